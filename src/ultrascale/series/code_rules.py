"""The lint's rules about a notebook's code.

syntax         every code cell (and hidden solution) parses; IPython magics are allowed
imports        a name that is a module by convention (torch, dist, np, ...) is imported in an
               earlier cell or in the same cell; at least one cell imports something
accelerator    no unconditional GPU-only code: `.cuda()`, a "cuda" device, the NCCL backend,
               torch.cuda.* calls. Allowed inside an `if` that tests for CUDA/a device, in cells
               tagged needs-gpu, or anywhere when the notebook declares an accelerator
process-group  DDP or a collective needs `init_process_group` (or `on_ranks`) somewhere in the notebook

Why static: a notebook that imports torch but calls `.cuda()` fails only on a laptop, the
machine the series is written for, so the lint says so before anyone runs it.
"""

from __future__ import annotations

import ast
import builtins
import re

from ultrascale.series.build import GPU_TAG

# Names that are modules by convention, and the import a notebook needs for each.
MODULES = {
    "torch": "import torch", "nn": "import torch.nn as nn", "F": "import torch.nn.functional as F",
    "dist": "import torch.distributed as dist", "mp": "import torch.multiprocessing as mp",
    "optim": "from torch import optim", "DDP": "from torch.nn.parallel import DistributedDataParallel as DDP",
    "np": "import numpy as np", "numpy": "import numpy", "plt": "import matplotlib.pyplot as plt",
    "math": "import math", "time": "import time", "os": "import os", "sys": "import sys",
    "random": "import random", "json": "import json", "copy": "import copy", "itertools": "import itertools",
    "functools": "import functools", "collections": "import collections", "re": "import re",
    "tempfile": "import tempfile", "threading": "import threading", "dataclasses": "import dataclasses",
}


def _parse(src: str):
    # IPython magics and shell escapes are not Python; keep the line numbers.
    lines = ["pass" if re.match(r"^[%!]", line) else line for line in src.splitlines()]
    return ast.parse("\n".join(lines))


def check_code(o, v) -> dict:
    """Apply the code rules to every code cell of Outline `o`, reporting through v(cell, rule, message);
    return the parsed cells: {cell index: ast, ("solution", starter index): ast}."""
    trees, bound, any_import = {}, set(dir(builtins)), False
    gpu_ok = o.needs_accelerator
    solutions = {e.starter: e.solution for e in o.exercises if e.starter is not None and e.solution}
    for i, cell in enumerate(o.cells):
        if cell.get("cell_type") != "code":
            continue
        src = "".join(cell.get("source", ""))
        try:
            tree = _parse(src)
        except SyntaxError as e:
            v(i, "syntax", f"line {e.lineno}: {e.msg}; fix the Python in this cell")
            continue
        trees[i] = tree
        any_import |= any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree))
        here = bound | _bindings(tree)
        if i in solutions:
            try:
                sol = _parse(solutions[i])
                trees[("solution", i)] = sol
                _missing_imports(i, sol, here | _bindings(sol), v, "the hidden solution ")
            except SyntaxError as e:
                v(i, "syntax", f"the hidden solution, line {e.lineno}: {e.msg}; fix it")
        _missing_imports(i, tree, here, v)
        bound = here
        tags = cell.get("metadata", {}).get("tags", [])
        if not gpu_ok and GPU_TAG not in tags:
            for what in _cuda_uses(tree):
                v(i, "accelerator", f"{what} needs a GPU; use a `device` argument that falls back to CPU "
                                    f"(gloo instead of NCCL), guard it with torch.cuda.is_available(), tag the "
                                    f"cell '{GPU_TAG}', or declare the accelerator in the notebook metadata")
    _process_group(trees, v)
    if trees and not any_import:
        v(None, "imports", "no cell imports anything; import what the code uses (e.g. `import torch`) in the "
                           "first code cell")
    return trees


def _process_group(trees: dict, v) -> None:
    """DDP (or a collective) needs init_process_group somewhere in the notebook first."""
    calls = {i: [ast.unparse(n.func) for n in ast.walk(t) if isinstance(n, ast.Call)]
             for i, t in trees.items() if isinstance(i, int)}
    # on_ranks(world, fn) runs fn on processes that joined a gloo group: fn's collectives have one.
    if any(name.endswith(("init_process_group", "on_ranks")) for names in calls.values() for name in names):
        return
    for i, names in sorted(calls.items()):
        used = [n for n in names if n.split(".")[-1] in ("DDP", "DistributedDataParallel")
                or re.fullmatch(r"(dist|torch\.distributed)\.(all_reduce|broadcast|all_gather|reduce_scatter)", n)]
        if used:
            v(i, "process-group", f"`{used[0]}(...)` needs a process group but no cell creates one: run the "
                                  f"function on real ranks with on_ranks(world, fn) (from ultrascale.series.ranks), "
                                  f"or call dist.init_process_group first")


def _bindings(tree) -> set:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            names.update(n.names)
    return names


def _missing_imports(i, tree, bound, v, who="") -> None:
    seen = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in MODULES and n.id not in bound:
            if n.id not in seen:
                seen.add(n.id)
                v(i, "imports", f"{who}uses `{n.id}` but no cell before imports it; add `{MODULES[n.id]}`")


def _string(node) -> str:
    return node.value.strip().lower() if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


def _guarded(test) -> bool:
    return re.search(r"cuda|gpu|device|accelerator", ast.unparse(test), re.I) is not None


def _cuda_uses(tree) -> list[str]:
    """Unconditional CUDA: .cuda(), 'nccl', a 'cuda' device, torch.cuda.* calls outside an availability test."""
    found = []

    def visit(node, guarded):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)) and _guarded(node.test):
            guarded = True
        if not guarded:
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Attribute) and f.attr == "cuda" and not node.args:
                    found.append("`.cuda()`")
                name = ast.unparse(f)
                if name.startswith("torch.cuda.") and name.split(".")[-1] not in (
                        "is_available", "device_count", "is_initialized"):
                    found.append(f"`{name}()`")
                last = name.split(".")[-1]
                # Strings only matter where they name a device or a backend, not in a print().
                device_args = [k.value for k in node.keywords if k.arg in ("device", "map_location")]
                backend_args = [k.value for k in node.keywords if k.arg == "backend"]
                if last in ("device", "to", "set_device"):
                    device_args += node.args[:1]
                if last in ("init_process_group", "new_group"):
                    backend_args += node.args[:1]
                for a in device_args:
                    if _string(a).startswith("cuda"):
                        found.append(f"device {_string(a)!r}")
                for a in backend_args:
                    if "nccl" in _string(a):
                        found.append("the NCCL backend")
            elif isinstance(node, ast.Attribute) and node.attr == "NCCL":
                found.append("the NCCL backend")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return list(dict.fromkeys(found))
