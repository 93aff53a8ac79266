"""Find the best configuration: the playbook's three steps as a search.

1. Fit a training step in memory: enumerate every layout of the GPUs
   (dp·tp·pp·cp = gpus, ep carved out of dp; tp within a node and dividing the
   heads; pp within the layers; cp cutting the sequence into 2·cp chunks), every
   ZeRO stage, recomputation and pipeline schedule (interleaved with every chunk count that
   divides a stage's blocks; first and last stages one block lighter as in Llama 3), and drop
   what does not fit.
2. Reach the target global batch: micro_batch x grad_accum x dp sequences,
   with an integer number of accumulation steps.
3. Maximise throughput, as far as the time model can tell: the layouts predicted within its own
   error (error_band) of the fastest form one group it cannot order, ranked by memory headroom, then
   simplicity; the rest follow by predicted tokens/s/GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ultrascale.errors import ConfigError
from ultrascale.plan.layout import Layout, check_framework, check_layout
from ultrascale.plan.memory import MemoryPlan, fits, memory_plan
from ultrascale.plan.time import StepTime, step_time

SEARCH_SCHEDULES = ("1f1b", "interleaved", "zero-bubble", "dualpipev")  # AFAB: 1F1B's bubble with more memory, never better


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryPlan
    time: StepTime | None = None
    slower: float = 0.0  # predicted shortfall from the fastest layout of the search (a fraction, >= 0)
    top_group: bool = False  # within the time model's error of the fastest (search.rank)

    def as_dict(self) -> dict:
        out = {"layout": self.layout.to_dict(), "label": self.layout.label(), "memory": self.memory.as_dict()}
        if self.time is not None:
            out["time"] = self.time.as_dict()
            out["rank"] = {"top_group": self.top_group, "slower_than_fastest": self.slower}
        return out


@dataclass
class SearchResult:
    ranked: list = field(default_factory=list)  # fitting candidates in the planner's order (rank)
    enumerated: int = 0
    smallest: Candidate | None = None  # the smallest per-GPU footprint seen (fitting or not)
    band: float = 0.0  # the time model's error (error_band): the top group's width
    memory_error: float = 0.0  # the memory model's (memory_error): headroom below it counts as tight
    capacity: float = 0.0  # bytes per GPU

    @property
    def top_group(self) -> list:
        """The layouts the time model cannot order: the head of `ranked`."""
        return [c for c in self.ranked if c.top_group]

    @property
    def by_time(self) -> list:
        """The fitting candidates fastest predicted first (exact ties: the simpler first)."""
        return sorted(self.ranked, key=time_key)

    @property
    def fastest(self) -> Candidate | None:
        return min(self.ranked, key=time_key) if self.ranked else None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def batch_sequences(global_batch_tokens: int, seq_len: int) -> int:
    if global_batch_tokens <= 0 or seq_len <= 0:
        raise ConfigError(f"--global-batch-tokens and --seq-len must be positive, got {global_batch_tokens} "
                          f"and {seq_len}")
    if global_batch_tokens % seq_len:
        lo = global_batch_tokens // seq_len * seq_len
        raise ConfigError(f"--global-batch-tokens {global_batch_tokens} is not a whole number of {seq_len}-token "
                          f"sequences, so no integer accumulation reaches it: use a multiple of {seq_len} "
                          f"(e.g. {lo or seq_len} or {lo + seq_len})")
    return global_batch_tokens // seq_len


def check_cluster(gpus: int, gpu) -> None:
    if gpus <= 0:
        raise ConfigError(f"--gpus must be a positive integer, got {gpus}")
    if gpus > gpu.node_size and gpus % gpu.node_size:
        raise ConfigError(f"--gpus {gpus} spans several {gpu.node_size}-GPU nodes but is not a multiple of "
                          f"{gpu.node_size}: use whole nodes (e.g. {gpus // gpu.node_size * gpu.node_size} or "
                          f"{(gpus // gpu.node_size + 1) * gpu.node_size})")


def layouts(shape, gpus: int, gpu, seq_len: int, sequences: int, precision: str, fixed: dict):
    """Every valid layout reaching `sequences` per step; `fixed` pins any Layout field."""

    def allowed(name, values):
        return [fixed[name]] if fixed.get(name) is not None else values

    node = gpu.node_size
    tps = [t for t in divisors(gpus) if t <= node and node % t == 0 and shape.heads % t == 0
           and shape.kv_heads % t == 0]
    for tp in allowed("tp", tps):
        for cp in allowed("cp", [c for c in divisors(gpus // tp) if c & (c - 1) == 0 and seq_len % (2 * c) == 0]):
            for pp in allowed("pp", [p for p in divisors(gpus // (tp * cp)) if p <= shape.layers]):
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if fixed.get("dp") is not None and fixed["dp"] != dp:
                    continue
                if sequences % dp:
                    continue
                eps = [e for e in divisors(dp) if shape.is_moe and shape.experts % e == 0] or [1]
                for ep in allowed("ep", eps):
                    for mbs in allowed("micro_batch", divisors(sequences // dp)):
                        ga = sequences // (dp * mbs)
                        yield from _variants(shape, dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=mbs,
                                                         grad_accum=ga, seq_len=seq_len, precision=precision),
                                             fixed, allowed)


def chunk_counts(layers: int, pp: int) -> list[int]:
    """Interleaved chunk counts worth trying: every v >= 2 that divides a stage's blocks (the even
    split gives each stage layers // pp or one more), so each chunk holds as many blocks."""
    per_stage = {layers // pp, -(-layers // pp)}
    return sorted({v for n in per_stage for v in divisors(n) if v >= 2 and pp * v <= layers})


def _variants(shape, base, fixed, allowed):
    zeros = [z for z in (0, 1, 2, 3) if z == 0 or base["dp"] * base["cp"] > 1]
    if base["pp"] == 1:
        schedules = [("1f1b", 1)]
    else:
        schedules = [(s, 1) for s in SEARCH_SCHEDULES if s not in ("interleaved", "dualpipev")]
        if base["grad_accum"] >= 2 * base["pp"] and shape.layers >= 2 * base["pp"]:
            schedules.append(("dualpipev", 2))  # a V of two chunks per rank, filled by 2 x pp micro-batches
        if base["grad_accum"] % base["pp"] == 0:
            schedules += [("interleaved", v) for v in chunk_counts(shape.layers, base["pp"])]
    if fixed.get("schedule") is not None:
        schedules = [(fixed["schedule"], fixed.get("chunks")
                      or (2 if fixed["schedule"] in ("interleaved", "dualpipev") else 1))]
    elif (fixed.get("chunks") or 1) > 1:  # --chunks alone asks for the interleaved schedule
        schedules = [("interleaved", fixed["chunks"])] if base["pp"] > 1 else []
    ends = [(fixed.get("first_stage_layers") or 0, fixed.get("last_stage_layers") or 0)]
    if base["pp"] >= 3 and not any(ends[0]):
        # Llama 3's balance: one block fewer on the first stage (it also embeds, and holds the most
        # micro-batches in flight) and on the last (the head and the loss).
        fewer = -(-shape.layers // base["pp"]) - 1
        if fewer >= 1:
            ends.append((fewer, fewer))
    offload = fixed.get("offload") or "none"
    if offload != "none":  # offload moves ZeRO's shards: a stage of ZeRO is needed
        zeros = [z for z in zeros if z]
    for zero in allowed("zero", zeros):
        for recompute in allowed("recompute", ["none", "selective", "full"]):
            for schedule, chunks in schedules:
                for first, last in ends if chunks == 1 else ends[:1]:
                    yield Layout(**base, zero=zero, recompute=recompute, schedule=schedule, chunks=chunks,
                                 sp=fixed.get("sp", True), cp_attention=fixed.get("cp_attention") or "zigzag",
                                 first_stage_layers=first, last_stage_layers=last, offload=offload)


RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}
# Simpler first: one pipeline pass per micro-batch, then chunks (more point-to-point sends), then
# the split backward (B and W apart), then the bidirectional V.
SCHEDULE_ORDER = {"afab": 0, "1f1b": 0, "interleaved": 1, "zero-bubble": 2, "dualpipev": 3}


@functools.cache
def error_band() -> float:
    """The time model's error: the largest |predicted / published - 1| over the published throughput
    rows of plan/published.py, each planned with the framework and cluster it ran on (the `own` column
    of `ultrascale plan published`). A ranking compares layouts under one framework and cluster, so
    that column is the model's error for it; the tests hold every row within published.TOLERANCE."""
    from ultrascale.plan.published import table

    return max(abs(row["own_ratio"] - 1) for row in table() if row["set"] == "chosen on")


@functools.cache
def memory_error() -> float:
    """The memory model's error: the median |predicted - measured| / measured peak over the playbook's
    finished runs (`ultrascale plan validate`). Headroom differences below it are not told apart."""
    from ultrascale.plan.validate import load_rows, validate

    return validate(load_rows()[0])["median_memory_error"]


def simplicity_key(c: Candidate):
    """Simpler first: less model parallelism (tp·pp·cp·ep, the ranks one replica spans: a count of axes
    alone would call cp64 as simple as dp64), fewer parallel axes above 1 (dp, tp, pp, cp, ep), less
    recomputation (its cost is arithmetic, one more forward pass for full: a third more compute, not
    a guess of the model), a lower ZeRO stage, a simpler pipeline schedule with fewer chunks, the even stage split."""
    lay = c.layout
    axes = sum(n > 1 for n in (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep))
    uneven = bool(lay.first_stage_layers or lay.last_stage_layers)
    return (lay.tp * lay.pp * lay.cp * lay.ep, axes, RECOMPUTE_ORDER[lay.recompute], lay.zero,
            SCHEDULE_ORDER[lay.schedule], lay.chunks, uneven)


def time_key(c: Candidate):
    """Fastest predicted first; an exact tie goes to the simpler layout (then the label, for a fixed order)."""
    return (-c.time.tokens_per_s_per_gpu, simplicity_key(c), c.layout.label())


def headroom_key(c: Candidate, capacity: float, mem_error: float):
    """Layouts whose free memory exceeds the memory model's error (peak x mem_error) first, all alike;
    then the tighter ones, more free memory first: a GiB more headroom than the model can vouch for
    buys nothing, a GiB less may be an out-of-memory error."""
    free = capacity - c.memory.peak.total
    return (0, 0.0) if free >= mem_error * c.memory.peak.total else (1, -free)


def rank(cands: list, capacity: float, band: float, mem_error: float) -> list:
    """The planner's order. The layouts predicted within `band` (a fraction) of the fastest form the top
    group, which the time model cannot order: memory headroom first (see headroom_key), then simplicity,
    then the predicted speed. After the group, strictly by predicted throughput. Marks each candidate
    with `slower` (its predicted shortfall from the fastest, >= 0) and `top_group`."""
    by_time = sorted(cands, key=time_key)
    if not by_time:
        return []
    fastest = by_time[0].time.tokens_per_s_per_gpu
    for c in by_time:
        c.slower = 1 - c.time.tokens_per_s_per_gpu / fastest
        c.top_group = c.slower <= band
    group = sorted((c for c in by_time if c.top_group),
                   key=lambda c: (headroom_key(c, capacity, mem_error), simplicity_key(c), time_key(c)))
    return group + [c for c in by_time if not c.top_group]


def search(shape, gpus: int, gpu, fw, seq_len: int, global_batch_tokens: int, precision: str = "bf16",
           fixed: dict | None = None, with_time: bool = True, tightly: bool = False) -> SearchResult:
    """tightly: propose too the layouts that fit only tightly (memory.fits: the live tensors and the context
    fit, the allocator's planned cache beside them does not), as `ultrascale plan` does; without it a layout
    fits when its planned total does (the course's rule: memory per GPU <= the card)."""
    fixed = fixed or {}
    check_cluster(gpus, gpu)
    sequences = batch_sequences(global_batch_tokens, seq_len)
    result = SearchResult()
    # Offload trades step time for memory: proposed only where nothing fits without it (cpu first,
    # then disk), unless pinned.
    for offload in [fixed["offload"]] if fixed.get("offload") else ["none", "cpu", "disk"]:
        _search_tier(result, shape, gpus, gpu, fw, seq_len, sequences, precision, {**fixed, "offload": offload},
                     with_time, tightly)
        if result.ranked:
            break
    if with_time:
        result.band, result.memory_error, result.capacity = error_band(), memory_error(), gpu.memory_bytes
        result.ranked = rank(result.ranked, gpu.memory_bytes, result.band, result.memory_error)
    if result.enumerated == 0:
        pins = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in fixed.items() if v is not None)
        raise ConfigError(f"no layout of {gpus} GPUs reaches a batch of {sequences} sequences"
                          + (f" with {pins}" if pins else "") + ": change --gpus, the batch, or the pinned sizes")
    return result


