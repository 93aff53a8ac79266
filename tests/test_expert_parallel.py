"""Expert parallelism on real gloo processes: the dispatch alone, then training against one process."""

import dataclasses

import pytest
import torch

from ultrascale.config import ConfigError, ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.model import get_preset
from ultrascale.testing.compare import FP32, check_against_single, compare_against_single, worst
from ultrascale.testing.harness import run_distributed, worker_context
from ultrascale.testing.cli import ultrascale as forked_ultrascale


def _identity(x, counts):
    assert sum(counts) == x.shape[0]
    return x * 1.0


def _round_trip(dispatch):
    """Top-1 routing with weight 1 through identity experts: the combine must return the input."""
    from ultrascale.parallel.expert import AllGatherDispatch, AllToAllDispatch

    ctx = worker_context(ParallelConfig(dp=2, ep=2))
    rank, group = ctx.index("ep"), ctx.group("ep")
    d = AllToAllDispatch(group, 2, 4) if dispatch == "alltoall" else AllGatherDispatch(group, 2, 4, rank)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randn(6, 8, generator=g, requires_grad=True)
    experts = torch.randint(0, 4, (6,), generator=g)
    weights = torch.ones(6, requires_grad=True)
    out = d(tokens, torch.arange(6), experts, weights, _identity)
    upstream = torch.randn(6, 8, generator=g)
    (out * upstream).sum().backward()
    return (torch.equal(out, tokens), torch.equal(tokens.grad, upstream),
            torch.allclose(weights.grad, (tokens * upstream).sum(1)))


@pytest.mark.parametrize("dispatch", ["alltoall", "allgather"])
def test_dispatch_then_combine_with_identity_experts_returns_the_input(dispatch):
    assert run_distributed(2, _round_trip, dispatch) == [(True, True, True)] * 2


def _no_tokens_for_rank_1(dispatch):
    from ultrascale.model.moe import Experts
    from ultrascale.parallel.expert import AllGatherDispatch, AllToAllDispatch

    ctx = worker_context(ParallelConfig(dp=2, ep=2))
    rank, group = ctx.index("ep"), ctx.group("ep")
    d = AllToAllDispatch(group, 2, 4) if dispatch == "alltoall" else AllGatherDispatch(group, 2, 4, rank)
    experts = Experts(2, 8, 16)
    torch.nn.init.normal_(experts.gate), torch.nn.init.normal_(experts.up), torch.nn.init.normal_(experts.down)
    tokens = torch.randn(5, 8)
    out = d(tokens, torch.arange(5), torch.zeros(5, dtype=torch.long), torch.ones(5), experts)  # all to expert 0
    out.sum().backward()
    return [float(p.grad.abs().sum()) for p in (experts.gate, experts.up, experts.down)]


@pytest.mark.parametrize("dispatch", ["alltoall", "allgather"])
def test_an_expert_that_receives_no_token_gets_a_zero_gradient(dispatch):
    r0, r1 = run_distributed(2, _no_tokens_for_rank_1, dispatch, timeout=60)
    assert min(r0) > 0  # rank 0 holds expert 0, which got every token
    assert r1 == [0.0, 0.0, 0.0]


def config(dp, ep, steps=3, grad_accum=1, model=None, **parallel):
    t = TrainConfig(steps=steps, seq_len=16, micro_batch=2, grad_accum=grad_accum, seed=3, progress=False,
                    measure_activations=False)
    model = model or get_preset("tiny-moe", aux_loss_coef=0.0)  # dropless, no aux: the whole-batch control
    return RunConfig(model=model, parallel=ParallelConfig(dp=dp, ep=ep, bucket_mb=0.05, **parallel), train=t)


LAYOUTS = {
    "ep2, all-to-all": (2, config(2, 2)),
    "ep2, all-gather": (2, config(2, 2, dispatch="allgather")),
    "ep4 (dp4), grad accum 2": (4, config(4, 4, grad_accum=2)),
    "dp4 x ep2, ZeRO-1": (4, config(4, 2, zero=1)),
    "dp4 x ep2, ZeRO-2": (4, config(4, 2, zero=2)),
    "dp2 x ep2, tp2": (4, config(2, 2, tp=2)),
    "dp2 x ep2, tp2 + SP": (4, config(2, 2, tp=2, sp=True, dispatch="allgather")),
    "dp2 x ep2, pp2 1F1B": (4, config(2, 2, pp=2, grad_accum=2)),
    "dp2 x ep2, pp2 zero-bubble": (4, config(2, 2, pp=2, grad_accum=2, pp_schedule="zero-bubble")),
    # Capacity and the aux loss are per-micro-batch statistics: the control sees the same micro-batches.
    "ep2, capacity 1.0 + aux loss + bias, all-gather": (2, config(
        2, 2, grad_accum=2, dispatch="allgather",
        model=get_preset("tiny-moe", capacity_factor=1.0, aux_loss_coef=0.01, z_loss_coef=1e-3, router_bias_rate=1e-3))),
    "dp4 x ep2, capacity 1.0 + aux loss": (4, config(4, 2, model=get_preset("tiny-moe", capacity_factor=1.0))),
}


