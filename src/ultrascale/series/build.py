"""Episode -> nbformat 4 notebook.

Layout, top to bottom: title, overview, references (if any), the sections,
the two exercises (instructions, starter cell, check cell), the quiz (one cell
per question, the answer inside a collapsed <details> block).

Every cell carries `metadata.ultrascale.role` so outline.py can read the
notebook back exactly; cell ids are derived from the role, so building the
same episode twice gives the same file (clean diffs). The reference solution
of an exercise lives in its starter cell's metadata (`ultrascale.solution`):
notebook front-ends do not show cell metadata, and the cell itself only ever
holds the starter.

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

GPU_TAG = "needs-gpu"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
LETTERS = "ABCDEFGH"


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


def question_source(i: int, q) -> str:
    options = "\n".join(f"- {LETTERS[j]}) {o}" for j, o in enumerate(q.options))
    letter = LETTERS[q.answer] if 0 <= q.answer < len(q.options) else "?"
    right = q.options[q.answer] if 0 <= q.answer < len(q.options) else ""
    why = f" {q.why}" if q.why else ""
    return (f"**Question {i}.** {q.question}\n\n{options}\n\n"
            f"<details>\n<summary>Answer</summary>\n\n**{letter})** {right}.{why}\n\n</details>")


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
    cells.append(_md(title, "title", role="title"))
    cells.append(_md("## Overview\n\n" + "\n".join(f"- {b}" for b in ep.overview), "overview", role="overview"))
    if ep.references:
        refs = "\n".join(f"- Part {r.episode}: {r.note}" if r.note else f"- Part {r.episode}"
                         for r in ep.references)
        cells.append(_md(f"**Builds on earlier episodes**\n\n{refs}", "references", role="references",
                         episodes=[r.episode for r in ep.references]))
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
                cells.append(_code(c.source, cid, tags=[GPU_TAG] if c.needs_gpu else (), role="section", section=i))
    for k, ex in enumerate(ep.exercises, 1):
        cells.append(_md(f"## Exercise {k}: {ex.title}\n\n{ex.instructions.strip()}", f"ex{k}", role="exercise",
                         exercise=k))
        cells.append(_code(ex.starter, f"ex{k}-starter", role="starter", exercise=k, solution=ex.solution))
        cells.append(_code(check_cell_source(k, ex.check), f"ex{k}-check", role="check", exercise=k,
                           check=ex.check))
    cells.append(_md("## Quiz\n\nPick an answer for each question, then open *Answer* to see if you were right.",
                     "quiz", role="quiz"))
    for i, q in enumerate(ep.quiz, 1):
        cells.append(_md(question_source(i, q), f"quiz-{i}", role="question", question=i))
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


def notebook_text(nb) -> str:
    """The .ipynb file's text (what nbformat.write produces), ending with a newline."""
    return nbformat.writes(nb, version=4) + "\n"
