"""The equivalence check itself: it fails on engines with deliberate bugs, and bf16 layouts
pass it against one process fed the same micro-batches.

Every parallel test in this suite rests on `testing/compare.py`; a criterion that
cannot fail proves nothing. Each fault of `testing/faults.py` is patched into the
worker processes for one run, and the comparison must reject that run.
"""

import math

import pytest
import torch

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import get_preset
from ultrascale.testing.compare import FP32, RunRecord, check_against_single, compare, compare_against_single

pytestmark = pytest.mark.equivalence


def config(world=2, grad_accum=2, steps=3, dtype="fp32", layers=2, micro_batch=2, **parallel):
    p = ParallelConfig(bucket_mb=0.05, **parallel)
    t = TrainConfig(steps=steps, seq_len=32, micro_batch=micro_batch, grad_accum=grad_accum, seed=5, dtype=dtype,
                    progress=False)
    return RunConfig(model=get_preset("tiny", layers=layers), parallel=p, train=t)


FAULTY = [  # (fault, label, world, config)
    ("grads-scaled-1.01", "dp 2 bucket", 2, config(dp=2)),
    ("grads-scaled-1.01", "dp 2 zero 3", 2, config(dp=2, zero=3)),
    ("grads-scaled-1.01", "dp 2 x tp 2 zero 1", 4, config(dp=2, tp=2, zero=1)),
    ("dp-wrong-group-size", "dp 2 naive", 2, config(dp=2, dp_mode="naive")),
    ("dp-wrong-group-size", "dp 4 overlap", 4, config(dp=4, dp_mode="overlap", grad_accum=1)),
    ("dp-wrong-group-size", "dp 2 zero 2", 2, config(dp=2, zero=2)),
    ("sp-norm-grads-not-summed", "tp 2 + sp", 2, config(tp=2, sp=True)),
    ("last-bucket-dropped", "dp 2 bucket", 2, config(dp=2)),
    ("last-bucket-dropped", "dp 2 zero 1", 2, config(dp=2, zero=1)),
    ("micro-batch-counted-twice", "dp 2, grad accum 2", 2, config(dp=2)),
    ("offload-stale-moment", "dp 2 zero 2 offload cpu", 2, config(dp=2, zero=2, offload="cpu")),
    ("micro-batch-counted-twice", "pp 2 1f1b, 4 micro-batches", 2,
     config(pp=2, grad_accum=4, micro_batch=1, layers=4)),
]


@pytest.mark.parametrize("fault,label,world,cfg", FAULTY, ids=[f"{f}-{lab}".replace(" ", "") for f, lab, _, _ in FAULTY])
def test_a_deliberate_bug_fails_the_check(fault, label, world, cfg):
    c = compare_against_single(label, cfg, world, fault=fault)[0]
    assert c.failures(FP32), f"the check passed an engine with the fault {fault!r}: {c.line()}"


def test_a_one_percent_gradient_scale_is_seen_only_in_the_gradients():
    # Clipping rescales to a fixed norm and Adam divides the scale away: losses and
    # parameters stay within their bounds, and only the gradient comparison fails.
    c = compare_against_single("dp 2 bucket", config(dp=2), 2, fault="grads-scaled-1.01")[0]
    failed = c.failures(FP32)
    assert c.max_loss_rel <= FP32.loss_rtol and c.max_param_mean <= FP32.param_mean, c.line()
    assert any("step-1 gradient" in f for f in failed) and any("grad norm" in f for f in failed), failed
    assert 0.009 < c.max_grad_rel_l2 < 0.011, c.line()  # the 1% itself


def _record(losses=(5.0, 4.0, 3.0), norms=(2.0, 2.0, 2.0), grad=(3.0, 4.0), param=(1.0, 1.0)):
    t = torch.tensor  # the tensors compared second ("b") take the NaN
    return RunRecord(list(losses), list(norms), [1e-3] * 3, {"a": t([1.0, 2.0]), "b": t(grad)},
                     {"a": t([0.5, 0.25]), "b": t(param)})


@pytest.mark.parametrize("where", ["second loss", "third norm", "a gradient", "a parameter"])
def test_a_nan_after_equal_numbers_fails_the_check(where):
    # Python's max() passes over a NaN that follows a number; the criterion must not.
    nan = math.nan
    got = {"second loss": dict(losses=(5.0, nan, 3.0)), "third norm": dict(norms=(2.0, 2.0, nan)),
           "a gradient": dict(grad=(3.0, nan)), "a parameter": dict(param=(1.0, nan))}[where]
    same = compare("same", _record(), _record(), record=False)
    assert same.failures(FP32) == [] and same.max_loss_rel == 0.0
    c = compare(where, _record(), _record(**got), record=False)
    assert len(c.failures(FP32)) == 1 and "nan" in c.line(), c.line()


# -- bf16: against one process with the same micro-batches ------------------------------------
BF16_LAYOUTS = [  # (label, world, parallel)
    ("dp 2 bucket", 2, dict(dp=2)),
    ("dp 2 zero 3", 2, dict(dp=2, zero=3)),
    ("tp 2 + sp", 2, dict(tp=2, sp=True)),
    ("pp 2 1f1b", 2, dict(pp=2)),
    ("dp 2 x tp 2 zero 1", 4, dict(dp=2, tp=2, zero=1)),
]


@pytest.mark.parametrize("label,world,parallel", BF16_LAYOUTS, ids=[lab.replace(" ", "") for lab, _, _ in BF16_LAYOUTS])
def test_bf16_layouts_match_one_process_with_the_same_micro_batches(label, world, parallel):
    check_against_single(f"bf16 {label}", config(steps=10, dtype="bf16", **parallel), world)
