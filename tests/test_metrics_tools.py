"""The metrics tools as a user meets them: `ultrascale peak`, `train --peak`, `--tensorboard`, `ultrascale plot`.

Nothing here times anything beyond "positive": the machine is shared (docs/benchmarks.md).
"""

import json
import re

import pytest

from ultrascale.testing.cli import jsonl_losses, ultrascale

TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--no-progress"]
TWO_RANKS = ["--nproc", "2", "--dp", "2"]


def rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def tiny_flops_per_token(seq_len: int) -> int:
    """6N + 12·L·h·s for the `tiny` preset, N counted by hand from its shape (model/config.py's PRESETS):
    vocab 257, hidden 64, 2 layers, 8 heads and 4 key/value heads of 8, SwiGLU width 128, untied."""
    v, h, layers, kv, ffn = 257, 64, 2, 4 * 8, 128
    block = (h * h + 2 * h * kv + h * h) + 3 * h * ffn + 2 * h  # q, k, v, o; gate, up, down; two norms
    n = 2 * v * h + layers * block + h  # embedding, head, blocks, final norm
    assert n == 106944
    return 6 * n + 12 * layers * h * seq_len


# -- ultrascale peak ------------------------------------------------------------

def test_peak_on_cpu_prints_a_positive_figure():
    r = ultrascale("peak", "--device", "cpu", "--size", "256")
    assert r.returncode == 0, r.stderr
    m = re.search(r"peak ([0-9.e+-]+) TFLOP/s \(fp32 matmul, cpu \(1 thread\)\), no datasheet figure", r.stdout)
    assert m and float(m.group(1)) > 0, r.stdout
    r = ultrascale("peak", "--device", "cpu", "--dtype", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tflops"] > 0 and out["dtype"] == "bf16" and out["datasheet_tflops"] is None
    assert out["threads"] == 1  # OMP_NUM_THREADS=1 (testing/cli.py): the threads torch trains with here
    assert out["tflops"] == max(out["by_size"].values()) and len(out["by_size"]) >= 1


# -- train --peak -----------------------------------------------------------------

@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """The same 2-rank data-parallel run with the measured ceiling (the CPU default) and with --peak 1.0."""
    d = tmp_path_factory.mktemp("peak")
    out = {}
    for name, extra in (("auto", []), ("given", ["--peak", "1.0"])):
        log = d / f"{name}.jsonl"
        r = ultrascale("train", *TINY, *TWO_RANKS, "--steps", "3", "--log-jsonl", str(log), *extra)
        assert r.returncode == 0, r.stderr
        out[name] = (r.stdout, rows(log))
    return out


def test_two_ranks_on_cpu_print_mfu_against_the_measured_ceiling(two_rank_runs):
    stdout, log = two_rank_runs["auto"]
    assert re.search(r"peak [0-9.e+-]+ TFLOP/s per device \(measured, fp32, cpu \(1 thread\)\)", stdout), stdout
    for r in log:
        assert r["peak_source"] == "measured" and r["peak_tflops"] > 0
        assert r["mfu"] is not None and r["mfu"] > 0
        assert r["mfu"] == pytest.approx(r["tflops"] / r["peak_tflops"], rel=1e-12)
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all(re.search(r"\| mfu [0-9.]+%", line) for line in lines), stdout


def test_given_peak_gives_the_mfu_of_the_flops_formula(two_rank_runs):
    stdout, log = two_rank_runs["given"]
    for r in log:
        assert r["peak_source"] == "given" and r["peak_tflops"] == 1.0
        # N by hand agrees with the parameter bytes the run itself measured (fp32, replicated by dp).
        assert r["memory"]["params"] == 4 * 106944
        # MFU = FLOPs per token x tokens/s / (peak x devices): 2 devices of 1.0 TFLOP/s each.
        expected = tiny_flops_per_token(32) * r["tokens_per_s"] / (1.0e12 * 2)
        assert r["mfu"] == pytest.approx(expected, rel=1e-9)
    printed = [float(x) for x in re.findall(r"\| mfu ([0-9.]+)%", stdout)]
    assert printed == [round(100 * r["mfu"], 1) for r in log]


# -- --tensorboard ------------------------------------------------------------------

def test_tensorboard_events_hold_the_jsonl_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log, tb = tmp_path / "run.jsonl", tmp_path / "tb"
    r = ultrascale("train", *TINY, "--model", "tiny-moe", "--steps", "4", "--log-jsonl", str(log),
                   "--tensorboard", str(tb))
    assert r.returncode == 0, r.stderr
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu", "memory/params",
            "memory/activations", "moe/tokens_per_expert_cv", "moe/aux_loss"} <= tags, tags
    logged = rows(log)
    for tag, key in (("train/loss", "loss"), ("train/grad_norm", "grad_norm"), ("train/mfu", "mfu")):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3, 4]
        # Event files store float32.
        assert [e.value for e in events] == pytest.approx([x[key] for x in logged], rel=1e-6)
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(jsonl_losses(log), rel=1e-6)


