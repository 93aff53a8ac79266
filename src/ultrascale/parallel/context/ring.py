"""Ring attention (contiguous shards) and its zig-zag form (balanced shards).

Forward: each rank starts with its own K/V block. For cp steps it attends its
queries to the block in hand, merging the block's (O, lse) into its running
result (blocks.merge), while the block travels on: sent to the next rank,
the previous rank's received, non-blocking. cp − 1 exchanges: after them every
rank has seen every block once. Which (query chunk, key chunk) pairs are
computed follows from the chunks' global indices (blocks.chunk_pairs): with
contiguous shards a block from a later rank is skipped whole, so rank r works
on r + 1 blocks (unbalanced); in zig-zag every rank works on the same number
of pairs.

Backward, a second ring: each rank recomputes its pairs' gradients from the
saved O and global lse. dQ stays here. dK and dV belong to the block's owner:
they travel around the ring with the block, each rank adding its part, and one
last exchange brings the sum home. So cp − 1 K/V exchanges and cp dK/dV
exchanges (in fp32, the sum of cp parts).
"""

from __future__ import annotations

import torch

from ultrascale.parallel.context import blocks
from ultrascale.parallel.context.comm import ContextGroup, ring_exchange
from ultrascale.parallel.context.sharding import chunks_of

KV_TAG, DKV_TAG = 11, 12  # both can be in flight between the same two ranks in backward


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cpg: ContextGroup, layout: str):
        p, r, scale = cpg.size, cpg.index, q.shape[-1] ** -0.5
        mine = chunks_of(r, p, layout)
        out, lse = blocks.start(q)
        kv = torch.stack((k, v))  # one message per step
        for step in range(p):
            incoming = ring_exchange(kv, cpg, KV_TAG, "forward") if step + 1 < p else None
            blocks.attend(q, kv[0], kv[1], mine, chunks_of((r - step) % p, p, layout), out, lse, scale)
            if incoming is not None:
                kv = incoming.wait()
        out = blocks.finish(out, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cpg, ctx.layout, ctx.scale = cpg, layout, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse = ctx.saved_tensors
        cpg, layout, scale = ctx.cpg, ctx.layout, ctx.scale
        p, r = cpg.size, cpg.index
        mine = chunks_of(r, p, layout)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        travelling = None  # the dK/dV sum of the block in hand, from the ranks it visited before
        for step in range(p):
            incoming = ring_exchange(kv, cpg, KV_TAG, "backward") if step + 1 < p else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            blocks.attend_backward(q, kv[0], kv[1], dout, out, lse, mine, chunks_of((r - step) % p, p, layout),
                                   dq, dkv[0], dkv[1], scale)
            if travelling is not None:
                dkv += travelling.wait()
            travelling = ring_exchange(dkv, cpg, DKV_TAG, "backward")
            if incoming is not None:
                kv = incoming.wait()
        dkv = travelling.wait()  # after cp exchanges, our own block's gradient, summed over all ranks
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, cpg: ContextGroup, layout: str = "contiguous"):
    """(O, lse) of this rank's queries over the whole sequence; q [b, H, n, d], k, v [b, KV, n, d]
    hold the rank's shard (`layout`: contiguous or zigzag)."""
    return RingAttention.apply(q, k, v, cpg, layout)
