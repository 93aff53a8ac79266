"""Context parallelism against one process: attention alone, then training, on real gloo processes.

Every expected value here comes from outside the code under test: positions
written out by hand, attention from scaled_dot_product_attention in float64,
log-sum-exp from the scores, losses and parameters from the single-process run.
Each comparison is also shown failing on a deliberately broken engine.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultrascale.config import ConfigError, ParallelConfig, RunConfig, TrainConfig, build_config, validate
from ultrascale.model import get_preset
from ultrascale.testing.compare import FP32, check_against_single, compare_against_single, train_single, worst
from ultrascale.testing.harness import run_distributed, worker_context

VARIANTS = ("allgather", "ring", "zigzag", "ulysses")
ATTENTION_RTOL = 1e-5  # fp32 against a float64 reference: measured <= 7.5e-7 (default, AVX2, AVX512 kernels)


# -- which tokens a rank holds ----------------------------------------------------
def expected_positions(seq, rank, cp, variant):
    """Written from the definition, not from the code: contiguous blocks (ring, Ulysses, the all-gather
    asked for contiguous shards), or chunks r and 2cp-1-r of 2cp (zig-zag, all-gather)."""
    if variant in ("zigzag", "allgather"):
        c = seq // (2 * cp)
        return list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))
    n = seq // cp
    return list(range(rank * n, (rank + 1) * n))


def test_shards_hold_the_documented_positions():
    from ultrascale.parallel.context import shard_positions

    assert [shard_positions(8, r, 2, "contiguous").tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [shard_positions(8, r, 2, "zigzag").tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [shard_positions(16, r, 4, "zigzag").tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    for cp in (2, 3, 4):
        every = sorted(p for r in range(cp) for p in shard_positions(24, r, cp, "zigzag").tolist())
        assert every == list(range(24))


def test_merging_two_blocks_equals_softmax_over_both():
    from ultrascale.parallel.context import blocks

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 8, generator=g), torch.randn(2, 3, 12, 8, generator=g), torch.randn(2, 3, 12, 8,
                                                                                                         generator=g)
    out, lse = blocks.start(q)
    for keys in (slice(0, 7), slice(7, 12)):  # unequal blocks: the merge does not care
        blocks.merge(out, lse, *blocks.block_forward(q, k[:, :, keys], v[:, :, keys], False, 8 ** -0.5))
    kk, vv = k.repeat_interleave(2, 1).double(), v.repeat_interleave(2, 1).double()
    scores = q.double() @ kk.transpose(-1, -2) / math.sqrt(8)
    torch.testing.assert_close(out.double(), scores.softmax(-1) @ vv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), rtol=1e-6, atol=1e-6)


def test_a_block_neither_builds_nor_keeps_its_score_matrix():
    # The fused kernel tiles the scores: the largest allocation of a block's forward + backward is a
    # tile (per thread: one thread here), well below one head's m x n scores. The math, the wrong
    # variant, allocates the whole block's; and under autograd it would keep it for backward.
    from torch.profiler import ProfilerActivity, profile

    from ultrascale.parallel.context import blocks
    from ultrascale.train.metrics import ActivationMeter

    m = n = 1024
    q, k, v = (torch.randn(1, h, m, 8) for h in (2, 1, 1))
    one_head_scores = m * n * 4

    def largest_allocation(forward, backward):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out, lse = forward(q, k, v, True, 8 ** -0.5)
                backward(q, k, v, torch.ones_like(q), out, lse, True, 8 ** -0.5)
        finally:
            torch.set_num_threads(threads)
        return max(e.cpu_memory_usage for e in prof.events())

    assert largest_allocation(blocks.block_forward, blocks.block_backward) < one_head_scores / 2
    assert largest_allocation(blocks._forward_math, blocks._backward_math) >= 2 * one_head_scores
    meter = ActivationMeter(())
    with meter.forward():
        blocks._forward_math(q.requires_grad_(), k, v, True, 8 ** -0.5)
    assert meter.take_peak() >= 2 * one_head_scores


# -- attention alone ----------------------------------------------------------------
def _inputs(seq, heads, kv_heads, b=2, d=16):
    g = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(b, n, seq, d, generator=g) for n in (heads, kv_heads, kv_heads))
    return q, k, v, torch.randn(b, heads, seq, d, generator=g)


def _attention_on_ranks(variant, seq, heads, kv_heads, fault=None):
    from ultrascale.parallel.context import COUNTS, ContextGroup, allgather_attention, blocks, ring_attention
    from ultrascale.parallel.context import ulysses_attention
    from ultrascale.testing.faults import inject
    from ultrascale.train.metrics import ActivationMeter

    cpg = ContextGroup.of(worker_context(ParallelConfig(cp=dist.get_world_size())))
    q, k, v, dout = _inputs(seq, heads, kv_heads)
    pos = torch.tensor(expected_positions(seq, cpg.index, cpg.size, variant))
    q, k, v = (t[:, :, pos].requires_grad_() for t in (q, k, v))
    COUNTS.clear()
    blocks.WORK.clear()
    meter = ActivationMeter(())  # what the forward keeps for backward, as the trainer measures it
    with inject(fault):
        with meter.forward():
            if variant == "ulysses":
                out, lse = ulysses_attention(q, k, v, cpg), None
            elif variant == "allgather":
                out, lse = allgather_attention(q, k, v, cpg)
            elif variant == "allgather-contiguous":  # the naive form: no reordering of the gathered chunks
                out, lse = allgather_attention(q, k, v, cpg, "contiguous")
            else:
                out, lse = ring_attention(q, k, v, cpg, "zigzag" if variant == "zigzag" else "contiguous")
        forward = dict(COUNTS)
        COUNTS.clear()
        out.backward(dout[:, :, pos])
    return {"positions": pos, "out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "forward": forward, "backward": dict(COUNTS), "work": blocks.WORK["forward"], "kept": meter.take_peak()}


def _reference(seq, heads, kv_heads):
    q, k, v, dout = (t.double() for t in _inputs(seq, heads, kv_heads))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    out.backward(dout)
    group = heads // kv_heads
    scores = q.detach() @ k.detach().repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return {"out": out.detach(), "lse": scores.logsumexp(-1), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def attention_errors(per_rank, ref) -> dict:
    """Reassemble the ranks' shards into whole sequences; max |error| / max |reference| per quantity."""
    errors = {}
    for name, want in ref.items():
        if per_rank[0][name] is None:  # Ulysses runs SDPA on its head shard: no log-sum-exp to compare
            continue
        got = torch.zeros_like(want)
        for r in per_rank:
            got[:, :, r["positions"]] = r[name].double()
        errors[name] = ((got - want).abs().max() / want.abs().max()).item()
    return errors


