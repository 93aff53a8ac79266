"""The single-process trainer: accumulation, precision, recomputation, memory, checkpoints."""

import dataclasses

import pytest
import torch

from ultrascale.config import RunConfig, TrainConfig
from ultrascale.model import count_params, get_preset
from ultrascale.testing.compare import RunRecord, assert_matches, compare, train_single


def run(steps=6, **train):
    t = dataclasses.replace(TrainConfig(steps=steps, seq_len=32, micro_batch=8, seed=1, progress=False), **train)
    return train_single(RunConfig(model=get_preset("tiny"), train=t))


def test_the_loss_falls():
    losses = run(steps=15).losses
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.equivalence
@pytest.mark.parametrize("micro_batch,grad_accum", [(4, 2), (2, 4), (1, 8)])
def test_gradient_accumulation_averages_over_the_global_batch(micro_batch, grad_accum):
    ref = run()
    acc = run(micro_batch=micro_batch, grad_accum=grad_accum)
    assert_matches(compare(f"grad accum mb {micro_batch} x {grad_accum} vs mb 8", RunRecord.of(ref),
                           RunRecord.of(acc)))


@pytest.mark.equivalence
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_changes_memory_not_results(mode):
    ref = run(steps=3)
    rec = run(steps=3, recompute=mode)
    c = compare(f"recompute {mode} vs none", RunRecord.of(ref), RunRecord.of(rec))
    # Recomputation replays the same kernels on the same inputs: bit-identical.
    assert c.max_loss_rel == c.max_grad_rel_l2 == c.max_param_abs == 0, c.line()
    assert rec.metrics[0]["memory"]["activations"] < ref.metrics[0]["memory"]["activations"]


def test_full_recompute_keeps_less_than_selective():
    sel = run(steps=1, recompute="selective").metrics[0]["memory"]["activations"]
    full = run(steps=1, recompute="full").metrics[0]["memory"]["activations"]
    assert full < sel


def test_activation_bytes_grow_linearly_with_the_micro_batch():
    a1, a2, a4 = (run(steps=1, micro_batch=b).metrics[0]["memory"]["activations"] for b in (1, 2, 4))
    # Every saved tensor but a few scalars has the batch as a dimension; views that
    # alias at batch 1 but not above make the growth a hair off exact.
    assert abs(a2 / a1 - 2) < 0.01 and abs(a4 / a2 - 2) < 0.01, (a1, a2, a4)


def test_bf16_stays_close_to_fp32():
    fp32 = run(steps=10)
    bf16 = run(steps=10, dtype="bf16")
    rel = max(abs(a - b) / a for a, b in zip(fp32.losses, bf16.losses))
    # bf16 keeps 8 bits of mantissa: the loss agrees to about 1%, and still falls.
    assert rel < 0.02, rel
    assert bf16.losses[-1] < bf16.losses[0] - 0.3


@pytest.mark.parametrize("dtype,per_param", [("fp32", (4, 4, 8)), ("bf16", (2, 4, 12))])
def test_memory_by_owner_matches_the_precision_recipe(dtype, per_param):
    # fp32: 4 bytes of weights, 4 of gradients, Adam's two moments (8).
    # bf16: 2-byte weights, fp32 gradients (4), and fp32 master weights + moments (k = 12).
    n = count_params(get_preset("tiny"))
    mem = run(steps=1, dtype=dtype).metrics[0]["memory"]
    assert (mem["params"], mem["grads"], mem["optim"]) == tuple(k * n for k in per_param)


def test_resume_continues_with_the_same_losses(tmp_path):
    straight = run(steps=8)
    first = run(steps=4, save=str(tmp_path / "ck"))
    second = run(steps=8, resume=str(tmp_path / "ck"))
    assert first.losses + second.losses == straight.losses
    for name, p in straight.state.items():
        assert torch.equal(p, second.state[name]), name


def test_resume_in_bf16_is_exact(tmp_path):
    straight = run(steps=4, dtype="bf16")
    run(steps=2, dtype="bf16", save=str(tmp_path / "ck"))
    second = run(steps=4, dtype="bf16", resume=str(tmp_path / "ck"))
    assert second.losses == straight.losses[2:]


def test_save_replaces_the_previous_checkpoint_atomically(tmp_path):
    ck = tmp_path / "ck"
    run(steps=2, save=str(ck), save_every=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert sorted(p.name for p in ck.iterdir()) == [".metadata", "__0_0.distcp", "meta.json"]


def test_jsonl_log_has_the_documented_fields(tmp_path):
    import json

    log = tmp_path / "log.jsonl"
    run(steps=3, log_jsonl=str(log))
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "tflops", "mfu", "memory"} <= r.keys()
        assert {"params", "grads", "optim", "activations"} <= r["memory"].keys()
        assert r["tokens"] == 8 * 32
        # No datasheet knows a CPU: its ceiling is measured at start-up (train/peak.py).
        assert r["peak_source"] == "measured" and r["mfu"] == pytest.approx(r["tflops"] / r["peak_tflops"])
