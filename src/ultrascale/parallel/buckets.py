"""Buckets: parameters packed into flat buffers, so one collective moves many of them.

One all-reduce per parameter pays a latency per parameter; one all-reduce of
everything cannot start until the whole backward is done. A bucket is the middle
ground (PyTorch DDP's `bucket_cap_mb`): parameters are grouped in the order
their gradients appear in backward (the reverse of the order they were
registered), up to a size cap; as soon as the last gradient of a bucket is in,
its collective starts while backward goes on with the earlier layers.

For ZeRO each bucket is also cut into dp equal shards, one per rank; the bucket
is padded at its end to a multiple of dp, so the padding (never more than dp - 1
elements) sits in the last rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    index: int
    params: list = field(default_factory=list)
    offsets: list = field(default_factory=list)  # where each parameter starts in the flat buffer
    numel: int = 0  # padded

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's slice of a flat buffer, shaped like the parameter."""
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        size = self.numel // world
        return rank * size, (rank + 1) * size

    def pieces(self, rank: int, world: int):
        """The parts of parameters inside this rank's shard: (i, start, end) in flat-buffer coordinates."""
        lo, hi = self.shard_range(rank, world)
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            start, end = max(lo, off), min(hi, off + p.numel())
            if start < end:
                yield i, start, end


def make_buckets(params, cap_bytes: float, pad_to: int = 1, bytes_per_elem: int = 4) -> list[Bucket]:
    """Group params into buckets of at most cap_bytes (a single larger parameter gets its own)."""
    buckets, current, size = [], Bucket(0), 0
    for p in reversed(params):  # backward order
        nbytes = p.numel() * bytes_per_elem
        if current.params and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = Bucket(len(buckets)), 0
        current.offsets.append(size // bytes_per_elem)
        current.params.append(p)
        size += nbytes
    if current.params:
        buckets.append(current)
    for b in buckets:
        n = b.offsets[-1] + b.params[-1].numel()
        b.numel = -(-n // pad_to) * pad_to
    return buckets


class LaunchOrder:
    """Counts the gradients that reach each bucket and releases full buckets in index order.

    Collectives must be issued in the same order on every rank; gradients may fill the
    buckets in another order (PyTorch DDP enforces the same rule).
    """

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets
        self.reset()

    def reset(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.next = 0

    def mark(self, b: Bucket) -> list[Bucket]:
        """One more gradient in b; the buckets that may be launched now."""
        self.ready[b.index] += 1
        out = []
        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next].params):
            out.append(self.buckets[self.next])
            self.next += 1
        return out

    def remaining(self) -> list[Bucket]:
        """The buckets not launched yet (some of their parameters got no gradient), in order."""
        out, self.next = self.buckets[self.next:], len(self.buckets)
        return out
