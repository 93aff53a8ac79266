"""The planner against the playbook's published H100 runs (playbook_benchmarks.csv).

Three figures, each with its goal:
- fit / no-fit accuracy over all runs: a run fits when it finished, or when it
  failed but the same configuration also finished elsewhere (then the failure
  was not memory, as the data's README says); the planner says it fits when its
  per-GPU total (overhead included) is within the GPU's memory;
- median absolute error of the predicted peak over the runs that finished: the
  CSV's peak_memory_gb is read as GiB (2^30 bytes) logged by the caching
  allocator, so it is compared with the planner's total less the CUDA context
  (which the allocator does not see);
- mean Spearman rank correlation of predicted vs measured tokens/s/GPU within
  each (model, nodes) group of finished runs;
- per node count, the median and 90th percentile of predicted / measured
  tokens/s/GPU over the finished runs (1.0 is exact; above it, the planner is
  optimistic). The goal is a median within [0.8, 1.25] at every node count (met)
  and a p90 within 2x (met at 1, 2 and 64 nodes: docs/planner.md, "The time
  model at scale");
- a cross-validation (`cross_validate`): the three synchronization constants
  calibrated on two of the four models, the figures reported on the other two.

The runs share one recipe (the data's README): H100 80 GB, 8 GPUs per node,
sequence 4096, global batch 256 sequences, bf16 with fp32 gradient accumulation,
AdamW, 1F1B, TP with sequence parallelism, FlashAttention, no recomputation.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import math
import statistics
from collections import defaultdict
from importlib import resources
from pathlib import Path

from ultrascale.errors import ConfigError
from ultrascale.plan.calibration import GIB, get_framework
from ultrascale.plan.hardware import get_cluster
from ultrascale.plan.layout import Layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.shape import get_shape
from ultrascale.plan.time import step_time

GOALS = {"accuracy": 0.90, "median_memory_error": 0.10, "mean_spearman": 0.80}
RATIO_GOAL = (0.8, 1.25, 2.0)  # median predicted/measured throughput within [0.8, 1.25], p90 within 2x
CSV_NAME = "playbook_benchmarks.csv"


def default_csv() -> Path | None:
    """../shared/data/playbook_benchmarks.csv beside the repository, if this is a checkout that has it."""
    repo = Path(__file__).resolve().parents[3]
    path = repo.parent / "shared" / "data" / CSV_NAME
    return path if path.is_file() else None


def load_rows(path: str | None = None) -> tuple[list[dict], str]:
    """The runs, and where they came from: --data, else the shared copy, else the packaged one."""
    if path:
        try:
            with open(path, newline="") as f:
                return list(csv.DictReader(f)), path
        except OSError as e:
            raise ConfigError(f"--data {path}: {e.strerror or e}") from None
    shared = default_csv()
    if shared is not None:
        with open(shared, newline="") as f:
            return list(csv.DictReader(f)), str(shared)
    text = resources.files("ultrascale.plan").joinpath("data", CSV_NAME).read_text()
    return list(csv.DictReader(io.StringIO(text))), f"{CSV_NAME} (packaged copy)"


def row_layout(r: dict) -> Layout:
    seqs = int(r["global_batch_seqs"])
    return Layout(dp=int(r["dp"]), tp=int(r["tp"]), pp=int(r["pp"]), zero=int(r["zero_stage"]),
                  micro_batch=int(r["micro_batch"]), grad_accum=seqs // (int(r["micro_batch"]) * int(r["dp"])),
                  seq_len=4096, precision="bf16-fp32-accum", sp=True, schedule="1f1b", recompute="none")


def _ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks, i = [0.0] * len(xs), 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(a, b) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (average ranks for ties)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else 0.0


def finished_runs(rows: list[dict]) -> list[tuple]:
    """(model, nodes, shape, layout, measured tokens/s/GPU) of every run that finished."""
    return [(r["model"], int(r["nodes"]), get_shape(r["model"].lower()), row_layout(r),
             float(r["tokens_per_s_per_gpu"])) for r in rows if r["status"] == "ok"]


def validate(rows: list[dict], framework: str = "playbook", cluster: str = "playbook") -> dict:
    fw, gpu = get_framework(framework), get_cluster(cluster)
    key = ("model", "nodes", "micro_batch", "grad_accum", "dp", "pp", "tp", "zero_stage")
    finished = {tuple(r[k] for k in key) for r in rows if r["status"] == "ok"}
    correct, errors = 0, []
    for r in rows:
        peak = memory_plan(get_shape(r["model"].lower()), row_layout(r), fw).peak
        fits = tuple(r[k] for k in key) in finished
        correct += (peak.total <= gpu.memory_bytes) == fits
        if r["status"] == "ok":
            measured = float(r["peak_memory_gb"]) * GIB
            errors.append(abs(peak.total - fw.context_bytes - measured) / measured)
    t = throughput_figures(finished_runs(rows), fw, gpu)
    rho = {f"{m} x {n} nodes": v for (m, n), v in sorted(t["spearman_by_group"].items(),
                                                          key=lambda kv: (float(kv[0][0][:-1]), kv[0][1]))}
    figures = {"runs": len(rows), "finished": len(errors), "accuracy": correct / len(rows),
               "median_memory_error": statistics.median(errors), "mean_spearman": t["mean_spearman"],
               "spearman_by_group": rho, "framework": framework, "cluster": cluster,
               "throughput_ratio_by_nodes": {n: {"runs": t["runs"][n], "median": t["median"][n], "p90": t["p90"][n]}
                                             for n in t["median"]}}
    lo, hi, _ = RATIO_GOAL
    figures["goals_met"] = (figures["accuracy"] >= GOALS["accuracy"]
                            and figures["median_memory_error"] <= GOALS["median_memory_error"]
                            and figures["mean_spearman"] >= GOALS["mean_spearman"]
                            and all(lo <= m <= hi for m in t["median"].values()))
    return figures


# The constants the cross-validation calibrates, the values it tries, and the folds: each pair of
# models calibrates, the other pair is reported. Two belong to the framework (calibration.Framework),
# one to the cluster (hardware.Cluster).
SYNC_GRID = {"collective_step_s": (10e-6, 20e-6, 30e-6), "pipeline_sync_factor": (4.0, 8.0, 12.0),
             "node_pair_sync_s": (1e-4, 2e-4, 3e-4)}
CLUSTER_CONSTANTS = ("node_pair_sync_s",)


def _with(fw, cluster, constants: dict):
    """The framework and cluster with the grid's values in place of their own."""
    on_cluster = {k: v for k, v in constants.items() if k in CLUSTER_CONSTANTS}
    on_fw = {k: v for k, v in constants.items() if k not in CLUSTER_CONSTANTS}
    return dataclasses.replace(fw, **on_fw), dataclasses.replace(cluster, **on_cluster)
