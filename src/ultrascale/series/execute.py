"""Run a notebook top to bottom in a fresh kernel, as a learner would, and prove its exercises.

One kernel per notebook (kernels are slow to start):

1. every code cell in order; the first error stops the run and is reported
   with its cell index. Cells tagged `needs-gpu` are skipped, and reported as
   skipped, unless the kernel sees CUDA.
2. then, for each exercise, in the same kernel: the starter cell again and a
   direct call of `check_exercise_<k>()`, which must raise (a check that passes
   on the starter checks nothing); then the hidden solution and the same call,
   which must return. This is how a generated exercise is known to be sound.
   The starter used is the one the notebook was built with (kept in the cell's
   metadata), so a notebook a learner has completed still proves its checks.

`grade_notebook` is the learner's side: run the notebook as it is, keep going past
a failing cell, then call each exercise's check on what the learner wrote.

The notebook's own cells keep what they printed (`RunReport.notebook`): outputs.py
writes them into the committed course. Charts come out as the inline backend's PNGs
at a modest resolution (FIGURE_DPI), and no timing is recorded in the cells.

The kernel is this interpreter (`sys.executable`), whatever kernelspec named
"python3" a user's Jupyter setup has: the notebook runs against the torch and
ultrascale this command was installed with.
"""

from __future__ import annotations

import copy
import io
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Protocol

from ultrascale.errors import ConfigError
from ultrascale.series.build import GPU_TAG, check_function
from ultrascale.series.outline import outline

FIGURE_DPI = 80  # a chart of matplotlib's default size is 512 x 384 pixels, tens of kB in the .ipynb


@dataclass
class CellError:
    cell: int
    ename: str
    evalue: str

    def line(self) -> str:
        return f"cell {self.cell} failed: {self.ename}: {self.evalue}".rstrip(": ")


@dataclass
class ExerciseResult:
    number: int
    on_starter: str | None  # what the check raised on the starter; None: it passed (wrong)
    on_solution: str | None  # what it raised on the solution; None: it passed (right)
    starter_cell: int | None = None

    @property
    def ok(self) -> bool:
        return self.on_starter is not None and self.on_solution is None

    def line(self) -> str:
        if self.ok:
            return (f"exercise {self.number}: the check fails on the starter ({self.on_starter}) and passes "
                    f"with the reference solution")
        parts = []
        if self.on_starter is None:
            parts.append("the check passes on the starter code: it checks nothing, or the starter holds the answer")
        if self.on_solution is not None:
            parts.append(f"the reference solution fails its own check: {self.on_solution}")
        return f"exercise {self.number}: " + "; ".join(parts)


@dataclass
class RunReport:
    seconds: float = 0.0
    executed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # needs-gpu cells not run
    failure: CellError | None = None
    exercises: list[ExerciseResult] = field(default_factory=list)
    outputs: dict = field(default_factory=dict)  # cell index -> text the cell printed
    errors: list[CellError] = field(default_factory=list)  # every failing cell, when asked to keep going
    grades: list = field(default_factory=list)  # Grade per exercise, when grading
    notebook: object = None  # the notebook's own cells with their outputs, once run

    @property
    def ok(self) -> bool:
        return self.failure is None and all(e.ok for e in self.exercises)

    def problems(self) -> list[str]:
        """One line per thing that is wrong, in the words a fix needs."""
        out = [self.failure.line()] if self.failure else []
        return out + [e.line() for e in self.exercises if not e.ok]


def _this_python_manager():
    """A kernel of this Python. Asynchronous, as nbclient's own: a cell's timeout is a timer on the
    event loop that waits for the kernel's reply, and a synchronous manager's calls block that loop,
    so an endless cell would never time out."""
    from ipykernel.kernelspec import RESOURCES, get_kernel_dict
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(resource_dir=RESOURCES, **get_kernel_dict())

    return AsyncKernelManager(kernel_spec_manager=ThisPython(), kernel_name="python3")


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append("".join(out.get("text", "")))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


@dataclass
class Grade:
    number: int
    title: str
    status: str  # "passed" | "not done yet" | "wrong" | "error"
    message: str = ""

    def line(self) -> str:
        what = f"exercise {self.number} ({self.title}): {self.status}"
        return f"{what}: {self.message}" if self.message else what


def grade_notebook(nb, timeout: float = 120, cwd: str | None = None) -> tuple[RunReport, list[Grade]]:
    """Run a learner's notebook as it is and grade each exercise by its check."""
    report = run_notebook(nb, timeout=timeout, cwd=cwd, exercises=False, keep_going=True, grade=True)
    return report, report.grades


