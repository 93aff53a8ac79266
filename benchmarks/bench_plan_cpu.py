"""The planner's `ultrascale` framework from this engine's own runs: measured step times of the
layouts the engine runs, against plan/time.py's `step_time`, with the constants fitted here.

The machine is described as a cluster (plan/hardware.py), one device per rank: each rank is one
process with one torch thread, so a 2-core machine is a "node" of 2 devices.
- peak: the fp32 matmul ceiling (train/peak.py) measured by both ranks at once, as they train;
- memory bandwidth per device: a copy of a large fp32 tensor, both ranks at once (the optimizer
  and the eager attention's score passes are memory-bound);
- link: gloo all-reduce between the 2 processes from 4 KiB to 16 MiB; a least-squares line through
  time = bytes / bandwidth + 2 x latency (a ring of 2: one step out, one back) gives both.

Then the model `small` (4 layers, hidden 256) trains in each layout of LAYOUTS (the benchmarks'
layouts: one process, dp 2 with and without ZeRO-1, tp 2 + SP, pp 2 1F1B, cp 2 in each attention
variant) for `--warmup`
untimed and `--steps` timed steps; a layout's time is the median over steps of the slowest rank's
`step_time_s` (train/trainer.py).

The framework's three software constants (`mfu`: the share of the peak the model's matmuls reach,
`layer_overhead_s` per layer and micro-batch, `microbatch_overhead_s` per micro-batch) are fitted by
least squares on log(predicted / measured) over the layouts, and once more with each layout held out
and predicted from the others (leave-one-out): the table shows both. The result goes to --json;
plan/data/cpu_runs.json is the copy the planner's `cpu` cluster and `ultrascale` framework were set
from, and tests/test_plan.py checks the planner against it.

    .venv/bin/python benchmarks/bench_plan_cpu.py --json src/ultrascale/plan/data/cpu_runs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank; this process is rank 0 of one-process runs

import torch  # noqa: E402

from _common import command_line, machine_info  # noqa: E402
from ultrascale.config import ParallelConfig, RunConfig, TrainConfig  # noqa: E402
from ultrascale.model import get_preset  # noqa: E402
from ultrascale.plan.calibration import get_framework  # noqa: E402
from ultrascale.plan.hardware import GPU, Cluster, Link  # noqa: E402
from ultrascale.plan.layout import Layout  # noqa: E402
from ultrascale.plan.precision import ENGINE_PRECISION  # noqa: E402
from ultrascale.plan.shape import from_model_config  # noqa: E402
from ultrascale.plan.time import step_time  # noqa: E402
from ultrascale.train.startup import check_run  # noqa: E402
from ultrascale.testing.harness import run_distributed, shutdown_pools, worker_context  # noqa: E402

MODEL, SEQ = "small", 256
# (label, world, parallel settings, micro-batch, grad-accum): 8 sequences per step in every layout.
LAYOUTS = [
    ("1 process", 1, {}, 4, 2),
    ("1 process, micro-batch 1", 1, {}, 1, 8),
    ("dp 2", 2, {"dp": 2}, 4, 1),
    ("dp 2 zero 1", 2, {"dp": 2, "zero": 1}, 4, 1),
    ("tp 2 + sp", 2, {"tp": 2, "sp": True}, 4, 2),
    ("pp 2 1f1b m=4", 2, {"pp": 2, "pp_schedule": "1f1b"}, 2, 4),
    ("cp 2 ring", 2, {"cp": 2, "cp_attention": "ring"}, 4, 2),
    ("cp 2 zigzag", 2, {"cp": 2, "cp_attention": "zigzag"}, 4, 2),
    ("cp 2 allgather", 2, {"cp": 2, "cp_attention": "allgather"}, 4, 2),
    ("cp 2 ulysses", 2, {"cp": 2, "cp_attention": "ulysses"}, 4, 2),
]
# Context parallelism where attention is most of the work (seq 2048: 12·h·s is 1.3x the blocks' 6N per
# token): the causal balance of the variants shows (the ring's last rank does 1.5x the mean at cp 2).
LONG = 2048
LAYOUTS += [(f"cp 2 {v}, seq {LONG}", 2, {"cp": 2, "cp_attention": v}, 1, 1, LONG) for v in ("ring", "zigzag")]
FITTED = ("mfu", "layer_overhead_s", "microbatch_overhead_s", "collective_step_s")


# -- the machine ---------------------------------------------------------------------------------
def _machine_on_rank(sizes: list[int], repeats: int) -> dict:
    import torch.distributed as dist

    from ultrascale.train.peak import measure

    def agree(x: int) -> int:
        t = torch.tensor([x])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    peak = measure(torch.device("cpu"), "fp32", agree=agree, barrier=dist.barrier).tflops * 1e12
    # Memory bandwidth as the memory-bound terms see it (the optimizer's and the eager softmax's
    # passes): one elementwise pass, exp, that reads and writes every byte; both ranks at once.
    src, dst = torch.ones(2**24), torch.empty(2**24)  # 64 MiB each, far beyond the caches
    passes = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        torch.exp(src, out=dst)
        passes.append(time.perf_counter() - t0)
    memory_bw = 2 * src.numel() * 4 / statistics.median(passes)
    # All-reduce on the process group, as the engine's collectives run.
    reduce_s = {}
    for n in sizes:
        x = torch.ones(n // 4)
        for _ in range(10):  # warm-up: the first messages also set up the connections
            dist.all_reduce(x)
        ts = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ts.append(time.perf_counter() - t0)
        reduce_s[n] = statistics.median(ts)
    return {"peak_flops": peak, "memory_bandwidth": memory_bw, "all_reduce_s": reduce_s}


def measure_machine(repeats: int) -> dict:
    sizes = [2**k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB
    per_rank = run_distributed(2, _machine_on_rank, sizes, repeats)
    reduce_s = {n: max(r["all_reduce_s"][n] for r in per_rank) for n in sizes}
    # time = bytes / bandwidth + 2 latency, fitted on relative errors (weights 1 / time^2), so that the
    # small messages set the latency as much as the large ones set the bandwidth.
    xs, ys = list(reduce_s), list(reduce_s.values())
    w = [1 / y**2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx**2)
    latency = max(0.0, (sy - slope * sx) / sw / 2)
    return {"peak_flops_fp32": statistics.fmean(r["peak_flops"] for r in per_rank),
            "memory_bandwidth": statistics.fmean(r["memory_bandwidth"] for r in per_rank),
            "link_bandwidth": 1 / slope, "link_latency_s": latency,
            "all_reduce_s": {str(n): t for n, t in reduce_s.items()}}


def cluster_of(m: dict) -> Cluster:
    """The measured machine in the planner's terms: a device is one rank (one thread, one core)."""
    device = GPU("cpu-core", 12 * 2**30, {"fp32": m["peak_flops_fp32"], "bf16": m["peak_flops_fp32"]},
                 m["memory_bandwidth"])
    link = Link("gloo, loopback TCP", m["link_bandwidth"], m["link_latency_s"])
    return Cluster("cpu", device, link, link, node_size=os.cpu_count() or 2)


