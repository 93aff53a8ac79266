"""Published per-GPU memory, against `plan memory`: the memory model validated like the time model.

Three kinds of figure, each compared on its own scale:
- "reserved": the caching allocator's peak reservation (torch.cuda.max_memory_reserved), what
  torchtitan's logs and docs/performance.md report as Memory(GiB). Compared with the plan's total
  less the CUDA context (which lives outside the allocator).
- "allocated": the allocator's peak of live tensors (torch.cuda.max_memory_allocated), what our
  engine's JSONL records (memory.allocator_peak). Compared with the plan's total less its overhead.
- "fits": a run that trained on that card and published no figure: what the plan needs there (its
  live tensors and the context, memory.StageMemory.needed) must fit the card.

Every row is planned with the framework and cluster of the software and machines it ran on, and
with the defaults (no --framework, no --cluster: what a new user sees), as plan/published.py does for
time. TOLERANCE is the goal for the first; the rows outside it are listed in docs/planner.md with why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ultrascale.plan.calibration import DEFAULT_FRAMEWORK, GIB, get_framework
from ultrascale.plan.hardware import get_cluster
from ultrascale.plan.layout import Layout, check_layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.shape import get_shape

TOLERANCE = 0.15
# Rows the model misses by more than TOLERANCE, and why (docs/planner.md): kept listed, and checked to
# be outside still, so that the list says what is known.
OUTSIDE: dict[str, str] = {}


@dataclass(frozen=True)
class MemoryRun:
    name: str
    model: str
    cluster: str  # the machines it ran on (its GPU's memory is the bound of a "fits" row)
    framework: str
    layout: dict
    kind: str  # reserved | allocated | fits
    published_gib: float  # 0 for "fits"
    source: str
    switches: dict = field(default_factory=dict)  # framework switches the run sets (compile, float8)


# torchtitan docs/performance.md (torchtitan 9dec370, 2024-12-26; torch and torchao of 2024-12-23):
# Llama 3.1 on Grand Teton (H100 96 GB HBM2e, 500 W), bf16 FSDP2 mixed precision, Memory(GiB) = the
# peak reserved memory. A pipeline run splits each rank's local batch into as many micro-batches as
# there are stages, virtual ones included (torchtitan's default then: pipeline_parallel_microbatches =
# pp degree x stages per rank): 8 for 1F1B, 16 for the interleaved schedule with 2 stages per rank.
_TT = "torchtitan docs/performance.md, "
_EAGER = dict(kernels="eager", float8=False)  # FSDP alone: no torch.compile, no Float8
_COMPILED = dict(float8=False)


def _tt(name, model, layout, published, table, switches=None):
    return MemoryRun(f"torchtitan {name}", model, "grand-teton", "torchtitan",
                     dict(precision="bf16-fp32-grads", **layout), "reserved", published, _TT + table,
                     switches or {})


_8B_T1 = dict(dp=8, zero=3, micro_batch=2, seq_len=8192, recompute="selective")
_8B_T3 = dict(_8B_T1, dp=128)
_405B = dict(tp=8, pp=8, zero=3, recompute="full")

RUNS = [
    _tt("8B FSDP on 8 H100", "llama3-8b", _8B_T1, 82.4, "Table 1: FSDP", _EAGER),
    _tt("8B FSDP + compile on 8 H100", "llama3-8b", _8B_T1, 77.0, "Table 1: FSDP + torch.compile", _COMPILED),
    _tt("8B FSDP + compile + Float8 on 8 H100", "llama3-8b", _8B_T1, 76.8, "Table 1: FSDP + torch.compile + Float8"),
    *[_tt(f"8B FSDP {8 // cp} CP {cp}, seq {seq // 1024}K", "llama3-8b",
          dict(dp=8 // cp, cp=cp, zero=3, micro_batch=1, seq_len=seq, recompute="full",
               # torch's context_parallel of the time: the all-gather rotation by default
               cp_attention="allgather" if cp > 1 else "zigzag"), pub, f"Table 2: FSDP {8 // cp}, CP {cp}")
      for cp, seq, pub in ((1, 32768, 83.9), (2, 65536, 84.2), (4, 131072, 84.0), (8, 262144, 84.5))],
    _tt("8B FSDP on 128 H100", "llama3-8b", _8B_T3, 67.0, "Table 3: FSDP", _EAGER),
    _tt("8B FSDP + compile on 128 H100", "llama3-8b", _8B_T3, 62.0, "Table 3: FSDP + torch.compile", _COMPILED),
    _tt("8B FSDP + compile + Float8 on 128 H100", "llama3-8b", _8B_T3, 61.8,
        "Table 3: FSDP + torch.compile + Float8"),
    _tt("70B FSDP 32 TP 8 on 256 H100", "llama3-70b", dict(dp=32, tp=8, zero=3, micro_batch=16, seq_len=8192,
                                                            recompute="full"), 71.9, "Table 4: 2D"),
    _tt("405B FSDP 8 TP 8 PP 8, 1F1B", "llama3-405b", dict(_405B, dp=8, micro_batch=4, grad_accum=8, seq_len=8192),
        82.5, "Table 5: 1F1B (local batch 32, 8 micro-batches)"),
    _tt("405B FSDP 8 TP 8 PP 8, interleaved 1F1B", "llama3-405b",
        dict(_405B, dp=8, micro_batch=2, grad_accum=16, seq_len=8192, schedule="interleaved", chunks=2), 72.7,
        "Table 5: interleaved 1F1B (local batch 32, 16 micro-batches: one per stage of the 8 x 2)"),
    *[_tt(f"405B FSDP {8 // cp} CP {cp} TP 8 PP 8, seq {seq // 1024}K", "llama3-405b",
          dict(_405B, dp=8 // cp, cp=cp, micro_batch=1, grad_accum=8, seq_len=seq,
               cp_attention="allgather" if cp > 1 else "zigzag"), pub, f"Table 6: FSDP {8 // cp}, CP {cp}")
      for cp, seq, pub in ((1, 32768, 75.3), (2, 65536, 75.9), (4, 131072, 77.1), (8, 262144, 84.9))],
    # Llama 3 paper (arXiv 2407.21783), section 3.3.2 and Table 4: tp 8, pp 16, dp 128, sequences of
    # 8192, 16 per data-parallel rank, an interleaved schedule, one block fewer on the first and the
    # last stage, optimizer states and gradients sharded but not the weights (ZeRO-2), and "we could
    # pre-train Llama 3 on sequences of 8K tokens without activation checkpointing": it fits 80 GB.
    MemoryRun("Llama 3 405B on 16,384 H100", "llama3-405b", "llama3", "megatron",
              dict(tp=8, pp=16, dp=128, zero=2, micro_batch=1, grad_accum=16, seq_len=8192, schedule="interleaved",
                   chunks=4, first_stage_layers=1, last_stage_layers=1, precision="bf16-fp32-grads"),
              "fits", 0.0, "Llama 3 paper (arXiv 2407.21783), section 3.3.2 and Table 4"),
    # DeepSeek-V3 report (arXiv 2412.19437), section 3.1-3.2: 2,048 H800, 16-way pipeline (DualPipe),
    # 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism; sequences
    # of 4K. Planned with DeepSeek's storage (activations in FP8, norms and MLA up-projections recomputed).
    MemoryRun("DeepSeek-V3 on 2,048 H800", "deepseek-v3", "deepseek", "deepseek",
              dict(dp=128, pp=16, ep=64, zero=1, schedule="dualpipev", chunks=2, micro_batch=1, grad_accum=120, seq_len=4096,
                   precision="bf16-fp32-grads"),
              "fits", 0.0, "DeepSeek-V3 report (arXiv 2412.19437), sections 3.1 and 3.2"),
    # Our engine on one H100 80GB HBM3 (docs/benchmarks.md, "On a GPU"): the JSONL's allocator peak of
    # `ultrascale train --model smollm-135m --device cuda --steps 2 --seq-len 1024 --micro-batch 4`.
    *[MemoryRun(f"ultrascale smollm-135m {dtype} on 1 H100", "smollm-135m", "h100-80gb", "ultrascale",
                dict(micro_batch=4, seq_len=1024, precision=prec), "allocated", pub,
                "docs/benchmarks.md, On a GPU: measured on an H100 80GB HBM3 (torch 2.11, CUDA 13.0)")
      for dtype, prec, pub in (("fp32", "fp32", 9.29), ("bf16", "bf16-fp32-grads", 6.93))],
]


def plan_gib(run: MemoryRun, own: bool = True) -> tuple[float, float]:
    """(the figure on the run's scale, the card's memory), in GiB, planned with the run's own
    framework (own) or the default one; the memory model reads nothing else of the cluster."""
    fw = get_framework(run.framework if own else DEFAULT_FRAMEWORK)
    fw = dataclasses.replace(fw, **run.switches) if own else fw
    cluster = get_cluster(run.cluster)
    shape, lay = get_shape(run.model), Layout(**run.layout)
    check_layout(lay, shape)
    plan = memory_plan(shape, lay, fw)
    peak = plan.peak
    figure = {"reserved": peak.total - fw.context_bytes, "allocated": peak.allocated,
              "fits": max(s.needed for s in plan.stages)}[run.kind]
    return figure / GIB, cluster.gpu.memory_bytes / GIB


def table() -> list[dict]:
    out = []
    for run in RUNS:
        own, card = plan_gib(run)
        default, _ = plan_gib(run, own=False)
        row = {"run": run.name, "kind": run.kind, "published_gib": run.published_gib or None, "own_gib": own,
               "default_gib": default, "card_gib": card, "framework": run.framework, "cluster": run.cluster,
               "source": run.source}
        if run.published_gib:
            row.update(own_ratio=own / run.published_gib, default_ratio=default / run.published_gib)
        out.append(row)
    return out