def _bf16(cfg):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype="bf16"))


# Two steps: experts see other batch shapes under ep, so bf16 rounds their outputs differently
# and by the third step a near-tied top-k choice can flip, moving the router by ~2e-2 of sum(lr)
# (measured); over two steps parameters agree to 1.6e-3 and step-1 gradients to 2.4e-3.
LAYOUTS["ep2, bf16 (against the same micro-batches)"] = (2, _bf16(config(2, 2, steps=2)))


@pytest.mark.equivalence
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_matches_the_single_process_run(label):
    world, cfg = LAYOUTS[label]
    c = check_against_single(label, cfg, world)
    if cfg.model.capacity_factor:
        assert c.max_loss_rel <= FP32.loss_rtol


@pytest.mark.parametrize("fault,world,cfg", [
    ("expert-grads-averaged-over-edp", 2, config(2, 2, steps=2)),
    ("expert-grads-averaged-over-edp", 4, config(4, 2, steps=2)),
    ("all-to-all-backward-dropped", 2, config(2, 2, steps=2)),
    ("all-gather-backward-dropped", 2, config(2, 2, steps=2, dispatch="allgather")),
    ("all-to-all-backward-dropped", 4, config(2, 2, steps=2, pp=2, grad_accum=2)),
    ("expert-grads-averaged-over-edp", 4, config(2, 2, steps=2, tp=2)),
    ("expert-grads-averaged-over-edp", 2, config(2, 2, steps=2, model=get_preset("tiny-moe", capacity_factor=1.0))),
    ("expert-norm-counted-per-replica", 4, config(4, 2, steps=2)),
])
def test_the_comparison_rejects_a_wrong_expert_parallel_engine(fault, world, cfg):
    (c,) = compare_against_single(f"ep {cfg.parallel.ep} dp {cfg.parallel.dp}", cfg, world, fault=fault)
    assert c.failures(FP32), c.line()
    if fault == "expert-norm-counted-per-replica":  # the gradients are right; the norm that clips them is not
        assert c.max_grad_rel_l2 <= FP32.grad_rtol and c.max_norm_rel > 10 * FP32.norm_rtol, c.line()
    else:  # far from rounding: the algebra is wrong
        assert c.max_grad_rel_l2 > 1e-2, c.line()


@pytest.mark.parametrize("model,parallel,world,msg", [
    ("tiny-moe", dict(ep=3, dp=3), 3, "--ep 3 must divide the 8 experts"),
    ("tiny-moe", dict(ep=4, dp=2), 2, "--ep 4 must divide dp = 2"),
    ("tiny", dict(ep=2), 2, "model tiny is dense"),
    ("tiny-moe", dict(ep=2, dispatch="ring"), 2, "--dispatch must be alltoall or allgather"),
    ("tiny-moe", dict(ep=2, zero=3), 2, "--zero 3 with --ep"),
])
def test_bad_expert_layouts_are_refused_before_any_process(model, parallel, world, msg):
    cfg = RunConfig(model=get_preset(model), parallel=ParallelConfig(**parallel))
    with pytest.raises(ConfigError, match=msg):
        validate(cfg, world)


def test_bad_moe_flags_exit_2_with_one_line(tmp_path):
    import sys

    for args, msg in ((["--model", "tiny-moe", "--top-k", "9"], "--top-k 9 must be within 1..8"),
                      (["--model", "tiny-moe", "--capacity-factor", "-1"], "--capacity-factor must be 0"),
                      (["--model", "tiny", "--nproc", "2", "--ep", "2"], "model tiny is dense"),
                      (["--model", "tiny-moe", "--nproc", "2", "--ep", "2", "--dispatch", "ring"], "--dispatch must"),
                      (["--model", "tiny-moe", "--experts", "6", "--nproc", "4", "--ep", "4"], "must divide the 6")):
        r = forked_ultrascale("train", *args, cwd=tmp_path)  # forked from a warm server (testing/cli.py)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and msg in r.stderr, r.stderr


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (3, 2, 2, 3)])
def test_any_flat_range_of_an_nd_tensor_is_tiled_by_its_rectangles(shape):
    from ultrascale.parallel.placement import _rectangles

    n = int(torch.tensor(shape).prod())
    t = torch.arange(n).view(shape)
    for a in range(n + 1):
        for e in range(a, n + 1):
            seen = []
            for offsets, sizes, start in _rectangles(shape, a, e):
                block = t[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))].flatten().tolist()
                assert block == list(range(start, start + len(block)))  # contiguous, where it says
                seen += block
            assert seen == list(range(a, e))


