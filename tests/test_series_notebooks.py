"""The course notebooks themselves: in step with their sources, conforming, and runnable on a CPU.

Each notebook is executed once (kernels are slow to start), with a few common wrong
answers to its exercises appended: each check must say what is wrong with them, in
words that point at the fix.
"""

import glob
import importlib.util
import json
import os
import textwrap

import nbformat
import pytest

from ultrascale.series.build import GPU_TAG, build_notebook, notebook_text
from ultrascale.series.episode import Episode
from ultrascale.series.execute import run_notebook
from ultrascale.series.lint import lint_file
from ultrascale.series.outline import read_episode
from printed import Close, printed_in

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "notebook_cases")


def _stem(path):
    return os.path.basename(path)[:-len(".ipynb")]


NOTEBOOK_FILES = sorted(glob.glob(os.path.join(NOTEBOOKS, "[0-9]*_*.ipynb")), key=lambda p: int(_stem(p).split("_")[0]))


def cases(path) -> dict:
    """tests/notebook_cases/N_topic.py: MISTAKES (exercise, label, what the check must say, code)
    and PRINTED (lines the notebook must print from its own runs)."""
    case = os.path.join(CASES, _stem(path) + ".py")
    if not os.path.exists(case):
        return {"MISTAKES": [], "PRINTED": []}
    spec = importlib.util.spec_from_file_location(f"case_{_stem(path)}", case)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {"MISTAKES": list(getattr(module, "MISTAKES", [])), "PRINTED": list(getattr(module, "PRINTED", []))}


def _probe(k, label):
    return (f"\ntry:\n    check_exercise_{k}()\nexcept AssertionError as problem:\n"
            f"    print({label!r}, 'SAYS', problem)\nelse:\n    print({label!r}, 'PASSED')\n")


class _Runs(dict):
    """Each notebook run once, on first use, with its mistakes appended when their test is selected:
    path -> (notebook, report, {label: what the check said}). Lazy, so `-k 1_scaling` runs one
    notebook only."""

    def __init__(self, tmp, with_mistakes):
        super().__init__()
        self.tmp, self.with_mistakes = tmp, with_mistakes

    def __missing__(self, path):
        mistakes = cases(path)["MISTAKES"] if self.with_mistakes else []
        nb = nbformat.read(path, as_version=4)
        extended = nbformat.from_dict(json.loads(json.dumps(nb)))
        first = len(extended.cells)
        for k, label, _, source in mistakes:
            extended.cells.append(nbformat.v4.new_code_cell(textwrap.dedent(source).strip() + "\n" + _probe(k, label)))
        report = run_notebook(extended, timeout=300, cwd=str(self.tmp.mktemp("run")))
        said = {label: report.outputs.get(first + i, "") for i, (_, label, _, _) in enumerate(mistakes)}
        self[path] = (nb, report, said)
        return self[path]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    # The runs again under another kernel set (`-m rounding`) leave the wrong answers out: what a
    # check says of a mistake is not a figure a CPU rounds.
    selected = {item.originalname for item in request.session.items}
    return _Runs(tmp_path_factory, with_mistakes="test_checks_say_what_is_wrong" in selected)


def _measures(path) -> bool:
    """Whether the notebook prints a figure its own runs measured (a Close line of its PRINTED)."""
    return any(isinstance(line, Close) for line in cases(path)["PRINTED"])


# The notebooks that print what a run measured go again under another kernel set (`-m rounding`,
# `make test`): a pin closer than that run's rounding fails on the developer's machine first. The
# others print words and the planner's arithmetic, which no kernel set changes; their exercises are
# checked against runs on the same machine, in the same kernels.
BY_KERNELS = [pytest.param(p, id=_stem(p), marks=[pytest.mark.rounding] if _measures(p) else [])
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
            text = f.read()
        assert text == notebook_text(build_notebook(ep)), f"rebuild {ep.filename}: python notebooks/src/build.py"
        assert read_episode(json.loads(text), ep.filename) == ep  # the notebook holds the whole episode


def test_the_notebooks_conform(cli):
    for path in NOTEBOOK_FILES:
        assert lint_file(path) == [], path
    code, out = cli("notebook", "check", *NOTEBOOK_FILES)
    assert code == 0, out
    assert out.splitlines() == [f"{p}: ok" for p in NOTEBOOK_FILES]


@pytest.mark.parametrize("path", BY_KERNELS)
def test_runs_top_to_bottom_on_cpu_and_the_exercises_are_sound(runs, path):
    nb, report, _ = runs[path]
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
    _, report, _ = runs[path]
    printed = "".join(report.outputs.values())
    for line in cases(path)["PRINTED"]:
        assert printed_in(line, printed), line.explain(printed) if isinstance(line, Close) else line


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


@pytest.mark.parametrize("path, label, says", [(p, m[1], m[2]) for p in NOTEBOOK_FILES for m in cases(p)["MISTAKES"]],
                         ids=lambda v: _stem(v) if str(v).endswith(".ipynb") else str(v)[:30])
def test_checks_say_what_is_wrong(runs, path, label, says):
    said = runs[path][2][label]
    assert f"{label} SAYS" in said, said
    assert says in said, said


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
