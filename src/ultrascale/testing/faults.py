"""Deliberate bugs, to prove the equivalence checks can fail.

A check that passes on the engine proves little until it is seen to fail on
an engine that is wrong. Each fault below is a small, realistic mistake in the
parallel algebra, patched into the running process for the duration of one run
(`with inject(name): ...`); the tests assert that `check_against_single` rejects
the run. Several are invisible to a comparison of losses and final parameters
alone: gradient clipping rescales every gradient to the same norm and Adam
divides the scale away, so a constant factor survives only in the gradients.
"""

from __future__ import annotations

import contextlib
from unittest import mock

FAULTS = {
    "grads-scaled-1.01": "every reduced gradient 1% too large (an average over world / 1.01 ranks)",
    "dp-wrong-group-size": "data-parallel gradients divided by N + 1 instead of N",
    "sp-norm-grads-not-summed": "under sequence parallelism, norm weight gradients not summed over tp",
    "last-bucket-dropped": "the last bucket's collective never launched",
    "micro-batch-counted-twice": "the first micro-batch accumulated again in place of the last",
    # Context parallelism (parallel/context/).
    "cp-local-positions": "RoPE given each shard's local positions 0..s/cp-1 instead of its global ones",
    "cp-contiguous-positions": "zig-zag shards rotated by the positions of contiguous shards",
    "cp-grads-reduced-over-dp-only": "gradients averaged over dp, not dp x cp: the cp ranks' parts never combined",
    "cp-merge-by-average": "ring blocks merged by a plain average instead of by their log-sum-exp",
    "cp-no-causal-skip": "key chunks after a query chunk attended to in full instead of skipped",
    "cp-zigzag-read-as-contiguous": "the ring takes zig-zag shards for contiguous ones",
    "cp-scatter-without-sum": "all-gather attention: each rank keeps its own block of dK/dV, not the sum over ranks",
    "cp-gathered-in-rank-order": "all-gather attention: the gathered zig-zag shards read as if in sequence order",
    "cp-all-to-all-reversed": "Ulysses: the all-to-all's pieces concatenated in reverse rank order",
    # Expert parallelism (parallel/expert.py).
    "expert-grads-averaged-over-edp": "expert gradients averaged over edp only (the 1/ep factor forgotten)",
    "all-to-all-backward-dropped": "the dispatch all-to-all's backward returns no gradient to the tokens",
    "all-gather-backward-dropped": "the all-gather dispatch's backward returns no gradient to the tokens",
    "expert-norm-counted-per-replica": "replicated expert gradients counted once per edp replica in the norm",
    # ZeRO-Offload (parallel/offload.py).
    "offload-stale-moment": "offload: the first moment written back to host memory or disk a step late",
    # DualPipeV (parallel/pipeline/runtime.py): the rule ZB-H1 can live with, wrong when a chunk mixes B and I.
    "pp-sync-at-last-b-or-i-and-last-w": "data-parallel reduction launched at each chunk's last B or I and its "
                                         "last W, though a full B may follow that W (or a W that B)",
    # A timing fault, invisible to the losses: what the schedule's clock of a recorded step must show.
    "pp-1f1b-played-as-afab": "1F1B configured, the runtime playing AFAB's action lists: the same losses, "
                              "every micro-batch's activations held",
    # fp16 loss scaling (train/loss_scale.py). The first is a condition, not a bug: the engine must skip
    # the step on every rank; the second adds the bug of deciding the skip on each rank alone.
    "fp16-inf-on-last-rank": "the first step's gradient overflows on the last rank only",
    "fp16-skip-decided-locally": "the overflow above, and each rank decides alone whether to skip (no all-reduce)",
    # Where two features meet (testing/matrix.py): each of these was once the engine's behaviour.
    "fp16-scale-times-dp-cp": "fp16: backward scaled by the full loss scale on every dp x cp rank, so each "
                              "rank's gradients overflow as dp x cp times one process's",
    "adam-steps-from-training-step": "a resumed AdamW counts every training step as an update, fp16's skipped "
                                     "ones included",
    "moe-loads-per-cp-shard": "MoE balance losses from each context-parallel shard's own loads",
    "moe-loads-per-sp-shard": "MoE balance losses from each sequence-parallel shard's own loads",
    # The validation loss (train/trainer.py evaluate).
    "eval-loss-not-averaged": "the validation loss of each rank's own rows and tokens, not averaged over dp x cp",
    "eval-rows-of-rank-0": "every data-parallel rank evaluates rank 0's rows of the validation batch",
}


