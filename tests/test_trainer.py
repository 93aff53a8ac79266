"""The single-process trainer: accumulation, precision, recomputation, memory, checkpoints."""

import dataclasses

import pytest
import torch

from ultrascale.config import RunConfig, TrainConfig
from ultrascale.model import count_params, get_preset
from ultrascale.testing.compare import RunRecord, assert_matches, compare, train_single, worst


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
    rel = worst(abs(a - b) / a for a, b in zip(fp32.losses, bf16.losses))
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
    # One schedule for all three (the decay would otherwise follow each run's own --steps).
    straight = run(steps=8, lr_decay_steps=8)
    first = run(steps=4, save=str(tmp_path / "ck"), lr_decay_steps=8)
    second = run(steps=8, resume=str(tmp_path / "ck"), lr_decay_steps=8)
    assert first.losses + second.losses == straight.losses
    for name, p in straight.state.items():
        assert torch.equal(p, second.state[name]), name


def test_resume_in_bf16_is_exact(tmp_path):
    straight = run(steps=4, dtype="bf16", lr_decay_steps=4)
    run(steps=2, dtype="bf16", save=str(tmp_path / "ck"), lr_decay_steps=4)
    second = run(steps=4, dtype="bf16", resume=str(tmp_path / "ck"), lr_decay_steps=4)
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


def _adamw_on_pieces(cuts, grads, step_fn=None):
    """The engine's AdamW (train/optim.py) on one tensor cut into ZeRO-like shards at `cuts`, for len(grads)
    steps; the shards joined back. step_fn replaces the optimizer's step (for a deliberately wrong one)."""
    from ultrascale.train.optim import build_adamw

    t = TrainConfig(lr=1e-2, weight_decay=0.1)
    pieces = [x.clone() for x in torch.tensor_split(torch.linspace(-1, 1, 1001), cuts)]
    opt = build_adamw(pieces, [True] * len(pieces), t)
    for g in grads:
        for p, gp in zip(pieces, torch.tensor_split(g, cuts)):
            p.grad = gp.clone()
        (step_fn or (lambda o, ps: o.step()))(opt, pieces)
    return torch.cat([p.detach() for p in pieces])


def _lamb_like(opt, pieces):
    # A realistic mistake for a sharded optimizer: an update scaled by the norm of the tensor it is
    # given (LAMB's trust ratio), which on a shard is the shard's norm, not the parameter's.
    opt.step()
    with torch.no_grad():
        for p in pieces:
            p.mul_(1 + 1e-3 * p.norm() / p.numel() ** 0.5)


@pytest.mark.parametrize("wrong", [False, True], ids=["adamw", "wrong-per-shard-norm"])
def test_adamw_on_shards_cut_anywhere_equals_adamw_on_the_whole(wrong):
    # ZeRO hands the optimizer shards of the parameters: each element's update must not depend on
    # where the tensor was cut, beyond rounding (a cut moves the fused kernel's scalar tail, which
    # rounds a few elements an ulp or two apart from its vector body: 4.7e-10 here, where the
    # per-shard norm below moves them by 1.8e-3), and it must be AdamW's (float64, by hand).
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1001, generator=g) for _ in range(4)]
    step_fn = _lamb_like if wrong else None
    whole = _adamw_on_pieces([], grads, step_fn)
    sharded = [_adamw_on_pieces(c, grads, step_fn) for c in ([7], [1, 2, 3, 500], [333, 666], [1000])]
    gap = worst((whole - s).abs().max().item() for s in sharded)  # |values| <= 1.1: 1e-6 is ~16 ulps
    assert (gap <= 1e-6) != wrong, f"shards differ from the whole tensor by up to {gap:.1e}"
    if wrong:
        return
    lr, wd, (b1, b2), eps = 1e-2, 0.1, (0.9, 0.95), 1e-8
    t = TrainConfig(lr=lr, weight_decay=wd)
    assert (t.beta1, t.beta2, t.eps) == (b1, b2, eps)
    p, m, v = torch.linspace(-1, 1, 1001).double(), torch.zeros(1001, dtype=torch.float64), 0
    for k, gk in enumerate(grads, 1):
        gk = gk.double()
        m, v = b1 * m + (1 - b1) * gk, b2 * v + (1 - b2) * gk * gk
        p = p * (1 - lr * wd) - lr * (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + eps)
    torch.testing.assert_close(whole.double(), p, rtol=0, atol=1e-6)


