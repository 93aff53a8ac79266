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
    "expert-grads-averaged-over-edp": "expert gradients averaged over edp only (the 1/ep factor forgotten)",
    "all-to-all-backward-dropped": "the dispatch all-to-all's backward returns no gradient to the tokens",
    "all-gather-backward-dropped": "the all-gather dispatch's backward returns no gradient to the tokens",
    "expert-norm-counted-per-replica": "replicated expert gradients counted once per edp replica in the norm",
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


def _sp_norms_not_summed():
    from ultrascale.parallel.tensor import apply, layers

    return mock.patch.object(apply, "replicated", lambda p, world, sum_group=None: layers.replicated(p, world))


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
        owner.norm_shares = owner.norm_shares[:len(owner.norm_shares) - n] + [1.0] * n


def _patch(name: str):
    if name == "grads-scaled-1.01":
        return _wrap_build_grads(lambda owner: _scale_after_finish(owner, 1.01))
    if name == "dp-wrong-group-size":
        return _wrap_build_grads(_wrong_group_size)
    if name == "last-bucket-dropped":
        return _wrap_build_grads(_drop_last_bucket)
    if name == "micro-batch-counted-twice":
        return _count_first_twice()
    if name == "sp-norm-grads-not-summed":
        return _sp_norms_not_summed()
    if name == "expert-grads-averaged-over-edp":
        return _wrap_build_grads(_expert_edp_average)
    if name == "all-to-all-backward-dropped":
        return _all_to_all_backward_dropped()
    if name == "all-gather-backward-dropped":
        return _all_gather_backward_dropped()
    if name == "expert-norm-counted-per-replica":
        return _wrap_build_grads(_expert_norm_per_replica)
    raise KeyError(f"unknown fault {name!r}: one of {', '.join(FAULTS)}")


@contextlib.contextmanager
def inject(name: str | None):
    """Run the body with fault `name` patched in (None: the engine as it is)."""
    if name is None:
        yield
        return
    with _patch(name):
        yield
