"""Cases for Part 13: lines the notebook must print from its own runs (its exercises' answers are
graded in tests/course/test_part13_expert_parallelism.py)."""

PRINTED = [
    "mixtral-8x7b  :   8 experts, top-2:   46.7 B parameters,  12.9 B active per token (27.6%)",
    "deepseek-v3   : 256 experts, top-8:  704.9 B parameters,  38.7 B active per token ( 5.5%)",
    "capacity factor 1.25 (capacity 160 each): assignments kept per expert",
]
