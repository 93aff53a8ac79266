"""Checkpoints that move between layouts: saved in one, resumed in another, the run goes on
as if never interrupted; and what a resume checks."""

import json
import functools
import os
import tempfile

import pytest
import torch

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import get_preset
from ultrascale.testing.cli import jsonl_losses, ultrascale
from ultrascale.testing.compare import FP32, train_on, train_single, worst
from ultrascale.train import checkpoint

GLOBAL_BATCH, SAVED_AT, STEPS = 12, 2, 4  # 12 sequences: 1, 2, 3 and 4 data-parallel ranks


def config(world, steps, save="", resume="", **parallel):
    """tiny with 4 layers (so pp 2 x 2 chunks fits); the same global batch in every layout."""
    p = ParallelConfig(bucket_mb=0.02, **parallel)
    per_rank = GLOBAL_BATCH // (world // (p.tp * p.pp * p.cp))
    micro_batch = 2 if per_rank % 2 == 0 else per_rank
    t = TrainConfig(steps=steps, seq_len=16, micro_batch=micro_batch, grad_accum=per_rank // micro_batch,
                    seed=4, progress=False, save=save, resume=resume)
    return RunConfig(model=get_preset("tiny", layers=4), parallel=p, train=t)


def run(world, cfg):
    got = train_on(cfg, world)
    return got.losses, got.state


@functools.lru_cache(maxsize=None)
def uninterrupted():
    r = train_single(config(1, STEPS))
    return r.losses, r.state, sum(m["lr"] for m in r.metrics[SAVED_AT:])


LAYOUTS = {  # name: (world, parallel)
    "1 process": (1, {}),
    "dp 2": (2, dict(dp=2)),
    "dp 2 zero 1": (2, dict(dp=2, zero=1)),
    "dp 2 zero 2": (2, dict(dp=2, zero=2)),
    "dp 2 zero 3": (2, dict(dp=2, zero=3)),
    "tp 2": (2, dict(tp=2)),
    "tp 2 + sp": (2, dict(tp=2, sp=True)),
    "pp 2 1f1b": (2, dict(pp=2)),
    "pp 2 interleaved x2": (2, dict(pp=2, pp_schedule="interleaved", pp_chunks=2)),
    "dp 2 x tp 2 + sp": (4, dict(dp=2, tp=2, sp=True)),
    "dp 2 x tp 2 zero 3": (4, dict(dp=2, tp=2, zero=3)),
    "dp 2 x pp 2 zero 1": (4, dict(dp=2, pp=2, zero=1)),
    "pp 2 x tp 2": (4, dict(pp=2, tp=2)),
    "dp 4 zero 2": (4, dict(dp=4, zero=2)),
    "dp 3 zero 3": (3, dict(dp=3, zero=3)),  # uneven shards, padded
    # Offloaded states save and load the same chunks (their files are anonymous: any writable directory).
    "dp 2 zero 1 offload cpu": (2, dict(dp=2, zero=1, offload="cpu")),
    "dp 2 zero 3 offload disk": (2, dict(dp=2, zero=3, offload="disk", offload_dir=tempfile.gettempdir())),
}

PAIRS = [
    ("dp 2", "1 process"), ("1 process", "dp 2 zero 3"), ("dp 2 zero 3", "tp 2 + sp"),
    ("tp 2 + sp", "pp 2 1f1b"), ("pp 2 interleaved x2", "dp 2 zero 1"), ("dp 2 zero 1", "dp 2 x tp 2 + sp"),
    ("dp 2 x tp 2 zero 3", "pp 2 x tp 2"), ("dp 2 x pp 2 zero 1", "dp 4 zero 2"), ("dp 4 zero 2", "tp 2"),
    ("tp 2", "dp 2 zero 2"), ("dp 3 zero 3", "dp 2 x tp 2 zero 3"), ("pp 2 x tp 2", "pp 2 interleaved x2"),
    ("dp 2 zero 1 offload cpu", "dp 2 zero 3 offload disk"), ("dp 2 zero 3 offload disk", "1 process"),
]


