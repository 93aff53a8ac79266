"""ZeRO: remove data parallelism's redundancy, one kind of state at a time.

Plain data parallelism keeps, on every one of N_d ranks, all parameters, all
gradients and all optimizer state. ZeRO (Rajbhandari et al. 2020) cuts each
bucket into N_d shards (buckets.py) and lets rank r own shard r:

ZeRO-1  optimizer state (and fp32 master weights) sharded. Gradients are
        reduce-scattered (each rank receives the average of its shard only),
        each rank updates its shard, then the parameters are all-gathered.
ZeRO-2  + gradients sharded: each bucket is reduce-scattered as soon as it is
        complete during backward and its full buffer is freed; a rank keeps only
        its shard, accumulated over micro-batches (so ZeRO-2 communicates every
        micro-batch: skipping it would mean keeping full gradients).
ZeRO-3  + parameters sharded (FSDP): one unit per transformer block, plus one
        for what lies outside the blocks (embedding, final norm, head). A unit's
        parameters are all-gathered just before its forward and freed after it,
        gathered again just before its backward and freed once its gradients
        are reduce-scattered; the next unit's all-gather is started early
        (prefetch) so it overlaps the current unit's compute.

Per-rank bytes, with Psi parameters and our recipe (fp32 gradients; bf16 adds
fp32 master weights to the optimizer state, k = 12, or k = 8 in fp32):
  DP     b*Psi + 4*Psi + k*Psi              (b = 2 for bf16, 4 for fp32)
  ZeRO-1 b*Psi + 4*Psi + k*Psi/N_d
  ZeRO-2 b*Psi + (4*Psi + k*Psi)/N_d
  ZeRO-3 (b*Psi + 4*Psi + k*Psi)/N_d
plus at most N_d - 1 padding elements per bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ultrascale.distributed.flat import all_gather as _all_gather
from ultrascale.distributed.flat import reduce_scatter as _reduce_scatter
from ultrascale.parallel.buckets import Bucket, LaunchOrder
from ultrascale.parallel.grads import LocalGrads
from ultrascale.parallel.precision import DTYPES, MainParams
from ultrascale.spans import comm


class ShardedMainParams(MainParams):
    """The optimizer's view under ZeRO: one fp32 tensor per piece of a parameter in this rank's shards.

    AdamW works element by element, so updating pieces gives exactly what
    updating whole parameters would; only weight decay needs to know which
    parameter a piece came from. Pieces are (bucket, start, end) in the
    bucket's flat coordinates.
    """

    def __init__(self, pieces, main, decay, shard_view, mixed, after_update):
        # Not MainParams.__init__: the cast and the masters are made per piece by ZeRO.
        self.pieces, self.main, self.decay = pieces, main, decay
        self.shard_view, self.mixed, self.after_update = shard_view, mixed, after_update

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if self.mixed:  # in fp32 the pieces are views of the parameters: already updated
            for (b, start, end), m in zip(self.pieces, self.main):
                self.shard_view(b, start, end).copy_(m)
        self.after_update()


class ZeroDataParallel(LocalGrads):
    """ZeRO stages 1 and 2 over size-capped buckets (stage 3 extends it in zero3.py)."""

    def __init__(self, params, dtype, group, world, rank, stage, buckets, offload="none", offload_dir=""):
        self.group, self.world, self.rank, self.stage = group, world, rank, stage
        # --offload cpu | disk: the optimizer's shard lives off the device (parallel/offload.py).
        self.offload, self.offload_dir = offload, offload_dir
        # Gradients are divided by this before the sum: the group size, except for expert
        # weights under expert parallelism (parallel/expert_grads.py), where it is dp.
        self.divisor = world
        self.buckets: list[Bucket] = buckets
        self._bucket_of = {p: b for b in buckets for p in b.params}
        self._callback_queued = False
        super().__init__(params, dtype)
        self._reset()

    # -- parameters: flat buffers, shards, and the optimizer's pieces -------
    def _make_main(self, dtype: str):
        mixed = dtype != "fp32"
        offloaded = self.offload != "none"
        pieces, main, decay = [], [], []
        self._piece_owners = []
        for b in self.buckets:
            b.shard = b.shard_range(self.rank, self.world)
            b.param_flat = torch.zeros(b.numel, dtype=DTYPES[dtype], device=b.params[0].device)
            with torch.no_grad():
                for i, p in enumerate(b.params):
                    b.view(b.param_flat, i).copy_(p.detach())
            for i, start, end in b.pieces(self.rank, self.world):
                p, off = b.params[i], b.offsets[i]
                initial = p.detach().flatten()[start - off:end - off]
                if offloaded:  # the offloaded states copy them where they live
                    main.append(initial)
                elif mixed:  # masters copy the fp32 initial values, before any rounding
                    main.append(nn.Parameter(initial.clone()))
                pieces.append((b, start, end))
                decay.append(p.ndim >= 2)
                self._piece_owners.append(p)
            for i, p in enumerate(b.params):
                p.data = b.view(b.param_flat, i)
            self._place(b)
        if offloaded:
            from ultrascale.parallel.offload import OffloadedMain

            return OffloadedMain(pieces, main, decay, self._shard_view, self._after_update,
                                 self.buckets[0].params[0].device, self.offload, self.offload_dir, self.rank)
        if not mixed:
            # fp32: the optimizer updates this rank's shard of the parameters in place.
            main = [nn.Parameter(self._shard_view(b, s, e), requires_grad=False) for b, s, e in pieces]
        return ShardedMainParams(pieces, main, decay, self._shard_view, mixed, self._after_update)

    def _place(self, b) -> None:
        """Stage 3 keeps only the shard of the parameters; stages 1 and 2 keep them whole."""

    def _shard_view(self, b, start, end):
        """Flat range [start, end) of this rank's shard of the parameters, where the optimizer writes."""
        return b.param_flat[start:end]

    def _after_update(self) -> None:
        # Every rank updated its shard; all-gather puts the whole bucket back on every rank.
        with comm("zero.all_gather"):
            works = [_all_gather(b.param_flat, b.param_flat[b.shard[0]:b.shard[1]], group=self.group,
                                 async_op=True) for b in self.buckets]
        with comm("zero.wait"):
            for w in works:
                w.wait()

    # -- gradients ----------------------------------------------------------
    def _allocate(self) -> None:
        for b in self.buckets:
            device = b.params[0].device
            if self.stage == 1:
                b.grad = torch.zeros(b.numel, dtype=torch.float32, device=device)
                for i, p in enumerate(b.params):
                    p.main_grad = b.view(b.grad, i)
            else:
                b.grad = None  # the full buffer exists only during backward
                b.grad_shard = torch.zeros(b.shard[1] - b.shard[0], dtype=torch.float32, device=device)
                b.shard_fresh = False

    def _reset(self) -> None:
        self._order = LaunchOrder(self.buckets)
        self._pending = []

    def _accumulate(self, p) -> None:
        b = self._bucket_of[p]
        if self.stage >= 2:
            if b.grad is None:
                # Not zero-filled: each parameter's first gradient is copied in (see below).
                b.grad = torch.empty(b.numel, dtype=torch.float32, device=p.device)
                b.written = set()
                for i, q in enumerate(b.params):
                    q.main_grad = b.view(b.grad, i)
            if not self._callback_queued:
                # Runs when this backward pass ends: drain the reduce-scatters of this micro-batch.
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._callback_queued = True
        super()._accumulate(p)

    def _add_into_main_grad(self, p) -> None:
        if self.stage == 1:
            return super()._add_into_main_grad(p)
        b = self._bucket_of[p]
        if p in b.written:
            p.main_grad.add_(p.grad)
        else:
            p.main_grad.copy_(p.grad)
            b.written.add(p)

    def on_grad_ready(self, p) -> None:
        if not self._sync and self.stage == 1:
            return  # ZeRO-1 keeps full gradients: reduce once, after the last micro-batch
        for b in self._order.mark(self._bucket_of[p]):
            self._launch(b)

    def _launch(self, b) -> None:
        lo, hi = b.shard
        if self.stage == 1:
            out = b.grad[lo:hi]  # in place: this rank's slice of the bucket receives the average of that slice
        else:
            self._fill_unwritten(b)
            if b.shard_fresh:  # first reduction since zero(): write the shard directly, nothing to add to
                out, b.shard_fresh = b.grad_shard, False
            else:
                out = torch.empty(hi - lo, dtype=torch.float32, device=b.grad.device)
        b.grad.div_(self.divisor)
        with comm("zero.reduce_scatter"):
            self._pending.append((_reduce_scatter(out, b.grad, group=self.group, async_op=True), b, out))
        self._launched(b)
        if self.stage >= 2 and len(self._pending) > 2:
            self._retire(self._pending.pop(0))  # bound the full gradient buffers alive at once

    def _fill_unwritten(self, b) -> None:
        """Zero what no gradient was copied into: padding, and parameters unused in this backward."""
        used = b.offsets[-1] + b.params[-1].numel()
        b.grad[used:].zero_()
        for i, q in enumerate(b.params):
            if q not in b.written:
                b.view(b.grad, i).zero_()

    def _launched(self, b) -> None:
        """Stage 3: a unit whose gradients are all in no longer needs its parameters."""

    def _retire(self, item) -> None:
        work, b, out = item
        with comm("zero.wait"):
            work.wait()
        if self.stage >= 2:
            if out is not b.grad_shard:
                b.grad_shard.add_(out)
            b.grad = None
            for q in b.params:
                q.main_grad = None  # drop the views, or they keep the full buffer alive

    def _drain(self) -> None:
        for b in self._order.remaining():
            if self.stage == 1 or b.grad is not None:  # stage 2/3: skip buckets no gradient reached
                self._launch(b)
        for item in self._pending:
            self._retire(item)
        self._reset()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._drain()

    def finish(self) -> None:
        self._drain()
        for b in self.buckets:
            if self.stage >= 2 and b.shard_fresh:  # no gradient reached it this step
                b.grad_shard.zero_()
                b.shard_fresh = False

    def zero(self) -> None:
        for b in self.buckets:
            if self.stage == 1:
                b.grad.zero_()
            else:
                b.shard_fresh = True  # the first reduce-scatter overwrites it: no need to fill zeros

    def grads(self):
        if self.stage == 1:
            return [b.grad[s:e] for b, s, e in self.main.pieces]
        return [b.grad_shard[s - b.shard[0]:e - b.shard[0]] for b, s, e in self.main.pieces]

    def grad_owners(self):
        return self._piece_owners

    def reduce_norm_sq(self, sq):
        with comm("grad_norm.all_reduce"):
            dist.all_reduce(sq, group=self.group)  # each rank holds a different shard
        return sq

    # -- where the optimizer's pieces sit, and full tensors -----------------
    def main_ranges(self):
        # By identity: comparing parameters with == would read ZeRO-3's freed storage.
        offset = {id(p): off for b in self.buckets for p, off in zip(b.params, b.offsets)}
        return [(p, start - offset[id(p)], end - offset[id(p)])
                for (_, start, end), p in zip(self.main.pieces, self._piece_owners)]

    @torch.no_grad()
    def _full(self, pieces):
        """Whole tensors from this rank's pieces (of the master weights or of the gradients):
        an all-reduce of zero-padded shards, simple, and used only for checks and export."""
        flats = {id(b): torch.zeros(b.numel, dtype=torch.float32, device=b.params[0].device) for b in self.buckets}
        for (b, start, end), m in zip(self.main.pieces, pieces):
            flats[id(b)][start:end] = m.detach().float()
        by_param = {}
        for b in self.buckets:
            dist.all_reduce(flats[id(b)], group=self.group)
            for i, p in enumerate(b.params):
                by_param[p] = b.view(flats[id(b)], i).clone()
        return [by_param[p] for p in self.params]
