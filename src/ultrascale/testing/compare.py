"""Prove a parallel run equals the single-process run on the same global batch.

torchtitan's discipline: the 1-process run is the trusted control; a parallel
layout must see the same tokens per step and start from the same weights. What
"equal" means has to hold on any CPU (another summation order, another kernel
set) and still fail for a real bug. Three things are compared, each for a
reason (the derivation is in docs/engine.md, "What equal means"):

1. the first step's gradients, per tensor, before clipping and before any
   optimizer update: the parallel algebra itself (every shard, sum, average and
   micro-batch), with nothing in between to amplify a rounding difference or to
   hide a constant factor (clipping rescales to a fixed norm, Adam divides the
   scale away);
2. the per-step losses and gradient norms (before clipping): the run stays on
   the same trajectory, and a wrong scale shows in the norm at every step;
3. the final parameters, per tensor, by the mean absolute difference measured
   against the distance AdamW can move an element (the sum of the learning
   rates): a summation-order difference in a gradient element within rounding
   noise of Adam's epsilon changes that element's update by a sizeable part of
   lr, which an element-wise bound cannot tell from a bug; such elements are
   few, and the mean over a tensor dilutes them, while a bug moves many.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ultrascale.config import ParallelConfig, RunConfig
from ultrascale.testing import tolerance
from ultrascale.testing.harness import run_distributed, worker_context
from ultrascale.testing.tolerance import Tolerance
from ultrascale.train.startup import check_run

# Filled by every comparison; the test suite prints it at the end, so the
# tolerance reached is on record next to the pass/fail.
REPORT: list[str] = []


# The bounds, by tolerance class (testing/tolerance.py, docs/engine.md "Tolerance classes"): each is the
# unit roundoff of the format where the two runs round differently times a stated growth factor, the
# same on every CPU. The faults they must catch are far outside them: a gradient averaged over N + 1
# ranks is off by 1/(N+1), one scaled by 1.01 by 1e-2, weight decay on the wrong tensors moves
# parameters by ~wd * |w| = 2e-3 of sum(lr), a missing tensor-parallel reduction by a factor.
FP32 = tolerance.FP32_REORDER.tolerance
BF16 = tolerance.BF16.tolerance
FP16 = tolerance.FP16.tolerance
FP8 = tolerance.FP8.tolerance


@dataclass
class RunRecord:
    """What a run is compared by; `of(result)` takes it from a TrainResult or a worker's return value."""

    losses: list[float]
    grad_norms: list[float]
    lrs: list[float]
    first_grads: dict[str, torch.Tensor] | None
    state: dict[str, torch.Tensor]
    memory: list[dict] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)  # the validation losses (--eval-every), in order

    @classmethod
    def of(cls, result) -> "RunRecord":
        m = result.metrics
        return cls(result.losses, [x["grad_norm"] for x in m], [x["lr"] for x in m], result.first_grads,
                   result.state, [x["memory"] for x in m], [x["val_loss"] for x in m if "val_loss" in x])


@dataclass
class Comparison:
    label: str
    steps: int
    max_loss_rel: float
    max_norm_rel: float
    max_grad_rel_l2: float  # first step, max over tensors of ||a - b|| / ||b||
    worst_grad: str
    max_param_mean: float  # max over tensors of mean(|a - b|) / sum(lr)
    worst_param: str
    max_param_abs: float  # reported, not bounded (see the module docstring)

    def line(self) -> str:
        return (f"{self.label}: {self.steps} steps, loss rel {self.max_loss_rel:.1e}, grad norm rel "
                f"{self.max_norm_rel:.1e}, step-1 grad rel L2 {self.max_grad_rel_l2:.1e} ({self.worst_grad}), "
                f"param mean diff/sum(lr) {self.max_param_mean:.1e} ({self.worst_param}), "
                f"param max abs {self.max_param_abs:.1e}")

    def failures(self, tol: Tolerance) -> list[str]:
        out = []
        if not self.max_loss_rel <= tol.loss_rtol:
            out.append(f"loss rel {self.max_loss_rel:.2e} > {tol.loss_rtol:g}")
        if not self.max_norm_rel <= tol.norm_rtol:
            out.append(f"grad norm rel {self.max_norm_rel:.2e} > {tol.norm_rtol:g}")
        if not self.max_grad_rel_l2 <= tol.grad_rtol:
            out.append(f"step-1 gradient of {self.worst_grad}: rel L2 {self.max_grad_rel_l2:.2e} > {tol.grad_rtol:g}")
        if not self.max_param_mean <= tol.param_mean:
            out.append(f"parameter {self.worst_param}: mean diff / sum(lr) {self.max_param_mean:.2e} > "
                       f"{tol.param_mean:g}")
        return out


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.float() - b.float()).norm().item()
    ref = b.float().norm().item()
    return 0.0 if diff == 0 else diff / ref if ref > 0 else math.inf


