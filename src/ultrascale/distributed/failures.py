"""What a failed rank says about itself, and the heartbeat the launcher watches.

A distributed run fails in few ways, and each looks different from each rank:

- the rank that *caused* it died (a signal, an exception, the OOM killer) or froze;
- every other rank then fails *because* of it: a peer's socket closed ("Connection
  reset by peer"), or a collective waited longer than the run's `--timeout`.

The second kind is noise that buries the first. This module tells them apart by
the error's text (`classify`), and names where a rank was waiting when it gave up
(`describe`): the collective and its group (dp, tp, pp, dp_cp, world...), read from
the traceback's frames, since gloo's own message ("Timed out waiting 10000ms for
recv operation to complete") names neither.

Under `ultrascale train --nproc N` each worker also writes a heartbeat (wall-clock
time and step, once a second, from a thread) into a file the launcher reads: a
rank whose heartbeat stops while the others time out is the one that hung.
"""

from __future__ import annotations

import linecache
import os
import re
import select
import signal
import sys
import threading
import time
import traceback

# Environment set by the local launcher for its workers.
ENV_HEARTBEAT = "ULTRASCALE_HEARTBEAT"  # file this rank writes its heartbeat into
ENV_LAUNCHER_PID = "ULTRASCALE_LAUNCHER_PID"  # die with the launcher

HEARTBEAT_EVERY_S = 1.0
# A worker whose stdout was closed by its reader (`| head`) exits with the shell's status for a
# process ended by SIGPIPE: the launcher then ends the run as quietly as one process ends it.
EXIT_PIPE = 128 + 13

# Errors a rank gets because *another* rank failed: not the cause of a failed run.
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_LOST = re.compile(r"connection (reset|closed|refused)|broken pipe|ECONNRESET|EPIPE|"
                        r"communicator was aborted|peer (closed|disconnected)|"
                        r"NCCL error.*remote process exited", re.IGNORECASE)

# Names of torch.distributed's functions that wait for other ranks.
_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "new_group", "init_process_group",
}


def classify(text: str) -> str:
    """'timeout', 'peer-lost' (both secondary: the rank was waiting on another) or 'error'."""
    if _TIMEOUT.search(text):
        return "timeout"
    if _PEER_LOST.search(text):
        return "peer-lost"
    return "error"


def group_name(pg) -> str:
    """The grid name a process group was created with (build_context passes it as group_desc)."""
    if pg is None:
        return "world"
    desc = getattr(pg, "group_desc", None)
    if desc in (None, "undefined", ""):
        return "unnamed"
    return "world" if desc == "default_pg" else desc


def _short(path: str) -> str:
    i = path.rfind(os.sep + "ultrascale" + os.sep)
    return path[i + len("/ultrascale/"):] if i >= 0 else os.path.basename(path)


def wait_site(exc: BaseException) -> str:
    """Where the failing rank waited: 'all_reduce on group dp (parallel/data_parallel.py:102 in finish)'.

    Read from the traceback: the innermost torch.distributed function named like a
    collective (its `group` argument gives the group), and the innermost frame of
    this package. An asynchronous collective fails in `work.wait()`, where torch's
    frames are gone: the group is then the `group` (or `self.group`) in scope.
    """
    frames = list(traceback.walk_tb(exc.__traceback__))
    op = pg = None
    found_pg = False
    for frame, _ in reversed(frames):
        mod = frame.f_globals.get("__name__", "")
        if mod.startswith("torch.distributed") and frame.f_code.co_name in _COLLECTIVES:
            op = frame.f_code.co_name
            pg, found_pg = frame.f_locals.get("group"), True
            break
    ours = [(f, n) for f, n in frames if f.f_globals.get("__name__", "").startswith("ultrascale.")]
    where = ""
    if ours:
        frame, lineno = ours[-1]
        code = linecache.getline(frame.f_code.co_filename, lineno).strip()
        where = f"{_short(frame.f_code.co_filename)}:{lineno} in {frame.f_code.co_name}"
        if op is None:
            op = f"`{code}`" if code else "a collective"
            local = frame.f_locals
            if "group" in local:
                pg, found_pg = local["group"], True
            elif getattr(local.get("self"), "group", None) is not None:
                pg, found_pg = local["self"].group, True
    if op is None:
        return ""
    text = op + (f" on group {group_name(pg)}" if found_pg else "")
    return text + (f" ({where})" if where else "")


