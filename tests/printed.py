"""Lines a notebook must print, compared the way the figures were made.

A notebook's words and its arithmetic (the planner, the simulator, bytes counted) are the
same on every machine, so a plain string is matched exactly. A figure measured by a training
run (a loss, a share of gradients) is rounded by the CPU's kernels: another vector width sums
in another order and moves the last digits. Such a line is written `Close(line, rel)`: its
words and whole numbers must match exactly, and each decimal number may differ from the one
written by `rel` of itself plus one unit of its last printed digit (the print's own rounding:
5.58115 prints as 5.5811 on one CPU and 5.5812 on the next).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A number as the notebooks print them: an optional sign, thousands commas, decimals, an exponent.
_NUMBER = r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?"
_SPLIT = re.compile(f"({_NUMBER})")


def _value(text: str) -> float:
    return float(text.replace(",", ""))


def _unit(text: str) -> float:
    """One unit of the last printed digit: 5.5812 -> 1e-4; whole numbers and exponents -> 0."""
    mantissa = re.split("[eE]", text)[0]
    if "." not in mantissa or re.search("[eE]", text):
        return 0.0
    return 10.0 ** -len(mantissa.split(".")[1])


@dataclass(frozen=True)
class Close:
    """A printed line whose decimal figures come from a run: equal within `rel` (see the module)."""

    line: str
    rel: float

    def __post_init__(self):
        if not any("." in n for n in _SPLIT.findall(self.line)):
            raise ValueError(f"Close({self.line!r}): no decimal figure to compare; write the plain string")

    def _pattern(self) -> re.Pattern:
        parts = _SPLIT.split(self.line)  # text, number, text, number, ..., text
        return re.compile("".join(re.escape(p) if i % 2 == 0 else f"({_NUMBER})" for i, p in enumerate(parts)))

    def differences(self, printed: str) -> list[list[tuple[str, str]]]:
        """For each printed line of the same words: the (expected, printed) figures that differ too much."""
        expected = _SPLIT.findall(self.line)
        found = []
        for match in self._pattern().finditer(printed):
            wrong = []
            for want, got in zip(expected, match.groups()):
                a, b = _value(want), _value(got)
                if "." not in want:
                    ok = a == b  # a count or a size: exact on every machine
                else:
                    ok = abs(a - b) <= self.rel * abs(a) + _unit(want) * (1 + 1e-9)
                if not ok:
                    wrong.append((want, got))
            found.append(wrong)
        return found

    def is_in(self, printed: str) -> bool:
        return any(not wrong for wrong in self.differences(printed))

    def explain(self, printed: str) -> str:
        found = self.differences(printed)
        if not found:
            return f"no printed line reads like {self.line!r}"
        return f"{self.line!r}: printed figures off by more than rel {self.rel:g}: {found}"


@dataclass(frozen=True)
class ByMachine:
    """A line that follows the machine's kernels (which attention kernel bf16 takes, parallel/precision.py):
    `here` is what this machine prints, `lines` what any machine may print. A notebook's committed
    outputs were printed by the machine that built it, so they hold one of `lines`."""

    here: str
    lines: tuple

    def __post_init__(self):
        if self.here not in self.lines:
            raise ValueError(f"ByMachine: {self.here!r} is not among {self.lines!r}")


def printed_in(expected, printed: str, on_another_machine: bool = False) -> bool:
    if isinstance(expected, ByMachine):
        return any(line in printed for line in expected.lines) if on_another_machine else expected.here in printed
    return expected.is_in(printed) if isinstance(expected, Close) else expected in printed
