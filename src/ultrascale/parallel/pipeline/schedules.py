"""Pipeline schedules as data: for every rank, the ordered list of what it does.

A schedule is a pure function of (p ranks, m micro-batches, v chunks per rank)
that returns one list of `Action`s per rank. The same lists are drawn, simulated
(simulate.py) and executed (runtime.py), so what you see is what runs.

Virtual stages: with v chunks per rank, the model is cut into p*v pieces; chunk
c of rank r is virtual stage c*p + r (Megatron's interleaving), so activations
go rank 0 -> 1 -> ... -> p-1 -> 0 (next chunk) -> ... With v = 1 a rank is a stage.
DualPipeV's two chunks sit in a V (partition.virtual_stages): chunk 0 of rank r
is stage r, chunk 1 is stage 2p-1-r, so activations go 0 -> ... -> p-1, turn
inside rank p-1, and come back p-1 -> ... -> 0, where the loss is.

Compute actions: F (forward), B (full backward), or B split into I (gradient of
the input, which the previous stage waits for) and W (gradient of the weights,
which nobody waits for: zero-bubble schedules move it into the bubbles).
Communication actions, inserted by `with_communication`: RECV_F before a forward
that does not start the model, SEND_F after one that does not end it; RECV_B /
SEND_B likewise for the input gradient. Sends are asynchronous, receives wait.
DualPipe's overlapped pairs add POST_B: the paired backward's gradient receive is
posted before the forward runs, so it travels while the forward computes and its
RECV_B only waits for what has (usually) arrived.
"""

from __future__ import annotations

from typing import NamedTuple

from ultrascale.config import PP_SCHEDULE_ALIASES, PP_SCHEDULES
from ultrascale.parallel.pipeline.partition import rank_of_stage, v_shaped

SCHEDULES = PP_SCHEDULES  # the names the configuration accepts, each built below


class Action(NamedTuple):
    kind: str  # F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, POST_B
    micro: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, p: int, vshape: bool = False) -> int:
    return 2 * p - 1 - rank if vshape and chunk == 1 else chunk * p + rank


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


def dualpipe_v(p: int, m: int, rank: int) -> list[Action]:
    """DualPipeV (DeepSeek's DualPipe cut in half, Sea AI Lab 2025): two chunks per rank in a V,
    chunk 0 going down the ranks and chunk 1 coming back up; m >= 2p micro-batches.

    The phases and their counts are those of the reference schedule (deepseek-ai/DualPipe,
    dualpipev.py), written here as actions like the other schedules. Its steady
    state (phase 4) pairs the forward of one micro-batch on one chunk with the
    backward of another on the other chunk (F0 with B1, then F1 with B0): on a GPU
    the pair runs as one overlapped step, each one's communication hidden behind
    the other's compute. Around it, backwards are split into I and W where a W can
    fill a wait (phases 3, 6, 7, 8), the weight gradients taken first in, first out.
    Bubble (p-1)(F&B + B - 3W) for 2p stages, F&B the time of one overlapped pair,
    where 1F1B on the same 2p stages (two ranks' worth) pays (2p-1)(F + B).
    """
    acts: list[Action] = []
    f, b, waiting_w = [0, 0], [0, 0], []

    def forward(c):
        acts.append(Action("F", f[c], c))
        f[c] += 1

    def backward(c, split=False):
        k = b[c]
        b[c] += 1
        acts.append(Action("I" if split else "B", k, c))
        if split:
            waiting_w.append((k, c))

    def weight():
        acts.append(Action("W", *waiting_w.pop(0)))

    for _ in range(2 * (p - rank - 1)):  # 1: the forward chunk fills the V's left arm
        forward(0)
    for _ in range(rank + 1):  # 2: forwards on both arms
        forward(0)
        forward(1)
    for _ in range(p - rank - 1):  # 3: the first backwards, their W at once
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(m - 2 * p + rank + 1):  # 4: the steady state, forward and backward in pairs
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - rank - 1):  # 5: the right arm's last forwards
        backward(1)
        forward(1)
        backward(0)
    split, n = False, rank + 1
    for i in range(n):  # 6: backwards only; the second half leaves W for later
        split = split or (i == n // 2 and rank % 2 == 1)
        backward(1, split)
        split = split or (i == n // 2 and rank % 2 == 0)
        backward(0, split)
    for _ in range(p - rank - 1):  # 7: a W in each wait for the next gradient
        weight()
        backward(0, split=True)
    while waiting_w:  # 8: the remaining W (rank + 1 of them)
        weight()
    return acts


def build(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Compute actions per rank (no communication), checked for a valid (p, m, v)."""
    name = PP_SCHEDULE_ALIASES.get(name, name)
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError("pipeline size, micro-batches and chunks must be positive")
    if name == "dualpipev":
        if v not in (1, 2):
            raise ValueError(f"the dualpipev schedule holds exactly 2 chunks per rank, got --chunks {v}")
        if m < 2 * p:
            raise ValueError(f"the dualpipev schedule needs at least 2 x pp = {2 * p} micro-batches, got {m}")
        return [dualpipe_v(p, m, r) for r in range(p)]
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


def chunks_of(name: str, v: int = 1) -> int:
    """Model chunks per rank: v, or the two of DualPipeV's V."""
    return 2 if v_shaped(PP_SCHEDULE_ALIASES.get(name, name)) else v


def overlapped_pairs(acts: list[Action]) -> list[tuple[int, int]]:
    """(forward, backward) indices of the pairs DualPipe overlaps: a full B of one chunk straight
    after an F of the other, micro-batches apart (dualpipe_v's phases 4 and 5). On a GPU the two
    run as one overlapped step; here each one's communication travels while the other computes."""
    return [(i, i + 1) for i, (a, b) in enumerate(zip(acts, acts[1:]))
            if a.kind == "F" and b.kind == "B" and a.chunk != b.chunk]


def with_communication(actions: list[list[Action]], p: int, v: int, vshape: bool = False) -> list[list[Action]]:
    """Insert the sends and receives each compute action needs (in a V, the turn from stage
    p-1 to stage p is a send and a receive on the same rank: a hand-off, no message). In a V,
    an overlapped pair's backward has its gradient receive posted (POST_B) before the forward."""
    last = p * v - 1
    out = []
    for rank, acts in enumerate(actions):
        seq = []
        ahead = {f: acts[b] for f, b in overlapped_pairs(acts)} if vshape else {}
        for i, a in enumerate(acts):
            stage = stage_of(rank, a.chunk, p, vshape)
            if i in ahead:  # the paired B's gradient comes from another rank: post its receive first
                b = ahead[i]
                b_stage = stage_of(rank, b.chunk, p, vshape)
                if b_stage < last and rank_of_stage(b_stage + 1, p, vshape) != rank:
                    seq.append(Action("POST_B", b.micro, b.chunk))
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
    name = PP_SCHEDULE_ALIASES.get(name, name)
    return with_communication(build(name, p, m, v), p, chunks_of(name, v), v_shaped(name))
