"""The device's dense matmul ceiling, measured: what MFU divides by when no datasheet says.

Square matmuls C = A @ B of a few sizes n, in the compute dtype: one warm-up call, then the
best of many timed repeats, TFLOP/s = 2 n^3 / t. The ceiling is the best size. On a CPU
each repeat is short (a few milliseconds of matmuls, then a millisecond's pause): on a
machine shared with other work, the scheduler takes the cores away for whole slices of
time, and a long repeat always contains some of them; among many short ones, some run
whole on a core that nothing else held, and the best of those is the ceiling (measured:
docs/engine.md, "Metrics"). On a CPU it runs on the threads torch uses in this process
(torch.get_num_threads(), what training uses: under `--nproc` the launcher sets
OMP_NUM_THREADS per rank); on a GPU with whatever matmul precision the process has set
(TF32 or not), as training would.

`--peak` (ultrascale train) picks the ceiling of MFU: `datasheet` (metrics.PEAK_TFLOPS),
`auto` (this machine's measured ceiling) or a number of TFLOP/s. The default is the
datasheet on a GPU that has a figure there, `auto` otherwise (every CPU). `auto` is
measured once per machine, device, dtype, torch version, thread count and number of ranks,
and kept in the user's cache (cache_file(): ~/.cache/ultrascale/peak.json): every later
run on the machine divides by the same figure, so their MFUs compare. `ultrascale peak
--save` measures again and replaces it; `ultrascale peak --forget` drops this machine's
figures (the next run measures again).
"""

from __future__ import annotations

import json
import math
import os
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
# How each device is timed: repeats per size, the least time one repeat runs (matmuls are called
# until it has passed), and the pause after each repeat. A CPU: many short repeats with a pause
# that lets whatever else wants the cores run in between (see the module's docstring); a GPU is
# the run's own, and its kernels need a longer repeat for the clock.
TIMING = {"cpu": {"repeats": 40, "min_time": 0.002, "pause_s": 0.001},
          "cuda": {"repeats": 5, "min_time": 0.02, "pause_s": 0.0}}
_CACHE: dict[tuple, tuple[float, str]] = {}  # this process's figures: (peak, where it came from)


@dataclass
class Peak:
    tflops: float  # the ceiling: the best size's best repeat
    dtype: str
    device: str  # "cpu (2 threads)" or the GPU's name
    by_size: dict[int, float] = field(default_factory=dict)  # n -> TFLOP/s
    one_thread: float | None = None  # a CPU of several threads: one thread's ceiling (ceiling())

    def to_dict(self) -> dict:
        return {"tflops": self.tflops, "dtype": self.dtype, "device": self.device,
                "by_size": {str(n): v for n, v in self.by_size.items()}, "one_thread": self.one_thread}


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


def measure(device: torch.device, dtype: str = "fp32", sizes=None, repeats: int | None = None,
            min_time: float | None = None, budget_s: float = 1.0, agree=None, barrier=None,
            pause_s: float | None = None) -> Peak:
    """Measure the matmul ceiling of `device` in `dtype` (see the module's docstring).

    Each size runs `repeats` timed repeats of at least `min_time` seconds, each followed by a
    pause of `pause_s` (None: the device's TIMING), and keeps the best. Sizes are tried in
    ascending order while the estimated time stays within `budget_s` (the first size always
    runs). In a multi-process run `agree(int) -> int` (the maximum over the ranks) makes every
    decision the same on every rank, and `barrier()` starts each timed repeat on all ranks at
    once, so that their matmuls overlap as in training.
    """
    import torch

    timing = TIMING["cuda" if device.type == "cuda" else "cpu"]
    repeats = timing["repeats"] if repeats is None else repeats
    min_time = timing["min_time"] if min_time is None else min_time
    pause_s = timing["pause_s"] if pause_s is None else pause_s
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
            estimate = per_call + repeats * (max(min_time, per_call) + pause_s)
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
            if pause_s:
                time.sleep(pause_s)
        by_size[n] = 2 * n**3 / best / 1e12
        spent += time.perf_counter() - started
        last = (n, best)
        del a, b, c
    return Peak(max(by_size.values()), dtype, describe_device(device), by_size)


