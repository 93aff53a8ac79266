"""The communication of context parallelism, one pattern per family of variants, counted.

- ring exchange (ring, zigzag): send a block to the next rank of the cp group and
  receive the previous rank's, non-blocking, so attention on the block in hand
  runs while the next one travels;
- all-gather of K and V (allgather), put in sequence order; its backward
  reduce-scatters their gradients;
- all-to-all (ulysses): a sequence shard of all heads traded for the whole
  sequence of a head shard, and back; its backward is the reverse all-to-all.

Every call adds one to COUNTS["<phase> <op>"] (phase: forward or backward), so
the tests can hold each variant to the messages its algorithm prescribes.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ultrascale.distributed.flat import all_gather as _all_gather
from ultrascale.distributed.flat import reduce_scatter as _reduce_scatter
from ultrascale.parallel.context.sharding import storage_order
from ultrascale.spans import comm

COUNTS: collections.Counter = collections.Counter()


def _count(phase: str, op: str) -> None:
    COUNTS[f"{phase} {op}"] += 1


@dataclass(frozen=True)
class ContextGroup:
    """This rank's context-parallel group: the process group, its global ranks in cp order, our index."""

    group: object
    ranks: tuple
    index: int

    @classmethod
    def of(cls, ctx) -> "ContextGroup":
        return cls(ctx.group("cp"), tuple(ctx.group_ranks["cp"]), ctx.index("cp"))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]


class _InFlight:
    """A posted exchange: wait() returns the received block (and keeps the sent one alive till then)."""

    def __init__(self, works, sent, received):
        self.works, self.sent, self.received = works, sent, received

    def wait(self):
        with comm("cp.wait"):
            for w in self.works:
                w.wait()
        return self.received


def ring_exchange(t: torch.Tensor, cpg: ContextGroup, tag: int, phase: str) -> _InFlight:
    """Post: send t to the next rank, receive the previous rank's tensor of the same shape."""
    t = t.contiguous()
    received = torch.empty_like(t)
    # One batch: NCCL groups the pair (no deadlock when next == prev); gloo posts both.
    with comm("cp.send_recv"):
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, cpg.next, cpg.group, tag),
                                        dist.P2POp(dist.irecv, received, cpg.prev, cpg.group, tag)])
    _count(phase, "send")
    _count(phase, "recv")
    return _InFlight(works, t, received)


class GatherKV(torch.autograd.Function):
    """K and V stacked, [2, b, KV, n, d] per rank -> [2, b, KV, cp·n, d], the whole sequence in order:
    the ranks' shards gathered, then their chunks put in sequence order (zig-zag shards hold two
    chunks far apart). Backward: the gradient's chunks back in rank order, each rank's shard summed
    over the ranks (reduce-scatter)."""

    @staticmethod
    def forward(ctx, kv, cpg: ContextGroup, layout: str):
        p, stored = cpg.size, storage_order(cpg.size, layout)
        ctx.cpg, ctx.stored = cpg, stored
        gathered = torch.empty((p,) + kv.shape, dtype=kv.dtype, device=kv.device)
        with comm("cp.all_gather"):
            _all_gather(gathered.view(-1), kv.contiguous().view(-1), group=cpg.group)
        _count("forward", "all_gather")
        two, b, h, n, d = kv.shape
        chunks = len(stored)
        by_chunk = gathered.view(p, two, b, h, chunks // p, n * p // chunks, d).permute(1, 2, 3, 0, 4, 5, 6)
        by_chunk = by_chunk.reshape(two, b, h, chunks, -1, d)  # the chunks as gathered: rank by rank
        if stored != sorted(stored):
            where = torch.tensor([stored.index(c) for c in range(chunks)], device=kv.device)
            by_chunk = by_chunk.index_select(3, where)
        return by_chunk.reshape(two, b, h, p * n, d)

    @staticmethod
    def backward(ctx, grad):
        p, stored = ctx.cpg.size, ctx.stored
        two, b, h, s, d = grad.shape
        by_chunk = grad.reshape(two, b, h, len(stored), s // len(stored), d)
        if stored != sorted(stored):
            by_chunk = by_chunk.index_select(3, torch.tensor(stored, device=grad.device))
        blocks = by_chunk.reshape(two, b, h, p, s // p, d).permute(3, 0, 1, 2, 4, 5).contiguous()
        mine = torch.empty(blocks.shape[1:], dtype=grad.dtype, device=grad.device)
        with comm("cp.reduce_scatter"):
            _reduce_scatter(mine.view(-1), blocks.view(-1), group=ctx.cpg.group)
        _count("backward", "reduce_scatter")
        return mine, None, None


def all_to_all(x, cpg: ContextGroup, scatter_dim: int, gather_dim: int, phase: str):
    """Cut x into cp pieces along scatter_dim, send piece j to rank j, and concatenate what
    arrives along gather_dim, in rank order."""
    send = torch.stack([piece.contiguous() for piece in x.chunk(cpg.size, dim=scatter_dim)])
    received = torch.empty_like(send)
    with comm("cp.all_to_all"):
        dist.all_to_all_single(received, send, group=cpg.group)
    _count(phase, "all_to_all")
    return torch.cat(received.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """all_to_all as an autograd function: its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, cpg: ContextGroup, scatter_dim: int, gather_dim: int):
        ctx.cpg, ctx.dims = cpg, (scatter_dim, gather_dim)
        return all_to_all(x, cpg, scatter_dim, gather_dim, "forward")

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, ctx.cpg, gather_dim, scatter_dim, "backward"), None, None, None
