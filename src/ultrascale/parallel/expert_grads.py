"""Gradients under expert parallelism: two owners behind the trainer's one interface.

The right gradient of any weight is the average over the dp ranks of their local
gradients, (1/dp) * sum_r dL_r/dW: the trainer's loss is the mean over each
rank's tokens, and the global batch is the dp ranks' slices.

- Dense weights (attention, norms, router, shared expert, embeddings) are
  replicated on every dp rank, each with its own tokens' gradient: averaged over
  dp_cp, exactly as data parallelism does (any --dp-mode, ZeRO).
- An expert weight lives on one rank of each expert group. The all-to-all brought
  it the tokens of all ep ranks of its group, so its local gradient is already
  sum_{r in group} dL_r/dW. The dp/ep replicas of that expert (one per group, the
  expert-data-parallel group `edp`) sum these to sum over all r, and the result is
  divided by dp: not by the edp size, which would leave it ep times too large.

The gradient norm counts every tensor once: the squared norms are summed over
dp_cp with weights 1/dp_cp for replicated dense gradients, 1/edp for replicated
expert gradients (different experts on the ep ranks are all counted), 1 for
ZeRO shards (each element lives on one rank).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ultrascale.parallel.grads import LocalGrads
from ultrascale.spans import comm


def is_expert(p) -> bool:
    return getattr(p, "ep_offset", None) is not None


class ExpertReplicas(LocalGrads):
    """Expert gradients summed over the edp group and divided by dp (once per optimizer step)."""

    def __init__(self, params, dtype, group, divisor: int):
        self.group, self.divisor = group, divisor
        super().__init__(params, dtype)

    def finish(self) -> None:
        for p in self.params:
            p.main_grad.div_(self.divisor)
            if self.group is not None:
                with comm("ep.grad_all_reduce"):
                    dist.all_reduce(p.main_grad, group=self.group)


class _JoinedMain:
    """The optimizer's tensors of several owners, one list (OptimizerTensors; on the device: expert
    parallelism does not offload)."""

    where = None

    def __init__(self, mains):
        self.mains = mains
        self.main = [m for main in mains for m in main.main]
        self.decay = [d for main in mains for d in main.decay]

    def attach_grads(self, grads) -> None:
        for m, g in zip(self.main, grads):
            m.grad = g

    def detach_grads(self) -> None:
        for m in self.main:
            m.grad = None

    def copy_to_model(self) -> None:
        for main in self.mains:
            main.copy_to_model()

    def master_bytes(self) -> int:
        return sum(main.master_bytes() for main in self.mains)

    def offloaded_bytes(self) -> int:
        return 0


class ExpertParallelGrads:
    def __init__(self, model, params, ctx, cfg):
        from ultrascale.parallel.buckets import make_buckets
        from ultrascale.parallel.data_parallel import build_data_parallel
        from ultrascale.parallel.zero import ZeroDataParallel

        self.params, self.ctx = params, ctx
        dense = [p for p in params if not is_expert(p)]
        experts = [p for p in params if is_expert(p)]
        self.dense = build_data_parallel(model, dense, ctx, cfg)
        dp, edp, dtype, zero = ctx.size("dp_cp"), ctx.size("edp"), cfg.train.dtype, cfg.parallel.zero
        if zero and edp > 1:
            buckets = make_buckets(experts, cfg.parallel.bucket_mb * 2**20, pad_to=edp)
            self.expert = ZeroDataParallel(experts, dtype, ctx.group("edp"), edp, ctx.index("edp"), zero, buckets)
            self.expert.divisor = dp  # reduce-scatter over edp, divided by dp (see the module docstring)
        else:
            self.expert = ExpertReplicas(experts, dtype, ctx.group("edp"), dp)
        self.owners = [self.dense, self.expert]
        self.main = _JoinedMain([o.main for o in self.owners])
        # Weights of each gradient in the squared norm summed over dp_cp (module docstring).
        self._norm_shares = ([1.0 if isinstance(self.dense, ZeroDataParallel) else 1.0 / dp]
                             * len(self.dense.grads())
                             + [1.0 if isinstance(self.expert, ZeroDataParallel) else 1.0 / edp]
                             * len(self.expert.grads()))
        self._replica = {}
        for owner, group in ((self.dense, "dp_cp"), (self.expert, "edp")):
            for p in owner.params:
                self._replica[id(p)] = 0 if isinstance(owner, ZeroDataParallel) else ctx.index(group)

    @contextlib.contextmanager
    def no_sync(self):
        with self.dense.no_sync(), self.expert.no_sync():
            yield

    def zero(self) -> None:
        for o in self.owners:
            o.zero()

    def finish(self) -> None:
        for o in self.owners:
            o.finish()

    def grads(self) -> list[torch.Tensor]:
        return self.dense.grads() + self.expert.grads()

    def grad_owners(self):
        return self.dense.grad_owners() + self.expert.grad_owners()

    def norm_shares(self) -> list[float]:
        return self._norm_shares

    def reduce_norm_sq(self, sq):
        with comm("grad_norm.all_reduce"):
            dist.all_reduce(sq, group=self.ctx.group("dp_cp"))
        return sq

    def param_tensors(self):
        return list(self.dense.param_tensors()) + list(self.expert.param_tensors())

    def main_ranges(self):
        return self.dense.main_ranges() + self.expert.main_ranges()

    def replica_index(self, p) -> int:
        """This rank's index among the ranks holding the same copy of p's optimizer state (0 writes it)."""
        return self._replica[id(p)]

    def full_params(self):
        return self._in_order(self.dense.full_params(), self.expert.full_params())

    def full_grads(self):
        return self._in_order(self.dense.full_grads(), self.expert.full_grads())

    def _in_order(self, dense, experts):
        """Per parameter in `params` order (this rank's experts only: full_state gathers them over ep)."""
        by_id = {id(p): t for o, ts in ((self.dense, dense), (self.expert, experts)) for p, t in zip(o.params, ts)}
        return [by_id[id(p)] for p in self.params]