def _wrap_build_grads(after):
    """Patch the gradient owner the trainer builds: `after(owner)` adjusts it."""
    from ultrascale import parallel

    original = parallel.build_grads

    def build(*args, **kwargs):
        owner = original(*args, **kwargs)
        after(owner)
        return owner

    return mock.patch.object(parallel, "build_grads", build)


def _scale_after_finish(owner, factor):
    finish = owner.finish

    def scaled_finish():
        finish()
        for g in owner.grads():
            g.mul_(factor)

    owner.finish = scaled_finish


def _wrong_group_size(owner):
    from ultrascale.parallel.zero import ZeroDataParallel

    world = getattr(owner, "world", 1)
    if isinstance(owner, ZeroDataParallel):  # world also sets the shards there: scale the launch instead
        launch = owner._launch

        def wrong_launch(b):
            b.grad.mul_(world / (world + 1))
            launch(b)

        owner._launch = wrong_launch
    elif world > 1:
        owner.world = world + 1


def _drop_last_bucket(owner):
    launch = getattr(owner, "_launch", None)
    if launch is None:
        return
    last = max(b.index for b in owner.buckets)
    owner._launch = lambda b: None if b.index == last else launch(b)


def _count_first_twice():
    from ultrascale.train.data import TokenBatches

    original = TokenBatches.micro_batches

    def twice(self, *args, **kwargs):
        mbs = original(self, *args, **kwargs)
        return mbs[:-1] + mbs[:1] if len(mbs) > 1 else mbs

    return mock.patch.object(TokenBatches, "micro_batches", twice)


def _eval_loss_not_averaged():
    """Trainer.evaluate with the context's average over the data ranks turned into the rank's own value."""
    from ultrascale.train.trainer import Trainer

    original = Trainer.evaluate

    def local(self):
        real = self.ctx.all_reduce_mean
        self.ctx.all_reduce_mean = lambda value, name="dp_cp": value
        try:
            return original(self)
        finally:
            self.ctx.all_reduce_mean = real

    return mock.patch.object(Trainer, "evaluate", local)


def _eval_rows_of_rank_0():
    """The validation batches' rows read as data-parallel rank 0's on every rank."""
    from ultrascale.train.trainer import Trainer

    original = Trainer.evaluate

    def rank_0(self):
        val = self.val
        real = val.micro_batches
        val.micro_batches = lambda step, dp_rank, dp, *a, **k: real(step, 0, dp, *a, **k)
        try:
            return original(self)
        finally:
            val.micro_batches = real

    return mock.patch.object(Trainer, "evaluate", rank_0)


def _sp_norms_not_summed():
    from ultrascale.parallel.tensor import apply, layers

    return mock.patch.object(apply, "replicated", lambda p, world, sum_group=None: layers.replicated(p, world))


