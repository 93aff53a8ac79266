"""What a plain `--resume CK` takes from the checkpoint, field by field of the run's configuration.

The fields are enumerated, not listed: a TrainConfig field added tomorrow is in none of
train/resume.py's lists and fails the first test, and each saved value of every field that a
resume keeps is checked to come back through a run record written to disk and read again (a value
the record drops reverts to the default and fails the second). Every field of the record itself, and
of the model and the layout, comes back the same way; one a reader does not know is refused. Then
the two that a user lost, end to end: --eval-every and --keep-last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import pytest

from ultrascale.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig, build_config
from ultrascale.errors import ConfigError
from ultrascale.train import integrity, resume
from ultrascale.train.record import RunRecord, read_record, write_record
from ultrascale.testing.cli import ultrascale as forked_ultrascale

TRAIN_FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


def test_every_train_field_says_what_a_resume_does_with_it():
    lists = {"SAME_TRAIN": resume.SAME_TRAIN, "LAYOUT_TRAIN": resume.LAYOUT_TRAIN, "KEPT": resume.KEPT,
             "KEPT_WHEN_SAVING": resume.KEPT_WHEN_SAVING, "THIS_RUN": tuple(resume.THIS_RUN)}
    for name in TRAIN_FIELDS:
        homes = [k for k, fields in lists.items() if name in fields]
        assert len(homes) == 1, f"TrainConfig.{name} is in {homes or 'none'} of train/resume.py's lists"
    assert set().union(*map(set, lists.values())) <= set(TRAIN_FIELDS), "a list names a field TrainConfig lacks"


def _other(value):
    """A value of the same type as `value` and different from it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 7
    if isinstance(value, float):
        return value + 0.25
    return f"{value}-saved"


def _round_trip(record: RunRecord, tmp) -> RunRecord:
    """`record` as a save writes it into a checkpoint directory, read back as every reader reads it."""
    tmp = str(tmp)
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "__0_0.distcp"), "wb") as f:
        f.write(b"tensors")
    record = dataclasses.replace(record, files=integrity.describe(tmp, ["__0_0.distcp"]))
    write_record(tmp, record)
    return read_record(str(tmp))


def _saved(**train):
    config = RunConfig(parallel=ParallelConfig(dp=2, tp=2), train=TrainConfig(**train))
    return _round_trip(RunRecord(step=1, config=config, optimizer_steps=1), tempfile.mkdtemp()).settings


def _resumed(saved: dict, train_flags: dict, parallel_flags: dict | None = None) -> RunConfig:
    flags = {"model": {}, "parallel": dict(parallel_flags or {}), "train": {"resume": "CK", **train_flags}}
    layer = resume.resume_layer(saved, flags)
    return build_config(layer, flags)


@pytest.mark.parametrize("name", [n for n in TRAIN_FIELDS if n not in resume.THIS_RUN])
def test_a_plain_resume_keeps_the_saved_value(name):
    value = _other(getattr(TrainConfig(), name))
    saving = {"save": "CK"} if name in resume.KEPT_WHEN_SAVING else {}
    got = _resumed(_saved(**{name: value}), saving)
    assert getattr(got.train, name) == value, f"--resume dropped the saved {name} = {value!r}"
    # and a flag given wins over it (the layout's fields: with a layout given too)
    given = _other(value)
    layout = {"pp": 2} if name in resume.LAYOUT_TRAIN else {}
    assert getattr(_resumed(_saved(**{name: value}), {**saving, name: given}, layout).train, name) == given


@pytest.mark.parametrize("name", list(resume.THIS_RUN))
def test_what_this_run_does_is_not_taken_from_the_checkpoint(name):
    value = _other(getattr(TrainConfig(), name))
    assert getattr(_resumed(_saved(**{name: value}), {}).train, name) == (
        "CK" if name == "resume" else getattr(TrainConfig(), name))


