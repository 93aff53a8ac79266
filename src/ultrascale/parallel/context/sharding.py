"""Sequence sharding: which tokens of every sequence a context-parallel rank holds.

contiguous (ring, ulysses): rank r of cp holds positions [r·s/cp, (r+1)·s/cp).
zigzag (zigzag, allgather): the sequence is cut into 2·cp equal chunks and rank r
        holds chunks r and 2·cp−1−r, in that order.

Why zig-zag: under the causal mask a query at position i attends to i + 1 keys,
so with contiguous shards the work grows with the rank (the last rank's queries
see the whole sequence, the first's only their own block). Pairing an early
chunk with its mirror image from the end gives every rank the same number of
(query, key) pairs. The all-gather variant shards this way too (as Llama 3's
all-gather attention does): it attends to the whole gathered sequence, so the
balance is free. The ring keeps contiguous shards: it is the naive form that
zig-zag improves on. Ulysses attends whole sequences of a head shard: balanced
whatever the sharding.

Every token-wise tensor of a micro-batch (inputs, targets) is cut the same way,
and RoPE is given the global positions of the shard: a rank's tokens are
rotated by the angles they would get in the whole sequence. Each rank's loss is
the mean over its own tokens; the shards are equal, so the average over the
dp x cp ranks (which the gradient reduction and the logged loss already take)
is the mean over every token of the global batch.
"""

from __future__ import annotations

import torch

# Which sharding each attention variant reads its tokens in.
LAYOUT = {"allgather": "zigzag", "ring": "contiguous", "ulysses": "contiguous", "zigzag": "zigzag"}


def chunk_count(cp: int, layout: str) -> int:
    """Equal chunks each sequence is cut into."""
    return 2 * cp if layout == "zigzag" else cp


def chunks_of(rank: int, cp: int, layout: str) -> list[int]:
    """The global indices of the chunks `rank` holds, in the order it stores them."""
    return [rank, 2 * cp - 1 - rank] if layout == "zigzag" else [rank]


def storage_order(cp: int, layout: str) -> list[int]:
    """The global chunk indices of the ranks' shards laid end to end in rank order (what an
    all-gather of the shards holds): [0, 1, .., cp-1] contiguous, [0, 2cp-1, 1, 2cp-2, ..] zig-zag."""
    return [c for r in range(cp) for c in chunks_of(r, cp, layout)]


def shard_positions(seq_len: int, rank: int, cp: int, layout: str, device=None) -> torch.Tensor:
    """The global positions of rank's tokens, int64 [seq_len / cp]."""
    size = seq_len // chunk_count(cp, layout)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunks_of(rank, cp, layout)])


def shard_micro_batches(micro_batches, rank: int, cp: int, variant: str):
    """[(inputs, targets)] of whole sequences -> [(inputs, targets, positions)] of this rank's shard.
    The shards are copies (index_select), so what the embedding and the loss keep for backward is
    the shard, not the whole batch it was cut from."""
    out = []
    for inputs, targets in micro_batches:
        positions = shard_positions(inputs.shape[1], rank, cp, LAYOUT[variant], inputs.device)
        out.append((inputs.index_select(1, positions), targets.index_select(1, positions), positions))
    return out
