"""Tensor parallelism (Megatron-LM) and sequence parallelism (Korthikanti et al. 2022).

comm.py    the conjugate autograd functions f / g and their sequence-parallel pair
layers.py  ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
loss.py    cross-entropy from vocabulary-sharded logits
apply.py   the transform of the single-device model into its TP form
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ultrascale.parallel.tensor.apply import apply_tensor_parallel
from ultrascale.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ultrascale.parallel.tensor.loss import vocab_parallel_cross_entropy


def vocab_parallel_loss(ctx, vocab_size: int):
    group, rank = ctx.group("tp"), ctx.index("tp")
    return lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, group, rank, vocab_size)


def gather_tensor_parallel(param, tensor, ctx):
    """The full tensor of a TP-sharded parameter (padding removed); a replicated one as it is."""
    dim = getattr(param, "tp_dim", None)
    if dim is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(ctx.size("tp"))]
    dist.all_gather(parts, tensor.contiguous(), group=ctx.group("tp"))
    full = torch.cat(parts, dim=dim)
    return full.narrow(dim, 0, param.full_shape[dim])


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "apply_tensor_parallel",
           "gather_tensor_parallel", "vocab_parallel_loss"]