def assert_attention_matches(per_rank, ref):
    errors = attention_errors(per_rank, ref)
    assert max(errors.values()) <= ATTENTION_RTOL, errors
    return errors


ATTENTION = [(w, v, 32 if w != 3 else 24, h, kv) for w, h, kv in ((2, 8, 4), (4, 8, 4), (3, 6, 3)) for v in VARIANTS]
ATTENTION += [(2, "ring", 32, 4, 4), (4, "zigzag", 32, 8, 1), (2, "allgather", 32, 8, 2)]  # MHA, MQA, GQA 4
ATTENTION += [(2, "zigzag", 1200, 2, 1)]  # chunks of 300 over 300 + 300 keys: across the CPU kernel's tiles
ATTENTION += [(w, "allgather-contiguous", 32, 8, 4) for w in (2, 4)]


@pytest.mark.equivalence
@pytest.mark.parametrize("world,variant,seq,heads,kv_heads", ATTENTION,
                         ids=[f"cp{w}-{v}-h{h}-kv{kv}" for w, v, _, h, kv in ATTENTION])
def test_attention_equals_full_causal_attention(world, variant, seq, heads, kv_heads):
    per_rank = run_distributed(world, _attention_on_ranks, variant, seq, heads, kv_heads)
    errors = assert_attention_matches(per_rank, _reference(seq, heads, kv_heads))
    assert set(errors) == ({"out", "dq", "dk", "dv"} | ({"lse"} if variant != "ulysses" else set()))
    # Kept for backward (the trainer's meter): q, k, v, the output and its fp32 lse, no block's scores.
    # All-gather keeps the whole sequence's K and V; Ulysses a head shard of the whole sequence, the same bytes.
    b, n, d = 2, seq // world, 16
    kv_len = seq if variant.startswith("allgather") else n
    assert [r["kept"] for r in per_rank] == [4 * (2 * b * heads * n * d + b * heads * n
                                                  + 2 * b * kv_heads * kv_len * d)] * world