# -- the runs ------------------------------------------------------------------------------------
def run_config(parallel: dict, micro_batch: int, grad_accum: int, steps: int, seq_len: int = SEQ) -> RunConfig:
    t = TrainConfig(steps=steps, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, seed=0,
                    progress=False, lr=1e-3, warmup_steps=1, peak="1")  # --peak given: no measurement per run
    model = get_preset(MODEL, max_seq_len=max(get_preset(MODEL).max_seq_len, seq_len))  # room for RoPE
    return RunConfig(model=model, parallel=ParallelConfig(**parallel), train=t)


def _steps_on_rank(cfg: RunConfig) -> list[float]:
    from ultrascale.train.trainer import run_training

    return [m["step_time_s"] for m in run_training(cfg, worker_context(cfg.parallel)).metrics]


def measure_layout(world: int, cfg: RunConfig, warmup: int) -> list[float]:
    from ultrascale.distributed.context import build_context
    from ultrascale.train.trainer import run_training

    if world == 1:
        torch.set_num_threads(1)
        per_rank = [[m["step_time_s"] for m in run_training(cfg, build_context(cfg.parallel, 0, 1)).metrics]]
    else:
        per_rank = run_distributed(world, _steps_on_rank, cfg, timeout=900)
    return [max(ts) for ts in zip(*per_rank)][warmup:]  # a step ends when its slowest rank ends


def layout_of(cfg: RunConfig) -> Layout:
    p, t = cfg.parallel, cfg.train
    return Layout(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, sp=p.sp, zero=p.zero, schedule=p.pp_schedule,
                  cp_attention=p.cp_attention, micro_batch=t.micro_batch, grad_accum=t.grad_accum, seq_len=t.seq_len,
                  precision=ENGINE_PRECISION[t.dtype], recompute=t.recompute, bucket_mb=p.bucket_mb)


