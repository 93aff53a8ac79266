"""Published runs on clusters other than the playbook's: the planner's default, tested against them.

`plan validate` checks the time model on the playbook's own runs (one cluster, one
framework). A user plans for another cluster, with another framework, and reads
the default. These are the runs whose layout, hardware and speed were published;
each is planned twice: with the defaults (no --framework, no --cluster: what a
new user sees, only the GPU named) and with the presets of the software and
machines it ran on. `ultrascale plan published` prints both; tests pin them.

Each figure is compared on its source's own scale:
- "tflops_megatron": TFLOP/s per GPU as Megatron counts them, the recomputed
  forward included (96·l·h² + 16·l·h·s + 6·V·h per token; Narayanan et al. 2021,
  appendix): the planner's tokens/s times that count;
- "mfu": the model FLOPs utilization (6N + 12·l·h·s per token over the peak);
- "tokens_per_s_per_gpu": torchtitan's TPS/GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ultrascale.plan.calibration import DEFAULT_FRAMEWORK, get_framework
from ultrascale.plan.hardware import get_cluster
from ultrascale.plan.layout import Layout
from ultrascale.plan.shape import get_shape
from ultrascale.plan.time import step_time

TOLERANCE = 0.25  # the default must be within this of every run below


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str  # a plan/shape.py preset
    gpu: str  # the GPU, as a user would name it with --gpu
    cluster: str  # the cluster preset it ran on
    framework: str  # the framework preset of the software it ran on
    layout: dict  # Layout fields
    published: float
    measure: str  # tflops_megatron | mfu | tokens_per_s_per_gpu
    source: str
    switches: dict = field(default_factory=dict)  # framework switches the run sets (dropout, float8)


def _narayanan(model, tp, pp, gpus, batch, tflops):
    dp = gpus // (tp * pp)
    interleaved = dict(schedule="interleaved", chunks=2) if pp > 2 else {}
    return PublishedRun(
        f"Narayanan 2021 {model} on {gpus} A100", model, "a100-80gb", "a100-80gb", "megatron",
        dict(tp=tp, pp=pp, dp=dp, sp=False, micro_batch=1, grad_accum=batch // dp, seq_len=2048, recompute="full",
             precision="bf16-fp32-grads", **interleaved),
        tflops, "tflops_megatron", "Narayanan et al. 2021 (arXiv 2104.04473), Table 1: TFLOP/s per GPU",
        switches=dict(attention="eager"))  # 2021: Megatron's fused softmax, before FlashAttention


RUNS = [
    # Table 1: GPT models of 1.7B-1T parameters, sequence 2048, full recomputation, Selene (DGX A100).
    _narayanan("gpt-1.7b", 1, 1, 32, 512, 137e12),
    _narayanan("gpt-3.6b", 2, 1, 64, 512, 138e12),
    _narayanan("gpt-7.5b", 4, 1, 128, 512, 142e12),
    _narayanan("gpt-18b", 8, 1, 256, 1024, 135e12),
    _narayanan("gpt-39b", 8, 2, 512, 1536, 138e12),
    _narayanan("gpt-76b", 8, 4, 1024, 1792, 140e12),
    _narayanan("gpt-146b", 8, 8, 1536, 2304, 148e12),
    _narayanan("gpt-310b", 8, 16, 1920, 2160, 155e12),
    _narayanan("megatron-530b", 8, 35, 2520, 2520, 163e12),
    _narayanan("megatron-1t", 8, 64, 3072, 3072, 163e12),
    PublishedRun(
        "Korthikanti 2022 530B on 2240 A100", "megatron-530b", "a100-80gb", "a100-80gb", "megatron",
        dict(tp=8, pp=35, dp=8, micro_batch=1, grad_accum=280, seq_len=2048, recompute="selective",
             precision="bf16-fp32-grads"),
        0.542, "mfu", "Korthikanti et al. 2022 (arXiv 2205.05198), abstract: sequence parallelism + selective "
                      "recomputation, 54.2% MFU",
        switches=dict(attention="eager")),
    PublishedRun(
        "BLOOM-176B on 384 A100", "bloom-176b", "a100-80gb", "jean-zay", "megatron",
        dict(tp=4, pp=12, dp=8, zero=1, micro_batch=2, grad_accum=128, seq_len=2048, recompute="full",
             precision="bf16-fp32-grads"),
        150e12, "tflops_megatron",
        "BigScience, BLOOM (arXiv 2211.05100), section 3.4: Megatron-DeepSpeed, tp 4 pp 12 dp 8, micro-batch 2, "
        "2048 sequences of 2048, ZeRO-1, about 150 TFLOP/s per GPU",
        switches=dict(attention="eager")),  # fused softmax with ALiBi, before FlashAttention
    PublishedRun(
        "Llama 3 405B on 16,384 H100", "llama3-405b", "h100-80gb", "llama3", "megatron",
        dict(tp=8, pp=16, dp=128, zero=1, micro_batch=1, grad_accum=16, seq_len=8192, schedule="interleaved",
             chunks=4, precision="bf16-fp32-grads"),
        0.40, "mfu", "Llama 3 paper (arXiv 2407.21783), Table 4: tp 8 pp 16 dp 128, seq 8192, 38-43% BF16 MFU",
        switches=dict(dropout=False)),
    # torchtitan's docs/performance.md (commit of 2024-12-26): Llama 3.1 on Grand Teton H100s (500 W).
    PublishedRun(
        "torchtitan Llama 3.1 8B FSDP on 8 H100", "llama3-8b", "h100-80gb", "grand-teton", "torchtitan",
        dict(dp=8, zero=3, micro_batch=2, grad_accum=1, seq_len=8192, recompute="selective",
             precision="bf16-fp32-grads"),
        6667, "tokens_per_s_per_gpu", "torchtitan docs/performance.md, Table 1: FSDP + torch.compile, 6,667 TPS/GPU",
        switches=dict(float8=False)),
    PublishedRun(
        "torchtitan Llama 3.1 8B FSDP float8 on 128 H100", "llama3-8b", "h100-80gb", "grand-teton", "torchtitan",
        dict(dp=128, zero=3, micro_batch=2, grad_accum=1, seq_len=8192, recompute="selective",
             precision="bf16-fp32-grads"),
        8380, "tokens_per_s_per_gpu",
        "torchtitan docs/performance.md, Table 3: FSDP + torch.compile + Float8, 8,380 TPS/GPU"),
    PublishedRun(
        "torchtitan Llama 3.1 70B FSDP+TP float8 on 256 H100", "llama3-70b", "h100-80gb", "grand-teton",
        "torchtitan",
        dict(dp=32, tp=8, zero=3, micro_batch=16, grad_accum=1, seq_len=8192, recompute="full",
             precision="bf16-fp32-grads"),
        829, "tokens_per_s_per_gpu", "torchtitan docs/performance.md, Table 4: 2D, 829 TPS/GPU"),
    PublishedRun(
        "torchtitan Llama 3.1 405B 3D float8 on 512 H100", "llama3-405b", "h100-80gb", "grand-teton", "torchtitan",
        # Local batch 32 in as many micro-batches as stages, virtual ones included (torchtitan's default
        # then): 16 micro-batches of 2.
        dict(dp=8, tp=8, pp=8, zero=3, micro_batch=2, grad_accum=16, seq_len=8192, recompute="full",
             schedule="interleaved", chunks=2, precision="bf16-fp32-grads"),
        128, "tokens_per_s_per_gpu", "torchtitan docs/performance.md, Table 5: interleaved 1F1B, 128 TPS/GPU"),
    # DeepSeek-V3 (arXiv 2412.19437): 2,048 H800 (3.1); 16-way pipeline (DualPipe), 64-way experts over 8 nodes,
    # ZeRO-1 data parallelism, no tensor parallelism (3.2); FP8 (3.3); sequences of 4K, batches of 15,360 after the
    # first 469B tokens (4.2); "180K H800 GPU hours" per trillion tokens (abstract, 1): 1e12 / (180e3 x 3600) =
    # 1,543 tokens/s per GPU. Planned as DualPipeV (one copy of the weights) with micro-batches of one sequence;
    # its multi-token-prediction module is not planned.
    PublishedRun(
        "DeepSeek-V3 on 2,048 H800", "deepseek-v3", "h800", "deepseek", "deepseek",
        dict(dp=128, pp=16, ep=64, zero=1, micro_batch=1, grad_accum=120, seq_len=4096, schedule="dualpipev",
             chunks=2, precision="bf16-fp32-grads"),
        1e12 / (180e3 * 3600), "tokens_per_s_per_gpu",
        "DeepSeek-V3 report (arXiv 2412.19437), sections 1 and 3: 180K H800 GPU hours per trillion tokens"),
]

# Held out: published runs no constant of the planner was chosen on (the frameworks' constants were set
# on RUNS above). `plan published` prints their errors apart, and the tests hold them to the same
# TOLERANCE: a model that is right only on the runs it was set on is not yet a tool.
_TT_DEC24 = "torchtitan docs/performance.md (torch 2024-12-23, torchtitan 9dec370), "
_TT_AUG24 = "torchtitan docs/performance.md (Aug 2024: 64 A100 80GB, FSDP2, no torch.compile), "


def _titan(name, model, layout, published, source, gpu="h100-80gb", cluster="grand-teton", **switches):
    return PublishedRun(name, model, gpu, cluster, "torchtitan", {"precision": "bf16-fp32-grads", **layout},
                        published, "tokens_per_s_per_gpu", source, switches=switches)


_FSDP8B = dict(zero=3, micro_batch=2, grad_accum=1, seq_len=8192, recompute="selective")
_405B = dict(tp=8, pp=8, zero=3, recompute="full")
HELD_OUT = [
    _titan("torchtitan Llama 3.1 8B FSDP eager on 8 H100", "llama3-8b", dict(dp=8, **_FSDP8B), 5762,
           _TT_DEC24 + "Table 1: FSDP, 5,762 TPS/GPU", kernels="eager", float8=False),
    _titan("torchtitan Llama 3.1 8B FSDP float8 on 8 H100", "llama3-8b", dict(dp=8, **_FSDP8B), 8532,
           _TT_DEC24 + "Table 1: FSDP + torch.compile + Float8, 8,532 TPS/GPU"),
    _titan("torchtitan Llama 3.1 8B FSDP eager on 128 H100", "llama3-8b", dict(dp=128, **_FSDP8B), 5605,
           _TT_DEC24 + "Table 3: FSDP, 5,605 TPS/GPU", kernels="eager", float8=False),
    _titan("torchtitan Llama 3.1 8B FSDP on 128 H100", "llama3-8b", dict(dp=128, **_FSDP8B), 6514,
           _TT_DEC24 + "Table 3: FSDP + torch.compile, 6,514 TPS/GPU", float8=False),
    *[_titan(f"torchtitan Llama 3.1 8B FSDP {8 // cp} CP {cp} float8, seq {seq}", "llama3-8b",
             dict(dp=8 // cp, cp=cp, zero=3, micro_batch=1, grad_accum=1, seq_len=seq, recompute="full",
                  cp_attention="allgather"), tps, _TT_DEC24 + f"Table 2: FSDP {8 // cp}, CP {cp}, {tps:,} TPS/GPU")
      for cp, seq, tps in ((1, 32768, 3890), (2, 65536, 2540), (4, 131072, 1071), (8, 262144, 548))],
    _titan("torchtitan Llama 3.1 70B FSDP+TP float8 + async TP on 256 H100", "llama3-70b",
           dict(dp=32, tp=8, zero=3, micro_batch=16, grad_accum=1, seq_len=8192, recompute="full"), 876,
           _TT_DEC24 + "Table 4: 2D + AsyncTP, 876 TPS/GPU", tp_overlap=True),
    # Local batch 32 in as many micro-batches as stages (torchtitan's default then): 8 of 4.
    _titan("torchtitan Llama 3.1 405B 3D 1F1B on 512 H100", "llama3-405b",
           dict(dp=8, micro_batch=4, grad_accum=8, seq_len=8192, **_405B), 100,
           _TT_DEC24 + "Table 5: 1F1B, 100 TPS/GPU", tp_overlap=True),
    *[_titan(f"torchtitan Llama 3.1 405B FSDP {8 // cp} CP {cp} TP 8 PP 8, seq {seq}", "llama3-405b",
             dict(dp=8 // cp, cp=cp, micro_batch=1, grad_accum=8, seq_len=seq, cp_attention="allgather", **_405B),
             tps, _TT_DEC24 + f"Table 6: FSDP {8 // cp}, CP {cp}, 1F1B, {tps} TPS/GPU", tp_overlap=True)
      for cp, seq, tps in ((1, 32768, 76), (2, 65536, 47), (4, 131072, 31), (8, 262144, 16))],
    _titan("torchtitan Llama 3 8B FSDP eager on 64 A100", "llama3-8b",
           dict(dp=64, zero=3, micro_batch=1, grad_accum=1, seq_len=8192, recompute="selective"), 2973,
           _TT_AUG24 + "Llama 3, batch 1, selective op AC, 2,973 WPS", gpu="a100-80gb", cluster="a100-80gb",
           kernels="eager", float8=False),
    _titan("torchtitan Llama 3 70B FSDP eager on 64 A100", "llama3-70b",
           dict(dp=64, zero=3, micro_batch=1, grad_accum=1, seq_len=8192, recompute="full"), 331,
           _TT_AUG24 + "Llama 3, batch 1, full AC, 331 WPS", gpu="a100-80gb", cluster="a100-80gb",
           kernels="eager", float8=False),
]


def figure(run: PublishedRun, t, shape) -> float:
    """The planner's step time on the run's own scale."""
    lay = run.layout
    if run.measure == "mfu":
        return t.mfu
    if run.measure == "tokens_per_s_per_gpu":
        return t.tokens_per_s_per_gpu
    l, h, s, v = shape.layers, shape.hidden, lay["seq_len"], shape.vocab
    return t.tokens_per_s_per_gpu * (96 * l * h * h + 16 * l * h * s + 6 * v * h)


def predict(run: PublishedRun, framework: str | None = None, cluster: str | None = None) -> float:
    """The run as planned with a framework and cluster (None: the defaults, only the GPU named)."""
    fw = dataclasses.replace(get_framework(framework or DEFAULT_FRAMEWORK), **run.switches)
    shape = get_shape(run.model)
    t = step_time(shape, Layout(**run.layout), get_cluster(cluster, None if cluster else run.gpu), fw)
    return figure(run, t, shape)


def table() -> list[dict]:
    """Every run, of both sets (`set`: the constants were "chosen on" it, or it is "held out"): published,
    the default's prediction and the run's own presets', each as a ratio."""
    out = []
    for run in RUNS + HELD_OUT:
        default, own = predict(run), predict(run, run.framework, run.cluster)
        out.append({"run": run.name, "set": "chosen on" if run in RUNS else "held out",
                    "measure": run.measure, "published": run.published,
                    "default": default, "default_ratio": default / run.published,
                    "own": own, "own_ratio": own / run.published, "framework": run.framework,
                    "cluster": run.cluster, "source": run.source})
    return out


def misses(rows: list[dict], key: str = "own_ratio") -> dict:
    """A set's errors: the median |ratio - 1|, the largest, and how many rows lie beyond TOLERANCE."""
    import statistics

    errors = [abs(r[key] - 1) for r in rows]
    return {"rows": len(errors), "median": statistics.median(errors), "largest": max(errors),
            "beyond": sum(e > TOLERANCE for e in errors)}
