"""The course checks' own helpers: a NaN answer is never taken for a right one.

A check rejects a learner's answer with `if max_rel_diff(got, want) > tol: raise ...`; NaN
compares False with everything, so a NaN difference would pass that line. Each notebook's
cases (tests/notebook_cases/) hold a NaN answer per exercise, run in the notebook itself.
"""

import math

import numpy as np
import pytest
import torch

from ultrascale.series.checks import max_rel_diff, require_finite

NAN, INF = math.nan, math.inf


def test_max_rel_diff_of_a_nan_answer_is_infinite():
    want = torch.tensor([1.0, -2.0, 4.0])
    assert max_rel_diff(want, want) == 0.0
    assert max_rel_diff(torch.tensor([1.0, -2.0, 5.0]), want) == 0.25
    assert max_rel_diff(torch.tensor([1.0, NAN, 4.0]), want) == INF
    assert max_rel_diff(torch.tensor([INF, -2.0, 4.0]), want) == INF


@pytest.mark.parametrize("answer", [NAN, -INF, torch.tensor([0.0, NAN]), [1.0, (2.0, torch.tensor([INF]))],
                                    {"w": torch.zeros(2), "b": torch.full((1,), NAN)},
                                    torch.full((2,), NAN).to(torch.float8_e4m3fn),  # isfinite has no fp8 kernel
                                    np.float32("nan"), np.array([1.0, np.inf])])
def test_require_finite_names_a_nan_or_an_infinity_wherever_it_is(answer):
    with pytest.raises(AssertionError, match="^a NaN or an infinity in your step time: look for a division by zero"):
        require_finite(answer, "your step time")


@pytest.mark.parametrize("answer", [0.5, 3, torch.tensor([1.0, -2.0]), torch.tensor([1, 2]), [1.0, (2, "a")],
                                    {"w": torch.ones(2)}, None, torch.ones(2).to(torch.float8_e4m3fn),
                                    np.float64(2.5), np.array(["a"], dtype=object)])
def test_require_finite_lets_numbers_through(answer):
    require_finite(answer, "your answer")
