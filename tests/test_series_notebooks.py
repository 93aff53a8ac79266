"""The course notebooks themselves: in step with their sources, committed with the outputs of a run
of those sources, conforming, and runnable on a CPU.

Each notebook is executed once (kernels are slow to start); what it prints is compared with
the lines of tests/notebook_cases/N_topic.py.
"""

import glob
import importlib.util
import json
import os

import nbformat
import pytest

from ultrascale.series.build import GPU_TAG, build_notebook, notebook_text
from ultrascale.series.episode import Episode
from ultrascale.series.execute import run_in_process, run_notebook
from ultrascale.series.lint import lint_file
from ultrascale.series.outline import read_episode
from ultrascale.series.outputs import outputs_problem, without_outputs
from printed import Close, printed_in

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")

REGENERATE = "python notebooks/src/build.py"  # builds, runs and writes a notebook with its outputs
CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "notebook_cases")


def _stem(path):
    return os.path.basename(path)[:-len(".ipynb")]


NOTEBOOK_FILES = sorted(glob.glob(os.path.join(NOTEBOOKS, "[0-9]*_*.ipynb")), key=lambda p: int(_stem(p).split("_")[0]))


def cases(path) -> dict:
    """tests/notebook_cases/N_topic.py: PRINTED, the lines the notebook must print from its own runs, and
    KERNELS, whether its cells take another path under another kernel set."""
    case = os.path.join(CASES, _stem(path) + ".py")
    if not os.path.exists(case):
        return {"PRINTED": [], "KERNELS": False}
    spec = importlib.util.spec_from_file_location(f"case_{_stem(path)}", case)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {"PRINTED": list(getattr(module, "PRINTED", [])), "KERNELS": bool(getattr(module, "KERNELS", False))}


class _Runs(dict):
    """Each notebook run once, on first use: path -> (notebook, report). Lazy, so `-k 1_scaling` runs
    one notebook only. Run in an IPython shell of this process (execute.run_in_process), so a notebook's
    ranks are this test process's pool, started once for all the notebooks and tests it runs. The kernel
    path is the commands' and is run below on whole notebooks too: `notebook grade` of a solved Part 1,
    `notebook run`, the GPU guard under plain nbclient, the endless cell; the committed outputs are a
    kernel's (notebooks/src/build.py), and the test after next compares them with this run's."""

    def __init__(self, tmp):
        super().__init__()
        self.tmp = tmp

    def __missing__(self, path):
        nb = nbformat.read(path, as_version=4)
        self[path] = (nb, run_in_process(without_outputs(nb), timeout=300, cwd=str(self.tmp.mktemp("run"))))
        return self[path]


_RUNS: list = []  # one _Runs per worker process: a module fixture is built again whenever pytest-xdist
#                   hands this worker another unit first, and each build would run the notebooks again


@pytest.fixture
def runs(tmp_path_factory):
    if not _RUNS:
        _RUNS.append(_Runs(tmp_path_factory))
    return _RUNS[0]


def _measures(path) -> bool:
    """Whether the notebook prints a figure its own runs measured (a Close line of its PRINTED)."""
    return any(isinstance(line, Close) for line in cases(path)["PRINTED"])


# The notebooks that print what a run measured go again under another kernel set (`-m rounding`,
# `make test`): a pin closer than that run's rounding fails on the developer's machine first. The
# others print words and the planner's arithmetic, which no kernel set changes; their exercises are
# checked against runs on the same machine, in the same kernels. The paced pipeline runs (Parts 11 and
# 12) pin their bubbles on the engine's schedule clock, which no load stretches; their seconds are printed,
# not pinned (a timing is a benchmark's, docs/benchmarks.md).
# KERNELS: a notebook whose cells take another path under another kernel set (bf16 attention: torch's
# CPU flash kernel, or the math kernel where flash cannot run, parallel/precision.py) says which it took,
# and runs again under the lowest set too.
BY_KERNELS = [pytest.param(p, id=_stem(p), marks=([pytest.mark.rounding] if _measures(p) or cases(p)["KERNELS"]
                                                  else [])
                           # a notebook's run and the tests that read it: one unit, on either worker
                           + [pytest.mark.xdist_group(f"notebook-{_stem(p)}"), pytest.mark.long])
              for p in NOTEBOOK_FILES]


