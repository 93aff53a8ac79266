"""Cases for Part 13: lines the notebook must print from its own runs (its exercises' answers are
graded in tests/course/test_part13_expert_parallelism.py)."""

PRINTED = [
    "mixtral-8x7b  :   8 experts, top-2:   46.7 B parameters, 12.88 B active per token (27.6%); published 46.7 B "
    "and 12.9 B",
    "qwen3-30b-a3b : 128 experts, top-8:   30.5 B parameters,  3.35 B active per token (11.0%); published 30.5 B "
    "and 3.3 B",
    "deepseek-v3   : 256 experts, top-8:  671.0 B parameters, 37.55 B active per token ( 5.6%); published 671 B "
    "and 37 B",
    "deepseek-v3 active without the input embedding: 36.63 B",
    "the engine's deepseek-v3 preset:  704.9 B parameters, 38.68 B active",
    "capacity factor 1.25 (capacity 160 each): assignments kept per expert",
]
