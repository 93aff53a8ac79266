"""Episode -> nbformat 4 notebook.

Layout, top to bottom: title, overview, references (if any), the sections,
the two exercises (instructions, starter cell, check cell), the quiz (one cell
per question, options only) and, last, the answers: one "## Answers" cell with
each question's letter, the option and why it is right. The series' format
puts the answers at the end, so a learner answers every question before
seeing any answer.

Every cell carries `metadata.ultrascale.role` so outline.py can read the
notebook back exactly; cell ids are derived from the role, so building the
same episode twice gives the same file (clean diffs). The reference solution
of an exercise lives in its starter cell's metadata (`ultrascale.solution`):
notebook front-ends do not show cell metadata, and the cell itself only ever
holds the starter.

Each exercise ends with a collapsed cell of progressive hints and the reference
solution, revealed one click at a time. A cell that needs a GPU is wrapped in
`if torch.cuda.is_available():` so "Run All" goes through on a CPU in any Jupyter;
the title carries an "Open in Colab" badge and the first code cell installs the
project where it is missing (Colab, a fresh environment).

The check cell defines `check_exercise_<k>()` from the episode's check
statements and calls it in a try block that prints what is wrong; it never
raises, so a fresh notebook runs top to bottom. execute.py calls the same
function directly to prove it fails on the starter and passes on the solution.
"""

from __future__ import annotations

import textwrap

import nbformat
from nbformat import v4

from ultrascale.series.episode import Episode

GPU_TAG = "needs-gpu"  # notebooks built before the guard; the runner still skips such cells on CPU
# Where the project is published: the one place its address is written. The Colab badge and the
# install cell are built from it, and every link to the repository in README.md, docs/ and the
# notebooks must agree with it and point to a file of this tree (tests/test_repository_links.py).
REPOSITORY = "ultrascale-playbook/ultrascale"  # owner/name on GitHub
BRANCH = "main"
COLAB_GITHUB = "https://colab.research.google.com/github/"


def repository_url(path: str = "") -> str:
    """https://github.com/OWNER/NAME, or the page of `path` (relative to the repository root) on BRANCH."""
    base = f"https://github.com/{REPOSITORY}"
    return f"{base}/blob/{BRANCH}/{path}" if path else base
GPU_GUARD = "if torch.cuda.is_available():  # this cell needs a GPU; on a CPU it says so and moves on"
GPU_ELSE = ('else:\n    print("Skipped: this cell needs a GPU (on Colab: Runtime > Change runtime type > GPU).")')
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
LETTERS = "ABCDEFGH"
QUIZ_INTRO = "Pick an answer for each question; the answers are at the end of the notebook."
ANSWERS_INTRO = "The quiz's answers: the right option for each question, and why."


def check_function(k: int) -> str:
    return f"check_exercise_{k}"


def check_cell_source(k: int, check: str) -> str:
    body = textwrap.indent(textwrap.dedent(check).strip("\n"), "    ") or "    pass"
    fn = check_function(k)
    return (
        f"# Check your answer: this runs your code and says what is wrong. Run it after the cell above.\n"
        f"def {fn}():\n"
        f"{body}\n"
        f"\n"
        f"\n"
        f"try:\n"
        f"    {fn}()\n"
        f"except NotImplementedError:\n"
        f"    print(\"Exercise {k}: not done yet - fill in the TODO above, run that cell, then this one.\")\n"
        f"except AssertionError as problem:\n"
        f"    print(f\"Exercise {k}: not yet. {{problem}}\")\n"
        f"except Exception as problem:\n"
        f"    print(f\"Exercise {k}: your code raised {{type(problem).__name__}}: {{problem}}\")\n"
        f"else:\n"
        f"    print(\"Exercise {k}: correct!\")\n"
    )


def colab_badge(filename: str) -> str:
    # Colab opens a file of a GitHub repository at the same path under its own host.
    url = repository_url(f"notebooks/{filename}").replace("https://github.com/", COLAB_GITHUB)
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def setup_source() -> str:
    return (
        "# Setup: the project this course runs on. Installed here only where it is missing (Colab, a fresh\n"
        "# environment); a local checkout installed with `pip install -e .` is used as it is.\n"
        "import importlib.util\n"
        "import subprocess\n"
        "import sys\n"
        "\n"
        "if importlib.util.find_spec(\"ultrascale\") is None:\n"
        f"    subprocess.check_call([sys.executable, \"-m\", \"pip\", \"install\", \"-q\",\n"
        f"                           \"ultrascale[series] @ git+{repository_url()}@{BRANCH}\"])\n"
        "import ultrascale\n"
        "\n"
        "print(\"ultrascale\", ultrascale.__version__)\n"
    )


def guard_gpu(source: str) -> str:
    """A GPU-only cell as code that runs anywhere: the body under a CUDA check."""
    return f"import torch\n\n{GPU_GUARD}\n{textwrap.indent(source, '    ')}\n{GPU_ELSE}"


def unguard_gpu(source: str) -> str:
    """The inverse of guard_gpu."""
    head = f"import torch\n\n{GPU_GUARD}\n"
    body = source[len(head):-len(GPU_ELSE)].rstrip("\n")
    return "\n".join(line[4:] if line.startswith("    ") else line for line in body.split("\n"))


def hints_source(k: int, ex) -> str:
    """Progressive hints, then the solution, each behind its own click."""
    parts = [f"**Stuck on Exercise {k}?** Open one hint at a time; the solution is last."]
    for i, h in enumerate(ex.hints, 1):
        parts.append(f"<details>\n<summary>Hint {i}</summary>\n\n{h}\n\n</details>")
    parts.append(f"<details>\n<summary>Reveal the solution</summary>\n\n```python\n{ex.solution}\n```\n\n</details>")
    return "\n\n".join(parts)