def _worse(a: float, b: float) -> bool:
    """b is worse than a: larger, or NaN. Python's max() passes over a NaN that comes after a
    number (NaN > x is False), and a run whose second loss is NaN would then read as equal."""
    return math.isnan(b) and not math.isnan(a) or b > a


def worst(values) -> float:
    """The largest of some errors, a NaN counting as the largest (max() would pass over it)."""
    values = list(values)
    if not values:
        raise ValueError("worst() of no errors: nothing was compared")
    found = values[0]
    for v in values[1:]:
        if _worse(found, v):
            found = v
    return found


def compare(label: str, ref: RunRecord, got: RunRecord, record: bool = True) -> Comparison:
    assert len(got.losses) == len(ref.losses), f"{label}: {len(got.losses)} steps vs {len(ref.losses)}"
    assert ref.state.keys() == got.state.keys(), f"{label}: parameter names differ: {ref.state.keys() ^ got.state.keys()}"
    assert len(got.val_losses) == len(ref.val_losses), f"{label}: {len(got.val_losses)} validation losses vs " \
                                                           f"{len(ref.val_losses)}"
    # The losses: every step's training loss and every validation loss (held to the same bound).
    loss_rel = worst(abs(a - b) / abs(b) for a, b in zip(got.losses + got.val_losses, ref.losses + ref.val_losses))
    norm_rel = worst(abs(a - b) / abs(b) for a, b in zip(got.grad_norms, ref.grad_norms))
    grad_rel, worst_grad = 0.0, "-"
    if ref.first_grads is not None or got.first_grads is not None:
        assert ref.first_grads is not None and got.first_grads is not None, f"{label}: first-step gradients missing"
        assert ref.first_grads.keys() == got.first_grads.keys(), f"{label}: gradient names differ"
        for name, g in ref.first_grads.items():
            r = _rel_l2(got.first_grads[name], g)
            if _worse(grad_rel, r) or worst_grad == "-":
                grad_rel, worst_grad = r, name
    distance = sum(ref.lrs)  # how far AdamW can move one element: about lr per step
    mean, worst_param, abs_diff = 0.0, "-", 0.0
    for name, p in ref.state.items():
        diff = (got.state[name].float() - p.float()).abs()
        abs_diff = worst([abs_diff, diff.max().item()])  # reported, NaN included
        r = diff.mean().item() / distance
        if _worse(mean, r) or worst_param == "-":
            mean, worst_param = r, name
    c = Comparison(label, len(got.losses), loss_rel, norm_rel, grad_rel, worst_grad, mean, worst_param, abs_diff)
    if record:
        REPORT.append(c.line())
    return c


def assert_matches(c: Comparison, tol: Tolerance = FP32) -> None:
    failures = c.failures(tol)
    assert not failures, f"{c.line()}\n  fails: " + "; ".join(failures)


