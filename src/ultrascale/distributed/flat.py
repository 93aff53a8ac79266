"""The flat collectives (one contiguous tensor in, one out) under one name on every torch of the
package's range: torch 2.13 renamed `reduce_scatter_tensor` and `all_gather_into_tensor` to
`reduce_scatter_single` and `all_gather_single`; older releases have only the old names.

Bound once, here, for every room that shards (ZeRO, tensor, context and expert parallelism)."""

from __future__ import annotations

import torch.distributed as dist

reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
