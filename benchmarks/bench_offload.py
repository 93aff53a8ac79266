"""ZeRO-Offload on this machine: peak resident memory and step time, without offload, cpu, disk.

Each mode is a real `ultrascale train` run (ZeRO-1 on --nproc gloo processes), in its own
processes: peak resident memory (ru_maxrss) only grows within a process. What is read from
the logging rank's JSONL: `memory.peak_rss` after the last step, the bytes moved off the
device (`memory.offloaded`), and the median `step_time_s` after the first step. The modes
run in rotation (none, cpu, disk, then cpu, disk, none, ...) --repeats times, so load from
other processes falls on all of them alike; the figures are the medians over the repeats.

On a CPU host and device are one memory: `cpu` moves nothing out of RAM (it adds a separate
fp32 master copy, since the device's fp32 parameters no longer double as the masters),
while `disk` moves the masters and both moments into files: RAM holds only two segments.

    .venv/bin/python benchmarks/bench_offload.py --model smollm-135m --json /tmp/bench_offload.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from _common import command_line, machine_info  # noqa: E402

MODES = ("none", "cpu", "disk")


def run(mode: str, args, workdir: str) -> dict:
    log = os.path.join(workdir, f"{mode}.jsonl")
    cmd = [sys.executable, "-m", "ultrascale", "train", "--model", args.model, "--nproc", str(args.nproc),
           "--zero", "1", "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--micro-batch", "1",
           "--warmup-steps", "1", "--peak", "1", "--no-progress", "--log-jsonl", log]
    if mode != "none":
        cmd += ["--offload", mode] + (["--offload-dir", os.path.join(workdir, "states")] if mode == "disk" else [])
    os.makedirs(os.path.join(workdir, "states"), exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(log) as f:
        steps = [json.loads(line) for line in f]
    last = steps[-1]["memory"]
    return {"peak_rss": last["peak_rss"], "offloaded": last.get("offloaded"),
            "optim_on_device": last["optim"],
            "step_s": statistics.median(s["step_time_s"] for s in steps[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm-135m")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    results = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as workdir:
        for rep in range(args.repeats):
            order = MODES[rep % 3:] + MODES[:rep % 3]
            for mode in order:
                results[mode].append(run(mode, args, workdir))
                print(f"repeat {rep + 1} {mode}: {results[mode][-1]}", flush=True)
    summary = {m: {"peak_rss_mib": statistics.median(r["peak_rss"] for r in rs) / 2**20,
                   "step_s": statistics.median(r["step_s"] for r in rs),
                   "offloaded": rs[0]["offloaded"], "optim_on_device": rs[0]["optim_on_device"]}
               for m, rs in results.items()}
    print(f"{'mode':<6} {'peak RSS (MiB, rank 0)':>24} {'step (s)':>10} {'moved off the device':>22}")
    for m, s in summary.items():
        moved = "-" if not s["offloaded"] else f"{s['offloaded']['optim'] / 2**20:.0f} MiB to {s['offloaded']['to']}"
        print(f"{m:<6} {s['peak_rss_mib']:>24.0f} {s['step_s']:>10.2f} {moved:>22}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command_line(), "machine": machine_info(), "runs": results, "summary": summary},
                      f, indent=2)


if __name__ == "__main__":
    main()
