"""`make gpu-check`'s Python side: is there a GPU, what to install, and the report.

A lent GPU machine has its own torch (CUDA build) and no network. The check must
not touch that torch: it installs, from a folder of wheels carried along
(`make gpu-wheels` fills `.whl/` here), only the distributions the tests and
benchmarks need and that machine lacks, each without its dependencies
(`pip install --no-index --no-deps --find-links`); the package itself runs from
`src/` (PYTHONPATH), not installed. The parts (tests, benchmarks) run under
scripts/gpu_check.sh, each with a time limit; each leaves a status file and,
where it measures, a JSON of figures; `report` gathers them into one Markdown and
one JSON file, with the GPU's name and the torch and CUDA versions, whatever
passed, failed or ran out of time.

    python -m ultrascale.testing.gpu_kit cuda             # exit 2 and one line without CUDA
    python -m ultrascale.testing.gpu_kit install .whl     # what is missing, from the folder
    python -m ultrascale.testing.gpu_kit report OUT       # OUT/gpu-report.md and .json
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

# What the check imports beyond torch and the machine's own transformers / numpy, by
# distribution name; the second field: needed only below this Python version.
KIT = [("pytest", None), ("pluggy", None), ("iniconfig", None), ("packaging", None), ("pygments", None),
       ("pytest-timeout", None), ("exceptiongroup", (3, 11)), ("tomli", (3, 11)), ("tqdm", None),
       ("torchao", None)]
STATUSES = ("passed", "failed", "timeout", "not run")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed(version=sys.version_info) -> list[str]:
    return [name for name, below in KIT if below is None or tuple(version[:2]) < below]


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def wheels_in(folder: str) -> dict[str, Path]:
    """Distribution name -> its wheel in `folder` (file names: name-version-tags.whl)."""
    out = {}
    for f in sorted(Path(folder).glob("*.whl")):
        out[_norm(f.name.split("-")[0])] = f
    return out


def plan_install(folder: str, have=None, version=sys.version_info) -> tuple[list[Path], list[str]]:
    """(wheels to install, distributions missing from both the machine and the folder)."""
    have = have or installed
    wheels = wheels_in(folder) if os.path.isdir(folder) else {}
    todo, missing = [], []
    for name in needed(version):
        if have(name) is not None:
            continue
        (todo.append(wheels[_norm(name)]) if _norm(name) in wheels else missing.append(name))
    return todo, missing


def install(folder: str, target: str) -> int:
    """Install what the check lacks from `folder` into `target`, a directory on PYTHONPATH: the machine's
    own site-packages stay as they are (and a system Python that refuses pip installs, PEP 668, works)."""
    todo, missing = plan_install(folder)
    if missing:
        print(f"gpu-check: {', '.join(missing)} missing here and not in {folder}/: run `make gpu-wheels` on a "
              f"machine with network and carry {folder}/ along", file=sys.stderr)
        return 2
    if not todo:
        print("gpu-check: every package the check needs is already installed")
        return 0
    print("gpu-check: installing " + ", ".join(w.name for w in todo))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links", folder,
           "--target", target, *map(str, todo)]
    return subprocess.call(cmd)


def cuda_line() -> str | None:
    """None when a CUDA device is visible; else the one line that says so."""
    try:
        import torch
    except ImportError:
        return f"gpu-check: {sys.executable} has no torch: run it with the Python that has the CUDA build of torch"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (f"gpu-check: no CUDA device is visible to torch {torch.__version__} ({build}): run it on a machine "
                f"with a GPU")
    return None


def environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": None, "capability": None, "nccl": None}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for name in ("transformers", "torchao", "triton"):
        env[name] = installed(name)
    return env


# -- the report ---------------------------------------------------------------------
def read_junit(path: str) -> list[dict]:
    """Each test case of a pytest --junitxml file: name, outcome, message, equivalence lines."""
    if not os.path.exists(path):
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
        lines = [p.get("value") for p in case.iter("property") if p.get("name") == "equivalence"]
        cases.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": message, "equivalence": lines})
    return cases


_VERBOSE = re.compile(r"^\S+::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def read_verbose_log(path: Path) -> list[dict]:
    """The outcomes pytest -v printed as each test ended: what is left of a run killed at its time
    limit, which never wrote its junit file."""
    if not path.exists():
        return []
    cases = []
    for line in path.read_text(errors="replace").splitlines():
        m = _VERBOSE.match(line)
        if m:
            outcome = {"PASSED": "passed", "SKIPPED": "skipped", "XFAIL": "skipped"}.get(m.group(2), "failed")
            cases.append({"name": m.group(1), "outcome": outcome, "seconds": 0.0,
                          "message": "(from the log: the run was stopped before its junit file)",
                          "equivalence": []})
    return cases


def gather(out: str) -> dict:
    """The parts' status files (OUT/parts/NAME.json) with their figures, and the environment."""
    parts = []
    for f in sorted(Path(out, "parts").glob("*.status.json")):
        part = json.loads(f.read_text())
        figures = Path(out, "parts", part["name"] + ".json")
        part["figures"] = json.loads(figures.read_text()) if figures.exists() else None
        if part.get("junit"):
            part["tests"] = read_junit(os.path.join(out, part["junit"])) or \
                read_verbose_log(Path(out, "parts", part["name"] + ".log"))
        parts.append(part)
    env_file = Path(out, "environment.json")
    env = json.loads(env_file.read_text()) if env_file.exists() else {}
    return {"environment": env, "parts": parts}


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# gpu-check: {env.get('gpu') or 'no GPU'}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}, Python {env.get('python')}, "
             f"compute capability {env.get('capability')}, transformers {env.get('transformers')}, "
             f"torchao {env.get('torchao')}, triton {env.get('triton')}", "",
             "| part | status | seconds | limit | command |", "| --- | --- | ---: | ---: | --- |"]
    for p in report["parts"]:
        lines.append(f"| {p['name']} | {p['status']} | {p['seconds']:.0f} | {p.get('timeout_s', '')} | "
                     f"`{p.get('command', '')}` |")
    for p in report["parts"]:
        if p.get("tests"):
            lines += ["", f"## {p['name']}: tests", "", "| test | outcome | s | |", "| --- | --- | ---: | --- |"]
            for c in p["tests"]:
                lines.append(f"| {c['name']} | {c['outcome']} | {c['seconds']:.1f} | {c['message']} |")
            eq = [line for c in p["tests"] for line in c["equivalence"]]
            if eq:
                lines += ["", "Tolerance reached:", ""] + [f"- {line}" for line in eq]
        if p.get("figures"):
            figures = p["figures"].get("summary", p["figures"])
            lines += ["", f"## {p['name']}: figures", ""]
            if isinstance(figures, dict):
                lines += [f"- {k}: {_fmt(v)}" for k, v in figures.items() if not isinstance(v, (dict, list))]
        if p["status"] != "passed" and p.get("log_tail"):
            lines += ["", f"## {p['name']}: end of its log", "", "```", p["log_tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write_report(out: str) -> dict:
    report = gather(out)
    for p in report["parts"]:
        log = Path(out, "parts", p["name"] + ".log")
        p["log_tail"] = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    Path(out, "gpu-report.json").write_text(json.dumps(report, indent=1) + "\n")
    Path(out, "gpu-report.md").write_text(markdown(report))
    return report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    arity = {"cuda": 1, "install": 3, "environment": 2, "report": 2}
    if len(argv) < 1 or arity.get(argv[0]) != len(argv):
        print("usage: python -m ultrascale.testing.gpu_kit cuda | install WHEELS TARGET | environment OUT | "
              "report OUT", file=sys.stderr)
        return 2
    if argv[0] == "cuda":
        line = cuda_line()
        if line:
            print(line, file=sys.stderr)
            return 2
        return 0
    if argv[0] == "install":
        return install(argv[1], argv[2])
    if argv[0] == "environment":
        Path(argv[1], "environment.json").write_text(json.dumps(environment(), indent=1) + "\n")
        return 0
    report = write_report(argv[1])
    bad = [p["name"] for p in report["parts"] if p["status"] != "passed"]
    print(f"gpu-check: report in {argv[1]}/gpu-report.md" + (f"; not passed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
