"""One GPU, one process: the `1b` preset's training step, its MFU, FP8 against bf16, the planner's prediction.

Three runs of the same shape, batches and initial weights (the real `Trainer.train_step`):

- bf16 + compile: bf16 compute with fp32 masters, each block under torch.compile; attention is
  the model's SDPA, which on CUDA picks FlashAttention for bf16 (the kernel that runs is named
  in the profile: `ultrascale train --profile`). Tokens/s and MFU against the datasheet's dense
  bf16 peak (train/metrics.py PEAK_TFLOPS; 989.5 TFLOP/s on an H100 SXM); the goal is >= 50%.
- bf16 + compile + `--fp8` (torchao's Float8Linear, `torch._scaled_mm`): the speed-up of FP8
  over the compiled bf16 run, the comparison torchao's recipe is made for (its scaling and casts
  fuse only under the compiler); and bf16 eager against bf16 eager + FP8, where every amax, scale
  and cast is a kernel of its own. The largest per-step loss difference of each pair, beside that
  of compile against eager (same bf16 numerics, other kernels): the floor that rounding alone
  reaches on this run.
- the planner's predicted step time (plan/time.py, framework `ultrascale`, an H100 80 GB) for
  the same layout, against each measured median.

Each run: `--warmup` untimed steps (compilation happens there), then `--steps` timed ones; the
median step time. A run that fails is recorded with its error and the others go on.

    python benchmarks/bench_gpu.py --json gpu.json                         # on the GPU (make gpu-check)
    python benchmarks/bench_gpu.py --device cpu --model tiny --seq-len 64 --micro-batch 2 --steps 2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate  # noqa: E402
from ultrascale.distributed.context import build_context  # noqa: E402
from ultrascale.model import get_preset  # noqa: E402


def measure(label: str, run: RunConfig, device: torch.device, warmup: int, steps: int) -> dict:
    from ultrascale.train.trainer import Trainer

    out = {"label": label, "compile": run.train.compile, "fp8": run.train.fp8, "dtype": run.train.dtype}
    trainer = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer = Trainer(run, build_context(run.parallel, 0, 1, device=device))
        t0 = time.perf_counter()
        for _ in range(warmup):
            trainer.train_step()
        out["warmup_s"] = time.perf_counter() - t0
        metrics = [trainer.train_step() for _ in range(steps)]
        times = [m["step_time_s"] for m in metrics]
        med = statistics.median(times)
        tokens = run.global_batch * run.train.seq_len
        out.update(status="ok", step_times_s=times, median_step_s=med, tokens_per_s=tokens / med,
                   tflops=tokens / med * trainer.flops_per_token / 1e12, peak_tflops=trainer.peak,
                   peak_source=trainer.peak_source, losses=[m["loss"] for m in metrics],
                   allocator_peak_gib=(torch.cuda.max_memory_allocated(device) / 2**30
                                       if device.type == "cuda" else None))
        out["mfu"] = out["tflops"] / trainer.peak if trainer.peak else None
    except Exception as e:  # noqa: BLE001 - one failed run does not stop the others
        out.update(status="failed", error=f"{type(e).__name__}: {e}"[:500], traceback=traceback.format_exc()[-3000:])
    finally:
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def measure_apart(label: str, run: RunConfig, device: torch.device, warmup: int, steps: int) -> dict:
    """measure() in a fresh process of its own (spawned): each run starts on an empty card with
    cold compiler caches. In one process, on an H100, each earlier run left about 12.5 GiB of the
    1b preset's states allocated (its bf16 weights, fp32 masters and gradients) under the next,
    torch._dynamo.reset() or not, and the fourth run ran out of memory (docs/benchmarks.md)."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (label, run, device, warmup, steps))


def predicted_step_s(run: RunConfig, gpu: str = "h100-80gb", framework: str = "ultrascale") -> float:
    """The planner's step time for this one-process layout."""
    from ultrascale.plan.calibration import get_framework
    from ultrascale.plan.hardware import get_cluster
    from ultrascale.plan.layout import Layout, check_layout
    from ultrascale.plan.precision import ENGINE_PRECISION
    from ultrascale.plan.shape import from_model_config
    from ultrascale.plan.time import step_time

    t = run.train
    lay = Layout(micro_batch=t.micro_batch, grad_accum=t.grad_accum, seq_len=t.seq_len,
                 precision=ENGINE_PRECISION[t.dtype], recompute=t.recompute)
    shape = from_model_config(run.model)
    check_layout(lay, shape)
    return step_time(shape, lay, get_cluster(gpu=gpu), get_framework(framework)).step_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device is visible: run it on a GPU (or --device cpu to try the plumbing)",
              file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t = TrainConfig(steps=10**6, seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                    dtype="bf16", device=args.device, progress=False, seed=0, measure_activations=False,
                    peak="datasheet" if device.type == "cuda" else "auto")
    model = get_preset(args.model)
    if model.max_seq_len < args.seq_len:
        model = dataclasses.replace(model, max_seq_len=args.seq_len)
    base = validate(RunConfig(model=model, parallel=ParallelConfig(dp=1), train=t), 1)
    variant = lambda **kw: dataclasses.replace(base, train=dataclasses.replace(t, **kw))  # noqa: E731
    runs = [measure_apart("bf16 + compile", variant(compile=True), device, args.warmup, args.steps),
            measure_apart("bf16 + compile + fp8", variant(compile=True, fp8=True), device, args.warmup, args.steps),
            measure_apart("bf16 eager", base, device, args.warmup, args.steps),
            measure_apart("bf16 eager + fp8", variant(fp8=True), device, args.warmup, args.steps)]
    by = {r["label"]: r for r in runs}
    ok = lambda label: by[label]["status"] == "ok"  # noqa: E731
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "model": args.model, "tokens_per_step": base.global_batch * args.seq_len}
    for r in runs:
        key = r["label"].replace(" + ", "_").replace(" ", "_")
        summary[f"{key}_status"] = r["status"]
        if r["status"] == "ok":
            summary[f"{key}_tokens_per_s"] = r["tokens_per_s"]
            summary[f"{key}_mfu"] = r["mfu"]
            summary[f"{key}_median_step_s"] = r["median_step_s"]
    def pair(name, ref, other):
        if ok(ref) and ok(other):
            a, b = by[ref], by[other]
            summary[f"{name}_speedup"] = a["median_step_s"] / b["median_step_s"]
            summary[f"{name}_max_loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(b["losses"], a["losses"]))

    pair("fp8_compiled", "bf16 + compile", "bf16 + compile + fp8")
    pair("fp8_eager", "bf16 eager", "bf16 eager + fp8")
    pair("compile", "bf16 eager", "bf16 + compile")
    try:
        pred = predicted_step_s(base)
        summary["planner_step_s"] = pred
        for label in ("bf16 eager", "bf16 + compile"):
            if ok(label):
                summary[f"planner_over_measured_{label.replace(' + ', '_').replace(' ', '_')}"] = \
                    pred / by[label]["median_step_s"]
    except Exception as e:  # noqa: BLE001
        summary["planner_error"] = f"{type(e).__name__}: {e}"[:300]
    for k, v in summary.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "args": vars(args), "summary": summary, "runs": runs}, f,
                      indent=1)
    return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