def test_saving_settings_come_back_only_when_the_resume_saves():
    saved = _saved(save="ck", save_every=3, keep_last=2)
    assert (_resumed(saved, {}).train.keep_last, _resumed(saved, {}).train.save_every) == (0, 0)
    assert _resumed(saved, {"save": "ck"}).train.keep_last == 2


def test_the_layout_comes_with_the_checkpoint_unless_one_is_given():
    saved = _saved(nproc=4, micro_batch=3, grad_accum=5)
    assert (_resumed(saved, {}).parallel.tp, _resumed(saved, {}).train.nproc) == (2, 4)
    other = _resumed(saved, {"nproc": 2}, {"pp": 2})
    assert (other.parallel.tp, other.parallel.pp, other.train.grad_accum) == (1, 2, 1)


# A value for every field of the record that differs from its default (the config: every field of every section).
RECORD_VALUES = {"step": 9, "optimizer_steps": 7, "world_size": 4, "tokenizer": {"kind": "hf", "sha256": "ab"},
                 "data": [{"path": "corpus", "index_sha256": "cd"}], "router_bias": {"layers.0.mlp.router_bias": [0.5]},
                 "loss_scale": {"scale": 1024.0, "good_steps": 3}}


def _every_field_changed() -> list[RunConfig]:
    """Runs in which, together, every field of every section differs from its default: experts need
    the default MLP (SwiGLU), so the other MLP is a second, dense run's."""
    changed = {f.name: _other(getattr(ModelConfig(), f.name)) for f in dataclasses.fields(ModelConfig)}
    moe = ModelConfig(**{**changed, "experts": 4, "top_k": 1, "mlp": "swiglu", "norm": "layernorm",
                         "router_score": "sigmoid"})
    dense = dataclasses.replace(moe, experts=0, mlp="gelu")
    sections = {name: cls(**{f.name: _other(getattr(cls(), f.name)) for f in dataclasses.fields(cls)})
                for name, cls in (("parallel", ParallelConfig), ("train", TrainConfig))}
    return [RunConfig(model=model, **sections) for model in (moe, dense)]


def test_every_field_of_the_run_record_comes_back_from_disk(tmp_path):
    missing = set(f.name for f in dataclasses.fields(RunRecord)) - set(RECORD_VALUES) - {"config", "files", "format"}
    assert not missing, f"RECORD_VALUES lacks a value for {missing}"
    configs = _every_field_changed()
    for cls, section in ((ModelConfig, "model"), (ParallelConfig, "parallel"), (TrainConfig, "train")):
        same = [f.name for f in dataclasses.fields(cls)
                if all(getattr(getattr(c, section), f.name) == getattr(cls(), f.name) for c in configs)]
        assert not same, f"{cls.__name__}: {same} kept the default: the round trip would not see them dropped"
    for i, config in enumerate(configs):
        record = RunRecord(config=config, **RECORD_VALUES)
        back = _round_trip(record, tmp_path / str(i))
        assert back.config.to_dict() == config.to_dict()
        for f in dataclasses.fields(RunRecord):
            if f.name != "files":
                assert getattr(back, f.name) == getattr(record, f.name), f"the run record dropped {f.name}"


