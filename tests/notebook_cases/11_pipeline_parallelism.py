"""Cases for Part 11: lines the notebook must print from its own runs (the wrong answers to its
exercises are in tests/course/test_part11_pipeline_parallelism.py)."""

PRINTED = [
    "stage 0: blocks [0, 1] + embedding",
    "stage 3: blocks [6, 7] + final norm, head, loss",
    "naive, p = 4, 8 micro-batches: step time 96, each stage computes 24, bubble ratio 3.00",
    "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    "(worst relative difference",
    "p = 4, m = 64: bubble ratio 0.0469  (p - 1)/m = 0.0469",
    "1f1b: peak activations per rank",
    ", 8.0, 8.0, 8.0]; simulator [8, 8, 8, 8]",
    ", 3.0, 2.0, 1.0]; simulator [4, 3, 2, 1]",
]
