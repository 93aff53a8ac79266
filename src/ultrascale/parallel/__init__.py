"""Where each technique plugs into the trainer, in torchtitan's composition order.

1. `shard_model(ctx, cfg)`: a transform applied to the model on the meta device,
   before any memory is allocated: pipeline split, then tensor parallelism.
2. recomputation (train/recompute.py) wraps what is left.
3. `build_grads(model, params, ctx, cfg)`: who owns the gradients and how they are
   reduced across data-parallel ranks (plain, overlapped, bucketed, ZeRO).
4. `loss_function(ctx, cfg)`: the loss over this rank's logits (vocabulary-sharded under TP).
5. `grad_norm_reducer(ctx)`: sums the squared gradient norm over the ranks that
   hold different pieces of the model (tensor and pipeline parallel).
6. `gather_full(...)`: the full parameters again, for comparisons and export.

A technique that is not implemented is refused by `ultrascale.config.IMPLEMENTED`,
never silently skipped.
"""

from __future__ import annotations

import torch.distributed as dist

from ultrascale.model import cross_entropy_loss
from ultrascale.train.grads import LocalGrads


def shard_model(ctx, cfg):
    """The transform that turns the single-device model into this rank's part of it."""
    if ctx.size("tp") == 1:
        return None
    from ultrascale.parallel.tensor import apply_tensor_parallel

    return lambda model: apply_tensor_parallel(model, ctx, sequence_parallel=cfg.parallel.sp)


def build_grads(model, params, ctx, cfg):
    """The gradient owner for this layout: plain, or a data-parallel mode, or ZeRO."""
    if ctx.size("dp_cp") == 1:
        return LocalGrads(params, cfg.train.dtype)
    from ultrascale.parallel.data_parallel import build_data_parallel

    return build_data_parallel(model, params, ctx, cfg)


def loss_function(ctx, cfg):
    if ctx.size("tp") == 1:
        return cross_entropy_loss
    from ultrascale.parallel.tensor import vocab_parallel_loss

    return vocab_parallel_loss(ctx, cfg.model.vocab_size)


def grad_norm_reducer(ctx):
    """Sum of squared norms over the ranks whose gradients are different pieces; None: local only."""
    if ctx.size("tp") == 1:
        return None

    def reduce(sq):
        dist.all_reduce(sq, group=ctx.group("tp"))
        return sq

    return reduce


def gather_full(params, tensors, ctx):
    """Full (unsharded) fp32 tensors from this rank's `tensors` of `params`."""
    if ctx.size("tp") == 1:
        return tensors
    from ultrascale.parallel.tensor import gather_tensor_parallel

    return [gather_tensor_parallel(p, t, ctx) for p, t in zip(params, tensors)]
