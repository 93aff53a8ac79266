"""Run a notebook's code as N ranks, so that code written for one process is tried on several.

A notebook that calls `dist.init_process_group(..., world_size=1)` runs every collective
on a group of one, where a sum equals an average and a reduction done twice is
invisible: a SUM all-reduce hook on top of DDP passes every check at world size 1. The
execution check therefore runs such a notebook again as 2 plain Python processes (no
kernel), each executing the code cells in order, with `init_process_group` joined to
one real 2-rank gloo group whatever store, rank and size the notebook passes. Every
cell must still run, and each exercise's reference solution must still pass its check,
on every rank: both ranks build the same data from the same seeds, so correct
data-parallel code gives the same numbers as on one rank, and a sum does not.

    python -m ultrascale.series.multirank CELLS.json OUT.json   (RANK, WORLD_SIZE, MASTER_PORT set)
"""

from __future__ import annotations

import json
import linecache
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

WORLD = 2
_MAGIC = re.compile(r"^\s*[%!]")


def uses_process_group(sources) -> bool:
    return any("init_process_group" in s for s in sources)


def run_as_ranks(cells: list[tuple[int, str]], exercises: list[tuple[int, str, str]], timeout: float,
                 world: int = WORLD) -> list[str]:
    """Execute `cells` ((index, source)) then each exercise ((k, solution, check function)) on `world`
    processes; one line per problem, naming the cell or exercise and the rank."""
    from ultrascale.distributed.failures import ENV_LAUNCHER_PID
    from ultrascale.distributed.launch import free_port

    with tempfile.TemporaryDirectory(prefix="ultrascale-ranks-") as tmp:
        spec = os.path.join(tmp, "cells.json")
        with open(spec, "w") as f:
            json.dump({"cells": cells, "exercises": exercises}, f)
        port, procs = free_port(), []
        err_files = [open(os.path.join(tmp, f"rank{r}.err"), "w+") for r in range(world)]
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", MPLBACKEND="Agg")
            env[ENV_LAUNCHER_PID] = str(os.getpid())  # the ranks die with this check
            procs.append(subprocess.Popen([sys.executable, "-m", "ultrascale.series.multirank", spec,
                                           os.path.join(tmp, f"rank{rank}.json")], env=env, cwd=tmp,
                                          stdout=subprocess.DEVNULL, stderr=err_files[rank]))
        deadline, grace = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs):
            if grace is None and any(p.poll() is not None for p in procs):
                # One rank is done (or failed): the others get a moment, not the whole timeout,
                # since a rank waiting in a collective its peer never reached would wait forever.
                grace = time.monotonic() + 20.0
            if time.monotonic() > min(deadline, grace or deadline):
                break
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
        problems = []
        for rank, p in enumerate(procs):
            p.wait()
            err_files[rank].seek(0)
            err = err_files[rank].read()
            err_files[rank].close()
            out = os.path.join(tmp, f"rank{rank}.json")
            if not os.path.exists(out):
                if rank in hung:
                    problems.append(f"on {world} ranks, rank {rank} did not finish (waiting in a collective "
                                    f"that another rank never called?)")
                else:
                    tail = err.strip().splitlines()[-1:] or ["no output"]
                    problems.append(f"on {world} ranks, rank {rank} died: {tail[0]}")
                continue
            with open(out) as f:
                result = json.load(f)
            if result.get("cell") is not None:
                problems.append(f"cell {result['cell']} fails on {world} ranks (rank {rank}): {result['error']}")
            for k, error in result.get("exercises", {}).items():
                problems.append(f"exercise {k}: the reference solution fails its check on {world} ranks "
                                f"(rank {rank}): {error}; the code is only right on one process")
        # Both ranks usually say the same; say it once.
        seen, unique = set(), []
        for p in problems:
            key = re.sub(r"\(rank \d+\)", "", p)
            if key not in seen:
                seen.add(key)
                unique.append(p)
        return unique


def _join_real_group():
    """Make every init_process_group call join this process's rank of the real group."""
    import torch.distributed as dist

    real = dist.init_process_group

    def joined(*args, **kwargs):
        if dist.is_initialized():
            return
        real("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
             rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))

    dist.init_process_group = joined


def _exec(source: str, name: str, namespace: dict) -> None:
    source = "\n".join("pass  # " + line if _MAGIC.match(line) else line for line in source.splitlines())
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # inspect.getsource works
    exec(compile(source, name, "exec"), namespace)


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0] if text else type(e).__name__


def main(argv=None) -> int:
    from ultrascale.distributed.failures import die_with_launcher

    die_with_launcher()  # a check interrupted (Ctrl-C, a killed generator) leaves no rank waiting in a collective
    spec_path, out_path = (argv or sys.argv[1:])[:2]
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(1)
    _join_real_group()
    namespace = {"__name__": "__main__"}
    result = {"cell": None, "error": None, "exercises": {}}
    for index, source in spec["cells"]:
        try:
            _exec(source, f"<cell {index}>", namespace)
        except BaseException as e:  # noqa: BLE001 - reported, with the cell
            result.update(cell=index, error=_error(e))
            break
    if result["cell"] is None:
        for k, solution, check in spec["exercises"]:
            try:
                _exec(solution, f"<exercise {k} solution>", namespace)
                namespace[check]()
            except BaseException as e:  # noqa: BLE001
                result["exercises"][str(k)] = _error(e)
    with open(out_path, "w") as f:
        json.dump(result, f)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is written; teardown cannot change it
        traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
