"""The planner against our engine on CPU: what it predicts is what the engine's meters measure.

Parameters, gradients and optimizer state must be equal to the byte, on every
rank (padding and shards included); activations (what autograd saves during one
micro-batch's forward, loss included) within 5%. The grid covers what the engine
runs today: single process, dp, tp with and without SP, ZeRO 0-3, recomputation,
fp32 and bf16, micro-batch and sequence length. It grows as the engine grows.
"""

import pytest

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import get_preset
from ultrascale.plan.calibration import engine_here
from ultrascale.plan.layout import Layout, check_layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.precision import ENGINE_PRECISION, get_precision
from ultrascale.plan.shape import from_model_config
from ultrascale.plan.states import engine_states, stage_layer_ids
from ultrascale.testing.compare import train_parallel, train_single

BUCKET_MB = 0.05  # cuts the tiny model into ~9 buckets, so bucket padding is exercised
GPT = dict(norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)
# Every tensor of the tiny model is a multiple of 64 elements, so 2 or 4 ranks never pad a shard.
# Hidden 18 makes every size 2 mod 4: buckets and ZeRO-3 units need padding on 4 ranks.
ODD = dict(hidden=18, heads=3, kv_heads=1, ffn_hidden=40)


def run_config(dp, tp=1, sp=False, zero=0, dtype="fp32", recompute="none", micro_batch=2, seq_len=32, model=None,
               pp=1, schedule="1f1b", chunks=1, grad_accum=1, first=0, last=0):
    p = ParallelConfig(dp=dp, tp=tp, sp=sp, zero=zero, bucket_mb=BUCKET_MB, pp=pp, pp_schedule=schedule,
                       pp_chunks=chunks, pp_first_stage_layers=first, pp_last_stage_layers=last)
    t = TrainConfig(steps=1, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, seed=3, dtype=dtype,
                    recompute=recompute, progress=False)
    return RunConfig(model=get_preset("tiny", **(model or {})), parallel=p, train=t)


def measured(cfg):
    """The engine's memory figures of each rank after one step."""
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp
    if world == 1:
        return [train_single(cfg).metrics[0]["memory"]]
    return [got.memory[0] for got in train_parallel(cfg, world)]


def check(cfg, label):
    """Every rank's measured figures against the planner's stage of that rank."""
    p, t = cfg.parallel, cfg.train
    shape = from_model_config(cfg.model)
    lay = Layout(dp=p.dp, tp=p.tp, sp=p.sp, zero=p.zero, pp=p.pp, schedule=p.pp_schedule, chunks=p.pp_chunks,
                 first_stage_layers=p.pp_first_stage_layers, last_stage_layers=p.pp_last_stage_layers,
                 micro_batch=t.micro_batch, grad_accum=t.grad_accum, seq_len=t.seq_len,
                 precision=ENGINE_PRECISION[t.dtype], recompute=t.recompute, bucket_mb=p.bucket_mb)
    check_layout(lay, shape)
    plan = memory_plan(shape, lay, engine_here(t.dtype))  # the attention kernel the engine runs here
    stages = stage_layer_ids(shape, p.pp, "even", p.pp_chunks, p.pp_first_stage_layers, p.pp_last_stage_layers)
    per_rank = measured(cfg)
    for world_rank, m in enumerate(per_rank):
        # The grid is dp x pp x cp x tp, tp innermost.
        dp_rank, pp_rank = world_rank // (p.tp * p.pp), world_rank // p.tp % p.pp
        whole = None if p.pp == 1 else stages[pp_rank]
        want = engine_states(shape, get_precision(lay.precision), p.dp, p.zero, p.bucket_mb, dp_rank, p.tp, whole)
        got = {k: m[k] for k in ("params", "grads", "optim")}
        assert got == want, (label, world_rank, got, want)
        predicted = plan.stages[pp_rank].terms
        act = predicted["activations"] + predicted["logits"]
        assert abs(act / m["activations"] - 1) <= 0.05, (label, world_rank, act, m["activations"])
    # The planner's per-GPU figure is the largest stage's largest rank.
    assert {k: plan.peak.terms[k] for k in ("params", "grads", "optim")} in [
        {k: m[k] for k in ("params", "grads", "optim")} for m in per_rank]


SINGLE = [  # (dtype, recompute, micro_batch, seq_len, model overrides)
    ("fp32", "none", 2, 32, None), ("bf16", "none", 2, 32, None),
    ("fp32", "selective", 2, 32, None), ("bf16", "selective", 2, 32, None),
    ("fp32", "full", 2, 32, None), ("bf16", "full", 2, 32, None),
    ("fp32", "none", 3, 48, None), ("bf16", "none", 1, 64, None),
    ("fp32", "none", 2, 32, GPT), ("bf16", "selective", 2, 32, GPT),
]