FAULTS = [("ring", "cp-merge-by-average"), ("ring", "cp-no-causal-skip"), ("zigzag", "cp-no-causal-skip"),
          ("zigzag", "cp-zigzag-read-as-contiguous"), ("allgather", "cp-scatter-without-sum"),
          ("allgather", "cp-merge-by-average"), ("allgather", "cp-gathered-in-rank-order"),
          ("allgather-contiguous", "cp-scatter-without-sum"),
          ("ulysses", "cp-all-to-all-reversed")]


@pytest.mark.equivalence
@pytest.mark.parametrize("variant,fault", FAULTS, ids=[f"{v}-{f}" for v, f in FAULTS])
def test_a_wrong_attention_fails_the_comparison(variant, fault):
    # The faults are testing/faults.py's, patched into the workers for one call.
    per_rank = run_distributed(4, _attention_on_ranks, variant, 32, 8, 4, fault)
    with pytest.raises(AssertionError):
        assert_attention_matches(per_rank, _reference(32, 8, 4))
    assert max(attention_errors(per_rank, _reference(32, 8, 4)).values()) > 1e-2  # not a near miss


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_communication_is_what_the_algorithm_prescribes(world, variant):
    per_rank = run_distributed(world, _attention_on_ranks, variant, 32, 8, 4)
    p = world
    expected = {  # per layer and rank: (forward, backward)
        # cp - 1 K/V exchanges; backward cp - 1 K/V exchanges and cp dK/dV ones (the last brings them home)
        "ring": ({"forward send": p - 1, "forward recv": p - 1},
                 {"backward send": 2 * p - 1, "backward recv": 2 * p - 1}),
        "allgather": ({"forward all_gather": 1}, {"backward reduce_scatter": 1}),
        "ulysses": ({"forward all_to_all": 4}, {"backward all_to_all": 4}),  # q, k, v in; the output back
    }
    expected["zigzag"] = expected["ring"]
    for r in per_rank:
        assert (r["forward"], r["backward"]) == expected[variant]


def test_zigzag_balances_the_causal_work_that_the_ring_does_not():
    p, seq = 4, 32
    ring, zigzag, allgather = ([r["work"] for r in run_distributed(p, _attention_on_ranks, variant, seq, 8, 4)]
                               for variant in ("ring", "zigzag", "allgather"))
    n, c = seq // p, seq // (2 * p)
    # Score elements computed (a diagonal block counts whole). Ring: rank r attends to its own block
    # and the r before it. Zig-zag: at home three c x c pairs, then 2 c x c at each of the p - 1 steps.
    # All-gather, on zig-zag shards: chunk r on the r + 1 chunks up to it, chunk 2p-1-r on 2p - r.
    assert ring == [(r + 1) * n * n for r in range(p)]
    assert zigzag == [3 * c * c + 2 * c * c * (p - 1)] * p
    assert allgather == [((r + 1) + (2 * p - r)) * c * c for r in range(p)] == [(2 * p + 1) * c * c] * p
    assert max(ring) / min(ring) == p and len(set(zigzag)) == 1


# -- training equals one process --------------------------------------------------
def config(cp, variant="ring", dp=1, tp=1, pp=1, sp=False, zero=0, steps=3, seq=32, micro_batch=2, grad_accum=1,
           recompute="none", schedule="1f1b", chunks=1, dtype="fp32", model=None):
    p = ParallelConfig(dp=dp, cp=cp, tp=tp, pp=pp, sp=sp, zero=zero, cp_attention=variant, bucket_mb=0.05,
                       pp_schedule=schedule, pp_chunks=chunks)
    t = TrainConfig(steps=steps, seq_len=seq, micro_batch=micro_batch, grad_accum=grad_accum, seed=5, dtype=dtype,
                    recompute=recompute, progress=False)
    return RunConfig(model=get_preset("tiny", **(model or {})), parallel=p, train=t)


def world_of(cfg):
    p = cfg.parallel
    return p.dp * p.cp * p.tp * p.pp


