"""Build the course notebooks from their sources in this folder.

    python notebooks/src/build.py            # build, lint, run, then write notebooks/N_topic.ipynb
    python notebooks/src/build.py 1 6        # only Parts 1 and 6
    python notebooks/src/build.py --check    # only say whether the notebooks match their sources

Each source N_topic.py defines EPISODE (an ultrascale.series Episode). A notebook is
written only if it passes the same gate as `ultrascale notebook import`: the format's
lint, a run on CPU, and each exercise check failing on the starter and passing on the
hidden solution. Notebooks are saved without outputs.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOKS = os.path.dirname(HERE)


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(HERE, "[0-9]*_*.py")), key=lambda p: int(os.path.basename(p).split("_")[0]))


def load_episode(path: str):
    """The EPISODE a source file defines (file names start with a digit, so import them by path)."""
    spec = importlib.util.spec_from_file_location(f"episode_source_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EPISODE


def main(argv=None) -> int:
    from ultrascale.series.build import build_notebook, notebook_text
    from ultrascale.series.generate import assess, keep
    from ultrascale.series.progress import Progress

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 if a notebook is out of date")
    ap.add_argument("parts", nargs="*", type=int, help="part numbers to build (default: all)")
    args = ap.parse_args(argv)
    status = 0
    for src in sources():
        if args.parts and int(os.path.basename(src).split("_")[0]) not in args.parts:
            continue
        ep = load_episode(src)
        target = os.path.join(NOTEBOOKS, ep.filename)
        if args.check:
            current = open(target, encoding="utf-8").read() if os.path.exists(target) else None
            fresh = current == notebook_text(build_notebook(ep))
            print(f"{target}: {'up to date' if fresh else 'OUT OF DATE: run python notebooks/src/build.py'}")
            status |= 0 if fresh else 1
            continue
        attempt = assess(ep.to_dict(), ep.number, timeout=300, progress=Progress(True))
        path, good = keep(attempt, NOTEBOOKS, ep.number, force=True)
        print(f"{'wrote' if good else 'REJECTED, see'} {path}")
        for p in attempt.problems:
            print(f"  - {p}")
        status |= 0 if good else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