def ceiling(device: torch.device, dtype: str, sizes=None, budget_s: float = 1.0, agree=None,
            barrier=None) -> Peak:
    """measure(), and on a CPU of several threads one thread's ceiling too: the ceiling is the
    better of the two. Work split over threads waits, at the end of every matmul, for the slowest
    of them; on a machine whose cores are also busy with other processes a thread is often
    descheduled, and a whole 2-thread 256 x 256 matmul then took 15-23 ms instead of 0.2 (measured
    here, beside another 2-thread training: 0.002 TFLOP/s in every repeat for a second, against
    0.2 on the same cores when they were free). One thread waits for nobody, and the work of several could always run on one of them:
    no ceiling of several threads is below it. Collective as measure() is (every rank calls it)."""
    import torch

    agree = agree or (lambda x: x)
    peak = measure(device, dtype, sizes, budget_s=budget_s, agree=agree, barrier=barrier)
    threads = torch.get_num_threads()
    if device.type != "cpu" or not agree(int(threads > 1)):
        return peak
    torch.set_num_threads(1)
    try:
        one = measure(device, dtype, sizes, budget_s=budget_s / 2, agree=agree, barrier=barrier)
    finally:
        torch.set_num_threads(threads)
    peak.one_thread = one.tflops
    peak.tflops = max(peak.tflops, one.tflops)
    return peak


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


def run_peak(value, device: torch.device, dtype: str, group_size: int = 1) -> tuple[float, str, str]:
    """The ceiling MFU divides by, per device; where it comes from ('given', 'datasheet' or
    'measured'); and a phrase saying so for the run's header. Collective under `--peak auto` in a
    process group of `group_size` > 1 (every rank calls it)."""
    from ultrascale.train.metrics import peak_tflops

    p = parse_peak(value)
    if isinstance(p, float):
        return p, "given", "given with --peak"
    sheet = peak_tflops(device, dtype)
    if p == "datasheet" or (p == "" and sheet is not None):
        if sheet is None:
            check_peak("datasheet", device.type, dtype)  # raises the one-line error
        return sheet, "datasheet", "the vendor's dense figure, PEAK_TFLOPS in train/metrics.py"
    value, where = measured_peak(device, dtype, group_size)
    return value, "measured", where


def measured_peak(device: torch.device, dtype: str, group_size: int = 1) -> tuple[float, str]:
    """`--peak auto`: the mean over the ranks of each rank's measured ceiling, and where it was
    measured (now, or on an earlier run of this machine: the cache file).

    The ranks measure together, on purpose. Ranks that share a machine's cores (several
    processes on one CPU) share them during training too: a rank measured alone would see
    every core and report a ceiling no rank can reach while the others compute, and MFU
    would come out too low by about the number of ranks per machine. Measured at the same
    time, each rank's ceiling is what it gets with the others busy, and each timed repeat
    starts behind a barrier so the overlap holds repeat by repeat (not only on average).
    GPUs are each rank's own, so this changes nothing there. The mean over the ranks times
    the number of devices is the sum of the ceilings, which is what the total FLOPs are
    compared with.

    Measured once per machine (cache_key(): the device, the CPU's kernel set, threads, dtype,
    torch version and number of ranks) and kept in cache_file(), and once per process besides
    (a process that trains several times, as the tests do, does not read the file again). The
    ranks agree first on whether all of them hold it, so none waits at a barrier the others skip.
    """
    import torch

    import torch.distributed as dist

    distributed = group_size > 1 and dist.is_available() and dist.is_initialized()
    key = (str(device), dtype, torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), group_size)
    comm_device = device if distributed and dist.get_backend() == "nccl" else torch.device("cpu")

    def reduce(x: float, op) -> float:
        if not distributed:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=comm_device)
        dist.all_reduce(t, op=op)
        return t.item()

    ops = dist.ReduceOp if distributed else None
    if not reduce(float(key not in _CACHE), ops.MAX if ops else None):
        return _CACHE[key]
    file_key = cache_key(device, dtype, group_size)
    kept = read_cache().get(file_key)
    if not reduce(float(kept is None), ops.MAX if ops else None):
        # Every rank holds a figure (the same one on one machine): their mean, as measured.
        value = reduce(kept["tflops"], ops.SUM if ops else None) / (group_size if distributed else 1)
        _CACHE[key] = value, f"measured {kept['measured']} and kept in {_shown(cache_file())}; {_again(group_size)}"
        return _CACHE[key]
    # A CPU reaches its ceiling already at n = 256-512 (measured: the same TFLOP/s at every size
    # in quiet runs, docs/benchmarks.md); the second is spent on the many short repeats.
    peak = ceiling(device, dtype, budget_s=1.0, agree=lambda x: int(reduce(float(x), ops.MAX if ops else None)),
                   barrier=dist.barrier if distributed else None)
    value = reduce(peak.tflops, ops.SUM if ops else None) / (group_size if distributed else 1)
    problem = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one writer per machine
        problem = write_cache(file_key, value, peak.by_size)
    if reduce(float(problem is not None), ops.MAX if ops else None):  # what every rank says, the logging one too
        where = f"measured now, not kept: {problem or 'cannot write ' + _shown(cache_file())}"
    else:
        where = f"measured now, kept in {_shown(cache_file())} for the next runs"
    _CACHE[key] = value, where
    return _CACHE[key]


