"""The CUDA paths on one GPU: `pytest -m gpu` (and `make gpu-check`, which runs these first).

Skipped without CUDA. Every comparison has the same trusted side as on the CPU: the
single-process run (on the CPU, or on the GPU with TF32 off), float64 attention, the
eager run, the planner's formulas; and each is shown failing on a wrong variant.

Several ranks on the one GPU: NCCL refuses two ranks on one device, so the ranks join
a gloo group, hold their model on cuda:0, and gloo carries their tensors
(testing/gloo_cuda.py: all_reduce and broadcast natively, the rest through host copies).
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import get_preset
from ultrascale.testing.compare import BF16, FP32, RunRecord, assert_matches, compare, single_process_config
from ultrascale.testing.harness import run_distributed, worker_context

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: make gpu-check runs these")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION_RTOL = 1e-5  # fp32 against float64, as on the CPU (tests/test_context_parallel.py)


@pytest.fixture(autouse=True)
def _no_tf32():
    # fp32 means fp32: TF32 matmuls round their inputs to 10 bits of mantissa.
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def config(model="tiny", steps=3, micro_batch=2, grad_accum=2, seq_len=32, dtype="fp32", **kw):
    train = {k: kw.pop(k) for k in ("compile", "fp8") if k in kw}
    t = TrainConfig(steps=steps, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, seed=3,
                    dtype=dtype, progress=False, **train)
    return RunConfig(model=get_preset(model), parallel=ParallelConfig(bucket_mb=0.05, **kw), train=t)


def on_host(r: RunRecord) -> RunRecord:
    cpu = lambda d: None if d is None else {k: v.detach().cpu() for k, v in d.items()}  # noqa: E731
    return dataclasses.replace(r, first_grads=cpu(r.first_grads), state=cpu(r.state))


def run_one(cfg: RunConfig, device: str, fault: str | None = None) -> RunRecord:
    """One process on `device`, in this process."""
    from ultrascale.distributed.context import build_context
    from ultrascale.testing.faults import inject
    from ultrascale.train.startup import check_run
    from ultrascale.train.trainer import run_training

    cfg = check_run(cfg, 1)
    if device == "cuda":
        torch.cuda.set_device(0)
    ctx = build_context(cfg.parallel, 0, 1, device=torch.device(device, 0) if device == "cuda" else torch.device(device))
    with inject(fault):
        return on_host(RunRecord.of(run_training(cfg, ctx, keep_first_grads=True)))


# -- one process: CUDA against the CPU --------------------------------------------------
def test_fp32_on_cuda_equals_the_cpu():
    cfg = config()
    ref = run_one(cfg, "cpu")
    assert_matches(compare("cuda fp32 (TF32 off) vs cpu, 1 process", ref, run_one(cfg, "cuda")))
    # The wrong variant the GPU brings: TF32 left on fails the fp32 bound.
    torch.backends.cuda.matmul.allow_tf32 = True
    bad = compare("cuda with TF32 on vs cpu", ref, run_one(cfg, "cuda"), record=False)
    assert bad.failures(FP32), bad.line()


def test_bf16_on_cuda_equals_the_cpu_within_the_bf16_bounds():
    cfg = config(dtype="bf16")
    ref = run_one(cfg, "cpu")
    assert_matches(compare("cuda bf16 vs cpu bf16, 1 process", ref, run_one(cfg, "cuda")), BF16)
    bad = compare("cuda bf16, a micro-batch counted twice", ref, run_one(cfg, "cuda", "micro-batch-counted-twice"),
                  record=False)
    assert bad.failures(BF16), bad.line()


# -- context parallelism's block attention on CUDA ----------------------------------------
def _chunks(variant: str, rank: int, cp: int) -> list[int]:
    """Written from the definition: chunk r of cp (ring), or chunks r and 2cp-1-r of 2cp (zig-zag, all-gather)."""
    return [rank, 2 * cp - 1 - rank] if variant in ("zigzag", "allgather") else [rank]


def _block_attention(variant, cp, seq=64, heads=8, kv_heads=4, d=64, device="cuda"):
    """Every rank's queries against every key chunk (as the ring or the all-gather brings them),
    forward and backward through parallel/context/blocks.py on CUDA; reassembled per position."""
    from ultrascale.parallel.context import blocks

    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, n, seq, d, generator=g) for n in (heads, kv_heads, kv_heads, heads))
    n_chunks = cp * (2 if variant in ("zigzag", "allgather") else 1)
    c = seq // n_chunks
    pos = lambda chunks: torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks])  # noqa: E731
    got = {name: torch.zeros(2, heads if name in ("out", "dq", "lse") else kv_heads, seq, *(() if name == "lse" else (d,)),
                             dtype=torch.float64) for name in ("out", "lse", "dq", "dk", "dv")}
    scale = d ** -0.5
    for rank in range(cp):
        qc = _chunks(variant, rank, cp)
        rq, rdo = (t[:, :, pos(qc)].to(device) for t in (q, dout))
        out, lse = blocks.start(rq)
        # The key blocks: in the ring's order of arrival, or the whole sequence at once (all-gather)
        sources = ([list(range(n_chunks))] if variant == "allgather" else
                   [_chunks(variant, (rank - src) % cp, cp) for src in range(cp)])
        for kc in sources:
            blocks.attend(rq, k[:, :, pos(kc)].to(device), v[:, :, pos(kc)].to(device), qc, kc, out, lse, scale)
        dq = torch.zeros_like(out)
        for kc in sources:
            dk, dv = (torch.zeros(2, kv_heads, len(kc) * c, d, device=device) for _ in range(2))
            blocks.attend_backward(rq, k[:, :, pos(kc)].to(device), v[:, :, pos(kc)].to(device), rdo, out, lse, qc, kc,
                                   dq, dk, dv, scale)
            got["dk"][:, :, pos(kc)] += dk.double().cpu()
            got["dv"][:, :, pos(kc)] += dv.double().cpu()
        got["out"][:, :, pos(qc)] = out.double().cpu()
        got["lse"][:, :, pos(qc)] = lse.double().cpu()
        got["dq"][:, :, pos(qc)] = dq.double().cpu()
    # float64, from the definition (SDPA's math on the CPU), not from blocks.py
    q, k, v, dout = (t.double().requires_grad_() for t in (q, k, v, dout))
    ref_out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref_out.backward(dout)
    kk = k.detach().repeat_interleave(heads // kv_heads, 1)
    scores = (q.detach() @ kk.transpose(-1, -2) * scale).masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1),
                                                                     float("-inf"))
    want = {"out": ref_out.detach(), "lse": scores.logsumexp(-1), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {name: ((got[name] - w).abs().max() / w.abs().max()).item() for name, w in want.items()}


@pytest.mark.parametrize("variant,cp", [("ring", 2), ("ring", 4), ("allgather", 4), ("zigzag", 2), ("zigzag", 4)])
def test_block_attention_on_cuda_equals_float64(variant, cp):
    from ultrascale.parallel.context import blocks

    # The fused kernel with its log-sum-exp runs (no fallback to the math) for these blocks.
    x = torch.randn(2, 8, 16, 64, device="cuda")
    assert blocks._forward_cuda(x, x[:, :4], x[:, :4], True, 0.125) is not None
    errors = _block_attention(variant, cp)
    assert max(errors.values()) <= ATTENTION_RTOL, errors


def test_ulysses_attention_on_cuda_equals_float64():
    # Ulysses attends over the whole sequence on a shard of the heads: the model's SDPA on CUDA.
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, n, 64, 64, generator=g) for n in (4, 2, 2))
    got = F.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), is_causal=True, enable_gqa=True)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert ((got.double().cpu() - want).abs().max() / want.abs().max()).item() <= ATTENTION_RTOL


@pytest.mark.parametrize("fault", ["cp-merge-by-average", "cp-no-causal-skip"])
def test_a_wrong_block_attention_fails_on_cuda(fault):
    from ultrascale.testing.faults import inject

    with inject(fault):
        errors = _block_attention("zigzag", 2)
    assert max(errors.values()) > 1e-2, errors


# -- several ranks on the one GPU ---------------------------------------------------------
def _train_on_gpu(cfg, fault=None):
    from ultrascale.testing.faults import inject
    from ultrascale.testing.gloo_cuda import staged
    from ultrascale.train.trainer import run_training

    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ctx = dataclasses.replace(worker_context(cfg.parallel), device=torch.device("cuda", 0))
    with staged(), inject(fault):
        return on_host(RunRecord.of(run_training(cfg, ctx, keep_first_grads=True)))


LAYOUTS = [  # (label, config)
    ("dp 2", config(dp=2)),
    ("tp 2 + sp", config(tp=2, sp=True)),
    ("cp 2 ring", config(cp=2, cp_attention="ring")),
    ("pp 2 1f1b", config(pp=2, pp_schedule="1f1b", micro_batch=1, grad_accum=4)),
    ("ep 2", config("tiny-moe", dp=2, ep=2, micro_batch=2)),
    # Offload's CUDA path: pinned host states, gradients and masters over a side stream (parallel/offload.py).
    ("dp 2 zero 1 offload cpu bf16", config(dp=2, zero=1, offload="cpu", dtype="bf16")),
    ("dp 2 zero 3 offload disk", config(dp=2, zero=3, offload="disk", offload_dir=tempfile.gettempdir())),
]


def _on_two_ranks(label, cfg, fault=None):
    from ultrascale.train.startup import check_run

    cfg = check_run(cfg, 2)
    m = cfg.model
    # Routing that depends on the micro-batch, and bf16's rounding: the control takes the same micro-batches.
    same = bool(m.is_moe and (m.capacity_factor or m.aux_loss_coef)) or cfg.train.dtype == "bf16"
    ref = run_one(single_process_config(cfg, same_micro_batches=same), "cuda")
    got = run_distributed(2, _train_on_gpu, cfg, fault, timeout=180)[0]
    return compare(f"{label}, 2 ranks on one GPU (gloo)", ref, got, record=fault is None)


@pytest.mark.parametrize("label,cfg", LAYOUTS, ids=[lab.replace(" ", "") for lab, _ in LAYOUTS])
def test_two_ranks_on_one_gpu_equal_one_process(label, cfg):
    assert_matches(_on_two_ranks(label, cfg), BF16 if cfg.train.dtype == "bf16" else FP32)


def test_a_wrong_layout_on_one_gpu_fails():
    bad = _on_two_ranks("dp 2", LAYOUTS[0][1], fault="dp-wrong-group-size")
    assert bad.failures(FP32), bad.line()


# -- FP8 through torch._scaled_mm, and compile ----------------------------------------------
def test_fp8_on_cuda_stays_within_the_fp8_bound():
    pytest.importorskip("torchao", reason="--fp8 needs torchao: make gpu-wheels carries it")
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9+")
    from unittest import mock

    calls = []
    real = torch._scaled_mm

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    cfg = config(dtype="bf16", steps=4, fp8=True, micro_batch=4, seq_len=64)
    ref = run_one(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8=False)), "cuda")
    with mock.patch.object(torch, "_scaled_mm", counted):
        fp8 = run_one(cfg, "cuda")
    assert calls, "the FP8 linears did not call torch._scaled_mm"
    # docs/precision.md: FP8 against the same run without it, loss within 1e-3, step-1 gradients within 0.2.
    c = compare("fp8 (torch._scaled_mm) vs bf16 on cuda", ref, fp8)
    assert c.max_loss_rel < 1e-3 and c.max_grad_rel_l2 < 0.2, c.line()
    assert c.max_grad_rel_l2 > 0, "FP8 changed nothing: the linears did not run in FP8"


def test_compile_on_cuda_equals_eager():
    cfg = config(compile=True)
    ref = run_one(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False)), "cuda")
    assert_matches(compare("compile vs eager on cuda, 1 process", ref, run_one(cfg, "cuda")))
    # The check sees a compiler that changes the numerics (bf16 autocast inside the compiled blocks).
    from unittest import mock

    from ultrascale.parallel import compile as compile_mod

    real = torch.compile

    def lowered(fn, mode=None, dynamic=False):
        def run(*a):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(*a)
        return real(run, backend="aot_eager", dynamic=dynamic)

    with mock.patch.object(compile_mod.torch, "compile", lowered):
        bad = compare("compile under bf16 autocast on cuda", ref, run_one(cfg, "cuda"), record=False)
    assert bad.failures(FP32), bad.line()


def test_a_dropped_trainer_gives_back_its_cuda_memory():
    # Found on an H100: a trainer's parameter hooks held it in a cycle through C++, and each dropped
    # trainer left its weights, masters and gradients allocated (tests/test_trainer.py has the CPU
    # side of it; parallel/grads.py the weak reference that fixed it).
    import gc

    from ultrascale.distributed.context import build_context
    from ultrascale.train.startup import check_run
    from ultrascale.train.trainer import Trainer

    torch.cuda.set_device(0)
    gc.collect()
    before = torch.cuda.memory_allocated(0)
    for compiled in (False, True):
        cfg = check_run(config("small", dtype="bf16", compile=compiled), 1)
        trainer = Trainer(cfg, build_context(cfg.parallel, 0, 1, device=torch.device("cuda", 0)))
        trainer.train_step()
        held = torch.cuda.memory_allocated(0) - before
        del trainer
        gc.collect()
        left = torch.cuda.memory_allocated(0) - before
        assert left <= 2**20, f"compile={compiled}: {left / 2**20:.0f} MiB of {held / 2**20:.0f} MiB still allocated"


# -- memory and profiles, through the command --------------------------------------------------
def _ultrascale(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "ultrascale", *args], capture_output=True, text=True, env=env,
                       timeout=timeout, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


MEMORY = [("bf16", "none"), ("bf16", "full"), ("fp32", "none")]


@pytest.mark.parametrize("dtype,recompute", MEMORY, ids=[f"{d}-{r}" for d, r in MEMORY])
def test_the_cuda_peak_is_the_planners_prediction(tmp_path, dtype, recompute):
    from ultrascale.plan.calibration import get_framework
    from ultrascale.plan.layout import Layout, check_layout
    from ultrascale.plan.memory import memory_plan
    from ultrascale.plan.precision import ENGINE_PRECISION
    from ultrascale.plan.shape import from_model_config

    model, seq, mb = "smollm-135m", 1024, 4
    log = tmp_path / "run.jsonl"
    _ultrascale("train", "--model", model, "--device", "cuda", "--steps", "2", "--seq-len", str(seq),
                "--micro-batch", str(mb), "--dtype", dtype, "--recompute", recompute, "--log-jsonl", str(log))
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    measured = max(s["memory"]["allocator_peak"] for s in steps if "memory" in s)
    lay = Layout(micro_batch=mb, grad_accum=1, seq_len=seq, precision=ENGINE_PRECISION[dtype], recompute=recompute)
    shape = from_model_config(get_preset(model))
    check_layout(lay, shape)
    predicted = memory_plan(shape, lay, get_framework("ultrascale")).peak.allocated
    assert abs(predicted / measured - 1) <= 0.10, (predicted / 2**30, measured / 2**30)


def test_a_cuda_profile_reads_compute_and_idle_from_the_kernels(tmp_path):
    prof = tmp_path / "prof"
    _ultrascale("train", "--model", "small", "--device", "cuda", "--steps", "3", "--seq-len", "128", "--profile",
                str(prof))
    assert list(prof.glob("*memory*")), "no CUDA memory snapshot next to the trace"
    ranks = json.loads(_ultrascale("trace", str(prof), "--json").stdout)
    r = ranks[0] if isinstance(ranks, list) else ranks["ranks"][0]
    assert r["compute_ms"] > 0 and r["idle_ms"] >= 0 and r["comm_ms"] == 0  # one process: no NCCL kernel
    assert math.isclose(r["window_ms"], r["compute_ms"] + r["idle_ms"], rel_tol=1e-6, abs_tol=1e-3)
