"""What a run says before step 1, what it leaves on stderr, the MFU it can print, and where it logs.

Runs of the command line (tiny model, 1-3 steps); those about stderr start a new interpreter, as
a shell does (a warning printed at import time would not show in a process forked from one that
has imported everything already). Nothing here times anything.
"""

import json
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from ultrascale.testing.cli import ultrascale

TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--no-progress"]
HEADER = ("model: ", "layout: ", "batch: ", "precision: ", "writes: ")


def rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def before_step_one(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("step "))]


# -- the header and a clean stderr -------------------------------------------------------

def test_a_plain_run_says_what_it_is_before_step_one_and_nothing_on_stderr(tmp_path):
    log, ck = tmp_path / "run.jsonl", tmp_path / "ck"
    r = ultrascale("train", *TINY, "--steps", "2", "--peak", "1", "--log-jsonl", str(log), "--save", str(ck),
                   "--save-every", "1", cwd=tmp_path, fresh=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    head = before_step_one(r.stdout)
    assert [line.split(" ")[0] + " " for line in head[:5]] == list(HEADER), head
    assert head[0] == "model: tiny, 2 layers, hidden 64, 8 heads (4 key/value), vocab 257: 106,944 parameters"
    assert head[1] == "layout: dp 1 x pp 1 x cp 1 x tp 1 = 1 rank (cpu)"
    assert head[2] == ("batch: 4 sequences x 32 tokens = 128 tokens per step (micro-batch 4 x grad-accum 1 x dp 1), "
                       "steps 1-2")
    assert head[3] == "precision: fp32, eager, recompute none"
    assert head[4] == f"writes: JSONL {log}, no TensorBoard, no W&B; checkpoint {ck} every step"
    assert head[5].startswith("data: ") and head[5].endswith(
        "; tokenizer: bytes (256 byte values and end-of-document; the model's vocabulary 257)")
    assert head[6] == ("peak 1 TFLOP/s per device (given, fp32, cpu (1 thread)): MFU is measured against it "
                       "(given with --peak)")
    # Below the peak, MFU is a figure and the flag says so.
    assert all(r["mfu"] is not None and r["mfu_above_peak"] is False for r in rows(log))


def test_a_profiled_run_leaves_stderr_empty(tmp_path, monkeypatch):
    prof = tmp_path / "prof"
    r = ultrascale("train", *TINY, "--steps", "3", "--peak", "1", "--profile", str(prof), fresh=True)
    assert r.returncode == 0, r.stderr
    assert (prof / "rank0.trace.json.gz").is_file()
    assert r.stderr == ""
    # The check sees Kineto's lines when they come: a level the user sets is kept, and prints them.
    monkeypatch.setenv("KINETO_LOG_LEVEL", "4")
    r = ultrascale("train", *TINY, "--steps", "2", "--peak", "1", "--profile", str(prof), "--profile-steps", "2")
    assert r.returncode == 0, r.stderr
    assert "profiler_start" in r.stderr


def test_loads_and_a_resume_without_save_are_said(tmp_path):
    from ultrascale.cli import main

    ck, hf = tmp_path / "ck", tmp_path / "hf"
    r = ultrascale("train", *TINY, "--steps", "1", "--peak", "1", "--save", str(ck))
    assert r.returncode == 0, r.stderr
    r = ultrascale("train", *TINY, "--steps", "2", "--peak", "1", "--resume", str(ck))
    assert r.returncode == 0, r.stderr
    head = before_step_one(r.stdout)
    assert f"resumed {ck} at step 1" in head
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: resumed without --save: step 2 will not be saved (add --save DIR, e.g. --save {ck})"]
    assert "batch: 4 sequences x 32 tokens = 128 tokens per step (micro-batch 4 x grad-accum 1 x dp 1), step 2" in head
    # where each setting came from: the flags of this invocation, then what the checkpoint gave
    settings = [line for line in head if line.startswith("settings: ")]
    assert settings == [f"settings: from the command line: the model (tiny, 2 layers, hidden 64) --seq-len 32 --steps 2 "
                        f"--peak 1 --no-progress --micro-batch 4 --resume {ck}; from --resume {ck}: --dp 1 "
                        f"--lr-decay-steps 1 and 48 more, as saved, at their defaults; 12 others at their defaults"], \
        settings
    assert main(["export", "--hf", str(hf), str(ck)]) == 0
    r = ultrascale("train", *TINY[2:], "--steps", "1", "--peak", "1", "--init-from", f"hf:{hf}")
    assert r.returncode == 0, r.stderr
    head = before_step_one(r.stdout)
    assert f"initialized from hf:{hf}" in head and not any(line.startswith("warning:") for line in head)


def test_the_compile_line_counts_this_ranks_blocks():
    from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
    from ultrascale.train.header import precision_line, start_lines

    def trainer(pp, blocks):
        cfg = RunConfig(parallel=ParallelConfig(pp=pp), train=TrainConfig(compile=True))
        return SimpleNamespace(cfg=cfg, step=0, model=SimpleNamespace(layers=dict.fromkeys(range(blocks))))

    assert start_lines(trainer(1, 2)) == ["compiling 2 transformer blocks with torch.compile: the first step "
                                          "includes the compile"]
    assert start_lines(trainer(2, 1)) == ["compiling 1 transformer block on this pipeline stage with torch.compile: "
                                          "the first step includes the compile"]
    assert precision_line(trainer(1, 2).cfg) == "precision: fp32, compiled blocks (--compile), recompute none"


# -- MFU above 100% ---------------------------------------------------------------------

def test_an_mfu_above_100_percent_is_never_a_figure(tmp_path):
    log = tmp_path / "run.jsonl"
    r = ultrascale("train", *TINY, "--steps", "3", "--peak", "0.00001", "--log-jsonl", str(log))
    assert r.returncode == 0, r.stderr
    for row in rows(log):
        assert row["mfu"] is None and row["mfu_above_peak"] is True
        assert row["tflops"] > row["peak_tflops"] == 1e-5
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("| mfu >100% (peak too low: --peak) |" in line for line in steps), steps
    assert not re.search(r"mfu [0-9.]+%", r.stdout)
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, r.stdout
    assert "above the peak MFU divides by (1e-05 TFLOP/s, given)" in warnings[0]
    assert "--peak 1e-05 is below what the device runs" in warnings[0]


def test_an_offloaded_runs_memory_reaches_tensorboard_as_numbers():
    from ultrascale.train.trainer import tensorboard_scalars

    m = {"loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 10.0, "tflops": 0.1, "mfu": None,
         "step_time_s": 0.1, "memory": {"params": 8, "grads": 8, "optim": 0, "activations": None,
                                        "offloaded": {"to": "cpu", "optim": 64, "params": 0, "params_to": None}}}
    out = tensorboard_scalars(m)
    assert out["memory/offloaded_optim"] == 64.0 and out["memory/offloaded_params"] == 0.0
    assert "train/mfu" not in out and "memory/activations" not in out
    assert not any(k.startswith("memory/offloaded_to") or k.endswith("params_to") for k in out)


# -- the measured peak, kept per machine --------------------------------------------------

def test_the_measured_peak_is_kept_and_can_be_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kept = tmp_path / "cache" / "ultrascale" / "peak.json"
    r = ultrascale("peak", "--device", "cpu", "--size", "256", "--save", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["saved_to"] == str(kept)
    data = json.loads(kept.read_text())
    [(key, entry)] = data["peaks"].items()
    assert "| fp32 | torch " in key and key.endswith("| 1 rank") and "1 thread" in key
    # A figure no matmul here reaches: a run that divides by it read it from the file.
    entry["tflops"] = 123.0
    kept.write_text(json.dumps(data))
    log = tmp_path / "run.jsonl"
    r = ultrascale("train", *TINY, "--steps", "1", "--log-jsonl", str(log))
    assert r.returncode == 0, r.stderr
    assert rows(log)[0]["peak_tflops"] == 123.0 and rows(log)[0]["peak_source"] == "measured"
    assert f"(measured {entry['measured']} and kept in {kept}; `ultrascale peak --save` measures it again)" in r.stdout
    r = ultrascale("peak", "--forget")
    assert r.returncode == 0 and r.stdout.startswith("forgot 1 measured ceiling of this machine"), r.stdout
    r = ultrascale("train", *TINY, "--steps", "1", "--log-jsonl", str(log))
    assert r.returncode == 0, r.stderr
    assert 0 < rows(log)[0]["peak_tflops"] < 123.0
    assert f"(measured now, kept in {kept} for the next runs)" in r.stdout
    assert list(json.loads(kept.read_text())["peaks"]) == [key]


# -- TensorBoard's hparams and W&B ---------------------------------------------------------

def wandb_records(run_dir: Path) -> list:
    """The records of an offline W&B run (its run-ID.wandb file: a LevelDB-style log of 32 KiB
    blocks, each record a 7-byte header (CRC, length, type: 1 whole, 2-4 first/middle/last piece)
    and a wandb_internal_pb2.Record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = run_dir.glob("run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, piece, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(piece)
            out.append(record)
            piece = b""
    return out


def test_wandb_and_tensorboard_get_the_scalars_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    from ultrascale.train.trainer import tensorboard_scalars

    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    log, tb = tmp_path / "run.jsonl", tmp_path / "tb"
    r = ultrascale("train", *TINY, "--steps", "2", "--peak", "1", "--nproc", "2", "--dp", "2", "--eval-every", "2",
                   "--eval-batches", "1", "--log-jsonl", str(log), "--tensorboard", str(tb), "--wandb", "header-test")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    head = before_step_one(r.stdout)
    assert "layout: dp 2 x pp 1 x cp 1 x tp 1 = 2 ranks (cpu, gloo); data parallel: bucket (25 MB buckets)" in head
    assert f"writes: JSONL {log}, TensorBoard {tb}, W&B project header-test; no checkpoint (--save DIR saves one)" \
        in head
    [runs] = list((tmp_path / "wandb-home").glob("wandb"))
    [run_dir] = list(runs.glob("offline-run-*"))  # the logging rank's run, and no other
    assert any(line == f"W&B: run {run_dir.name.rsplit('-', 1)[1]} offline, in {run_dir} (`wandb sync {run_dir}` "
               f"uploads it)" for line in head), head

    records = wandb_records(run_dir)
    [run] = [x.run for x in records if x.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}
    assert run.project == "header-test"
    assert config["train"]["wandb"] == "header-test" and config["parallel"]["dp"] == 2
    assert config["model"]["hidden"] == 64 and config["train"]["steps"] == 2
    history = {}
    for x in records:
        if x.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in x.history.item}
            history[x.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    logged = rows(log)
    assert sorted(history) == [1, 2]
    for row in logged:
        assert history[row["step"]] == pytest.approx(tensorboard_scalars(row), rel=1e-12)
    assert history[2] != pytest.approx(tensorboard_scalars(logged[0]), rel=1e-12)  # a step off is told apart
    assert "val/loss" in history[2] and "val/loss" not in history[1]

    acc = EventAccumulator(str(tb))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["train/loss", "val/loss"]
    hparams = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info.hparams
    assert hparams["train.lr"].number_value == 3e-3 and hparams["parallel.dp"].number_value == 2
    assert hparams["model.name"].string_value == "tiny" and hparams["train.compile"].string_value == "false"
    assert hparams["train.wandb"].string_value == "header-test"
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]


def test_wandb_online_without_credentials_is_one_line_before_step_one(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings: nobody logged in
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    log = tmp_path / "run.jsonl"
    r = ultrascale("train", *TINY, "--steps", "1", "--peak", "1", "--wandb", "p", "--log-jsonl", str(log), timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("ultrascale: error: --wandb p: W&B did not start the run (")
    assert lines[0].endswith("log in with `wandb login` (or set WANDB_API_KEY), or log locally with WANDB_MODE=offline")
    assert not any(line.startswith("step ") for line in r.stdout.splitlines()) and not log.exists()


def test_wandb_missing_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    import sys

    from ultrascale.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    code = main(["train", *TINY, "--steps", "1", "--wandb", "p", "--log-jsonl", str(tmp_path / "run.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["ultrascale: error: --wandb needs the wandb package: pip install 'ultrascale[wandb]'"]
    assert not (tmp_path / "run.jsonl").exists()
