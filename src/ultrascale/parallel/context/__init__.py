"""Context parallelism: every sequence cut into cp shards, attention computed across them.

Only attention mixes tokens, so only attention needs the other shards: the
embedding, norms, MLP, head and loss run on a rank's own tokens unchanged (an
MoE layer's balance losses, statistics of the whole micro-batch, sum their loads
over the cp ranks: parallel/expert.py `share_token_loads`). The model is left as
it is; two things change around it:
- the batch: each micro-batch's inputs and targets are cut to this rank's shard
  of the sequence, and RoPE is given their global positions (sharding.py);
- each block's `core_attention` is swapped for one of four variants:

  allgather  all-gather K and V, attend locally (zig-zag shards: balanced);
             backward reduce-scatters dK, dV                                     (allgather.py)
  ring       K/V blocks passed around the ring, partial results merged by their
             log-sum-exp; a second ring in backward                                 (ring.py)
  zigzag     the same ring over head-and-tail chunks: balanced causal work       (ring.py)
  ulysses    all-to-all from sequence shards to head shards and back              (ulysses.py)

blocks.py holds the per-block attention with log-sum-exp, the merge formula and
the flash-style backward that all but Ulysses share; comm.py the collectives
(counted). Gradients are averaged over the dp x cp ranks (the `dp_cp` group the
data-parallel owners already use): each cp rank's loss is the mean over its
own tokens, and the shards are equal.
"""

from __future__ import annotations

from torch import nn

from ultrascale.parallel.context.allgather import allgather_attention
from ultrascale.parallel.context.comm import COUNTS, ContextGroup
from ultrascale.parallel.context.ring import ring_attention
from ultrascale.parallel.context.sharding import LAYOUT, shard_micro_batches, shard_positions
from ultrascale.parallel.context.ulysses import ulysses_attention

VARIANTS = ("allgather", "ring", "zigzag", "ulysses")


class ContextParallelAttention(nn.Module):
    """In place of CoreAttention: q [b, H, n, d], k, v [b, KV, n, d] of this rank's shard of the
    sequence (RoPE already applied with global positions) -> the causal attention output of its queries."""

    def __init__(self, variant: str, cpg: ContextGroup):
        super().__init__()
        self.variant, self.cpg = variant, cpg

    def forward(self, q, k, v):
        if self.variant == "ulysses":
            return ulysses_attention(q, k, v, self.cpg)
        if self.variant == "allgather":
            return allgather_attention(q, k, v, self.cpg, LAYOUT[self.variant])[0]
        return ring_attention(q, k, v, self.cpg, LAYOUT[self.variant])[0]

    def extra_repr(self) -> str:
        return f"{self.variant}, cp={self.cpg.size}"


def apply_context_parallel(model, ctx, variant: str):
    """Swap every block's core attention for the context-parallel one (meta device: nothing allocated)."""
    cpg = ContextGroup.of(ctx)
    for block in model.layers.values():
        block.attn.core_attention = ContextParallelAttention(variant, cpg)
    return model


__all__ = ["COUNTS", "VARIANTS", "ContextGroup", "ContextParallelAttention", "allgather_attention",
           "apply_context_parallel", "ring_attention", "shard_micro_batches", "shard_positions", "ulysses_attention"]
