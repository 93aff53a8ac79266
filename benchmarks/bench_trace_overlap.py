"""How much communication `ultrascale trace` finds hidden behind compute, on real profiled runs.

The test suite checks the trace arithmetic on constructed traces (known intervals, known
hidden share); what a real run hides depends on the machine: gloo runs each collective on
a worker thread, which overlaps backward only if a core is free for it. This benchmark
records it. For each data-parallel mode (naive: all-reduce after backward; overlap: one
async all-reduce per gradient as it is ready; bucket: async all-reduces of buckets) it
runs `ultrascale train --profile DIR` --runs times on --world gloo ranks, then
`ultrascale trace DIR --json`, and prints every rank's hidden share per run with the
machine it ran on.

    .venv/bin/python benchmarks/bench_trace_overlap.py --runs 3 --json /tmp/overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import command_line, machine_info  # noqa: E402

MODES = ("naive", "overlap", "bucket")


def ultrascale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ultrascale", *args], capture_output=True, text=True)


def one_run(mode: str, args, directory: str) -> list[float]:
    r = ultrascale("train", "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch",
                   str(args.micro_batch), "--steps", "3", "--nproc", str(args.world), "--dp", str(args.world),
                   "--dp-mode", mode, "--bucket-mb", str(args.bucket_mb), "--no-progress",
                   "--profile", directory, "--profile-steps", "2:3")
    if r.returncode:
        raise SystemExit(f"train --dp-mode {mode} failed: {r.stderr.strip().splitlines()[-1]}")
    r = ultrascale("trace", directory, "--json", "--no-plot")
    if r.returncode:
        raise SystemExit(f"trace {directory} failed: {r.stderr.strip()}")
    return [x["hidden_share"] for x in json.loads(r.stdout)["ranks"]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=0.05, help="small buckets: several launched during backward")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    machine = machine_info()
    shares = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for mode in MODES:  # modes alternate, so load from other processes falls on all alike
                shares[mode].append(one_run(mode, args, os.path.join(tmp, f"{mode}-{run}")))
    machine["loadavg_end"] = os.getloadavg()
    print(f"Machine: {machine['cpu']}, {machine['cores']} cores; torch {machine['torch']}; {args.world} gloo ranks; "
          f"load average (1 min) {machine['loadavg_start'][0]:.2f} at start, {machine['loadavg_end'][0]:.2f} at end")
    print(f"Command: {command_line()}")
    print(f"{'mode':8} {'median':>7}   hidden share per run (rank 0, rank 1, ...)")
    for mode in MODES:
        flat = [s for run in shares[mode] for s in run]
        runs = "  ".join("(" + ", ".join(f"{s:.3f}" for s in run) + ")" for run in shares[mode])
        print(f"{mode:8} {statistics.median(flat):7.3f}   {runs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "command": command_line(), "args": vars(args), "hidden_share": shares}, f,
                      indent=1)


if __name__ == "__main__":
    main()
