"""Start N local processes the way torchrun would, and supervise them.

`ultrascale train --nproc N ...` re-runs the same command in N child processes
with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); a child sees WORLD_SIZE and joins the process group instead of
spawning again. On many machines, use torchrun itself: the code path is the same.

The launcher is also the run's supervisor (torchrun's agent does the same job on
each node):

- the workers' stdout is the launcher's (the logging rank's step lines, live);
  their stderr goes through the launcher, which forwards it while the run is
  healthy and keeps a copy per rank (`rankN.log` in a temporary directory);
- when one worker fails, the others are stopped at once (SIGTERM, SIGKILL after
  a grace period), and one line names the rank that caused it: its signal or exit
  code and the end of its own error output. The other ranks' errors ("Connection
  reset by peer", timeouts) are consequences: they stay in their log files;
- every worker writes a heartbeat; a rank that stops beating while the others
  time out (or for longer than the timeout) is named as the one that hung;
- a reader that stops reading (`| head`) ends the run as it ends one process:
  quietly, status 0, the run folder removed, every worker stopped (the rank whose
  stdout broke exits with failures.EXIT_PIPE; a closed stderr is the launcher's own);
- SIGINT, SIGTERM or SIGHUP to the launcher stops every worker, and the launcher
  exits with 128 + the signal's number. Workers sit in their own sessions (a
  terminal's Ctrl-C reaches only the launcher, which decides) and die with the
  launcher if it is killed outright (Linux's parent-death signal).

How the workers start: on Linux, when the caller names the modules every worker
imports, the launcher imports them once and forks the workers from itself (torch
and its compiler stack take seconds of CPU to import; N ranks on a laptop would
pay it N times). Elsewhere, each worker is a fresh `python -m ultrascale`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

from ultrascale.distributed import failures

POLL_S = 0.05
GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping the other workers
# A dying process's sockets close before it can be reaped, so its peers may be seen failing
# ("connection reset") first: how long a run ended by such consequences waits for the cause.
CAUSE_WAIT_S = 2.0
TAIL_LINES = 12  # of the failed rank's stderr, shown under its cause line
ENV_LAUNCHED = "ULTRASCALE_LAUNCHED"  # set in the workers of launch_local
ENV_STDERR_TTY = "ULTRASCALE_STDERR_TTY"  # the launcher's stderr is a terminal (progress bar)

_HOLD_MARKERS = (b"Traceback (most recent call last)", b"ultrascale: ")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port for rank 0's store, free now and outside the kernel's ephemeral range.

    Between this check and rank 0's bind the port is unheld. A port the kernel hands out itself
    (bind to 0) comes from the ephemeral range, which every outgoing connection on the machine also
    draws from (gloo's, other runs'): one of them can take it in that window (EADDRINUSE, seen with
    runs side by side on two cores). Below that range only a listener that names the port can."""
    low, _ = _ephemeral_range()
    pick = random.Random()  # not the caller's seeded global generator
    for _ in range(64):
        port = pick.randrange(max(1024, low // 2), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_worker() -> bool:
    """True inside a process started by torchrun or by `launch_local`."""
    return "WORLD_SIZE" in os.environ


def launched_locally() -> bool:
    """True inside a worker of `launch_local` (not torchrun)."""
    return os.environ.get(ENV_LAUNCHED) == "1"


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class _ForkedWorker:
    """A worker forked from the launcher, with the part of `subprocess.Popen` the supervisor uses."""

    def __init__(self, argv: list[str], env: dict[str, str], worker_main, signals, others=()) -> None:
        self.returncode: int | None = None
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            for fd in (read, *others):  # the other ranks' pipes are the launcher's to read
                os.close(fd)
            _run_forked(argv, env, worker_main, signals, write)  # never returns
        os.close(write)
        self.stderr = os.fdopen(read, "rb", buffering=0)

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def _run_forked(argv, env, worker_main, signals, stderr_fd) -> None:
    """In the forked child: become what `python -m ultrascale *argv` with `env` would be."""
    code = 1
    try:
        os.setsid()  # its own session, as start_new_session=True gives a spawned worker
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        for sig in signals:  # the launcher's handlers are not the worker's
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        import torch  # already imported by the launcher: its thread count was read from another environment

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        sys.argv = [sys.argv[0], *argv]
        code = worker_main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception in a fresh interpreter
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what a normal interpreter exit runs (os._exit skips it)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _can_fork(preload) -> bool:
    # Linux only: macOS' system libraries are not safe to use after fork().
    return bool(preload) and sys.platform.startswith("linux") and hasattr(os, "fork")


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen | _ForkedWorker
    log: str
    heartbeat: str
    reader: threading.Thread | None = None
    holding: bool = False  # its stderr has started an error report: held back, not forwarded
    held: bytearray = field(default_factory=bytearray)
    returncode: int | None = None


class _Supervisor:
    def __init__(self, argv, nproc, threads_per_proc, timeout_s, worker_main=None, preload=(), signals=()):
        self.argv, self.nproc, self.threads, self.timeout_s = argv, nproc, threads_per_proc, timeout_s
        self.worker_main, self.preload, self.signals = worker_main, preload, signals
        self.workers: list[_Worker] = []
        self.chunks: queue.SimpleQueue = queue.SimpleQueue()
        self.signal: int | None = None
        self.pipe_closed = False  # our stderr's reader stopped reading
        self.started = time.time()
        self.dir = tempfile.mkdtemp(prefix="ultrascale-run-")

    # -- starting -----------------------------------------------------------
    def start(self) -> None:
        fork = _can_fork(self.preload) and self.worker_main is not None
        if fork:
            for name in self.preload:  # once here instead of once per rank
                importlib.import_module(name)
            self.started = time.time()  # a rank's heartbeat is awaited from its start
            # CUDA cannot be used again in a child forked after the parent used it (the launcher's
            # checks may have: a bf16 or device query): then the ranks start fresh.
            fork = not _cuda_initialized()
        port = free_port()
        tty = sys.stderr.isatty()
        for rank in range(self.nproc):
            log, hb = os.path.join(self.dir, f"rank{rank}.log"), os.path.join(self.dir, f"rank{rank}.heartbeat")
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.nproc),
                       LOCAL_WORLD_SIZE=str(self.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
            env.update({ENV_LAUNCHED: "1", failures.ENV_HEARTBEAT: hb, failures.ENV_LAUNCHER_PID: str(os.getpid())})
            if tty:
                env[ENV_STDERR_TTY] = "1"
                env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
            # Own session: a signal for the launcher's terminal group reaches the launcher alone,
            # and killpg(pid) reaches the worker with anything it started.
            if fork:
                others = [w.proc.stderr.fileno() for w in self.workers]
                proc = _ForkedWorker(self.argv, env, self.worker_main, self.signals, others)
            else:
                proc = subprocess.Popen([sys.executable, "-m", "ultrascale", *self.argv], env=env,
                                        stderr=subprocess.PIPE, start_new_session=True)
            self.workers.append(_Worker(rank, proc, log, hb))
        for w in self.workers:  # threads only once every fork is done
            w.reader = threading.Thread(target=self._read, args=(w,), daemon=True)
            w.reader.start()

    def _read(self, w: _Worker) -> None:
        fd = w.proc.stderr.fileno()
        with open(w.log, "ab") as log:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                self.chunks.put((w.rank, chunk))

    # -- watching -----------------------------------------------------------
    def _forward(self, chunks) -> None:
        try:
            self._write(chunks)
        except BrokenPipeError:  # our stderr's reader stopped reading (`2>&1 | head`)
            self.pipe_closed = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())

    def _write(self, chunks) -> None:
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        for rank, chunk in chunks:
            w = self.workers[rank]
            if not w.holding:
                cut = min((i for i in (chunk.find(m) for m in _HOLD_MARKERS) if i >= 0), default=-1)
                if cut >= 0:
                    w.holding = True
                    w.held += chunk[cut:]
                    chunk = chunk[:cut]
                if chunk:
                    if out is not None:
                        out.write(chunk)
                        out.flush()
                    else:
                        sys.stderr.write(chunk.decode(errors="replace"))
                        sys.stderr.flush()
            else:
                w.held += chunk

    def _drain(self) -> list:
        chunks = []
        while True:
            try:
                chunks.append(self.chunks.get_nowait())
            except queue.Empty:
                return chunks

    def heartbeat_age(self, w: _Worker, now: float) -> tuple[float, int | None]:
        beat = failures.read_heartbeat(w.heartbeat)
        return (now - self.started, None) if beat is None else (now - beat[0], beat[1])

    def watch(self):
        """Wait until every worker succeeded, one failed, a rank froze, or a signal came.

        Returns ('ok', []), ('failed', [workers found failed]), ('hung', [frozen workers])
        or ('signal', []).
        """
        watchdog = self.timeout_s + max(15.0, 0.1 * self.timeout_s)
        while True:
            if self.signal is not None:
                return "signal", []
            # Output first, then the processes: output that a rank wrote after another one
            # died is then never forwarded (it is that death's consequence).
            chunks = self._drain()
            failed = []
            for w in self.workers:
                if w.returncode is None and w.proc.poll() is not None:
                    w.returncode = w.proc.returncode
                    if w.returncode != 0:
                        failed.append(w)
            if self.pipe_closed or any(w.returncode == failures.EXIT_PIPE for w in failed):
                return "pipe", []
            if failed:
                return "failed", failed
            self._forward(chunks)
            if self.pipe_closed:
                return "pipe", []
            running = [w for w in self.workers if w.returncode is None]
            if not running:
                return "ok", []
            now = time.time()
            frozen = [w for w in running if self.heartbeat_age(w, now)[0] > watchdog]
            if frozen:
                return "hung", frozen
            time.sleep(POLL_S)

    def await_cause(self, failed: list[_Worker]) -> list[_Worker]:
        """`failed` and any rank that ends within CAUSE_WAIT_S, while all of them only waited on another.

        The kernel closes a dying rank's sockets before its parent can reap it: the peer that
        reads "connection reset" may exit and be seen first. Waiting briefly for the cause names
        it instead of calling every rank alive.
        """
        for w in failed:  # its last words reach its log through the reader: read them whole
            if w.reader is not None:
                w.reader.join(timeout=1.0)
        deadline = time.monotonic() + CAUSE_WAIT_S
        while (all(self.kind(w) in ("peer-lost", "timeout") for w in failed)
               and time.monotonic() < deadline):
            running = [w for w in self.workers if w.returncode is None]
            if not running:
                break
            time.sleep(POLL_S)
            for w in running:
                if w.proc.poll() is not None:
                    w.returncode = w.proc.returncode
                    if w.returncode != 0:
                        failed.append(w)
        return failed

    # -- stopping -----------------------------------------------------------
    def stop_all(self, first=signal.SIGTERM) -> None:
        """Stop every running worker: `first`, then SIGKILL after the grace period."""
        running = [w for w in self.workers if w.returncode is None and w.proc.poll() is None]
        for w in running:
            for sig in (first, signal.SIGCONT):  # SIGCONT: a stopped process acts on the signal now
                self._killpg(w, sig)
        deadline = time.monotonic() + GRACE_S
        for w in running:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._killpg(w, signal.SIGKILL)
        for w in self.workers:
            if w.proc.poll() is None:
                self._killpg(w, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # only a process stuck in the kernel
                w.proc.wait(timeout=GRACE_S)
            if w.returncode is None:
                w.returncode = w.proc.returncode
        for w in self.workers:
            if w.reader is not None:
                w.reader.join(timeout=2.0)
        self._drain()

    @staticmethod
    def _killpg(w: _Worker, sig) -> None:
        try:
            os.killpg(w.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                w.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    # -- reporting ----------------------------------------------------------
    def tail(self, w: _Worker, lines: int = TAIL_LINES) -> list[str]:
        try:
            with open(w.log, "rb") as f:
                f.seek(max(0, os.path.getsize(w.log) - 65536))
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()][-lines:]

    def summary(self, w: _Worker) -> str:
        """The rank's own one-line account of its failure, if it wrote one."""
        for line in reversed(self.tail(w, 200)):
            if line.startswith("ultrascale: "):
                return line[len("ultrascale: "):]
        return ""

    def kind(self, w: _Worker) -> str:
        """'signal', 'error', 'timeout' or 'peer-lost' (the last two: a consequence of another rank)."""
        if w.returncode is not None and w.returncode < 0:
            if -w.returncode == signal.SIGABRT:
                # NCCL's watchdog aborts a rank whose collective timed out (or lost a peer):
                # a consequence, like gloo's exception, when its last words say so.
                kind = failures.classify("\n".join(self.tail(w, 20)))
                if kind != "error":
                    return kind
            return "signal"
        text = self.summary(w) or "\n".join(self.tail(w, 3))
        return failures.classify(text)

    def stalled(self, now: float) -> list[tuple[_Worker, float, int | None, str | None]]:
        """Running ranks that have not beaten for a while, or that the kernel shows as stopped."""
        threshold = max(3.0, 0.5 * self.timeout_s)
        out = []
        for w in self.workers:
            if w.proc.poll() is not None:
                continue
            age, step = self.heartbeat_age(w, now)
            state = failures.process_state(w.proc.pid)
            if age > threshold or state in ("T", "t", "D"):
                out.append((w, age, step, state))
        return out

    def describe_failure(self, failed: list[_Worker], stalled) -> tuple[int, list[str]]:
        """(exit code, lines to print) for a run ended by `failed` (the first ranks seen failing)."""
        order = {"signal": 0, "error": 1, "timeout": 2, "peer-lost": 3}  # a timeout is upstream of a lost peer
        failed = sorted(failed, key=lambda w: (order[self.kind(w)], w.rank))
        first = failed[0]
        kind = self.kind(first)
        others = "stopped the other rank" if self.nproc == 2 else f"stopped the other {self.nproc - 1} ranks"
        if kind == "signal":
            sig = -first.returncode
            hint = (" (sent from outside: the kernel's out-of-memory killer, a job scheduler, or kill -9)"
                    if sig == signal.SIGKILL else "")
            lines = [f"ultrascale: rank {first.rank} was killed by signal {sig} ({signal_name(sig)}){self.at(first)}"
                     f"{hint}; {others}"]
            lines += [f"  | {line}" for line in self.tail(first)]
            return 128 + sig, lines
        if kind == "error":
            error = [line for line in self.tail(first, 200) if line.startswith("ultrascale: error:")]
            if first.returncode in (1, 2) and error:
                # A configuration mistake found in a worker (2), or a diverged run (1): its one line.
                return first.returncode, [error[-1]]
            # Its traceback's end (its own one-line account repeats the cause line: left out).
            tail = [line for line in self.tail(first, TAIL_LINES + 1) if not line.startswith("ultrascale: ")]
            return first.returncode, ([f"ultrascale: rank {first.rank} failed with exit code {first.returncode}"
                                       f"{self.at(first)}; {others}. Its last lines:"]
                                      + [f"  | {line}" for line in tail[-TAIL_LINES:]])
        # Every rank seen failing was waiting on another: find the one that stopped.
        said = self.summary(first) or (self.tail(first, 1) or ["(no output)"])[0]
        ended = [w for w in self.workers if w.returncode == 0]
        if ended and not stalled:
            names = ", ".join(f"rank {w.rank}" for w in ended)
            return 1, [f"ultrascale: {names} ended (status 0) while the others still waited for "
                       f"{'it' if len(ended) == 1 else 'them'} in a collective; {others}", f"  | {said}"]
        if stalled:
            names = ", ".join(f"rank {w.rank}" for w, *_ in stalled)
            w, age, step, state = stalled[0]
            how = {"T": "the process is stopped (SIGSTOP or a debugger)", "t": "the process is stopped by a tracer",
                   "D": "the process is blocked in the kernel (disk, network file system or driver)"}.get(
                       state, "the process is running but its heartbeat stopped")
            at = f" at step {step}" if step is not None else ""
            return 1, [f"ultrascale: {names} stopped responding{at}: no heartbeat for {age:.0f} s, {how}; "
                       f"the others gave up after --timeout {self.timeout_s:g} s; {others}",
                       f"  | {said}"]
        if kind == "timeout":
            return 1, [f"ultrascale: a collective timed out after --timeout {self.timeout_s:g} s with every "
                       f"rank still alive (ranks calling different collectives, or one stuck in a long "
                       f"computation); {others}", f"  | {said}"]
        return 1, [f"ultrascale: rank {first.rank} lost a peer, but every other rank was alive; {others}",
                   f"  | {said}"]

    def at(self, w: _Worker) -> str:
        step = self.heartbeat_age(w, time.time())[1]
        return f" at step {step}" if step is not None else ""

    def cleanup(self, keep_logs: bool) -> None:
        if keep_logs:
            for w in self.workers:
                with contextlib.suppress(OSError):
                    os.remove(w.heartbeat)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def launch_local(argv: list[str], nproc: int, threads_per_proc: int | None = None, *,
                 timeout_s: float = 300.0, on_failure=None, worker_main=None, preload=()) -> int:
    """Run `python -m ultrascale *argv` in nproc processes and supervise them; the exit status.

    With `worker_main` (what `python -m ultrascale` calls with argv) and `preload` (the modules
    every worker imports), on Linux the workers are forked from this process once it imported
    `preload`, and call worker_main(argv): one import for all ranks.

    0 when every process succeeded. Otherwise the run is ended as soon as one rank
    fails (or freezes), one line names the cause, and the status is the failed rank's
    (128 + signal for a signal, 1 for a hang); 128 + signal when the launcher itself is
    told to stop. `on_failure()` runs after every worker is gone, on any unsuccessful end
    (the trainer passes the removal of a half-written checkpoint).
    """
    if threads_per_proc is None:
        # Processes share the machine's cores: more threads than cores only thrash.
        threads_per_proc = max(1, (os.cpu_count() or 1) // nproc)
    handled = [getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)]
    sup = _Supervisor(argv, nproc, threads_per_proc, timeout_s, worker_main, preload, handled)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(sig, frame):
            if sup.signal is not None:  # a second one: no more grace
                for w in sup.workers:
                    sup._killpg(w, signal.SIGKILL)
            sup.signal = sig

        previous = {s: signal.signal(s, on_signal) for s in handled}
    try:
        sup.start()
        outcome, who = sup.watch()
        if outcome == "ok":
            for w in sup.workers:
                w.reader.join(timeout=2.0)
            sup._forward(sup._drain())
            for w in sup.workers:  # held output of ranks that ended well (e.g. a warning with a traceback)
                if w.held:
                    sys.stderr.write(w.held.decode(errors="replace"))
            sup.cleanup(keep_logs=False)
            return 0
        if outcome == "pipe":
            # The reader has what it wanted: stop, as one process does, and say nothing.
            sup.stop_all(signal.SIGTERM)
            if on_failure is not None:
                on_failure()  # a save cut short is not left behind
            sup.cleanup(keep_logs=False)
            return 0
        if outcome == "signal":
            sig = sup.signal
            sup.stop_all(signal.SIGTERM)
            print(f"ultrascale: stopped by {signal_name(sig)}: ended all {nproc} worker processes", file=sys.stderr)
            code = 128 + sig
            keep = False
        else:
            now = time.time()
            if outcome == "hung":
                w = who[0]
                (age, step), state = sup.heartbeat_age(w, now), failures.process_state(w.proc.pid)
            else:
                who = sup.await_cause(who)
                now = time.time()
                stalled = sup.stalled(now)  # before stopping anyone: who had stopped beating
            sup.stop_all(signal.SIGTERM)
            if outcome == "hung":
                names = ", ".join(f"rank {w.rank}" for w in who)
                at = f" at step {step}" if step is not None else ""
                code, lines = 1, [f"ultrascale: {names} made no progress{at} for {age:.0f} s, longer than "
                                  f"--timeout {timeout_s:g} s (process state {state or '?'}); stopped all {nproc} ranks"]
            else:
                code, lines = sup.describe_failure(who, stalled)
            # A worker's one-line error (a configuration mistake, a diverged run) is the whole story.
            keep = not (len(lines) == 1 and lines[0].startswith("ultrascale: error: "))
            if keep:
                lines.append(f"ultrascale: every rank's output is in {sup.dir}/rank<N>.log")
            print("\n".join(lines), file=sys.stderr, flush=True)
        if on_failure is not None:
            on_failure()
        sup.cleanup(keep_logs=keep)
        return code
    finally:
        for w in sup.workers:  # whatever happened above, nothing stays running
            if w.proc.poll() is None:
                sup._killpg(w, signal.SIGKILL)
                w.proc.wait()
        for s, h in previous.items():
            signal.signal(s, h)
