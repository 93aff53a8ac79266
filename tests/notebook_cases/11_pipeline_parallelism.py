"""Cases for Part 11: lines the notebook must print from its own runs (the wrong answers to its
exercises are in tests/course/test_part11_pipeline_parallelism.py)."""

from printed import Close

# The bubble measured on the engine's paced step 2 must agree with the simulator's at the paced costs
# within this much (an absolute difference of bubble ratios), as in Part 12: each message and each wake
# of a waiting process adds a few milliseconds against actions of 250 and 500 ms (0.008 to 0.009 above
# the simulator on 2 shared cores).
WITHIN = 0.06
# Measured alone on the machine (`make test` runs paced notebooks after the parallel pass, one at a time).
PACED = True


def agrees(name: str, simulated: float) -> Close:
    """The line of `name`'s bubble, measured within WITHIN of the simulated one and the formula (which
    must print exactly: the plain string of the same line's start)."""
    return Close(f"{name:4s}: bubble ratio simulated {simulated:.3f}, measured {simulated:.3f}, "
                 f"formula (p - 1)/m = {simulated:.3f}", rel=WITHIN / simulated)


PRINTED = [
    "stage 0: blocks [0, 1] + embedding",
    "stage 3: blocks [6, 7] + final norm, head, loss",
    "naive, p = 4, 8 micro-batches: step time 96, each stage computes 24, bubble ratio 3.00",
    "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    "(worst relative difference",
    "afab: bubble ratio simulated 0.375, measured",
    "1f1b: bubble ratio simulated 0.375, measured",
    ", formula (p - 1)/m = 0.375   (mean F",
    agrees("afab", 0.375),
    agrees("1f1b", 0.375),
    "p = 4, m = 64: bubble ratio 0.0469  (p - 1)/m = 0.0469",
    "1f1b: peak activations per rank",
    ", 8.0, 8.0, 8.0]; simulator [8, 8, 8, 8]",
    ", 3.0, 2.0, 1.0]; simulator [4, 3, 2, 1]",
]
