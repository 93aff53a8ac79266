"""Notebook -> where each part of the format is (cell indices) -> Episode.

Notebooks built by build.py say what each cell is (`metadata.ultrascale.role`)
and are read back exactly. Any other notebook (one pasted from a chat, an old
episode) is read by its headings, the way a person would: the first
`# Ultra-Scale Playbook: Part N` heading is the title, `## Overview` holds the
bullets, a heading with the word "Exercise" opens an exercise (its first code
cell is the starter), a heading with "Quiz" opens the quiz, whose questions are
numbered items or "Question N" blocks, and a heading with "Answers" after it
opens the answers (quiz.py). A markdown cell holding several headings is split
into blocks at those headings. Outputs of code cells are never read: the
notebook's content is its sources.

lint.py checks the Outline; `read_episode` turns it into an Episode for
re-building or for the previous-episodes list of the prompt.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass, field

from ultrascale.series.build import unguard_gpu
from ultrascale.series.episode import Cell, Episode, Exercise, QuizQuestion, Reference, Section, slugify
from ultrascale.series.quiz import QuestionOutline, read_quiz

TITLE = re.compile(r"^Ultra-Scale Playbook:\s*Part\s+(\d+)\s*(?:[-\u2013\u2014:]\s*(.*?))?\s*$", re.I)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+(.*\S)")


@dataclass
class Block:
    """A cell, or the part of a markdown cell under one heading."""

    cell: int
    kind: str  # markdown | code
    text: str
    heading: tuple[int, str] | None = None  # (level, text) if the block starts with a heading


@dataclass
class ExerciseOutline:
    number: int  # position among the exercises, 1-based
    cell: int  # the heading's cell
    title: str
    instructions: str
    starter: int | None = None  # cell index
    check: int | None = None
    solution: str | None = None  # the hidden reference solution, if the notebook has one
    check_body: str | None = None
    code_cells: list[int] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    starter_source: str | None = None  # the starter as built, even after a learner filled the cell in


@dataclass
class Outline:
    cells: list  # the notebook's cells
    metadata: dict
    title_cell: int | None = None
    title_text: str | None = None  # the first heading's text, whatever it says
    part: int | None = None
    title: str = ""
    subtitle: str = ""
    overview_cell: int | None = None
    overview: list[str] = field(default_factory=list)
    references: list[Reference] = field(default_factory=list)
    sections: list[tuple[str, list[Block]]] = field(default_factory=list)
    exercises: list[ExerciseOutline] = field(default_factory=list)
    quiz_cell: int | None = None
    questions: list[QuestionOutline] = field(default_factory=list)
    answers_cell: int | None = None  # where the answers start (the "## Answers" cell, or an "Answers:" line)
    after_answers: list[int] = field(default_factory=list)  # cells with content below the answers

    @property
    def needs_accelerator(self) -> bool:
        meta = self.metadata
        return bool(meta.get("ultrascale", {}).get("needs_accelerator")) or str(
            meta.get("accelerator", "")).upper() in ("GPU", "TPU")


def _role(cell) -> dict:
    return dict(cell.get("metadata", {}).get("ultrascale", {}) or {})


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def blocks_of(cells) -> list[Block]:
    """Cells as blocks: markdown split before every heading of level <= 3 past its first line
    (outside ``` fences), except cells built by build.py, which are whole."""
    out = []
    for i, cell in enumerate(cells):
        text = _source(cell)
        kind = cell.get("cell_type")
        if kind != "markdown":
            out.append(Block(i, "code" if kind == "code" else "raw", text))
            continue
        if _role(cell).get("role"):  # the builder's cells are whole; their role says what they are
            first = next((x for x in text.splitlines() if x.strip()), "")
            m = HEADING.match(first)
            out.append(Block(i, "markdown", text, (len(m.group(1)), m.group(2)) if m else None))
            continue
        parts, current, fenced = [], [], False
        for line in text.splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            m = None if fenced else HEADING.match(line)
            if m and len(m.group(1)) <= 3 and current and any(x.strip() for x in current):
                parts.append(current)
                current = []
            current.append(line)
        parts.append(current)
        for lines in parts:
            body = "\n".join(lines)
            first = next((x for x in lines if x.strip()), "")
            m = HEADING.match(first)
            out.append(Block(i, "markdown", body, (len(m.group(1)), m.group(2)) if m else None))
    return out


def _strip_heading(text: str) -> str:
    lines = text.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    if lines and HEADING.match(lines[0]):
        lines.pop(0)
    return "\n".join(lines).strip("\n")


def _is_exercise(h: str) -> bool:
    return re.search(r"\bexercise\b", h, re.I) is not None


def _is_quiz(h: str) -> bool:
    return re.search(r"\bquiz\b", h, re.I) is not None


def _is_answers(h: str) -> bool:
    return re.search(r"\banswers?\b", h, re.I) is not None


def outline(nb) -> Outline:
    """Locate the parts of the format in a notebook (an nbformat node or a plain dict)."""
    cells = list(nb.get("cells", []))
    o = Outline(cells=cells, metadata=dict(nb.get("metadata", {})))
    state = _Walk(o)
    prev = None
    for b in blocks_of(cells):
        role = _role(cells[b.cell])
        first_of_cell, prev = b.cell != prev, b.cell
        if role.get("role") in _ROLES:
            state.by_role(b, role, first_of_cell)
        else:
            state.by_heading(b)
    o.questions, o.answers_cell = read_quiz(
        [(b.cell, _strip_heading(b.text) if b.heading and _is_quiz(b.heading[1]) else b.text)
         for b in state.quiz_blocks if b.kind == "markdown"],
        [(b.cell, b.text) for b in state.answer_blocks if b.kind == "markdown"])
    o.after_answers = _after_answers(o, state)
    meta = o.metadata.get("ultrascale", {})
    if not o.title and meta.get("title"):
        o.title = meta["title"]
    return o


_ROLES = {"title", "overview", "references", "setup", "section", "exercise", "starter", "check", "hints", "quiz",
          "question", "answers"}


def _after_answers(o: Outline, state) -> list[int]:
    """Cells with content below the cell where the answers start, other than the answers themselves."""
    if o.answers_cell is None:
        return []
    answers = {b.cell for b in state.answer_blocks}
    return [i for i, c in enumerate(o.cells) if i > o.answers_cell and i not in answers and _source(c).strip()]


class _Walk:
    """The cell being read is in scope `scope` (opened by a heading of level `level`)."""

    def __init__(self, o: Outline):
        self.o, self.scope, self.level, self.ex = o, None, 0, None
        self.quiz_blocks: list[Block] = []
        self.answer_blocks: list[Block] = []

    # -- notebooks built by build.py ------------------------------------------
    def by_role(self, b: Block, role: dict, first_of_cell: bool) -> None:
        o, r = self.o, role["role"]
        if r == "title":
            if first_of_cell:
                self._title(b)
        elif r == "overview":
            if first_of_cell:
                o.overview_cell = b.cell
            self.scope = "overview"
            self._overview(b)
        elif r == "references":
            o.references += [Reference(int(n), note) for n, note in _reference_lines(b.text)]
        elif r == "section":
            if role.get("heading") and first_of_cell:
                o.sections.append((b.heading[1] if b.heading else "", []))
            elif not o.sections:
                o.sections.append(("", []))
            o.sections[-1][1].append(b)
        elif r == "exercise":
            if first_of_cell:
                self._exercise(b)
            elif b.heading is None:
                self.ex.instructions = (self.ex.instructions + "\n\n" + b.text).strip()
        elif r in ("starter", "check"):
            k = role.get("exercise")
            ex = next((e for e in o.exercises if e.number == k), self.ex)
            if ex is None:
                return
            ex.code_cells.append(b.cell)
            if r == "starter":
                ex.starter = b.cell
                if isinstance(role.get("solution"), str):
                    ex.solution = role["solution"]
                if isinstance(role.get("starter"), str):
                    ex.starter_source = role["starter"]
            else:
                ex.check = b.cell
                body = _check_body(b.text, ex.number)
                ex.check_body = body if body is not None else role.get("check")
        elif r == "hints":
            k = role.get("exercise")
            ex = next((e for e in o.exercises if e.number == k), self.ex)
            if ex is not None and isinstance(role.get("hints"), list):
                ex.hints = [str(h) for h in role["hints"]]
        elif r == "quiz":
            if first_of_cell:
                o.quiz_cell = b.cell
            self.scope = "quiz"
            self.quiz_blocks.append(b)
        elif r == "question":
            self.quiz_blocks.append(b)
        elif r == "answers":
            self.scope = "answers"
            self.answer_blocks.append(b)

    # -- any other notebook: by its headings ----------------------------------
    def by_heading(self, b: Block) -> None:
        o, h = self.o, b.heading
        if h and h[0] == 1 and o.title_text is None:
            self._title(b)
            self.scope, self.level = "title", 1
            return
        if h:
            level, text = h
            if self.scope == "answers" and not _is_answers(text):
                self.scope = None  # another heading ends the answers: what follows is content after them
            opens = level <= self.level or self.scope in (None, "title", "section", "overview")
            if re.fullmatch(r"\W*overview\W*", text, re.I) and o.overview_cell is None:
                self.scope, self.level, o.overview_cell = "overview", level, b.cell
            elif _is_exercise(text) and self.scope not in ("quiz", "answers"):
                self._exercise(b)
                self.scope, self.level = "exercise", level
                return
            elif _is_quiz(text) and not (_is_answers(text) and o.quiz_cell is not None):
                self.scope, self.level, o.quiz_cell = "quiz", level, b.cell
            elif _is_answers(text) and o.quiz_cell is not None and self.scope in ("quiz", "answers"):
                self.scope, self.level = "answers", level
            elif opens and not (self.scope == "section" and level > 2):
                self.scope, self.level = "section", level
                o.sections.append((text, []))
        if self.scope == "overview":
            self._overview(b)
        elif self.scope == "exercise":
            ex = self.ex
            if b.kind == "code":
                ex.code_cells.append(b.cell)
                if re.search(r"def\s+check_exercise_\d+\s*\(", b.text):
                    ex.check, ex.check_body = b.cell, _check_body(b.text, ex.number)
                elif ex.starter is None:
                    ex.starter = b.cell
            elif b.kind == "markdown":
                ex.instructions = (ex.instructions + "\n\n" + b.text).strip()
        elif self.scope == "quiz":
            self.quiz_blocks.append(b)
        elif self.scope == "answers":
            if b.kind == "markdown":  # code below the answers is content after them, for the lint
                self.answer_blocks.append(b)
        elif self.scope == "section" or b.kind == "code":
            if not o.sections:
                o.sections.append(("", []))
            o.sections[-1][1].append(b)

    def _title(self, b: Block) -> None:
        o = self.o
        text = b.heading[1] if b.heading else _strip_heading(b.text).splitlines()[0] if b.text.strip() else ""
        o.title_text, o.title_cell = text, b.cell
        m = TITLE.match(text)
        if m:
            o.part, o.title = int(m.group(1)), (m.group(2) or "").strip()
        sub = re.search(r"^\s*\*(?!\*)(.+?)\*\s*$", _strip_heading(b.text), re.M)
        if sub:
            o.subtitle = sub.group(1).strip()

    def _overview(self, b: Block) -> None:
        lines = _strip_heading(b.text).splitlines() if b.heading else b.text.splitlines()
        self.o.overview += [m.group(1) for m in map(BULLET.match, lines) if m]

    def _exercise(self, b: Block) -> None:
        text = b.heading[1] if b.heading else ""
        m = re.search(r"\bexercise\b\s*#?\d*\s*[:.\-\u2013\u2014]?\s*(.*)", text, re.I)
        self.ex = ExerciseOutline(len(self.o.exercises) + 1, b.cell, (m.group(1) if m else text).strip(),
                                  _strip_heading(b.text))
        self.o.exercises.append(self.ex)


def _reference_lines(text):
    for line in text.splitlines():
        m = re.match(r"^\s*[-*]\s*Part\s+(\d+)\s*:?\s*(.*)", line)
        if m:
            yield m.group(1), m.group(2).strip()


def _check_body(src: str, k: int) -> str | None:
    """The statements inside `def check_exercise_k():` of a check cell."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    lines = src.splitlines()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("check_exercise_"):
            # From the line after `def ...:` (comments before the first statement belong to the check).
            start = node.lineno if node.body[0].lineno > node.lineno else node.body[0].lineno - 1
            return textwrap.dedent("\n".join(lines[start:node.end_lineno])).strip("\n")
    return None


def read_episode(nb, filename: str | None = None) -> Episode:
    """The Episode a notebook holds, as far as it holds one (lint says what is missing)."""
    o = outline(nb)
    meta = o.metadata.get("ultrascale", {})
    number = o.part if o.part is not None else int(meta.get("episode", 0) or 0)
    slug = meta.get("slug") or ""
    if not slug and filename:
        m = re.match(r"^\d+_(.+?)(?:\.rejected)?\.ipynb$", filename.rsplit("/", 1)[-1])
        slug = m.group(1) if m else ""
    sections = []
    for heading, blocks in o.sections:
        cells = []
        for j, b in enumerate(blocks):
            if b.kind == "markdown":
                text = _strip_heading(b.text) if (j == 0 and b.heading) else b.text
                if text.strip():
                    cells.append(Cell("markdown", text))
            elif b.kind == "code":
                tags = o.cells[b.cell].get("metadata", {}).get("tags", [])
                if _role(o.cells[b.cell]).get("gpu"):
                    cells.append(Cell("code", unguard_gpu(b.text), True))
                else:
                    cells.append(Cell("code", b.text, "needs-gpu" in tags))
        sections.append(Section(heading, cells))
    exercises = []
    for e in o.exercises:
        starter = _source(o.cells[e.starter]) if e.starter is not None else ""
        if e.starter_source is not None:
            starter = e.starter_source
        exercises.append(Exercise(e.title, e.instructions, starter, e.solution or "", e.check_body or "",
                                  hints=list(e.hints)))
    quiz = [QuizQuestion(q.question, q.options, q.answer if q.answer is not None else -1, q.why)
            for q in o.questions]
    return Episode(number=number, title=o.title, overview=o.overview, sections=sections, exercises=exercises,
                   quiz=quiz, slug=slugify(slug) if slug else "", subtitle=o.subtitle or meta.get("subtitle", ""),
                   references=o.references, needs_accelerator=o.needs_accelerator)
