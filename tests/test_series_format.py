"""The series' format as code: the Episode structure, its notebook, reading it back, and the lint.

No kernels here: everything is static, so these tests are fast. Bad notebooks are
made from a good episode (tests/data/tiny_episode.json) by breaking one rule at a time.
"""

import copy
import dataclasses
import json
import re
import os
import subprocess
import sys

import nbformat
import pytest

from ultrascale.series import episode as E
from ultrascale.series.build import build_notebook, notebook_text
from ultrascale.series.episode import Episode, EpisodeError
from ultrascale.series.lint import lint_file
from ultrascale.series.outline import read_episode
from ultrascale.series.schema import CELL, EPISODE_SCHEMA, EXERCISE, QUESTION, REFERENCE, SECTION

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture
def tiny():
    with open(os.path.join(DATA, "tiny_episode.json")) as f:
        return json.load(f)


def write(tmp_path, name, data_or_nb):
    nb = build_notebook(Episode.from_dict(data_or_nb)) if isinstance(data_or_nb, dict) and "cells" not in \
        data_or_nb else data_or_nb
    path = tmp_path / name
    path.write_text(notebook_text(nb))
    return str(path)


def rules(violations):
    return [v.rule for v in violations]


def ultrascale(*args):
    """The command as a user runs it: its own process, exit status, stdout and stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ultrascale", *args], capture_output=True, text=True, env=env,
                          timeout=120)


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys):
    """The command through ultrascale.cli.main in this process (no interpreter start per call)."""
    from ultrascale.cli import main

    def run(*args):
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


# -- the structure ------------------------------------------------------------
def test_schema_mirrors_the_dataclasses():
    pairs = [(EPISODE_SCHEMA, E.Episode), (SECTION, E.Section), (CELL, E.Cell), (EXERCISE, E.Exercise),
             (QUESTION, E.QuizQuestion), (REFERENCE, E.Reference)]
    for schema, cls in pairs:
        assert set(schema["properties"]) == {f.name for f in dataclasses.fields(cls)}, cls.__name__
        assert set(schema["required"]) <= set(schema["properties"])
    assert EPISODE_SCHEMA["properties"]["exercises"]["minItems"] == 2 == EPISODE_SCHEMA["properties"]["exercises"][
        "maxItems"]
    quiz = EPISODE_SCHEMA["properties"]["quiz"]
    assert (quiz["minItems"], quiz["maxItems"]) == (3, 4)


def test_build_is_a_valid_deterministic_notebook_with_hidden_solutions(tiny):
    tiny["exercises"][0]["hints"] = ["Which function of math sums floats exactly?", "Divide by the count."]
    ep = Episode.from_dict(tiny)
    nb = build_notebook(ep)
    nbformat.validate(nb)
    assert (nb.nbformat, nb.nbformat_minor) == (4, 5)
    assert nb.metadata.kernelspec.name == "python3" and nb.metadata.kernelspec.language == "python"
    ids = [c.id for c in nb.cells]
    assert len(set(ids)) == len(ids)
    assert notebook_text(build_notebook(ep)) == notebook_text(nb)  # same episode, same file
    assert nb.cells[0].source.startswith("# Ultra-Scale Playbook: Part 6 - Averages")
    assert "colab.research.google.com/github/" in nb.cells[0].source
    assert "/notebooks/6_averages.ipynb" in nb.cells[0].source
    # What is in plain sight: every cell, with each collapsed <details> block removed.
    visible = "\n".join(re.sub(r"<details>.*?</details>", "", c.source, flags=re.S) for c in nb.cells)
    for k, ex in enumerate(tiny["exercises"], 1):
        solution_line = ex["solution"].splitlines()[1].strip()  # the line the learner has to write
        assert solution_line not in visible
        hints = next(c for c in nb.cells if c.metadata["ultrascale"].get("role") == "hints"
                     and c.metadata["ultrascale"]["exercise"] == k).source
        blocks = re.findall(r"<summary>(.*?)</summary>(.*?)</details>", hints, flags=re.S)
        # Hints one click at a time, in order, then the solution behind the last click.
        assert [b[0] for b in blocks] == [f"Hint {i}" for i in range(1, len(ex.get("hints", [])) + 1)] + \
            ["Reveal the solution"]
        assert solution_line in blocks[-1][1]
        starters = [c for c in nb.cells if c.metadata["ultrascale"].get("role") == "starter"]
        assert any(c.metadata["ultrascale"]["solution"] == ex["solution"] for c in starters)
    checks = [c for c in nb.cells if c.metadata["ultrascale"].get("role") == "check"]
    for k, c in enumerate(checks, 1):  # the check is defined, then called where a failure only prints
        assert f"def check_exercise_{k}():" in c.source and f"try:\n    check_exercise_{k}()" in c.source
    quiz = [c.source for c in nb.cells if c.metadata["ultrascale"].get("role") == "question"]
    assert len(quiz) == 3 and not any("ReduceOp.SUM is the default." in q or "<details>" in q for q in quiz)


def test_the_answers_are_together_at_the_end_of_the_notebook(tiny):
    nb = build_notebook(Episode.from_dict(tiny))
    roles = [c.metadata["ultrascale"]["role"] for c in nb.cells]
    assert roles[-5:] == ["quiz", "question", "question", "question", "answers"]  # the questions, then the answers
    answers = nb.cells[-1].source
    assert answers.startswith("## Answers\n")
    # Each answer: the question's number, the letter, the option's text and the why, in order.
    assert re.findall(r"^\*\*Question (\d): ([A-H])\)\*\* (.*)$", answers, flags=re.M) == [
        ("1", "A", "The sum over all ranks. ReduceOp.SUM is the default."),
        ("2", "B", "4. The sum has one term per rank."),
        ("3", "A", "3. 12 / 4 = 3."),
    ]


def test_a_built_notebook_reads_back_into_the_same_episode(tiny):
    ep = Episode.from_dict(tiny)
    back = read_episode(json.loads(notebook_text(build_notebook(ep))), "6_averages.ipynb")
    assert back == ep


def test_edits_made_in_the_notebook_flow_back(tiny):
    nb = build_notebook(Episode.from_dict(tiny))
    check = next(c for c in nb.cells if c.metadata["ultrascale"].get("role") == "check")
    check.source = check.source.replace("got = average(", "got = average(  ")
    back = read_episode(nb)
    assert back.exercises[0].check.startswith("got = average(  [1.0")


def test_from_dict_takes_what_models_send(tiny):
    d = copy.deepcopy(tiny)
    d["number"] = "6"
    d["title"] = "Ultra-Scale Playbook: Part 6 - Averages"
    d["quiz"][0]["answer"] = "A"
    d["quiz"][1]["options"] = ["A) 2", "B) 4", "C) 16"]
    d["quiz"][1]["answer"] = "B) 4"
    d["quiz"][2]["answer"] = "3"  # the text of an option
    d["exercises"][0]["starter"] = d["exercises"][0]["starter"].splitlines(keepends=True)
    ep = Episode.from_dict({"episode": d})
    assert ep.number == 6 and ep.title == "Averages"
    assert [q.answer for q in ep.quiz] == [0, 1, 0]
    assert ep.quiz[1].options == ["2", "4", "16"]
    assert ep.exercises[0].starter == tiny["exercises"][0]["starter"]


@pytest.mark.parametrize("breakage, message", [
    (lambda d: d["exercises"][1].pop("check"), "exercises[1].check is missing"),
    (lambda d: d.update(overview="one string"), "overview must be a list"),
    (lambda d: d["quiz"][0].update(answer=7), "quiz[0].answer is 7 but there are 3 options"),
    (lambda d: d["sections"][0]["cells"][0].update(kind="raw"), "sections[0].cells[0].kind must be"),
    (lambda d: d.update(number="six"), "number must be an integer"),
])
def test_from_dict_names_the_field_it_cannot_use(tiny, breakage, message):
    breakage(tiny)
    with pytest.raises(EpisodeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Episode.from_dict(tiny)


# -- the lint -------------------------------------------------------------------
def test_a_conforming_notebook_has_no_violations(tiny, tmp_path, cli):
    path = write(tmp_path, "6_averages.ipynb", tiny)
    assert lint_file(path) == []
    r = cli("notebook", "check", path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == f"{path}: ok"


def _third_exercise(d):
    d["exercises"].append(copy.deepcopy(d["exercises"][0]))


def _fifth_question(d):
    d["quiz"] += copy.deepcopy(d["quiz"][:2])


def _cuda(d):
    d["sections"][0]["cells"].append({"kind": "code", "source": "import torch\nx = torch.ones(2).cuda()"})


def _one_letter(d):
    """Question 2's right option moved to A, where questions 1 and 3 have theirs."""
    q = d["quiz"][1]
    q["options"] = [q["options"][q["answer"]]] + [o for i, o in enumerate(q["options"]) if i != q["answer"]]
    q["answer"] = 0