FOLDS = (("1B", "8B"), ("3B", "80B"))


def throughput_figures(finished: list, fw, gpu) -> dict:
    """Per node count the runs and the median and p90 of predicted / measured tokens/s/GPU; Spearman
    per (model, nodes) group of three runs or more, and its mean; the mean squared log ratio.
    `finished` as finished_runs gives it."""
    ratios, groups = defaultdict(list), defaultdict(lambda: ([], []))
    for model, nodes, shape, lay, measured in finished:
        predicted = step_time(shape, lay, gpu, fw).tokens_per_s_per_gpu
        ratios[nodes].append(predicted / measured)
        groups[(model, nodes)][0].append(measured)
        groups[(model, nodes)][1].append(predicted)
    rhos = {g: spearman(a, b) for g, (a, b) in groups.items() if len(a) >= 3}
    return {"runs": {n: len(v) for n, v in sorted(ratios.items())},
            "median": {n: statistics.median(v) for n, v in sorted(ratios.items())},
            "p90": {n: statistics.quantiles(v, n=10, method="inclusive")[-1] for n, v in sorted(ratios.items())},
            "spearman_by_group": rhos, "mean_spearman": statistics.fmean(rhos.values()),
            "msle": statistics.fmean(math.log(x) ** 2 for v in ratios.values() for x in v)}


