"""What the generator is doing, on stderr, so stdout stays clean for pipes.

On a terminal a running step shows a spinner and its elapsed seconds, and
statuses (what was read, a retry wait) are shown as they happen. In a log (not
a terminal) only results are written ("call 1: 3.2 s, 1,234 prompt + 2,345
completion tokens", each attempt's verdict), so a command that fails before
any result leaves just its one-line error.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from contextlib import contextmanager

_CLEAR = "\r\x1b[2K"


class Progress:
    def __init__(self, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._lock = threading.Lock()  # the spinner and the lines must not interleave
        self._spinning = False

    def say(self, text: str) -> None:
        """A result worth keeping in a log."""
        if self.enabled:
            self._line(text)

    def info(self, text: str) -> None:
        """A status for someone watching (a retry wait, what was read); not written to logs."""
        if self.tty:
            self._line(text)

    def _line(self, text: str) -> None:
        with self._lock:
            if self._spinning:
                self.stream.write(_CLEAR)  # the spinner redraws itself on the next line
            print(text, file=self.stream, flush=True)

    @contextmanager
    def step(self, text: str):
        if not self.tty:
            yield
            return
        done = threading.Event()
        start = time.perf_counter()

        def spin():
            for frame in itertools.cycle("|/-\\"):
                with self._lock:
                    self.stream.write(f"{_CLEAR}{frame} {text} {time.perf_counter() - start:5.1f} s")
                    self.stream.flush()
                if done.wait(0.2):
                    break
            with self._lock:
                self.stream.write(_CLEAR)
                self.stream.flush()

        self._spinning = True
        t = threading.Thread(target=spin, daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()
            self._spinning = False
