"""Grade one answer to one exercise of the course, as the notebook would, without running the notebook.

The corpus of answers (tests/course/test_part*.py) holds, for each exercise, wrong answers a
learner writes and unusual right ones, as source text. `grade(part, k, source)` builds the
namespace a learner's cell runs in, from the part's own episode source (notebooks/src):

1. the notebook's definitions: the imports, functions, classes, constants and aliases at the
   top of its code cells (not the cells' runs, which train models);
2. the reference solutions of this exercise and the ones before it (helpers they define, such
   as Part 10's `pass_along`, and an earlier exercise's answer, are there as in the notebook);
3. the answer, which replaces what it redefines;

then runs the exercise's check cell there. Functions are defined in a `__main__` namespace with
their source kept (linecache), so the check sends them to its pooled ranks as source, exactly as
it sends a notebook's functions. What the check said comes back as a string.
"""

from __future__ import annotations

import ast
import functools
import glob
import importlib.util
import itertools
import linecache
import os
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = os.path.join(ROOT, "notebooks", "src")
PASSED = "PASSED"
_COUNTER = itertools.count()


@functools.lru_cache(maxsize=None)
def episode(part: int):
    """The Episode of notebooks/src/<part>_*.py."""
    (path,) = glob.glob(os.path.join(SOURCES, f"{part}_*.py"))
    spec = importlib.util.spec_from_file_location(f"episode_{part}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EPISODE


def _definition(node) -> bool:
    """A value that only names things: a constant, or aliases such as
    `reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor`
    (no call but getattr: nothing that runs a model)."""
    try:
        ast.literal_eval(node)
        return True
    except ValueError:
        pass
    naming = (ast.Name, ast.Attribute, ast.Constant, ast.BoolOp, ast.boolop, ast.expr_context, ast.keyword)
    return all(isinstance(n, naming) or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                                         and n.func.id == "getattr") for n in ast.walk(node))


@functools.lru_cache(maxsize=None)
def definitions(part: int) -> tuple:
    """The notebook's top-level imports, defs, classes and naming assignments, in order:
    (source, is_assignment) each."""
    keep = []
    for section in episode(part).sections:
        for cell in section.cells:
            if cell.kind != "code":
                continue
            source = "\n".join("pass  # " + line if line.lstrip().startswith(("%", "!")) else line
                               for line in cell.source.splitlines())
            for node in ast.parse(source).body:
                if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
                    keep.append((ast.get_source_segment(source, node), False))
                elif isinstance(node, ast.Assign) and _definition(node.value):
                    keep.append((ast.get_source_segment(source, node), True))
    return tuple(keep)


def _exec(source: str, what: str, namespace: dict) -> None:
    name = f"<{what} {next(_COUNTER)}>"
    source = textwrap.dedent(source).strip() + "\n"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # inspect.getsource works
    exec(compile(source, name, "exec"), namespace)


def namespace(part: int, k: int, source: str) -> dict:
    """The namespace of the notebook's exercise `k` with `source` run in it."""
    ns = {"__name__": "__main__"}
    for source_, assignment in definitions(part):
        try:
            _exec(source_, f"part {part} definitions", ns)
        except (NameError, AttributeError):
            if not assignment:
                raise
            # `smallest = plain.smallest`: a name only the cell's run binds; the answers do without.
    # The notebook runs its exercises in order: exercise 2's cell finds exercise 1's answer defined.
    for i, exercise in enumerate(episode(part).exercises[:k], 1):
        _exec(exercise.solution, f"part {part} exercise {i} solution", ns)
    _exec(source, f"part {part} exercise {k} answer", ns)
    return ns


def grade(part: int, k: int, source: str) -> str:
    """What exercise `k`'s check says of `source`: PASSED, or its AssertionError's message.
    NotImplementedError and any other exception go to the caller."""
    ns = namespace(part, k, source)
    try:
        _exec(episode(part).exercises[k - 1].check, f"part {part} exercise {k} check", ns)
    except AssertionError as e:
        return str(e)
    return PASSED


# ---- the two tests every part's corpus runs (collected in each test_partN_*.py that imports them;
# conftest.py gives them that module's WRONG and RIGHT) ---------------------------------------------

def test_a_wrong_answer_is_rejected_naming_its_mistake(request, wrong):
    k, label, says, source = wrong
    said = grade(request.module.PART, k, source)
    assert said != PASSED, f"{label} passed"
    assert says in said, said


def test_an_unusual_right_answer_passes(request, right):
    k, label, source = right
    assert grade(request.module.PART, k, source) == PASSED
