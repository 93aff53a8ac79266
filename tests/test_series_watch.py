"""The collectives a learner's function calls on its ranks, as a check sees them (series/watch.py),
and a deadlock said as such, naming the rank and the call it waits in."""

import linecache
import textwrap
import time

import pytest
import torch.distributed as dist

from ultrascale.series.ranks import RankError, on_ranks
from ultrascale.series import watch
from ultrascale.series.watch import Call, kinds, sent, stalled
from ultrascale.testing.harness import run_distributed


def notebook(source: str) -> dict:
    """Functions defined as a notebook cell defines them (in __main__, their source kept)."""
    source = textwrap.dedent(source)
    name = f"<cell {abs(hash(source))}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    ns = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), ns)
    return ns


CELL = notebook('''
import torch
import torch.distributed as dist
from torch.distributed import all_gather_into_tensor

def talk():
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(4) * rank
    dist.all_reduce(x)                                        # 16 B over both ranks
    out = torch.empty(8)
    all_gather_into_tensor(out, torch.ones(4))                # bound by name: watched too
    received = torch.empty(2, dtype=torch.float64)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2, dtype=torch.float64), (rank + 1) % world),
                                    dist.P2POp(dist.irecv, received, (rank - 1) % world)])
    for w in works:
        w.wait()
    dist.all_to_all_single(torch.empty(6), torch.ones(6))
    return x.sum().item()

def stuck():
    if dist.get_rank() == 1:
        dist.all_reduce(torch.ones(3))
    return 0
''')


def test_each_ranks_calls_are_recorded_with_their_group_bytes_and_peer():
    calls = []
    assert on_ranks(2, CELL["talk"], calls=calls) == [4.0, 4.0]
    for rank, mine in enumerate(calls):
        assert kinds(mine) == ["all_reduce", "all_gather_single", "isend", "irecv", "all_to_all_single"]
        assert mine[0] == Call("all_reduce", (0, 1), 16, "SUM")
        assert mine[1] == Call("all_gather_into_tensor", (0, 1), 16)
        assert mine[2] == Call("isend", (0, 1), 16, peer=1 - rank)
        assert mine[3] == Call("irecv", (0, 1), 16, peer=1 - rank)
        assert sent(mine) == 16
        assert str(mine[0]) == "all_reduce SUM over ranks [0, 1], 16 B"
        assert str(mine[2]) == f"isend to rank {1 - rank}, 16 B"
    # Watched during the call, and nothing left wrapped on the ranks after it (the pool runs other work).
    assert on_ranks(2, _wrapped) == [True, True]
    assert run_distributed(2, _wrapped) == [False, False]


def _wrapped():
    return hasattr(dist.all_reduce, "__watched__") and hasattr(dist.distributed_c10d.isend, "__watched__")


def test_a_deadlock_names_the_rank_and_the_collective_it_waits_in_before_the_timeout():
    # The timeout is far away: only the watch (every unfinished rank blocked for STALL seconds) can
    # say "deadlock" in time, and the message says where.
    with pytest.raises(AssertionError, match=r"^deadlock on 2 ranks: rank 1 waits in all_reduce SUM over ranks "
                                             r"\[0, 1\], 12 B; rank 0 had returned\. Every rank must call"):
        on_ranks(2, CELL["stuck"], timeout=200)
    assert on_ranks(2, CELL["talk"]) == [4.0, 4.0]  # the pool is started again for the next call


RAISES = notebook('''
import torch
import torch.distributed as dist

def one_rank_raises():
    if dist.get_rank() == 0:
        raise KeyError("no such expert")
    dist.all_reduce(torch.ones(3))  # waits for rank 0, which is gone
    return 0
''')


def test_a_rank_that_raised_is_reported_not_the_wait_it_caused_on_the_others():
    with pytest.raises(RankError, match=r"^KeyError: 'no such expert' \(rank 0 of 2\)"):
        on_ranks(2, RAISES["one_rank_raises"], timeout=200)


FUNCTIONAL = notebook('''
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

def functional():
    x = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)            # the API torch now points to
    gathered = funcol.all_gather_single(torch.ones(2), 0, [0, 1])
    return x.sum().item() + gathered.sum().item()
''')


def test_the_functional_collectives_are_recorded_as_the_kinds_they_do():
    calls = []
    assert on_ranks(2, FUNCTIONAL["functional"], calls=calls) == [12.0, 12.0]
    for mine in calls:
        assert mine == [Call("all_reduce", (0, 1), 16, "SUM"), Call("all_gather_into_tensor", (0, 1), 8)]


def _status(tmp_path, rank, seconds_ago, line):
    (tmp_path / f"rank{rank}").write_text(f"{time.time() - seconds_ago} {line}" if line else "")


