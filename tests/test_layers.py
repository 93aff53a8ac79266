"""The house has floors: cli -> train -> parallel -> distributed / model, with the configuration,
the errors and the span vocabulary below them all. An import that points up a floor makes a
circle (a technique that needs the trainer to be imported first; a config that cannot be read
without the hardware): this test reads every module's imports and names the one that does."""

import ast
import os

import pytest

import ultrascale

SRC = os.path.dirname(ultrascale.__file__)

# For each floor, the packages it may not import (the floors above it).
FORBIDDEN = {
    "parallel": ("ultrascale.train", "ultrascale.cli", "ultrascale.plan", "ultrascale.series"),
    "distributed": ("ultrascale.train", "ultrascale.parallel", "ultrascale.cli"),
    "model": ("ultrascale.train", "ultrascale.parallel", "ultrascale.distributed", "ultrascale.cli"),
}
# The bottom: what these may import of the package at all.
BOTTOM = {"config.py": ("ultrascale.errors", "ultrascale.model.config"), "errors.py": (), "spans.py": ()}


def imports_of(path):
    """Every `ultrascale...` module a file imports, at any depth (imports inside functions count)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m == "ultrascale" or m.startswith("ultrascale.")}


def violations(root=SRC):
    found = []
    for floor, forbidden in FORBIDDEN.items():
        for dirpath, _, files in os.walk(os.path.join(root, floor)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    for m in sorted(imports_of(path)):
                        if m.startswith(forbidden):
                            found.append(f"{os.path.relpath(path, root)} imports {m}")
    for name, allowed in BOTTOM.items():
        for m in sorted(imports_of(os.path.join(root, name))):
            if m not in ("ultrascale",) and not any(m == a or m.startswith(a + ".") for a in allowed) \
                    and not any(a.startswith(m) for a in allowed):
                found.append(f"{name} imports {m}")
    return found


def test_imports_point_down_only():
    assert violations() == []


def test_an_import_up_a_floor_is_named(tmp_path):
    # The check is not blind: a copy of the package whose data parallelism imports the trainer's
    # profiler, and whose config asks the hardware, fails with both named.
    import shutil

    copy = tmp_path / "ultrascale"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    dp = copy / "parallel" / "data_parallel.py"
    dp.write_text(dp.read_text() + "\nfrom ultrascale.train.profile import profile_window\n")
    cfg = copy / "config.py"
    cfg.write_text(cfg.read_text() + "\n\ndef f():\n    from ultrascale.train.peak import check_peak\n")
    assert violations(str(copy)) == ["parallel/data_parallel.py imports ultrascale.train.profile",
                                     "parallel/data_parallel.py imports ultrascale.train.profile.profile_window",
                                     "config.py imports ultrascale.train.peak",
                                     "config.py imports ultrascale.train.peak.check_peak"]


@pytest.mark.parametrize("module", ["ultrascale.spans", "ultrascale.config", "ultrascale.parallel"])
def test_a_lower_floor_imports_without_the_upper_ones(module):
    # In a fresh interpreter: importing a floor loads nothing above it.
    import subprocess
    import sys

    code = (f"import sys, {module}; up = sorted(m for m in sys.modules if m.startswith(('ultrascale.train', "
            f"'ultrascale.cli'))); print(up); sys.exit(1 if up else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
