"""Run the `ultrascale` command as a user would: a real process, its output captured."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import selectors
import subprocess
import sys
import tempfile
import time
import traceback


def ultrascale(*args, cwd=None, timeout: float = 300, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m ultrascale ARGS` in a process of its own, one thread per process (several share
    the cores): its exit status, stdout and stderr. Forked from a warm server (`forked`) unless
    `fresh`: a new interpreter, for what happens at start-up (lazy imports, a refused flag's
    cost, the command a user's shell runs)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = ["-m", "ultrascale", *args]
    if fresh:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd, env=env,
                              timeout=timeout)
    return forked(argv, cwd=cwd, env=env, timeout=timeout)


def forked(argv: list[str], cwd=None, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python ARGV` (`-m MODULE ARGS` or `SCRIPT ARGS`), forked from a server that has imported
    torch, dynamo and the command line already: the harness's fork server, one per test process.

    A new interpreter spends 3 of a tiny run's 3.5 CPU-seconds importing torch and dynamo, and a
    suite starts dozens. From the fork on it is the command as a shell runs it: these argv, working
    directory and environment (temporary files under its TMPDIR), stdin empty, stdout and stderr to
    files, its own exit status from sys.exit or an uncaught exception's traceback, its exit
    handlers. What a test changed in its own process (a monkeypatched module) does not reach it,
    as it would not reach a subprocess; variables torch reads when imported (ATEN_CPU_CAPABILITY)
    are the test process's."""
    from ultrascale.testing.harness import warm_context

    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        p = warm_context().Process(target=_become, args=(list(argv), cwd or os.getcwd(), env, out, err))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        with open(out, encoding="utf-8", errors="replace") as o, open(err, encoding="utf-8", errors="replace") as e:
            return subprocess.CompletedProcess([sys.executable, *argv], p.exitcode, o.read(), e.read())


def _become(argv, cwd, env, out, err):
    """In the forked process: become `python ARGV` and exit as it would."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read TMPDIR again: the server's choice is cached
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # what the interpreter does with sys.exit's argument
        code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - uncaught: its traceback, status 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
