"""Pipeline schedules as data: for every rank, the ordered list of what it does.

A schedule is a pure function of (p ranks, m micro-batches, v chunks per rank)
that returns one list of `Action`s per rank. The same lists are drawn, simulated
(simulate.py) and executed (runtime.py), so what you see is what runs.

Virtual stages: with v chunks per rank, the model is cut into p*v pieces; chunk
c of rank r is virtual stage c*p + r (Megatron's interleaving), so activations
go rank 0 -> 1 -> ... -> p-1 -> 0 (next chunk) -> ... With v = 1 a rank is a stage.

Compute actions: F (forward), B (full backward), or B split into I (gradient of
the input, which the previous stage waits for) and W (gradient of the weights,
which nobody waits for: zero-bubble schedules move it into the bubbles).
Communication actions, inserted by `with_communication`: RECV_F before a forward
that does not start the model, SEND_F after one that does not end it; RECV_B /
SEND_B likewise for the input gradient. Sends are asynchronous, receives wait.
"""

from __future__ import annotations

from typing import NamedTuple

from ultrascale.config import PP_SCHEDULES

SCHEDULES = PP_SCHEDULES  # the names the configuration accepts, each built below


class Action(NamedTuple):
    kind: str  # F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B
    micro: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, p: int) -> int:
    return chunk * p + rank


def naive(p: int, m: int, rank: int) -> list[Action]:
    """One micro-batch at a time through the whole pipeline: every other stage idles."""
    return [a for k in range(m) for a in (Action("F", k), Action("B", k))]


def afab(p: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (GPipe): bubble (p-1)/m, but m activations in flight."""
    return [Action("F", k) for k in range(m)] + [Action("B", k) for k in range(m)]


def one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """1F1B: p-1-rank warm-up forwards, then alternate one forward and one backward.
    Same bubble as AFAB, but at most p - rank micro-batches in flight instead of m."""
    warmup = min(p - 1 - rank, m)
    acts = [Action("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        acts += [Action("F", warmup + k), Action("B", k)]
    return acts + [Action("B", k) for k in range(m - warmup, m)]


def zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023): 1F1B with each backward split into I and W.

    The previous stage waits only for I, so the backward chain carries t_b
    instead of t_b + t_w, and W passes fill the time a rank would otherwise wait.
    The order is found by playing the pipeline with unit costs: at each tick an
    idle rank runs, by priority, a W if p-1 are already waiting, else an I whose
    gradient has arrived, else a forward (at most p - rank micro-batches between
    their forward and their I, as in 1F1B), else a waiting W.
    Bubble (p-1)(t_f + t_b - t_w): a third of 1F1B's when all are equal (m >= p).
    Memory: full activations for at most p - rank micro-batches, as 1F1B, plus the
    layer inputs that at most p-1 waiting W passes still need.
    """
    done: dict[tuple, int] = {}  # (kind, micro, rank) -> tick it finished
    acts = [[] for _ in range(p)]
    next_f, next_i, waiting_w = [0] * p, [0] * p, [[] for _ in range(p)]
    tick = 0
    while any(len(a) < 3 * m for a in acts):
        for r in range(p):
            def ready(kind, k, src):
                return done.get((kind, k, src), tick + 1) <= tick

            k_i, k_f = next_i[r], next_f[r]
            if len(waiting_w[r]) > p - 1:
                a = Action("W", waiting_w[r].pop(0))  # at most p-1 W passes wait on a rank
            elif k_i < k_f and (ready("I", k_i, r + 1) if r < p - 1 else ready("F", k_i, r)):
                a, next_i[r] = Action("I", k_i), k_i + 1
                waiting_w[r].append(k_i)
            elif k_f < m and k_f - k_i < p - r and (r == 0 or ready("F", k_f, r - 1)):
                a, next_f[r] = Action("F", k_f), k_f + 1
            elif waiting_w[r]:
                a = Action("W", waiting_w[r].pop(0))
            else:
                continue
            acts[r].append(a)
            done[(a.kind, a.micro, r)] = tick + 1
        tick += 1
    return acts


def interleaved(p: int, m: int, rank: int, v: int) -> list[Action]:
    """Interleaved 1F1B (Megatron, Narayanan et al. 2021): v chunks per rank, bubble
    (p-1)/(v*m), paid for with v times more point-to-point messages. Micro-batches go
    through the chunks in groups of p; needs m to be a multiple of p."""
    total = m * v

    def forward_step(k):
        group, within = divmod(k, p * v)
        return Action("F", group * p + within % p, within // p)

    def backward_step(k):
        group, within = divmod(k, p * v)
        return Action("B", group * p + within % p, v - 1 - within // p)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    acts = [forward_step(k) for k in range(warmup)]
    for k in range(total - warmup):
        acts += [forward_step(warmup + k), backward_step(k)]
    return acts + [backward_step(k) for k in range(total - warmup, total)]


def build(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Compute actions per rank (no communication), checked for a valid (p, m, v)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError("pipeline size, micro-batches and chunks must be positive")
    if v > 1 and name != "interleaved":
        raise ValueError(f"--pp-chunks {v} needs the interleaved schedule")
    if name == "interleaved":
        if m % p:
            raise ValueError(f"the interleaved schedule takes micro-batches in groups of pp = {p}: "
                             f"{m} micro-batches is not a multiple")
        return [interleaved(p, m, r, v) for r in range(p)]
    if name == "zero-bubble":
        return zero_bubble_h1(p, m)
    fn = {"naive": naive, "afab": afab, "1f1b": one_f_one_b}[name]
    return [fn(p, m, r) for r in range(p)]


def with_communication(actions: list[list[Action]], p: int, v: int) -> list[list[Action]]:
    """Insert the sends and receives each compute action needs."""
    last = p * v - 1
    out = []
    for rank, acts in enumerate(actions):
        seq = []
        for a in acts:
            stage = stage_of(rank, a.chunk, p)
            if a.kind == "F":
                seq += [Action("RECV_F", a.micro, a.chunk)] if stage > 0 else []
                seq.append(a)
                seq += [Action("SEND_F", a.micro, a.chunk)] if stage < last else []
            elif a.kind in ("B", "I"):
                seq += [Action("RECV_B", a.micro, a.chunk)] if stage < last else []
                seq.append(a)
                seq += [Action("SEND_B", a.micro, a.chunk)] if stage > 0 else []
            else:
                seq.append(a)
        out.append(seq)
    return out


def schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """The full action lists, communication included, one per rank."""
    return with_communication(build(name, p, m, v), p, v)
