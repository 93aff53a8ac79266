"""`make test`: the suite's passes, each timed, then the slowest tests of all of them.

  python scripts/test_passes.py PYTHON

1. every test, on three pytest-xdist workers (a file, a notebook or a part of the README's tour to a
   worker at a time: tests/conftest.py);
2. the equivalence tests and the notebooks whose figures or kernels depend on the CPU's kernel set,
   again under the lowest set (ATEN_CPU_CAPABILITY=default), whose summation orders differ most
   from any machine's own: a bound that holds on one CPU only fails here, not on the next machine.

Each pass's time is printed as it ends, then all of them and the 15 slowest tests (from the JUnit
files pytest writes), so a slow machine shows where the time went. The exit status is the first
failing pass's; every pass runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

# Three workers on two cores: a worker spends about half its time waiting (on its pooled ranks, the processes
# a command-line test starts, a paced pipeline step), and a third keeps the cores busy meanwhile (measured on a
# 2-core EPYC: the main pass in 682 s against 777 s with two).
WORKERS = "3"
PASSES = [  # (name, extra environment, pytest arguments)
    ("main", {}, ["-n", WORKERS, "--dist", "loadgroup"]),
    ("default kernels", {"ATEN_CPU_CAPABILITY": "default"},
     ["-n", WORKERS, "--dist", "loadgroup", "-p", "no:cacheprovider", "-m", "equivalence or rounding"]),
]


def slowest(files: list[tuple[str, str]], n: int = 15) -> list[tuple[float, str]]:
    found = []
    for name, path in files:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        for case in root.iter("testcase"):
            found.append((float(case.get("time", 0)), f"{case.get('classname', '')}::{case.get('name', '')} [{name}]"))
    return sorted(found, reverse=True)[:n]


def costliest(files: list[tuple[str, str]], n: int = 10) -> list[tuple[float, str]]:
    per_file: dict[str, float] = {}
    for took, test in slowest(files, n=10 ** 9):
        name = test.split("::", 1)[0]
        per_file[name] = per_file.get(name, 0.0) + took
    return sorted(((t, f) for f, t in per_file.items()), reverse=True)[:n]


def main(python: str) -> int:
    status, times, junit = 0, [], []
    with tempfile.TemporaryDirectory(prefix="ultrascale-test-") as tmp:
        # Bytecode kept for the run, outside the tree: where the machine sets PYTHONDONTWRITEBYTECODE, every
        # pytest worker would otherwise rewrite the tests' assertions and compile them again (9 s of the 14 s
        # a worker takes to collect on 2 cores), in each pass, as would every interpreter a test starts.
        bytecode = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": os.path.join(tmp, "pycache")}
        for i, (name, env, args) in enumerate(PASSES):
            xml = os.path.join(tmp, f"pass{i}.xml")
            start = time.perf_counter()
            rc = subprocess.call([python, "-m", "pytest", "-q", *args, f"--junitxml={xml}"],
                                 env={**os.environ, **bytecode, **env})
            took = time.perf_counter() - start
            times.append((name, took, rc))
            junit.append((name, xml))
            print(f"== pass {name!r}: {took:.0f} s, exit {rc}", flush=True)
            status = status or rc
        print("\n== the passes")
        for name, took, rc in times:
            print(f"  {name:<16} {took:6.0f} s  exit {rc}")
        print(f"  {'all':<16} {sum(t for _, t, _ in times):6.0f} s")
        print("== the 15 slowest tests")
        for took, test in slowest(junit):
            print(f"  {took:7.1f} s  {test}")
        print("== the 10 costliest files (all their tests, every pass)")
        for took, file in costliest(junit):
            print(f"  {took:7.1f} s  {file}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else sys.executable))