def test_ranks_blocked_in_calls_that_answer_each_other_are_slow_not_deadlocked(tmp_path):
    # All four in the same all-reduce for a minute (a big tensor on a loaded machine): it is moving.
    for rank in range(4):
        _status(tmp_path, rank, 60, "all_reduce@0,1,2,3#2:64 all_reduce SUM over ranks [0, 1, 2, 3], 64 B")
    assert stalled(str(tmp_path), [0, 1, 2, 3], 4) is None
    # The same collective, but rank 3 in the next one: none of them can complete.
    _status(tmp_path, 3, 60, "all_reduce@0,1,2,3#3:64 all_reduce SUM over ranks [0, 1, 2, 3], 64 B")
    assert stalled(str(tmp_path), [0, 1, 2, 3], 4).startswith("rank 0 waits in all_reduce SUM")
    # A size that differs is no match either; nor is a collective that a returned rank never joins.
    _status(tmp_path, 3, 60, "all_reduce@0,1,2,3#2:32 all_reduce SUM over ranks [0, 1, 2, 3], 32 B")
    assert stalled(str(tmp_path), [0, 1, 2, 3], 4) is not None
    assert stalled(str(tmp_path), [0, 1, 2], 4).endswith("rank 3 had returned")
    # A send whose recv is posted moves; two ranks both sending to each other do not.
    _status(tmp_path, 0, 60, "send>1:16 send to rank 1, 16 B")
    _status(tmp_path, 1, 60, "recv<0:16 recv from rank 0, 16 B")
    assert stalled(str(tmp_path), [0, 1], 2) is None
    _status(tmp_path, 1, 60, "send>0:16 send to rank 0, 16 B")
    assert stalled(str(tmp_path), [0, 1], 2) == ("rank 0 waits in send to rank 1, 16 B; "
                                                 "rank 1 waits in send to rank 0, 16 B")
    # Blocked for less than STALL, computing, or a line half written: not yet a deadlock.
    _status(tmp_path, 1, 1, "send>0:16 send to rank 0, 16 B")
    assert stalled(str(tmp_path), [0, 1], 2) is None
    _status(tmp_path, 1, 0, "")
    assert stalled(str(tmp_path), [0, 1], 2) is None
    (tmp_path / "rank1").write_text(f"{time.time() - 60:.3f}")
    assert stalled(str(tmp_path), [0, 1], 2) is None


def test_a_rank_still_inside_a_collective_its_peer_has_left_is_finishing_not_deadlocked(tmp_path):
    # Rank 1 has left the 3rd all-reduce (its part done) and waits in a recv; rank 0 is still inside that
    # all-reduce, which completes by itself. Each line says how many collectives its rank has entered per
    # group: seen at once, the two are moving. Had rank 1 entered only 2, rank 0 would wait for ever.
    _status(tmp_path, 0, 60, "all_reduce@0,1#3:64|0,1#3 all_reduce SUM over ranks [0, 1], 64 B")
    _status(tmp_path, 1, 60, "recv<0:16|0,1#3 recv from rank 0, 16 B")
    assert stalled(str(tmp_path), [0, 1], 2) is None
    _status(tmp_path, 1, 60, "recv<0:16|0,1#2 recv from rank 0, 16 B")
    assert stalled(str(tmp_path), [0, 1], 2) == ("rank 0 waits in all_reduce SUM over ranks [0, 1], 64 B; "
                                                 "rank 1 waits in recv from rank 0, 16 B")


def test_a_recv_whose_sender_has_left_its_send_is_finishing_not_deadlocked(tmp_path):
    # Rank 0 has sent its 3rd message to rank 1 (the data is on its way) and waits in the next all-reduce;
    # rank 1 is still inside its 3rd recv from rank 0. Each line counts the sends and recvs its rank has
    # entered per peer: the recv is answered. Had rank 0 entered only 2 sends to rank 1, nothing would move.
    _status(tmp_path, 0, 60, "all_reduce@0,1#4:64|0,1#4/send>1#3 all_reduce SUM over ranks [0, 1], 64 B")
    _status(tmp_path, 1, 60, "recv<0:16|0,1#3/recv<0#3 recv from rank 0, 16 B")
    assert stalled(str(tmp_path), [0, 1], 2) is None
    _status(tmp_path, 0, 60, "all_reduce@0,1#4:64|0,1#4/send>1#2 all_reduce SUM over ranks [0, 1], 64 B")
    assert stalled(str(tmp_path), [0, 1], 2) == ("rank 0 waits in all_reduce SUM over ranks [0, 1], 64 B; "
                                                 "rank 1 waits in recv from rank 0, 16 B")


SLOW = notebook('''
import torch
import torch.distributed as dist

def slow_but_live():
    rank = dist.get_rank()
    big, part = torch.zeros(1 << 24), torch.zeros(1 << 22)
    for _ in range(60):                                        # seconds, spent inside the calls
        dist.all_reduce(big)                                   # both ranks in the same call
        if rank == 0:
            dist.send(part, 1)                                 # a send and the recv that takes it
        else:
            dist.recv(part, 0)
    return big.sum().item()
''')


def test_a_slow_collective_is_not_called_a_deadlock(monkeypatch):
    # The calls here outlast a stall of a millisecond each time the pool asks, and none is a deadlock.
    monkeypatch.setattr(watch, "STALL", 0.001)
    assert on_ranks(2, SLOW["slow_but_live"], timeout=200) == [0.0, 0.0]


# The notebooks bind the flat collectives under short names, as the engine's own rooms do (distributed/flat.py).
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _uses_reduce_scatter(out, inp):
    reduce_scatter(out, inp)


def test_a_collective_bound_under_another_name_reaches_the_ranks_by_its_own_name():
    # Shipped by its own module and name, a rank looks it up where the check's watch wraps it; handed over
    # from a module that holds the same object under the same short name, it would be the bare original,
    # and a learner's reduce-scatter would go unseen.
    import ultrascale.distributed.flat  # noqa: F401 - holds the same function as `reduce_scatter`
    from ultrascale.series.ranks import _bundle

    bundle = _bundle(_uses_reduce_scatter)
    assert "reduce_scatter" not in bundle["from_imports"], bundle["from_imports"]
    assert "reduce_scatter" in bundle["values"]