@pytest.mark.parametrize("wrong", [False, True], ids=["norm", "wrong-shares-ignored"])
def test_clip_grad_norm_weighs_each_gradient_by_its_share(wrong):
    from ultrascale.train.optim import clip_grad_norm_

    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=g) for s in ((64, 32), (32,), (5, 7, 3))]
    shares = [1.0, 0.5, 0.25]  # e.g. a norm weight replicated on 2 ranks counts 1/2 on each
    want = sum(s * x.double().pow(2).sum() for s, x in zip(shares, grads)).sqrt().item()
    before = [x.clone() for x in grads]
    got = clip_grad_norm_(grads, 1.0, shares=None if wrong else shares)
    assert (abs(got - want) <= 1e-6 * want) != wrong, (got, want)
    if not wrong:  # clipped to norm 1 by one common factor
        for x, x0 in zip(grads, before):
            torch.testing.assert_close(x.double(), x0.double() / (want + 1e-6), rtol=1e-6, atol=0)


def test_a_dropped_trainer_is_freed_with_its_model_and_states():
    # A notebook or a benchmark builds several trainers in one process: each must go with its
    # last reference (a GPU's memory is given back only then; tests/test_gpu.py checks the card).
    import gc
    import weakref

    from ultrascale.config import validate
    from ultrascale.distributed.context import build_context
    from ultrascale.train.trainer import Trainer

    def build():
        t = TrainConfig(steps=10, seq_len=32, micro_batch=2, seed=1, progress=False, dtype="bf16")
        cfg = validate(RunConfig(model=get_preset("tiny"), train=t), 1)
        trainer = Trainer(cfg, build_context(cfg.parallel, 0, 1))
        trainer.train_step()
        return trainer

    trainer = build()
    alive = [weakref.ref(x) for x in (trainer, trainer.model, next(trainer.model.parameters()))]
    del trainer
    gc.collect()
    assert all(r() is None for r in alive), [r() is not None for r in alive]

    # The check sees a leak: a process-wide forward hook that keeps the model (the kind of
    # reference that would hold it) leaves the trainer's model alive.
    trainer = build()
    model = weakref.ref(trainer.model)
    kept = trainer.model
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o, kept=kept: None)
    del trainer, kept
    gc.collect()
    try:
        assert model() is not None
    finally:
        handle.remove()
    gc.collect()
    assert model() is None


def _params_left_after_dropping(cfgs):
    import gc
    import weakref

    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import Trainer

    left = []
    for cfg in cfgs:
        trainer = Trainer(cfg, worker_context(cfg.parallel))
        trainer.train_step()
        params = [weakref.ref(p) for p in trainer.model.parameters()]
        del trainer
        gc.collect()
        left.append(sum(r() is not None for r in params))
    return left


def test_a_dropped_trainer_is_freed_under_every_layout():
    # Each layout adds its own hooks (reductions, ZeRO's gathers, offload's copies, the pipeline's
    # stages): none may keep the model alive. The layouts of two ranks, in one pooled call.
    from ultrascale.config import ParallelConfig, validate
    from ultrascale.testing.harness import run_distributed

    layouts = [dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3),
               dict(dp=2, zero=1, offload="cpu"), dict(tp=2, sp=True), dict(pp=2, pp_schedule="1f1b"),
               dict(pp=2, pp_schedule="zero-bubble"), dict(cp=2), dict(dp=2, ep=2)]
    t = TrainConfig(steps=3, seq_len=32, micro_batch=1, grad_accum=2, seed=1, progress=False, dtype="bf16")
    cfgs = [validate(RunConfig(model=get_preset("tiny-moe" if "ep" in kw else "tiny"), parallel=ParallelConfig(**kw),
                               train=t), 2) for kw in layouts]
    for rank_left in run_distributed(2, _params_left_after_dropping, cfgs):
        assert rank_left == [0] * len(layouts), list(zip(layouts, rank_left))