def load_source(path):
    spec = importlib.util.spec_from_file_location("episode_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EPISODE


def test_the_notebooks_are_built_from_their_sources():
    sources = sorted(glob.glob(os.path.join(NOTEBOOKS, "src", "[0-9]*_*.py")))
    assert [os.path.basename(s)[:-3] for s in sources] == [_stem(p) for p in sorted(NOTEBOOK_FILES)]
    for src in sources:
        ep = load_source(src)
        assert isinstance(ep, Episode)
        with open(os.path.join(NOTEBOOKS, ep.filename), encoding="utf-8") as f:
            nb = json.load(f)
        # The cells as built; outputs (and the record of their run) are the next test's.
        assert notebook_text(without_outputs(nb)) == notebook_text(build_notebook(ep)), \
            f"rebuild {ep.filename}: {REGENERATE} {ep.number}"
        assert read_episode(nb, ep.filename) == ep  # the notebook holds the whole episode


def test_the_notebooks_carry_the_outputs_of_a_run_of_their_sources():
    # GitHub and Colab show the committed outputs before anything runs: they must be those of a run
    # of today's source, untouched, top to bottom. One line per notebook that is not.
    stale = []
    for src in sorted(glob.glob(os.path.join(NOTEBOOKS, "src", "[0-9]*_*.py")),
                      key=lambda s: int(os.path.basename(s).split("_")[0])):
        ep = load_source(src)
        with open(os.path.join(NOTEBOOKS, ep.filename), encoding="utf-8") as f:
            problem = outputs_problem(json.load(f), build_notebook(ep))
        if problem:
            stale.append(f"notebooks/{ep.filename}: {problem}; run {REGENERATE} {ep.number}")
    assert not stale, "\n".join(stale)


def test_the_notebooks_conform(cli):
    for path in NOTEBOOK_FILES:
        assert lint_file(path) == [], path
    code, out = cli("notebook", "check", *NOTEBOOK_FILES)
    assert code == 0, out
    assert out.splitlines() == [f"{p}: ok" for p in NOTEBOOK_FILES]


@pytest.mark.parametrize("path", BY_KERNELS)
def test_runs_top_to_bottom_on_cpu_and_the_exercises_are_sound(runs, path):
    nb, report = runs[path]
    print(f"{_stem(path)}: {len(report.executed)} code cells in {report.seconds:.1f} s")
    assert report.failure is None, report.failure
    # Run All in any Jupyter: no cell relies on a tag only our runner reads; GPU cells guard themselves.
    assert report.skipped == [] and not any(GPU_TAG in c.metadata.get("tags", []) for c in nb.cells)
    for c in nb.cells:
        if c.cell_type == "code" and (".cuda()" in c.source or '"cuda"' in c.source):
            assert "torch.cuda.is_available()" in c.source, c.source
    assert nb.cells[0].source.count("colab.research.google.com/github/") == 1
    setup = next(c for c in nb.cells if c.cell_type == "code")
    assert "pip" in setup.source and 'find_spec("ultrascale")' in setup.source
    assert [e.number for e in report.exercises] == [1, 2]
    for e in report.exercises:
        assert e.ok, e.line()
        assert e.on_starter.startswith("NotImplementedError")


@pytest.mark.parametrize("path", BY_KERNELS)
def test_the_notebook_prints_what_its_runs_measured(runs, path):
    _, report = runs[path]
    printed = "".join(report.outputs.values())
    for line in cases(path)["PRINTED"]:
        assert printed_in(line, printed), line.explain(printed) if isinstance(line, Close) else line


@pytest.mark.parametrize("path", NOTEBOOK_FILES, ids=_stem)
def test_the_committed_outputs_a_kernel_printed_hold_the_same_lines(path):
    # The suite runs the notebooks in a shell of its own process; what a learner sees was printed by a
    # Jupyter kernel (notebooks/src/build.py), on another machine perhaps. Both print every line of the
    # case, within the tolerance of its figures: the shell is the kernel's cell semantics, not another program.
    from ultrascale.series.execute import _text

    printed = "".join(_text(c) for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    for line in cases(path)["PRINTED"]:
        assert printed_in(line, printed, on_another_machine=True), \
            line.explain(printed) if isinstance(line, Close) else line


def test_a_figure_from_a_run_is_compared_within_its_tolerance_and_the_words_exactly():
    line = Close("one process : losses 5.581182 5.465283, activations 678,420 B", rel=1e-5)
    assert line.is_in("...\none process : losses 5.581183 5.465283, activations 678,420 B\n")  # another CPU
    assert not line.is_in("one process : losses 5.582182 5.465283, activations 678,420 B")  # a real change
    assert not line.is_in("one process : losses 5.581182 5.465283, activations 678,421 B")  # a byte count: exact
    assert not line.is_in("one process : losses 5.581182 5.465283, activations 678,420 KB")  # the words: exact
    assert "off by more than" in line.explain("one process : losses 5.6 5.465283, activations 678,420 B")
    # The print rounds: 5.58115 reads 5.5811 here and 5.5812 there; one unit of the last digit is allowed.
    assert Close("losses 5.5812, 5.2692", rel=1e-5).is_in("losses 5.5811, 5.2692")
    assert not Close("losses 5.5812, 5.2692", rel=1e-5).is_in("losses 5.5810, 5.2692")
    with pytest.raises(ValueError, match="no decimal figure"):
        Close("rank 0 of 2", rel=1e-5)


def test_grade_passes_the_solved_notebook_and_says_not_done_yet_on_the_starter(tmp_path, cli):
    # A quick notebook (Part 1 runs in about 4 s; the smallest file, Part 12, in 15), graded end to end
    # through the command line.
    path = next(p for p in NOTEBOOK_FILES if os.path.basename(p) == "1_scaling_basics.ipynb")
    solved = tmp_path / "solved.ipynb"
    code, out = cli("notebook", "build", "--solved", path, "-o", str(solved))
    assert code == 0 and f"wrote {solved} (2 exercises solved)" in out, out
    assert oct(os.stat(solved).st_mode & 0o777) == oct(0o666 & ~_umask())
    code, out = cli("notebook", "grade", str(solved))
    assert code == 0, out
    assert out.count(": passed") == 2 and f"{solved}: 2/2 exercises passed" in out, out
    code, out = cli("notebook", "grade", path)
    assert code == 1, out
    assert out.count(": not done yet: fill in the TODO") == 2 and f"{path}: 0/2 exercises passed" in out, out


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.fixture
def cli(capsys):
    """`ultrascale ARGS` in this process: (exit status, stdout)."""
    from ultrascale.cli import main

    def run(*args):
        capsys.readouterr()
        code = main(list(args))
        return code, capsys.readouterr().out

    return run


def test_a_gpu_cell_guards_itself_so_run_all_goes_through_on_a_cpu(tmp_path, cli):
    with open(os.path.join(os.path.dirname(__file__), "data", "tiny_episode.json")) as f:
        d = json.load(f)
    d["sections"][0]["cells"].append({"kind": "code", "needs_gpu": True,
                                      "source": "x = torch.ones(1).cuda()\nprint('on the GPU:', x)"})
    path = tmp_path / "6_averages.ipynb"
    ep = Episode.from_dict(d)
    nb = build_notebook(ep)
    assert read_episode(nb, path.name) == ep  # the guard reads back as the plain cell
    path.write_text(notebook_text(nb))
    gpu_cell = next(i for i, c in enumerate(nb.cells) if "torch.ones(1).cuda()" in c.source)
    assert not nb.cells[gpu_cell].metadata.get("tags")  # not a tag only this runner would honour
    # Plain nbclient, as Jupyter's Run All: no skipping, the cell itself says why it did nothing.
    from nbclient import NotebookClient

    NotebookClient(nbformat.read(str(path), as_version=4), timeout=120, kernel_name="python3").execute()
    code, out = cli("notebook", "run", str(path))
    assert code == 0, out
    assert f"{path}: ok," in out and "skipped" not in out


def test_a_notebook_is_written_with_its_outputs_and_says_when_they_are_stale(tmp_path, cli):
    # The gate's run is kept: printed lines and a chart, PNG at a modest size, and a record of what ran.
    with open(os.path.join(os.path.dirname(__file__), "data", "tiny_episode.json")) as f:
        d = json.load(f)
    d["sections"][0]["cells"].append({"kind": "code", "source": (
        "import matplotlib.pyplot as plt\n\nplt.plot(values, marker='o')\nplt.title('one value per rank')\nplt.show()")})
    (tmp_path / "answer.json").write_text(json.dumps(d))
    code, out = cli("notebook", "import", str(tmp_path / "answer.json"), "--out", str(tmp_path), "--no-progress")
    assert code == 0, out
    with open(tmp_path / "6_averages.ipynb", encoding="utf-8") as f:
        text = f.read()
    nb, ep = json.loads(text), Episode.from_dict(d)
    built = build_notebook(ep)
    assert outputs_problem(nb, built) is None
    assert read_episode(nb) == ep  # outputs are not content
    code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code_cells] == list(range(1, len(code_cells) + 1))
    printed = "".join("".join(o.get("text", "")) for c in code_cells for o in c["outputs"])
    assert "sum 12.0 average 3.0" in printed and "Exercise 1: not done yet" in printed
    [png] = [o["data"]["image/png"] for c in code_cells for o in c["outputs"] if "image/png" in o.get("data", {})]
    assert 2_000 < len(png) < 60_000  # base64 of a 512 x 384 chart
    # Nothing a kernel session adds: no timings, no kernel version.
    assert nb["metadata"]["language_info"] == {"name": "python"}
    assert not any("execution" in c["metadata"] for c in code_cells)
    # Stale, edited, never run: each says so.
    d["sections"][0]["cells"][0]["source"] += " Changed."
    assert "stale" in outputs_problem(nb, build_notebook(Episode.from_dict(d)))
    edited = json.loads(text)
    edited["cells"][next(i for i, c in enumerate(edited["cells"]) if c["outputs" if c["cell_type"] == "code"
                         else "source"] and "sum 12.0" in json.dumps(c.get("outputs")))]["outputs"][0]["text"] = "4.0"
    assert outputs_problem(edited, built) == "its outputs were edited after the run"
    edited = json.loads(text)
    code_cells = [c for c in edited["cells"] if c["cell_type"] == "code"]
    code_cells[1]["source"] = "print('something else')"
    assert outputs_problem(edited, built) == "its cells were edited after the run"
    assert outputs_problem(json.loads(notebook_text(built)), built) == "its outputs are missing (it was never run)"


def test_run_command_reports_the_failing_cell(tmp_path, cli):
    with open(os.path.join(os.path.dirname(__file__), "data", "tiny_episode.json")) as f:
        d = json.load(f)
    d["sections"][0]["cells"].append({"kind": "code", "source": "values[0] / 0"})
    path = tmp_path / "6_averages.ipynb"
    nb = build_notebook(Episode.from_dict(d))
    path.write_text(notebook_text(nb))
    code, out = cli("notebook", "run", str(path))
    assert code == 1
    bad = next(i for i, c in enumerate(nb.cells) if c.source == "values[0] / 0")
    assert f"{path}: cell {bad} failed: ZeroDivisionError: float division by zero" in out
    assert f"{path}: FAILED," in out


@pytest.mark.parametrize("runner", [run_notebook, run_in_process], ids=["kernel", "this process"])
def test_an_endless_cell_times_out_and_grading_goes_on_past_it(runner):
    # The kernel's manager is asynchronous: a cell's limit is a timer on the loop that waits for the kernel's
    # reply (a synchronous manager blocked that loop: an endless cell hung `run` and `grade` whatever
    # --timeout said). Graded, the kernel is interrupted at the limit and the next cell runs. In this
    # process the limit is an alarm, with the same report.
    from ultrascale.series.execute import _grade

    cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("while True:\n    pass"),
             nbformat.v4.new_code_cell("print('after', x)")]
    nb = nbformat.v4.new_notebook(cells=cells)
    report = runner(nb, timeout=3)
    assert report.failure is not None
    assert report.failure.line() == "cell 1 failed: Timeout: the cell ran longer than 3 s"
    assert report.executed == [0, 1], report.executed  # a run stops at the cell that failed
    graded = runner(nb, timeout=3, exercises=False, keep_going=True, grade=True)
    assert [e.line() for e in graded.errors] == ["cell 1 failed: Timeout: ran longer than 3 s (--timeout)"]
    assert "after 1" in graded.outputs[2], graded.outputs  # the kernel was interrupted, not lost
    g = _grade(1, "Accumulate", "Timeout: ran longer than 3 s (--timeout)")
    assert (g.status, g.message.split(":")[0]) == ("error", "the check ran longer than 3 s (--timeout)"), g



