"""Checkpoints that know when they are damaged, and what a crash or a full disk during a save leaves.

Everything here runs `ultrascale` as a user does, in real processes. A checkpoint is
damaged the ways a disk or a copy damages one (a file truncated, lost, a byte changed,
meta.json garbled or gone): `train --resume` and `export` refuse it in one line naming
the file, before any worker starts or any output exists. Where no checksum shows the
damage (format 2, or meta.json rewritten to match), the read itself meets it, in the
workers: still one line, exit 2, and no output. A save is interrupted where it
hurts most, exactly (ULTRASCALE_SAVE_FAULT pauses the save at a named point,
train/checkpoint.py): the launcher or one rank is killed there, and the next
`train --resume` continues from the last complete save with the losses of a run never
interrupted. A full disk in the middle of a save is one line, and the previous
checkpoint stays whole.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil  # a dev dependency: the workers are found as the launcher's children, named after their rank
import pytest

from ultrascale.cli import main
from ultrascale.testing.cli import jsonl_losses, ranks as worker_ranks, read_until, ultrascale
from ultrascale.testing.compare import FP32, worst
from ultrascale.train import integrity
from ultrascale.train.checkpoint import FAULT_ENV, read_full_state
from ultrascale.train.record import verified

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc: Linux")

TINY = ["--model", "tiny", "--seq-len", "16", "--no-progress", "--peak", "1"]  # --peak: no start-up measurement
SAVES = ["--steps", "6", "--save-every", "2"]  # saves at steps 2 and 4, and at the end


def one_line(r):
    return one_error(r.stderr)


def one_error(stderr, after=()):
    """stderr is one error line (after the given lines, if any), no traceback."""
    lines = stderr.strip().splitlines()
    return (len(lines) == len(after) + 1 and lines[:-1] == list(after)
            and lines[-1].startswith("ultrascale: error: ") and "Traceback" not in stderr)


# -- damage ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of 2 ranks at step 2; under ZeRO-1 each rank writes half the masters and moments."""
    ck = str(tmp_path_factory.mktemp("saved") / "ck")
    r = ultrascale("train", *TINY, "--micro-batch", "2", "--nproc", "2", "--zero", "1", "--steps", "2", "--save", ck)
    assert r.returncode == 0, r.stderr
    return ck


def copy(saved, tmp_path):
    ck = str(tmp_path / "ck")
    shutil.copytree(saved, ck)
    return ck


def flip_a_middle_byte(ck):
    with open(os.path.join(ck, "__1_0.distcp"), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def flip_the_first_bytes(ck):
    """The start of the first tensor's record (torch.save's zip header), which DCP reads: damage
    that fails the read itself, not only the checksum (a byte inside a tensor's values loads)."""
    with open(os.path.join(ck, "__1_0.distcp"), "r+b") as f:
        head = f.read(4)
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in head))


def truncate_a_shard(ck):
    os.truncate(os.path.join(ck, "__1_0.distcp"), 100)


def rewrite_meta(ck, edit):
    with open(os.path.join(ck, "meta.json")) as f:
        meta = json.load(f)
    edit(meta)
    with open(os.path.join(ck, "meta.json"), "w") as f:
        json.dump(meta, f)


def as_format_2(ck):
    """What the previous version wrote: the same tensors, no file list (nothing to check them against)."""
    rewrite_meta(ck, lambda meta: (meta.pop("files"), meta.update(format=2)))


def forge_checksums(ck):
    """meta.json rewritten to list the files as they are now: every size and checksum matches."""
    rewrite_meta(ck, lambda meta: meta.update(files=integrity.describe(ck, sorted(meta["files"]))))


