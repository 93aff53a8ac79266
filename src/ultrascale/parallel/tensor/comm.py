"""The communication of tensor parallelism, as autograd functions in conjugate pairs.

Megatron's f and g: wherever an activation enters the sharded region it goes
through f (identity forward, all-reduce of the gradient backward); where it
leaves, through g (all-reduce forward, identity backward). Each forward op's
backward is the other one, so one pair per MLP or attention block is all the
communication there is.

Sequence parallelism replaces the pair by another conjugate pair on the
sequence dimension (dim 1 of [batch, seq, hidden]): all-gather entering
(reduce-scatter of the gradient backward) and reduce-scatter leaving
(all-gather backward). Same bytes as one all-reduce, but the activations outside
the sharded region (norms, residuals) are 1/tp the size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ultrascale.distributed.flat import all_gather as _all_gather
from ultrascale.distributed.flat import reduce_scatter as _reduce_scatter
from ultrascale.spans import comm


def _all_reduce(x, group):
    x = x.contiguous()
    with comm("tp.all_reduce"):
        dist.all_reduce(x, group=group)
    return x


def _gather_seq(x, group, world):
    """[b, s/t, h] on each rank -> [b, s, h], the ranks' shards in rank order."""
    b, s, h = x.shape
    out = torch.empty(world * b * s * h, dtype=x.dtype, device=x.device)
    with comm("tp.all_gather"):
        _all_gather(out, x.contiguous().view(-1), group=group)
    return out.view(world, b, s, h).transpose(0, 1).reshape(b, world * s, h)


def _reduce_scatter_seq(x, group, world):
    """[b, s, h] partial sums on each rank -> [b, s/t, h]: the sum over ranks of this rank's shard."""
    b, s, h = x.shape
    chunks = x.view(b, world, s // world, h).transpose(0, 1).contiguous()
    out = torch.empty(b, s // world, h, dtype=x.dtype, device=x.device)
    with comm("tp.reduce_scatter"):
        _reduce_scatter(out.view(-1), chunks.view(-1), group=group)
    return out


class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward, sum the input gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """g: sum the partial outputs over the TP group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSP(torch.autograd.Function):
    """Entering the TP region under SP: all-gather the sequence; backward, reduce-scatter it."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _gather_seq(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group, ctx.world), None, None


class ReduceScatterToSP(torch.autograd.Function):
    """Leaving the TP region under SP: reduce-scatter the sequence; backward, all-gather it."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _reduce_scatter_seq(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group, ctx.world), None, None


class TPRegion:
    """How activations enter and leave the sharded region, for one TP group, with or without SP."""

    def __init__(self, group, world: int, sequence_parallel: bool):
        self.group, self.world, self.sp = group, world, sequence_parallel

    def enter(self, x):
        return GatherFromSP.apply(x, self.group, self.world) if self.sp else CopyToTP.apply(x, self.group)

    def leave(self, x):
        return ReduceScatterToSP.apply(x, self.group, self.world) if self.sp else ReduceFromTP.apply(x, self.group)