def _loss(f: dict) -> float:
    """What calibration minimises: every node count's median off 1 (squared log), a fifth of the mean
    squared log error (the spread), less the mean Spearman (the ranking)."""
    return sum(math.log(m) ** 2 for m in f["median"].values()) + 0.2 * f["msle"] - f["mean_spearman"]


def cross_validate(rows: list[dict], framework: str = "playbook", cluster: str = "playbook") -> list[dict]:
    """For each fold: the SYNC_GRID values that fit the fold's two models best, and the figures they
    give on the two models left out."""
    fw, gpu = get_framework(framework), get_cluster(cluster)
    finished = finished_runs(rows)
    out = []
    for fold in FOLDS:
        train = [x for x in finished if x[0] in fold]
        test = [x for x in finished if x[0] not in fold]
        best = min((dict(zip(SYNC_GRID, values)) for values in itertools.product(*SYNC_GRID.values())),
                   key=lambda c: _loss(throughput_figures(train, *_with(fw, gpu, c))))
        figures = throughput_figures(test, *_with(fw, gpu, best))
        figures["spearman_by_group"] = {f"{m} x {n} nodes": v for (m, n), v in figures["spearman_by_group"].items()}
        out.append({"calibrated_on": list(fold), "reported_on": sorted({x[0] for x in test}, key=lambda m: float(m[:-1])),
                    "constants": best, **figures})
    return out


def cross_validation_lines(folds: list[dict]) -> list[str]:
    lo, hi, _ = RATIO_GOAL
    out = ["cross-validation: the synchronization constants calibrated on two models, reported on the others"]
    for f in folds:
        c = f["constants"]
        out.append(f"  calibrated on {' + '.join(f['calibrated_on'])}: collective_step_s "
                   f"{c['collective_step_s'] * 1e6:g} us, pipeline_sync_factor {c['pipeline_sync_factor']:g}, "
                   f"node_pair_sync_s {c['node_pair_sync_s'] * 1e3:g} ms")
        meds = "  ".join(f"{n}:{m:.2f}" for n, m in f["median"].items())
        ok = all(lo <= m <= hi for m in f["median"].values())
        out.append(f"    on {' + '.join(f['reported_on'])}: median by nodes {meds}  "
                   f"({'all in' if ok else 'NOT all in'} [{lo}, {hi}]); mean Spearman {f['mean_spearman']:.3f}")
    return out


def report_lines(f: dict, source: str) -> list[str]:
    ok = lambda met: "met" if met else "MISSED"  # noqa: E731
    out = [f"playbook benchmark runs: {source}",
           f"{f['runs']:,} runs, {f['finished']:,} finished; framework {f['framework']} on cluster {f['cluster']}",
           f"fit / no-fit accuracy:                 {100 * f['accuracy']:5.1f}%  (goal >= 90%: "
           f"{ok(f['accuracy'] >= GOALS['accuracy'])})",
           f"median |peak memory error| (finished): {100 * f['median_memory_error']:5.1f}%  (goal <= 10%: "
           f"{ok(f['median_memory_error'] <= GOALS['median_memory_error'])})",
           f"mean Spearman, tokens/s/GPU by group:  {f['mean_spearman']:5.3f}   (goal >= 0.8: "
           f"{ok(f['mean_spearman'] >= GOALS['mean_spearman'])})",
           "predicted / measured tokens/s/GPU by node count (goal: median in [0.8, 1.25], p90 <= 2):"]
    lo, hi, p90 = RATIO_GOAL
    for n, r in f["throughput_ratio_by_nodes"].items():
        out.append(f"  {n:3d} nodes: {r['runs']:4d} runs, median {r['median']:5.2f} ({ok(lo <= r['median'] <= hi)}), "
                   f"p90 {r['p90']:6.2f} ({ok(r['p90'] <= p90)})")
    out.append("Spearman by (model, nodes):")
    items = list(f["spearman_by_group"].items())
    for i in range(0, len(items), 4):
        out.append("  " + "  ".join(f"{k:<15}{v:6.3f}" for k, v in items[i:i + 4]))
    return out