DAMAGE = {  # name: (what is done to the copy, what the line says)
    "truncated": (truncate_a_shard, "/__1_0.distcp has 100 bytes, meta.json says"),
    "deleted": (lambda ck: os.remove(os.path.join(ck, "__1_0.distcp")), "/__1_0.distcp is missing"),
    "meta.json not JSON": (lambda ck: open(os.path.join(ck, "meta.json"), "w").write("nonsense"),
                           "/meta.json is not valid JSON"),
    "meta.json missing": (lambda ck: os.remove(os.path.join(ck, "meta.json")), "no meta.json"),
    "a byte flipped": (flip_a_middle_byte, "/__1_0.distcp is damaged: its crc32 is"),
}
# The same damage where no checksum shows it: only DCP's read meets it, in every worker (those of
# `train --resume`'s launcher have started by then) and in export.
UNSEEN = {  # name: what hides the damage from the checks before the load
    "format 2": as_format_2,
    "checksums forged": forge_checksums,
}
READ_DAMAGE = {  # name: (what is done to the copy, what the line says)
    "truncated": (truncate_a_shard, "its tensor files cannot be read ("),
    "first bytes flipped": (flip_the_first_bytes, "its tensor files cannot be read ("),
    "index truncated": (lambda ck: os.truncate(os.path.join(ck, ".metadata"), 100),
                        "/.metadata, the index of its tensors, cannot be read ("),
}
DAMAGED = "): the checkpoint is damaged; copy the checkpoint again from where it was written, or use an earlier one"
DAMAGE.update({f"{damage}, {unseen}": (lambda ck, harm=harm, hide=hide: (harm(ck), hide(ck)), says)
               for damage, (harm, says) in READ_DAMAGE.items() for unseen, hide in UNSEEN.items()})


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_one_line_naming_the_file(saved, tmp_path, monkeypatch, capsys, damage):
    ck = copy(saved, tmp_path)
    harm, says = DAMAGE[damage]
    harm(ck)
    before = sorted(os.listdir(ck))
    # The launcher makes its rank-log directory in TMPDIR when it starts the workers: none may appear.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    unseen = damage.rpartition(", ")[2] if ", " in damage else ""  # met by DCP's read alone
    # A format-2 checkpoint is announced as unverified before it loads: that line, then the error.
    warned = {what: [f"ultrascale: warning: {what} {ck} is a checkpoint of format 2, which lists no checksums: it "
                     f"is loaded unverified; a save from it (train --resume {ck} --save DIR) writes format 3, "
                     f"which is verified"] if unseen == "format 2" else [] for what in ("--resume", "checkpoint")}
    r = ultrascale("train", "--resume", ck, "--steps", "4", "--save", str(tmp_path / "next"), "--no-progress")
    assert r.returncode == 2 and one_error(r.stderr, warned["--resume"]) and says in r.stderr, r.stderr
    assert f"ultrascale: error: --resume {ck}: " in r.stderr and (DAMAGED in r.stderr or not unseen), r.stderr
    assert r.stdout == ""
    assert os.listdir(tmp_path / "tmp") == [] and not (tmp_path / "next").exists()
    assert [n for n in os.listdir(tmp_path) if n.startswith("next")] == []  # no partial save either
    # export in this process (its checks are the same code; no process of its own to start).
    capsys.readouterr()
    assert main(["export", "--hf", str(tmp_path / "out"), ck]) == 2
    err = capsys.readouterr().err
    assert one_error(err, warned["checkpoint"]) and says in err, err
    assert f"ultrascale: error: checkpoint {ck}: " in err and (DAMAGED in err or not unseen), err
    assert not (tmp_path / "out").exists()
    assert sorted(os.listdir(ck)) == before  # a reader changes nothing


@pytest.mark.parametrize("damage", READ_DAMAGE)
def test_damage_met_while_loading_in_one_process_is_one_line(saved, tmp_path, damage):
    # The test above resumes in the checkpoint's layout (2 ranks under the launcher); here the
    # one process that reads without a process group.
    ck = copy(saved, tmp_path)
    harm, says = READ_DAMAGE[damage]
    harm(ck)
    forge_checksums(ck)
    r = ultrascale("train", "--resume", ck, "--steps", "4", "--nproc", "1", "--peak", "1", "--no-progress",
                   "--save", str(tmp_path / "next"))
    assert r.returncode == 2 and one_line(r) and says in r.stderr and DAMAGED in r.stderr, r.stderr
    assert r.stderr.startswith(f"ultrascale: error: --resume {ck}: ") and r.stdout == ""
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_meta_json_lists_every_file_with_its_size_and_checksum(saved):
    with open(os.path.join(saved, "meta.json")) as f:
        meta = json.load(f)
    assert meta["format"] == 3
    assert sorted(meta["files"]) == sorted(n for n in os.listdir(saved) if n != "meta.json") \
        == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(entry["bytes"] > 1000 for entry in meta["files"].values())  # both ranks wrote chunks
    for name, entry in meta["files"].items():
        assert entry == {"bytes": os.path.getsize(os.path.join(saved, name)),
                         "crc32": integrity.checksum(os.path.join(saved, name))}


def test_a_format_2_checkpoint_is_loaded_with_a_warning_and_saved_as_format_3(saved, tmp_path):
    ck, again = copy(saved, tmp_path), str(tmp_path / "again")
    as_format_2(ck)
    r = ultrascale("train", "--resume", ck, "--steps", "3", "--nproc", "1", "--save", again, "--no-progress")
    assert r.returncode == 0, r.stderr
    warning = [line for line in r.stderr.splitlines() if line.startswith("ultrascale: warning:")]
    assert len(warning) == 1 and f"{ck} is a checkpoint of format 2" in warning[0], r.stderr
    assert "loaded unverified" in warning[0] and "writes format 3" in warning[0]
    assert verified(again).step == 3
    rewrite_meta(ck, lambda meta: meta.update(format=1))
    with pytest.raises(ValueError, match="format 1, this version reads formats 2 and 3: use the version"):
        verified(ck)