def test_tensorboard_missing_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    import sys

    from ultrascale.cli import main

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    code = main(["train", *TINY, "--steps", "1", "--tensorboard", str(tmp_path / "tb")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "pip install 'ultrascale[tensorboard]'" in err[0]
    assert not (tmp_path / "tb").exists()


# -- ultrascale plot ----------------------------------------------------------------

def test_plot_draws_several_runs(tmp_path):
    from PIL import Image

    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    for log, extra in ((one, ["--micro-batch", "8"]), (two, ["--grad-accum", "2"])):
        r = ultrascale("train", *TINY, "--steps", "3", "--peak", "1", "--log-jsonl", str(log), *extra)
        assert r.returncode == 0, r.stderr
    out = tmp_path / "fig" / "runs.png"
    r = ultrascale("plot", str(one), str(two), "-o", str(out), "--labels", "one", "accumulated")
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == (1500, 450)


# -- bad input ------------------------------------------------------------------------

def _one_line_exit_2(capsys, argv) -> str:
    from ultrascale.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


BAD_TRAIN = [
    (["--peak", "fast"], "--peak must be auto, datasheet or a positive number"),
    (["--peak", "0"], "--peak must be auto, datasheet or a positive number"),
    (["--peak", "-3"], "--peak must be auto, datasheet or a positive number"),
    (["--peak", "nan"], "--peak must be auto, datasheet or a positive number"),
    (["--device", "cpu", "--peak", "datasheet"], "--peak datasheet: no datasheet figure for a CPU"),
    (["--tensorboard", "/proc/ultrascale-tb"], "--tensorboard /proc/ultrascale-tb: cannot write in /proc"),
    (["--tensorboard", "FILE"], "exists and is not a directory"),
]


@pytest.mark.parametrize("args,message", BAD_TRAIN, ids=[" ".join(a) for a, _ in BAD_TRAIN])
def test_bad_train_flags_are_one_line_before_training(tmp_path, capsys, args, message):
    (tmp_path / "FILE").write_text("x")
    args = [str(tmp_path / a) if a == "FILE" else a for a in args]
    line = _one_line_exit_2(capsys, ["train", *TINY, "--steps", "1", *args, "--save", str(tmp_path / "ck")])
    assert message in line and line.startswith("ultrascale: error:"), line
    assert not (tmp_path / "ck").exists()


def test_peak_datasheet_on_cpu_in_a_real_process(tmp_path):
    r = ultrascale("train", *TINY, *TWO_RANKS, "--steps", "1", "--device", "cpu", "--peak", "datasheet",
                   "--log-jsonl", str(tmp_path / "a.jsonl"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "use --peak auto" in lines[0], r.stderr
    assert not (tmp_path / "a.jsonl").exists()


@pytest.fixture
def a_log(tmp_path):
    log = tmp_path / "a.jsonl"
    log.write_text(json.dumps({"step": 1, "loss": 5.0, "tokens_per_s": 100.0, "memory": {"params": 1}}) + "\n")
    return str(log)


BAD_PLOT = [
    (["/no/such.jsonl"], "/no/such.jsonl: no such file"),
    (["EMPTY"], "no step records"),
    (["JUNK"], "not a JSON line"),
    (["LOG", "-o", "/proc/ultrascale.png"], "-o /proc/ultrascale.png: cannot write in /proc"),
    (["LOG", "-o", "DIR"], "is a directory: give a file name"),
    (["LOG", "-o", "out.svg"], "ending in .png"),
    (["LOG", "LOG", "--labels", "one"], "--labels gives 1 labels for 2 runs"),
]


@pytest.mark.parametrize("args,message", BAD_PLOT, ids=[" ".join(a) for a, _ in BAD_PLOT])
def test_bad_plot_input_is_one_line(tmp_path, capsys, a_log, args, message):
    (tmp_path / "EMPTY").write_text('{"config": "not a step"}\n')
    (tmp_path / "JUNK").write_text("step 1 loss 5\n")
    (tmp_path / "DIR.png").mkdir()
    names = {"LOG": a_log, "EMPTY": str(tmp_path / "EMPTY"), "JUNK": str(tmp_path / "JUNK"),
             "DIR": str(tmp_path / "DIR.png"), "out.svg": str(tmp_path / "out.svg")}
    args = [names.get(a, a) for a in args]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "out.png")]
    line = _one_line_exit_2(capsys, ["plot", *args])
    assert message in line, line
    assert not (tmp_path / "out.png").exists()


def test_bad_plot_input_in_a_real_process(tmp_path):
    r = ultrascale("plot", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.png"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "no such file" in r.stderr
