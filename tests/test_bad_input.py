"""Bad input, drawn rather than listed: every flag of `ultrascale train` and every key of its
TOML file, given a value it cannot take, is refused before any work starts: exit 2, at most
three lines, no traceback, nothing created. So is every number and every named mode of the
other commands (`plan`, `plan memory`, `pp-schedule`, `peak`, `notebook run`, `notebook grade`).

The flags are read from the command's own parser, so a flag added tomorrow is drawn too.
Hypothesis draws which flags, how many at once (1-3), and the wrong values from a class of
wrongness per flag type: text that is no number, a non-finite or negative number, a name
that is none of the choices, a path that does not exist or cannot be written. The run
itself is replaced by a stop that fails the case: a drawn value that is accepted shows as
"it would have run". `ULTRASCALE_BAD_INPUT_EXAMPLES=5000 pytest tests/test_bad_input.py`
draws more (benchmarks/fuzz_bad_input.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ultrascale.cli as cli
import ultrascale.distributed.launch as launch
from ultrascale.errors import positive_number
from ultrascale.config import ModelConfig, ParallelConfig, TrainConfig

EXAMPLES = int(os.environ.get("ULTRASCALE_BAD_INPUT_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# String flags by what their value names. A path that must exist, one the run writes, or a
# name from a closed set; anything else must be listed here with the reason it has no wrong value.
INPUTS = {"--config", "--data", "--tokenizer", "--resume", "--init-from"}
OUTPUTS = {"--save", "--log-jsonl", "--pp-trace", "--profile", "--tensorboard", "--offload-dir"}
ANY_TEXT = {
    "--data-column": "a column of a Hugging Face dataset: any name may be one, checked when the dataset loads",
    "--data-split": "a split of a Hugging Face dataset: likewise",
}
# Flags that only make sense with another one; given alone they are refused for that reason,
# which is a refusal too: they are drawn like the others.


def _train_actions():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["train"]._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


ACTIONS = _train_actions()
VALUED = [a for a in ACTIONS if a.nargs != 0 and a.const is None]  # flags that take a value

NOT_A_NUMBER = st.sampled_from(["ten", "", "1,5", "0x10", "--", "1e", "½"]) | st.text(
    alphabet=st.characters(categories=["L", "P"]), min_size=1, max_size=6)
NOT_AN_INT = NOT_A_NUMBER | st.sampled_from(["1.5", "2e3", "nan"])
BAD_FLOAT = NOT_A_NUMBER | st.sampled_from(["nan", "inf", "-inf", "-1", "-0.5", "1e400"])
BAD_INT = NOT_AN_INT | st.integers(max_value=-1).map(str)
NOT_A_CHOICE = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_0123456789", min_size=1, max_size=12).map(
    lambda s: "x-" + s)  # no preset, schedule, dtype or mode begins so


def _wrong_value(action, where):
    """A strategy of values this flag cannot take."""
    flag = action.option_strings[0]
    if action.type is int:
        return BAD_INT
    if action.type in (float, positive_number):
        return BAD_FLOAT
    if flag in INPUTS:
        return st.sampled_from(["missing", "missing/deeper", "hf:missing"]).map(lambda p: _under(where, p))
    if flag in OUTPUTS:  # under a regular file: no directory can be made there
        return st.sampled_from(["a-file/x", "a-file/x/y"]).map(lambda p: _under(where, p))
    return NOT_A_CHOICE


def _under(where, path):
    prefix = "hf:" if path.startswith("hf:") else ""
    return prefix + os.path.join(where, path.removeprefix("hf:"))


class WouldRun(Exception):
    pass


@pytest.fixture
def no_runs(monkeypatch):
    def stop(*_, **__):
        raise WouldRun

    monkeypatch.setattr(cli, "_train_here", stop)
    monkeypatch.setattr(launch, "launch_local", stop)


def _run(args):
    """(exit status, stderr lines) of `ultrascale ARGS` in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(args)
        except SystemExit as e:  # argparse's own refusals
            code = e.code
    return code, err.getvalue().strip().splitlines()