# -- crashes -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The losses of steps 3 to 6 of the run below never interrupted (one process, the same global batch)."""
    log = str(tmp_path_factory.mktemp("straight") / "log.jsonl")
    r = ultrascale("train", *TINY, *SAVES[:2], "--micro-batch", "4", "--log-jsonl", log)
    assert r.returncode == 0, r.stderr
    return jsonl_losses(log)[2:]


class PausedSave:
    """`train --nproc 2 --save-every 2` whose save of step 4 pauses at `point` (every rank that
    reaches it prints a line): a kill then lands exactly there."""

    def __init__(self, ck, point, tmp_path):
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path),
                   **{FAULT_ENV: f"point={point},step=4,action=pause"})
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "ultrascale", "train", *TINY, *SAVES, "--micro-batch", "2", "--nproc", "2",
             "--save", ck], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.workers = {}

    def wait_until_paused(self, ranks, limit=240):
        lines, short = read_until(self.launcher.stdout,
                                  lambda lines: sum(x.startswith(b"save paused at") for x in lines) >= ranks, limit)
        if short == "timeout":
            pytest.fail(f"the save did not pause within {limit} s")
        if short == "ended":
            pytest.fail(f"the run ended before its save paused:\n{self.launcher.stderr.read().decode()}")
        self.workers = worker_ranks(psutil.Process(self.launcher.pid).children())

    def kill(self, who):
        (self.launcher if who == "launcher" else self.workers[int(who[-1])]).send_signal(signal.SIGKILL)
        self.launcher.wait(timeout=60)
        gone, alive = psutil.wait_procs(self.workers.values(), timeout=30)  # they die with the launcher
        assert not alive

    def kill_everything(self):
        for p in [*self.workers.values(), self.launcher]:
            try:
                p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        self.launcher.wait()


# (who is killed, where the save is): what is on disk right after, besides ck.
CRASHES = {
    ("launcher", "write"): ["ck", "ck.tmp"],  # the partial save stays until the next run that saves
    ("rank 1", "write"): ["ck"],  # the launcher outlives the rank, and removes the partial save
    ("launcher", "swap"): ["ck.old", "ck.tmp"],  # between the two renames: no ck, the previous one is ck.old
    ("rank 0", "swap"): ["ck"],  # the launcher put ck.old back
}


@pytest.mark.parametrize("who,point", CRASHES, ids=[f"{w} killed during the {p}".replace(" ", "-") for w, p in CRASHES])
def test_a_kill_during_a_save_keeps_the_last_complete_one_and_resume_continues(straight, tmp_path, who, point):
    ck, log = str(tmp_path / "ck"), str(tmp_path / "resumed.jsonl")
    run = PausedSave(ck, point, tmp_path)
    try:
        run.wait_until_paused(ranks=2 if point == "write" else 1)
        run.kill(who)
    finally:
        run.kill_everything()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ck")) == CRASHES[(who, point)]
    # The run again, with --resume: it continues from the save of step 2 (in one process: the
    # checkpoint is layout-free, and one process starts faster than a launcher and two workers).
    r = ultrascale("train", "--resume", ck, *SAVES, "--save", ck, "--log-jsonl", log, "--no-progress",
                   "--nproc", "1")
    assert r.returncode == 0, r.stderr
    losses = jsonl_losses(log)
    assert len(losses) == 4, losses
    rel = worst(abs(a - b) / b for a, b in zip(losses, straight))
    assert rel <= FP32.loss_rtol, (losses, straight)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ck")) == ["ck"]
    assert verified(ck).step == 6


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ck = str(tmp_path / "ck")
    monkeypatch.setenv(FAULT_ENV, "point=write,step=4,action=enospc,rank=1")  # rank 1's disk fills up at step 4
    r = ultrascale("train", *TINY, *SAVES, "--micro-batch", "2", "--nproc", "2", "--save", ck)
    assert r.returncode == 2 and one_line(r), r.stderr
    assert (f"--save {ck}: cannot write {ck}.tmp/__1_0.distcp: No space left on device; {ck} still holds "
            f"step 2: free space there (or pass another --save) and continue with --resume {ck}") in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert verified(ck).step == 2
    record, state = read_full_state(ck)
    assert record.config.train.steps == 6 and len(state) > 0
