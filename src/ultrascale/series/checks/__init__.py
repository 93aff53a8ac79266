"""The exercise checks of the course, one module per part (`part4.exercise_1(fn)`).

A check cell in a notebook only calls into here (`part4.exercise_1(data_parallel_grads)`),
so the notebook does not show the answer. A check:

- runs the learner's function where the exercise is about several ranks on real
  gloo processes (`on_ranks`), and compares with the single-process result;
- lets NotImplementedError through (the starter: "not done yet");
- raises AssertionError with a message that names what is wrong and points at
  the fix, for each mistake a learner is known to make, in words of the lesson.
"""

from __future__ import annotations

import math

from ultrascale.series.ranks import RankError, on_ranks

__all__ = ["on_ranks", "RankError", "max_rel_diff", "ratio", "require_finite"]


def max_rel_diff(got, want) -> float:
    """The largest |got - want| over the largest |want| (0 when both are zero); inf when `got`
    holds a NaN, so that a check written `if max_rel_diff(...) > tol: raise` rejects it (NaN > tol
    is False, and a NaN answer would otherwise pass)."""
    import torch

    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    scale = want.abs().max().item() or 1.0
    diff = (got - want).abs()
    return float("inf") if diff.isnan().any() else diff.max().item() / scale


def _non_finite(value) -> bool:
    import torch

    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    if not torch.is_tensor(value) and hasattr(value, "__array__"):  # a numpy array or scalar
        try:
            value = torch.as_tensor(value)
        except (TypeError, RuntimeError):  # an array of objects: not numbers to judge
            return False
    if torch.is_tensor(value):
        # isfinite has no fp8 kernel: judge the values widened to fp32 (fp8's NaN stays NaN).
        return value.is_floating_point() and not bool(torch.isfinite(value.float()).all())
    if isinstance(value, float):
        return not math.isfinite(value)
    return False


def require_finite(value, what: str) -> None:
    """AssertionError naming `what` when `value` (a number, a tensor, or lists, tuples and dicts
    of them) holds a NaN or an infinity: a learner's overflow or 0/0 is said as such, before any
    comparison (a NaN compares False with everything, and would slip past a `>` test)."""
    if _non_finite(value):
        raise AssertionError(f"a NaN or an infinity in {what}: look for a division by zero, an exp() that "
                             f"overflows, or a tensor read before it was written (torch.empty)")


def ratio(got, want) -> float:
    """How many times larger `got` is than `want` (by norm): 2.0 says "summed over 2 ranks"."""
    import torch

    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return (got.norm() / want.norm()).item() if want.norm() > 0 else float("inf")
