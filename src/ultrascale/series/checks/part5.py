"""Checks of Part 5: the global batch size, GBS = MBS x GA x DP.

exercise_1(grad_accum_steps)  the accumulation steps of a token budget, refusing a batch that is
                              not whole sequences, not whole steps, or smaller than the GPUs.
exercise_2(choose_layout)     (mbs, ga, dp) for a token budget on N GPUs by the stated rule,
                              compared with the planner's choice (ultrascale.plan.search,
                              restricted to data parallelism: tp = pp = cp = 1, ZeRO-3).

Both refuse with ValueError only a batch that breaks a rule: a refusal of one that splits (an
off-by-one, <= for <) and a refusal said another way (an assert) are each named. The planner's
answers are pure functions of their arguments and cached: a notebook that checks again, and the
answers in tests/course, search once per case.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ultrascale.series.checks import require_finite

FOUR_M = 4 * 2**20


# ---- exercise 1 ---------------------------------------------------------------------------------

def _refuses(fn, *args) -> bool:
    """Whether fn(*args) raises ValueError; another exception is a refusal said the wrong way."""
    try:
        fn(*args)
    except ValueError:
        return True
    except Exception as e:  # noqa: BLE001 - whatever the learner raised instead, named
        said = f" ({e})" if str(e) else ""
        raise AssertionError(
            f"{fn.__name__}{args} raised {type(e).__name__}{said}: raise ValueError, not {type(e).__name__}. "
            f"A batch that does not split is a bad argument, and ValueError is what a caller catches for it "
            f"(an assert is for bugs in your own code, and python -O removes it)") from None
    return False


def _accepts(fn, args, why: str):
    """fn(*args) for arguments that break no rule: a ValueError here refuses a batch that splits."""
    try:
        return fn(*args)
    except ValueError as e:
        raise AssertionError(f"{fn.__name__}{args} raised ValueError ({e}), yet {why}: refuse only a batch that "
                             f"breaks a rule (an off-by-one in a comparison? <= where < was meant)") from None


def _steps(gbs_tokens, seq_len, mbs, dp) -> str:
    sequences = gbs_tokens // seq_len
    steps = sequences // (mbs * dp)
    return (f"{gbs_tokens:,} tokens are {sequences} sequences, exactly {steps} step{'s' if steps > 1 else ''} "
            f"of MBS {mbs} x DP {dp}")


def exercise_1(grad_accum_steps):
    got = _accepts(grad_accum_steps, (FOUR_M, 4096, 2, 128), _steps(FOUR_M, 4096, 2, 128))
    require_finite(got, "grad_accum_steps(4194304, 4096, 2, 128)")
    if got == FOUR_M // (2 * 128):
        raise AssertionError(f"you returned {got}: that divides tokens, not sequences - first turn the "
                             f"{FOUR_M:,} tokens into {FOUR_M // 4096} sequences of 4096 tokens, then divide by "
                             f"MBS x DP")
    sequences = FOUR_M // 4096
    if got == sequences // 2:
        raise AssertionError(f"you returned {got} = {sequences} sequences / MBS 2: every one of the 128 data-parallel "
                             f"replicas takes a micro-batch each step, so a step consumes MBS x DP = 256 sequences; "
                             f"divide by MBS x DP")
    if got == sequences // 128:
        raise AssertionError(f"you returned {got} = {sequences} sequences / DP 128: each of them takes a micro-batch "
                             f"of 2 sequences per step, so a step consumes MBS x DP = 256 sequences; divide by MBS x DP")
    if got == sequences:
        raise AssertionError(f"you returned {got}, the number of sequences in the batch: the accumulation steps are "
                             f"that divided by the sequences one step consumes, MBS x DP")
    assert got == 4, f"4,194,304 tokens / 4096 = 1024 samples; 1024 / (2 x 128) = 4 steps, but you returned {got!r}"
    assert type(got) is int, f"return an int (4), not {type(got).__name__} ({got!r})"
    for args, want in (((FOUR_M, 4096, 2, 512), 1), ((FOUR_M, 4096, 1, 128), 8), ((FOUR_M, 2048, 2, 128), 8),
                       ((3 * 2**20, 4096, 3, 64), 4)):
        got = _accepts(grad_accum_steps, args, _steps(*args))
        require_finite(got, f"grad_accum_steps{args}")
        assert got == want and type(got) is int, f"grad_accum_steps{args} should be the int {want}, got {got!r}"
    # Each refusal below breaks exactly one rule, so an answer that checks another rule cannot pass it.
    assert _refuses(grad_accum_steps, FOUR_M, 4096, 2, 1024), (
        "4,194,304 tokens = 1024 sequences, MBS 2 on 1024 GPUs is GA = 0.5: raise ValueError - there are more GPUs "
        "than the batch can feed (GA must be at least 1)")
    assert _refuses(grad_accum_steps, 4096 * 1000, 4096, 2, 128), (
        "4,096,000 tokens are exactly 1000 sequences, and 1000 / (2 x 128) = 3.906: raise ValueError - not a "
        "whole number of accumulation steps (floor or round would silently train on another batch size)")
    assert _refuses(grad_accum_steps, FOUR_M + 2048, 4096, 2, 128), (
        "4,196,352 tokens are 1024.5 sequences of 4096 tokens, yet 1024 whole sequences would give GA = 4: raise "
        "ValueError when the tokens are not a whole number of sequences (gbs_tokens % seq_len != 0) - floor "
        "division drops the half sequence without a word")


# ---- exercise 2 ---------------------------------------------------------------------------------

PINNED = {"tp": 1, "pp": 1, "cp": 1, "zero": 3, "recompute": "none"}  # 1-D: data parallelism (ZeRO-3) only

# (model, GPU, tokens per step, sequence length, GPUs)
CASES = [
    ("llama3-8b", "h100-80gb", FOUR_M, 4096, 128),
    ("llama3-8b", "h200", FOUR_M, 4096, 128),
    ("llama3-8b", "h100-80gb", FOUR_M, 4096, 512),
    ("llama3-8b", "h200", 3 * 2**20, 4096, 128),
    ("smollm-1.7b", "h100-80gb", 2**20, 2048, 32),
    ("smollm-1.7b", "h100-80gb", 3 * 2**19, 2048, 64),
    ("llama3-8b", "h100-80gb", FOUR_M, 4096, 1024),  # one sequence per GPU: MBS 1, GA 1
]
REFUSED = [
    ("llama3-8b", "h100-80gb", FOUR_M, 4096, 2048, "1024 sequences cannot give each of 2048 GPUs a micro-batch"),
    ("llama3-8b", "h100-80gb", 4096 * 1000, 4096, 128, "1000 sequences do not split evenly over 128 GPUs"),
]


def _planner():
    from ultrascale.plan.calibration import get_framework

    return replace(get_framework("playbook"), partition="even")


@functools.lru_cache(maxsize=None)
def largest_fitting_micro_batch(model: str, gpu_name: str, gpus: int, seq_len: int) -> int:
    """The largest micro-batch whose peak memory fits the GPU, by the planner's memory model
    (data parallelism over `gpus` GPUs with ZeRO-3, no recomputation)."""
    from ultrascale.plan.hardware import playbook_cluster
    from ultrascale.plan.layout import Layout
    from ultrascale.plan.memory import memory_plan
    from ultrascale.plan.shape import get_shape

    shape, gpu, fw = get_shape(model), playbook_cluster(gpu_name), _planner()
    m = 0
    while memory_plan(shape, Layout(dp=gpus, zero=3, micro_batch=m + 1, seq_len=seq_len), fw).peak.total \
            <= gpu.memory_bytes:
        m += 1
    return m


@functools.lru_cache(maxsize=None)
def planner_choice(model: str, gpu_name: str, tokens: int, seq_len: int, gpus: int):
    """(mbs, ga, dp) of the planner's fastest 1-D layout, or None when no layout reaches the batch."""
    from ultrascale.errors import ConfigError
    from ultrascale.plan.hardware import playbook_cluster
    from ultrascale.plan.search import search
    from ultrascale.plan.shape import get_shape

    try:
        found = search(get_shape(model), gpus, playbook_cluster(gpu_name), _planner(), seq_len, tokens,
                       "bf16", PINNED)
    except ConfigError:
        return None
    if not found.ranked:
        return None
    lay = found.by_time[0].layout
    return lay.micro_batch, lay.grad_accum, lay.dp


