"""Sharded layers: column- and row-parallel linears, and the vocabulary-parallel embedding.

Y = X W^T with W [out, in]:
- column parallel: W split by output rows; each rank computes its slice of Y's
  features from the whole X. Needs X on every rank; gives a sharded Y.
- row parallel: W split by input columns; each rank multiplies its slice of X's
  features and holds a partial sum of the whole Y. Takes a sharded X; the
  partial sums are added when leaving the region.
Column then row (MLP up -> down, attention q/k/v -> o) needs no communication in
between: the column's sharded output is exactly the row's sharded input.

Each sharded parameter records `full_shape`, `tp_dim` and `shard_of_full`, so it
is initialised as its slice of the single-device tensor and can be gathered
back; a replicated one records `grad_norm_share = 1/tp` so the gradient norm
counts it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def sharded_param(full_shape, dim: int, rank: int, world: int, padded: int | None = None) -> nn.Parameter:
    """A meta parameter for rank's slice along `dim` of a tensor of full_shape (padded with zero rows
    along dim to `padded` first, when the size does not divide)."""
    size = padded or full_shape[dim]
    shape = list(full_shape)
    shape[dim] = size // world
    p = nn.Parameter(torch.empty(shape, device="meta"))
    p.full_shape, p.tp_dim = torch.Size(full_shape), dim

    def shard_of_full(full, dim=dim, size=size):
        if full.shape[dim] != size:
            pad = list(full.shape)
            pad[dim] = size - full.shape[dim]
            full = torch.cat([full, full.new_zeros(pad)], dim=dim)
        return full.chunk(world, dim=dim)[rank]

    p.shard_of_full = shard_of_full
    return p


def replicated(p: nn.Parameter, world: int, sum_group=None) -> nn.Parameter:
    p.grad_norm_share = 1.0 / world
    if sum_group is not None:
        p.grad_sum_group = sum_group
    return p


class ColumnParallelLinear(nn.Module):
    """Output features sharded. `region` (a TPRegion) prepares the input, unless the
    enclosing module already did (region=None: q, k, v share one preparation)."""

    def __init__(self, in_features, out_features, bias, rank, world, region=None, padded_out=None):
        super().__init__()
        self.region = region
        self.weight = sharded_param((out_features, in_features), 0, rank, world, padded_out)
        self.bias = sharded_param((out_features,), 0, rank, world, padded_out) if bias else None

    def forward(self, x):
        if self.region is not None:
            x = self.region.enter(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features sharded; the partial outputs are summed (or reduce-scattered
    under SP) over the TP group, then the replicated bias is added once."""

    def __init__(self, in_features, out_features, bias, rank, world, region):
        super().__init__()
        self.region = region
        self.weight = sharded_param((out_features, in_features), 1, rank, world)
        self.bias = None
        if bias:
            sum_group = region.group if region.sp else None  # under SP each rank adds it to its tokens only
            self.bias = replicated(nn.Parameter(torch.empty(out_features, device="meta")), world, sum_group)

    def forward(self, x):
        out = self.region.leave(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding table sharded by vocabulary: a rank looks up the tokens in its
    range, writes zeros for the others, and leaving the region sums the ranks' partial rows."""

    def __init__(self, vocab_size, hidden, rank, world, region):
        super().__init__()
        self.region = region
        padded = -(-vocab_size // world) * world
        self.weight = sharded_param((vocab_size, hidden), 0, rank, world, padded)
        self.start, self.end = rank * padded // world, (rank + 1) * padded // world

    def forward(self, tokens):
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.region.leave(out)


class TiedVocabParallelHead(nn.Module):
    """The output layer that reads the (vocabulary-sharded) embedding table: logits come out
    sharded by vocabulary, which is what the vocabulary-parallel loss takes."""

    def __init__(self, embedding: VocabParallelEmbedding, region):
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)  # not a child: its weight has one name
        self.region = region

    def forward(self, x):
        return F.linear(self.region.enter(x), self._embedding.weight)
