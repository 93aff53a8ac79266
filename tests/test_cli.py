"""The command line as a user meets it: real processes, real exit codes."""

import dataclasses
import json
import math
import re

import pytest

from ultrascale.distributed.launch import launch_local
from ultrascale.testing.cli import jsonl_losses as losses
from ultrascale.testing.cli import ultrascale
from ultrascale.testing.compare import FP32, worst

TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--no-progress"]


def test_train_runs_and_logs(tmp_path):
    r = ultrascale("train", *TINY, "--steps", "3", "--log-jsonl", str(tmp_path / "a.jsonl"), fresh=True)
    assert r.returncode == 0, r.stderr
    assert "step     1 | loss" in r.stdout and "done: 3 steps" in r.stdout
    assert len(losses(tmp_path / "a.jsonl")) == 3


def _train_config(*argv):
    """The RunConfig that `ultrascale train ARGV` would run, parsed as the command parses it."""
    from ultrascale.cli import build_parser, parse_train_config

    return parse_train_config(build_parser().parse_args(["train", *argv]))[0]


def test_toml_config_is_equivalent_to_flags(tmp_path):
    # The same run from a file and from flags: the same configuration, field for field (the
    # trainer is a function of it; a TOML file trains end to end in test_plan's emitted config).
    (tmp_path / "run.toml").write_text(
        '[model]\npreset = "tiny"\nlayers = 1\n[train]\nsteps = 3\nseq_len = 32\nmicro_batch = 2\n'
        'grad_accum = 2\nseed = 5\n[parallel]\ndp = 2\nzero = 1\n')
    from_file = _train_config("--config", str(tmp_path / "run.toml"))
    from_flags = _train_config("--model", "tiny", "--layers", "1", "--steps", "3", "--seq-len", "32",
                               "--micro-batch", "2", "--grad-accum", "2", "--seed", "5", "--dp", "2", "--zero", "1")
    assert from_file == from_flags
    assert from_file != _train_config("--model", "tiny", "--layers", "1", "--steps", "3", "--seq-len", "32")
    # A flag wins over the file, and changes nothing else.
    flag_wins = _train_config("--config", str(tmp_path / "run.toml"), "--seed", "6")
    assert flag_wins.train.seed == 6
    assert dataclasses.replace(flag_wins, train=dataclasses.replace(flag_wins.train, seed=5)) == from_file


def test_resume_continues_the_run_from_the_command_line(tmp_path):
    a, b, c, ck = (str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "c.jsonl", "ck"))
    assert ultrascale("train", *TINY, "--steps", "6", "--log-jsonl", a).returncode == 0
    assert ultrascale("train", *TINY, "--steps", "3", "--save", ck, "--log-jsonl", b).returncode == 0
    r = ultrascale("train", *TINY, "--steps", "6", "--resume", ck, "--log-jsonl", c)
    assert r.returncode == 0, r.stderr
    assert losses(b) + losses(c) == losses(a)