@pytest.mark.parametrize("name, breakage, rule", [
    ("6_averages.ipynb", _third_exercise, "exercises"),
    ("6_averages.ipynb", _fifth_question, "quiz"),
    ("6_averages.ipynb", lambda d: d.update(quiz=d["quiz"][:2]), "quiz"),
    ("5_x.ipynb", lambda d: d.update(number=4), "title-number"),
    ("6_averages.ipynb", _cuda, "accelerator"),
    ("6_averages.ipynb", lambda d: d["sections"][0]["cells"].append(
        {"kind": "code", "source": "import torch.distributed as dist\ndist.init_process_group('nccl')"}),
     "accelerator"),
    ("6_averages.ipynb", lambda d: d["sections"][0]["cells"].append(
        {"kind": "code", "source": "import torch\nx = torch.zeros(2, device='cuda')"}), "accelerator"),
    ("6_averages.ipynb", lambda d: d["exercises"][0].update(starter=d["exercises"][0]["solution"]),
     "solution-visible"),
    ("6_averages.ipynb", lambda d: d["exercises"][1].update(
        starter=d["exercises"][1]["solution"] + "\n# TODO: nothing left to do"), "solution-visible"),
    ("6_averages.ipynb", lambda d: d["exercises"][0].update(
        instructions="Write it like this:\n\n```python\ndef average(values):\n    return math.fsum(values) / "
                     "len(values)\n```"), "solution-visible"),
    ("6_averages.ipynb", lambda d: d["exercises"][0].update(solution=""), "exercise-solution"),
    ("6_averages.ipynb", lambda d: d["exercises"][0].update(check="assert 1 + 1 == 2, 'arithmetic'"),
     "exercise-check"),
    ("6_averages.ipynb", lambda d: d["sections"][0]["cells"].append(
        {"kind": "code", "source": "t = torch.ones(3)"}), "imports"),
    ("6_averages.ipynb", lambda d: d["sections"][0]["cells"].append(
        {"kind": "code", "source": "def broken(:\n    pass"}), "syntax"),
    ("6_averages.ipynb", lambda d: d["sections"][0]["cells"].append(
        {"kind": "code", "source": "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                                   "model = DDP(torch.nn.Linear(2, 2))"}), "process-group"),
    ("6_averages.ipynb", lambda d: d["quiz"][1].update(why=""), "quiz-answer"),
    ("6_averages.ipynb", lambda d: d["quiz"][2].update(options=["3"], answer=0), "quiz-answer"),
    ("6_averages.ipynb", _one_letter, "quiz-answer"),
    ("6_averages.ipynb", lambda d: d.update(overview=["only one bullet"]), "overview"),
    ("6_Averages.ipynb", lambda d: None, "file-name"),
    ("6-averages.ipynb", lambda d: None, "file-name"),
])
def test_each_broken_rule_is_named(tiny, tmp_path, name, breakage, rule):
    breakage(tiny)
    found = lint_file(write(tmp_path, name, tiny))
    assert rule in rules(found), [v.line() for v in found]
    # Breaking one rule breaks nothing else.
    assert set(rules(found)) == {rule}, [v.line() for v in found]


def test_every_answer_at_one_letter_is_named(tiny, tmp_path):
    _one_letter(tiny)
    found = [v.message for v in lint_file(write(tmp_path, "6_averages.ipynb", tiny))]
    assert found == ["every question's answer is A); put the right options at different letters"]


def _answers_under_questions(nb):
    """The layout the format replaced: each answer in a <details> block under its question, none at the end."""
    answers = [c for c in nb.cells if c.metadata["ultrascale"].get("role") == "answers"][0]
    lines = re.findall(r"^\*\*Question \d: (.*)$", answers.source, flags=re.M)
    nb.cells.remove(answers)
    questions = [c for c in nb.cells if c.metadata["ultrascale"].get("role") == "question"]
    for c, line in zip(questions, lines):
        c.source += f"\n\n<details>\n<summary>Answer</summary>\n\n**{line}\n\n</details>"
    return nb


def _quiz_lines(tmp_path, nb):
    found = lint_file(write(tmp_path, "6_averages.ipynb", nb))
    assert set(rules(found)) == {"quiz-answer"}, [v.line() for v in found]
    return [v.line() for v in found]


def test_an_answer_under_its_question_is_one_line_per_question(tiny, tmp_path):
    nb = _answers_under_questions(build_notebook(Episode.from_dict(tiny)))
    lines = _quiz_lines(tmp_path, nb)
    assert len(lines) == 3
    for i, line in enumerate(lines, 1):
        assert f"quiz-answer: question {i}'s answer is under the question; the answers go together at the end " \
               f"of the notebook: move it to the '## Answers' section after the last question" in line
    assert read_episode(nb) == Episode.from_dict(tiny)  # still read, wherever the answers are


def test_a_missing_answer_is_named(tiny, tmp_path):
    nb = build_notebook(Episode.from_dict(tiny))
    nb.cells[-1].source = re.sub(r"\n\n\*\*Question 2: .*", "", nb.cells[-1].source)
    end = len(nb.cells) - 1
    assert _quiz_lines(tmp_path, nb) == [
        f"{tmp_path / '6_averages.ipynb'}: cell {end}: quiz-answer: question 2 has no answer in the answers at "
        f"the end; add it: the letter, the option and a one-line why"]


def test_no_answers_at_all_is_one_line(tiny, tmp_path):
    nb = build_notebook(Episode.from_dict(tiny))
    nb.cells.pop()
    [line] = _quiz_lines(tmp_path, nb)
    assert "the quiz has no answers at the end; after the last question add '## Answers'" in line


@pytest.mark.parametrize("move", ["before the last question", "a cell after them"])
def test_answers_not_at_the_end_are_one_line(tiny, tmp_path, move):
    nb = build_notebook(Episode.from_dict(tiny))
    if move == "before the last question":
        nb.cells.insert(len(nb.cells) - 2, nb.cells.pop())
        after = len(nb.cells) - 1
    else:
        nb.cells.append(nbformat.v4.new_markdown_cell("## Summary\n\nWhat we saw."))
        after = len(nb.cells) - 1
    [line] = _quiz_lines(tmp_path, nb)
    assert f"the answers are not at the end of the notebook: cell {after} comes after them" in line


def test_a_hand_written_answer_key_at_the_end_is_read(tmp_path):
    v4 = nbformat.v4
    nb = v4.new_notebook(cells=[
        v4.new_markdown_cell("# Ultra-Scale Playbook: Part 6 - Averages"),
        v4.new_markdown_cell("## Quiz\n\n1. What does all_reduce compute?\n   a) A max\n   b) A sum\n\n"
                             "2. How many ranks?\n   a) 2\n   b) 4"),
        v4.new_markdown_cell("## Answers\n\n1. b) A sum. SUM is the default.\n\n"
                             "<details>\n<summary>Question 2</summary>\n\nA) 2. Two were started.\n\n</details>"),
    ])
    ep = read_episode(nb)
    assert [(q.answer, q.why) for q in ep.quiz] == [(1, "SUM is the default."), (0, "Two were started.")]


def test_collectives_run_through_on_ranks_need_no_process_group_in_the_kernel(tiny, tmp_path):
    # on_ranks(world, fn) runs fn on gloo processes where torch.distributed is initialised.
    tiny["sections"][0]["cells"].append({"kind": "code", "source": (
        "import torch\nimport torch.distributed as dist\nfrom ultrascale.series.ranks import on_ranks\n\n\n"
        "def total():\n    t = torch.ones(1)\n    dist.all_reduce(t)\n    return t.item()\n\n\n"
        "print(on_ranks(2, total))")})
    assert "process-group" not in rules(lint_file(write(tmp_path, "6_averages.ipynb", tiny)))


def test_gpu_code_is_allowed_where_the_notebook_says_so(tiny, tmp_path):
    guarded = copy.deepcopy(tiny)
    guarded["sections"][0]["cells"].append({"kind": "code", "source": (
        "import torch\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\nx = torch.ones(2, device=device)\n"
        "if torch.cuda.is_available():\n    x = x.cuda()\n    torch.cuda.synchronize()\n"
        "print('on a cluster: cuda and nccl')")})
    tagged = copy.deepcopy(tiny)
    tagged["sections"][0]["cells"].append({"kind": "code", "needs_gpu": True,
                                           "source": "import torch\nx = torch.ones(2).cuda()"})
    declared = copy.deepcopy(tiny)
    _cuda(declared)
    declared["needs_accelerator"] = True
    for d in (guarded, tagged, declared):
        assert lint_file(write(tmp_path, "6_averages.ipynb", d)) == []


def test_missing_overview_title_and_quiz_in_a_hand_written_notebook(tmp_path):
    v4 = nbformat.v4
    nb = v4.new_notebook(cells=[
        v4.new_markdown_cell("# Data parallelism notes\n\nSome words about replicas and gradients, at length."),
        v4.new_code_cell("import torch\nprint(torch.ones(2))"),
    ])
    found = lint_file(write(tmp_path, "4_notes.ipynb", nb))
    assert {"title", "overview", "exercises", "quiz"} <= set(rules(found))
    title = next(v for v in found if v.rule == "title")
    assert title.cell == 0 and "# Ultra-Scale Playbook: Part N" in title.message


def test_unreadable_notebook_is_one_nbformat_violation(tmp_path):
    bad = tmp_path / "4_broken.ipynb"
    bad.write_text("{ not json")
    assert rules(lint_file(str(bad))) == ["nbformat"]


def test_check_command_names_every_rule_broken_one_line_each(tiny, tmp_path, cli):
    three = copy.deepcopy(tiny)
    _third_exercise(three)
    five = copy.deepcopy(tiny)
    _fifth_question(five)
    part4 = copy.deepcopy(tiny)
    part4["number"] = 4
    paths = [write(tmp_path, "6_three.ipynb", three), write(tmp_path, "6_five.ipynb", five),
             write(tmp_path, "5_x.ipynb", part4)]
    r = cli("notebook", "check", *paths)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.strip().splitlines()
    assert any(line.startswith(f"{paths[0]}: cell ") and ": exercises: " in line for line in lines)
    assert any(line.startswith(f"{paths[1]}: cell ") and ": quiz: " in line for line in lines)
    assert any(line.startswith(f"{paths[2]}: cell 0: title-number: ") for line in lines)
    j = cli("notebook", "check", "--json", *paths)
    assert j.returncode == 1
    found = json.loads(j.stdout)
    assert len(found) == len(lines)  # one line per violation
    assert {(v["file"], v["rule"]) for v in found} == {(paths[0], "exercises"), (paths[1], "quiz"),
                                                       (paths[2], "title-number")}
    assert all(set(v) == {"file", "cell", "rule", "message"} for v in found)


def test_check_command_bad_input_is_one_line_exit_2(tmp_path):
    r = ultrascale("notebook", "check", str(tmp_path / "9_missing.ipynb"))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_a_directory_stands_for_the_notebooks_in_it(tiny, tmp_path, cli):
    three = copy.deepcopy(tiny)
    _third_exercise(three)
    d = tmp_path / "series"
    d.mkdir()
    good, bad = write(d, "6_averages.ipynb", tiny), write(d, "10_three.ipynb", three)
    write(d, "6_averages.rejected.ipynb", three)  # kept by the generator with its reasons: not checked
    (d / ".ipynb_checkpoints").mkdir()
    write(d / ".ipynb_checkpoints", "6_averages-checkpoint.ipynb", three)  # Jupyter's copies: not its own
    (d / "notes.txt").write_text("not a notebook")
    r = cli("notebook", "check", str(d))
    assert r.returncode == 1, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == f"{good}: ok" and all(line.startswith(f"{bad}: cell ") for line in lines[:-1]), lines
    r = cli("notebook", "check", "--json", str(d), good)  # a directory and a file together
    assert {v["file"] for v in json.loads(r.stdout)} == {bad}
    # run and grade expand it the same way: here to a file that is not a notebook (no kernel starts).
    (d / "7_broken.ipynb").write_text("{ not json")
    for command in ("run", "grade"):
        r = cli("notebook", command, str(d))
        assert r.returncode == 2 and f"{d}/7_broken.ipynb is not a readable notebook" in r.stderr, r.stderr


def test_a_directory_without_notebooks_is_one_line_exit_2(tmp_path, cli):
    (tmp_path / "empty").mkdir()
    r = ultrascale("notebook", "check", str(tmp_path / "empty"))  # as a user meets it: its own process
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{tmp_path / 'empty'} is a directory with no notebook (*.ipynb) in it: give notebook files" in r.stderr
    for command in ("run", "grade"):
        r = cli("notebook", command, str(tmp_path / "empty"))
        assert r.returncode == 2 and "is a directory with no notebook (*.ipynb) in it" in r.stderr, r.stderr
    r = cli("notebook", "build", "--solved", str(tmp_path), "-o", str(tmp_path / "out.ipynb"))
    assert r.returncode == 2 and f"{tmp_path} is a directory: give one notebook file in it" in r.stderr, r.stderr
