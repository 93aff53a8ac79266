"""AdamW with the usual decay groups, and the learning-rate schedules: warmup, then cosine, linear,
warmup-stable-decay or constant."""

from __future__ import annotations

import math

import torch

from ultrascale.config import TrainConfig


def build_adamw(main: list[torch.Tensor], decay: list[bool], cfg: TrainConfig, offloaded=None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (decay[i] says which; norms and biases are not decayed).

    fused=True on the CPU and CUDA: one kernel per tensor that reads each element once,
    instead of the per-tensor loop's nine passes (on the `small` model the step costs
    1.9 ms instead of 9.7). Each element's update depends only on that element, so
    whole parameters and ZeRO shards of them, cut anywhere, get the same update to
    rounding: a cut moves the kernel's scalar tail, which rounds a few elements an
    ulp or two apart from its vector body (tests/test_trainer.py). `offloaded`: the OffloadedMain that
    `main` belongs to under --offload, whose AdamW steps on the host (parallel/offload.py).
    """
    groups = [{"params": [p for p, d in zip(main, decay) if d], "weight_decay": cfg.weight_decay},
              {"params": [p for p, d in zip(main, decay) if not d], "weight_decay": 0.0}]
    hyper = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if offloaded is not None:
        from ultrascale.parallel.offload import OffloadedAdamW

        return OffloadedAdamW(offloaded, groups, **hyper)
    fused = all(p.device.type in ("cpu", "cuda") for p in main)
    return torch.optim.AdamW(groups, fused=fused, foreach=None if fused else False, **hyper)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to lr, then the schedule down to
    min_lr_ratio x lr at lr_decay_steps (0: the run's steps), and there after it.

    cosine: half a cosine over the steps after warmup (Llama, Megatron's default);
    linear: a straight line down (Megatron's linear, torchtitan's default decay);
    wsd: warmup-stable-decay (MiniCPM, DeepSeek, SmolLM2): lr until the last lr_decay_fraction of the
         steps after warmup, then a straight line down (a run can be extended from its stable phase);
    constant: lr after warmup."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, (cfg.lr_decay_steps or cfg.steps) - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.lr_schedule == "wsd":
        stable = 1.0 - cfg.lr_decay_fraction
        progress = max(0.0, progress - stable) / cfg.lr_decay_fraction
    return floor + (cfg.lr - floor) * (1.0 - progress)


@torch.no_grad()
def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, reduce_sq=None, shares=None) -> float:
    """Scale gradients so their global L2 norm is at most max_norm; return the norm before clipping.

    reduce_sq sums the squared norm over the ranks that hold different pieces of
    the gradients (tensor, pipeline and ZeRO shards). shares[i] weighs gradient
    i's contribution: a tensor replicated on t ranks that all take part in the
    sum counts 1/t on each, so it counts once in all.
    """
    device = grads[0].device if grads else "cpu"
    if grads:
        # One call for every tensor's norm, in fp32 whatever the gradients' dtype (a loop of
        # pow and sum per tensor cost twice as much on the `small` model).
        sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()
        if shares is not None:
            sq = sq * torch.tensor(shares, dtype=torch.float32, device=device)
        sq = sq.sum()
    else:
        sq = torch.zeros((), dtype=torch.float32, device=device)
    if reduce_sq is not None:
        sq = reduce_sq(sq)
    norm = sq.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm
