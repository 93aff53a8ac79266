"""Lines Part 4's notebook must print from its own runs (its exercises' answers: tests/course)."""

PRINTED = [
    "hidden behind compute: rank 0 0%, rank 1 0%",  # naive: the profiler sees no overlap
    "rank 0 of 2, backend gloo\nrank 1 of 2, backend gloo",
    "summed  : ranks agree: True, gradient / single-process gradient: 2.000, equal to it: False",
    "averaged: ranks agree: True, gradient / single-process gradient: 1.000, equal to it: True",
    "gradients ready, in this order: ['4.bias', '4.weight', '2.bias', '2.weight', '0.bias', '0.weight']",
    "DDP alone                  : gradients 1.000x the single-process ones, ranks agree: True, extra all-reduces: 0",
    "DDP + SUM hook (the seed's): gradients 2.000x the single-process ones, ranks agree: True, extra all-reduces: 6",
    "DDP + averaging hook       : gradients 1.000x the single-process ones, ranks agree: True, extra all-reduces: 6",
    "  iteration 1: ['0.weight', '0.bias', '2.weight', '2.bias', '4.weight', '4.bias'] = 484 elements",
    "  iteration 2: ['4.bias', '4.weight', '2.bias', '2.weight'] = 340 elements | "
    "['0.bias', '0.weight'] = 144 elements",
    "llama3-8b: 291 parameter tensors",
    "six Linear(256, 256), default caps (first bucket 1 MiB, then 25 MiB):",
    "  iteration 1: 12 tensors = 1.506 MiB",
    "  iteration 2: 8 tensors = 1.004 MiB | 4 tensors = 0.502 MiB",
    "1,182,720 parameters in 16 tensors (4.5 MiB of fp32 gradients), 2 ranks, rank 0, best of 10\n",
    "every mode's averaged gradients equal DDP's: True",
    "forward + backward inside no_sync: all-reduce calls after each micro-batch [0, 0, 0, 1], ranks agree: True, "
    "full-batch gradient: True",
    "only backward inside no_sync     : all-reduce calls after each micro-batch [1, 2, 3, 4], ranks agree: True, "
    "full-batch gradient: True",
]
