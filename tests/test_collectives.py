"""The hand-written collectives against torch.distributed's own, on 2, 3 and 4 gloo processes.

Every rank's input is a deterministic function of (rank, shape, seed), so each
rank can also compute the expected result by itself: every check compares with
torch.distributed *and* with that independent expectation. Integer-valued
floats sum exactly in any order, so those comparisons are exact; random floats
are compared with fp32 tolerance (the ring adds in a different order).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from ultrascale.distributed import collectives as C
from ultrascale.testing.harness import run_distributed

# 12 elements split evenly over 2, 3 and 4 ranks; 7 over none of them; 2 leaves some ranks an empty chunk.
SHAPES = [(3, 4), (7,), (2,)]
# (processes, members of the group under test): the whole world, or a sub-group (None = default group).
SETUPS = [(2, None), (3, None), (4, None), (4, (0, 2)), (4, (1, 2, 3)), (4, (2,))]
SETUP_IDS = [f"world{n}" if m is None else f"ranks{','.join(map(str, m))}of{n}" for n, m in SETUPS]
OPS = {"sum": False, "avg": True, "ReduceOp.SUM": False, "ReduceOp.AVG": True}  # name -> is a mean
TIMEOUT = 60  # a broken exchange hangs; fail quickly rather than wait for the default

EXACT = dict(rtol=0, atol=0)


# -- helpers run on the workers ---------------------------------------------
_GROUPS: dict = {}


def _group(members):
    """(group, its global ranks) for this rank, or None when the rank is not a member.

    Every rank must create every group (even ones it is not in), so this runs on
    all ranks; the group is cached because the pool outlives the test.
    """
    if members is None:
        return None, list(range(dist.get_world_size()))
    if members not in _GROUPS:
        _GROUPS[members] = dist.new_group(list(members))
    return (_GROUPS[members], list(members)) if dist.get_rank() in members else None


def _data(rank, shape, seed=0, integer=False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + 17 * rank + len(shape))
    if integer:
        return torch.randint(-8, 9, shape, generator=g).float()
    return torch.randn(shape, generator=g)


def _expected_sum(ranks, shape, seed=0, integer=False) -> torch.Tensor:
    return sum(_data(r, shape, seed, integer).double() for r in ranks).float()


def _cat0(tensors):
    """Concatenate along dim 0, 0-dim tensors as one element each (as an all-gather into a tensor)."""
    return torch.cat([t.reshape(-1, *t.shape[1:]) for t in tensors])


def _op(name):
    return getattr(dist.ReduceOp, name.split(".")[1]) if name.startswith("ReduceOp.") else name


def _check_all_reduce(members, impl):
    setup = _group(members)
    if setup is None:
        return True
    group, ranks = setup
    me, n = dist.get_rank(), len(ranks)
    for shape in SHAPES:
        for integer in (True, False):
            for op, is_mean in OPS.items():
                x = _data(me, shape, integer=integer)
                ref = x.clone()
                dist.all_reduce(ref, group=group)  # gloo has no AVG on every version: SUM, then / N
                expected = _expected_sum(ranks, shape, integer=integer)
                if is_mean:
                    ref, expected = ref / n, expected / n
                out = getattr(C, impl)(x, group=group, op=_op(op))
                assert out is x, "all-reduce works in place"
                tol = EXACT if integer else {}  # integers: every summation order is exact
                torch.testing.assert_close(x, ref, **tol)
                torch.testing.assert_close(x, expected, **tol)
    return True


def _check_ring_reduce_scatter(members):
    setup = _group(members)
    if setup is None:
        return True
    group, ranks = setup
    me, n = dist.get_rank(), len(ranks)
    i = ranks.index(me)
    for shape in SHAPES:
        for op, is_mean in OPS.items():
            x = _data(me, shape)
            before = x.clone()
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            ref = torch.tensor_split(ref.flatten() / (n if is_mean else 1), n)[i]
            expected = torch.tensor_split(_expected_sum(ranks, shape).flatten() / (n if is_mean else 1), n)[i]
            out = C.ring_reduce_scatter(x, group=group, op=_op(op))
            torch.testing.assert_close(out, ref)
            torch.testing.assert_close(out, expected)
            torch.testing.assert_close(x, before, **EXACT)  # the input is left alone
    return True


def _check_ring_all_gather(members):
    setup = _group(members)
    if setup is None:
        return True
    group, ranks = setup
    me = dist.get_rank()
    for shape in SHAPES + [()]:
        x = _data(me, shape)
        parts = [torch.empty_like(x) for _ in ranks]
        dist.all_gather(parts, x, group=group)
        out = C.ring_all_gather(x, group=group)
        torch.testing.assert_close(out, _cat0(parts), **EXACT)
        torch.testing.assert_close(out, _cat0([_data(r, shape) for r in ranks]), **EXACT)
    return True


def _check_broadcast(members):
    setup = _group(members)
    if setup is None:
        return True
    group, ranks = setup
    me = dist.get_rank()
    for shape in SHAPES:
        for src in ranks:
            ref = _data(me, shape)
            dist.broadcast(ref, src, group=group)
            x = _data(me, shape)
            assert C.broadcast(x, src, group=group) is x
            torch.testing.assert_close(x, ref, **EXACT)
            torch.testing.assert_close(x, _data(src, shape), **EXACT)
    return True


def _check_reduce(members):
    setup = _group(members)
    if setup is None:
        return True
    group, ranks = setup
    me, n = dist.get_rank(), len(ranks)
    for shape in SHAPES:
        for integer in (True, False):
            for op, is_mean in OPS.items():
                for dst in ranks:
                    ref = _data(me, shape, integer=integer)
                    dist.reduce(ref, dst, group=group)
                    x = _data(me, shape, integer=integer)
                    C.reduce(x, dst, group=group, op=_op(op))
                    if me != dst:  # only dst's tensor changes
                        torch.testing.assert_close(x, _data(me, shape, integer=integer), **EXACT)
                        continue
                    expected = _expected_sum(ranks, shape, integer=integer)
                    if is_mean:
                        ref, expected = ref / n, expected / n
                    tol = EXACT if integer else {}
                    torch.testing.assert_close(x, ref, **tol)
                    torch.testing.assert_close(x, expected, **tol)
    return True


def _check_gather_scatter(members):
    setup = _group(members)
    if setup is None:
        return True
    group, ranks = setup
    me, n = dist.get_rank(), len(ranks)
    for shape in SHAPES:
        for root in ranks:
            x = _data(me, shape)
            ref = [torch.empty_like(x) for _ in ranks] if me == root else None
            dist.gather(x, ref, root, group=group)
            got = [torch.full_like(x, float("nan")) for _ in ranks] if me == root else None
            C.gather(x, got, root, group=group)
            if me == root:
                for i, r in enumerate(ranks):
                    torch.testing.assert_close(got[i], ref[i], **EXACT)
                    torch.testing.assert_close(got[i], _data(r, shape), **EXACT)

            pieces = [_data(root, shape, seed=1 + i) for i in range(n)] if me == root else None
            ref = torch.empty(shape)
            dist.scatter(ref, pieces, root, group=group)
            out = torch.full(shape, float("nan"))
            assert C.scatter(out, pieces, root, group=group) is out
            torch.testing.assert_close(out, ref, **EXACT)
            torch.testing.assert_close(out, _data(root, shape, seed=1 + ranks.index(me)), **EXACT)
    return True


def _check_list_collectives(members):
    """all_gather, reduce_scatter and all_to_all, in torch.distributed's list form."""
    setup = _group(members)
    if setup is None:
        return True
    group, ranks = setup
    me, n = dist.get_rank(), len(ranks)
    i = ranks.index(me)
    for shape in SHAPES:
        x = _data(me, shape)
        ref = [torch.empty_like(x) for _ in ranks]
        dist.all_gather(ref, x, group=group)
        got = C.all_gather([torch.full_like(x, float("nan")) for _ in ranks], x, group=group)
        for j, r in enumerate(ranks):
            torch.testing.assert_close(got[j], ref[j], **EXACT)
            torch.testing.assert_close(got[j], _data(r, shape), **EXACT)

        # Rank r's j-th input is _data(r, shape, seed=j): rank j's result is the sum over r.
        inputs = [_data(me, shape, seed=j) for j in range(n)]
        for op, is_mean in OPS.items():
            # Reference: all-reduce everything, keep our piece (gloo lacks reduce_scatter on older torch).
            full = torch.stack(inputs)
            dist.all_reduce(full, group=group)
            expected = _expected_sum(ranks, shape, seed=i)
            ref = full[i] / (n if is_mean else 1)
            out = torch.full(shape, float("nan"))
            assert C.reduce_scatter(out, inputs, group=group, op=_op(op)) is out
            torch.testing.assert_close(out, ref)
            torch.testing.assert_close(out, expected / (n if is_mean else 1))

        # all_to_all: rank j receives input j of every rank, in rank order.
        ref = [torch.empty(shape) for _ in ranks]
        dist.all_to_all(ref, inputs, group=group)
        got = C.all_to_all([torch.full(shape, float("nan")) for _ in ranks], inputs, group=group)
        for j, r in enumerate(ranks):
            torch.testing.assert_close(got[j], ref[j], **EXACT)
            torch.testing.assert_close(got[j], _data(r, shape, seed=i), **EXACT)
    return True


