"""Where each of this rank's optimizer tensors sits in the single-device model.

A checkpoint that any layout can resume must not store "rank 3's flat shard";
it stores, for each parameter under its single-device name, rectangular
chunks of the full tensor, each with its offsets (what torch.distributed.checkpoint
records for a DTensor). This module describes this rank's tensors that way:

- a plain or data-parallel rank holds whole parameters: one chunk each;
- a tensor-parallel shard is a slab of the full tensor along `tp_dim`, starting
  at tp_rank * shard size; the padding rows of a vocabulary shard lie outside
  the full tensor and are not part of any chunk;
- a ZeRO piece is a flat range [a, e) of a (possibly tensor-parallel) parameter,
  row-major: a partial first row, whole rows, a partial last row: at most three
  rectangles (N-D: the same along the leading dim, recursively);
- an expert-parallel shard [E/ep, ...] of a stacked expert weight starts at its
  first expert, `ep_offset`, along dim 0;
- a pipeline stage holds only its own parameters.

Ranks holding the same chunk (data-parallel replicas, norms replicated over tp,
experts replicated over edp) describe it identically; the checkpoint writes it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chunk:
    """Elements [flat_start, flat_end) of optimizer tensor `index` (row-major) are the rectangle
    offsets .. offsets + sizes of the full parameter `name` of shape `full_shape`."""

    name: str
    full_shape: tuple
    offsets: tuple
    sizes: tuple
    index: int
    flat_start: int
    flat_end: int

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This chunk of `tensor` (shaped like optimizer tensor `index`), as a view."""
        return tensor.view(-1)[self.flat_start:self.flat_end].view(self.sizes)


def _rectangles(shape, a: int, e: int):
    """Split the flat range [a, e) of a row-major tensor of `shape` (any number of dims) into
    rectangles: (offsets, sizes, flat start) in the tensor's own coordinates.

    Along the leading dim: a partial first slab (recursing into it), whole slabs, a partial last
    slab (recursing). A 2-D range gives at most three rectangles, an N-D one at most 2N - 1."""
    if e <= a:
        return []
    if len(shape) == 1:
        return [((a,), (e - a,), a)]
    inner = 1
    for s in shape[1:]:
        inner *= s

    def within(r, lo, hi):  # rectangles of slab r, elements [lo, hi) of it
        return [((r, *o), (1, *z), r * inner + st) for o, z, st in _rectangles(shape[1:], lo, hi)]

    out = []
    if a % inner:  # a partial first slab
        r = a // inner
        end = min(e, (r + 1) * inner)
        out += within(r, a - r * inner, end - r * inner)
        a = end
    if e - a >= inner:  # whole slabs
        n = (e - a) // inner
        out.append(((a // inner, *[0] * (len(shape) - 1)), (n, *shape[1:]), a))
        a += n * inner
    if e > a:  # a partial last slab
        out += within(a // inner, 0, e - a)
    return out


def chunks_of(index: int, name: str, param, tp_rank: int, flat_start: int, flat_end: int, base: int = 0):
    """The chunks of optimizer tensor `index`, which holds elements [flat_start, flat_end)
    of this rank's `param` (its local, possibly tensor-parallel, shape). `base` is where
    element flat_start sits in the optimizer tensor (0 for whole parameters and ZeRO pieces)."""
    local = tuple(param.shape)
    full = tuple(getattr(param, "full_shape", local))
    dim = getattr(param, "tp_dim", None)
    shift = [0] * len(local)
    if dim is not None:
        shift[dim] = tp_rank * local[dim]
    shift[0] += getattr(param, "ep_offset", None) or 0  # an expert-parallel rank's first expert
    out = []
    for offsets, sizes, start in _rectangles(local, flat_start, flat_end):
        glob = [o + s for o, s in zip(offsets, shift)]
        if dim is not None and glob[dim] + sizes[dim] > full[dim]:
            # Vocabulary padding: keep what lies inside the full tensor. Along dim 0 the
            # rows are contiguous, so the kept part is still a contiguous flat range.
            keep = max(0, full[dim] - glob[dim])
            if keep == 0:
                continue
            assert dim == 0, f"{name}: padding along dim {dim} is not placed"
            sizes = (keep, *sizes[1:])
        n = 1
        for s in sizes:
            n *= s
        first = base + start - flat_start
        out.append(Chunk(name, full, tuple(glob), tuple(sizes), index, first, first + n))
    return out
