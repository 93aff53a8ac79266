"""Each notebook of the course, Run All as a learner runs it: wall time from the kernel's start to the
last cell, on this machine (the course's promise: every Part in 45 s or less on 2 cores; Parts 11
and 12 spend most of theirs in paced pipeline steps, each action waiting out a fixed 250 ms so that the
measured bubble is the schedule's, not the shared cores').

    python benchmarks/bench_notebooks.py [--repeats 2] [--json OUT.json] [notebooks/4_*.ipynb ...]

The notebooks run one at a time (two at once would share the cores), each `--repeats` times in
rotation; the table gives the median and the largest. Inductor's on-disk cache is left as it is:
Part 15 compiles, and its first run on a machine pays the compilation (said in its own output).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import command_line, machine_info  # noqa: E402

LIMIT_S = 45.0


def _order(path: str) -> int:
    return int(os.path.basename(path).split("_", 1)[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    import nbformat

    from ultrascale.series.execute import run_notebook

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sorted(args.notebooks or glob.glob(os.path.join(root, "notebooks", "*.ipynb")), key=_order)
    books = {p: nbformat.read(p, as_version=4) for p in paths}
    seconds = {p: [] for p in paths}
    info = machine_info()
    for r in range(args.repeats):
        for p in paths[r % len(paths):] + paths[:r % len(paths)]:
            with tempfile.TemporaryDirectory() as cwd:
                start = time.perf_counter()
                report = run_notebook(books[p], timeout=300, cwd=cwd, exercises=False)
                seconds[p].append(time.perf_counter() - start)
            if report.failure is not None:
                print(f"{os.path.basename(p)}: failed: {report.failure}", file=sys.stderr)
                return 1
    rows = [{"notebook": os.path.basename(p), "median_s": statistics.median(s), "max_s": max(s), "runs": s}
            for p, s in seconds.items()]
    print(f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}; load at start {info['loadavg_start']}")
    print(f"{'notebook':44} {'median s':>9} {'max s':>7}")
    for row in rows:
        flag = "" if row["max_s"] <= LIMIT_S else f"  over {LIMIT_S:g} s"
        print(f"{row['notebook']:44} {row['median_s']:9.1f} {row['max_s']:7.1f}{flag}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "command": command_line(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
