"""Transcript -> LLM -> notebook, saved only if it keeps the format and runs.

Each attempt goes through the same gate as `notebook import`: parse the JSON
into an Episode, build the notebook, lint it, run it (exercise checks proven
against the starter and the hidden solution). A failed attempt is sent back
to the model with every problem found, up to `max_repairs` times.

What is written, in `out`:
- N_slug.ipynb when an attempt passes (replacing an older file of that name
  only under --force), with the outputs of the run that proved it (outputs.py);
- otherwise N_slug.rejected.ipynb: the last attempt with the reasons in its
  first cell and in metadata.ultrascale.rejected, and exit status 1. A good
  notebook already there is never touched.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

from ultrascale.errors import ConfigError
from ultrascale.series.episode import Episode, EpisodeError
from ultrascale.series.files import episode_files, rejected_name, write_atomic
from ultrascale.series.progress import Progress


@dataclass
class Attempt:
    episode: Episode | None = None
    notebook: object = None  # nbformat.NotebookNode once built
    executed: object = None  # the same notebook with the outputs of the run that checked it
    problems: list[str] = field(default_factory=list)
    text: str = ""  # what the model (or the pasted file) said

    @property
    def ok(self) -> bool:
        return self.notebook is not None and not self.problems


def parse_episode(obj) -> Episode:
    """An Episode from parsed JSON: the episode object itself, or a whole .ipynb notebook."""
    from ultrascale.series.outline import read_episode

    if isinstance(obj, dict) and "cells" in obj and "nbformat" in obj:
        ep = read_episode(obj)
        if not ep.title and not ep.sections:
            raise EpisodeError("the notebook has no '# Ultra-Scale Playbook: Part N' title and no sections")
        return ep
    return Episode.from_dict(obj)


def describe_cell(nb, i) -> str:
    """Where cell i is, in the episode's terms (the model never sees cell indices)."""
    if i is None:
        return "the notebook"
    meta = nb.cells[i].get("metadata", {}).get("ultrascale", {}) if 0 <= i < len(nb.cells) else {}
    role = meta.get("role")
    if role == "section":
        return f"cell {i} (section {meta.get('section')})"
    if role in ("exercise", "starter", "check"):
        what = {"exercise": "instructions", "starter": "starter", "check": "check"}[role]
        return f"cell {i} (exercise {meta.get('exercise')} {what})"
    if role == "question":
        return f"cell {i} (quiz question {meta.get('question')})"
    if role == "answers":
        return f"cell {i} (the quiz's answers, at the end)"
    return f"cell {i} ({role})" if role else f"cell {i}"


def assess(obj, number: int | None, timeout: float, progress: Progress, text: str = "") -> Attempt:
    """Parse, build, lint and run one candidate; `obj` is parsed JSON or None if `text` must be parsed."""
    from ultrascale.series.build import build_notebook
    from ultrascale.series.execute import run_notebook
    from ultrascale.series.lint import lint_notebook
    from ultrascale.series.llm import extract_json

    a = Attempt(text=text)
    try:
        if obj is None:
            obj = extract_json(text)
        a.episode = parse_episode(obj)
    except EpisodeError as e:
        a.problems.append(str(e))
        return a
    if number is not None:
        a.episode.number = number
    if a.episode.number <= 0:
        a.problems.append(f"number must be a positive episode number, got {a.episode.number}")
        return a
    nb = a.notebook = build_notebook(a.episode)
    violations = lint_notebook(nb, a.episode.filename)
    a.problems += [f"{describe_cell(nb, v.cell)}: {v.rule}: {v.message}" for v in violations]
    if any(v.rule in ("syntax", "nbformat") for v in violations):
        return a  # it cannot run; say what to fix first
    with progress.step(f"running {a.episode.filename} on CPU"):
        with tempfile.TemporaryDirectory(prefix="ultrascale-run-") as cwd:
            report = run_notebook(nb, timeout=timeout, cwd=cwd)
    a.executed = report.notebook
    failed = report.failure
    if failed:
        a.problems.append(f"{describe_cell(nb, failed.cell)} failed when run: {failed.ename}: {failed.evalue}")
    a.problems += [e.line() for e in report.exercises if not e.ok]
    if not a.problems:
        a.problems += _on_two_ranks(nb, timeout, progress)
    progress.say(f"  ran {len(report.executed)} code cells in {report.seconds:.1f} s"
                 + (f", skipped {len(report.skipped)} needing a GPU" if report.skipped else ""))
    return a


def _on_two_ranks(nb, timeout: float, progress: Progress) -> list[str]:
    """A notebook that starts its own process group is run again as 2 ranks (see multirank.py)."""
    from ultrascale.series.build import check_function
    from ultrascale.series.multirank import WORLD, run_as_ranks, uses_process_group
    from ultrascale.series.outline import outline

    cells = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    if not uses_process_group(s for _, s in cells):
        return []
    o = outline(nb)
    exercises = [(e.number, e.solution, check_function(e.number)) for e in o.exercises
                 if e.solution and e.check is not None]
    with progress.step(f"running it again as {WORLD} ranks"):
        return run_as_ranks(cells, exercises, timeout)


