"""DeepSpeed-Ulysses: trade the sequence shard for a head shard around attention.

Before attention each rank holds all heads of s/cp tokens. One all-to-all per
q, k and v gives it instead the whole sequence of heads/cp heads (and
kv_heads/cp key heads: GQA groups stay whole, since both counts divide by cp);
attention is then ordinary full causal attention, any kernel will do (here the
model's own, scaled_dot_product_attention); one all-to-all brings the output
back to the sequence shard. Backward is the reverse all-to-all of each.

Four all-to-alls per layer each way, each moving 1/cp of a rank's q, k, v or
output: the volume per rank stays constant as cp grows with the sequence. The
limit: cp x tp must divide the key/value heads.
"""

from __future__ import annotations

from ultrascale.model.transformer import causal_attention
from ultrascale.parallel.context.comm import AllToAll, ContextGroup

# Attention runs on [b, heads, s, d] views of [b, s, heads, d] memory; the trades are done on that memory.
SEQ, HEADS = 1, 2


def _seq_to_heads(x, cpg):
    return AllToAll.apply(x.transpose(1, 2), cpg, HEADS, SEQ).transpose(1, 2)


def _heads_to_seq(x, cpg):
    return AllToAll.apply(x.transpose(1, 2), cpg, SEQ, HEADS).transpose(1, 2)


def local_attention(q, k, v):
    """Full causal attention of a head shard over the whole sequence (the model's own SDPA call)."""
    return causal_attention(q, k, v)


def ulysses_attention(q, k, v, cpg: ContextGroup):
    """O of this rank's contiguous block of queries; q [b, H, n, d], k, v [b, KV, n, d]."""
    if q.shape[1] % cpg.size or k.shape[1] % cpg.size:
        raise ValueError(f"Ulysses over cp = {cpg.size} needs heads ({q.shape[1]}) and key/value heads "
                         f"({k.shape[1]}) divisible by it")
    out = local_attention(_seq_to_heads(q, cpg), _seq_to_heads(k, cpg), _seq_to_heads(v, cpg))
    return _heads_to_seq(out, cpg)
