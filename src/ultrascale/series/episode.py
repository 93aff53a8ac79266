"""One episode of the series as data: what the notebook says, not how it is laid out.

An Episode is what an LLM is asked to produce (as JSON, see schema.py), what
build.py turns into a notebook and what outline.py reads back from one. The
format's rules (exactly 2 exercises, 3-4 quiz questions, ...) are *not*
enforced here: a structure with 3 exercises must still load, so that lint can
say what is wrong with it in the words of the format.

`from_dict` accepts what models tend to send (answers as letters, options
prefixed "A) ", numbers as strings) and raises EpisodeError naming the path of
the first field it cannot use.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

SERIES = "Ultra-Scale Playbook"


class EpisodeError(ValueError):
    """JSON that cannot be read as an episode; the message names the field."""


@dataclass
class Cell:
    """A markdown or code cell of a section. `needs_gpu` cells are skipped on CPU."""

    kind: str  # "markdown" | "code"
    source: str
    needs_gpu: bool = False

    def __post_init__(self):
        self.source = _edges(self.source)


def md(text: str) -> Cell:
    """A markdown cell, for episode sources written in Python (notebooks/src)."""
    return Cell("markdown", text.strip("\n"))


def code(text: str, needs_gpu: bool = False) -> Cell:
    """A code cell, for episode sources written in Python (notebooks/src)."""
    return Cell("code", text.strip("\n"), needs_gpu)


@dataclass
class Section:
    """A `## heading` and the cells under it."""

    heading: str
    cells: list[Cell] = field(default_factory=list)


@dataclass
class Exercise:
    """A hands-on exercise.

    starter   code the learner completes: a gap marked with TODO and
              `raise NotImplementedError`, never the answer
    solution  the complete code; kept out of sight (notebook metadata)
    check     statements that call the learner's code and `assert` what must
              hold, with a message saying what is wrong; they become the body
              of `check_exercise_<k>()`, and raising NotImplementedError means
              "not done yet"
    hints     progressive hints, each one revealed on demand (collapsed in the
              notebook), from a nudge to nearly the answer; the solution itself
              can be revealed after them
    """

    title: str
    instructions: str
    starter: str
    solution: str
    check: str
    hints: list[str] = field(default_factory=list)

    def __post_init__(self):
        # Blank lines at the edges are not content: the notebook drops them, so the structure does too.
        for name in ("instructions", "starter", "solution", "check"):
            setattr(self, name, _edges(getattr(self, name)))
        self.hints = [_edges(h) for h in self.hints]


@dataclass
class QuizQuestion:
    """`answer` is an index into `options`; `why` is the one line shown with it."""

    question: str
    options: list[str]
    answer: int
    why: str


@dataclass
class Reference:
    """An earlier episode this one builds on, and what from it."""

    episode: int
    note: str


@dataclass
class Episode:
    """Part `number` of the series.

    title     the topic, after the dash in "# Ultra-Scale Playbook: Part N - title"
    slug      snake_case topic for the file name N_slug.ipynb (from the title if empty)
    subtitle  one line under the heading (optional)
    needs_accelerator  the notebook declares it needs a GPU (lint then allows CUDA code)
    """

    number: int
    title: str
    overview: list[str]
    sections: list[Section]
    exercises: list[Exercise]
    quiz: list[QuizQuestion]
    slug: str = ""
    subtitle: str = ""
    references: list[Reference] = field(default_factory=list)
    needs_accelerator: bool = False

    def __post_init__(self):
        if not self.slug:
            self.slug = slugify(self.title)

    @property
    def heading(self) -> str:
        head = f"{SERIES}: Part {self.number}"
        return f"{head} - {self.title}" if self.title else head

    @property
    def filename(self) -> str:
        return f"{self.number}_{self.slug}.ipynb"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data) -> "Episode":
        return _episode(data)


def _edges(text):
    """Text without blank lines (or trailing spaces) at its start and end; indentation kept."""
    if not isinstance(text, str):
        return text
    lines = text.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines)


def slugify(text: str, limit: int = 40) -> str:
    """'Data Parallelism: 3 optimisations' -> 'data_parallelism_3_optimisations'."""
    slug = re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")
    if len(slug) > limit:
        slug = slug[:limit].rsplit("_", 1)[0] or slug[:limit]
    return slug or "episode"


# -- reading JSON -------------------------------------------------------------
def _need(data, key, path, kind=None, default=...):
    if not isinstance(data, dict):
        raise EpisodeError(f"{path or 'the episode'} must be a JSON object, got {type(data).__name__}")
    if key not in data or data[key] is None:
        if default is not ...:
            return default
        raise EpisodeError(f"{_join(path, key)} is missing")
    value = data[key]
    if kind is str:
        if not isinstance(value, str):
            raise EpisodeError(f"{_join(path, key)} must be a string, got {type(value).__name__}")
        return value
    if kind is list:
        if not isinstance(value, list):
            raise EpisodeError(f"{_join(path, key)} must be a list, got {type(value).__name__}")
        return value
    if kind is int:
        return _int(value, _join(path, key))
    if kind is bool:
        if not isinstance(value, bool):
            raise EpisodeError(f"{_join(path, key)} must be true or false")
        return value
    return value


def _join(path, key):
    return f"{path}.{key}" if path else key


def _int(value, path):
    if isinstance(value, bool):
        raise EpisodeError(f"{path} must be an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise EpisodeError(f"{path} must be an integer, got {value!r}")


def _text(value, path) -> str:
    # Models sometimes send code as a list of lines (as .ipynb does).
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "".join(v if v.endswith("\n") else v + "\n" for v in value).rstrip("\n")
    if not isinstance(value, str):
        raise EpisodeError(f"{path} must be a string")
    return value


_OPTION_PREFIX = re.compile(r"^\s*(?:\(?[A-Ha-h][).:]|[A-Ha-h]\s*-)\s+")


def _answer(value, options, path) -> int:
    """An option index from 0-based int, a letter, or the option's text."""
    if isinstance(value, str):
        v = value.strip()
        stripped = [_OPTION_PREFIX.sub("", o).strip().lower() for o in options if isinstance(o, str)]
        if _OPTION_PREFIX.sub("", v).strip().lower() in stripped:
            return stripped.index(_OPTION_PREFIX.sub("", v).strip().lower())
        m = re.fullmatch(r"\(?([A-Ha-h])[).:]?(?:\s.*)?", v)
        if m:
            return "abcdefgh".index(m.group(1).lower())
        if v.isdigit():
            return int(v)
        raise EpisodeError(f"{path} must be the index of the right option, got {value!r}")
    return _int(value, path)


