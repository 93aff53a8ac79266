"""Run the `ultrascale` command as a user would: a real process, its output captured."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def ultrascale(*args, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ultrascale ARGS` with one thread per process (several share the cores)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ultrascale", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


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
