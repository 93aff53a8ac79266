"""How a run fails, as a user meets it: real processes killed, stopped and signalled.

Each multi-process test starts `ultrascale train --nproc N` with a run far longer
than the test, waits for the first step line (every worker is then training),
does to one process what a machine does to it (SIGKILL, SIGSTOP, SIGTERM), and
asserts what the user sees: how soon the launcher exits, its status, the line
that names the cause, and that no process is left behind.
"""

import glob
import os
import signal
import subprocess
import sys
import time

import psutil  # a dev dependency: the workers are found as the launcher's children, named after their rank
import pytest

from ultrascale.testing.cli import ranks, read_until

# The launcher's supervision reads /proc and uses Linux's parent-death signal.
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc: Linux")

LONG_RUN = ["--model", "tiny", "--steps", "100000", "--seq-len", "16", "--micro-batch", "1", "--no-progress",
            "--log-every", "100000"]  # prints step 1 only


def ultrascale(*args, timeout=60):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ultrascale", *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    return r, time.monotonic() - start


class Run:
    """A launcher and its workers, with everything killed at the end whatever happened."""

    def __init__(self, nproc, *args, tmp=None):
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp))  # the launcher's rank logs go there
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "ultrascale", "train", *LONG_RUN, "--nproc", str(nproc), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.nproc, self.workers, self.tmp = nproc, {}, tmp

    def wait_until_training(self, limit=240):
        """Block until the logging rank printed step 1; then map rank -> worker process."""
        _, short = read_until(self.launcher.stdout, lambda lines: any(x.startswith(b"step") for x in lines), limit)
        if short == "timeout":
            pytest.fail(f"no step line within {limit} s")
        if short == "ended":
            out, err = self.finish()
            pytest.fail(f"the run ended before its first step:\n{err}")
        self.workers = ranks(psutil.Process(self.launcher.pid).children())
        assert sorted(self.workers) == list(range(self.nproc))

    def wait_until_started(self, limit=120):
        """Block until every worker runs this package's code (its first heartbeat is written)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            workers = ranks(psutil.Process(self.launcher.pid).children())
            if len(workers) == self.nproc:
                beats = [glob.glob(f"{self.tmp}/ultrascale-run-*/rank{r}.heartbeat") for r in workers]
                if all(b and os.path.getsize(b[0]) for b in beats):
                    self.workers = workers
                    return
            time.sleep(0.05)
        pytest.fail(f"the workers did not start within {limit} s")

    def finish(self, limit=120):
        out, err = self.launcher.communicate(timeout=limit)
        return out.decode(errors="replace"), err.decode(errors="replace")

    def left_running(self, within=5.0):
        """Workers still alive `within` seconds from now (zombies count as gone)."""
        deadline = time.monotonic() + within
        while True:
            alive = [r for r, p in self.workers.items() if _alive(p)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)

    def kill_everything(self):
        for p in self.workers.values():
            if _alive(p):
                p.kill()  # SIGKILL also ends a stopped process
        if self.launcher.poll() is None:
            self.launcher.kill()
            self.launcher.wait()


def _alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def run(tmp_path):
    runs = []

    def start(nproc, *args):
        runs.append(Run(nproc, *args, tmp=tmp_path))
        return runs[-1]

    yield start
    for r in runs:
        r.kill_everything()


def test_a_killed_rank_ends_the_run_and_is_named(run):
    r = run(4)
    r.wait_until_training()
    r.workers[2].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out, err = r.finish()
    took = time.monotonic() - killed
    assert took < 10, f"the launcher took {took:.1f} s to exit after the kill"
    assert r.launcher.returncode == 128 + 9, err
    assert "rank 2 was killed by signal 9 (SIGKILL)" in err.splitlines()[0], err
    # The survivors' "Connection reset/closed by peer" are consequences: kept in their logs, not shown.
    assert "Connection" not in err + out and "Traceback" not in err, err
    assert r.left_running() == []


def _a_survivor_exits_before_the_rank_that_died_is_reaped(argv):
    # The kernel closes a dying process's sockets before its parent can reap it: the survivor that
    # read "connection reset" may be seen ending first. Here that order is made certain.
    rank = int(os.environ["RANK"])
    if rank == 1:
        os.write(2, b"ultrascale: rank 1 lost a peer at step 2 in `work.wait()` on group dp_cp: another rank has "
                    b"died (RuntimeError: Read error [127.0.0.1]:4242: Connection reset by peer)\n")  # fd 2: the log
        return 1
    if rank == 0:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return 0


def test_a_killed_rank_seen_after_the_peer_that_lost_it_is_still_named(capsys):
    from ultrascale.distributed.launch import launch_local

    started = time.monotonic()
    code = launch_local(["train"], 3, 1, worker_main=_a_survivor_exits_before_the_rank_that_died_is_reaped,
                        preload=("os",))
    err = capsys.readouterr().err
    assert code == 128 + 9, err
    assert err.splitlines()[0].startswith("ultrascale: rank 0 was killed by signal 9 (SIGKILL)"), err
    assert time.monotonic() - started < 30, "the other ranks were not stopped"


def test_a_stalled_rank_ends_the_run_within_the_timeout(run):
    r = run(2, "--timeout", "10")
    r.wait_until_training()
    r.workers[1].send_signal(signal.SIGSTOP)  # a hung rank: alive, silent
    stopped = time.monotonic()
    out, err = r.finish()
    took = time.monotonic() - stopped
    # Within the timeout and a margin, not torch's 30-minute default.
    assert took < 10 + 15, f"the run took {took:.1f} s to end after the stop"
    assert r.launcher.returncode == 1, err
    first = err.splitlines()[0]
    assert "rank 1 stopped responding" in first and "stopped (SIGSTOP" in first and "--timeout 10" in first, err
    # The survivor's own account: the timeout, the collective's place and its group.
    assert "rank 0 gave up after the timeout of 10 s" in err and " on group dp_cp " in err, err
    assert "Traceback" not in err
    assert r.left_running() == []


def test_sigterm_to_the_launcher_stops_every_worker(run):
    # As soon as the workers run (not only once they train: their start-up is what makes
    # this test slow on a busy machine, and a stop is a stop, whatever the worker is doing).
    r = run(2)
    r.wait_until_started()
    r.launcher.send_signal(signal.SIGTERM)
    out, err = r.finish(limit=30)
    assert r.launcher.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "ultrascale: stopped by SIGTERM: ended all 2 worker processes"
    assert r.left_running() == []


@pytest.mark.parametrize("flag,path", [("--save", "/proc/ck"), ("--log-jsonl", "/proc/x.jsonl"),
                                       ("--pp-trace", "/proc/trace.json")])
def test_an_unwritable_output_is_refused_before_any_process_starts(flag, path):
    r, took = ultrascale("train", *LONG_RUN, "--nproc", "4", flag, path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ultrascale: error: {flag} {path}: cannot write in /proc"), r.stderr
    assert took < 10 and r.stdout == ""
    assert not os.path.exists(path)


def test_a_save_path_under_a_file_is_refused_and_nothing_is_created(tmp_path):
    (tmp_path / "file").write_text("x")
    r, _ = ultrascale("train", *LONG_RUN, "--save", str(tmp_path / "file" / "sub" / "ck"))
    assert r.returncode == 2 and "is a file, not a directory" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_the_writability_check_creates_nothing(tmp_path):
    from ultrascale.config import ConfigError
    from ultrascale.preflight import check_writable_dir, check_writable_file

    check_writable_dir("--save", str(tmp_path / "a" / "b" / "ck"))  # creatable: accepted
    check_writable_file("--log-jsonl", str(tmp_path / "logs" / "run.jsonl"))
    (tmp_path / "existing.jsonl").write_text("kept\n")
    check_writable_file("--log-jsonl", str(tmp_path / "existing.jsonl"))
    assert sorted(os.listdir(tmp_path)) == ["existing.jsonl"]
    assert (tmp_path / "existing.jsonl").read_text() == "kept\n"
    with pytest.raises(ConfigError, match="is a directory"):
        check_writable_file("--log-jsonl", str(tmp_path))


def test_partial_checkpoints_are_cleaned_and_a_failed_save_keeps_the_last_good_one(tmp_path, monkeypatch):
    import torch

    from ultrascale.config import ConfigError, RunConfig, TrainConfig, validate
    from ultrascale.distributed.context import build_context
    from ultrascale.train import checkpoint
    from ultrascale.train.trainer import Trainer

    ck = tmp_path / "ck"
    # What a run killed in the middle of a save leaves: its DIR.tmp with parts.
    (tmp_path / "ck.tmp").mkdir()
    (tmp_path / "ck.tmp" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    cfg = validate(RunConfig(train=TrainConfig(steps=2, seq_len=16, micro_batch=1, save=str(ck), progress=False,
                                               measure_activations=False)), 1)
    trainer = Trainer(cfg, build_context(cfg.parallel, 0, 1))
    assert not (tmp_path / "ck.tmp").exists()  # a run that will save starts by removing it

    trainer.fit()
    good = checkpoint.read_record(str(ck))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    # DCP reports a rank's failure as a CheckpointException carrying the cause: the save says it in one line.
    with pytest.raises(ConfigError, match=f"--save {ck}: cannot write {ck}.tmp: No space left on device; "
                                          f"{ck} still holds step 2"):
        trainer.save(str(ck))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no ck.tmp
    assert checkpoint.read_record(str(ck)) == good

    # A save stopped between its two renames: DIR gone, DIR.old the last good one.
    os.replace(ck, tmp_path / "ck.old")
    (tmp_path / "ck.tmp").mkdir()
    checkpoint.clean_partial(str(ck))
    assert sorted(os.listdir(tmp_path)) == ["ck"] and checkpoint.read_record(str(ck)) == good


def test_secondary_errors_are_told_apart_from_causes():
    from ultrascale.distributed.failures import classify

    assert classify("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms "
                    "for recv operation to complete") == "timeout"
    assert classify("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                    "[127.0.0.1]:15790") == "peer-lost"
    assert classify("Read error [127.0.0.1]:4242: Connection reset by peer") == "peer-lost"
    assert classify("torch.OutOfMemoryError: CUDA out of memory") == "error"


def test_the_timeout_must_be_positive(capsys):
    from ultrascale.cli import main

    assert main(["train", "--model", "tiny", "--timeout", "0"]) == 2
    assert capsys.readouterr().err.strip() == "ultrascale: error: --timeout must be a positive number of seconds, got 0"


@pytest.mark.parametrize("merged", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_a_reader_that_stops_reading_ends_the_run_as_one_process_does(tmp_path, merged):
    """`ultrascale train --nproc 2 ... | head -2`: the logging rank's next line meets a closed pipe.
    One process ends there, status 0, silent; so does the launcher, with every rank stopped and its
    run folder gone (it used to name rank 0 as a lost peer, status 1, and keep the folder)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "ultrascale", "train", *LONG_RUN, "--log-every", "1", "--nproc", "2",
                          "--dp", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT if merged else subprocess.PIPE, env=env)
    try:
        _, short = read_until(p.stdout, lambda lines: any(x.startswith(b"step") for x in lines), 240)
        assert short is None, f"no step line: {short}"
        workers = ranks(psutil.Process(p.pid).children())
        p.stdout.close()  # the reader has what it wanted
        status = p.wait(timeout=120)
        err = b"" if merged else p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert status == 0 and err == b"", err.decode(errors="replace")
    assert glob.glob(f"{tmp_path}/ultrascale-run-*") == []
    deadline = time.monotonic() + 5
    while any(_alive(w) for w in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers.values())