def _grade(number: int, title: str, raised: str | None) -> Grade:
    if raised is None:
        return Grade(number, title, "passed")
    if raised.startswith("NotImplementedError"):
        return Grade(number, title, "not done yet", "fill in the TODO in the exercise's code cell")
    if raised.startswith("AssertionError"):
        return Grade(number, title, "wrong", raised[len("AssertionError"):].lstrip(": ") or "the check failed")
    if raised.startswith("Timeout"):
        return Grade(number, title, "error", f"the check {raised.partition(': ')[2]}: an answer that never returns "
                                             f"(an endless loop, a receive no rank sends to), or raise --timeout")
    if raised.startswith("NameError") and "check_exercise_" in raised:
        return Grade(number, title, "error", "the check cell did not run (a cell above it failed)")
    return Grade(number, title, "error", f"your code raised {raised}")


class CellTimeout(Exception):
    """A cell ran past its limit while the run was not grading (a run stops there)."""


class CellRunner(Protocol):
    """Where a notebook's cells execute: a Jupyter kernel (`notebook run` / `grade`, the generator) or an
    IPython shell in this process (the test suite, on its pooled ranks). Either keeps the cell's outputs."""

    def execute(self, cell, index: int) -> tuple[str, str] | None:
        """Run `cell`; (ename, evalue) if it raised, None if not. A cell past the limit: CellTimeout, or
        ("Timeout", ...) when grading (the next cell still runs)."""


def _play(work, report: RunReport, runner: CellRunner, timeout: float, gpu: bool | None, exercises: bool,
          keep_going: bool, grade: bool) -> None:
    """The cells in order, then each exercise's proof (starter fails its check, solution passes) or grade."""
    import nbformat

    o = outline(work)
    n_cells = len(work.cells)

    def run(source: str):
        """Execute extra code after the notebook's cells; return the error text, or None."""
        work.cells.append(nbformat.v4.new_code_cell(source))
        raised = runner.execute(work.cells[-1], len(work.cells) - 1)
        if raised is None:
            return None
        ename, evalue = raised
        return f"{ename}: {evalue}" if str(evalue).strip() else ename

    for i in range(n_cells):
        cell = work.cells[i]
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        if GPU_TAG in cell.metadata.get("tags", []):
            if gpu is None:
                probe = "import importlib.util as _u; print(bool(_u.find_spec('torch')) and " \
                        "__import__('torch').cuda.is_available()); del _u"
                run(probe)
                gpu = _text(work.cells[-1]).strip() == "True"
            if not gpu:
                report.skipped.append(i)
                continue
        try:
            raised = runner.execute(cell, i)
        except CellTimeout:
            report.failure = CellError(i, "Timeout", f"the cell ran longer than {timeout:g} s")
            break
        finally:
            report.executed.append(i)
            report.outputs[i] = _text(cell)
        if raised is not None:
            report.errors.append(CellError(i, raised[0], _first_line(raised[1])))
            report.failure = report.failure or report.errors[-1]
            if not keep_going:
                break
    try:
        if report.failure is None and exercises:
            for e in o.exercises:
                if e.starter is None or e.check is None or not e.solution:
                    continue
                fn = check_function(e.number)
                run(e.starter_source if e.starter_source is not None else work.cells[e.starter].source)
                on_starter = run(f"{fn}()")
                sol = run(e.solution)
                on_solution = f"the solution cell raised {sol}" if sol else run(f"{fn}()")
                report.exercises.append(ExerciseResult(e.number, _first_line(on_starter) if on_starter else None,
                                                       _first_line(on_solution) if on_solution else None,
                                                       e.starter))
        if grade:
            for e in o.exercises:
                if e.check is None:
                    continue
                raised = run(f"{check_function(e.number)}()")
                report.grades.append(_grade(e.number, e.title, _first_line(raised) if raised else None))
    except CellTimeout:
        report.failure = CellError(n_cells - 1, "Timeout", f"an exercise check ran longer than {timeout:g} s")


class _Kernel:
    """Cells executed by nbclient in a kernel of this Python."""

    def __init__(self, client, ready_within: float):
        self.client = client
        # A kernel's first execution still finishes its start (the shell's first-run setup, the output
        # channels' first messages): on a busy machine that took over 3 s before a cell's own `x = 1` could
        # run. One empty cell, under the start's limit, so a cell's limit counts its own time only.
        import nbformat

        from nbclient.exceptions import CellTimeoutError

        # nbclient writes a cell back at its index: the empty one goes after the last and is taken away.
        cells = client.nb.cells
        cells.append(nbformat.v4.new_code_cell("pass"))
        limit, client.timeout = client.timeout, ready_within
        try:
            client.execute_cell(cells[-1], len(cells) - 1, store_history=False)
        except CellTimeoutError:
            raise RuntimeError(f"the kernel did not run an empty cell within {ready_within:g} s") from None
        finally:
            client.timeout = limit
            cells.pop()

    def execute(self, cell, index):
        from nbclient.exceptions import CellExecutionError, CellTimeoutError

        try:
            self.client.execute_cell(cell, index)
        except CellExecutionError as e:
            return e.ename, e.evalue
        except CellTimeoutError:
            raise CellTimeout from None
        return None


