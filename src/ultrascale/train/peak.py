"""The device's dense matmul ceiling, measured: what MFU divides by when no datasheet says.

Square matmuls C = A @ B of a few sizes n, in the compute dtype: one warm-up call, then the
best of several timed repeats (each repeat long enough for the clock, at least `min_time`),
TFLOP/s = 2 n^3 / t. The ceiling is the best size. On a CPU it runs on the threads torch uses
in this process (torch.get_num_threads(), what training uses: under `--nproc` the launcher
sets OMP_NUM_THREADS per rank); on a GPU with whatever matmul precision the process has set
(TF32 or not), as training would.

`--peak` (ultrascale train) picks the ceiling of MFU: `datasheet` (metrics.PEAK_TFLOPS),
`auto` (measured here once at start-up) or a number of TFLOP/s. The default is the
datasheet on a GPU that has a figure there, `auto` otherwise (every CPU).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
from ultrascale.errors import ConfigError

# torch is imported where a measurement runs: the launcher and every command's parser read this
# module (check_peak, add_parser) without paying for it.
DTYPES = ("fp32", "bf16", "fp16")
# Sizes tried, smallest first; the larger ones only while the time budget allows.
SIZES = {"cpu": (256, 512, 1024, 2048), "cuda": (2048, 4096, 8192)}
_CACHE: dict[tuple, "Peak"] = {}


@dataclass
class Peak:
    tflops: float  # the ceiling: the best size's best repeat
    dtype: str
    device: str  # "cpu (2 threads)" or the GPU's name
    by_size: dict[int, float] = field(default_factory=dict)  # n -> TFLOP/s

    def to_dict(self) -> dict:
        return {"tflops": self.tflops, "dtype": self.dtype, "device": self.device,
                "by_size": {str(n): v for n, v in self.by_size.items()}}


def describe_device(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    return f"cpu ({n} thread{'s' if n != 1 else ''})"


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, dtype: str = "fp32", sizes=None, repeats: int = 5, min_time: float = 0.02,
            budget_s: float = 1.0, agree=None, barrier=None) -> Peak:
    """Measure the matmul ceiling of `device` in `dtype` (see the module's docstring).

    Sizes are tried in ascending order while the estimated time stays within `budget_s`
    (the first size always runs). In a multi-process run `agree(int) -> int` (the maximum over
    the ranks) makes every decision the same on every rank, and `barrier()` starts each timed
    repeat on all ranks at once, so that their matmuls overlap as in training.
    """
    import torch

    agree = agree or (lambda x: x)
    barrier = barrier or (lambda: None)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    sizes = sorted(sizes or SIZES["cuda" if device.type == "cuda" else "cpu"])
    gen = torch.Generator(device="cpu").manual_seed(0)
    by_size: dict[int, float] = {}
    spent, last = 0.0, None  # time so far; (n, seconds per matmul) of the previous size
    for n in sizes:
        if last is not None:
            per_call = last[1] * (n / last[0]) ** 3
            estimate = per_call + repeats * max(min_time, per_call)
            if agree(int(spent + estimate > budget_s)):
                break
        started = time.perf_counter()
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=torch_dtype)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=torch_dtype)
        c = torch.empty(n, n, device=device, dtype=torch_dtype)
        barrier()
        t0 = time.perf_counter()
        torch.matmul(a, b, out=c)  # warm-up: kernels chosen, pages touched
        _sync(device)
        single = time.perf_counter() - t0
        calls = agree(max(1, math.ceil(min_time / max(single, 1e-9))))
        best = math.inf
        for _ in range(repeats):
            barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.matmul(a, b, out=c)
            _sync(device)
            best = min(best, (time.perf_counter() - t0) / calls)
        by_size[n] = 2 * n**3 / best / 1e12
        spent += time.perf_counter() - started
        last = (n, best)
        del a, b, c
    return Peak(max(by_size.values()), dtype, describe_device(device), by_size)


def parse_peak(value) -> float | str:
    """--peak: 'auto', 'datasheet' or a positive number of TFLOP/s ('' is the default)."""
    s = str(value).strip()
    if s in ("", "auto", "datasheet"):
        return s
    try:
        x = float(s)
    except ValueError:
        x = math.nan
    if not (x > 0 and math.isfinite(x)):
        raise ConfigError(f"--peak must be auto, datasheet or a positive number of TFLOP/s, got {value!r}: "
                          f"e.g. --peak auto")
    return x


def check_peak(value, device_name: str, dtype: str) -> None:
    """Refuse, before training, a --peak that cannot be honoured on this device."""
    if parse_peak(value) != "datasheet":
        return
    import torch

    from ultrascale.distributed.context import device_of
    from ultrascale.train.metrics import PEAK_TFLOPS, peak_tflops

    device = device_of(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        return  # --device cuda without a GPU: the run itself says so
    if peak_tflops(device, dtype) is None:
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else "a CPU"
        raise ConfigError(f"--peak datasheet: no datasheet figure for {what} (known: "
                          f"{', '.join(PEAK_TFLOPS)}): use --peak auto to measure it, or give TFLOP/s (--peak 50)")


def run_peak(value, device: torch.device, dtype: str, group_size: int = 1) -> tuple[float, str]:
    """The ceiling MFU divides by, per device, and where it comes from: 'given', 'datasheet' or
    'measured'. Collective when measured in a process group of `group_size` > 1 (every rank calls it)."""
    from ultrascale.train.metrics import peak_tflops

    p = parse_peak(value)
    if isinstance(p, float):
        return p, "given"
    sheet = peak_tflops(device, dtype)
    if p == "datasheet" or (p == "" and sheet is not None):
        if sheet is None:
            check_peak("datasheet", device.type, dtype)  # raises the one-line error
        return sheet, "datasheet"
    return measured_peak(device, dtype, group_size), "measured"


def measured_peak(device: torch.device, dtype: str, group_size: int = 1) -> float:
    """`--peak auto`: the mean over the ranks of each rank's measured ceiling.

    The ranks measure together, on purpose. Ranks that share a machine's cores (several
    processes on one CPU) share them during training too: a rank measured alone would see
    every core and report a ceiling no rank can reach while the others compute, and MFU
    would come out too low by about the number of ranks per machine. Measured at the same
    time, each rank's ceiling is what it gets with the others busy, and each timed repeat
    starts behind a barrier so the overlap holds repeat by repeat (not only on average).
    GPUs are each rank's own, so this changes nothing there. The mean over the ranks times
    the number of devices is the sum of the ceilings, which is what the total FLOPs are
    compared with.

    Measured once per process for the same device, dtype, thread count and group size (a
    process that trains several times, as the tests do, pays once); the ranks agree first
    on whether all of them hold it, so none waits at a barrier the others skip.
    """
    import torch

    import torch.distributed as dist

    distributed = group_size > 1 and dist.is_available() and dist.is_initialized()
    key = (str(device), dtype, torch.get_num_threads(), group_size)
    comm_device = device if distributed and dist.get_backend() == "nccl" else torch.device("cpu")

    def reduce(x: float, op) -> float:
        if not distributed:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=comm_device)
        dist.all_reduce(t, op=op)
        return t.item()

    ops = dist.ReduceOp if distributed else None
    missing = reduce(float(key not in _CACHE), ops.MAX if ops else None)
    if missing:
        # A CPU reaches its ceiling already at n = 256-1024 (measured: the same TFLOP/s at every
        # size in quiet runs, docs/benchmarks.md), so training spends a quarter of a second on it,
        # not the second `ultrascale peak` allows itself; a GPU needs its large sizes.
        budget = 0.25 if device.type == "cpu" else 1.0
        _CACHE[key] = measure(device, dtype, budget_s=budget,
                              agree=lambda x: int(reduce(float(x), ops.MAX if ops else None)),
                              barrier=dist.barrier if distributed else None)
    mine = _CACHE[key].tflops
    return reduce(mine, ops.SUM if ops else None) / (group_size if distributed else 1)


# -- `ultrascale peak` -----------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("peak", help="measure the device's dense matmul ceiling (TFLOP/s), beside the datasheet's")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16")
    p.add_argument("--size", type=int, help="one matrix size n (default: a few, smallest first)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_peak)


def cmd_peak(args) -> int:
    import json

    import torch

    from ultrascale.distributed.context import device_of
    from ultrascale.train.metrics import peak_tflops

    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be fp32, bf16 or fp16, got {args.dtype!r}")
    if args.size is not None and args.size <= 0:
        raise ConfigError(f"--size must be a positive integer, got {args.size}")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no GPU is visible to torch: use --device cpu")
    device = device_of(args.device)
    sizes = [args.size] if args.size else None
    peak = measure(device, args.dtype, sizes, repeats=10, budget_s=5.0)
    sheet = peak_tflops(device, args.dtype)
    if args.json:
        threads = torch.get_num_threads() if device.type == "cpu" else None
        print(json.dumps({**peak.to_dict(), "threads": threads, "datasheet_tflops": sheet}))
        return 0
    for n, v in peak.by_size.items():
        print(f"  n = {n:>5}: {v:.4g} TFLOP/s")
    beside = f", datasheet {sheet:g} TFLOP/s ({100 * peak.tflops / sheet:.0f}% of it)" if sheet else \
        ", no datasheet figure for this device"
    print(f"peak {peak.tflops:.4g} TFLOP/s ({args.dtype} matmul, {peak.device}){beside}")
    if device.type == "cpu":
        print(f"on {torch.get_num_threads()} threads: torch.get_num_threads(), what one training process uses "
              f"(OMP_NUM_THREADS; `train --nproc N` gives each rank its share)")
    return 0
