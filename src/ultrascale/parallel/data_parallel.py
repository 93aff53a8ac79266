"""Data parallelism in the playbook's three steps: naive, overlapped, bucketed.

Every rank holds the whole model and runs its own slice of the global batch;
before the optimizer step the gradients are averaged over the data-parallel
group (dp x cp ranks: context-parallel ranks see other tokens of the same
sequences, so their gradients are averaged too). All modes:

- average, not sum: each gradient is divided by the group size before the
  all-reduce (dividing first keeps low-precision sums in range);
- communicate once per optimizer step: backward passes of all but the last
  micro-batch run inside `no_sync()` and only accumulate (the trainer divides
  each micro-batch's loss by their number, so the sum is the global-batch mean).

naive    wait for the whole backward, then one all-reduce per gradient.
overlap  a hook starts an async all-reduce for each gradient as soon as it is
         ready, while backward computes the next ones; wait before the step.
bucket   gradients live in flat buffers (see buckets.py); one async all-reduce
         per bucket, started when its last gradient is in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ultrascale.parallel.buckets import LaunchOrder, make_buckets
from ultrascale.parallel.grads import LocalGrads
from ultrascale.spans import comm


class _DataParallel(LocalGrads):
    def __init__(self, params, dtype, group, world: int):
        self.group, self.world = group, world
        super().__init__(params, dtype)

    def replica_index(self, p) -> int:
        """Every rank of the group holds the same replica: the first writes it."""
        return dist.get_rank(self.group) if self.world > 1 else 0


class NaiveDataParallel(_DataParallel):
    def finish(self) -> None:
        for p in self.params:
            p.main_grad.div_(self.world)
            with comm("dp.all_reduce"):
                dist.all_reduce(p.main_grad, group=self.group)


class OverlapDataParallel(_DataParallel):
    def __init__(self, params, dtype, group, world):
        super().__init__(params, dtype, group, world)
        self._pending = []

    def on_grad_ready(self, p) -> None:
        if self._sync:
            # Every rank runs the same graph, so hooks fire in the same order and the
            # collectives match up across ranks.
            p.main_grad.div_(self.world)
            with comm("dp.all_reduce"):
                self._pending.append(dist.all_reduce(p.main_grad, group=self.group, async_op=True))

    def finish(self) -> None:
        with comm("dp.wait"):
            for work in self._pending:
                work.wait()
        self._pending = []


class BucketedDataParallel(_DataParallel):
    def __init__(self, params, dtype, group, world, bucket_mb: float, comm_dtype: str = "fp32"):
        self.bucket_bytes = bucket_mb * 2**20
        self.comm_dtype = torch.bfloat16 if comm_dtype == "bf16" else None
        super().__init__(params, dtype, group, world)

    def _allocate(self) -> None:
        self.buckets = make_buckets(self.params, self.bucket_bytes)
        self._bucket_of = {}
        for b in self.buckets:
            b.grad = torch.zeros(b.numel, dtype=torch.float32, device=b.params[0].device)
            for i, p in enumerate(b.params):
                p.main_grad = b.view(b.grad, i)  # a view: accumulating into it fills the bucket
                self._bucket_of[p] = b
        self._order = LaunchOrder(self.buckets)
        self._pending = []

    def zero(self) -> None:
        for b in self.buckets:
            b.grad.zero_()

    def on_grad_ready(self, p) -> None:
        if not self._sync:
            return
        for b in self._order.mark(self._bucket_of[p]):
            self._launch(b)

    def _launch(self, b) -> None:
        b.grad.div_(self.world)
        if self.comm_dtype is None:
            with comm("dp.bucket_all_reduce"):
                self._pending.append((dist.all_reduce(b.grad, group=self.group, async_op=True), b, None))
        else:
            # Communication hook: send half the bytes; the sum is rounded to bf16 (changes numerics).
            low = b.grad.to(self.comm_dtype)
            with comm("dp.bucket_all_reduce"):
                self._pending.append((dist.all_reduce(low, group=self.group, async_op=True), b, low))

    def finish(self) -> None:
        # A bucket whose parameters got no gradient this step still has to be reduced.
        for b in self._order.remaining():
            self._launch(b)
        for work, b, low in self._pending:
            with comm("dp.wait"):
                work.wait()
            if low is not None:
                b.grad.copy_(low)
        self._order.reset()
        self._pending = []


def build_data_parallel(model, params, ctx, cfg):
    p, dtype = cfg.parallel, cfg.train.dtype
    group, world = ctx.group("dp_cp"), ctx.size("dp_cp")
    if p.zero == 3:
        from ultrascale.parallel.zero3 import Zero3

        return Zero3(model, params, dtype, group, world, ctx.index("dp_cp"), p.offload, p.offload_dir)
    if p.zero:
        from ultrascale.parallel.zero import ZeroDataParallel

        buckets = make_buckets(params, p.bucket_mb * 2**20, pad_to=world)
        return ZeroDataParallel(params, dtype, group, world, ctx.index("dp_cp"), p.zero, buckets,
                                p.offload, p.offload_dir)
    if p.dp_mode == "naive":
        return NaiveDataParallel(params, dtype, group, world)
    if p.dp_mode == "overlap":
        return OverlapDataParallel(params, dtype, group, world)
    return BucketedDataParallel(params, dtype, group, world, p.bucket_mb, p.dp_comm_dtype)