TRAIN = [(f"cp {cp} {v}", config(cp, v)) for cp in (2, 4) for v in VARIANTS] + [
    ("dp 2 x cp 2 zigzag, 2 micro-batches", config(2, "zigzag", dp=2, grad_accum=2)),
    ("cp 2 x tp 2 + sp, zigzag", config(2, "zigzag", tp=2, sp=True)),
    ("cp 2 x tp 2 + sp, ulysses", config(2, "ulysses", tp=2, sp=True)),
    ("cp 2 x tp 2, ring", config(2, "ring", tp=2)),
    ("cp 2 x pp 2 1f1b, ring", config(2, "ring", pp=2, micro_batch=1, grad_accum=2)),
    ("cp 2 x pp 2 zero-bubble, zigzag", config(2, "zigzag", pp=2, micro_batch=1, grad_accum=2, schedule="zero-bubble")),
    ("cp 2 x pp 2 interleaved, allgather", config(2, "allgather", pp=2, micro_batch=1, grad_accum=2,
                                                  schedule="interleaved", chunks=2, model={"layers": 4})),
    ("cp 2 x pp 2 afab, ulysses", config(2, "ulysses", pp=2, micro_batch=1, grad_accum=2, schedule="afab")),
    ("cp 2 zero 1, zigzag", config(2, "zigzag", zero=1)),
    ("cp 2 zero 3, ring", config(2, "ring", zero=3)),
    ("dp 2 x cp 2 zero 3, ulysses", config(2, "ulysses", dp=2, zero=3, steps=2)),
    ("cp 2 selective recompute, ring", config(2, "ring", recompute="selective")),
    ("cp 2 selective recompute, allgather", config(2, "allgather", recompute="selective")),
    ("cp 2 full recompute, zigzag", config(2, "zigzag", recompute="full")),
    ("cp 2 tied embeddings, zigzag", config(2, "zigzag", model={"tie_embeddings": True})),
    ("dp 2 x cp 2 x tp 2 + sp, zigzag", config(2, "zigzag", dp=2, tp=2, sp=True, steps=2)),
]


@pytest.mark.equivalence
@pytest.mark.parametrize("label,cfg", TRAIN, ids=[label for label, _ in TRAIN])
def test_training_matches_the_single_process_run(label, cfg):
    check_against_single(label, cfg, world_of(cfg))


TRAIN_FAULTS = [("ring", "cp-local-positions"), ("zigzag", "cp-contiguous-positions"),
                ("ulysses", "cp-grads-reduced-over-dp-only"), ("ring", "cp-merge-by-average"),
                ("zigzag", "cp-no-causal-skip")]


@pytest.mark.equivalence
@pytest.mark.parametrize("variant,fault", TRAIN_FAULTS, ids=[f"{v}-{f}" for v, f in TRAIN_FAULTS])
def test_a_wrong_training_fails_the_comparison(variant, fault):
    # dp 2 x cp 2, so that a reduction over dp alone still reduces something
    c = compare_against_single(f"dp 2 x cp 2 {variant}", config(2, variant, dp=2), 4, fault=fault)[0]
    assert c.failures(FP32), f"the check passed an engine with the fault {fault!r}: {c.line()}"


def _train_and_count(cfg):
    from ultrascale.parallel.context import COUNTS
    from ultrascale.train.trainer import run_training

    COUNTS.clear()
    run_training(cfg, worker_context(cfg.parallel))
    return dict(COUNTS)


@pytest.mark.parametrize("variant,recompute", [("ring", "none"), ("ring", "selective"), ("ulysses", "none")])
def test_every_layer_of_every_micro_batch_uses_context_parallel_attention(variant, recompute):
    cfg = validate(config(2, variant, steps=1, grad_accum=3, recompute=recompute), 2)
    per_layer = {"ring": {"forward send": 1, "forward recv": 1, "backward send": 3, "backward recv": 3},
                 "ulysses": {"forward all_to_all": 4, "backward all_to_all": 4}}[variant]
    again = 2 if recompute == "selective" else 1  # the recomputed forward runs the ring again, in backward
    times = cfg.model.layers * cfg.train.grad_accum
    want = {k: v * times * (again if k.startswith("forward") else 1) for k, v in per_layer.items()}
    assert all(counts == want for counts in run_distributed(2, _train_and_count, cfg))


