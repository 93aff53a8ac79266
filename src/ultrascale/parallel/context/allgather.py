"""All-gather attention: every rank gathers the whole sequence's keys and values.

The simplest context parallelism (Llama 3's choice for long-context training):
one all-gather of K and V before attention, after which a rank attends its
queries to all earlier keys in one place (the pairs of blocks.chunk_pairs: the
chunks before a query chunk in full, its own under the diagonal mask, the later
ones not at all). Backward reduce-scatters the K/V gradients back to their
owners. It keeps the gathered K and V for backward: their memory is that of the
whole sequence (cheap with GQA: KV ≪ H).

Its shards are zig-zag (sharding.py), as in Llama 3 and the playbook's
all-gather form of zig-zag attention: with contiguous shards the last rank's
queries would see the whole sequence and the first rank's only their own block
(cp : 1 in work), and the step waits for the last. Zig-zag costs nothing here:
the gathered chunks are put back in sequence order, so each of a rank's two
query chunks attends to one run of earlier keys in one kernel call, and to
its own chunk in one under the diagonal mask.
"""

from __future__ import annotations

import torch

from ultrascale.parallel.context import blocks
from ultrascale.parallel.context.comm import ContextGroup, GatherKV
from ultrascale.parallel.context.sharding import chunk_count, chunks_of


class LocalAttention(torch.autograd.Function):
    """Attention of q (holding q_chunks) on local k, v (holding k_chunks), with the flash-style backward."""

    @staticmethod
    def forward(ctx, q, k, v, q_chunks, k_chunks):
        scale = q.shape[-1] ** -0.5
        out, lse = blocks.start(q)
        blocks.attend(q, k, v, q_chunks, k_chunks, out, lse, scale)
        out = blocks.finish(out, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.scale = (q_chunks, k_chunks), scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        blocks.attend_backward(q, k, v, dout, out, lse, *ctx.chunks, dq, dk, dv, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def allgather_attention(q, k, v, cpg: ContextGroup, layout: str = "zigzag"):
    """(O, lse) of this rank's queries over the whole sequence; q [b, H, n, d], k, v [b, KV, n, d]
    hold the rank's shard (`layout`: zigzag or contiguous)."""
    kv = GatherKV.apply(torch.stack((k, v)), cpg, layout)  # [2, b, KV, s, d] in sequence order
    chunks = chunk_count(cpg.size, layout)
    return LocalAttention.apply(q, kv[0], kv[1], chunks_of(cpg.index, cpg.size, layout), list(range(chunks)))