# -- the figures kept per machine --------------------------------------------------
def cache_file() -> str:
    """Where measured ceilings are kept: $XDG_CACHE_HOME/ultrascale/peak.json (~/.cache/...)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "ultrascale", "peak.json")


def _shown(path: str) -> str:
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home not in ("", "/") and path.startswith(home + os.sep) else path


def _again(ranks: int) -> str:
    return ("`ultrascale peak --save` measures it again" if ranks == 1 else
            "`ultrascale peak --forget` has the next run measure it again")


def _host() -> str:
    import platform

    return platform.node() or "localhost"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def cache_key(device: torch.device, dtype: str, ranks: int = 1) -> str:
    """What a measured ceiling depends on, as the cache file's key: the machine, the device (a
    CPU's model, the kernel set torch runs on it, the threads of each rank; a GPU's name and,
    in fp32, whether TF32 is on), the dtype, the torch version and the ranks measuring together."""
    import torch

    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
        if dtype == "fp32":
            what += f", fp32 matmul precision {torch.get_float32_matmul_precision()}"
    else:
        n = torch.get_num_threads()
        what = (f"{_cpu_model()}, {torch.backends.cpu.get_cpu_capability()} kernels, "
                f"{n} thread{'s' if n != 1 else ''}")
    return f"{_host()} | {what} | {dtype} | torch {torch.__version__} | {ranks} rank{'s' if ranks != 1 else ''}"


def read_cache() -> dict:
    """{key: {"tflops", "measured", "by_size"}} of the cache file; {} when missing or unreadable."""
    try:
        with open(cache_file()) as f:
            data = json.load(f)
        peaks = data.get("peaks", {}) if isinstance(data, dict) else {}
        return {k: v for k, v in peaks.items()
                if isinstance(v, dict) and isinstance(v.get("tflops"), (int, float)) and v["tflops"] > 0
                and isinstance(v.get("measured"), str)}
    except (OSError, ValueError):
        return {}


def _write_all(peaks: dict) -> str | None:
    """Replace the cache file's figures (atomically: a reader sees the old file or the new one);
    None, or what stopped it."""
    path = cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"version": 1, "peaks": peaks}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        return f"{_shown(path)}: {e.strerror or e}"
    return None


def write_cache(key: str, tflops: float, by_size: dict | None = None) -> str | None:
    """Keep one figure; None, or why it could not be written."""
    peaks = read_cache()
    peaks[key] = {"tflops": tflops, "measured": time.strftime("%Y-%m-%d %H:%M"),
                  "by_size": {str(n): v for n, v in (by_size or {}).items()}}
    return _write_all(peaks)


def forget_cache() -> int:
    """Drop this machine's figures; return how many there were."""
    peaks = read_cache()
    mine = [k for k in peaks if k.split(" | ", 1)[0] == _host()]
    if mine:
        problem = _write_all({k: v for k, v in peaks.items() if k not in mine})
        if problem:
            raise ConfigError(f"ultrascale peak --forget: cannot rewrite {problem}")
    _CACHE.clear()
    return len(mine)


