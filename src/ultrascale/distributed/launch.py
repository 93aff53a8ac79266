"""Start N local processes the way torchrun would.

`ultrascale train --nproc N ...` re-runs the same command in N child processes
with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); a child sees WORLD_SIZE and joins the process group instead of
spawning again. On many machines, use torchrun itself: the code path is the same.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_worker() -> bool:
    """True inside a process started by torchrun or by `launch_local`."""
    return "WORLD_SIZE" in os.environ


def launch_local(argv: list[str], nproc: int, threads_per_proc: int | None = None) -> int:
    """Run `python -m ultrascale *argv` in nproc processes; return the first non-zero exit code, or 0.

    When one process fails the others are stopped, so a crash never leaves the rest
    waiting forever in a collective.
    """
    port = free_port()
    if threads_per_proc is None:
        # Processes share the machine's cores: more threads than cores only thrash.
        threads_per_proc = max(1, (os.cpu_count() or 1) // nproc)
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", str(threads_per_proc))
        procs.append(subprocess.Popen([sys.executable, "-m", "ultrascale", *argv], env=env))
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    for other in procs:
                        other.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        code = 130
    finally:
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return code