def keep(a: Attempt, out: str, number: int, force: bool) -> tuple[str, bool]:
    """Save a passing attempt as N_slug.ipynb, or the last failing one as N_slug.rejected.ipynb."""
    import nbformat

    from ultrascale.series.build import notebook_text
    from ultrascale.series.outputs import with_outputs

    if a.ok:
        path = os.path.join(out, a.episode.filename)
        if os.path.exists(path) and not force:
            raise ConfigError(f"{path} exists; pass --force to replace it")
        shown = with_outputs(a.notebook, a.executed) if a.executed is not None else a.notebook
        write_atomic(path, notebook_text(shown))
        stale = os.path.join(out, rejected_name(a.episode.filename))
        if os.path.exists(stale):
            os.unlink(stale)
        return path, True
    slug = a.episode.slug if a.episode else _existing_slug(out, number)
    path = os.path.join(out, rejected_name(f"{number}_{slug}.ipynb"))
    # The saved file starts with the note below, so every cell moves down by one: the
    # reasons (printed and saved) count cells as in the saved file.
    a.problems = [_renumbered(p) for p in a.problems]
    reasons = "\n".join(f"- {p}" for p in a.problems)
    head = nbformat.v4.new_markdown_cell(f"**Rejected by `ultrascale notebook`**: this attempt breaks the series' "
                                         f"format or does not run.\n\n{reasons}", id="rejected")
    if a.notebook is not None:
        nb = nbformat.from_dict(json.loads(json.dumps(a.notebook)))
        nb.cells.insert(0, head)
    else:
        raw = nbformat.v4.new_raw_cell(a.text, id="reply")
        nb = nbformat.v4.new_notebook(cells=[head, raw])
        nb.nbformat_minor = 5
    nb.metadata.setdefault("ultrascale", {})["rejected"] = list(a.problems)
    write_atomic(path, notebook_text(nb))
    return path, False


def _renumbered(problem: str) -> str:
    import re

    return re.sub(r"\bcell (\d+)\b", lambda m: f"cell {int(m.group(1)) + 1}", problem)


def _existing_slug(out: str, number: int) -> str:
    for path in episode_files(out, number):
        return os.path.basename(path).split("_", 1)[1][:-len(".ipynb")]
    return "episode"


def previous_episodes(directory: str, number: int, progress: Progress) -> list[Episode]:
    """Title and overview of every good notebook in `directory` before episode `number`."""
    from ultrascale.series.outline import read_episode

    eps = []
    if not os.path.isdir(directory):
        return eps
    for path in episode_files(directory):
        n = int(os.path.basename(path).split("_", 1)[0])
        if n >= number:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                eps.append(read_episode(json.load(f), path))
        except (OSError, ValueError) as e:
            progress.say(f"note: skipping {path} as an earlier episode ({e})")
    return eps


def generate(n: int, transcript: str, previous: list[Episode], model, out: str, max_repairs: int,
             timeout: float, force: bool, progress: Progress) -> int:
    """The loop: ask, check, repair; 0 when N_slug.ipynb is written, 1 when only a rejected file is."""
    from ultrascale.series.prompt import SYSTEM, build_prompt, repair_prompt

    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": build_prompt(n, transcript, previous)}]
    attempt, replies = None, []
    for k in range(max_repairs + 1):
        with progress.step(f"call {k + 1}: waiting for {model.where()}"):
            reply = model.complete(messages)
        replies.append(reply)
        progress.say(f"call {k + 1}: {reply.seconds:.1f} s, {reply.usage()}"
                     + (f", {reply.retries} retr{'y' if reply.retries == 1 else 'ies'}" if reply.retries else "")
                     + ("" if reply.structured else ", JSON read from text"))
        attempt = assess(None, n, timeout, progress, text=reply.text)
        if attempt.ok:
            path, _ = keep(attempt, out, n, force)
            progress.say(f"attempt {k + 1} passed: lint clean, runs on CPU, exercises proven")
            progress.say(_totals(replies))
            print(f"wrote {path}")
            return 0
        progress.say(f"attempt {k + 1} rejected ({len(attempt.problems)} problem(s)):")
        for p in attempt.problems:
            progress.say(f"  - {p}")
        messages += [{"role": "assistant", "content": reply.text},
                     {"role": "user", "content": repair_prompt(attempt.problems)}]
    path, _ = keep(attempt, out, n, force)
    progress.say(_totals(replies))
    print(f"rejected after {max_repairs + 1} attempt(s); the last one is kept as {path} with the reasons")
    return 1


def _totals(replies) -> str:
    prompt = sum(r.prompt_tokens or 0 for r in replies)
    completion = sum(r.completion_tokens or 0 for r in replies)
    return (f"{len(replies)} call(s), {sum(r.seconds for r in replies):.1f} s waiting for the model, "
            f"{prompt:,} prompt + {completion:,} completion tokens in all")


__all__ = ["Attempt", "assess", "keep", "generate", "parse_episode", "previous_episodes"]