def test_a_kernel_runs_an_empty_cell_first_and_the_notebook_does_not_see_it():
    # The cell that lets a fresh kernel finish its start (execute._Kernel) must leave no trace: the first cell
    # is still In [1], no cell is added or replaced (nbclient writes a cell back at the index it is given: an
    # empty cell given index 0 once replaced the notebook's first cell and its `x = 1` never ran).
    cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("print('after', x)")]
    report = run_notebook(nbformat.v4.new_notebook(cells=cells), timeout=30, exercises=False)
    assert report.failure is None and report.outputs[1] == "after 1\n", (report.failure, report.outputs)
    assert [c.source for c in report.notebook.cells] == ["x = 1", "print('after', x)"]
    assert [c.execution_count for c in report.notebook.cells] == [1, 2]

def test_a_notebook_in_this_process_starts_empty_and_leaves_the_process_as_it_was(tmp_path):
    # Two notebooks in one shell are two kernels: nothing of the first is seen by the second, and what a
    # notebook changes of the process (its directory, torch's generator and threads, the environment) is
    # put back. A cell's error is reported as a kernel reports it, not printed into the outputs.
    import torch

    first = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os, torch\nsecret = 41\ntorch.manual_seed(0)\ntorch.set_num_threads(2)\nos.environ['US_T'] = '1'\n"
        "def f():\n    return secret + 1\nprint(f(), os.getcwd())"), nbformat.v4.new_code_cell("f() / 0")])
    here, threads, state = os.getcwd(), torch.get_num_threads(), torch.random.get_rng_state()
    report = run_in_process(first, cwd=str(tmp_path))
    assert report.outputs[0] == f"42 {tmp_path}\n"
    assert report.failure.line() == "cell 1 failed: ZeroDivisionError: division by zero" and report.outputs[1] == ""
    assert (os.getcwd(), torch.get_num_threads(), "US_T" in os.environ) == (here, threads, False)
    assert torch.equal(torch.random.get_rng_state(), state)
    second = run_in_process(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(secret)")]))
    assert second.failure.line() == "cell 0 failed: NameError: name 'secret' is not defined"
    # torch's flash switch, which a bf16 run of this process may have turned off: on in the notebook, as in
    # a fresh kernel, and as it was after it
    was = torch.backends.cuda.flash_sdp_enabled()
    try:
        torch.backends.cuda.enable_flash_sdp(False)
        seen = run_in_process(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
            "import torch\nprint(torch.backends.cuda.flash_sdp_enabled())")]))
        assert seen.outputs[0] == "True\n" and not torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(was)
    # The last expression is shown as a kernel's execute_result: its value, no "Out[n]:".
    shown = run_in_process(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("6 * 7")]))
    assert shown.outputs[0] == "42\n", shown.outputs
