"""ZeRO-3: parameters sharded too, gathered one unit at a time, just in time.

A unit is one transformer block, or the "root" (everything outside the blocks:
embedding, final norm, head). Each unit keeps a persistent shard of its flat
parameters (1/N_d) and a full flat buffer whose storage exists only while the
unit is in use: the parameters are views into it, so the model code runs
unchanged. Freeing is `storage.resize_(0)`, re-gathering is `resize_` back and
an all-gather into the same storage: views, and the tensors autograd saved for
backward, stay valid across the cycle.

Timeline of one micro-batch (F = forward, B = backward, L blocks):
  root gathered before F, kept until its gradients are in (last in B);
  block i: gather before F(i) (already in flight: prefetched during F(i-1)),
           free after F(i); gather again when the gradient reaches its output
           (prefetching block i-1), free once all its gradients are in and
           their reduce-scatter started.
"""

from __future__ import annotations

import torch

from ultrascale.parallel.buckets import Bucket
from ultrascale.parallel.zero import ZeroDataParallel, _all_gather
from ultrascale.spans import comm


def _units(model, params, world) -> list[Bucket]:
    """[block L-1, ..., block 0, root]: the order in which backward completes their gradients."""
    owned = {id(p) for p in params}
    groups = [[p for p in block.parameters() if id(p) in owned] for block in reversed(model.layers.values())]
    in_blocks = {id(p) for g in groups for p in g}
    groups.append([p for p in params if id(p) not in in_blocks])
    units = []
    for k, ps in enumerate(g for g in groups if g):
        b = Bucket(k)
        for p in ps:
            b.offsets.append(b.numel)
            b.params.append(p)
            b.numel += p.numel()
        b.numel = -(-b.numel // world) * world
        units.append(b)
    return units


class Zero3(ZeroDataParallel):
    def __init__(self, model, params, dtype, group, world, rank, offload="none", offload_dir=""):
        super().__init__(params, dtype, group, world, rank, stage=3, buckets=_units(model, params, world),
                         offload=offload, offload_dir=offload_dir)
        self.root = self.buckets[-1]
        blocks = list(model.layers.values())
        self.block_units = list(reversed(self.buckets[:len(blocks)]))  # forward order
        model.register_forward_pre_hook(lambda m, args: self._gather(self.root))
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, args, i=i: self._pre_forward(i))
            block.register_forward_hook(lambda m, args, out, i=i: self._post_forward(i, out))

    # -- the shard is what persists ------------------------------------------
    def _place(self, b) -> None:
        lo, hi = b.shard
        if self.offload != "none":  # the shard lives in host memory, copied over at each gather
            from ultrascale.parallel.offload import host_empty

            b.param_shard = host_empty(hi - lo, b.param_flat.dtype, b.param_flat.device).copy_(b.param_flat[lo:hi])
        else:
            b.param_shard = b.param_flat[lo:hi].clone()
        b.nbytes = b.param_flat.untyped_storage().nbytes()
        b.work = None
        self._free(b)

    def _shard_view(self, b, start, end):
        return b.param_shard[start - b.shard[0]:end - b.shard[0]]

    def _after_update(self) -> None:
        """The optimizer wrote into the shards; the next forward gathers them."""

    def param_tensors(self):
        return [b.param_shard for b in self.buckets]

    # -- gather / free ------------------------------------------------------
    def _start_gather(self, b) -> None:
        if b.gathered or b.work is not None:
            return
        b.param_flat.untyped_storage().resize_(b.nbytes)
        shard = b.param_shard
        if self.offload != "none":
            # Host -> device into this rank's slot of the full buffer, then gather in place (as ZeRO-1 does).
            shard = b.param_flat[b.shard[0]:b.shard[1]]
            shard.copy_(b.param_shard, non_blocking=True)
        with comm("zero.all_gather"):
            b.work = _all_gather(b.param_flat, shard, group=self.group, async_op=True)

    def _gather(self, b) -> None:
        self._start_gather(b)
        if b.work is not None:
            with comm("zero.wait"):
                b.work.wait()
            b.work, b.gathered = None, True

    def _free(self, b) -> None:
        b.param_flat.untyped_storage().resize_(0)
        b.gathered = False

    # -- module hooks -------------------------------------------------------
    def _pre_forward(self, i: int) -> None:
        self._start_gather(self.block_units[i])  # first what is needed now: collectives run in launch order
        if i + 1 < len(self.block_units) and torch.is_grad_enabled():
            self._start_gather(self.block_units[i + 1])  # prefetch: overlaps block i's compute
        self._gather(self.block_units[i])

    def _post_forward(self, i: int, out) -> None:
        self._free(self.block_units[i])
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad: self._pre_backward(i))

    def _pre_backward(self, i: int) -> None:
        self._start_gather(self.block_units[i])
        if i > 0:
            self._start_gather(self.block_units[i - 1])  # backward walks the blocks in reverse
        self._gather(self.block_units[i])

    def _launched(self, b) -> None:
        # All of this unit's gradients are in and being reduce-scattered: free its parameters.
        self._free(b)
