"""One vocabulary: `train` and `plan` take the same names for the same things, a global batch in
sequences, --help in the TOML file's groups, and a refused value answered with our name for it.

The pairs are generated from the two tables that define them (cli.ALIASES, plan/cli.TRAIN_NAMES,
config.SYNONYMS), so a name added to one side without the other fails here.
"""

from __future__ import annotations


import pytest

from ultrascale.cli import ALIASES, HELP_GROUPS, TRAIN_FLAGS, build_parser, help_group, parse_train_config
from ultrascale.config import SYNONYMS, ConfigError, RunConfig, TrainConfig, ParallelConfig, validate
from ultrascale.plan.cli import TRAIN_NAMES
from ultrascale.testing.cli import ultrascale as forked_ultrascale

VALUES = {"--dtype": "bf16", "--fp8": None, "--pp-schedule": "interleaved", "--pp-chunks": "2",
          "--moe-ffn-hidden": "32", "--nproc": "2"}


def train_config(*args):
    return parse_train_config(build_parser().parse_args(["train", *args]))[0]


@pytest.mark.parametrize("flag,alias", [(f, a) for f, names in ALIASES.items() for a in names])
def test_train_takes_plans_name_for_the_same_setting(flag, alias):
    value = [VALUES[flag]] if VALUES[flag] is not None else []
    assert train_config(alias, *value) == train_config(flag, *value)
    assert train_config(alias, *value) != train_config()


def test_the_two_commands_name_the_same_things_alike():
    """Every train flag with a plan spelling is taken by plan under both names, and the reverse."""
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    plan_flags = {o for a in plan._actions for o in a.option_strings}
    for ours, theirs in ((f, a) for f, names in ALIASES.items() for a in names):
        assert theirs in TRAIN_NAMES and TRAIN_NAMES[theirs] == ours
        assert {ours, theirs} <= plan_flags, (ours, theirs)
    assert {"--sp", "--no-sp", "--global-batch", "--fp8", "--no-fp8"} <= plan_flags


def run_cli(*args):
    # a process of its own, forked from a server that imported torch once (testing/cli.py)
    return forked_ultrascale(*args, timeout=120)


def test_plan_reads_trains_names_to_the_same_plan():
    base = ["plan", "memory", "--model", "llama3-8b", "--tp", "2", "--pp", "2", "--micro-batch", "1", "--grad-accum", "4",
            "--json"]
    a = run_cli(*base, "--precision", "bf16", "--schedule", "interleaved", "--chunks", "2", "--no-float8")
    b = run_cli(*base, "--dtype", "bf16", "--pp-schedule", "interleaved", "--pp-chunks", "2", "--no-fp8")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert a.stdout == b.stdout


def test_plans_global_batch_in_sequences_is_its_tokens():
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "4096", "--top", "1", "--json"]
    a = run_cli(*base, "--global-batch", "256")
    b = run_cli(*base, "--global-batch-tokens", str(256 * 4096))
    assert a.returncode == 0 and a.stdout == b.stdout
    both = run_cli(*base, "--global-batch", "256", "--global-batch-tokens", "1048576")
    assert both.returncode == 2 and "give one" in both.stderr


# ----------------------------------------------------------------------------- --global-batch


@pytest.mark.parametrize("micro,dp,gb", [(1, 1, 8), (2, 2, 8), (4, 2, 64), (3, 1, 9)])
def test_global_batch_sets_the_accumulation(micro, dp, gb):
    cfg = RunConfig(parallel=ParallelConfig(dp=dp), train=TrainConfig(micro_batch=micro, global_batch=gb))
    v = validate(cfg, dp)
    assert v.train.grad_accum == gb // (micro * dp) and v.global_batch == gb


def test_global_batch_mistakes_are_one_line_with_the_fix():
    with pytest.raises(ConfigError, match="not a multiple of --micro-batch x dp = 2 x 2 = 4: pick a multiple of 4"):
        validate(RunConfig(parallel=ParallelConfig(dp=2), train=TrainConfig(micro_batch=2, global_batch=6)), 2)
    with pytest.raises(ConfigError, match="disagree.*give one of them"):
        validate(RunConfig(train=TrainConfig(micro_batch=2, grad_accum=3, global_batch=8)), 1)


# ----------------------------------------------------------------------------- synonyms


FIELD_FLAG = {"dtype": "--dtype", "pp_schedule": "--pp-schedule", "cp_attention": "--cp-attention",
              "recompute": "--recompute", "dispatch": "--dispatch"}


@pytest.mark.parametrize("field,word,ours", [(f, w, o) for f, table in SYNONYMS.items() for w, o in table.items()])
def test_a_refused_value_names_ours(field, word, ours):
    args = [FIELD_FLAG[field], word] + (["--nproc", "2", "--pp", "2", "--grad-accum", "4"] if field == "pp_schedule"
                                        else ["--nproc", "2", "--cp", "2"] if field == "cp_attention" else [])
    # In this process: the validation the command runs before any process starts (the command line's
    # own one-line form is checked once below).
    with pytest.raises(ConfigError) as e:
        cfg = train_config(*args)
        validate(cfg, cfg.train.nproc)
    line = str(e.value)
    assert f"that is {ours} here" in line and repr(word) in line


def test_a_refused_synonym_is_one_line_from_the_command():
    r = run_cli("train", "--steps", "1", "--nproc", "2", "--pp", "2", "--grad-accum", "4", "--pp-schedule", "gpipe")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr == ("ultrascale: error: --pp-schedule must be one of naive, afab, 1f1b, interleaved, zero-bubble, "
                        "dualpipev, got 'gpipe': that is afab here\n")


# ----------------------------------------------------------------------------- help and errors


def test_help_is_grouped_by_the_config_files_sections():
    text = run_cli("train", "--help").stdout
    starts = {name: text.index(title + ":") for name, title in HELP_GROUPS.items()}
    assert list(starts) == sorted(starts, key=starts.get)  # the groups in their order
    bounds = sorted(starts.values()) + [len(text)]
    for flag, section, dest, _, _ in TRAIN_FLAGS:
        group = help_group(section, dest)
        lo = starts[group]
        hi = min(b for b in bounds if b > lo)
        assert f"  {flag}" in text[lo:hi], (flag, group)


def test_an_unknown_flag_points_at_the_commands_help_and_the_near_name():
    r = run_cli("train", "--micro-bach", "4")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "did you mean --micro-batch?" in r.stderr and "`ultrascale train --help`" in r.stderr



def test_a_flag_of_the_command_but_not_of_its_verb_says_which_takes_it():
    # `plan` searches over --gpus; `plan memory` takes a layout's sizes instead.
    r = run_cli("plan", "memory", "--model", "tiny", "--gpus", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--gpus is `ultrascale plan`'s, not `ultrascale plan memory`'s" in r.stderr
    assert "`ultrascale plan memory --help`" in r.stderr and "did you mean --gpus" not in r.stderr
    r = run_cli("plan", "memory", "--model", "tiny", "--micro-bach", "2")
    assert "did you mean --micro-batch?" in r.stderr and "`ultrascale plan memory --help`" in r.stderr


def test_under_torchrun_a_layout_error_speaks_of_the_world_size(monkeypatch):
    cfg = RunConfig(parallel=ParallelConfig(tp=2))
    with pytest.raises(ConfigError, match="add --nproc 2"):
        validate(cfg, 3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(ConfigError) as e:
        validate(cfg, 3)
    assert "--nproc 2" not in str(e.value) and "torchrun with a world size of 2" in str(e.value)
