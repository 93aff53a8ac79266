"""Where one training step's time goes, against the matmul ceiling measured in the same run.

The `small` demo (`make demo`: seq 128, micro-batch 8, one process) is trained by the real
`Trainer.train_step`. In one process, in this order:

1. `ultrascale peak`'s measurement (square matmuls, best of 10 repeats);
2. `--repeats` unprofiled steps, each behind the idle gate of bench_single_vs_hf.py: the
   median step time and the MFU it gives (FLOPs per token, the trainer's 6N + 12·L·h·s,
   x tokens/s over the ceiling);
3. `--profile-steps` steps under torch.profiler, each operator's self time put in a class:
   matmul (mm, addmm, bmm), attention (the fused SDPA kernels, forward and backward), loss
   (log-softmax and NLL), norms, other elementwise (RoPE, SwiGLU, residual adds, the fp32
   gradient accumulation), optimizer (everything under the `optimizer` span: clipping,
   AdamW, the copy back); what no operator accounts for is Python and autograd overhead;
4. every matmul shape the profiled steps ran, timed alone (best of 30 windows, the shapes
   taking turns, the same transposes as in the step), so the matmuls' own rate can be set against the ceiling;
5. the ceiling again.

    .venv/bin/python benchmarks/bench_step_breakdown.py --json /tmp/breakdown.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402
from bench_single_vs_hf import IdleGate, measure_peak  # noqa: E402
from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.distributed.context import build_context
from ultrascale.model import flops_per_token
from ultrascale.model.config import get_preset
from ultrascale.spans import recording
from ultrascale.train.trainer import Trainer

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm")
NORMS = ("aten::rms_norm", "aten::_fused_rms_norm", "aten::_fused_rms_norm_backward", "aten::rsqrt", "aten::mean",
         "aten::pow")
LOSS = ("aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss_forward",
        "aten::nll_loss_backward")


def op_class(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    if name in LOSS:
        return "loss"
    if name in NORMS:
        return "norms"
    return "other elementwise"


def _inside(e, spans) -> bool:
    return any(s.time_range.start <= e.time_range.start and e.time_range.end <= s.time_range.end for s in spans)


def breakdown(trainer: Trainer, steps: int) -> tuple[dict, list[float], dict]:
    """Self time per class, per step (ms); the profiled steps' times; the matmul calls by shape; the
    operators of each class (ms per step)."""
    recording(True)  # the engine's spans (`optimizer` among them), as under --profile
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            times = [trainer.train_step()["step_time_s"] for _ in range(steps)]
    finally:
        recording(False)
    events = list(prof.events())
    opt_spans = [e for e in events if e.name == "optimizer"]
    per = collections.defaultdict(float)
    ops = collections.defaultdict(lambda: collections.defaultdict(float))  # class -> operator -> ms per step
    shapes = collections.Counter()
    for e in events:
        if e.device_type.name != "CPU" or not e.name.startswith("aten::"):
            continue
        ms = e.self_cpu_time_total / 1e3 / steps
        cls = "optimizer" if _inside(e, opt_spans) else op_class(e.name)
        per[cls] += ms
        ops[cls][e.name] += ms
        if e.name == "aten::mm" and not _inside(e, opt_spans):
            a, b = e.input_shapes[:2]
            shapes[(tuple(a), tuple(b))] += 1
    return dict(per), times, shapes, ops


def time_matmuls(shapes, repeats: int = 30) -> dict:
    """Best time of each (m, k) @ (k, n) product alone, s (the second operand a transposed (n, k), as
    F.linear has it): 10 ms windows, the shapes taking turns, so that a burst of load from other
    processes spoils one window of several shapes rather than every window of one."""
    operands = {s: (torch.randn(s[0]), torch.randn(s[1][::-1]).t()) for s in shapes}
    best = {s: float("inf") for s in shapes}
    for _ in range(repeats):
        for s, (a, b) in operands.items():
            torch.mm(a, b)
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < 0.01:
                torch.mm(a, b)
                n += 1
            best[s] = min(best[s], (time.perf_counter() - start) / n)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20, help="unprofiled steps, each behind the idle gate")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--idle-below", type=float, default=0.2, metavar="FRACTION")
    p.add_argument("--max-wait", type=float, default=30, metavar="SECONDS")
    p.add_argument("--compile", action="store_true", help="train with --compile (each block under torch.compile)")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)

    machine = common.machine_info()
    t = TrainConfig(steps=10**6, seq_len=args.seq_len, micro_batch=args.micro_batch, lr=3e-3, progress=False,
                    compile=args.compile, peak="1")  # the ceiling is measured below, around the steps, not at start-up
    run = validate(RunConfig(model=get_preset(args.model), parallel=ParallelConfig(dp=1), train=t), 1)
    trainer = Trainer(run, build_context(run.parallel, 0, 1, device=torch.device("cpu")))
    gate = IdleGate(args.idle_below, args.max_wait)
    print(f"{machine['cpu']} | {machine['cores']} cores | {torch.get_num_threads()} threads | torch {machine['torch']}",
          flush=True)
    peaks = [measure_peak(torch.device("cpu"), "fp32", gate)]
    for _ in range(args.warmup):
        trainer.train_step()
    times = []
    for _ in range(args.repeats):
        gate.wait()
        times.append(trainer.train_step()["step_time_s"])
    gate.wait()
    per, prof_times, shapes, ops = breakdown(trainer, args.profile_steps)
    gate.wait()
    mm_alone = time_matmuls(list(shapes))
    peaks.append(measure_peak(torch.device("cpu"), "fp32", gate))

    peak = max(peaks)
    tokens = run.global_batch * t.seq_len
    fpt = flops_per_token(run.model, t.seq_len)
    med = statistics.median(times)
    mfu = tokens * fpt / med / 1e12 / peak
    prof_step = statistics.median(prof_times) * 1e3
    per["Python and autograd overhead"] = max(0.0, prof_step - sum(per.values()))
    mm_flops = sum(2 * a[0] * a[1] * b[1] * c for (a, b), c in shapes.items()) / args.profile_steps
    mm_floor = sum(mm_alone[s] * c for s, c in shapes.items()) / args.profile_steps * 1e3
    lines = [
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {torch.get_num_threads()} torch threads, torch "
        f"{machine['torch']}; `{args.model}`, batch {args.micro_batch} x {args.seq_len} tokens, fp32, one process"
        f"{', --compile' if args.compile else ''}.",
        f"`ultrascale peak` before / after: {peaks[0]:.4g} / {peaks[1]:.4g} TFLOP/s; {fpt / 1e6:.2f} MFLOP per token.",
        f"Unprofiled: median step {1e3 * med:.1f} ms [quartiles {1e3 * statistics.quantiles(times, n=4)[0]:.1f}-"
        f"{1e3 * statistics.quantiles(times, n=4)[2]:.1f}], best {1e3 * min(times):.1f} ms over {len(times)} steps: "
        f"**MFU {100 * mfu:.1f}%** of the higher ceiling "
        f"(best step: {100 * tokens * fpt / min(times) / 1e12 / peak:.1f}%).",
        "",
        f"Profiled ({args.profile_steps} steps, median {prof_step:.1f} ms, the profiler's own cost included):",
        "",
        "| where | ms per step | share | its largest operators (ms per step) |",
        "|---|---:|---:|---|",
    ]
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
        top = sorted(ops.get(name, {}).items(), key=lambda kv: -kv[1])[:6]
        lines.append(f"| {name} | {ms:.1f} | {100 * ms / prof_step:.0f}% | "
                     + ", ".join(f"{n.removeprefix('aten::')} {v:.1f}" for n, v in top) + " |")
    lines += [
        "",
        f"Matmuls: {mm_flops / 1e9:.2f} GFLOP per step; in the step {per.get('matmul', 0):.1f} ms "
        f"({mm_flops / per.get('matmul', 1) / 1e9:.3f} TFLOP/s), alone {mm_floor:.1f} ms "
        f"({mm_flops / mm_floor / 1e9:.3f} TFLOP/s, {100 * mm_flops / mm_floor / 1e9 / peak:.0f}% of the ceiling). "
        f"With every other cost at zero but attention, the step would take "
        f"{mm_floor + per.get('attention', 0):.1f} ms: "
        f"MFU {100 * tokens * fpt / ((mm_floor + per.get('attention', 0)) / 1e3) / 1e12 / peak:.1f}%.",
        "",
        "| matmul (m, k) @ (k, n) | calls per step | alone (ms) | TFLOP/s alone | of the ceiling |",
        "|---|---:|---:|---:|---:|",
    ]
    for (a, b), c in sorted(shapes.items(), key=lambda kv: -mm_alone[kv[0]] * kv[1]):
        rate = 2 * a[0] * a[1] * b[1] / mm_alone[(a, b)] / 1e12
        lines.append(f"| {a} @ {b} | {c / args.profile_steps:g} | {1e3 * mm_alone[(a, b)]:.2f} | {rate:.3f} | "
                     f"{100 * rate / peak:.0f}% |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "machine": machine, "peaks_tflops": peaks, "step_times_s": times,
                       "mfu": mfu, "profiled_ms_per_step": per,
                       "operators_ms_per_step": {k: dict(v) for k, v in ops.items()}, "matmul_floor_ms": mm_floor,
                       "idle_gate": gate.seen}, f, indent=1)


if __name__ == "__main__":
    main()