# -- MFU above 100% ------------------------------------------------------------------
def above_peak_warning(m: dict) -> str:
    """One line for the step whose achieved TFLOP/s passed the peak MFU divides by: MFU is left out
    (an MFU above 100% says only that the peak is wrong), and how to give a right one."""
    fix = {
        "given": f"--peak {m['peak_tflops']:g} is below what the device runs: give its ceiling (`ultrascale peak` "
                 f"measures it; --peak datasheet on a known GPU)",
        "measured": "the ceiling was measured while the machine was busier than now: measure it again "
                    "(`ultrascale peak --save`; `ultrascale peak --forget` for a run of several ranks) or give "
                    "--peak TFLOPS",
        "datasheet": "the datasheet's figure is below what this device runs: give --peak TFLOPS (`ultrascale "
                     "peak` measures it)",
    }[m["peak_source"]]
    return (f"warning: step {m['step']} ran at {m['tflops']:.3g} TFLOP/s per device, above the peak MFU divides "
            f"by ({m['peak_tflops']:.3g} TFLOP/s, {m['peak_source']}): MFU is left out (null in the JSONL, "
            f"with mfu_above_peak); {fix}")


# -- `ultrascale peak` -----------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("peak", help="measure the device's dense matmul ceiling (TFLOP/s), beside the datasheet's")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16")
    p.add_argument("--size", type=int, help="one matrix size n (default: a few, smallest first)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save", action="store_true",
                   help="keep the figure as this machine's ceiling for `train --peak auto` of one process "
                        "(in ~/.cache/ultrascale/peak.json), replacing the one measured before")
    p.add_argument("--forget", action="store_true",
                   help="drop this machine's kept ceilings (any dtype, threads, ranks) and measure nothing: "
                        "the next `train --peak auto` measures again")
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
    if args.forget:
        if args.save or args.json or args.size is not None:
            raise ConfigError("--forget measures nothing: give it alone")
        n = forget_cache()
        print(f"forgot {n} measured ceiling{'s' if n != 1 else ''} of this machine in {_shown(cache_file())}: "
              f"the next `ultrascale train --peak auto` measures again")
        return 0
    device = device_of(args.device)
    sizes = [args.size] if args.size else None
    peak = ceiling(device, args.dtype, sizes, budget_s=5.0)
    sheet = peak_tflops(device, args.dtype)
    kept = None
    if args.save:
        problem = write_cache(cache_key(device, args.dtype), peak.tflops, peak.by_size)
        if problem:
            raise ConfigError(f"--save: cannot write {problem}")
        _CACHE.clear()
        kept = cache_file()
    if args.json:
        threads = torch.get_num_threads() if device.type == "cpu" else None
        print(json.dumps({**peak.to_dict(), "threads": threads, "datasheet_tflops": sheet, "saved_to": kept}))
        return 0
    for n, v in peak.by_size.items():
        print(f"  n = {n:>5}: {v:.4g} TFLOP/s")
    beside = f", datasheet {sheet:g} TFLOP/s ({100 * peak.tflops / sheet:.0f}% of it)" if sheet else \
        ", no datasheet figure for this device"
    if peak.one_thread is not None:
        print(f"  1 thread: {peak.one_thread:.4g} TFLOP/s (the ceiling is at least one thread's)")
    print(f"peak {peak.tflops:.4g} TFLOP/s ({args.dtype} matmul, {peak.device}){beside}")
    if device.type == "cpu":
        print(f"on {torch.get_num_threads()} threads: torch.get_num_threads(), what one training process uses "
              f"(OMP_NUM_THREADS; `train --nproc N` gives each rank its share)")
    if kept:
        print(f"saved in {_shown(kept)}: `ultrascale train --peak auto` of one process divides MFU by it here")
    return 0
