"""Reading a quiz back from markdown: the questions, their options, the answer and where it is shown.

The builder writes one cell per question: "**Question N.** text", options "- A) ...",
and the answer with its why inside a collapsed <details> block. Other notebooks
number their questions ("1. ...", "Q2:", "### Question 3"), tick the right option
in plain sight (a check mark or "(correct)") or list the answers under an
"Answers:" line; all of these are read, and `collapsed` says whether the answer
was hidden, which is what the lint asks for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
OPTION = re.compile(r"^\s*(?:[-*+]\s*)?\(?([A-Ha-h])[).]\s+(.*\S)")
QUESTION_START = re.compile(r"^(?:\*\*)?\s*(?:Q(?:uestion)?\s*)?(\d+)\s*[.):]\s*(?:\*\*)?\s*(.*)", re.I)
ANSWER_KEY = re.compile(r"^\s*(?:#+\s*)?(?:\*\*)?\s*answers?\s*(?:key)?\s*:?\s*(?:\*\*)?\s*:?\s*$", re.I)
VISIBLE_MARK = re.compile(r"\u2705|\u2714|\(correct\)|\u2190\s*correct", re.I)


@dataclass
class QuestionOutline:
    cell: int
    question: str
    options: list[str]
    answer: int | None  # option index, None if the notebook gives none
    why: str
    collapsed: bool  # the answer sits in a <details> block


def read_quiz(parts: list[tuple[int, str]]) -> tuple[list[QuestionOutline], int | None]:
    """The questions in the quiz's markdown, given as (cell index, text) without the "## Quiz" heading;
    and the cell of an "Answers:" key, if there is one."""
    lines, key = [], []  # (cell, line)
    in_key, key_cell = False, None
    for cell, text in parts:
        for line in text.splitlines():
            if ANSWER_KEY.match(line) or (HEADING.match(line) and re.search(r"\banswers?\b", line, re.I)):
                in_key, key_cell = True, cell
                continue
            (key if in_key else lines).append((cell, line))
    questions: list[tuple[int, list[str]]] = []
    for cell, line in lines:
        text = HEADING.sub(lambda m: m.group(2), line) if HEADING.match(line) else line
        m = QUESTION_START.match(text.strip()) if not line.startswith((" ", "\t")) else None
        if m and not OPTION.match(line):
            questions.append((cell, [m.group(2)]))
        elif questions:
            questions[-1][1].append(line)
    answers = {}
    for _, line in key:
        m = re.match(r"^\s*(?:\*\*)?\s*(?:Q(?:uestion)?\s*)?(\d+)\s*[.):]\s*(?:\*\*)?\s*\(?([A-Ha-h])\b[).]?\s*(.*)",
                     line)
        if m:
            answers[int(m.group(1))] = ("ABCDEFGH".index(m.group(2).upper()), m.group(3).strip())
    return [_question(cell, qlines, answers.get(n)) for n, (cell, qlines) in enumerate(questions, 1)], key_cell


def _question(cell: int, qlines: list[str], keyed) -> QuestionOutline:
    text = "\n".join(qlines)
    details = re.search(r"<details>(.*?)</details>", text, re.S | re.I)
    outside = text[:details.start()] + text[details.end():] if details else text
    question, options, answer, why = [], [], None, ""
    for line in outside.splitlines():
        m = OPTION.match(line)
        if m:
            if VISIBLE_MARK.search(m.group(2)) and answer is None:
                answer = len(options)
            options.append(VISIBLE_MARK.sub("", m.group(2)).strip())
        elif not options and line.strip():
            question.append(line.strip())
    collapsed = False
    if details:
        inner = re.sub(r"<summary>.*?</summary>", "", details.group(1), flags=re.S | re.I).strip()
        m = re.search(r"\(?\b([A-H])\)", inner)
        if m:
            answer, collapsed = "ABCDEFGH".index(m.group(1)), True
            rest = inner[m.end():].lstrip("* ").strip()
            if 0 <= answer < len(options) and rest.lower().startswith(options[answer].lower().rstrip(".")):
                rest = rest[len(options[answer].rstrip(".")):].lstrip(". ")
            why = rest.strip()
    elif keyed is not None and answer is None:
        answer, why = keyed[0], ""
    q = " ".join(question).strip().strip("*").strip()
    q = re.sub(r"^\*\*|\*\*$", "", q).strip()
    return QuestionOutline(cell, q, options, answer, why, collapsed)
