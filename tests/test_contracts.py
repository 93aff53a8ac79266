"""The contracts between the rooms (parallel/grads.py's GradientSync, parallel/precision.py's
OptimizerTensors): every gradient owner and every holder of the optimizer's tensors declares what the
trainer, the pipeline and checkpoints call, so none of them is probed for a capability."""

from __future__ import annotations

import inspect

import pytest

from ultrascale.parallel import data_parallel, expert_grads, offload, zero, zero3  # noqa: F401 - their classes
from ultrascale.parallel.grads import GradientSync, LocalGrads
from ultrascale.parallel.precision import MainParams, OptimizerTensors


def _subclasses(cls):
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def _methods(protocol) -> list[str]:
    return [n for n, v in vars(protocol).items() if not n.startswith("_") and inspect.isfunction(v)]


OWNERS = _subclasses(LocalGrads) + [expert_grads.ExpertParallelGrads]
HOLDERS = _subclasses(MainParams) + [offload.OffloadedMain, expert_grads._JoinedMain]


def test_the_contracts_name_what_their_callers_call():
    assert {"no_sync", "finish", "grads", "norm_shares", "replica_index", "main_ranges"} <= set(_methods(GradientSync))
    assert {"attach_grads", "copy_to_model", "offloaded_bytes"} <= set(_methods(OptimizerTensors))
    assert {"Zero3", "ZeroDataParallel", "OverlapDataParallel", "ExpertParallelGrads"} <= {c.__name__ for c in OWNERS}


@pytest.mark.parametrize("cls", OWNERS, ids=lambda c: c.__name__)
def test_every_gradient_owner_implements_gradient_sync(cls):
    missing = [n for n in _methods(GradientSync) if not callable(getattr(cls, n, None))]
    assert not missing, f"{cls.__name__} lacks {missing} of GradientSync"


@pytest.mark.parametrize("cls", HOLDERS, ids=lambda c: c.__name__)
def test_every_holder_of_the_optimizers_tensors_implements_optimizer_tensors(cls):
    missing = [n for n in _methods(OptimizerTensors) if not callable(getattr(cls, n, None))]
    assert not missing, f"{cls.__name__} lacks {missing} of OptimizerTensors"
    # `where` is the trainer's question "off the device?": a class attribute or set by the constructor.
    assert "where" in vars(cls) or "self.where" in inspect.getsource(cls) or any("where" in vars(b) for b in cls.__mro__)


def test_a_class_missing_a_method_is_found():
    class Partial(LocalGrads):
        replica_index = None  # a capability taken away: the check above must see it

    missing = [n for n in _methods(GradientSync) if not callable(getattr(Partial, n, None))]
    assert missing == ["replica_index"]
