"""The exceptions a user sees as one line: a configuration a run cannot start with, and a run
that left the finite numbers.

They live below everything else (config, model, parallel, train all raise them) so that no
module has to import a higher layer to say what is wrong.
"""

import errno


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


# A write the filesystem refused for want of room: the disk or the quota is full, or the file passed
# the size a process may write (ulimit -f). Said as ConfigError: the fix is the user's, not the code's.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _carried(e: BaseException) -> int | None:
    """The errno of a refused write, raised as an OSError or carried in another library's exception
    (safetensors says "os error 28")."""
    if isinstance(e, OSError):
        return e.errno
    return next((n for n in _NO_ROOM if f"os error {n})" in str(e)), None)


def no_room(e: BaseException) -> bool:
    """Whether `e` is a write refused for want of room."""
    return _carried(e) in _NO_ROOM


def no_room_error(path: str, e: BaseException, kept: str = "") -> ConfigError:
    """One line for a write refused for want of room: where, why, what is left, and the fix."""
    import os

    why = getattr(e, "strerror", None) or os.strerror(_carried(e))
    return ConfigError(f"{path}: no room to write ({why}){'; ' + kept if kept else ''}: free space on its "
                       f"filesystem (or raise the quota, ulimit -f) or write elsewhere")
