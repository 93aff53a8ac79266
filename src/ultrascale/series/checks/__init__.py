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

from ultrascale.series.ranks import RankError, on_ranks

__all__ = ["on_ranks", "RankError", "max_rel_diff", "ratio"]


def max_rel_diff(got, want) -> float:
    """The largest |got - want| over the largest |want| (0 when both are zero)."""
    import torch

    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    scale = want.abs().max().item() or 1.0
    return (got - want).abs().max().item() / scale


def ratio(got, want) -> float:
    """How many times larger `got` is than `want` (by norm): 2.0 says "summed over 2 ranks"."""
    import torch

    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return (got.norm() / want.norm()).item() if want.norm() > 0 else float("inf")
