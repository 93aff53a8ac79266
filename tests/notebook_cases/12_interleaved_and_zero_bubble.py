"""Cases for Part 12: lines the notebook must print from its own runs (the wrong answers to its
exercises are in tests/course/test_part12_interleaved_and_zero_bubble.py)."""

# The bubble on the engine's schedule clock (each action its unit cost, each message its sender's
# clock: parallel/pipeline/runtime.py) is the simulator's exactly; the one measured in seconds adds the
# messages' time and the machine's load, a timing, printed and not pinned.


def agrees(name: str, simulated: float) -> str:
    """The line of `name`'s bubble up to its measured seconds: the simulator's and the engine's clock's equal."""
    return f"{name:11s}: bubble simulated {simulated:.3f}, on the engine's clock {simulated:.3f}, measured "


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
    # DeepSeek's formulas at the simulator's costs, and the simulator's two counts of DualPipeV.
    "1F1B      (PP - 1)(F + B)          = 9   (PP = 4 stages)",
    "ZB1P      (PP - 1)(F + B - 2W)     = 3   (PP = 4 stages)",
    "DualPipeV (PP/2 - 1)(F&B + B - 3W) = 3   (PP = 8 stages, F&B = F + B = 1.5)",
    "simulator, DualPipeV, the engine's order (a forward goes when its input is in): idle time per rank 1.5",
    "simulator, DualPipeV, each pair one slot, waiting for both inputs: idle time per rank 3",
    agrees("1f1b", 0.375),
    agrees("interleaved", 0.1875),
    agrees("zero-bubble", 0.125),
    agrees("dualpipev", 0.0625),
    # the real compute of each paced action, and what the messages added to the step (timings: not pinned)
    "; computing F ",
    "ms longer than simulated)",
]
