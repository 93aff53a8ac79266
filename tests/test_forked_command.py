"""The suite runs `ultrascale` forked from a warm server (testing/cli.py `forked`), not from a new
interpreter: in everything a test looks at, the two must be the same process."""

import subprocess
import sys

from ultrascale.testing.cli import forked, jsonl_losses, ultrascale

# What a process can see of how it was started, and every way it can end.
SCRIPT = """
import atexit, os, sys, tempfile
atexit.register(lambda: print("exit handler ran"))
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()))
print("X", os.environ.get("X"), "HOME", os.environ.get("HOME"))
print("tmp", tempfile.gettempdir() == os.environ.get("TMPDIR"), "stdin", repr(sys.stdin.read()))
print("main", __name__, "path", os.path.basename(sys.path[0]))
how = sys.argv[1]
if how == "code":
    sys.exit(3)
if how == "message":
    sys.exit("a message instead of a status")
if how == "raise":
    raise ValueError("uncaught")
print("to stderr", file=sys.stderr)
"""


def test_a_forked_process_sees_and_ends_as_a_new_interpreter(tmp_path):
    script = tmp_path / "bin" / "show.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    (tmp_path / "here").mkdir()
    (tmp_path / "tmp").mkdir()
    env = {"PATH": "/usr/bin:/bin", "X": "42", "TMPDIR": str(tmp_path / "tmp")}
    for how in ("ok", "code", "message", "raise"):
        new = subprocess.run([sys.executable, str(script), how], cwd=tmp_path / "here", env=env, capture_output=True,
                             text=True, stdin=subprocess.DEVNULL)
        got = forked([str(script), how], cwd=tmp_path / "here", env=env)
        assert (got.returncode, got.stdout) == (new.returncode, new.stdout), (how, got, new)
        # A traceback names the script's frames the same way; the runner's own frames come first.
        assert got.stderr.splitlines()[-1:] == new.stderr.splitlines()[-1:], (how, got.stderr, new.stderr)
    assert new.returncode == 1 and "exit handler ran" in new.stdout and "tmp True" in new.stdout


def test_the_command_line_forked_prints_and_exits_as_from_a_shell(tmp_path):
    args = ["train", "--model", "tiny", "--seq-len", "16", "--steps", "2", "--no-progress", "--log-jsonl", "run.jsonl"]
    runs = {}
    for fresh in (True, False):
        where = tmp_path / ("fresh" if fresh else "forked")
        where.mkdir()
        r = ultrascale(*args, cwd=where, fresh=fresh)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        done = r.stdout.splitlines()[-1]
        runs[fresh] = (done.rsplit(", ", 1)[0], jsonl_losses(where / "run.jsonl"))  # less the tokens/s
    assert runs[True][0] == runs[False][0] and runs[True][0].startswith("done: 2 steps, loss")
    # The same process on the same machine: one rounding, so equal up to the last bit.
    assert runs[True][1] == runs[False][1]
    for fresh in (True, False):
        r = ultrascale("train", "--steps", "ten", fresh=fresh)
        assert r.returncode == 2 and r.stdout == "", r
        assert r.stderr == ("ultrascale: error: argument --steps: invalid int value: 'ten' "
                            "(see `ultrascale train --help`)\n")
