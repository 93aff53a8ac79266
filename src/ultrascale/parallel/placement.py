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
  rectangles;
- a pipeline stage holds only its own parameters.

Ranks holding the same chunk (data-parallel replicas, norms replicated over tp)
describe it identically; the checkpoint writes it once.
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
    """Split the flat range [a, e) of a row-major tensor of `shape` (1-D or 2-D) into
    rectangles: (offsets, sizes, flat start) in the tensor's own coordinates."""
    if len(shape) == 1:
        return [((a,), (e - a,), a)] if e > a else []
    rows, cols = shape
    out = []
    if a % cols and a < e:  # a partial first row
        r, c = divmod(a, cols)
        end = min(e, (r + 1) * cols)
        out.append(((r, c), (1, end - a), a))
        a = end
    if e - a >= cols:  # whole rows
        n = (e - a) // cols
        out.append(((a // cols, 0), (n, cols), a))
        a += n * cols
    if e > a:  # a partial last row
        out.append(((a // cols, 0), (1, e - a), a))
    return out


def chunks_of(index: int, name: str, param, tp_rank: int, flat_start: int, flat_end: int, base: int = 0):
    """The chunks of optimizer tensor `index`, which holds elements [flat_start, flat_end)
    of this rank's `param` (its local, possibly tensor-parallel, shape). `base` is where
    element flat_start sits in the optimizer tensor (0 for whole parameters and ZeRO pieces)."""
    local = tuple(param.shape)
    assert len(local) in (1, 2), f"{name}: only 1-D and 2-D parameters are placed, not {local}"
    full = tuple(getattr(param, "full_shape", local))
    dim = getattr(param, "tp_dim", None)
    shift = [0] * len(local)
    if dim is not None:
        shift[dim] = tp_rank * local[dim]
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