# Not marked `equivalence`: saving and loading move bits unchanged, so what another kernel set
# could change here is each layout's own rounding, which its equivalence test already checks
# under every kernel set.
@pytest.mark.parametrize("saved,resumed", PAIRS, ids=[f"{a}->{b}".replace(" ", "") for a, b in PAIRS])
def test_saved_in_one_layout_resumed_in_another(tmp_path, saved, resumed):
    ck = str(tmp_path / "ck")
    (w1, p1), (w2, p2) = LAYOUTS[saved], LAYOUTS[resumed]
    head, _ = run(w1, config(w1, SAVED_AT, save=ck, **p1))
    tail, state = run(w2, config(w2, STEPS, resume=ck, **p2))
    ref_losses, ref_state, travel = uninterrupted()
    losses = head + tail
    rel = worst(abs(a - b) / b for a, b in zip(losses, ref_losses))
    assert len(losses) == STEPS and rel <= FP32.loss_rtol, (saved, resumed, losses, ref_losses)
    # Masters and Adam's moments came back: the parameters follow the uninterrupted run.
    moved = worst((state[n] - p).abs().mean().item() / travel for n, p in ref_state.items())
    assert moved <= FP32.param_mean, (saved, resumed, moved)


def test_a_resume_without_the_optimizer_state_would_be_caught(tmp_path):
    # The check above is not blind to the optimizer: zeroing Adam's moments after loading
    # (a resume of the parameters alone) moves the continuation off the uninterrupted run.
    ck = str(tmp_path / "ck")
    run(2, config(2, SAVED_AT, save=ck, dp=2, zero=1))
    original = checkpoint.load

    def parameters_only(path, trainer):
        step = original(path, trainer)
        for state in trainer.opt.state.values():
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
        return step

    checkpoint.load = parameters_only
    try:
        tail, state = run(1, config(1, STEPS, resume=ck))
    finally:
        checkpoint.load = original
    ref_losses, ref_state, travel = uninterrupted()
    moved = worst((state[n] - p).abs().mean().item() / travel for n, p in ref_state.items())
    assert moved > FP32.param_mean, moved


