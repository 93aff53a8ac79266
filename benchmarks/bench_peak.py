"""How stable the start-up matmul ceiling is (what `--peak auto` divides MFU by), quiet and under load.

Each measurement runs in a fresh process, as a run's start-up does, with an empty cache (its own
XDG_CACHE_HOME), in two ways taken in turn so that the load falls on both alike:

- `before`: the start-up measurement this project used first: per size, 5 repeats of at least
  20 ms each, no pause, a quarter-second budget (peak.measure(..., repeats=5, min_time=0.02,
  pause_s=0, budget_s=0.25));
- `now`: what `train --peak auto` measures today (peak.measured_peak: 40 repeats of at least
  2 ms, a 1 ms pause after each, a one-second budget).

Conditions: `quiet` (whatever else the machine runs), and `load`: one `ultrascale train` of
the `small` preset on every core (torch's default threads) running beside the measurements.

    .venv/bin/python benchmarks/bench_peak.py --runs 5 --threads 1 --json /tmp/peak.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import command_line, machine_info  # noqa: E402

MEASURE = r"""
import json, sys, time
import torch
from ultrascale.train import peak
how, dtype = sys.argv[1], sys.argv[2]
cpu = torch.device("cpu")
t0 = time.perf_counter()
if how == "before":
    value = peak.measure(cpu, dtype, repeats=5, min_time=0.02, pause_s=0.0, budget_s=0.25).tflops
else:
    value = peak.measured_peak(cpu, dtype)[0]
print(json.dumps({"tflops": value, "seconds": time.perf_counter() - t0}))
"""


def measure_once(how: str, dtype: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), XDG_CACHE_HOME=cache)
        r = subprocess.run([sys.executable, "-c", MEASURE, how, dtype], capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout)


def start_load() -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    p = subprocess.Popen([sys.executable, "-m", "ultrascale", "train", "--model", "small", "--steps", "100000",
                          "--peak", "1", "--no-progress", "--log-every", "1000"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    time.sleep(8)  # its start-up done: it trains
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--conditions", default="quiet,load")
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"machine": machine_info(), "command": command_line(), "threads": args.threads, "dtype": args.dtype,
           "results": {}}
    for condition in args.conditions.split(","):
        load = start_load() if condition == "load" else None
        try:
            runs = {"before": [], "now": []}
            for i in range(args.runs):
                for how in (("before", "now") if i % 2 == 0 else ("now", "before")):
                    runs[how].append(measure_once(how, args.dtype, args.threads))
        finally:
            if load is not None:
                load.terminate()
                load.wait()
        out["results"][condition] = runs
        for how, rs in runs.items():
            values = [r["tflops"] for r in rs]
            print(f"{condition:5} {how:6}: TFLOP/s {' '.join(f'{v:.4f}' for v in values)} | min/max "
                  f"{min(values) / max(values):.2f} | median {statistics.median(values):.4f} | "
                  f"{statistics.mean(r['seconds'] for r in rs):.2f} s each", flush=True)
    print(f"{out['machine']['cpu']}, {out['machine']['cores']} cores, {args.threads} thread(s), {args.dtype}, "
          f"torch {out['machine']['torch']}, load average at start {out['machine']['loadavg_start']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