def run_notebook(nb, timeout: float = 120, cwd: str | None = None, gpu: bool | None = None,
                 exercises: bool = True, keep_going: bool = False, grade: bool = False) -> RunReport:
    """Execute `nb` (not modified) in a fresh kernel and report; `gpu=None` asks the kernel whether CUDA is
    there."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    work = nbformat.from_dict(copy.deepcopy(dict(nb)))
    n_cells = len(work.cells)
    report = RunReport()
    start = time.perf_counter()
    stderr = tempfile.TemporaryFile()
    settings = tempfile.TemporaryDirectory(prefix="ultrascale-kernel-")
    try:
        # Consecutive prints are one output, as a reader sees them; no per-cell timestamps.
        # A kernel's start imports this Python's packages: on a busy machine that alone can take a minute,
        # which is no failure of the notebook; it gets the cells' own limit, and at least nbclient's 60 s.
        client = NotebookClient(work, km=_this_python_manager(), timeout=timeout, shutdown_kernel="immediate",
                                startup_timeout=max(60.0, timeout),
                                # After a reply, a cell's outputs are read until the kernel says it is idle,
                                # for at most iopub_timeout (nbclient's default, 4 s). An interrupted cell's
                                # idle can come later than that on a busy machine, and its reader, still
                                # running, then takes the next cell's outputs for its own and drops them:
                                # wait for the idle as long as for the cell itself.
                                iopub_timeout=max(60.0, timeout),
                                # Grading goes on past an answer that never returns: the kernel is
                                # interrupted at the limit, that exercise graded as such, the next checked.
                                interrupt_on_timeout=grade,
                                error_on_timeout={"ename": "Timeout", "evalue": f"ran longer than {timeout:g} s "
                                                                                f"(--timeout)"} if grade else None,
                                resources={"metadata": {"path": cwd or os.getcwd()}}, record_timing=False,
                                coalesce_streams=True)
    except Exception as e:  # no ipykernel, broken jupyter setup
        raise ConfigError(f"cannot start a Python kernel ({e}); pip install 'ultrascale[series]'") from e
    try:
        with client.setup_kernel(cleanup_kc=True, stderr=stderr, env=_kernel_env(settings.name)):
            _play(work, report, _Kernel(client, ready_within=max(60.0, timeout)), timeout, gpu, exercises,
                  keep_going, grade)
    except DeadKernelError as e:
        stderr.seek(0)
        tail = stderr.read().decode(errors="replace").strip().splitlines()[-1:] or [str(e)]
        cell = report.executed[-1] if report.executed else 0
        report.failure = CellError(cell, "DeadKernel", f"the kernel died: {tail[0]}")
    except RuntimeError as e:
        if "kernel" not in str(e).lower():
            raise
        report.failure = CellError(0, "Kernel", f"the kernel did not start ({_first_line(str(e))}); waited up "
                                                f"to {max(60.0, timeout):g} s: run again, or raise --timeout")
    finally:
        stderr.close()
        settings.cleanup()
    report.seconds = time.perf_counter() - start
    report.notebook = nbformat.from_dict({**work, "cells": work.cells[:n_cells]})
    return report


class _CellOutputs(io.TextIOBase):
    """One cell's outputs in the order a kernel would send them: consecutive writes to a stream are one
    stream output (nbclient's coalesce_streams), a display is a display_data output."""

    def __init__(self, cell, name: str):
        self.cell, self.name = cell, name

    def writable(self):
        return True

    def write(self, text: str) -> int:
        outs = self.cell.outputs
        if outs and outs[-1].get("output_type") == "stream" and outs[-1].get("name") == self.name:
            outs[-1]["text"] += text
        else:
            outs.append({"output_type": "stream", "name": self.name, "text": text})
        return len(text)


class _Shell:
    """Cells executed by an IPython shell in this process: the cell semantics of ipykernel's shell (magics,
    the last expression displayed, each cell's source kept for `inspect.getsource`, which series/ranks.py
    sends to the ranks) without a kernel to start, so the ranks a cell asks for are this process's pool
    (testing/harness.py), shared by every notebook and test that runs here. A cell's limit is SIGALRM, which
    only the main thread receives; elsewhere a cell runs to its end (on_ranks keeps its own deadline)."""

    def __init__(self, timeout: float, grade: bool):
        from IPython.core.displaypub import DisplayPublisher
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        class ThisProcess(InteractiveShell):
            def init_sys_modules(self):
                pass  # the process's own __main__ stays: multiprocessing reads it to start the ranks

            def fresh_namespace(self):
                """An empty `__main__` module for the next notebook, as a fresh kernel's. The last one is
                left to the collector, not cleared: torch.compile keeps entries in a cell's globals that
                it deletes itself when its code objects go."""
                import types

                self.user_module, self.user_ns = self.prepare_user_module(types.ModuleType("__main__"), None)
                self.ns_table.update(user_global=self.user_module.__dict__, user_local=self.user_ns)
                self.init_user_ns()
                self.execution_count = 1

        if not InteractiveShell.initialized():
            config = Config()
            config.HistoryManager.enabled = False  # no sqlite file in the user's ~/.ipython
            config.InteractiveShell.cache_size = 0  # no "Out[n]:" prompt: a kernel sends the value alone
            config.InteractiveShell.colors = "nocolor"
            ThisProcess.instance(config=config)
        self.shell = InteractiveShell.instance()
        self.shell.fresh_namespace()  # each notebook starts from an empty namespace, as in a fresh kernel
        self.shell.showtraceback = lambda *a, **k: None  # an error is reported as (ename, evalue), not printed
        self.shell.showsyntaxerror = lambda *a, **k: None
        self.timeout, self.grade = timeout, grade
        self._cell = None
        shell_self = self

        class Publisher(DisplayPublisher):
            def publish(self, data, metadata=None, *args, **kwargs):
                shell_self._cell.outputs.append({"output_type": "display_data", "data": data,
                                                 "metadata": metadata or {}})

        self.shell.display_pub = Publisher(shell=self.shell)

    def execute(self, cell, index):
        import signal
        import threading

        cell.outputs, self._cell = [], cell
        alarm = threading.current_thread() is threading.main_thread() and self.timeout > 0

        def expired(*_):
            raise TimeoutError(f"ran longer than {self.timeout:g} s (--timeout)")

        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _CellOutputs(cell, "stdout"), _CellOutputs(cell, "stderr")
        if alarm:
            # An alarm already set (a test's own limit, pytest-timeout's) is put back with what is left of it.
            previous = signal.signal(signal.SIGALRM, expired)
            before, _ = signal.setitimer(signal.ITIMER_REAL, self.timeout)
            started = time.monotonic()
        try:
            result = self.shell.run_cell(cell.source, store_history=True)
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                if before:
                    signal.setitimer(signal.ITIMER_REAL, max(before - (time.monotonic() - started), 1e-3))
            sys.stdout, sys.stderr = saved
        error = result.error_before_exec or result.error_in_exec
        if error is None:
            return None
        if isinstance(error, TimeoutError) and "(--timeout)" in str(error):
            if not self.grade:
                raise CellTimeout
            return "Timeout", str(error)
        return type(error).__name__, str(error)


def run_in_process(nb, timeout: float = 300, cwd: str | None = None, gpu: bool | None = None,
                   exercises: bool = True, keep_going: bool = False, grade: bool = False) -> RunReport:
    """`run_notebook` in an IPython shell of this process instead of a kernel (_Shell): what the test suite
    runs the course's notebooks with. The process's state a notebook may change (the working directory,
    torch's random generators and threads, its flash-attention switch, the environment, matplotlib's
    figures) is put back after it."""
    import nbformat
    import torch

    work = nbformat.from_dict(copy.deepcopy(dict(nb)))
    n_cells = len(work.cells)
    report = RunReport()
    start = time.perf_counter()
    here, environ, threads = os.getcwd(), dict(os.environ), torch.get_num_threads()
    flash = torch.backends.cuda.flash_sdp_enabled()
    os.environ["MPLBACKEND"] = "Agg"
    # As a fresh kernel starts: torch's flash attention on (a bf16 run of this process may have switched
    # it off process-wide, parallel/precision.choose_attention_kernel), so a cell's own SDPA is a kernel's.
    torch.backends.cuda.enable_flash_sdp(True)
    try:
        with torch.random.fork_rng(devices=[]):
            if cwd:
                os.chdir(cwd)
            _play(work, report, _Shell(timeout, grade), timeout, gpu, exercises, keep_going, grade)
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        torch.backends.cuda.enable_flash_sdp(flash)
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
    report.seconds = time.perf_counter() - start
    report.notebook = nbformat.from_dict({**work, "cells": work.cells[:n_cells]})
    return report


def _kernel_env(directory: str) -> dict:
    """The kernel's environment: this one, with matplotlib's figures at FIGURE_DPI."""
    rc = os.path.join(directory, "matplotlibrc")
    with open(rc, "w") as f:
        f.write(f"figure.dpi: {FIGURE_DPI}\n")
    return dict(os.environ, MATPLOTLIBRC=rc)


def _first_line(text: str) -> str:
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", text or "").strip()
    return text.splitlines()[0] if text else text
