"""The series' format as rules; every violation names the cell and what to do.

Rules (the `rule` field of a Violation):

nbformat           the file is not a readable nbformat 4 notebook
file-name          not N_snake_case_topic.ipynb
title              the first heading is not "# Ultra-Scale Playbook: Part N" (optionally " - subtitle")
title-number       the title's N is not the file name's N
overview           no "## Overview" section with at least two bullets
content            no markdown explanation or no code outside the exercises and quiz
syntax             a code cell is not valid Python
imports            code uses a module (torch, dist, np, ...) that nothing imported before
accelerator        unconditional .cuda() / NCCL / "cuda" device without a GPU declared in the metadata
process-group      DDP or a collective is called but no cell calls init_process_group
exercises          not exactly 2 exercises
exercise-starter   an exercise without a code cell for the learner
solution-visible   the starter cell (or the instructions) already holds the solution
exercise-solution  no hidden reference solution
exercise-check     no check cell, or a check that never calls the learner's code
quiz               no quiz, or not 3-4 questions
quiz-answer        the answers are not at the end of the notebook: a question without options, an answer
                   under its question (ticked, or in a <details> block there), a question with no answer
                   in the Answers section at the end, an answer without a one-line why, cells after
                   the answers, or every answer at one letter

The rules about code (syntax, imports, accelerator, process-group) are in
code_rules.py. Code cells tagged `needs-gpu` may use CUDA: the runner skips them on CPU.
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import asdict, dataclass

from ultrascale.series.code_rules import check_code
from ultrascale.series.outline import Outline, outline

FILE_NAME = re.compile(r"^(\d+)_([a-z0-9]+(?:_[a-z0-9]+)*)\.ipynb$")
STRICT_TITLE = re.compile(r"^Ultra-Scale Playbook: Part (\d+)(?: [-\u2013\u2014] (\S.*))?$")
GAP = re.compile(r"NotImplementedError|\bTODO\b|YOUR CODE|_{3,}", re.I)  # how a starter marks the part to write


@dataclass
class Violation:
    file: str
    cell: int | None  # None: the notebook as a whole
    rule: str
    message: str  # what is wrong, then what to do

    def line(self) -> str:
        where = "-" if self.cell is None else str(self.cell)
        return f"{self.file}: cell {where}: {self.rule}: {self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


def lint_file(path: str) -> list[Violation]:
    """Violations of one .ipynb file (an unreadable file is one `nbformat` violation)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [Violation(path, None, "nbformat", f"cannot read the notebook ({e}); save it as .ipynb (JSON)")]
    return lint_notebook(data, path)


def lint_notebook(nb, path: str) -> list[Violation]:
    """Violations of a notebook (dict or NotebookNode) that is, or will be, saved as `path`."""
    out: list[Violation] = []

    def v(cell, rule, message):
        out.append(Violation(path, cell, rule, message))

    problem = _nbformat_problem(nb)
    if problem:
        v(None, "nbformat", problem)
        if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
            return out
    o = outline(nb)
    _names(o, os.path.basename(path), v)
    _overview_and_content(o, v)
    trees = check_code(o, v)
    _exercises(o, trees, v)
    _quiz(o, v)
    return sorted(out, key=lambda x: -1 if x.cell is None else x.cell)


def _nbformat_problem(nb) -> str | None:
    import nbformat

    if not isinstance(nb, dict) or nb.get("nbformat") != 4:
        return "not an nbformat 4 notebook; build it with `ultrascale notebook import`"
    try:
        nbformat.validate(nbformat.from_dict(nb))
    except nbformat.ValidationError as e:
        return f"invalid nbformat 4 ({e.message}); rebuild it with `ultrascale notebook import`"
    return None


def _names(o: Outline, name: str, v) -> None:
    m = FILE_NAME.match(name)
    if not m:
        v(None, "file-name", f"{name!r} is not N_snake_case_topic.ipynb; rename it, e.g. 4_data_parallelism.ipynb")
    if o.title_text is None:
        v(None, "title", "no title; start the notebook with a markdown cell '# Ultra-Scale Playbook: Part N'")
        return
    t = STRICT_TITLE.match(o.title_text)
    if not t:
        v(o.title_cell, "title", f"the title is {o.title_text!r}; write '# Ultra-Scale Playbook: Part N' "
                                 f"(optionally followed by ' - subtitle')")
    part = int(t.group(1)) if t else o.part
    if m and part is not None and part != int(m.group(1)):
        v(o.title_cell, "title-number", f"the title says Part {part} but the file name says {m.group(1)}; "
                                        f"make them agree (rename the file or fix the title)")


def _overview_and_content(o: Outline, v) -> None:
    if o.overview_cell is None:
        v(None, "overview", "no '## Overview' section; add one after the title with a bullet per topic covered")
    elif len(o.overview) < 2:
        v(o.overview_cell, "overview", f"the Overview has {len(o.overview)} bullet(s); list what the episode "
                                       f"covers as at least two '- ' bullets")
    blocks = [b for _, bs in o.sections for b in bs]
    if not any(b.kind == "markdown" and len(b.text.strip()) > 40 for b in blocks):
        v(None, "content", "no markdown explanation outside the exercises and quiz; explain the ideas in "
                           "markdown sections")
    if not any(b.kind == "code" and b.text.strip() for b in blocks):
        v(None, "content", "no code outside the exercises; add runnable PyTorch examples to the sections")


