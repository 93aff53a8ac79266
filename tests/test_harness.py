"""The harness itself: a failure or a hang on one rank fails the caller, with the traceback."""

import selectors
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from ultrascale.testing.cli import read_until
from ultrascale.testing.harness import DistributedError, WorkerPool


def _rank_times(x):
    return dist.get_rank() * x


def _fails_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # the others wait here for rank 1, which never comes


def _sleeps():
    time.sleep(60)


def test_pool_runs_on_every_rank_then_surfaces_failures_and_hangs():
    pool = WorkerPool(2)
    try:
        assert pool.run(_rank_times, 3) == [0, 3]
        assert pool.run(_rank_times, 5) == [0, 5]  # the same processes, reused
        with pytest.raises(DistributedError, match="rank one is broken"):
            pool.run(_fails_on_rank_1, timeout=60)
        assert not pool.alive  # a pool stuck in a collective is not reused
    finally:
        pool.close(kill=True)
    pool = WorkerPool(2)
    try:
        start = time.monotonic()
        with pytest.raises(DistributedError, match="did not finish within 2s"):
            pool.run(_sleeps, timeout=2)
        assert time.monotonic() - start < 30
    finally:
        pool.close(kill=True)


def _unpicklable():
    import threading

    return threading.Lock()


def _exits():
    import os

    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(60)


def test_an_unpicklable_result_or_a_dead_rank_fails_fast():
    pool = WorkerPool(2)
    try:
        start = time.monotonic()
        with pytest.raises(DistributedError, match="pickle"):
            pool.run(_unpicklable, timeout=120)
        with pytest.raises(DistributedError, match="did not finish"):
            pool.run(_exits, timeout=120)
        assert time.monotonic() - start < 30
    finally:
        pool.close(kill=True)


def _two_lines_in_one_write():
    # Both lines reach the pipe in one write, as two ranks' lines do when they print together.
    return subprocess.Popen([sys.executable, "-c", "import os, time; os.write(1, b'paused 0\\npaused 1\\n'); "
                             "time.sleep(30)"], stdout=subprocess.PIPE)


def test_read_until_sees_two_lines_that_arrive_in_one_write():
    child = _two_lines_in_one_write()
    try:
        lines, short = read_until(child.stdout, lambda lines: len(lines) >= 2, limit=60)
        assert short is None and lines == [b"paused 0", b"paused 1"]
    finally:
        child.kill()
        child.wait()
    # The wrong form, select() on the pipe and the buffered readline(): the first readline takes
    # both lines off the pipe, so a select() waiting for the second never wakes.
    child = _two_lines_in_one_write()
    try:
        sel = selectors.DefaultSelector()
        sel.register(child.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=60)  # the child's one write is in the pipe
        assert child.stdout.readline() == b"paused 0\n"
        assert sel.select(timeout=1) == []  # nothing left in the pipe to signal...
        assert child.stdout.readline() == b"paused 1\n"  # ...the second line was in the buffer all along
    finally:
        child.kill()
        child.wait()
    # A pipe that closes is "ended", with the lines before it.
    done = subprocess.Popen([sys.executable, "-c", "print('only')"], stdout=subprocess.PIPE)
    assert read_until(done.stdout, lambda lines: len(lines) >= 2, limit=60) == ([b"only"], "ended")
    done.wait()
