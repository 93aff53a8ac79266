"""Run a notebook's functions on real ranks: N gloo processes, from a notebook cell.

A learner writes an ordinary function in a cell (`def data_parallel_grads(...)`) and
the notebook runs it on 2 or 4 processes joined in one gloo process group, the way
torchrun would run it on 2 or 4 GPUs, so every `dist.all_reduce` really crosses
processes and a sum that should have been an average is visible.

Processes are started with `spawn` (the only start method that is safe with torch
threads, and the only one on macOS), so a new process cannot see the functions a
notebook defined: `__main__` of a kernel is not importable. Functions defined in the
notebook therefore travel as source: `inspect.getsource` (IPython keeps every cell's
text) plus what they use from the notebook's globals, found in their code objects:
modules are imported again by name, other notebook functions and classes travel as
source too, and plain values (numbers, tensors) are pickled. Functions of installed
packages travel by reference, as pickle always does.

The processes are the project's worker pool (ultrascale.testing.harness): started on
the first call, reused by later ones, killed with the kernel. A learner's exception on
a rank comes back as the same exception type in the notebook, so a check can tell
"not done yet" (NotImplementedError) from "wrong" (AssertionError) from a crash.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import inspect
import pickle
import sys
import textwrap
import traceback
import types

DEFAULT_TIMEOUT = 90.0  # seconds; a collective that not every rank joins would otherwise hang the kernel


class RankError(RuntimeError):
    """The function failed on a rank, with something other than NotImplementedError or AssertionError."""


def on_ranks(world: int, fn, *args, timeout: float = DEFAULT_TIMEOUT, calls: list | None = None, **kwargs) -> list:
    """fn(*args, **kwargs) on `world` processes of one gloo group; each rank's return value, by rank.

    Inside fn, `torch.distributed` is initialised: `dist.get_rank()`, `dist.all_reduce(...)`
    and the rest work as under torchrun. Functions among fn, args and kwargs that the
    notebook defined are sent as source; the rest must pickle.

    Every torch.distributed call made inside fn is watched (series/watch.py): pass a list as
    `calls` and it receives, per rank, the `Call`s that rank made. A deadlock (every rank that
    has not returned blocked in a call for watch.STALL seconds) is reported as such, naming the
    rank and the call it waits in, well before `timeout`.
    """
    import tempfile

    from ultrascale.series.watch import stalled
    from ultrascale.testing.harness import DistributedError, run_distributed

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive number of ranks, got {world!r}")
    payload = pickle.dumps((_pack(fn), [_pack(a) for a in args], {k: _pack(v) for k, v in kwargs.items()}))
    with tempfile.TemporaryDirectory(prefix="ultrascale-watch-") as status:
        try:
            results = run_distributed(world, _call_on_rank, payload, status, timeout=timeout,
                                      stalled=lambda pending: stalled(status, pending, world))
        except DistributedError as e:
            first = str(e).splitlines()[0]
            raised = sorted((r, res) for r, res in e.finished.items() if res[0] != "ok")
            if raised:
                # A rank that raised left the others waiting for it: its error is the learner's to see.
                _raise(*raised[0], world)
            if "cannot finish: " in first:
                waits = first.split("cannot finish: ", 1)[1]
                # A learner's mistake, not a crash: the check fails with where each rank stopped.
                raise AssertionError(f"deadlock on {world} ranks: {waits}. Every rank must call the same "
                                     f"collectives in the same order, and every send needs its recv") from None
            else:
                raise RankError(f"{_name(fn)} did not finish on {world} ranks within {timeout:.0f} s: is there a "
                                f"collective that not every rank calls, or a send without its recv?\n{e}") from None
    if calls is not None:
        calls[:] = [res[-1] for res in results]
    failures = [(r, res) for r, res in enumerate(results) if res[0] != "ok"]
    if failures:
        _raise(*failures[0], world)
    return [res[1] for res in results]


def _raise(rank: int, result: tuple, world: int):
    """A rank's exception, raised here as its kind: "not done yet", a wrong answer, or a crash."""
    _, kind, message, tb, _ = result
    where = f" (rank {rank} of {world})"
    if kind == "NotImplementedError":
        raise NotImplementedError(message or "not done yet")
    if kind == "AssertionError":
        raise AssertionError(f"{message}{where}")
    raise RankError(f"{kind}: {message}{where}\n{tb}")


# ---- what travels -------------------------------------------------------------------------------

_SOURCE = "__ultrascale_source__"


def _from_notebook(obj) -> bool:
    """Defined in the notebook (or a script's __main__): not importable by another process."""
    return isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__"