def _assert_refused(args, where, before):
    try:
        code, lines = _run(args)
    except WouldRun:
        pytest.fail(f"`ultrascale {' '.join(args)}`: accepted, it would have run")
    except Exception as e:  # noqa: BLE001 - a traceback is the defect this test looks for
        pytest.fail(f"`ultrascale {' '.join(args)}`: {type(e).__name__}: {e}")
    assert code == 2, (args, code, lines)
    assert 1 <= len(lines) <= 3 and not any("Traceback" in x for x in lines), (args, lines)
    assert sorted(os.listdir(where)) == before, (args, "created", set(os.listdir(where)) - set(before))


def test_every_string_flag_has_a_class_of_wrong_values():
    # A new string flag must say what its wrong values are: a path in, a path out, a choice, or why none.
    for a in VALUED:
        flag = a.option_strings[0]
        if a.type not in (int, float):
            assert flag in INPUTS | OUTPUTS | set(ANY_TEXT) or a.type in (None, str), flag


@pytest.fixture
def where(tmp_path):
    (tmp_path / "a-file").write_text("")
    return str(tmp_path)


@SETTINGS
@given(data=st.data())
def test_wrong_flag_values_are_one_line_before_any_work(data, where, no_runs):
    drawable = [a for a in VALUED if a.option_strings[0] not in ANY_TEXT]
    chosen = data.draw(st.lists(st.sampled_from(drawable), min_size=1, max_size=3, unique_by=id), label="flags")
    args = ["train"]
    for a in chosen:
        args += [a.option_strings[0], data.draw(_wrong_value(a, where), label=a.option_strings[0])]
    _assert_refused(args, where, sorted(os.listdir(where)))


OFFLOAD = ["train", "--dp", "2", "--nproc", "2", "--zero", "1"]


@pytest.mark.parametrize("args,says", [
    (["--offload", "disk", "--offload-dir", "a-file"], "is not a directory"),
    (["--offload", "disk", "--offload-dir", "a-file/x"], "is a file, not a directory"),
    (["--offload", "disk"], "add --offload-dir DIR"),
    (["--offload-dir", "states"], "add --offload disk"),
    (["--offload", "gpu"], "must be none, cpu or disk"),
], ids=["dir-is-a-file", "under-a-file", "no-dir", "dir-without-disk", "unknown-tier"])
def test_offload_mistakes_are_one_line(args, says, where, no_runs):
    args = [os.path.join(where, a) if a.startswith(("a-file", "states")) else a for a in args]
    _assert_refused(OFFLOAD + args, where, sorted(os.listdir(where)))
    assert says in _run(OFFLOAD + args)[1][0]


def test_offload_without_zero_is_one_line(where, no_runs):
    _assert_refused(["train", "--dp", "2", "--nproc", "2", "--offload", "cpu"], where, sorted(os.listdir(where)))


def test_an_offload_dir_without_room_for_the_states_is_one_line(where, no_runs, monkeypatch):
    # The tiny model's states are 12 bytes x 106,944 parameters = 1.2 MiB; the disk says 1 MiB is free.
    import shutil

    from ultrascale import preflight

    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 2**40, 2**20))
    args = OFFLOAD + ["--offload", "disk", "--offload-dir", os.path.join(where, "states")]
    _assert_refused(args, where, sorted(os.listdir(where)))
    line = _run(args)[1][0]
    assert "the optimizer states need 1.2 MiB and" in line and "has 1.0 MiB free" in line, line


# -- the TOML file ----------------------------------------------------------------
SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}
WRONG_TYPE = {  # TOML values of another type than the field's
    "int": st.sampled_from(['"4"', "4.5", "true", "[4]", "{ n = 4 }", "1979-05-27"]),
    "float": st.sampled_from(['"0.5"', "true", "[0.5]", "{ x = 1 }", "12:30:00"]),
    "str": st.sampled_from(["4", "0.5", "true", '["x"]', "{ name = \"x\" }"]),
    "bool": st.sampled_from(["1", "0", '"true"', "[true]", "1.0"]),
}


def _keys():
    from dataclasses import fields

    out = [(section, f.name, f.type) for section, cls in SECTIONS.items() for f in fields(cls)]
    return out + [("model", "preset", "str")]