# -- the fit -------------------------------------------------------------------------------------
def predict(runs: list[dict], cluster: Cluster, constants: dict) -> list[float]:
    fw = dataclasses.replace(get_framework("ultrascale"), **constants)
    shape = from_model_config(get_preset(MODEL))
    return [step_time(shape, Layout(**r["layout"]), cluster, fw).step_s for r in runs]


def _loss(runs, cluster, constants) -> float:
    return sum(math.log(p / r["measured_s"]) ** 2 for p, r in zip(predict(runs, cluster, constants), runs))


def fit(runs: list[dict], cluster: Cluster) -> dict:
    """The constants that minimise the squared log error: a grid, then finer grids around the best."""
    span = {"mfu": (0.1, 1.5), "layer_overhead_s": (0.0, 0.02), "microbatch_overhead_s": (0.0, 0.05),
            "collective_step_s": (0.0, 0.004)}
    best = None
    for _ in range(4):
        grids = [[lo + (hi - lo) * i / 8 for i in range(9)] for lo, hi in span.values()]
        for values in itertools.product(*grids):
            c = dict(zip(FITTED, values))
            if c["mfu"] > 0:
                loss = _loss(runs, cluster, c)
                if best is None or loss < best[0]:
                    best = (loss, c)
        span = {k: (max(0.0, best[1][k] - (hi - lo) / 8), best[1][k] + (hi - lo) / 8) for k, (lo, hi) in span.items()}
    return best[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per layout, first")
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats of each machine measurement")
    ap.add_argument("--json", help="write the measurements and the fit here")
    ap.add_argument("--refit", metavar="JSON", help="fit again the measurements of an earlier --json (no runs)")
    args = ap.parse_args()
    if args.refit:
        with open(args.refit) as f:
            earlier = json.load(f)
        info, machine, runs = earlier["machine"], earlier["measured"], earlier["runs"]
        cluster = cluster_of(machine)
    else:
        info, machine, runs = machine_info(), measure_machine(args.repeats), []
        cluster = cluster_of(machine)
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}")
    print(f"  per rank (1 thread): fp32 peak {machine['peak_flops_fp32'] / 1e9:.1f} GFLOP/s, memory "
          f"{machine['memory_bandwidth'] / 1e9:.1f} GB/s; gloo all-reduce {machine['link_bandwidth'] / 1e9:.2f} GB/s, "
          f"latency {machine['link_latency_s'] * 1e6:.0f} us")
    for label, world, parallel, mb, ga, *seq in ([] if args.refit else LAYOUTS):
        cfg = check_run(run_config(parallel, mb, ga, args.warmup + args.steps, *seq), world)  # dp resolved
        times = measure_layout(world, cfg, args.warmup)
        runs.append({"label": label, "world": world, "layout": dataclasses.asdict(layout_of(cfg)),
                     "measured_s": statistics.median(times), "steps_s": times})
        print(f"  {label:26s} {statistics.median(times):.3f} s per step (median of {len(times)})")
    shutdown_pools()
    if args.json and not args.refit:  # the measurements first: a fit can be redone from them (--refit)
        with open(args.json, "w") as f:
            json.dump({"command": command_line(), "machine": info, "model": MODEL, "seq_len": SEQ,
                       "measured": machine, "runs": runs}, f, indent=1)
    constants = fit(runs, cluster)
    held_out = []
    for i in range(len(runs)):
        c = fit(runs[:i] + runs[i + 1:], cluster)
        held_out.append(predict([runs[i]], cluster, c)[0])
    for r, p, h in zip(runs, predict(runs, cluster, constants), held_out):
        r.update(predicted_s=p, held_out_predicted_s=h)
    print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in constants.items()))
    print(f"  {'layout':26s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s} {'held out':>9s}")
    for r in runs:
        print(f"  {r['label']:26s} {r['measured_s']:8.3f}s {r['predicted_s']:8.3f}s "
              f"{r['predicted_s'] / r['measured_s']:6.2f} {r['held_out_predicted_s'] / r['measured_s']:9.2f}")
    if args.json:
        out = {"command": earlier["command"] if args.refit else command_line(), "machine": info, "model": MODEL, "seq_len": SEQ,
               "measured": machine, "fitted": constants, "runs": runs}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
