"""Reading a quiz back from markdown: the questions, their options, each answer and where it sits.

The series' format asks the questions in the Quiz section and gives all the answers
together at the end of the notebook. The builder writes one cell per question
("**Question N.** text", options "- A) ...") and a last "## Answers" cell with one
line per question: "**Question N: B)** the option. Why it is right."

Other notebooks number their questions ("1. ...", "Q2:", "### Question 3"), list the
answers under an "Answers:" line or heading ("1. b) ...", "Q2: A) ..."), tick the right
option in plain sight (a check mark or "(correct)") or hide the answer in a <details>
block under its question; all of these are read, and `under` says that an answer sits
under its question, which the lint points out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
OPTION = re.compile(r"^\s*(?:[-*+]\s*)?\(?([A-Ha-h])[).]\s+(.*\S)")
QUESTION_START = re.compile(r"^(?:\*\*)?\s*(?:Q(?:uestion)?\s*)?(\d+)\s*[.):]\s*(?:\*\*)?\s*(.*)", re.I)
ANSWER_KEY = re.compile(r"^\s*(?:#+\s*)?(?:\*\*)?\s*answers?\s*(?:key)?\s*:?\s*(?:\*\*)?\s*:?\s*$", re.I)
VISIBLE_MARK = re.compile(r"\u2705|\u2714|\(correct\)|\u2190\s*correct", re.I)
# One answer at the end: "**Question 2: B)** ...", "2. b) ...", "Q2: (B) ...", "- 2. B - ..."
_NUMBER = r"^\s*(?:[-*+]\s+)?(?:\*\*)?\s*(?:Q(?:uestion)?\s*)?(\d+)\s*[.):]?\s*(?:\*\*)?\s*"
_LETTER = r"(?:\*\*)?\s*\(?([A-Ha-h])(?:[).:]|\s*$|\s+[-\u2013\u2014]\s+)(.*)$"
KEY_ENTRY = re.compile(_NUMBER + r"[-:]?\s*" + _LETTER, re.I)
KEY_LABEL = re.compile(_NUMBER + r"$", re.I)  # "Question 2" alone, its answer on the next line
KEY_LETTER = re.compile(r"^\s*" + _LETTER)
TAG = re.compile(r"</?details>|</?summary>", re.I)


@dataclass
class QuestionOutline:
    cell: int
    question: str
    options: list[str]
    answer: int | None  # option index, None if the notebook gives none
    why: str
    under: bool = False  # an answer sits under the question (ticked, or in a <details> block there)


def read_quiz(parts: list[tuple[int, str]], answer_parts: list[tuple[int, str]] = ()
              ) -> tuple[list[QuestionOutline], int | None]:
    """The questions of the quiz's markdown, given as (cell index, text) without the "## Quiz" heading,
    with their answers from `answer_parts` (the Answers section, heading included) or from an
    "Answers:" key inside the quiz; and the cell where the answers start, if anywhere."""
    lines, key = [], []  # (cell, line)
    key_cell = None
    for cell, text in parts:
        for line in text.splitlines():
            if key_cell is None and _opens_key(line):
                key_cell = cell
                continue
            (key if key_cell is not None else lines).append((cell, line))
    for cell, text in answer_parts:
        key_cell = cell if key_cell is None else key_cell
        key += [(cell, line) for line in text.splitlines() if not _opens_key(line)]
    questions: list[tuple[int, list[str]]] = []
    for cell, line in lines:
        text = HEADING.sub(lambda m: m.group(2), line) if HEADING.match(line) else line
        m = QUESTION_START.match(text.strip()) if not line.startswith((" ", "\t")) else None
        if m and not OPTION.match(line):
            questions.append((cell, [m.group(2)]))
        elif questions:
            questions[-1][1].append(line)
    answers = read_key([line for _, line in key])
    return [_question(cell, qlines, answers.get(n)) for n, (cell, qlines) in enumerate(questions, 1)], key_cell


def _opens_key(line: str) -> bool:
    return bool(ANSWER_KEY.match(line) or (HEADING.match(line) and re.search(r"\banswers?\b", line, re.I)))


def read_key(lines: list[str]) -> dict[int, tuple[int, str]]:
    """Question number -> (option index, the text after the letter) from an answer key's lines; an
    entry goes on over the lines below it up to the next one."""
    entries: dict[int, list] = {}
    current, label = None, None
    for raw in lines:
        line = TAG.sub("", raw)
        m = KEY_ENTRY.match(line)
        if label is not None and not m:
            m2 = KEY_LETTER.match(line)
            if m2:
                current = entries.setdefault(label, ["ABCDEFGH".index(m2.group(1).upper()), [m2.group(2)]])
                label = None
                continue
        if m:
            current = entries.setdefault(int(m.group(1)), ["ABCDEFGH".index(m.group(2).upper()), [m.group(3)]])
            label = None
        elif KEY_LABEL.match(line) and line.strip():
            label, current = int(KEY_LABEL.match(line).group(1)), None
        elif current is not None:
            current[1].append(line)
    return {n: (index, "\n".join(text).strip()) for n, (index, text) in entries.items()}


def _rest_after_option(rest: str, options: list[str], answer: int) -> str:
    """The why: what follows the letter, less the right option's text if it is repeated."""
    rest = rest.lstrip("* ").strip()
    if 0 <= answer < len(options) and rest.lower().startswith(options[answer].lower().rstrip(".")):
        rest = rest[len(options[answer].rstrip(".")):].lstrip(". ")
    return rest.strip()


def _question(cell: int, qlines: list[str], keyed) -> QuestionOutline:
    text = "\n".join(qlines)
    details = re.search(r"<details>(.*?)</details>", text, re.S | re.I)
    outside = text[:details.start()] + text[details.end():] if details else text
    question, options, answer, why, under = [], [], None, "", False
    for line in outside.splitlines():
        m = OPTION.match(line)
        if m:
            if VISIBLE_MARK.search(m.group(2)) and answer is None:
                answer, under = len(options), True
            options.append(VISIBLE_MARK.sub("", m.group(2)).strip())
        elif not options and line.strip():
            question.append(line.strip())
    if details:
        inner = re.sub(r"<summary>.*?</summary>", "", details.group(1), flags=re.S | re.I).strip()
        m = re.search(r"\(?\b([A-H])\)", inner)
        if m:
            answer, under = "ABCDEFGH".index(m.group(1)), True
            why = _rest_after_option(inner[m.end():], options, answer)
    if keyed is not None:  # the answer at the end is the one the format reads
        answer = keyed[0]
        why = _rest_after_option(keyed[1], options, answer)
    q = " ".join(question).strip().strip("*").strip()
    q = re.sub(r"^\*\*|\*\*$", "", q).strip()
    return QuestionOutline(cell, q, options, answer, why, under)
