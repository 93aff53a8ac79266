"""The corpus itself: a file per part, and for each of the course's 32 exercises at least 6 wrong
answers (each with what the check must say of it) and 2 unusual right ones."""

import glob
import importlib.util
import os
from collections import Counter

import pytest

from answers import SOURCES, episode

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = sorted(int(os.path.basename(p).split("_")[0]) for p in glob.glob(os.path.join(SOURCES, "[0-9]*_*.py")))


def corpus(part: int):
    (path,) = glob.glob(os.path.join(HERE, f"test_part{part}_*.py"))
    spec = importlib.util.spec_from_file_location(f"corpus_{part}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("part", PARTS)
def test_every_exercise_has_six_wrong_answers_and_two_unusual_right_ones(part):
    module = corpus(part)
    assert module.PART == part
    exercises = range(1, len(episode(part).exercises) + 1)
    wrong, right = Counter(w[0] for w in module.WRONG), Counter(r[0] for r in module.RIGHT)
    for k in exercises:
        assert wrong[k] >= 6, f"Part {part} exercise {k}: {wrong[k]} wrong answers"
        assert right[k] >= 2, f"Part {part} exercise {k}: {right[k]} right answers"
    assert set(wrong) | set(right) <= set(exercises)
    for k, label, says, _ in module.WRONG:
        assert says.strip(), f"Part {part} {label!r}: no words the check must say"
    labels = [w[1] for w in module.WRONG] + [r[1] for r in module.RIGHT]
    assert len(labels) == len(set(labels)), [x for x, n in Counter(labels).items() if n > 1]


def test_the_course_has_sixteen_parts_of_two_exercises():
    assert PARTS == list(range(1, 17))
    assert all(len(episode(p).exercises) == 2 for p in PARTS)
