"""Prove a parallel run equals the single-process run on the same global batch.

torchtitan's discipline: the 1-process run is the trusted control; a parallel
layout must see the same tokens per step and start from the same weights, and
then produce the same per-step losses and final parameters, up to the rounding
of a different summation order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ultrascale.config import ParallelConfig, RunConfig, validate
from ultrascale.testing.harness import run_distributed, worker_context

# Filled by every comparison; the test suite prints it at the end, so the
# tolerance reached is on record next to the pass/fail.
REPORT: list[str] = []


@dataclass
class Comparison:
    label: str
    steps: int
    max_loss_rel: float
    max_param_abs: float
    max_param_rel_l2: float  # max over tensors of ||a - b|| / ||b||

    def line(self) -> str:
        return (f"{self.label}: {self.steps} steps, max loss rel diff {self.max_loss_rel:.2e}, "
                f"max param abs diff {self.max_param_abs:.2e}, max tensor rel L2 diff {self.max_param_rel_l2:.2e}")


def single_process_config(cfg: RunConfig) -> RunConfig:
    """The control for `cfg`: one process, one micro-batch holding the whole global batch."""
    t = dataclasses.replace(cfg.train, micro_batch=cfg.global_batch, grad_accum=1, nproc=1)
    return dataclasses.replace(cfg, parallel=ParallelConfig(dp=1), train=t)


def _train_on_worker(cfg: RunConfig):
    from ultrascale.train.trainer import run_training

    ctx = worker_context(cfg.parallel)
    result = run_training(cfg, ctx)
    return result.losses, result.state, [m["memory"] for m in result.metrics]


def train_single(cfg: RunConfig):
    from ultrascale.distributed.context import build_context
    from ultrascale.train.trainer import run_training

    cfg = validate(cfg, 1)
    return run_training(cfg, build_context(cfg.parallel, 0, 1))


def train_parallel(cfg: RunConfig, world_size: int, timeout: float = 300):
    """Train `cfg` on world_size pooled gloo processes; per rank: (losses, final state, memory per step)."""
    cfg = validate(cfg, world_size)
    return run_distributed(world_size, _train_on_worker, cfg, timeout=timeout)


def compare(label: str, ref_losses, ref_state, losses, state, record: bool = True) -> Comparison:
    assert len(losses) == len(ref_losses), f"{label}: {len(losses)} steps vs {len(ref_losses)}"
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert ref_state.keys() == state.keys(), f"{label}: parameter names differ: {ref_state.keys() ^ state.keys()}"
    abs_diff = rel_l2 = 0.0
    for name, ref in ref_state.items():
        diff = state[name].float() - ref.float()
        abs_diff = max(abs_diff, diff.abs().max().item())
        rel_l2 = max(rel_l2, (diff.norm() / ref.float().norm().clamp_min(1e-12)).item())
    c = Comparison(label, len(losses), loss_rel, abs_diff, rel_l2)
    if record:
        REPORT.append(c.line())
    return c


# Parameters after a few AdamW steps: a gradient element near zero gets an update
# of about lr * sign(g), so a rounding difference of 1e-7 in such an element can
# move it by ~1e-5 while the rest agrees to ~1e-6. A real error (a wrong shard, a
# sum instead of a mean) moves elements by ~lr = 1e-3, a hundred times more.
PARAM_ATOL = 2e-5


def assert_matches(c: Comparison, loss_rtol: float = 1e-5, param_atol: float = PARAM_ATOL) -> None:
    assert c.max_loss_rel <= loss_rtol and c.max_param_abs <= param_atol, (
        f"{c.line()} exceeds loss rtol {loss_rtol:g} / param atol {param_atol:g}")


def check_against_single(label: str, cfg: RunConfig, world_size: int, loss_rtol=1e-5, param_atol=PARAM_ATOL,
                         rank_with_state: int = 0) -> Comparison:
    """Run cfg on world_size processes and its single-process control; assert they match."""
    cfg = validate(cfg, world_size)
    ref = train_single(single_process_config(cfg))
    per_rank = train_parallel(cfg, world_size)
    losses, state, _ = per_rank[rank_with_state]
    c = compare(label, ref.losses, ref.state, losses, state)
    assert_matches(c, loss_rtol, param_atol)
    return c