def describe(exc: BaseException, rank: int, timeout_s: float | None = None, step: int | None = None) -> str:
    """One line for a rank's failure, for the launcher (or a torchrun log) to show."""
    message = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    kind = classify(message)
    site = wait_site(exc)
    at = f" at step {step}" if step is not None else ""
    if kind == "timeout":
        limit = f" of {timeout_s:g} s (--timeout)" if timeout_s else ""
        return (f"rank {rank} gave up after the timeout{limit}{at}, waiting in {site or 'a collective'}: "
                f"another rank of that group stopped responding ({message})")
    if kind == "peer-lost":
        return f"rank {rank} lost a peer{at} in {site or 'a collective'}: another rank has died ({message})"
    return f"rank {rank} failed{at}: {message}"


# -- the worker's side of the launcher's supervision ---------------------------

_progress = {"step": None, "fd": None}


def note_step(step: int) -> None:
    """Record the step (counted from 1) this rank is working on, for its heartbeat and failure line."""
    _progress["step"] = step
    if _progress["fd"] is not None:
        _beat()  # at once: a rank that stops right after is reported at the right step


def current_step() -> int | None:
    return _progress["step"]


def _beat() -> None:
    step = _progress["step"]
    # One small write at offset 0, fixed width: a reader sees one beat or the next, never half.
    os.pwrite(_progress["fd"], f"{time.time():.3f} {-1 if step is None else step}".ljust(40).encode(), 0)


def _heartbeat() -> None:
    while True:
        _beat()
        time.sleep(HEARTBEAT_EVERY_S)


def die_with_parent() -> None:
    """Linux: this process is killed when its parent dies, so a killed launcher (or test
    runner) never leaves workers behind."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def die_with(pid: int) -> None:
    """This process ends when process `pid` ends, whichever process is its parent.

    A pool's workers are forked by multiprocessing's fork server, which is their parent and which
    lives as long as any of them (each holds the server's alive-pipe): parent-death alone lets a
    notebook kernel that is restarted, or a script that exits without closing its pool, leave a
    server and every worker behind, a few hundred MB each. A thread waits for `pid` to end (a
    pidfd on Linux 5.3+, else a poll each second) and ends this process."""

    def watch():
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone
            os._exit(1)
        except (AttributeError, OSError):  # no pidfd here: poll
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    os._exit(1)
                except PermissionError:
                    pass
                time.sleep(1.0)
        select.select([fd], [], [])  # readable once the process has ended
        os._exit(1)

    threading.Thread(target=watch, name="ultrascale-die-with-owner", daemon=True).start()


def name_process(name: str) -> None:
    """Linux: the name `ps`, `top` and psutil show (15 characters at most), e.g. which rank a
    process is, when every rank has the same command line."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        PR_SET_NAME = 15
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15])
    except (OSError, AttributeError):
        pass


def die_with_launcher() -> None:
    """In a process started with ENV_LAUNCHER_PID set: die with that process, also when it ended
    before this one could ask (its parent is then another process already)."""
    launcher = os.environ.get(ENV_LAUNCHER_PID)
    if launcher and sys.platform.startswith("linux"):
        die_with_parent()
        if os.getppid() != int(launcher):  # the launcher is already gone
            os._exit(1)


def start_worker_supervision() -> None:
    """In a worker of `launch_local`: named after its rank, die with the launcher, and beat."""
    name_process(f"ultrascale-r{os.environ.get('RANK', '?')}")
    die_with_launcher()
    path = os.environ.get(ENV_HEARTBEAT)
    if path:
        _progress["fd"] = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        threading.Thread(target=_heartbeat, name="ultrascale-heartbeat", daemon=True).start()


def read_heartbeat(path: str) -> tuple[float, int | None] | None:
    """(time of the last beat, step) from a heartbeat file, or None before the first beat."""
    try:
        with open(path) as f:
            t, step = f.read().split()
        return float(t), (None if int(step) < 0 else int(step))
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (R, S, D, T stopped, Z zombie), where /proc exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
