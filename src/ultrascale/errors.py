"""The exceptions a user sees as one line: a configuration a run cannot start with, and a run
that left the finite numbers.

They live below everything else (config, model, parallel, train all raise them) so that no
module has to import a higher layer to say what is wrong.
"""


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message says what to change."""


class Diverged(ArithmeticError):
    """Training produced a NaN or an infinite gradient norm; the message names the step and what to
    change. Raised before that step's update, so the parameters and every checkpoint are those of
    the last finite step."""


def positive_number(text: str) -> float:
    """An argparse type: a finite positive number. inf and nan are no setting (a timeout of nan would
    never end, a bucket of inf never fills), so they are refused at parsing, in one line."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value
