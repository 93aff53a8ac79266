"""The two example notebooks the series started from, rebuilt from their text rendering, and what they violate.

tests/data/seeds/ holds the user's Part 4 and Part 5 notebooks exactly as they were rendered
as text ("In [None]:" before each code cell). They show the format the series wants, and
the mistakes it must not repeat; the lint has to find those mistakes, and Part 4 has to
fail to run on a CPU.
"""

import os
import re

import nbformat
import pytest

from ultrascale.series.execute import run_notebook
from ultrascale.series.lint import lint_notebook

SEEDS = os.path.join(os.path.dirname(__file__), "data", "seeds")


def from_rendering(text):
    """A notebook from its text rendering: "In [None]:" opens a code cell that runs up to the next
    '##' heading; markdown is one cell per '#'/'##' heading (outside ``` fences)."""
    v4 = nbformat.v4
    cells, md, code, in_code = [], [], [], False

    def flush():
        if code:
            cells.append(v4.new_code_cell("\n".join(code).strip("\n")))
            code.clear()
        parts, part, fenced = [], [], False
        for line in md:
            if line.lstrip().startswith("```"):
                fenced = not fenced
            if not fenced and re.match(r"^#{1,2} ", line) and any(x.strip() for x in part):
                parts.append(part)
                part = []
            part.append(line)
        parts.append(part)
        cells.extend(v4.new_markdown_cell("\n".join(p).strip("\n")) for p in parts if "".join(p).strip())
        md.clear()

    for line in text.splitlines():
        if line.strip() == "In [None]:":
            flush()
            in_code = True
            continue
        if in_code and re.match(r"^#{2,} ", line):
            flush()
            in_code = False
        (code if in_code else md).append(line)
    flush()
    return v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                 "language": "python"}})


def seed(name):
    with open(os.path.join(SEEDS, name), encoding="utf-8") as f:
        return from_rendering(f.read())


def cell_with(nb, text, kind=None):
    """Index of the one cell containing `text`."""
    found = [i for i, c in enumerate(nb.cells) if text in c.source and (kind is None or c.cell_type == kind)]
    assert len(found) == 1, (text, found)
    return found[0]


@pytest.fixture(scope="module")
def part4():
    return seed("part4_as_rendered.txt")


@pytest.fixture(scope="module")
def part5():
    return seed("part5_as_rendered.txt")


def test_the_rendering_is_rebuilt_cell_by_cell(part4, part5):
    assert [c.cell_type for c in part4.cells].count("code") == 2
    assert [c.cell_type for c in part5.cells].count("code") == 4
    assert part4.cells[0].source.startswith("# Ultra-Scale Playbook: Part 4")
    # The fenced pseudo-code stays inside its markdown cell.
    assert "```python\n# pseudo-bucket logic" in part4.cells[cell_with(part4, "## 3 Optimization 2")].source


def test_part4_seed_violations(part4):
    found = {(v.rule, v.cell) for v in lint_notebook(part4, "4_data_parallelism.ipynb")}
    cuda = cell_with(part4, ".cuda()", "code")
    hook = cell_with(part4, "def attach_sync_hook", "code")
    ex1, ex2 = cell_with(part4, "Exercise 1:"), cell_with(part4, "Exercise 2:")
    quiz = cell_with(part4, "Quiz")
    expected = {
        ("accelerator", cuda),  # model.cuda() on a laptop
        ("process-group", cuda), ("process-group", hook),  # DDP and all_reduce, no init_process_group
        # The exercises are instructions only: nothing to write in, no solution, no check.
        ("exercise-starter", ex1), ("exercise-solution", ex1), ("exercise-check", ex1),
        ("exercise-starter", ex2), ("exercise-solution", ex2), ("exercise-check", ex2),
        ("quiz-answer", quiz),  # the answers are ticked under their questions, not given at the end
    }
    assert found == expected
    quiz_lines = [v for v in lint_notebook(part4, "4_data_parallelism.ipynb") if v.rule == "quiz-answer"]
    assert len(quiz_lines) == 4 and all("answer is under the question" in v.message for v in quiz_lines)


def test_part5_seed_violations(part5):
    violations = lint_notebook(part5, "5_1d_parallelism.ipynb")
    found = {(v.rule, v.cell) for v in violations}
    ex1, ex2 = cell_with(part5, "### Exercise 1"), cell_with(part5, "### Exercise 2")
    code1, code2 = cell_with(part5, "target_gbs_tokens = 4_000_000", "code"), cell_with(part5, "def estimate_memory")
    answers = cell_with(part5, "Answers:")
    expected = {
        # "# Your solution here" followed by the whole solution, printed.
        ("solution-visible", code1), ("exercise-solution", code1), ("exercise-check", ex1),
        ("solution-visible", code2), ("exercise-solution", code2), ("exercise-check", ex2),
        ("quiz-answer", answers),  # an "Answers:" list after the questions, no why, then a Summary
    }
    assert found == expected
    quiz = [v.message for v in violations if v.rule == "quiz-answer"]
    assert sum("has no why" in m for m in quiz) == 4  # one per question
    # The key follows the questions, but "## Summary" follows the key: the answers are not at the end.
    summary = cell_with(part5, "## Summary")
    assert [m for m in quiz if "not at the end" in m] == [
        f"the answers are not at the end of the notebook: cell {summary} comes after them; move the "
        f"'## Answers' section to the end, after the last question"]


def test_part4_seed_does_not_run_on_a_cpu(part4, tmp_path):
    report = run_notebook(part4, timeout=120, cwd=str(tmp_path))
    assert report.failure is not None
    assert report.failure.cell == cell_with(part4, ".cuda()", "code")
    assert report.failure.ename in ("AssertionError", "RuntimeError")
