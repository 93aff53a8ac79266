"""Precision recipes beyond fp32/bf16: fp16 with dynamic loss scaling, and FP8 linear layers.

Each recipe is compared with the fp32 run over a few steps (a bound measured here,
written next to it), and each check is seen to fail on a deliberately wrong variant.
"""

import dataclasses

import pytest
import torch

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.distributed.context import build_context
from ultrascale.model import get_preset
from ultrascale.testing.compare import (BF16, check_against_single, compare_against_single, train_parallel,
                                        train_single)
from ultrascale.train.loss_scale import DynamicLossScaler
from ultrascale.train.trainer import Trainer


def train_cfg(steps=6, model="tiny", **train):
    t = dataclasses.replace(TrainConfig(steps=steps, seq_len=32, micro_batch=8, seed=1, progress=False), **train)
    return RunConfig(model=get_preset(model), train=t)


def run(steps=6, **train):
    return train_single(train_cfg(steps, **train))


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# -- fp16 -----------------------------------------------------------------------------------
def test_fp16_stays_close_to_fp32(monkeypatch):
    fp32 = run()
    fp16 = run(dtype="fp16")
    # Measured over 6 steps (10 give the same): loss rel 1.7e-5, grad norm rel < 1e-3; bf16 reaches 5e-4
    # on the loss: fp16 keeps 10 mantissa bits to bf16's 7. No step overflows at the initial 2^16.
    assert max_rel(fp16.losses, fp32.losses) < 2e-4
    norms = lambda r: [m["grad_norm"] for m in r.metrics]  # noqa: E731
    assert max_rel(norms(fp16), norms(fp32)) < 1e-2
    assert [m["loss_scale"] for m in fp16.metrics] == [2.0 ** 16] * 6
    assert not any(m["skipped"] for m in fp16.metrics)
    assert fp16.losses[-1] < fp16.losses[0] - 0.5

    # A scaler that forgets to divide the gradients by the scale: clipping and Adam hide it
    # from the loss (Adam divides any constant away), but the gradient norm is off by 2^16.
    monkeypatch.setattr(DynamicLossScaler, "unscale_and_check", lambda self, grads, world: True)
    wrong = run(steps=2, dtype="fp16")
    assert max_rel(norms(wrong), norms(fp32)[:2]) > 1e3


def _trainer(cfg):
    return Trainer(validate(cfg, 1), build_context(cfg.parallel, 0, 1))


def test_an_overflow_skips_the_step_and_backs_off_the_scale():
    # 2^40 times the loss overflows fp16's gradients (max 65504): each step is skipped on
    # inf/nan, the scale halves, and the parameters do not move.
    trainer = _trainer(train_cfg(steps=3, dtype="fp16", loss_scale_init=2.0 ** 40))
    before = trainer.full_state_dict()
    result = trainer.fit()
    assert [m["skipped"] for m in result.metrics] == [True] * 3
    assert [m["loss_scale"] for m in result.metrics] == [2.0 ** 40, 2.0 ** 39, 2.0 ** 38]
    assert trainer.scaler.scale == 2.0 ** 37
    assert all(m["grad_norm"] is None for m in result.metrics)
    for name, p in before.items():
        assert torch.equal(p, result.state[name]), name
    assert not trainer.opt.state  # AdamW never stepped: no moments were made

    # Growth: after `window` finite steps in a row the scale doubles.
    grown = run(steps=5, dtype="fp16", loss_scale_init=16.0, loss_scale_window=2)
    assert [m["loss_scale"] for m in grown.metrics] == [16.0, 16.0, 32.0, 32.0, 64.0]
    assert not any(m["skipped"] for m in grown.metrics)


def test_the_scaler_alone():
    s = DynamicLossScaler(init_scale=8.0, window=3)
    grads = [torch.tensor([8.0, 16.0]), torch.tensor([float("nan")])]
    assert not s.unscale_and_check(grads, world=False)
    assert grads[0].tolist() == [1.0, 2.0]  # unscaled in place
    s.update(False)
    assert s.scale == 4.0
    for _ in range(3):
        assert s.unscale_and_check([torch.ones(2)], world=False)
        s.update(True)
    assert s.scale == 8.0 and s.good_steps == 0


def fp16_dp_config(**parallel):
    p = ParallelConfig(bucket_mb=0.05, **parallel)
    t = TrainConfig(steps=4, seq_len=32, micro_batch=2, grad_accum=2, seed=5, dtype="fp16", progress=False)
    return RunConfig(model=get_preset("tiny", layers=2), parallel=p, train=t)


@pytest.mark.equivalence
def test_fp16_data_parallel_matches_one_process_with_the_same_micro_batches():
    # Within the bf16 bounds of testing/compare.py. Measured: loss rel 4.5e-8, step-1 grad rel L2
    # 9e-11 (this CPU's fp16 matmuls accumulate in fp32: the same micro-batches round alike).
    check_against_single("fp16 dp 2 bucket", fp16_dp_config(dp=2), 2)
    # The same check rejects fp16 data parallelism that averages over N + 1 ranks.
    c = compare_against_single("fp16 dp 2 bucket", fp16_dp_config(dp=2), 2, fault="dp-wrong-group-size")[0]
    assert c.failures(BF16), c.line()


def test_an_overflow_on_one_rank_is_skipped_by_every_rank():
    cfg = validate(fp16_dp_config(dp=2, zero=1), 2)  # ZeRO-1: each rank sees only its shard's gradients
    ok = train_parallel(cfg, 2, fault="fp16-inf-on-last-rank")
    for rank in ok:
        assert rank.grad_norms[0] is None and None not in rank.grad_norms[1:]
    for name, p in ok[0].state.items():
        assert torch.equal(p, ok[1].state[name]), name
    # Each rank deciding alone (plain data parallelism, where the stepping rank meets no collective
    # the skipping one misses): rank 0 steps, rank 1 skips, and the replicas part for good. Under
    # ZeRO the lone step even deadlocks: the stepping rank all-gathers its shard alone.
    bad = train_parallel(validate(fp16_dp_config(dp=2), 2), 2, fault="fp16-skip-decided-locally")
    assert bad[0].grad_norms[0] is not None and bad[1].grad_norms[0] is None
    assert any(not torch.equal(p, bad[1].state[n]) for n, p in bad[0].state.items())


def test_fp16_on_a_device_without_its_kernels_is_refused_in_one_line(capsys, monkeypatch, tmp_path):
    # This CPU runs fp16; a build without a Half kernel fails the probe the same way.
    import torch.nn.functional as F

    def missing(*a, **k):
        raise RuntimeError('"scaled_dot_product_attention" not implemented for \'Half\'')

    monkeypatch.setattr(F, "scaled_dot_product_attention", missing)
    from ultrascale.cli import main

    code = main(["train", "--model", "tiny", "--steps", "1", "--dtype", "fp16", "--save", str(tmp_path / "ck")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--dtype fp16" in err[0] and "not implemented for 'Half'" in err[0] and "use --dtype fp32 or bf16" in err[0]
    assert not (tmp_path / "ck").exists()