CK_LAYOUTS = {"1 process": (1, dict()), "dp2 x ep2, ZeRO-1": (2, dict(dp=2, ep=2, zero=1)),
              "dp4 x ep2": (4, dict(dp=4, ep=2)), "dp4 x ep2, ZeRO-1": (4, dict(dp=4, ep=2, zero=1)),
              "dp2 x ep2 x tp2": (4, dict(dp=2, ep=2, tp=2))}


def ck_config(world, steps, save="", resume="", **parallel):
    dp = parallel.get("dp", 1)
    t = TrainConfig(steps=steps, seq_len=16, micro_batch=2, grad_accum=4 // dp, seed=5, progress=False,
                    measure_activations=False, save=save, resume=resume)
    model = get_preset("tiny-moe", router_bias_rate=1e-2)  # the bias is state too: it must resume
    return RunConfig(model=model, parallel=ParallelConfig(bucket_mb=0.05, **parallel), train=t)


def _run(world, cfg):
    from ultrascale.testing.compare import train_on

    got = train_on(cfg, world)
    return got.losses, got.state


@pytest.mark.parametrize("saved,resumed", [("dp2 x ep2, ZeRO-1", "1 process"), ("1 process", "dp4 x ep2"),
                                          ("dp4 x ep2, ZeRO-1", "dp2 x ep2 x tp2"), ("dp2 x ep2 x tp2", "dp4 x ep2")])
def test_expert_shards_checkpoint_and_resume_in_another_layout(tmp_path, saved, resumed):
    ck = str(tmp_path / "ck")
    (w1, p1), (w2, p2) = CK_LAYOUTS[saved], CK_LAYOUTS[resumed]
    head, _ = _run(w1, ck_config(w1, 2, save=ck, **p1))
    tail, state = _run(w2, ck_config(w2, 4, resume=ck, **p2))
    ref_losses, ref_state = _run(1, ck_config(1, 4))
    assert worst(abs(a - b) / b for a, b in zip(head + tail, ref_losses)) <= FP32.loss_rtol
    from ultrascale.train.optim import lr_at

    travel = sum(lr_at(step, ck_config(1, 4).train) for step in (2, 3))  # how far AdamW moves steps 3, 4
    moved = worst((state[n] - p).abs().mean().item() / travel for n, p in ref_state.items())
    assert moved <= FP32.param_mean, moved


@pytest.mark.parametrize("dp,ep,zero,dtype", [(1, 1, 0, "bf16"), (2, 2, 0, "fp32"), (4, 2, 2, "bf16")])
def test_the_planner_predicts_the_engines_moe_memory(dp, ep, zero, dtype):
    from ultrascale.plan.calibration import engine_here
    from ultrascale.plan.layout import Layout, check_layout
    from ultrascale.plan.memory import memory_plan
    from ultrascale.plan.precision import ENGINE_PRECISION
    from ultrascale.plan.shape import from_model_config
    from ultrascale.testing.compare import train_parallel, train_single

    t = TrainConfig(steps=1, seq_len=32, micro_batch=2, seed=3, dtype=dtype, progress=False)
    cfg = RunConfig(model=get_preset("tiny-moe"), parallel=ParallelConfig(dp=dp, ep=ep, zero=zero, bucket_mb=0.05),
                    train=t)
    lay = Layout(dp=dp, ep=ep, zero=zero, micro_batch=2, grad_accum=1, seq_len=32,
                 precision=ENGINE_PRECISION[dtype], bucket_mb=0.05)
    shape = from_model_config(cfg.model)
    check_layout(lay, shape)
    plan = memory_plan(shape, lay, engine_here(dtype)).peak.terms  # the attention kernel the engine runs here
    got = [train_single(cfg).metrics[0]["memory"]] if dp == 1 else [r.memory[0] for r in train_parallel(cfg, dp)]
    for k in ("params", "grads", "optim"):  # the planner's per-GPU figure is the largest rank's
        assert plan[k] == max(m[k] for m in got), (k, plan[k], [m[k] for m in got])
    # Activations: the planner assumes a balanced router; the copies a rank's experts process
    # average k per local token over the expert group, so the mean over ranks is what it predicts.
    measured = sum(m["activations"] for m in got) / len(got)
    assert abs((plan["activations"] + plan["logits"]) / measured - 1) <= 0.05