@pytest.mark.parametrize("where", ["", "config.", "config.model.", "config.parallel.", "config.train."])
def test_a_field_the_reader_does_not_know_is_refused_not_skipped(tmp_path, where):
    _round_trip(RunRecord(step=1, config=RunConfig(), optimizer_steps=1), tmp_path)
    with open(tmp_path / "meta.json") as f:
        d = json.load(f)
    part = d
    for key in where.split(".")[:-1]:
        part = part[key]
    part["mla_rank"] = 64  # a field of a later version
    with open(tmp_path / "meta.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ConfigError) as e:
        read_record(str(tmp_path))
    assert str(e.value) == (f"--resume {tmp_path}: its run record holds {where}mla_rank = 64, which this version "
                            f"does not know: read it with the version that wrote it")


def test_every_reader_refuses_a_record_field_it_cannot_honour_in_one_line(tmp_path, capsys):
    from ultrascale.cli import main

    ck = str(tmp_path / "ck")
    assert main(["train", "--model", "tiny", "--steps", "1", "--seq-len", "16", "--micro-batch", "2", "--no-progress",
                 "--save", ck]) == 0
    with open(os.path.join(ck, "meta.json")) as f:
        d = json.load(f)
    d["config"]["model"]["mla_rank"] = 64
    with open(os.path.join(ck, "meta.json"), "w") as f:
        json.dump(d, f)
    capsys.readouterr()
    for argv, what in ((["train", "--resume", ck, "--steps", "2"], "--resume"), (["generate", ck, "--prompt", "a"],
                       "checkpoint"), (["export", "--hf", str(tmp_path / "hf"), ck], "checkpoint"),
                       (["data", "info", ck], "checkpoint")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"ultrascale: error: {what} {ck}: its run record holds config.model.mla_rank = 64, which this "
                       f"version does not know: read it with the version that wrote it"], (argv, err)
    assert not (tmp_path / "hf").exists()


def ultrascale(*args, cwd):
    # a process of its own, forked from a server that imported torch once (testing/cli.py)
    return forked_ultrascale(*args, cwd=str(cwd), timeout=300)


RUN = ("train", "--seq-len", "32", "--layers", "2", "--no-progress", "--seed", "5", "--warmup-steps", "1",
       "--micro-batch", "4")


def test_a_resume_keeps_evaluating_and_keeps_the_saved_steps(tmp_path):
    r = ultrascale(*RUN, "--steps", "2", "--eval-every", "1", "--eval-batches", "1", "--save", "ck",
                   "--save-every", "1", "--keep-last", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = ultrascale(*RUN, "--resume", "ck", "--steps", "4", "--save", "ck", "--log-jsonl", "log.jsonl", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in open(tmp_path / "log.jsonl") if line.strip()]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [3, 4] and all("val_loss" in row for row in steps), rows
    # --keep-last 2 and --save-every 1 came back: steps 3 and 4 kept, and nothing the first run kept was
    # deleted before this run had saved newer ones
    assert sorted(os.listdir(tmp_path / "ck")) == ["step-000003", "step-000004"], os.listdir(tmp_path / "ck")


def test_a_resumed_log_holds_each_step_once_and_plot_reads_a_torn_line(tmp_path):
    # The run saved at step 2 and went on to step 3 before it stopped (its last line cut by the kill);
    # resumed from step 2 into the same log, steps 3 and 4 are there once each, step 3 the resumed run's.
    r = ultrascale(*RUN, "--steps", "3", "--save", "ck", "--save-every", "2", "--log-jsonl", "log.jsonl",
                   cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # the checkpoint at step 3 is the end of the run; the one to resume from is step 2's: keep it aside
    r = ultrascale(*RUN, "--steps", "2", "--save", "ck2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.')  # torn
    r = ultrascale("plot", "log.jsonl", "-o", "torn.png", cwd=tmp_path)
    assert r.returncode == 0 and "the last line is cut short" in r.stderr, r.stderr
    r = ultrascale(*RUN, "--resume", "ck2", "--steps", "4", "--log-jsonl", "log.jsonl", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    steps = [json.loads(line)["step"] for line in open(tmp_path / "log.jsonl") if line.strip()]
    assert steps == [1, 2, 3, 4], steps
    r = ultrascale("plot", "log.jsonl", "-o", "runs.png", cwd=tmp_path)
    assert r.returncode == 0 and not r.stderr, r.stderr


def test_save_every_without_save_is_refused_before_the_run():
    from ultrascale.config import validate
    from ultrascale.errors import ConfigError

    with pytest.raises(ConfigError, match="--save-every 2 without --save"):
        validate(RunConfig(train=TrainConfig(save_every=2)), 1)