def _episode(data) -> Episode:
    if isinstance(data, dict) and "episode" in data and isinstance(data["episode"], dict):
        data = data["episode"]  # {"episode": {...}} wrappers
    number = _need(data, "number", "", int)
    sections = []
    for i, s in enumerate(_need(data, "sections", "", list)):
        p = f"sections[{i}]"
        cells = []
        for j, c in enumerate(_need(s, "cells", p, list)):
            q = f"{p}.cells[{j}]"
            kind = _need(c, "kind", q, str)
            if kind not in ("markdown", "code"):
                raise EpisodeError(f"{q}.kind must be 'markdown' or 'code', got {kind!r}")
            cells.append(Cell(kind, _text(_need(c, "source", q), f"{q}.source"),
                              _need(c, "needs_gpu", q, bool, default=False)))
        sections.append(Section(_need(s, "heading", p, str), cells))
    exercises = []
    for i, e in enumerate(_need(data, "exercises", "", list)):
        p = f"exercises[{i}]"
        hints = _need(e, "hints", p, list, default=[])
        if not all(isinstance(h, str) for h in hints):
            raise EpisodeError(f"{p}.hints must be a list of strings (one per hint)")
        exercises.append(Exercise(*(_text(_need(e, k, p), f"{p}.{k}") for k in
                                    ("title", "instructions", "starter", "solution", "check")), hints=hints))
    quiz = []
    for i, q in enumerate(_need(data, "quiz", "", list)):
        p = f"quiz[{i}]"
        options = [_OPTION_PREFIX.sub("", o) for o in _need(q, "options", p, list)]
        if not all(isinstance(o, str) for o in options):
            raise EpisodeError(f"{p}.options must be a list of strings")
        answer = _answer(_need(q, "answer", p), _need(q, "options", p, list), f"{p}.answer")
        if not 0 <= answer < len(options):
            raise EpisodeError(f"{p}.answer is {answer} but there are {len(options)} options (0-based index)")
        quiz.append(QuizQuestion(_need(q, "question", p, str), options, answer, _need(q, "why", p, str, default="")))
    references = [Reference(_need(r, "episode", f"references[{i}]", int), _need(r, "note", f"references[{i}]", str,
                                                                                 default=""))
                  for i, r in enumerate(_need(data, "references", "", list, default=[]))]
    overview = _need(data, "overview", "", list)
    if not all(isinstance(b, str) for b in overview):
        raise EpisodeError("overview must be a list of strings (one per bullet)")
    # "Ultra-Scale Playbook: Part 6 - Averages" as a title would be said twice in the heading.
    title = re.sub(r"^\s*Ultra-Scale Playbook:\s*Part\s+\d+\s*(?:[-\u2013\u2014:]\s*)?", "",
                   _need(data, "title", "", str), flags=re.I)
    return Episode(
        number=number,
        title=title,
        overview=[re.sub(r"^\s*[-*]\s+", "", b) for b in overview],
        sections=sections,
        exercises=exercises,
        quiz=quiz,
        slug=slugify(_need(data, "slug", "", str, default="")) if data.get("slug") else "",
        subtitle=_need(data, "subtitle", "", str, default=""),
        references=references,
        needs_accelerator=_need(data, "needs_accelerator", "", bool, default=False),
    )
