"""Where each technique plugs into the trainer, in torchtitan's composition order.

1. `shard_model(ctx, cfg)`: a transform applied to the model on the meta device,
   before any memory is allocated: pipeline split, then tensor parallelism.
2. recomputation (train/recompute.py) wraps what is left.
3. `build_grads(params, ctx, cfg)`: who owns the gradients and how they are
   reduced across data-parallel ranks (plain, overlapped, bucketed, ZeRO).
4. `grad_norm_reducer(ctx)`: how the squared gradient norm is summed over ranks
   that hold different pieces of the model.

Today the engine runs a single process (dp = tp = pp = cp = ep = 1); each
technique that lands replaces one of these defaults for its sizes, and turns
itself on in `ultrascale.config.IMPLEMENTED`.
"""

from __future__ import annotations

from ultrascale.train.grads import LocalGrads


def shard_model(ctx, cfg):
    """The transform that turns the single-device model into this rank's part of it."""
    return None


def build_grads(model, params, ctx, cfg):
    """The gradient owner for this layout: plain, or a data-parallel mode, or ZeRO."""
    if ctx.size("dp_cp") == 1:
        return LocalGrads(params, cfg.train.dtype)
    from ultrascale.parallel.data_parallel import build_data_parallel

    return build_data_parallel(model, params, ctx, cfg)


def grad_norm_reducer(ctx):
    """Sum of squared norms over the ranks whose gradients are different pieces; None: local only."""
    return None