# -- running the two sides ------------------------------------------------------
def single_process_config(cfg: RunConfig, same_micro_batches: bool = False) -> RunConfig:
    """The control for `cfg`: one process, one micro-batch holding the whole global batch; or,
    with same_micro_batches, the parallel run's micro-batches accumulated one after another
    (the control for bf16, whose rounding depends on the micro-batch size)."""
    if same_micro_batches:
        t = dataclasses.replace(cfg.train, grad_accum=cfg.global_batch // cfg.train.micro_batch, nproc=1)
    else:
        t = dataclasses.replace(cfg.train, micro_batch=cfg.global_batch, grad_accum=1, nproc=1)
    return dataclasses.replace(cfg, parallel=ParallelConfig(dp=1), train=t)


def _train_on_worker(cfg: RunConfig, fault: str | None = None):
    from ultrascale.testing.faults import inject
    from ultrascale.train.trainer import run_training

    ctx = worker_context(cfg.parallel)
    with inject(fault):
        result = run_training(cfg, ctx, keep_first_grads=True)
    return RunRecord.of(result)


def train_single(cfg: RunConfig, fault: str | None = None):
    """One process, in this process; the TrainResult (with the first step's gradients)."""
    from ultrascale.distributed.context import build_context
    from ultrascale.testing.faults import inject
    from ultrascale.train.trainer import run_training

    cfg = check_run(cfg, 1)
    with inject(fault):
        return run_training(cfg, build_context(cfg.parallel, 0, 1), keep_first_grads=True)


def train_on(cfg: RunConfig, world_size: int) -> RunRecord:
    """cfg on world_size processes (rank 0's record), or in this process when world_size is 1."""
    if world_size == 1:
        return RunRecord.of(train_single(cfg))
    return train_parallel(cfg, world_size)[0]


def train_parallel(cfg: RunConfig, world_size: int, timeout: float = 300, fault: str | None = None) -> list[RunRecord]:
    """Train `cfg` on world_size pooled gloo processes; a RunRecord per rank. `fault` names a
    deliberate bug from testing/faults.py to run the engine with (for tests of the tests)."""
    cfg = check_run(cfg, world_size)
    return run_distributed(world_size, _train_on_worker, cfg, fault, timeout=timeout)


def compare_against_single(label: str, cfg: RunConfig, world_size: int, fault: str | None = None,
                           every_rank: bool = False) -> list[Comparison]:
    """Run cfg on world_size processes and its single-process control; the comparison of
    rank 0 (or of every rank: each gathers the full gradients and parameters).

    fp32 runs are compared with one process holding the whole global batch in one
    micro-batch; bf16 runs with one process fed the same micro-batches (bf16 rounding
    depends on the micro-batch, not on the layout); so are MoE models whose routing
    depends on the micro-batch's statistics (expert capacity, the load-balancing loss).
    """
    cfg = check_run(cfg, world_size)
    m = cfg.model
    # FP8's per-tensor scales come from each micro-batch's amax: the same micro-batches too.
    same = (cfg.train.dtype != "fp32" or cfg.train.fp8
            or bool(m.is_moe and (m.capacity_factor or m.aux_loss_coef)))
    ref = RunRecord.of(train_single(single_process_config(cfg, same_micro_batches=same)))
    per_rank = train_parallel(cfg, world_size, fault=fault)
    label = label + (f" [fault: {fault}]" if fault else "")
    return [compare(label, ref, got, record=rank == 0 and not fault)
            for rank, got in enumerate(per_rank if every_rank else per_rank[:1])]


def tolerance_for(cfg: RunConfig) -> Tolerance:
    """The class of a layout against its single-process control: the compute dtype's, through FP8's casts."""
    return tolerance.for_run(cfg.train.dtype, cfg.train.fp8).tolerance


def check_against_single(label: str, cfg: RunConfig, world_size: int, tol: Tolerance | None = None,
                         every_rank: bool = False) -> Comparison:
    """compare_against_single, asserting that every compared rank matches."""
    comparisons = compare_against_single(label, cfg, world_size, every_rank=every_rank)
    for c in comparisons:
        assert_matches(c, tol or tolerance_for(cfg))
    return comparisons[0]
