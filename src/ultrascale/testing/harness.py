"""Run a function on N real gloo processes, from pytest or anywhere.

Starting processes and a process group costs seconds (importing torch, the TCP
rendezvous); a test suite that runs hundreds of distributed checks cannot pay
that each time. A `WorkerPool` starts N processes once, joins them in one gloo
group, and then runs any importable function on all ranks, as many times as
asked. Contexts for each parallel layout are built once per pool and reused.

A hang is a failure, not a stuck CI: every call has a deadline; past it (or
shortly after one rank fails while others wait in a collective) the pool is
killed and the caller gets an error with each rank's traceback.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from datetime import timedelta

from ultrascale.distributed.launch import free_port


class DistributedError(RuntimeError):
    """A function failed (or hung) on at least one rank."""

    finished: dict = {}  # rank -> return value, of the ranks that returned before the others hung


def _worker(rank: int, world: int, port: int, tasks, results, owner: int):
    from ultrascale.distributed.failures import die_with, die_with_parent

    # No pool outlives the process that started it (a killed test runner, a restarted notebook
    # kernel): its parent is the fork server, which outlives the owner, so watch the owner itself.
    die_with_parent()
    die_with(owner)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    while True:
        try:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = pickle.loads(task)
            # Pickle here, not in the queue's feeder thread, so an unpicklable result is an error, not a hang.
            results.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
        except BaseException:  # noqa: BLE001 - everything goes back to the caller
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


# What every worker imports, imported once in the server its workers are forked from (and the
# command line, whose runs testing/cli.py forks from the same server).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ultrascale.train.trainer", "ultrascale.testing.compare",
            "ultrascale.cli"]


def warm_context():
    """A new process that imports torch costs seconds of CPU; a pool of 4 started with `spawn` pays
    that four times, and every restart of a pool again. `forkserver` pays it once per caller: one
    server imports torch (and what workers run) and forks each worker from that state, which holds
    no threads of ours, no process group and no CUDA context, the guarantees `spawn` gives. Where
    there is no forkserver (Windows), spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once this process's server runs: it has them
    return ctx


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = warm_context()
        port = free_port()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        owner = os.getpid()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results, owner),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = 240, stalled=None, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank; the list of return values, by rank.

        `stalled(pending ranks)`, asked about once a second while ranks are still running, may
        return a sentence: those ranks can never finish (a deadlock it can see), so the pool is
        killed and the sentence is the error, without waiting for the timeout."""
        task = pickle.dumps((fn, args, kwargs))  # fails here, in the caller, if it cannot travel
        for q in self.tasks:
            q.put(task)
        try:
            return self._collect(fn, timeout, stalled)
        except BaseException:
            # Left running (an interrupt, a `stalled` that raised), the ranks would finish this task
            # later and hand its results to the next caller's: a pool is reused only between tasks.
            self.close(kill=True)
            raise

    def _collect(self, fn, timeout: float, stalled) -> list:
        deadline = time.monotonic() + timeout
        out, errors, grace = {}, {}, False
        while len(out) + len(errors) < self.world_size:
            if (errors or not self.alive) and not grace:
                # The others may be blocked in a collective the failed (or dead) rank never joined.
                grace, deadline = True, min(deadline, time.monotonic() + 5.0)
            remaining = deadline - time.monotonic()
            pending = sorted(set(range(self.world_size)) - set(out) - set(errors))
            stuck = stalled(pending) if stalled is not None and not errors else None
            if stuck:
                self.close(kill=True)
                error = DistributedError(f"{fn.__name__} on {self.world_size} ranks cannot finish: {stuck}")
                error.finished = out  # what the ranks that returned gave: often the cause of the others' wait
                raise error
            try:
                rank, ok, value = self.results.get(timeout=max(0.01, min(remaining, 1.0)))
            except queue.Empty:
                if remaining > 1.0 and self.alive:
                    continue
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                self.close(kill=True)
                missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                why = f"(ranks {dead} died)" if dead else f"within {timeout:.0f}s"
                raise DistributedError(
                    f"{fn.__name__} on {self.world_size} ranks: ranks {missing} did not finish {why}{msg}") from None
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = value
        if errors:
            self.close(kill=True)
            msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise DistributedError(f"{fn.__name__} failed on {len(errors)} of {self.world_size} ranks:{msg}")
        return [out[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        self.request_close(kill)
        self.join()

    def request_close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)

    def join(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


_POOLS: dict[int, WorkerPool] = {}


def run_distributed(world_size: int, fn, *args, timeout: float = 240, stalled=None, **kwargs) -> list:
    """Run fn on `world_size` gloo processes (a pool kept for reuse); return each rank's result."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = WorkerPool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, stalled=stalled, **kwargs)
    finally:
        if not pool.alive:
            _POOLS.pop(world_size, None)


def shutdown_pools() -> None:
    # Ask all pools first, then wait: their shutdowns overlap.
    for pool in _POOLS.values():
        pool.request_close()
    for pool in _POOLS.values():
        pool.join()
    _POOLS.clear()


_CONTEXTS: dict = {}


def worker_context(layout):
    """The ParallelContext for `layout` over this worker's process group, built once per layout."""
    import torch.distributed as dist

    from ultrascale.distributed.context import build_context

    layout = layout.resolve(dist.get_world_size())
    key = (layout.dp, layout.pp, layout.cp, layout.tp, layout.ep)
    if key not in _CONTEXTS:
        _CONTEXTS[key] = build_context(layout, dist.get_rank(), dist.get_world_size(), backend="gloo")
    # Same groups, this call's full layout (zero stage and the like do not change the groups).
    return dataclasses.replace(_CONTEXTS[key], layout=layout)