def _losses(cfg):
    from ultrascale.train.trainer import run_training

    return run_training(cfg, worker_context(cfg.parallel)).losses


@pytest.mark.equivalence
@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_matches_the_single_process_bf16_run(variant):
    # Against one process fed the same micro-batches, within the bf16 bounds (testing/compare.py).
    check_against_single(f"bf16 cp 2 {variant}", config(2, variant, dtype="bf16", steps=4), 2)


RESUME_LAYOUTS = {  # name: (world, config keywords); every one steps through 4 sequences per step
    "1 process": (1, dict(cp=1, micro_batch=2, grad_accum=2)),
    "cp 2 zigzag": (2, dict(cp=2, variant="zigzag", micro_batch=2, grad_accum=2)),
    "cp 2 ulysses zero 3": (2, dict(cp=2, variant="ulysses", zero=3, micro_batch=4)),
    "dp 2 x cp 2 ring zero 1": (4, dict(cp=2, dp=2, zero=1, micro_batch=2)),
    "cp 4 allgather": (4, dict(cp=4, variant="allgather", micro_batch=4)),
}
RESUME = [("cp 2 zigzag", "1 process"), ("1 process", "cp 2 ulysses zero 3"),
          ("dp 2 x cp 2 ring zero 1", "cp 4 allgather")]


def _run(world, cfg):
    cfg = validate(cfg, world)
    if world == 1:
        return train_single(cfg).losses
    return run_distributed(world, _losses, cfg)[0]


@pytest.mark.parametrize("saved,resumed", RESUME, ids=[f"{a}->{b}".replace(" ", "") for a, b in RESUME])
def test_saved_in_one_layout_resumed_in_another(tmp_path, saved, resumed):
    import dataclasses

    def cfg(name, steps, **train):
        world, kw = RESUME_LAYOUTS[name]
        c = config(steps=steps, seq=32, **kw)
        return world, dataclasses.replace(c, train=dataclasses.replace(c.train, **train))

    straight = train_single(cfg("1 process", 4)[1]).losses
    head = _run(*cfg(saved, 2, save=str(tmp_path / "ck")))
    tail = _run(*cfg(resumed, 4, resume=str(tmp_path / "ck")))
    assert len(head + tail) == 4
    assert worst(abs(a - b) / b for a, b in zip(head + tail, straight)) <= FP32.loss_rtol, (head + tail, straight)


# -- activation memory: falls with cp, and the planner predicts it ------------------
def _memory(cfg):
    from ultrascale.train.trainer import run_training

    return run_training(cfg, worker_context(cfg.parallel)).metrics[0]["memory"]


def measured_memory(cfg):
    cfg = validate(cfg, world_of(cfg))
    if world_of(cfg) == 1:
        return [train_single(cfg).metrics[0]["memory"]]
    return run_distributed(world_of(cfg), _memory, cfg)


def test_activation_memory_falls_with_cp():
    act = [max(m["activations"] for m in measured_memory(config(cp, "zigzag" if cp > 1 else "ring", steps=1, seq=64)))
           for cp in (1, 2, 4)]
    assert act[0] > act[1] > act[2], act
    assert act[1] < 0.55 * act[0] and act[2] < 0.3 * act[0], act  # about 1/cp: only the RoPE rows are not


PLANNED = [  # (cp, variant, tp, sp, dtype, recompute, zero)
    (2, "ring", 1, False, "fp32", "none", 0), (2, "zigzag", 1, False, "bf16", "none", 1),
    (2, "allgather", 1, False, "fp32", "none", 0), (2, "ulysses", 1, False, "fp32", "none", 3),
    (4, "zigzag", 1, False, "fp32", "none", 0), (4, "allgather", 1, False, "bf16", "none", 2),
    (2, "allgather", 1, False, "fp32", "selective", 0), (2, "ulysses", 1, False, "bf16", "selective", 0),
    (2, "zigzag", 1, False, "fp32", "full", 0), (2, "ring", 2, True, "fp32", "none", 0),
    (2, "ulysses", 2, False, "fp32", "none", 0),
]


@pytest.mark.parametrize("cp,variant,tp,sp,dtype,recompute,zero", PLANNED, ids=[
    f"cp{c}-{v}-tp{t}{'-sp' if s else ''}-{d}-{r}-zero{z}" for c, v, t, s, d, r, z in PLANNED])
