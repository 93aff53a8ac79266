"""Run the `ultrascale` command as a user would: a real process, its output captured."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time


def ultrascale(*args, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ultrascale ARGS` with one thread per process (several share the cores)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ultrascale", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def read_until(pipe, enough, limit: float) -> tuple[list[bytes], str | None]:
    """The complete lines a child process wrote to `pipe` until `enough(lines)` holds, and why the
    reading stopped short: None when it did not, else "timeout" (nothing more within `limit`
    seconds) or "ended" (the pipe closed).

    It reads the pipe's file descriptor, not the buffered file object: a buffered readline() may
    take two lines off the pipe and hand back one, and a select() waiting for the second then
    never wakes, since that line is already out of the pipe."""
    fd, data = pipe.fileno(), b""
    deadline = time.monotonic() + limit
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            lines = data.split(b"\n")[:-1]
            if enough(lines):
                return lines, None
            left = deadline - time.monotonic()  # a child that keeps writing other lines still runs out
            if left <= 0 or not sel.select(timeout=left):
                return lines, "timeout"
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return lines, "ended"
            data += chunk


def jsonl_losses(path) -> list[float]:
    """The per-step losses of a `--log-jsonl` file."""
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def ranks(processes) -> dict:
    """{rank: process} of a launcher's workers (psutil processes), from the names the workers give
    themselves (`ultrascale-r<rank>`); one not named yet is left out."""
    found = {}
    for p in processes:
        name = p.name()
        if name.startswith("ultrascale-r") and name[len("ultrascale-r"):].isdigit():
            found[int(name[len("ultrascale-r"):])] = p
    return found