@pytest.mark.parametrize("dtype,recompute,mbs,seq,model", SINGLE,
                         ids=[f"{d}-{r}-mbs{m}-s{s}{'-gpt' if g else ''}" for d, r, m, s, g in SINGLE])
def test_single_process(dtype, recompute, mbs, seq, model):
    check(run_config(1, dtype=dtype, recompute=recompute, micro_batch=mbs, seq_len=seq, model=model),
          f"1 rank {dtype} {recompute} mbs {mbs} seq {seq}{' gpt' if model else ''}")


PARALLEL = [  # (dp, tp, sp, zero, dtype, recompute, model overrides)
    (4, 1, False, 0, "bf16", "none", None), (4, 1, False, 1, "fp32", "selective", None),
    (4, 1, False, 2, "bf16", "full", None), (4, 1, False, 3, "bf16", "none", None),
    (4, 1, False, 1, "fp32", "none", ODD), (4, 1, False, 2, "bf16", "none", ODD),  # padded shards
    (4, 1, False, 3, "fp32", "selective", ODD),
    (1, 4, False, 0, "fp32", "none", None), (1, 4, True, 0, "bf16", "selective", None),
    (2, 2, False, 0, "fp32", "none", None), (2, 2, True, 1, "fp32", "none", None),
    (2, 2, True, 2, "bf16", "none", None), (2, 2, False, 3, "bf16", "full", None),
]  # all on 4 ranks (here and below): one pool of processes for the whole file


@pytest.mark.parametrize("dp,tp,sp,zero,dtype,recompute,model", PARALLEL,
                         ids=[f"dp{d}-tp{t}{'-sp' if s else ''}-zero{z}-{dt}-{r}{'-odd' if m else ''}"
                              for d, t, s, z, dt, r, m in PARALLEL])
def test_parallel(dp, tp, sp, zero, dtype, recompute, model):
    check(run_config(dp, tp, sp, zero, dtype, recompute, model=model),
          f"dp {dp} tp {tp}{' sp' if sp else ''} zero {zero} {dtype} {recompute}{' odd' if model else ''}")


PIPELINE = [  # (dp, tp, pp, schedule, chunks, grad_accum, zero, dtype, first, last stage blocks)
    (1, 1, 4, "1f1b", 1, 6, 0, "fp32", 0, 0), (2, 1, 2, "afab", 1, 3, 1, "bf16", 0, 0),
    (2, 1, 2, "interleaved", 2, 4, 0, "fp32", 0, 0), (1, 2, 2, "zero-bubble", 1, 4, 0, "bf16", 0, 0),
    (2, 1, 2, "1f1b", 1, 2, 1, "fp32", 0, 0),  # the engine composes pipelines with ZeRO-1 only
    (2, 1, 2, "1f1b", 1, 2, 0, "fp32", 1, 0), (2, 1, 2, "1f1b", 1, 3, 1, "bf16", 0, 1),  # 1 + 3, 3 + 1 blocks
]


@pytest.mark.parametrize("dp,tp,pp,schedule,chunks,ga,zero,dtype,first,last", PIPELINE,
                         ids=[f"dp{d}-tp{t}-pp{p}-{s}{f'-v{v}' if v > 1 else ''}-m{m}-zero{z}-{dt}"
                              f"{f'-first{f}' if f else ''}{f'-last{la}' if la else ''}"
                              for d, t, p, s, v, m, z, dt, f, la in PIPELINE])
def test_pipeline(dp, tp, pp, schedule, chunks, ga, zero, dtype, first, last):
    model = dict(layers=4)  # one block per stage at pp 4; two chunks of one block at pp 2 x v 2
    check(run_config(dp, tp, tp > 1, zero, dtype, pp=pp, schedule=schedule, chunks=chunks, grad_accum=ga, model=model,
                     micro_batch=1, first=first, last=last),
          f"pp {pp} {schedule} v{chunks} m {ga} dp {dp} tp {tp} zero {zero} {dtype} first {first} last {last}")


def test_gpt_block_under_tp_and_sp():
    check(run_config(2, 2, True, 0, "fp32", "none", model=GPT), "dp 2 tp 2 sp gpt block")


def test_padding_is_really_exercised():
    # The exactness above means something only if shards were padded somewhere.
    shape = from_model_config(get_preset("tiny", **ODD))
    zero1 = engine_states(shape, get_precision("fp32"), 4, 1, BUCKET_MB, 0)
    zero3 = [engine_states(shape, get_precision("fp32"), 4, 3, BUCKET_MB, r) for r in range(4)]
    assert zero1["params"] > 4 * shape.count()
    assert sum(r["params"] for r in zero3) > 4 * shape.count()