def exercise_2(choose_layout):
    lines = []
    for model, gpu, tokens, seq_len, gpus in CASES:
        max_mbs = largest_fitting_micro_batch(model, gpu, gpus, seq_len)
        want = planner_choice(model, gpu, tokens, seq_len, gpus)
        call = f"choose_layout({tokens:,}, {seq_len}, {gpus}, max_mbs={max_mbs})"
        got = _accepts(choose_layout, (tokens, seq_len, gpus, max_mbs),
                       f"its {tokens // seq_len} sequences split evenly over the {gpus} GPUs")
        require_finite(got, f"what {call} returned")
        assert isinstance(got, tuple) and len(got) == 3 and all(type(v) is int for v in got), (
            f"{call} returned {got!r}: return a tuple of three ints (mbs, ga, dp)")
        mbs, ga, dp = got
        if want is not None and got != want and (ga, mbs, dp) == want:
            raise AssertionError(f"{call} returned {got}: that is the planner's choice in the order (ga, mbs, dp). "
                                 f"Return (mbs, ga, dp): the micro-batch first, then the accumulation steps")
        sequences = tokens // seq_len
        assert mbs * ga * dp == sequences, (
            f"{call} returned mbs {mbs} x ga {ga} x dp {dp} = {mbs * ga * dp} sequences, but the batch is "
            f"{sequences} sequences ({tokens:,} / {seq_len}): mbs must divide the {sequences // gpus} sequences each "
            f"GPU gets, and ga = sequences / (mbs x dp)")
        assert mbs <= max_mbs, f"{call}: a micro-batch of {mbs} does not fit in memory; at most {max_mbs} does"
        assert dp == gpus, (f"{call} returned dp {dp} on {gpus} GPUs: in 1-D parallelism every GPU holds one "
                            f"data-parallel replica, so dp = gpus = {gpus}; "
                            + ("more replicas than GPUs do not exist" if dp > gpus else "fewer leave GPUs idle"))
        assert got == want, (
            f"{call} returned (mbs, ga, dp) = {got}, the planner picks {want}: take the largest micro-batch that "
            f"fits and divides the {sequences // gpus} sequences per GPU - fewer, larger micro-batches keep the GPU "
            f"busier per step (the planner predicts more tokens/s)")
        lines.append(f"  {model} on {gpus} x {gpu}, {tokens:,} tokens of {seq_len}: (mbs, ga, dp) = {got}")
    for model, gpu, tokens, seq_len, gpus, why in REFUSED:
        assert planner_choice(model, gpu, tokens, seq_len, gpus) is None  # the planner finds no layout either
        if _refuses(choose_layout, tokens, seq_len, gpus, 2):
            continue
        got = choose_layout(tokens, seq_len, gpus, 2)
        raise AssertionError(f"choose_layout({tokens:,}, {seq_len}, {gpus}, max_mbs=2) returned {got!r}: raise "
                             f"ValueError - {why} (the planner finds no layout either)")
    print("Same choice as the planner in every case:\n" + "\n".join(lines))
