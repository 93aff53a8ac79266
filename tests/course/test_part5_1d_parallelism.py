"""Part 5's answers: the accumulation steps of a token budget, and (mbs, ga, dp) chosen like the planner."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 5

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "returns a float", "return an int", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    return gbs_tokens / seq_len / (mbs * dp)
'''),
    (1, "never refuses", "more GPUs than the batch can feed", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    return gbs_tokens // seq_len // (mbs * dp)
'''),
    (1, "floors the accumulation steps", "not a whole number of accumulation steps", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    if gbs_tokens % seq_len:
        raise ValueError("not whole sequences")
    ga = gbs_tokens // seq_len // (mbs * dp)
    if ga < 1:
        raise ValueError("more GPUs than samples")
    return ga
'''),
    (1, "never checks whole sequences", "not a whole number of sequences (gbs_tokens % seq_len != 0)", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    samples = gbs_tokens // seq_len
    per_step = mbs * dp
    if samples < per_step:
        raise ValueError("more GPUs than the batch can feed")
    if samples % per_step:
        raise ValueError("not a whole number of accumulation steps")
    return samples // per_step
'''),
    (1, "counts tokens as samples", "first turn the 4,194,304 tokens into 1024 sequences", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    return gbs_tokens // (mbs * dp)
'''),
    (1, "forgets the DP replicas", "every one of the 128 data-parallel replicas", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    if gbs_tokens % seq_len:
        raise ValueError("not whole sequences")
    samples = gbs_tokens // seq_len
    if samples % mbs:
        raise ValueError("not whole micro-batches")
    return samples // mbs  # micro-batches per step
'''),
    (1, "forgets the micro-batch size", "each of them takes a micro-batch of 2 sequences", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    if gbs_tokens % seq_len:
        raise ValueError("not whole sequences")
    samples = gbs_tokens // seq_len
    if samples < dp or samples % dp:
        raise ValueError("does not split over the GPUs")
    return samples // dp
'''),
    (1, "refuses a batch of exactly one step", "yet 4,194,304 tokens are 1024 sequences, exactly 1 step", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    if gbs_tokens % seq_len:
        raise ValueError("not whole sequences")
    samples = gbs_tokens // seq_len
    if samples <= mbs * dp:
        raise ValueError("more GPUs than the batch can feed")
    if samples % (mbs * dp):
        raise ValueError("not whole steps")
    return samples // (mbs * dp)
'''),
    (1, "refuses with assert", "raise ValueError, not AssertionError", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    assert gbs_tokens % seq_len == 0, "not whole sequences"
    samples = gbs_tokens // seq_len
    assert samples >= mbs * dp, "more GPUs than samples"
    assert samples % (mbs * dp) == 0, "not whole steps"
    return samples // (mbs * dp)
'''),
    (1, "NaN for 'no whole steps', the test reversed", "a NaN or an infinity in grad_accum_steps", '''
import math

def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    if gbs_tokens % seq_len:
        raise ValueError("not whole sequences")
    samples, per_step = gbs_tokens // seq_len, mbs * dp
    if samples < per_step:
        raise ValueError("more GPUs than samples")
    if per_step % samples:  # meant samples % per_step
        return math.nan     # no whole number of steps
    return samples // per_step
'''),
    (2, "takes max_mbs as it is", "mbs must divide the 6 sequences each GPU gets", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    if sequences < gpus or sequences % gpus:
        raise ValueError("does not split")
    return max_mbs, sequences // (max_mbs * gpus), gpus
'''),
    (2, "always MBS 1", "the planner picks (2, 4, 128)", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    if sequences < gpus or sequences % gpus:
        raise ValueError("does not split")
    return 1, sequences // gpus, gpus
'''),
    (2, "ignores what fits in memory", "does not fit in memory", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    if sequences < gpus or sequences % gpus:
        raise ValueError("does not split")
    per_gpu = sequences // gpus
    return per_gpu, 1, gpus  # the whole share in one micro-batch: no accumulation
'''),
    (2, "returns (ga, mbs, dp)", "in the order (ga, mbs, dp)", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    if sequences < gpus or sequences % gpus:
        raise ValueError("does not split")
    per_gpu = sequences // gpus
    mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)
    return per_gpu // mbs, mbs, gpus
'''),
    (2, "refuses when each GPU gets one micro-batch", "yet its 1024 sequences split evenly over the 1024 GPUs", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    if sequences <= gpus or sequences % gpus:
        raise ValueError("does not split")
    per_gpu = sequences // gpus
    mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)
    return mbs, per_gpu // mbs, gpus
'''),
    (2, "returns a list", "return a tuple of three ints", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    if sequences < gpus or sequences % gpus:
        raise ValueError("does not split")
    per_gpu = sequences // gpus
    mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)
    return [mbs, per_gpu // mbs, gpus]
'''),
    (2, "more replicas than GPUs", "returned dp 512 on 128 GPUs", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    if sequences < gpus or sequences % gpus:
        raise ValueError("does not split")
    per_gpu = sequences // gpus
    mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)
    return mbs, 1, sequences // mbs
'''),
    (2, "never refuses a batch too small", "raise ValueError - 1024 sequences cannot give each of 2048 GPUs", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    per_gpu = max(sequences // gpus, 1)
    mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)
    return mbs, per_gpu // mbs, gpus
'''),
    (2, "never refuses an uneven split", "1000 sequences do not split evenly over 128 GPUs", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    if sequences < gpus:
        raise ValueError("fewer sequences than GPUs")
    per_gpu = sequences // gpus
    mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)
    return mbs, per_gpu // mbs, gpus
'''),
    (2, "an infinite 'best so far' never replaced", "a NaN or an infinity in what choose_layout", '''
import math

def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    if sequences < gpus or sequences % gpus:
        raise ValueError("does not split")
    per_gpu = sequences // gpus
    best = (math.inf, math.inf, gpus)  # (mbs, ga, dp) with the fewest steps so far
    for m in range(1, max_mbs + 1):
        if m % per_gpu == 0 and per_gpu // m < best[1]:  # meant per_gpu % m
            best = (m, per_gpu // m, gpus)
    return best
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "divmod, the steps first", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    samples, extra_tokens = divmod(gbs_tokens, seq_len)
    if extra_tokens:
        raise ValueError(f"{extra_tokens} tokens left over: not whole sequences")
    steps, extra_samples = divmod(samples, mbs * dp)
    if extra_samples:
        raise ValueError(f"{extra_samples} samples left over: not whole accumulation steps")
    if steps == 0:
        raise ValueError("fewer samples than GPUs x micro-batch")
    return steps
'''),
    (1, "float division, tested for whole numbers", '''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    samples = gbs_tokens / seq_len
    if not samples.is_integer():
        raise ValueError("not a whole number of sequences")
    steps = samples / (mbs * dp)
    if steps < 1:
        raise ValueError("more GPUs than the batch can feed")
    if not steps.is_integer():
        raise ValueError("not a whole number of accumulation steps")
    return int(steps)
'''),
    (2, "counts down from the largest micro-batch", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    sequences = gbs_tokens // seq_len
    per_gpu, uneven = divmod(sequences, gpus)
    if per_gpu == 0 or uneven:
        raise ValueError(f"{sequences} sequences do not split evenly over {gpus} GPUs")
    mbs = min(max_mbs, per_gpu)
    while per_gpu % mbs:
        mbs -= 1
    return (mbs, per_gpu // mbs, gpus)
'''),
    (2, "the divisors first, then the largest that fits", '''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    if gbs_tokens % (seq_len * gpus):
        raise ValueError("the sequences do not split evenly over the GPUs")
    per_gpu = gbs_tokens // (seq_len * gpus)
    if per_gpu < 1:
        raise ValueError("fewer sequences than GPUs")
    divisors = [m for m in range(1, per_gpu + 1) if per_gpu % m == 0]
    mbs = max(m for m in divisors if m <= max_mbs)
    return mbs, per_gpu // mbs, gpus
'''),
]
