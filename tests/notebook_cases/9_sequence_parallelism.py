"""Cases for Part 9: lines the notebook must print from its own runs (its exercises' answers are
tests/course/test_part9_sequence_parallelism.py)."""

from printed import Close

from ultrascale.testing.compare import FP32

PRINTED = [
    # Under plain TP eight tensors are whole (the norms' four [1, 24, 64], their rstd, the two norm
    # outputs); q and k/v split by heads/t and kv heads/t.
    "tp = 2     : rank 0 keeps 83,520 bytes for block 0 (b=1, s=24)",
    "    4 x (1, 24, 64)    float32\n    2 x (24, 64)       float32",
    "    2 x (1, 24, 1)     float32",
    "    1 x (1, 4, 24, 8)  float32",
    "    2 x (1, 2, 24, 8)  float32",
    "tp = 2 + sp: rank 0 keeps 71,136 bytes for block 0 (b=1, s=24)",
    "    4 x (1, 12, 64)    float32",
    "    2 x (1, 12, 1)     float32",
    "reduce-scatter + all-gather vs all-reduce: max |difference|",
    Close('one process : losses 5.552306 5.491920, activations 678,420 B', rel=FP32.loss_rtol),
    Close('tp = 2 + sp: losses 5.552305 5.491920, activations 380,928 B per rank', rel=FP32.loss_rtol),
    "tp = 2     : per step 10 all-reduces of [b, s, h]; sent per rank 163,840 B",
    "tp = 2 + sp: per step 10 reduce-scatters, 10 all-gathers of [b, s, h]; sent per rank 163,840 B",
    # per step 3 loss reductions [b, s], the gradient norm, 5 norm weights' gradients [h]; once a start-up value
    "tp = 2 + sp, the small all-reduces of the run's 2 steps (shape: count): {(): 2, (1,): 1, (2, 32): 6, (64,): 10}",
    "the difference per token, 2 norms x (8h + 4) x (1 - 1/t): 516",
    "b=2, s=32: one block keeps 189,952 B per rank with tp = 2, 156,928 B with tp = 2 + sp: 2968 and 2452 per token",
]
