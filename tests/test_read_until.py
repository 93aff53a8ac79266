"""Waiting for what a child process prints (`ultrascale.testing.cli.read_until`): the tests that
stop a run at a named point wait for its lines this way."""

import selectors
import subprocess
import sys
import time

from ultrascale.testing.cli import read_until


def _two_lines_in_one_write():
    # Both lines reach the pipe in one write, as two ranks' lines do when they print together.
    return subprocess.Popen([sys.executable, "-c", "import os, time; os.write(1, b'paused 0\\npaused 1\\n'); "
                             "time.sleep(30)"], stdout=subprocess.PIPE)


def test_read_until_sees_two_lines_that_arrive_in_one_write():
    child = _two_lines_in_one_write()
    try:
        lines, short = read_until(child.stdout, lambda lines: len(lines) >= 2, limit=60)
        assert short is None and lines == [b"paused 0", b"paused 1"]
    finally:
        child.kill()
        child.wait()
    # Why it reads the descriptor: with select() on the pipe and the buffered readline(), the
    # first readline takes both lines off the pipe, so a select() waiting for the second never
    # wakes (two ranks' "save paused" lines once hung a test this way).
    child = _two_lines_in_one_write()
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(child.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=60)  # the child's one write is in the pipe
            assert child.stdout.readline() == b"paused 0\n"
            assert sel.select(timeout=1) == []  # nothing left in the pipe to signal...
            assert child.stdout.readline() == b"paused 1\n"  # ...the second line was in the buffer all along
    finally:
        child.kill()
        child.wait()
    # A pipe that closes is "ended", with the lines before it.
    done = subprocess.Popen([sys.executable, "-c", "print('only')"], stdout=subprocess.PIPE)
    assert read_until(done.stdout, lambda lines: len(lines) >= 2, limit=60) == ([b"only"], "ended")
    done.wait()


def test_read_until_runs_out_while_the_child_keeps_writing_other_lines():
    chatty = subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n    print('busy', flush=True)\n"
                               "    time.sleep(0.01)"], stdout=subprocess.PIPE)
    try:
        start = time.monotonic()
        lines, short = read_until(chatty.stdout, lambda lines: b"done" in lines, limit=1)
        assert short == "timeout" and lines and time.monotonic() - start < 30
    finally:
        chatty.kill()
        chatty.wait()