def _barrier_times(members):
    """For each member in turn arriving late: (entered, left) the barrier on this rank."""
    setup = _group(members)
    if setup is None:
        return None
    group, ranks = setup
    times = []
    for late in ranks:
        C.barrier(group)
        if dist.get_rank() == late:
            time.sleep(0.05)
        entered = time.time()
        C.barrier(group)
        times.append((entered, time.time()))
    return times


# -- the tests ----------------------------------------------------------------
def _run(setup, fn, *args):
    world, members = setup
    return run_distributed(world, fn, members, *args, timeout=TIMEOUT)


@pytest.mark.parametrize("impl", ["ring_all_reduce", "naive_all_reduce"])
@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_all_reduce_matches_torch(setup, impl):
    assert all(_run(setup, _check_all_reduce, impl))


@pytest.mark.parametrize(
    "check", [_check_ring_reduce_scatter, _check_ring_all_gather, _check_broadcast, _check_reduce,
              _check_gather_scatter, _check_list_collectives],
    ids=lambda f: f.__name__.removeprefix("_check_"))
@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_collective_matches_torch(setup, check):
    assert all(_run(setup, check))


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_barrier_waits_for_the_last_rank(setup):
    times = [t for t in _run(setup, _barrier_times) if t is not None]
    for k in range(len(times[0])):  # round k: one member arrived late
        last_in = max(rank_times[k][0] for rank_times in times)
        first_out = min(rank_times[k][1] for rank_times in times)
        assert first_out >= last_in, f"a rank left barrier {k} before the last one entered it"


def test_single_process_is_a_no_op():
    if dist.is_initialized():
        pytest.skip("needs a process without a process group")
    x = torch.arange(6.0).reshape(2, 3)
    for fn in (C.ring_all_reduce, C.naive_all_reduce):
        assert torch.equal(fn(x.clone(), op="avg"), x)
    assert torch.equal(C.ring_reduce_scatter(x), x.flatten())
    assert torch.equal(C.ring_all_gather(x), x)
    assert torch.equal(C.broadcast(x.clone(), 0), x)
    assert torch.equal(C.reduce(x.clone(), 0), x)
    assert torch.equal(C.gather(x, [torch.empty_like(x)], 0)[0], x)
    assert torch.equal(C.scatter(torch.empty_like(x), [x], 0), x)
    assert torch.equal(C.all_gather([torch.empty_like(x)], x)[0], x)
    assert torch.equal(C.reduce_scatter(torch.empty_like(x), [x]), x)
    assert torch.equal(C.all_to_all([torch.empty_like(x)], [x])[0], x)
    C.barrier()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="op must be"):
        C.ring_all_reduce(torch.ones(4), op="max")
    with pytest.raises(ValueError, match="contiguous"):
        C.ring_all_reduce(torch.ones(4, 4).t())
