"""Cases for Part 3: lines the notebook must print from its own runs (the wrong answers a learner
might write are in tests/course/test_part3_gradient_accumulation_and_comm_ops.py)."""

PRINTED = [
    "summed micro-batch gradients / one big batch:   4.000",
    "saved for backward, batch of 8: 78,208 bytes; micro-batch of 2: 28,768 bytes",
    "= 8,240 bytes per sample + 12,288 bytes whatever the batch",
    "  rank 3: [31, 32, 33, 34]                 ->  [1, 2, 3, 4]",
    "  rank 0: [1, 2, 3, 4]                     ->  [64, 68, 72, 76]",
    "  rank 3: [31, 32]                         ->  [[1, 2], [11, 12], [21, 22], [31, 32]]",
    "  rank 2: [21, 22, 23, 24, 25, 26, 27, 28] ->  [5, 6]",
    "  rank 3: [31, 32, 33, 34, 35, 36, 37, 38] ->  [88, 92]",
    "  rank 1: [11, 12, 13, 14, 15, 16, 17, 18] ->  [[3, 4], [13, 14], [23, 24], [33, 34]]",
    "rank 0: sent 49,152 bytes, result 4",
    "rank 1: sent 16,384 bytes, result 4",
    "rank 2: sent 12,288 bytes, first value of each chunk [1, 2, 3, 4]",
    "(N-1)/N x 16,384 = 12,288 bytes; a ring all-reduce, twice that: 2(N-1)/N x 16,384 = 24,576 bytes",
]