def test_the_planner_predicts_the_measured_memory(cp, variant, tp, sp, dtype, recompute, zero):
    from ultrascale.plan.calibration import get_framework
    from ultrascale.plan.layout import Layout, check_layout
    from ultrascale.plan.memory import memory_plan
    from ultrascale.plan.precision import ENGINE_PRECISION, get_precision
    from ultrascale.plan.shape import from_model_config
    from ultrascale.plan.states import engine_states

    cfg = config(cp, variant, dp=4 // (cp * tp), tp=tp, sp=sp, zero=zero, steps=1, seq=64, dtype=dtype,
                 recompute=recompute)
    shape, p, t = from_model_config(cfg.model), cfg.parallel, cfg.train
    lay = Layout(dp=p.dp, tp=tp, sp=sp, cp=cp, cp_attention=variant, zero=zero, micro_batch=t.micro_batch,
                 seq_len=t.seq_len, precision=ENGINE_PRECISION[dtype], recompute=recompute, bucket_mb=p.bucket_mb)
    check_layout(lay, shape)
    plan = memory_plan(shape, lay, get_framework("ultrascale")).stages[0].terms
    for rank, m in enumerate(measured_memory(cfg)):
        dp_rank, cp_rank = rank // (tp * cp), rank // tp % cp  # the grid is dp x pp x cp x tp
        states = engine_states(shape, get_precision(lay.precision), p.dp * cp, zero, p.bucket_mb,
                               dp_rank * cp + cp_rank, tp)
        assert {k: m[k] for k in ("params", "grads", "optim")} == states, (rank, m, states)
        predicted = plan["activations"] + plan["logits"]
        assert abs(predicted / m["activations"] - 1) <= 0.05, (rank, predicted, m["activations"])


# -- configurations that cannot work ----------------------------------------------
@pytest.mark.parametrize("parallel,seq_len,kv_heads,message", [
    (ParallelConfig(cp=2, cp_attention="stripe"), 32, 4, "--cp-attention must be allgather, ring, zigzag or ulysses"),
    (ParallelConfig(cp=3), 32, 4, "--seq-len 32 must divide by 3"),
    (ParallelConfig(cp=3, cp_attention="allgather"), 33, 4, "2 x cp = 6 equal chunks: --seq-len 33 must divide by 6"),
    (ParallelConfig(cp=3, cp_attention="ulysses"), 32, 4, "--seq-len 32 must divide by 3"),
    (ParallelConfig(cp=2, cp_attention="zigzag"), 34, 4, "2 x cp = 4 equal chunks: --seq-len 34 must divide by 4"),
    (ParallelConfig(cp=2, tp=2, sp=True), 34, 4, "must divide by cp x tp = 4"),
    (ParallelConfig(cp=4, cp_attention="ulysses"), 32, 2, "it must divide the 8 query heads and the 2 key/value"),
    (ParallelConfig(cp=2, tp=2, cp_attention="ulysses"), 32, 2, "cp x tp = 4 ranks whole heads"),
])
def test_layouts_that_cannot_work(parallel, seq_len, kv_heads, message):
    cfg = RunConfig(model=get_preset("tiny", kv_heads=kv_heads), parallel=parallel,
                    train=TrainConfig(seq_len=seq_len))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        validate(cfg, parallel.cp * parallel.tp)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("parallel", [ParallelConfig(cp=4, cp_attention=v) for v in VARIANTS]
                         + [ParallelConfig(cp=2, tp=2, sp=True, cp_attention="zigzag")])
def test_layouts_that_work_are_accepted(parallel):
    cfg = RunConfig(model=get_preset("tiny"), parallel=parallel, train=TrainConfig(seq_len=32))
    assert validate(cfg, 4).parallel.cp == parallel.cp


def test_the_attention_variant_comes_from_toml_too():
    cfg = build_config({"parallel": {"cp": 2, "cp_attention": "zigzag"}}, {"parallel": {}})
    assert cfg.parallel.cp_attention == "zigzag"
    assert build_config({}, {"parallel": {"cp_attention": "ulysses"}}).parallel.cp_attention == "ulysses"
    assert ParallelConfig().cp_attention == "ring"
