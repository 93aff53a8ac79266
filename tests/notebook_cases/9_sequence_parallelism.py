"""Cases for Part 9: lines the notebook must print from its own runs (its exercises' answers are
tests/course/test_part9_sequence_parallelism.py)."""

from printed import Close

from ultrascale.testing.compare import FP32

PRINTED = [
    "tp = 2 + sp: rank 0 keeps 71,136 bytes for block 0 (b=1, s=24)",
    "    4 x (1, 12, 64)    float32",
    "reduce-scatter + all-gather vs all-reduce: max |difference|",
    Close('one process : losses 5.552306 5.491920, activations 678,420 B', rel=FP32.loss_rtol),
    Close('tp = 2 + sp: losses 5.552305 5.491920, activations 380,928 B per rank', rel=FP32.loss_rtol),
    "b=2, s=32: one block keeps 189,952 B per rank with tp = 2, 156,928 B with tp = 2 + sp: 2968 and 2452 per token",
]
