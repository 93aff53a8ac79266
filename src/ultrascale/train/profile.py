"""Profiling a window of training steps: `ultrascale train ... --profile DIR --profile-steps A:B`.

Each rank writes a torch.profiler trace of steps A to B (1-based, inclusive; the
default 2:3 skips the first step's warm-up: allocations, lazy initialisation) as
a gzipped Chrome trace, DIR/rank{r}.trace.json.gz, readable by Perfetto,
chrome://tracing, Holistic Trace Analysis or `ultrascale trace DIR`. On CUDA it
also writes a memory snapshot of those steps, DIR/rank{r}.memory.pickle (drag it
onto https://pytorch.org/memory_viz).

What the steps record is named in ultrascale/spans.py, below every layer that
records; this window switches the recording on and off.
"""

from __future__ import annotations

import os

import torch

from ultrascale import spans
from ultrascale.config import parse_steps  # noqa: F401 - the window's A:B, as the config reads it


# -- the window -----------------------------------------------------------------
def trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.trace.json.gz")


def memory_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.memory.pickle")


class _Off:
    def step_done(self) -> None:
        pass

    def close(self) -> None:
        pass


def profile_window(train_cfg, rank: int, device: torch.device, next_step: int):
    """The profiler of this run: a ProfileWindow under --profile, else an object that does nothing."""
    if not train_cfg.profile:
        return _Off()
    return ProfileWindow(train_cfg.profile, train_cfg.profile_steps, rank, device, next_step)


class ProfileWindow:
    """Records steps first..last of the run on this rank; `step_done()` after each step, `close()` at the end.

    Steps are counted as the log counts them (a resumed run continues the count).
    """

    def __init__(self, directory: str, steps: str, rank: int, device: torch.device, next_step: int):
        self.directory, self.rank = directory, rank
        self.first, self.last = parse_steps(steps)
        self.step = next_step  # the number of the step about to run
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.prof = None
        if self.last < next_step:
            return  # a resumed run already past the window
        from torch.profiler import ProfilerActivity, profile, schedule

        # Kineto, under torch.profiler, prints its own markers on stderr at every start and stop
        # ("USDT: ... profiler_start"), whatever the level below its highest: it reads the level when
        # the first profiler of the process starts, so this silences it (a level set by the user stays).
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.start = max(self.first, next_step)  # the first step recorded
        pre = self.start - next_step  # steps to run before it
        warmup = min(pre, 1)  # the profiler's own warm-up step, as its schedule recommends
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities,
                            schedule=schedule(wait=pre - warmup, warmup=warmup, active=self.last - self.start + 1,
                                              repeat=1),
                            on_trace_ready=self._write)
        os.makedirs(directory, exist_ok=True)
        self.prof.start()
        spans.recording(True)
        self._memory_at_step()

    def step_done(self) -> None:
        if self.prof is None:
            return
        self.step += 1
        self.prof.step()
        self._memory_at_step()
        if self.step > self.last:
            self.close()  # nothing more to record: stop paying for the profiler

    def close(self) -> None:
        spans.recording(False)
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()  # writes the trace if the run ended inside the window

    def _write(self, prof) -> None:
        prof.export_chrome_trace(trace_path(self.directory, self.rank))  # gzipped: the name ends in .gz

    def _memory_at_step(self) -> None:
        """CUDA: record the allocator's history over the window, and dump it at its end."""
        if not self.cuda:
            return
        if self.step == self.start:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        elif self.step == self.last + 1:
            torch.cuda.memory._dump_snapshot(memory_path(self.directory, self.rank))
            torch.cuda.memory._record_memory_history(enabled=None)