KEYS = _keys()


@SETTINGS
@given(data=st.data())
def test_wrong_toml_types_are_one_line_naming_the_key(data, where, no_runs):
    section, key, typ = data.draw(st.sampled_from(KEYS), label="key")
    value = data.draw(WRONG_TYPE[typ], label="value")
    path = os.path.join(where, "run.toml")
    with open(path, "w") as f:
        f.write(f"[{section}]\n{key} = {value}\n")
    before = sorted(os.listdir(where))
    _assert_refused(["train", "--config", path], where, before)
    code, lines = _run(["train", "--config", path])
    assert f"[{section}] {key} = " in lines[0] and "it takes" in lines[0], lines


def test_a_wrong_type_in_toml_is_refused_in_a_real_process(tmp_path):
    from ultrascale.testing.cli import ultrascale

    (tmp_path / "bad.toml").write_text('[train]\nsteps = "ten"\n')
    r = ultrascale("train", "--config", str(tmp_path / "bad.toml"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f'ultrascale: error: --config {tmp_path / "bad.toml"}: [train] steps = "ten" is a '
                                f'string; it takes an integer, e.g. 4')


# -- the other commands -----------------------------------------------------------
# Each command with a valid command line of its own, so that the drawn flag is the only thing wrong,
# and the work it would start replaced by a stop (a drawn value that is accepted shows as "it would
# have run"). The flags drawn: every flag that takes a number, and the ones that name a preset or a
# mode; paths in and out are the train test's (the same checks, preflight.py).
NAMES = {"--model", "--gpu", "--cluster", "--framework", "--schedule", "--precision", "--dtype", "--device",
         "--recompute", "--cp-attention", "--kernels", "--attention", "--block", "--partition"}
COMMANDS = {  # command -> the valid rest of its command line ("NB": a notebook of the series)
    ("pp-schedule",): [],
    ("plan",): ["--model", "llama3-8b", "--gpus", "8"],
    ("plan", "memory"): ["--model", "llama3-8b"],
    ("peak",): [],
    ("notebook", "run"): ["NB"],
    ("notebook", "grade"): ["NB"],
}


def _command_actions():
    parser, out = cli.build_parser(), []
    for path in COMMANDS:
        p = parser
        for name in path:
            p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        out += [(path, a) for a in p._actions if a.option_strings and a.nargs != 0 and a.const is None
                and not isinstance(a, argparse._HelpAction)
                and (a.type in (int, float, positive_number) or a.choices or a.option_strings[0] in NAMES)]
    return out


COMMAND_ACTIONS = _command_actions()


@pytest.fixture
def no_work(monkeypatch):
    import ultrascale.series.execute as execute
    import ultrascale.train.peak as peak

    def stop(*_, **__):
        raise WouldRun

    for module, name in ((execute, "run_notebook"), (execute, "grade_notebook"), (peak, "measure")):
        monkeypatch.setattr(module, name, stop)


def test_the_other_commands_have_flags_to_draw():
    drawn = {(path, a.option_strings[0]) for path, a in COMMAND_ACTIONS}
    assert {(("pp-schedule",), "--t-comm"), (("plan",), "--cluster"), (("plan", "memory"), "--zero"),
            (("peak",), "--size"), (("notebook", "run"), "--timeout")} <= drawn


@SETTINGS
@given(data=st.data())
def test_wrong_values_of_the_other_commands_are_one_line_before_any_work(data, where, no_work):
    path, action = data.draw(st.sampled_from(COMMAND_ACTIONS), label="flag")
    flag = action.option_strings[0]
    if action.type is int:
        value = data.draw(BAD_INT, label=flag)
    elif action.type in (float, positive_number):
        value = data.draw(BAD_FLOAT, label=flag)
    else:
        value = data.draw(NOT_A_CHOICE, label=flag)
    notebook = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks",
                            "1_scaling_basics.ipynb")
    rest = [notebook if x == "NB" else x for x in COMMANDS[path]]
    _assert_refused([*path, *rest, flag, value], where, sorted(os.listdir(where)))
