"""Shared pieces of the distributed benchmarks: machine info, the interleaved schedule, statistics.

A runner is any object with a `label` and a `step()` that trains one optimizer
step and returns its time in seconds. Every rank runs the same schedule:
`warmup` untimed steps per runner, then `repeats` rounds in which each runner
runs `steps` timed steps, in an order that rotates from round to round
(A B C, B C A, C A B, ...), with a barrier before each block so that the ranks
start it together. Load from other processes on the machine then falls on all
runners alike, and a paired ratio (the two runners' times in the same round)
cancels the load that changes from one round to the next.

A step's time is the slowest rank's time for it: the step is done when every
rank is done.
"""

from __future__ import annotations

import gc
import os
import platform
import shlex
import statistics
import sys

import torch


def machine_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": cpu_isa(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "loadavg_start": os.getloadavg()}


def cpu_isa() -> str:
    """The vector instructions that pick torch's CPU kernels (two CPUs named alike can differ here)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return "unknown"
    names = [("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"), ("amx_tile", "AMX")]
    found = [name for flag, name in names if flag in flags]
    if not found:
        found = ["AVX2"] if "avx2" in flags else ["no AVX2"]
    return ", ".join(found)


def command_line() -> str:
    args = [os.path.relpath(sys.argv[0])] + sys.argv[1:]
    return " ".join([".venv/bin/python"] + [shlex.quote(a) for a in args])


def interleave(runners, warmup: int, repeats: int, steps: int, barrier) -> dict:
    """Run the schedule on this rank; {label: [step seconds, in order]} (warm-up steps left out)."""
    for r in runners:
        for _ in range(warmup):
            barrier()
            r.step()
    times = {r.label: [] for r in runners}
    for rep in range(repeats):
        k = rep % len(runners)
        for r in runners[k:] + runners[:k]:
            gc.collect()
            barrier()
            times[r.label] += [r.step() for _ in range(steps)]
    return times


def combine(per_rank: list[dict], steps: int) -> tuple[dict, list[dict]]:
    """Per-rank {label: times} -> ({label: slowest rank's time per step}, per round {label: mean step time})."""
    labels = per_rank[0].keys()
    times = {lb: [max(ts) for ts in zip(*(r[lb] for r in per_rank))] for lb in labels}
    n_rounds = len(next(iter(times.values()))) // steps
    rounds = [{lb: statistics.fmean(times[lb][i * steps:(i + 1) * steps]) for lb in labels} for i in range(n_rounds)]
    return times, rounds


def summary(times: list[float]) -> dict:
    ts = sorted(times)
    med = statistics.median(ts)
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [med, med, med]
    return {"median_s": med, "q1_s": q[0], "q3_s": q[2], "min_s": ts[0], "n": len(ts)}


def paired_ratio(rounds: list[dict], a: str, b: str) -> float:
    """Median over rounds of a's mean step time over b's in the same round."""
    return statistics.median([rd[a] / rd[b] for rd in rounds])


def fmt_time(s: dict) -> str:
    return f"{s['median_s']:.3f} [{s['q1_s']:.3f}-{s['q3_s']:.3f}]"


def machine_line(m: dict) -> str:
    return (f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']}; one torch thread "
            f"per process, gloo over loopback. Load average (1 min) at start {m['loadavg_start'][0]:.2f}, "
            f"at end {m['loadavg_end'][0]:.2f}.")


def max_rel_diff(a: list[float], b: list[float]) -> float:
    n = min(len(a), len(b))
    return max((abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n])), default=float("nan"))