def question_source(i: int, q) -> str:
    options = "\n".join(f"- {LETTERS[j]}) {o}" for j, o in enumerate(q.options))
    return f"**Question {i}.** {q.question}\n\n{options}"


def answer_line(i: int, q) -> str:
    """'**Question 1: B)** the option. Why it is right.' (quiz.py reads it back)."""
    letter = LETTERS[q.answer] if 0 <= q.answer < len(q.options) else "?"
    right = q.options[q.answer] if 0 <= q.answer < len(q.options) else ""
    why = f" {q.why}" if q.why else ""
    return f"**Question {i}: {letter})** {right}.{why}"


def answers_source(quiz) -> str:
    lines = "\n\n".join(answer_line(i, q) for i, q in enumerate(quiz, 1))
    return f"## Answers\n\n{ANSWERS_INTRO}\n\n{lines}"


def _md(source: str, cell_id: str, **meta):
    cell = v4.new_markdown_cell(source.strip("\n"), id=cell_id)
    cell.metadata["ultrascale"] = meta
    return cell


def _code(source: str, cell_id: str, tags=(), **meta):
    cell = v4.new_code_cell(source.strip("\n"), id=cell_id)
    cell.metadata["ultrascale"] = meta
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def build_notebook(ep: Episode) -> nbformat.NotebookNode:
    """The notebook for `ep`, valid nbformat 4.5, without outputs."""
    cells = []
    title = f"# {ep.heading}" + (f"\n\n*{ep.subtitle}*" if ep.subtitle else "")
    cells.append(_md(f"{title}\n\n{colab_badge(ep.filename)}", "title", role="title"))
    cells.append(_md("## Overview\n\n" + "\n".join(f"- {b}" for b in ep.overview), "overview", role="overview"))
    if ep.references:
        refs = "\n".join(f"- Part {r.episode}: {r.note}" if r.note else f"- Part {r.episode}"
                         for r in ep.references)
        cells.append(_md(f"**Builds on earlier episodes**\n\n{refs}", "references", role="references",
                         episodes=[r.episode for r in ep.references]))
    cells.append(_code(setup_source(), "setup", role="setup"))
    for i, sec in enumerate(ep.sections, 1):
        head = f"## {sec.heading}"
        body = list(sec.cells)
        if not body or body[0].kind != "markdown":
            cells.append(_md(head, f"s{i}", role="section", section=i, heading=True))
        else:
            first = body.pop(0)
            cells.append(_md(f"{head}\n\n{first.source.strip()}", f"s{i}", role="section", section=i,
                             heading=True))
        for j, c in enumerate(body, 1):
            cid = f"s{i}-{j}"
            if c.kind == "markdown":
                cells.append(_md(c.source, cid, role="section", section=i))
            else:
                if c.needs_gpu:
                    cells.append(_code(guard_gpu(c.source), cid, role="section", section=i, gpu=True))
                else:
                    cells.append(_code(c.source, cid, role="section", section=i))
    for k, ex in enumerate(ep.exercises, 1):
        cells.append(_md(f"## Exercise {k}: {ex.title}\n\n{ex.instructions.strip()}", f"ex{k}", role="exercise",
                         exercise=k))
        # The starter is kept in metadata too: once a learner has filled the cell in, the
        # runner can still prove that the check fails on the starter.
        cells.append(_code(ex.starter, f"ex{k}-starter", role="starter", exercise=k, solution=ex.solution,
                           starter=ex.starter))
        cells.append(_code(check_cell_source(k, ex.check), f"ex{k}-check", role="check", exercise=k,
                           check=ex.check))
        cells.append(_md(hints_source(k, ex), f"ex{k}-hints", role="hints", exercise=k, hints=list(ex.hints)))
    cells.append(_md(f"## Quiz\n\n{QUIZ_INTRO}", "quiz", role="quiz"))
    for i, q in enumerate(ep.quiz, 1):
        cells.append(_md(question_source(i, q), f"quiz-{i}", role="question", question=i))
    cells.append(_md(answers_source(ep.quiz), "answers", role="answers"))
    meta = {
        "kernelspec": dict(KERNELSPEC),
        "language_info": {"name": "python"},
        "ultrascale": {"episode": ep.number, "title": ep.title, "slug": ep.slug, "subtitle": ep.subtitle,
                       "needs_accelerator": ep.needs_accelerator},
    }
    if ep.needs_accelerator:
        meta["accelerator"] = "GPU"  # what Colab reads
    nb = v4.new_notebook(cells=cells, metadata=meta)
    nb.nbformat, nb.nbformat_minor = 4, 5
    return nb


def solved(nb) -> nbformat.NotebookNode:
    """The instructor's version: every starter cell holds its reference solution."""
    import copy

    out = nbformat.from_dict(copy.deepcopy(dict(nb)))
    for cell in out.cells:
        meta = cell.get("metadata", {}).get("ultrascale", {})
        if meta.get("role") == "starter" and isinstance(meta.get("solution"), str) and meta["solution"].strip():
            cell.source = meta["solution"]
    out.metadata.setdefault("ultrascale", {})["solved"] = True
    return out


def notebook_text(nb) -> str:
    """The .ipynb file's text (what nbformat.write produces), ending with a newline."""
    return nbformat.writes(nb, version=4) + "\n"
