"""Cases for Part 11: lines the notebook must print from its own runs (the wrong answers to its
exercises are in tests/course/test_part11_pipeline_parallelism.py)."""

# The bubble on the engine's schedule clock (each action its unit cost, each message its sender's
# clock: parallel/pipeline/runtime.py) is the simulator's exactly; the one measured in seconds adds the
# messages' time and the machine's load, a timing, printed and not pinned.


def agrees(name: str, simulated: float) -> str:
    """The line of `name`'s bubble up to its measured seconds: simulator, engine's clock and formula equal."""
    return (f"{name:4s}: bubble ratio simulated {simulated:.3f}, on the engine's clock {simulated:.3f}, "
            f"formula (p - 1)/m = {simulated:.3f}; measured ")


PRINTED = [
    "stage 0: blocks [0, 1] + embedding",
    "stage 3: blocks [6, 7] + final norm, head, loss",
    "naive, p = 4, 8 micro-batches: step time 96, each stage computes 24, bubble ratio 3.00",
    "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    "(worst relative difference",
    agrees("afab", 0.375),
    agrees("1f1b", 0.375),
    "ms; their real compute ",
    "p = 4, m = 64: bubble ratio 0.0469  (p - 1)/m = 0.0469",
    "1f1b: peak activations per rank",
    ", 8.0, 8.0, 8.0]; simulator [8, 8, 8, 8]",
    ", 3.0, 2.0, 1.0]; simulator [4, 3, 2, 1]",
]