def _search_tier(result, shape, gpus, gpu, fw, seq_len, sequences, precision, fixed, with_time, tightly) -> None:
    """Add the layouts with `fixed`'s offload tier to `result`: every one counted, the fitting ones timed."""
    for lay in layouts(shape, gpus, gpu, seq_len, sequences, precision, fixed):
        try:
            check_layout(lay, shape)
            check_framework(fw, lay.ep, lay.zero)
        except ConfigError:
            continue
        result.enumerated += 1
        mem = memory_plan(shape, lay, fw)
        cand = Candidate(lay, mem)
        if result.smallest is None or mem.peak.total < result.smallest.memory.peak.total:
            result.smallest = cand
        # Tightly: a layout whose live tensors and context fit is proposed even where the allocator's planned
        # slack does not fit beside them (memory.fits): Llama 3 405B trained so. headroom_key ranks such a
        # layout after every roomier one of its group.
        if (fits(mem, gpu) if tightly else mem.peak.total <= gpu.memory_bytes):
            if with_time:
                cand.time = step_time(shape, lay, gpu, fw)
            result.ranked.append(cand)


def gpus_needed(shape, gpus: int, gpu, fw, seq_len: int, global_batch_tokens: int, precision: str,
                fixed: dict | None = None, limit: int = 64) -> int | None:
    """The smallest GPU count (doubling from `gpus`, up to limit x) at which something fits."""
    n = gpus
    while n <= gpus * limit:
        n *= 2
        if n > gpu.node_size and n % gpu.node_size:
            continue
        memory_only = {**(fixed or {}), "recompute": "full"}
        try:
            found = search(shape, n, gpu, fw, seq_len, global_batch_tokens, precision, memory_only, with_time=False)
        except ConfigError:
            continue
        if found.ranked:
            return n
    return None
