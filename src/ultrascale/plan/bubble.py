"""Pipeline schedules: the bubble, and how many micro-batches a stage holds in flight.

Closed forms (the playbook's pipeline chapter; Narayanan et al. 2021 for the
interleaved schedule; Qi et al. 2023 for zero bubble), with p stages, m
micro-batches per optimizer step and v model chunks per rank:

  schedule     bubble / ideal time        activations held by stage i (micro-batches of a stage)
  afab         (p - 1) / m                m
  1f1b         (p - 1) / m                min(p - i, m)
  interleaved  (p - 1) / (v·m)            min(2(p - i - 1) + (v - 1)p + 1, v·m) chunks, / v
  zero-bubble  (p - 1 + max(0, p - m))    min(p - i, m)
               / (3m)
  dualpipev    (p - 1) / (6m)             (2p - i) chunks of the first, i + 1 of the second,
                                          / 2: p + 1/2 on every rank (m >= 2p)

ZB-H1 splits the backward into I (input gradient) and W (weight gradient): a third of
1F1B's bubble once m >= p. DualPipeV (DeepSeek's DualPipe cut in half) holds two
chunks per rank in a V and pairs forwards with backwards: p - 1 idle chunk slots of
6m, half ZB-H1's bubble on the same ranks, for p + 1/2 stages' worth of activations
on every rank instead of 1F1B's p - i, and one copy of the weights (full DualPipe,
not modelled, keeps two: stage i and stage p - 1 - i on every rank).
Every entry equals what the engine's own schedules give
(ultrascale.parallel.pipeline: the action lists played by its simulator at unit costs
F = I = W, and the micro-batches held between a forward and its B or I) for the p, m, v
each schedule accepts (tests/test_plan.py).

The closed forms stay the planner's source: they cost nothing where a simulation of
p = 64, m = 256 takes a second, and the search asks thousands of times. The seam: a
schedule is any object with `bubble_fraction(p, m, v)` and `in_flight(p, m, v, stage)`
(and optionally `held_per_chunk`); `use_schedule(name, model)` swaps one in, e.g. the
simulator played with measured, unequal F / I / W costs.
"""

from __future__ import annotations

import functools

from typing import Protocol


class ScheduleModel(Protocol):
    def bubble_fraction(self, p: int, m: int, v: int) -> float: ...

    def in_flight(self, p: int, m: int, v: int, stage: int) -> float: ...


class AllForwardAllBackward:
    def bubble_fraction(self, p, m, v):
        return (p - 1) / m

    def in_flight(self, p, m, v, stage):
        return m


class OneForwardOneBackward:
    def bubble_fraction(self, p, m, v):
        return (p - 1) / m

    def in_flight(self, p, m, v, stage):
        return min(p - stage, m)


class Interleaved:
    def bubble_fraction(self, p, m, v):
        return (p - 1) / (v * m)

    def in_flight(self, p, m, v, stage):
        return sum(self.held_per_chunk(p, m, v, stage)) / v

    def held_per_chunk(self, p, m, v, stage):
        # Megatron's warm-up count for rank `stage`, plus the chunk in its steady 1F1B. Forwards go
        # p micro-batches of chunk 0, then p of chunk 1, ...: forward slot k is chunk (k // p) % v.
        slots = min(2 * (p - stage - 1) + (v - 1) * p + 1, v * m)
        held = [0] * v
        for k in range(slots):
            held[(k // p) % v] += 1
        return held


class ZeroBubbleH1:
    def bubble_fraction(self, p, m, v):
        # With fewer micro-batches than stages the weight passes cannot fill the ramp: p - m more idle slots.
        return (p - 1 + max(0, p - m)) / (3 * m)

    def in_flight(self, p, m, v, stage):
        return min(p - stage, m)


class DualPipeV:
    def bubble_fraction(self, p, m, v):
        # p - 1 idle chunk slots (F = I = W = 1) against 2m chunks x 3 slots of work.
        return (p - 1) / (6 * m)

    def in_flight(self, p, m, v, stage):
        return sum(self.held_per_chunk(p, m, v, stage)) / 2

    def held_per_chunk(self, p, m, v, stage):
        # Rank i's peak: 2p - i micro-batches on the way down (chunk 0), i + 1 on the way back up.
        return [2 * p - stage, stage + 1]


SCHEDULES: dict[str, ScheduleModel] = {
    "afab": AllForwardAllBackward(),
    "1f1b": OneForwardOneBackward(),
    "interleaved": Interleaved(),
    "zero-bubble": ZeroBubbleH1(),
    "dualpipev": DualPipeV(),
}


def use_schedule(name: str, model: ScheduleModel) -> None:
    """Replace the closed form of `name` (e.g. by a schedule simulator)."""
    SCHEDULES[name] = model


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    return 0.0 if p == 1 else SCHEDULES[schedule].bubble_fraction(p, m, v)


def in_flight(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Micro-batches' worth of a stage's activations alive at the stage's peak (1 without a pipeline)."""
    return 1.0 if p == 1 else _in_flight(SCHEDULES[schedule], p, m, v, stage)


def held_per_chunk(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> tuple[float, ...]:
    """Micro-batches held at the peak by each of the stage's v chunks (a schedule without its own
    split holds the same number of each)."""
    return _held_per_chunk(SCHEDULES[schedule], p, m, v, stage)


# Cached by the schedule's model itself, so that use_schedule's replacement is asked afresh.
@functools.lru_cache(maxsize=65536)
def _in_flight(model, p: int, m: int, v: int, stage: int) -> float:
    return model.in_flight(p, m, v, stage)


@functools.lru_cache(maxsize=65536)
def _held_per_chunk(model, p: int, m: int, v: int, stage: int) -> tuple[float, ...]:
    if p > 1 and hasattr(model, "held_per_chunk"):
        return tuple(model.held_per_chunk(p, m, v, stage))
    return (1.0 if p == 1 else model.in_flight(p, m, v, stage),) * v
