"""Cases for Part 12: lines the notebook must print from its own runs (the wrong answers to its
exercises are in tests/course/test_part12_interleaved_and_zero_bubble.py)."""

PRINTED = [
    "v = 1: rank 0 holds [[0, 1]]; rank 1 holds [[2, 3]]; rank 2 holds [[4, 5]]; rank 3 holds [[6, 7]]",
    "v = 2: rank 0 holds [[0], [4]]; rank 1 holds [[1], [5]]; rank 2 holds [[2], [6]]; rank 3 holds [[3], [7]]",
    "v = 1: bubble ratio 0.3750, (p - 1)/(v m) = 0.3750; point-to-point messages per step 48",
    "v = 2: bubble ratio 0.1875, (p - 1)/(v m) = 0.1875; point-to-point messages per step 112",
    "1f1b       : idle time per rank 9, bubble ratio 0.3750",
    "zero-bubble: idle time per rank 3, bubble ratio 0.1250",
    "(worst relative difference",
    "dualpipev  : idle time per rank 1.5, bubble ratio 0.0625, stages' activations in flight [4.5, 4.5, 4.5, 4.5]",
    "pp = 4 dualpipev",
]
