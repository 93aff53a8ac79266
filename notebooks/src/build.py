"""Build the course notebooks from their sources in this folder, with the outputs of a run on this CPU.

    python notebooks/src/build.py            # every part: build, lint, run, write notebooks/N_topic.ipynb
    python notebooks/src/build.py 1 6        # only Parts 1 and 6
    python notebooks/src/build.py --check    # only say whether the notebooks match their sources and runs
    python notebooks/src/build.py --no-run 3 # build and lint only: written without outputs, to be run later

Each source N_topic.py defines EPISODE (an ultrascale.series Episode). A notebook is
written only if it passes the same gate as `ultrascale notebook import`: the format's
lint, a run on CPU, and each exercise check failing on the starter and passing on the
hidden solution. It is written with the outputs of that run (every printed figure,
charts as PNGs) and a record of what was run (ultrascale.series.outputs), so GitHub and
Colab show the results before anything runs, and a test says when they are stale.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOKS = os.path.dirname(HERE)
COMMAND = "python notebooks/src/build.py"


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(HERE, "[0-9]*_*.py")), key=lambda p: int(os.path.basename(p).split("_")[0]))


def load_episode(path: str):
    """The EPISODE a source file defines (file names start with a digit, so import them by path)."""
    spec = importlib.util.spec_from_file_location(f"episode_source_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EPISODE


def problems(path: str, ep) -> list[str]:
    """What is out of date in the notebook at `path` against a fresh build of `ep`: its cells (the
    source changed or the notebook was edited), then its outputs (stale, edited, never run)."""
    import json

    from ultrascale.series.build import build_notebook, notebook_text
    from ultrascale.series.outputs import outputs_problem, without_outputs

    if not os.path.exists(path):
        return ["it does not exist"]
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    built = build_notebook(ep)
    found = []
    if notebook_text(without_outputs(nb)) != notebook_text(built):
        found.append("its cells differ from its source")
    problem = outputs_problem(nb, built)
    if problem:
        found.append(problem)
    return found


def regenerate(ep, target: str) -> bool:
    from ultrascale.series.generate import assess, keep
    from ultrascale.series.progress import Progress

    attempt = assess(ep.to_dict(), ep.number, timeout=300, progress=Progress(True))
    path, good = keep(attempt, NOTEBOOKS, ep.number, force=True)
    print(f"{'wrote' if good else 'REJECTED, see'} {path}")
    for p in attempt.problems:
        print(f"  - {p}")
    return good


def build_only(ep, target: str) -> bool:
    """The notebook as built, without outputs: for a change of layout, before the run that fills it."""
    from ultrascale.series.build import build_notebook, notebook_text
    from ultrascale.series.files import write_atomic
    from ultrascale.series.lint import lint_notebook

    nb = build_notebook(ep)
    violations = lint_notebook(nb, ep.filename)
    for v in violations:
        print(f"  - {v.line()}")
    if violations:
        print(f"REJECTED {target}")
        return False
    write_atomic(target, notebook_text(nb))
    print(f"wrote {target} without outputs: run {COMMAND} {ep.number} before committing it")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare only; exit 1 if a notebook is out of date")
    mode.add_argument("--no-run", action="store_true", help="build and lint only; write the notebooks without "
                                                            "outputs (the tests then ask for a run)")
    ap.add_argument("parts", nargs="*", type=int, help="part numbers to build (default: all)")
    args = ap.parse_args(argv)
    status = 0
    for src in sources():
        if args.parts and int(os.path.basename(src).split("_")[0]) not in args.parts:
            continue
        ep = load_episode(src)
        target = os.path.join(NOTEBOOKS, ep.filename)
        if args.check:
            found = problems(target, ep)
            print(f"{target}: " + (f"OUT OF DATE: {'; '.join(found)}: run {COMMAND} {ep.number}" if found
                                   else "up to date"))
            status |= 1 if found else 0
            continue
        start = time.perf_counter()
        good = build_only(ep, target) if args.no_run else regenerate(ep, target)
        print(f"  {ep.filename}: {time.perf_counter() - start:.1f} s")
        status |= 0 if good else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
