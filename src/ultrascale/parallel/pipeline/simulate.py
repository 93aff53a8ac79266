"""Play a schedule's action lists against per-action costs: the timeline, the bubble, the memory.

Every rank starts at time 0 and runs its actions in order. A compute action
starts when the rank is free and its inputs have arrived: a receive waits for
the matching send (plus `t_comm`); sends cost nothing on the sender (they are
asynchronous; so is posting a receive ahead, POST_B, which changes nothing here: a message
in flight is already modelled as travelling while its receiver computes). Costs: F = t_f,
I = t_b, W = t_w, and an unsplit B = t_b + t_w.
With chunks, the costs are those of one chunk.

The bubble ratio is the playbook's r_bubble: idle time over compute time of a
rank, (T - busy) / busy, T the time the last rank finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ultrascale.parallel.pipeline.partition import rank_of_stage
from ultrascale.parallel.pipeline.schedules import Action, stage_of

COMPUTE = ("F", "B", "I", "W")


def costs(t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> dict[str, float]:
    """Each compute action's cost: F = t_f, I = t_b, W = t_w, an unsplit B = t_b + t_w."""
    return {"F": t_f, "B": t_b + t_w, "I": t_b, "W": t_w}


UNIT_COSTS = costs()  # the simulator's defaults; the runtime's schedule clock runs at these


@dataclass
class Timeline:
    p: int
    v: int
    spans: list = field(default_factory=list)  # per rank: [(action, start, end)] for compute actions
    makespan: float = 0.0
    busy: list = field(default_factory=list)  # per rank: compute time
    peak_in_flight: list = field(default_factory=list)  # per rank: micro-batch activations held at once

    @property
    def bubble_ratio(self) -> float:
        return (self.makespan - max(self.busy)) / max(self.busy)

    @property
    def bubble_time(self) -> float:
        return self.makespan - max(self.busy)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward is done and whose activations are not yet freed:
    by B, or, when the backward is split, by W (the weight gradients need the layer inputs)."""
    held, peak = set(), 0
    for a in actions:
        if a.kind == "F":
            held.add((a.micro, a.chunk))
            peak = max(peak, len(held))
        elif a.kind in ("B", "W"):
            held.discard((a.micro, a.chunk))
    return peak


def simulate(actions: list[list[Action]], p: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0,
             t_w: float = 1.0, t_comm: float = 0.0, vshape: bool = False) -> Timeline:
    """vshape: the chunks sit in a V (DualPipeV), as with_communication was told."""
    cost = costs(t_f, t_b, t_w)
    sent: dict[tuple, float] = {}  # (kind, micro, virtual stage) -> time the message is available
    clock = [0.0] * p
    pos = [0] * p
    spans = [[] for _ in range(p)]
    busy = [0.0] * p
    while any(pos[r] < len(actions[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                stage = stage_of(r, a.chunk, p, vshape)
                if a.kind == "RECV_F":
                    key = ("F", a.micro, stage - 1)
                elif a.kind == "RECV_B":
                    key = ("B", a.micro, stage + 1)
                else:
                    key = None
                if a.kind == "POST_B":
                    pass
                elif key is not None:
                    if key not in sent:
                        break  # blocked until the sender gets there
                    clock[r] = max(clock[r], sent[key])
                elif a.kind in ("SEND_F", "SEND_B"):
                    dest = stage + 1 if a.kind == "SEND_F" else stage - 1
                    local = rank_of_stage(dest, p, vshape) == r  # the V's turn: no message
                    sent[(a.kind[-1], a.micro, stage)] = clock[r] + (0.0 if local else t_comm)
                else:
                    start = clock[r]
                    clock[r] += cost[a.kind]
                    busy[r] += cost[a.kind]
                    spans[r].append((a, start, clock[r]))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: actions[r][pos[r]] for r in range(p) if pos[r] < len(actions[r])}
            raise RuntimeError(f"the schedule deadlocks: ranks wait on {stuck}")
    tl = Timeline(p=p, v=v, spans=spans, makespan=max(clock), busy=busy)
    tl.peak_in_flight = [peak_in_flight([a for a, _, _ in s]) for s in spans]
    return tl
