"""The harness itself: a failure or a hang on one rank fails the caller, with the traceback."""

import time

import pytest
import torch
import torch.distributed as dist

from ultrascale.testing.harness import DistributedError, WorkerPool, run_distributed


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



def _says_after_a_while(word):
    time.sleep(1.5)
    return word


def _interrupt(pending):
    raise KeyboardInterrupt  # as a notebook's stop button interrupts the wait


def test_a_run_interrupted_in_the_caller_leaves_no_results_for_the_next_run():
    with pytest.raises(KeyboardInterrupt):
        run_distributed(2, _says_after_a_while, "old", stalled=_interrupt)
    assert run_distributed(2, _says_after_a_while, "new") == ["new", "new"]

# A process that starts a pool, says who serves it, then waits to be killed: no shutdown, no atexit.
_OWNER = """
import sys, time
from multiprocessing import forkserver, resource_tracker
from ultrascale.testing.harness import run_distributed, _POOLS
assert run_distributed(2, abs, -3) == [3, 3]
pids = [p.pid for p in _POOLS[2].procs]
pids += [forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid]
print(*pids, flush=True)
time.sleep(600)
"""


def test_a_pool_ends_with_the_process_that_started_it(tmp_path):
    # Its workers' parent is the fork server, which lives as long as they do: a notebook kernel
    # restarted, or a test runner killed, must not leave the server and its workers behind.
    import os
    import signal
    import subprocess
    import sys

    from ultrascale.distributed.failures import process_state

    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 4 and all(process_state(p) not in (None, "Z") for p in pids), pids
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(process_state(p) not in (None, "Z") for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if process_state(p) not in (None, "Z")]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == [], f"still running after their owner was killed: {left} of {pids}"


_CHECKER = """
import sys
from ultrascale.series.multirank import run_as_ranks
run_as_ranks([(0, "import time\\ntime.sleep(600)")], [], timeout=600)
"""


def test_the_ranks_of_a_notebook_check_end_with_the_check(tmp_path):
    # `notebook import` runs a notebook's cells as 2 plain processes: interrupted, it leaves none.
    import signal
    import subprocess
    import sys

    import psutil

    checker = subprocess.Popen([sys.executable, "-c", _CHECKER])
    try:
        deadline, ranks = time.monotonic() + 60, []
        while time.monotonic() < deadline and len(ranks) < 2:
            ranks = [p for p in psutil.Process(checker.pid).children() if "ultrascale.series.multirank" in p.cmdline()]
            time.sleep(0.1)
        assert len(ranks) == 2
    finally:
        checker.send_signal(signal.SIGKILL)
        checker.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    for p in alive:
        p.kill()
    assert alive == [], f"still running after the check was killed: {alive}"


def test_the_store_port_is_free_and_outside_the_ephemeral_range():
    # Outgoing connections take their local ports from the kernel's ephemeral range: a store port
    # from there can be taken between the check and rank 0's bind (EADDRINUSE with runs side by side).
    import socket

    from ultrascale.distributed import launch

    low, _ = launch._ephemeral_range()
    ports = {launch.free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), ports
    assert len(ports) > 1  # drawn, not a fixed port every run shares
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))
