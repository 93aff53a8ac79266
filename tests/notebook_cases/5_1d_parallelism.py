"""Cases for Part 5: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

from printed import Close

from ultrascale.testing.compare import FP32

MISTAKES = [
            ("1", "returns a float", "return an int", '''
    def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
        return gbs_tokens / seq_len / (mbs * dp)
    '''),
            ("1", "never refuses", "more GPUs than the batch can feed", '''
    def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
        return gbs_tokens // seq_len // (mbs * dp)
    '''),
            ("1", "floors the accumulation steps", "not a whole number of accumulation steps", '''
    def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
        if gbs_tokens % seq_len:
            raise ValueError("not whole sequences")
        ga = gbs_tokens // seq_len // (mbs * dp)
        if ga < 1:
            raise ValueError("more GPUs than samples")
        return ga
    '''),
            # The answer the old check accepted: steps and GPUs checked, whole sequences never.
            ("1", "never checks whole sequences", "not a whole number of sequences (gbs_tokens % seq_len != 0)", '''
    def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
        samples = gbs_tokens // seq_len
        per_step = mbs * dp
        if samples < per_step:
            raise ValueError("more GPUs than the batch can feed")
        if samples % per_step:
            raise ValueError("not a whole number of accumulation steps")
        return samples // per_step
    '''),
            ("1", "counts tokens as samples", "first turn the 4,194,304 tokens into 1024 sequences", '''
    def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
        return gbs_tokens // (mbs * dp)
    '''),
            ("1", "NaN for 'no whole steps', the test reversed", "a NaN or an infinity in grad_accum_steps", '''
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
            ("2", "takes max_mbs as it is", "mbs must divide the 6 sequences each GPU gets", '''
    def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
        sequences = gbs_tokens // seq_len
        if sequences < gpus or sequences % gpus:
            raise ValueError("does not split")
        return max_mbs, sequences // (max_mbs * gpus), gpus
    '''),
            ("2", "always MBS 1", "the planner picks (2, 4, 128)", '''
    def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
        sequences = gbs_tokens // seq_len
        if sequences < gpus or sequences % gpus:
            raise ValueError("does not split")
        return 1, sequences // gpus, gpus
    '''),
            ("2", "more replicas than GPUs", "returned dp 512 on 128 GPUs", '''
    def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
        sequences = gbs_tokens // seq_len
        if sequences < gpus or sequences % gpus:
            raise ValueError("does not split")
        per_gpu = sequences // gpus
        mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)
        return mbs, 1, sequences // mbs
    '''),
            ("2", "never refuses a batch too small", "raise ValueError - 1024 sequences cannot give each of 2048 GPUs", '''
    def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
        sequences = gbs_tokens // seq_len
        per_gpu = max(sequences // gpus, 1)
        mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)
        return mbs, per_gpu // mbs, gpus
    '''),
            ("2", "an infinite 'best so far' never replaced", "a NaN or an infinity in what choose_layout", '''
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

PRINTED = [
    "llama3-8b: 8.03B parameters; h100-80gb: 79.2 GiB",
    "MBS 2 x GA 4 x DP 128 = 1024 samples = 4,194,304 tokens per step",
    "4,194,304 tokens / 4096 tokens per sample = 1024 samples per step",
    "DP =  128: GA = 1024 / (2 x 128) = 4\n",
    "  dp128 tp1 pp1 zero3 rc:none mbs2 ga4      65.7 GiB  step 3.74 s  8,756 tokens/s/GPU",
    "planner's choice: MBS 2 x GA 4 x DP 128 = 1024 sequences",
    "ZeRO-3, MBS 3:  97.0 GiB does not fit",
    "of which parameters, gradients and optimizer states 119.7 GiB",
    Close("DP 1 x MBS 8 x GA 1 = 8 sequences: losses 5.5829, 5.2560, 4.9662; activations 2,713,668 bytes per rank",
          rel=FP32.loss_rtol),
    Close("DP 2 x MBS 2 x GA 2 = 8 sequences: losses 5.5829, 5.2560, 4.9662; activations 678,948 bytes per rank",
          rel=FP32.loss_rtol),
    "  128 GPUs: MBS 2 x GA  4  step  3.74 s   8,756 tokens/s/GPU  exposed DP communication 0.000 s",
    " 1024 GPUs: MBS 1 x GA  1  step  3.83 s   1,070 tokens/s/GPU  exposed DP communication 0.092 s",
    " 2048 GPUs: no layout - 1024 sequences cannot give every GPU a micro-batch",
]
