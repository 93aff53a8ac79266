"""A write the filesystem refuses for want of room, at every place a command writes: one line, exit 2,
nothing half-written left behind, and what was already whole kept.

The disk is made "full" by the process's own file-size limit (RLIMIT_FSIZE, `ulimit -f`, with SIGXFSZ
ignored so that the write fails with EFBIG as a full disk fails it with ENOSPC): a real refusal by the
kernel at the write that crosses it, with no root, no mount and no patched code."""

import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from ultrascale.testing.cli import ultrascale

import sysconfig

JSON = os.path.join(sysconfig.get_paths()["stdlib"], "json")  # 48 KB of text: a 97 KB shard, past the limit


def limited(limit: int, *args, cwd):
    """`python -m ultrascale ARGS` in a new process that may write no file past `limit` bytes."""
    def at_start():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "ultrascale", *args], preexec_fn=at_start, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import shutil

    where = tmp_path_factory.mktemp("corpus")
    for name in os.listdir(JSON):
        if name.endswith(".py"):
            shutil.copyfile(os.path.join(JSON, name), where / name)
    return where


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    where = tmp_path_factory.mktemp("ck")
    r = ultrascale("train", "--steps", "2", "--seq-len", "16", "--micro-batch", "2", "--no-progress", "--peak", "1",
                   "--save", str(where / "ck"))
    assert r.returncode == 0, r.stderr
    return where / "ck"


TRAIN = ["train", "--seq-len", "16", "--micro-batch", "2", "--no-progress", "--peak", "1"]
# (case, file-size limit, arguments, the words of the line): every place a command writes a user's file
SITES = [
    ("data-prepare", 40_000, ["data", "prepare", "{src}", "out"], ["out: no room to write", "run again finishes"]),
    ("export-hf", 100_000, ["export", "{ck}", "--hf", "hf"], ["hf: no room to write", "nothing was written"]),
    ("log-jsonl", 2_000, TRAIN + ["--steps", "30", "--log-jsonl", "log.jsonl"], ["log.jsonl: no room", "are kept"]),
    ("save", 100_000, TRAIN + ["--steps", "2", "--save", "saved"], ["--save saved: cannot write", "nothing was saved"]),
]


def left_over(root) -> list[str]:
    """What a refused write may not leave: a temporary file or folder, a half shard."""
    return [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files
            if n.endswith((".tmp", ".old")) or ".tmp" in n]


@pytest.mark.parametrize("case,limit,args,words", SITES, ids=[s[0] for s in SITES])
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(case, limit, args, words, corpus, checkpoint,
                                                                 tmp_path):
    r = limited(limit, *[a.format(ck=checkpoint, src=corpus) for a in args], cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not left_over(tmp_path), left_over(tmp_path)
    if case == "log-jsonl":  # the rows before the refused one, each whole
        rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
        assert rows and [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    if case == "data-prepare":  # what is whole stays, and the same command with room finishes it
        r = ultrascale("data", "prepare", str(corpus), str(tmp_path / "out"))
        assert r.returncode == 0, r.stderr
    if case in ("export-hf", "save"):
        assert not any((tmp_path / name).exists() for name in ("hf", "saved"))