def _context_parallel(name: str):
    import dataclasses

    import torch
    import torch.distributed as dist

    from ultrascale import parallel
    from ultrascale.parallel import context
    from ultrascale.parallel.context import blocks, comm, ring, sharding

    def positions(new):
        original = context.shard_micro_batches

        def shard(micro_batches, rank, cp, variant):
            return [(x, y, new(x.shape[1] * cp, rank, cp)) for x, y, _ in original(micro_batches, rank, cp, variant)]

        return mock.patch.object(context, "shard_micro_batches", shard)

    if name == "cp-local-positions":
        return positions(lambda s, rank, cp: torch.arange(s // cp))
    if name == "cp-contiguous-positions":
        return positions(lambda s, rank, cp: sharding.shard_positions(s, rank, cp, "contiguous"))
    if name == "cp-grads-reduced-over-dp-only":
        build = parallel.build_grads

        def over_dp(model, params, ctx, cfg):
            dp_only = dataclasses.replace(ctx, groups={**ctx.groups, "dp_cp": ctx.groups.get("dp")},
                                          group_ranks={**ctx.group_ranks, "dp_cp": ctx.group_ranks["dp"]})
            return build(model, params, dp_only, cfg)

        return mock.patch.object(parallel, "build_grads", over_dp)
    if name == "cp-merge-by-average":
        def average(out, lse, block_out, block_lse):
            out.copy_(block_out if torch.isinf(lse).all() else (out + block_out) / 2)
            lse.copy_(torch.logaddexp(lse, block_lse))

        return mock.patch.object(blocks, "merge", average)
    if name == "cp-no-causal-skip":
        return mock.patch.object(blocks, "chunk_pairs", lambda qc, kc: (
            (i, j, a == c) for i, a in enumerate(qc) for j, c in enumerate(kc)))
    if name == "cp-zigzag-read-as-contiguous":
        return mock.patch.object(ring, "chunks_of", lambda rank, cp, layout: [rank])
    if name == "cp-scatter-without-sum":
        def keep_own(out, inp, group=None):
            out.copy_(inp.view(dist.get_world_size(group), -1)[dist.get_rank(group)])

        return mock.patch.object(comm, "_reduce_scatter", keep_own)
    if name == "cp-gathered-in-rank-order":
        return mock.patch.object(comm, "storage_order", lambda cp, layout: list(range(2 * cp)))
    if name == "cp-all-to-all-reversed":
        original = comm.all_to_all

        def reversed_order(x, cpg, scatter_dim, gather_dim, phase):
            out = original(x, cpg, scatter_dim, gather_dim, phase)
            return torch.cat(out.chunk(cpg.size, dim=gather_dim)[::-1], dim=gather_dim)

        return mock.patch.object(comm, "all_to_all", reversed_order)
    raise KeyError(f"unknown fault {name!r}: one of {', '.join(FAULTS)}")


def _expert_edp_average(owner):
    expert = getattr(owner, "expert", None)
    if expert is not None:
        expert.divisor = owner.ctx.size("edp")


def _all_to_all_backward_dropped():
    from ultrascale.parallel import expert

    def backward(ctx, grad):
        return grad.new_zeros((sum(ctx.send), *grad.shape[1:])), None, None, None

    return mock.patch.object(expert._AllToAll, "backward", staticmethod(backward))


def _all_gather_backward_dropped():
    from ultrascale.parallel import expert

    def backward(ctx, grad):
        return grad.new_zeros((grad.shape[0] // ctx.world, *grad.shape[1:])), None, None

    return mock.patch.object(expert._AllGather, "backward", staticmethod(backward))


def _expert_norm_per_replica(owner):
    expert = getattr(owner, "expert", None)
    if expert is not None:
        n = len(expert.grads())
        owner._norm_shares = owner._norm_shares[:len(owner._norm_shares) - n] + [1.0] * n


def _inf_on_last_rank(owner):
    import torch.distributed as dist

    finish, calls = owner.finish, []

    def overflowing_finish():
        finish()
        calls.append(1)
        if len(calls) == 1 and dist.get_rank() == dist.get_world_size() - 1:
            owner.grads()[0].view(-1)[0] = float("inf")

    owner.finish = overflowing_finish


@contextlib.contextmanager
def _skip_decided_locally():
    from ultrascale.train.loss_scale import DynamicLossScaler

    check = DynamicLossScaler.unscale_and_check
    with _wrap_build_grads(_inf_on_last_rank), \
            mock.patch.object(DynamicLossScaler, "unscale_and_check",
                              lambda self, grads, world, applied=None: check(self, grads, False, applied)):
        yield


@contextlib.contextmanager
def _stale_moment():
    """Each segment's new first moment is held back and the previous step's is stored instead
    (what a write-back that lags its step by one does: the step itself saw the right values)."""
    from ultrascale.parallel import offload

    patches, held = [], {}
    for cls in (offload.HostStates, offload.DiskStates):
        segment = cls.segment

        @contextlib.contextmanager
        def late(self, slot, lo, hi, segment=segment):
            with segment(self, slot, lo, hi) as s:
                yield s
                fresh = s["exp_avg"].clone()
                s["exp_avg"].copy_(held.get((id(self), lo), s["exp_avg"].new_zeros(hi - lo)))
                held[(id(self), lo)] = fresh

        patches.append(mock.patch.object(cls, "segment", late))
    with patches[0], patches[1]:
        yield


def _sync_at_last_b_or_i_and_last_w():
    from ultrascale.parallel.pipeline.runtime import PipelineRuntime

    def last_backwards(self):
        last = {}
        for i, a in enumerate(self.actions):
            if a.kind in ("B", "I", "W"):
                last[(a.kind == "W", a.chunk)] = i
        return set(last.values())

    return mock.patch.object(PipelineRuntime, "_last_backwards", last_backwards)


def _1f1b_played_as_afab():
    from ultrascale.parallel.pipeline import runtime

    build = runtime.schedule
    return mock.patch.object(runtime, "schedule", lambda name, *a: build("afab" if name == "1f1b" else name, *a))


def _fp16_scale_times_dp_cp():
    from ultrascale.train.trainer import Trainer

    return mock.patch.object(Trainer, "backward_scale",
                             lambda self: 1.0 if self.scaler is None else self.scaler.scale)


def _adam_steps_from_training_step():
    from ultrascale.train import checkpoint

    load = checkpoint.load

    def counted_by_step(path, trainer):
        step = load(path, trainer)
        trainer.optimizer_steps = step
        checkpoint._ensure_adam_state(trainer.opt, step)  # the moments stay; the count is the step's
        return step

    return mock.patch.object(checkpoint, "load", counted_by_step)


def _moe_loads_per_shard(axis: str):
    from ultrascale.parallel import expert

    share = expert.share_token_loads

    def per_shard(model, ctx, sequence_parallel):
        if axis == "cp":  # as if there were no context-parallel shards to sum over
            return share(model, _without(ctx, "cp"), sequence_parallel)
        return share(model, ctx, False)

    return mock.patch.object(expert, "share_token_loads", per_shard)


def _without(ctx, axis):
    class Sizes:
        def size(self, name):
            return 1 if name == axis else ctx.size(name)

        def group(self, name):
            return ctx.group(name)

    return Sizes()


# How each fault is patched in: a factory of the patch's context manager.
_PATCHES = {
    "grads-scaled-1.01": lambda: _wrap_build_grads(lambda owner: _scale_after_finish(owner, 1.01)),
    "dp-wrong-group-size": lambda: _wrap_build_grads(_wrong_group_size),
    "last-bucket-dropped": lambda: _wrap_build_grads(_drop_last_bucket),
    "micro-batch-counted-twice": _count_first_twice,
    "sp-norm-grads-not-summed": _sp_norms_not_summed,
    "expert-grads-averaged-over-edp": lambda: _wrap_build_grads(_expert_edp_average),
    "all-to-all-backward-dropped": _all_to_all_backward_dropped,
    "all-gather-backward-dropped": _all_gather_backward_dropped,
    "expert-norm-counted-per-replica": lambda: _wrap_build_grads(_expert_norm_per_replica),
    "fp16-inf-on-last-rank": lambda: _wrap_build_grads(_inf_on_last_rank),
    "fp16-skip-decided-locally": _skip_decided_locally,
    "pp-sync-at-last-b-or-i-and-last-w": _sync_at_last_b_or_i_and_last_w,
    "pp-1f1b-played-as-afab": _1f1b_played_as_afab,
    "offload-stale-moment": _stale_moment,
    "fp16-scale-times-dp-cp": _fp16_scale_times_dp_cp,
    "adam-steps-from-training-step": _adam_steps_from_training_step,
    "moe-loads-per-cp-shard": lambda: _moe_loads_per_shard("cp"),
    "moe-loads-per-sp-shard": lambda: _moe_loads_per_shard("sp"),
    "eval-loss-not-averaged": _eval_loss_not_averaged,
    "eval-rows-of-rank-0": _eval_rows_of_rank_0,
}


def _patch(name: str):
    if name.startswith("cp-"):
        return _context_parallel(name)
    if name not in _PATCHES:
        raise KeyError(f"unknown fault {name!r}: one of {', '.join(FAULTS)}")
    return _PATCHES[name]()


@contextlib.contextmanager
def inject(name: str | None):
    """Run the body with fault `name` patched in (None: the engine as it is)."""
    if name is None:
        yield
        return
    with _patch(name):
        yield
