"""Cases for Part 10: lines the notebook must print from its own runs (its exercises' answers are
graded in tests/course/test_part10_context_parallelism.py)."""

PRINTED = [
    "cp = 1: activations + logits  90.1 GiB, total 143.6 GiB per GPU -> does not fit in 79 GiB",
    "cp = 4: activations + logits  22.5 GiB, total  47.9 GiB per GPU -> fits in 79 GiB",
    "MLP on the second half alone  == its rows of the MLP on everything: True",
    "attention of the second half alone == its rows of attention on everything: False",
    "attention work per rank [512, 1024, 1536, 2048] (max / mean 1.60)",
    "attention work per rank [1152, 1152, 1152, 1152] (max / mean 1.00)",
    "rank 3: (1, 4, 4, 8) -> (1, 1, 16, 8); its sequence positions came from ranks [0, 1, 2, 3]",
]