def test_the_standard_tools_read_one_file_of_full_tensors(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ck = str(tmp_path / "ck")
    _, state = run(4, config(4, SAVED_AT, save=ck, dp=2, tp=2, zero=3))
    dcp_to_torch_save(ck, str(tmp_path / "one.pt"))
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    assert {k for k in one if k.startswith("model.")} == {f"model.{n}" for n in state}
    for name, value in state.items():
        assert torch.equal(one[f"model.{name}"], value), name
        assert one[f"optim.exp_avg_sq.{name}"].shape == value.shape
    record, full = checkpoint.read_full_state(ck)
    assert record.config.parallel.zero == 3 and all(torch.equal(full[n], v) for n, v in state.items())


def test_a_partial_save_is_cleaned_and_the_last_good_one_kept(tmp_path):
    ck = tmp_path / "ck"
    run(1, config(1, SAVED_AT, save=str(ck)))
    before = sorted(os.listdir(ck))
    (tmp_path / "ck.tmp").mkdir()  # what a save killed half-way leaves
    (tmp_path / "ck.tmp" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    assert checkpoint.read_record(str(ck)).step == SAVED_AT and sorted(os.listdir(ck)) == before
    run(1, config(1, STEPS, save=str(ck), resume=str(ck)))
    assert not (tmp_path / "ck.tmp").exists() and checkpoint.read_record(str(ck)).step == STEPS


# -- what a resume checks, from the command line ------------------------------------------
TINY = ["--model", "tiny", "--seq-len", "16", "--no-progress"]



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-process run with a non-default seed, batch split and dp mode, saved at step 2."""
    ck = str(tmp_path_factory.mktemp("resume") / "ck")
    r = ultrascale("train", *TINY, "--nproc", "2", "--dp-mode", "overlap", "--seed", "3", "--micro-batch", "2",
                   "--grad-accum", "2", "--steps", "2", "--save", ck)
    assert r.returncode == 0, r.stderr
    return ck


def test_resume_alone_continues_the_run_and_the_layout_is_free(saved, tmp_path):
    straight = str(tmp_path / "straight.jsonl")
    r = ultrascale("train", *TINY, "--seed", "3", "--micro-batch", "8", "--steps", "4", "--log-jsonl", straight)
    assert r.returncode == 0, r.stderr
    want = jsonl_losses(straight)[2:]
    for layout in ([], ["--nproc", "2", "--tp", "2"], ["--micro-batch", "4"]):
        log = str(tmp_path / f"r{len(layout)}.jsonl")
        r = ultrascale("train", "--resume", saved, "--steps", "4", "--log-jsonl", log, "--no-progress", *layout)
        assert r.returncode == 0, (layout, r.stderr)
        got = jsonl_losses(log)
        assert worst(abs(a - b) / b for a, b in zip(got, want)) <= 1e-5, (layout, got, want)


@pytest.mark.parametrize("args,message", [
    (["--seed", "4"], "trained with --seed 3, this run asks for 4: drop --seed"),
    (["--micro-batch", "2", "--grad-accum", "1"], "trained on 8 sequences per step, this run on 2"),
    (["--lr", "1e-2"], "trained with --lr 0.003"),
    (["--hidden", "32"], "holds a model with hidden = 64, this run asks for 32"),
    (["--micro-batch", "3"], "global batch is 8 sequences, which --micro-batch 3 x dp 1 does not divide"),
])
def test_a_resume_that_would_not_continue_the_run_names_the_setting(saved, args, message):
    r = ultrascale("train", "--resume", saved, "--steps", "4", "--nproc", "1", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_resume_already_finished_says_what_to_do(saved):
    r = ultrascale("train", "--resume", saved, "--steps", "2")
    assert r.returncode == 2 and "pass a larger --steps" in r.stderr and len(r.stderr.strip().splitlines()) == 1



@pytest.fixture(scope="module")
def saved_by_one_process(tmp_path_factory):
    """A step-2 checkpoint of tiny with 4 layers, 1 sequence x 4 micro-batches in one process; and
    the losses of the same run's 3 steps never interrupted (4 sequences in one micro-batch)."""
    root = tmp_path_factory.mktemp("one-process")
    ck, log = str(root / "ck"), str(root / "straight.jsonl")
    shape = [*TINY, "--layers", "4", "--peak", "1"]
    r = ultrascale("train", *shape, "--micro-batch", "1", "--grad-accum", "4", "--steps", "2", "--save", ck)
    assert r.returncode == 0, r.stderr
    r = ultrascale("train", *shape, "--micro-batch", "4", "--steps", "3", "--log-jsonl", log)
    assert r.returncode == 0, r.stderr
    return ck, jsonl_losses(log)


@pytest.mark.parametrize("schedule", ["interleaved", "dualpipe"])
def test_resume_into_a_pipeline_that_needs_more_micro_batches_chooses_them_first(saved_by_one_process, tmp_path,
                                                                                  schedule):
    # The interleaved schedule takes micro-batches in groups of pp, DualPipeV at least 2 x pp of them:
    # they are checked against the accumulation that keeps the checkpoint's global batch (4), not
    # against --grad-accum's default of 1.
    ck, straight = saved_by_one_process
    log = str(tmp_path / "resumed.jsonl")
    r = ultrascale("train", "--resume", ck, "--steps", "3", "--nproc", "2", "--pp", "2", "--pp-schedule", schedule,
                   "--pp-chunks", "2", "--log-jsonl", log, "--no-progress", "--peak", "1")
    assert r.returncode == 0, r.stderr
    got = jsonl_losses(log)
    assert len(got) == 1 and worst(abs(a - b) / b for a, b in zip(got, straight[2:])) <= 1e-5, (got, straight)


def test_a_save_onto_another_runs_checkpoint_is_refused_unless_overwrite(tmp_path):
    """--save onto a checkpoint of another run (model, seed or data) is refused in one line before
    anything runs, the checkpoint untouched; --overwrite replaces it; a resume saving back into its
    source continues it; the same run started again replaces its own."""
    ck = str(tmp_path / "ck")
    base = ["--steps", "1", "--seq-len", "16", "--micro-batch", "2", "--no-progress", "--peak", "1"]
    assert ultrascale("train", "--model", "tiny", *base, "--save", ck).returncode == 0
    meta = (tmp_path / "ck" / "meta.json").read_bytes()
    for other, said in ((["--model", "tiny-moe"], "(model 'tiny', this run 'tiny-moe')"),
                        (["--model", "tiny", "--seed", "3"], "(seed 0, this run 3)"),
                        (["--model", "tiny", "--seq-len", "32"], "(seq_len 16, this run 32)")):
        r = ultrascale("train", *base, *other, "--save", ck)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"--save {ck} holds the checkpoint of another run {said}: add --overwrite" in r.stderr
        assert (tmp_path / "ck" / "meta.json").read_bytes() == meta  # untouched
    assert ultrascale("train", "--model", "tiny", *base, "--save", ck).returncode == 0  # the same run again
    r = ultrascale("train", "--resume", ck, "--steps", "2", "--no-progress", "--save", ck)
    assert r.returncode == 0, r.stderr
    r = ultrascale("train", *base, "--model", "tiny-moe", "--save", ck, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ck" / "meta.json").read_text())["config"]["model"]["experts"] == 8