def _pack(obj):
    if _from_notebook(obj):
        return (_SOURCE, _bundle(obj))
    return obj


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _names_used(code) -> set:
    """Global names the code reads (not attribute names, which share co_names)."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def _bundle(obj, seen=None) -> dict:
    """Everything needed to define `obj` again in a fresh process, dependencies first."""
    seen = seen if seen is not None else set()
    name = obj.__name__
    try:
        source = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError) as e:
        raise ValueError(f"cannot send {name} to other processes: its source is not available ({e}); "
                         f"define it with `def` in a notebook cell") from None
    if isinstance(obj, types.LambdaType) and name == "<lambda>":
        raise ValueError("cannot send a lambda to other processes: define the function with `def`")
    bundle = {"name": name, "source": source, "imports": {}, "from_imports": {}, "values": {}, "deps": []}
    seen.add(name)
    namespace = getattr(obj, "__globals__", None) or vars(sys.modules.get(obj.__module__, builtins))
    if isinstance(obj, type):  # a class: the names its methods use
        codes = [m.__code__ for m in vars(obj).values() if isinstance(m, types.FunctionType)]
    else:
        codes = [obj.__code__]
    used = set().union(*(_names_used(c) for c in codes)) if codes else set()
    for n in sorted(used):
        if n in seen or n not in namespace or hasattr(builtins, n):
            continue
        value = namespace[n]
        if isinstance(value, types.ModuleType):
            bundle["imports"][n] = value.__name__
        elif _from_notebook(value):
            bundle["deps"].append(_bundle(value, seen))
        elif (home := _module_holding(n, value)) is not None:
            # `from pkg import STATE`: the same object in the new process, not a pickled copy of it
            # (a module-level counter or registry must be the one the package itself updates).
            bundle["from_imports"][n] = home
        else:
            try:
                bundle["values"][n] = pickle.dumps(value)
            except Exception as e:  # noqa: BLE001 - say which name, whatever pickle raised
                raise ValueError(f"{name} uses {n!r}, which cannot be sent to other processes "
                                 f"({type(e).__name__}); pass it as an argument or build it inside "
                                 f"the function") from None
    return bundle


def _module_holding(name: str, value):
    """The importable module that defines `name` as this very object, if one does."""
    if isinstance(value, (int, float, str, bytes, bool, type(None))):
        return None  # small values: as cheap to copy, and a copy cannot go stale
    main = sys.modules.get("__main__")
    own = getattr(value, "__module__", None)  # a function's or class's home, tried first
    qualname = getattr(value, "__qualname__", None)
    if isinstance(own, str) and isinstance(qualname, str) and own in sys.modules and \
            getattr(sys.modules[own], qualname, None) is value:
        # Importable under its own name (dist.reduce_scatter_single bound as `reduce_scatter`): pickled by
        # reference, it is looked up there in the new process, where the check's watch may have wrapped it;
        # another module that happens to hold it under the same name would hand over the bare original.
        return None
    names = ([own] if isinstance(own, str) and own in sys.modules else []) + list(sys.modules)
    for module_name in names:
        module = sys.modules.get(module_name)
        # __main__ and its aliases (__mp_main__) are the notebook itself: not importable elsewhere.
        if module is None or module is main or module_name.startswith("__"):
            continue
        try:
            if vars(module).get(name) is value:
                return module_name
        except TypeError:
            continue
    return None


def _define(bundle: dict, namespace: dict):
    import importlib

    for dep in bundle["deps"]:
        _define(dep, namespace)
    for alias, module in bundle["imports"].items():
        namespace[alias] = importlib.import_module(module)
    for n, module in bundle["from_imports"].items():
        namespace[n] = getattr(importlib.import_module(module), n)
    for n, blob in bundle["values"].items():
        namespace[n] = pickle.loads(blob)
    exec(compile(bundle["source"], f"<notebook: {bundle['name']}>", "exec"), namespace)
    return namespace[bundle["name"]]


def _unpack(obj, namespace):
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == _SOURCE:
        return _define(obj[1], namespace)
    return obj


@contextlib.contextmanager
def _flash_back(enabled: bool):
    import torch

    try:
        yield
    finally:
        torch.backends.cuda.enable_flash_sdp(enabled)


def _call_on_rank(payload: bytes, status_dir: str):
    """On each rank: define the notebook's functions, call, and report the outcome (and the
    torch.distributed calls made) as data."""
    import os

    import torch.distributed as dist

    from ultrascale.series.watch import unwaited, watching

    import torch

    namespace = {"__name__": "__notebook__"}
    # A pooled rank is a fresh process to each call: torch's flash switch on, as it starts, whatever an
    # earlier bf16 task of this process chose (parallel/precision.choose_attention_kernel), and put back.
    flash = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(True)
    # Watched from before the functions are defined: a `from torch.distributed import all_reduce`
    # in the notebook binds the watched function.
    with watching(os.path.join(status_dir, f"rank{dist.get_rank()}")) as record, _flash_back(flash):
        try:
            fn, args, kwargs = pickle.loads(payload)
            fn = _unpack(fn, namespace)
            args = [_unpack(a, namespace) for a in args]
            kwargs = {k: _unpack(v, namespace) for k, v in kwargs.items()}
            result = fn(*args, **kwargs)
            left = unwaited()
            if left:  # a race that passes or fails by the timing: named every time instead
                call = left[0]
                more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
                raise AssertionError(
                    f"rank {dist.get_rank()}: the request of {call}{more} was never waited for: until its "
                    f".wait(), a received buffer may not hold the data yet, an all-reduced one not the sum, and "
                    f"a sent one may still be read; call .wait() on every request before its tensor is used")
            return ("ok", result, list(record))
        except Exception as e:  # noqa: BLE001 - the notebook decides what each kind means
            return ("failed", type(e).__name__, str(e), traceback.format_exc(limit=-4), list(record))