# -- exercises ----------------------------------------------------------------
def _norm(src: str) -> list[str]:
    return [re.sub(r"\s+", " ", line.strip()) for line in src.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _defined(tree) -> set:
    names = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names |= {x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}
    return names


def _exercises(o: Outline, trees: dict, v) -> None:
    n = len(o.exercises)
    if n != 2:
        cell = o.exercises[2].cell if n > 2 else None
        v(cell, "exercises", f"found {n} exercise(s); the format has exactly 2: "
                             f"{'merge or drop the extra ones' if n > 2 else 'add hands-on exercises'}")
    for e in o.exercises:
        k = e.number
        if e.starter is None:
            v(e.cell, "exercise-starter", f"exercise {k} has no code cell for the learner; add a starter cell "
                                          f"with the part to write marked TODO")
        else:
            starter = "".join(o.cells[e.starter].get("source", ""))
            missing = [x for x in _norm(e.solution or "") if x not in set(_norm(starter))]
            if not GAP.search(starter):
                v(e.starter, "solution-visible", f"exercise {k}'s starter cell is complete code with nothing to "
                                                 f"write; hide the solution and leave a gap marked "
                                                 f"'# TODO' + 'raise NotImplementedError'")
            elif e.solution and not missing:
                v(e.starter, "solution-visible", f"every line of exercise {k}'s solution is already in its "
                                                 f"starter cell; leave out the part the learner should write")
            if sum(map(len, missing)) >= 30 and all(x in re.sub(r"\s+", " ", e.instructions) for x in missing):
                v(e.cell, "solution-visible", f"exercise {k}'s instructions spell out the solution's code; "
                                              f"describe what to write, not the code itself")
        if not e.solution:
            v(e.starter if e.starter is not None else e.cell, "exercise-solution",
              f"exercise {k} has no hidden reference solution; add one (it goes into the cell metadata, "
              f"never into the cell)")
        if e.check is None:
            v(e.cell, "exercise-check", f"exercise {k} has no check; add a cell defining check_exercise_{k}() "
                                        f"that runs the learner's code and asserts with a message saying what "
                                        f"is wrong")
        elif e.starter is not None and e.starter in trees and e.check in trees:
            defined = _defined(trees[e.starter])
            used = {x.id for x in ast.walk(trees[e.check]) if isinstance(x, ast.Name)}
            if defined and not defined & used:
                v(e.check, "exercise-check", f"exercise {k}'s check never uses what the starter defines "
                                             f"({', '.join(sorted(defined))}); call the learner's code")
            if not e.check_body or not e.check_body.strip() or e.check_body.strip() == "pass":
                v(e.check, "exercise-check", f"exercise {k}'s check is empty; assert what the learner's code "
                                             f"must do")


# -- quiz ---------------------------------------------------------------------
ANSWERS_HOW = "the letter, the option and a one-line why"


def _quiz(o: Outline, v) -> None:
    if o.quiz_cell is None:
        v(None, "quiz", "no quiz; add '## Quiz' with 3-4 questions, and their answers at the end of the notebook")
        return
    n = len(o.questions)
    if not 3 <= n <= 4:
        v(o.quiz_cell, "quiz", f"the quiz has {n} question(s); ask 3 or 4")
    no_key = o.answers_cell is None and not any(q.under for q in o.questions)
    if no_key and o.questions:
        v(o.quiz_cell, "quiz-answer", f"the quiz has no answers at the end; after the last question add "
                                      f"'## Answers' with each question's answer: {ANSWERS_HOW}")
    for i, q in enumerate(o.questions, 1):
        _question(i, q, o, no_key, v)
    answers = {q.answer for q in o.questions if q.answer is not None and 0 <= q.answer < len(q.options)}
    if n >= 3 and len(answers) == 1 and all(q.answer is not None for q in o.questions):
        # Listed together at the end, one letter for every answer is a pattern a learner sees before thinking.
        letter = "ABCDE"[answers.pop()]
        v(o.answers_cell if o.answers_cell is not None else o.quiz_cell, "quiz-answer",
          f"every question's answer is {letter}); put the right options at different letters")
    if o.after_answers:
        k = o.after_answers[0]
        v(o.answers_cell, "quiz-answer", f"the answers are not at the end of the notebook: cell {k} comes after "
                                         f"them; move the '## Answers' section to the end, after the last "
                                         f"question")


def _question(i: int, q, o: Outline, no_key: bool, v) -> None:
    if len(q.options) < 2:
        v(q.cell, "quiz-answer", f"question {i} has {len(q.options)} option(s); give 2-5 options 'A) ...'")
    if q.under:
        v(q.cell, "quiz-answer", f"question {i}'s answer is under the question; the answers go together at the "
                                 f"end of the notebook: move it to the '## Answers' section after the last "
                                 f"question ({ANSWERS_HOW})")
    elif q.answer is None:
        if not no_key:
            v(o.answers_cell, "quiz-answer", f"question {i} has no answer in the answers at the end; add it: "
                                             f"{ANSWERS_HOW}")
    elif not 0 <= q.answer < len(q.options):
        v(o.answers_cell, "quiz-answer", f"question {i}'s answer points to no option; name one of its options")
    elif not q.why.strip():
        v(o.answers_cell, "quiz-answer", f"question {i}'s answer has no why; add one line saying why it is right")