BAD = [
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--seq-len", "100000"], "exceeds the model's limit"),
    (["--micro-batch", "0"], "--micro-batch must be a positive"),
    (["--steps", "-1"], "--steps must be a positive"),
    (["--nproc", "3", "--tp", "3"], "--tp 3 must divide both the 8 query heads"),
    (["--model", "tiny-moe", "--nproc", "4", "--dp", "2", "--cp", "2", "--ep", "2"], "--ep 2 with --cp 2"),
    (["--nproc", "2", "--tp", "2", "--ffn-hidden", "129"], "--tp 2 must divide the MLP width --ffn-hidden 129"),
    (["--nproc", "2", "--tp", "4"], "not divisible"),
    (["--nproc", "4", "--dp", "3"], "make the product equal the world size"),
    (["--dtype", "fp8"], "--dtype must be"),
    (["--recompute", "some"], "--recompute must be"),
    (["--dtype", "fp16", "--loss-scale-window", "0"], "--loss-scale-window positive"),
    (["--model", "gpt5"], "unknown model preset"),
    (["--resume", "/no/such/dir"], "no such checkpoint"),
    (["--config", "/no/such.toml"], "no such file"),
    (["--zero", "2"], "nothing to shard"),
    (["--nproc", "2", "--ep", "2"], "is dense: pick an MoE model"),
    (["--nproc", "2", "--cp", "2", "--seq-len", "33"], "--cp 2 cuts each sequence into 2 equal shards"),
    (["--nproc", "2", "--cp", "2", "--cp-attention", "zigzag", "--seq-len", "34"], "2 x cp = 4 equal chunks"),
    (["--nproc", "4", "--cp", "2", "--tp", "2", "--sp", "--seq-len", "34"], "must divide by cp x tp = 4"),
    (["--nproc", "4", "--cp", "4", "--cp-attention", "ulysses", "--kv-heads", "2"], "--cp-attention ulysses"),
    (["--nproc", "2", "--cp", "2", "--cp-attention", "stripe"], "--cp-attention must be"),
    (["--cp-attention", "zigzag"], "--cp-attention zigzag with --cp 1"),
    (["--profile-steps", "3:4"], "--profile-steps 3:4 without --profile"),
    (["--nproc", "2", "--bucket-mb", "0"], "--bucket-mb must be positive"),
    (["--nproc", "2", "--dp-mode", "naive", "--zero", "1"], "built on bucketed data parallelism"),
    (["--nproc", "2", "--dp-mode", "ring"], "--dp-mode must be"),
    (["--nproc", "2", "--dp-comm-dtype", "bf16", "--zero", "2"], "--dp-comm-dtype bf16"),
    (["--steps", "many"], "invalid int value"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    # In-process (the same main() the console script calls), to keep the suite fast;
    # the two tests below check the same through a real process.
    from ultrascale.cli import main

    try:
        code = main(["train", *TINY, "--steps", "2", *args, "--save", str(tmp_path / "ck")])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("args,message", [(["--nproc", "4", "--dp", "3"], "make the product equal the world size"),
                                          (["--data", "/no/such/file.txt"], "no such file"),
                                          (["--nproc", "2", "--cp", "2", "--cp-attention", "zigzag", "--seq-len", "30"],
                                           "--seq-len 30 must divide by 4"),
                                          (["--nproc", "4", "--cp", "4", "--cp-attention", "ulysses",
                                            "--kv-heads", "2"], "must divide the 8 query heads and the 2 key/value")])
def test_bad_input_in_a_real_process(tmp_path, args, message):
    r = ultrascale("train", *TINY, "--steps", "2", *args, "--save", str(tmp_path / "ck"), cwd=tmp_path, fresh=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "ck").exists()


def test_bad_toml_is_one_line(tmp_path):
    (tmp_path / "bad.toml").write_text("[train]\nstepz = 3\n")
    r = ultrascale("train", "--config", str(tmp_path / "bad.toml"))
    assert r.returncode == 2 and "unknown key 'stepz'" in r.stderr


def test_nproc_launches_data_parallel_processes_that_match_one_process(tmp_path):
    # The check of the data-parallel chapter, end to end through the launcher: 4 ranks x 2 micro-batches
    # of 2 sequences is the global batch of 16 that one process takes in one micro-batch.
    one, four = tmp_path / "one.jsonl", tmp_path / "four.jsonl"
    common = ["--model", "tiny", "--seq-len", "32", "--steps", "4", "--no-progress"]
    assert ultrascale("train", *common, "--micro-batch", "16", "--log-jsonl", str(one)).returncode == 0
    r = ultrascale("train", *common, "--nproc", "4", "--dp", "4", "--zero", "2", "--micro-batch", "2",
                   "--grad-accum", "2", "--log-jsonl", str(four))
    assert r.returncode == 0, r.stderr
    assert worst(abs(a - b) / b for a, b in zip(losses(four), losses(one))) < 1e-4
    # The optimizer state is sharded four ways in the log.
    mem = json.loads(open(four).readline())["memory"]
    assert mem["optim"] * 4 == json.loads(open(one).readline())["memory"]["optim"]


def test_context_parallel_from_the_command_line_matches_one_process(tmp_path, monkeypatch):
    # Two processes share every sequence (zig-zag shards of 16 tokens): the same global batch as one process,
    # and the logged loss is the mean over both shards' tokens.
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    common = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "3", "--no-progress"]
    assert ultrascale("train", *common, "--log-jsonl", str(one)).returncode == 0
    # The ranks as fresh interpreters (`python -m ultrascale`), the launcher's start where fork() is not
    # safe (macOS); every other --nproc run here forks them from the launcher.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["train", *common, "--nproc", "2", "--cp", "2", "--cp-attention", "zigzag", "--log-jsonl", str(two)]
    assert launch_local(argv, 2) == 0
    assert worst(abs(a - b) / b for a, b in zip(losses(two), losses(one))) < 1e-5


def test_ranks_are_forked_only_for_runs_that_cannot_touch_cuda():
    # A rank forked from a launcher that queried CUDA cannot use CUDA: runs that may use it start their
    # ranks as fresh interpreters.
    import torch

    from ultrascale.cli import _cpu_only

    assert _cpu_only("cpu") and not _cpu_only("cuda")
    assert _cpu_only("auto") == (torch.version.cuda is None and getattr(torch.version, "hip", None) is None)


# -- a run that diverges ---------------------------------------------------------------------------
DIVERGING = ["--model", "tiny", "--seq-len", "16", "--no-progress", "--peak", "1", "--lr", "1e30", "--warmup-steps", "0"]


def test_a_diverged_run_stops_in_one_line_before_the_update_and_keeps_the_last_save(tmp_path):
    # lr 1e30: step 1 moves every weight by ~1e30, so step 2's activations overflow fp32.
    from ultrascale.train.checkpoint import read_full_state
    from ultrascale.train.record import verified

    ck = str(tmp_path / "ck")
    r = ultrascale("train", *DIVERGING, "--steps", "6", "--nproc", "2", "--dp", "2", "--save", ck, "--save-every", "1",
                   "--lr-schedule", "constant")
    assert r.returncode == 1 and "done:" not in r.stdout, r.stderr
    [line] = r.stderr.splitlines()  # one line: the rank logs are not kept for it
    assert re.fullmatch(rf"ultrascale: error: step 2: the gradient norm is (nan|inf): training diverged, and "
                        rf"stopped before this step's update \({re.escape(ck)} holds step 1, saved before it\)\. "
                        rf"Start again with a lower --lr \(now 1e\+30, 1e\+30 at this step\) or a longer "
                        rf"--warmup-steps \(now 0\); or go back to step 1 with --resume {re.escape(ck)} "
                        rf"--override-schedule and a lower --lr", line), line
    # The save of step 1 is whole and finite, and nothing after it was written.
    assert verified(ck).step == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    _, state = read_full_state(ck)
    assert all(bool(t.isfinite().all()) for t in state.values() if t.is_floating_point())


def test_fp16_overflowing_at_the_smallest_loss_scale_stops_instead_of_skipping_every_step(tmp_path):
    # Step 1 is finite; steps 2 to 17 overflow at 2^16 ... 2 and are skipped, each halving the scale;
    # step 18 overflows at 1, with no scale left to try.
    r = ultrascale("train", *DIVERGING, "--steps", "40", "--dtype", "fp16", "--log-jsonl", str(tmp_path / "log"))
    assert r.returncode == 1, r.stderr
    [line] = r.stderr.splitlines()
    assert re.fullmatch(r"ultrascale: error: step 18: the gradients overflow fp16 at loss scale 1, the smallest: "
                        r"training diverged, and stopped before this step's update\. Start again with a lower "
                        r"--lr \(now 1e\+30, [0-9.]+e\+29 at this step\) or a longer --warmup-steps \(now 0\), or "
                        r"--dtype bf16", line), line
    logged = [json.loads(x) for x in open(tmp_path / "log")]
    assert [m["loss_scale"] for m in logged] == [2.0 ** 16] + [2.0 ** 16 / 2 ** k for k in range(16)]
    assert not logged[0]["skipped"] and all(m["skipped"] for m in logged[1:])
    assert not math.isfinite(logged[-1]["loss"])


def test_override_schedule_resumes_with_another_learning_rate(tmp_path):
    # The field's way back from a divergence: the last save, a lower lr. Steps 3-4 of an
    # uninterrupted run at lr 3e-3, against steps 3-4 resumed from step 2 at lr 1e-3.
    ck, straight, resumed = str(tmp_path / "ck"), str(tmp_path / "straight.jsonl"), str(tmp_path / "resumed.jsonl")
    # (The decay's length given: without it each run's schedule would follow its own --steps.)
    run = [*TINY, "--seed", "3", "--warmup-steps", "1", "--lr-decay-steps", "4"]
    assert ultrascale("train", *run, "--steps", "4", "--log-jsonl", straight).returncode == 0
    assert ultrascale("train", *run, "--steps", "2", "--save", ck).returncode == 0
    r = ultrascale("train", "--resume", ck, "--steps", "4", "--lr", "1e-3", "--no-progress")
    assert r.returncode == 2 and r.stderr == (
        f"ultrascale: error: --resume {ck} was trained with --lr 0.003, this run asks for 0.001: drop --lr to "
        f"continue the run, or add --override-schedule to continue it with this --lr\n")
    r = ultrascale("train", "--resume", ck, "--steps", "4", "--lr", "1e-3", "--override-schedule", "--no-progress",
                   "--log-jsonl", resumed)
    assert r.returncode == 0, r.stderr
    want, got = [json.loads(x) for x in open(straight)][2:], [json.loads(x) for x in open(resumed)]
    # The schedule is lr times a curve of the step alone: the same curve, a third of the height.
    assert [m["step"] for m in got] == [3, 4]
    assert all(abs(g["lr"] / w["lr"] - 1 / 3) <= 1e-12 for g, w in zip(got, want))
    # Step 3's forward runs on the weights of step 2, the same in both; its update is the first to differ.
    assert abs(got[0]["loss"] - want[0]["loss"]) <= FP32.loss_rtol * want[0]["loss"]
    assert abs(got[1]["loss"] - want[1]["loss"]) > 1e-4 * want[1]["loss"]
    r = ultrascale("train", *run, "--steps", "2", "--override-schedule")
    assert r.returncode == 2 and r.stderr.startswith("ultrascale: error: --override-schedule changes the schedule")
