"""Prepared corpora, the loader and `prepare`: memory and start-up against the corpus size, the
loader against the trainer, and `prepare` against a plain loop.

A prepared corpus (`ultrascale data prepare`) is read window by window from its shards (one
os.pread per window, each file advised POSIX_FADV_RANDOM: nothing mapped, no read-ahead), and each
step's windows come from a keyed permutation evaluated for that step only (train/data.py), so
neither memory, nor start-up, nor what is read from storage should grow with the corpus. Three
measurements check that, and that reading the data costs the trainer nothing:

1. Flat memory and start-up. Two corpora of the same text (Python's standard library sources,
   repeated in a seeded shuffled order, in files of about 1 MiB, each file one document) are
   prepared with the byte tokenizer: about 10M tokens and about 1.05e9. For each corpus and each
   reading (the whole global batch as dp 1, and rank 3's rows of dp 8), a fresh process imports the
   loader's modules, notes its resident memory (the baseline), times `run_batches` and the first
   `micro_batches` (start-up), then draws `--steps` more steps (seq 1024, global batch 64, micro-batch 8)
   and reports the assembly rate in tokens/s and its resident memory: the peak (ru_maxrss) and the
   current RSS over the baseline, split into anonymous memory (what the process allocated) and
   file-backed pages (files' pages mapped into it: page cache, shared and reclaimable). Each
   reading runs twice: first with the shards' pages evicted from the page cache
   (posix_fadvise DONTNEED on the shard files only: a cold start, as after a reboot), then again
   with them cached (warm). `prepare`'s own line for the large corpus (tokens, seconds, tokens/s)
   and the sizes on disk are reported too; so is what the process read from storage
   (/proc/self/io read_bytes: page-cache misses, read-ahead included). For comparison, the large
   corpus is also read two other ways, set up in the measuring process only (`use_reader`, which
   replaces `Shards.read` there): np.memmap of each shard with the kernel's defaults (how `Shards`
   read before: a page fault reads around the faulting page, and the pages read stay mapped into
   the process), and the same maps advised MADV_RANDOM.
2. The loader against the trainer, on the 10M corpus: batch assembly in tokens/s for the shape
   `ultrascale train --seq-len 256 --micro-batch 8` trains in one process (global batch 8), read
   as one rank and as 8 ranks (every rank's call, one row each, as the ranks would make them),
   against the trainer's own tokens/s (`ultrascale train --data DIR --log-jsonl`, median over the
   steps after the first 3) for the `tiny` and the `small` presets. The trainer's step time
   includes its own call to `micro_batches`; the ratio says how far ahead the loader is.
3. `prepare` against a plain single-process loop on the same ~100 MB of text: read each file,
   `text.encode('utf-8')` into a uint16 array, an end-of-document token after it, all into one
   .bin; against `ultrascale data prepare --workers 1` and with its default (every core). The
   loop and the two commands take turns `--repeats` times; the figures are medians. prepare's
   tokens/s is its own line (its pool, from the first piece to the index); its wall time with the
   interpreter's start is reported beside it.

Everything is written under a scratch directory in --workdir (default: the system's temporary
directory) and deleted at the end unless --keep. The full run writes ~1.1 GB of text and ~2.1 GB
of shards.

    .venv/bin/python benchmarks/bench_data.py --json /tmp/bench_data.json
    .venv/bin/python benchmarks/bench_data.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FILE_BYTES = 2**20  # one generated text file (one document)
SEQ, GLOBAL_BATCH, MICRO_BATCH = 1024, 64, 8  # measurement 1's shape
READINGS = [("dp 1", 0, 1), ("rank 3 of dp 8", 3, 8)]  # (label, dp rank, dp)
TRAIN_SEQ, TRAIN_MICRO = 256, 8  # measurement 2's shape (one process: global batch 8)
EOS = 256  # the byte tokenizer's end-of-document token


# -- corpora -------------------------------------------------------------------------------------
def stdlib_sources() -> list[bytes]:
    from ultrascale.train.corpus import stdlib_files

    out = []
    for path in stdlib_files():
        with open(path, "rb") as f:
            out.append(f.read())
    return [s for s in out if s]


def write_text(directory: str, target_bytes: int, seed: int = 0) -> dict:
    """~target_bytes of stdlib sources, each pass over them in a new shuffled order, in files of about
    FILE_BYTES (whole sources only); {"files", "bytes"}."""
    sources, rng = stdlib_sources(), random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    written, files, order = 0, 0, []
    while written < target_bytes:
        chunk = []
        while sum(map(len, chunk)) < min(FILE_BYTES, target_bytes - written):
            if not order:
                order = list(range(len(sources)))
                rng.shuffle(order)
            chunk.append(sources[order.pop()])
        with open(os.path.join(directory, f"{files:06d}.txt"), "wb") as f:
            f.write(b"".join(chunk))
        written += sum(map(len, chunk))
        files += 1
    return {"files": files, "bytes": written}


LINE = re.compile(r"([\d,]+) tokens in ([\d.]+) s \(([\d,]+) tokens/s on (\d+) processes\)")


def prepare(text_dir: str, out_dir: str, workers: int | None = None) -> dict:
    """`ultrascale data prepare` in its own process: its own figures, its wall time and its line."""
    cmd = [sys.executable, "-m", "ultrascale", "data", "prepare", text_dir, out_dir]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    start = time.perf_counter()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    line = done.stdout.strip().splitlines()[-1]
    m = LINE.search(line)
    tokens, rate = int(m[1].replace(",", "")), int(m[3].replace(",", ""))  # its rate: its seconds unrounded
    return {"line": line, "tokens": tokens, "seconds": tokens / rate, "tokens_per_s": rate,
            "processes": int(m[4]), "wall_s": wall, "wall_tokens_per_s": tokens / wall}


def disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs)


def evict(directory: str) -> None:
    """Drop the shard files' pages from the page cache (theirs only): the next read comes from disk.
    Written back first: the kernel keeps a dirty page (a shard prepare has just written)."""
    for name in os.listdir(directory):
        if name.endswith(".bin"):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- 1: a fresh process per corpus and reading ---------------------------------------------------
def memory_now() -> dict:
    """This process's resident memory, MiB: peak (ru_maxrss), current, anonymous and file-backed; and
    what it has read from storage so far (read_bytes: page-cache misses, read-ahead included)."""
    status = {}
    with open("/proc/self/io") as f:
        io = {k: int(v) for k, v in (line.split(":") for line in f)}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                status[key] = int(value.split()[0]) / 1024
    return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss": status["VmRSS"],
            "anon": status["RssAnon"], "file": status["RssFile"],
            "storage_read": io["read_bytes"] / 2**20}


def use_reader(reader: str) -> None:
    """Read the shards another way than train/data.py's `Shards` (os.pread of each window from a file
    advised POSIX_FADV_RANDOM: no read-ahead, nothing mapped), for comparison; `Shards.read` replaced in
    this process only. `mmap`: np.memmap of each shard with the kernel's defaults, what `Shards` did
    before (a page fault reads around the faulting page, and the pages read are mapped into the process);
    `madvise`: the same maps advised MADV_RANDOM (no read-around). The maps go in the stream's `maps`."""
    if reader == "pread":
        return
    if reader not in ("mmap", "madvise"):
        raise ValueError(f"unknown reader {reader!r}")
    import mmap

    import numpy as np

    from ultrascale.train.data import Shards

    def map_of(self, i):
        maps = self.__dict__.setdefault("maps", {})
        if i not in maps:
            maps[i] = np.memmap(self.files[i], dtype=self.dtype, mode="r")
            if reader == "madvise":
                maps[i]._mmap.madvise(mmap.MADV_RANDOM)
        return maps[i]

    def read(self, starts, length):  # Shards.read with a slice of the map in place of a pread
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, s in enumerate(np.asarray(starts, dtype=np.int64)):
            pos, filled = int(s), 0
            while filled < length:
                i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
                local = pos - int(self.offsets[i])
                take = min(length - filled, int(self.offsets[i + 1]) - pos)
                out[row, filled:filled + take] = map_of(self, i)[local:local + take]
                filled, pos = filled + take, pos + take
        return out

    Shards.read = read


def child(spec: dict) -> dict:
    """Run in a fresh process: start-up, --steps steps of one rank's micro-batches, memory."""
    t0 = time.perf_counter()
    from ultrascale.config import TrainConfig
    from ultrascale.train.data import run_batches

    reader = spec.get("reader", "pread")
    use_reader(reader)
    imports_s = time.perf_counter() - t0
    base = memory_now()
    rank, dp = spec["rank"], spec["dp"]
    grad_accum = max(1, GLOBAL_BATCH // dp // MICRO_BATCH)
    t = TrainConfig(data=spec["data"], seq_len=SEQ, seed=0)
    start = time.perf_counter()
    train, _, _ = run_batches(t, GLOBAL_BATCH)
    opened_s = time.perf_counter() - start
    train.micro_batches(0, rank, dp, grad_accum)
    startup_s = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        train.micro_batches(step, rank, dp, grad_accum)
    elapsed = time.perf_counter() - start
    tokens = spec["steps"] * GLOBAL_BATCH // dp * SEQ
    after = memory_now()
    stream = train.sources[0].stream
    return {"imports_s": imports_s, "open_s": opened_s, "startup_s": startup_s, "steps": spec["steps"],
            "tokens": tokens, "tokens_per_s": tokens / elapsed, "baseline": base, "after": after,
            "rss_over_baseline": after["rss"] - base["rss"], "anon_over_baseline": after["anon"] - base["anon"],
            "file_over_baseline": after["file"] - base["file"],
            "storage_read": after["storage_read"] - base["storage_read"],
            "peak_over_baseline": after["peak"] - base["rss"],
            "reader": reader, "shards_opened": len(getattr(stream, "maps", {}) if reader != "pread" else stream.fds),
            "shards": len(stream.files)}


def in_fresh_process(spec: dict) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                          check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_flat(corpora: dict, steps: int, caches: tuple) -> dict:
    """{cache: {reading: {corpus: child's figures}}}; cold then warm for each reading."""
    out = {cache: {} for cache in caches}
    for label, rank, dp in READINGS:
        for cache in caches:
            out[cache][label] = {}
            for name, path in corpora.items():
                if cache == "cold":
                    evict(path)
                out[cache][label][name] = in_fresh_process({"data": path, "rank": rank, "dp": dp, "steps": steps})
    return out


def print_flat(flat: dict, names: list[str]) -> None:
    a, b = names
    rows = [("start-up: run_batches + first micro_batches, ms", lambda r: 1e3 * r["startup_s"], "{:,.1f}"),
            ("  of which run_batches (index, shards, permutation), ms", lambda r: 1e3 * r["open_s"], "{:,.1f}"),
            ("assembly, tokens/s", lambda r: r["tokens_per_s"], "{:,.0f}"),
            ("peak RSS (ru_maxrss), MiB", lambda r: r["after"]["peak"], "{:,.0f}"),
            ("RSS over the baseline, MiB", lambda r: r["rss_over_baseline"], "{:,.1f}"),
            ("  anonymous, MiB", lambda r: r["anon_over_baseline"], "{:,.1f}"),
            ("  file-backed (mapped pages), MiB", lambda r: r["file_over_baseline"], "{:,.1f}"),
            ("read from storage (cache misses, read-ahead included), MiB", lambda r: r["storage_read"], "{:,.1f}"),
            ("shards opened / in the split", lambda r: f"{r['shards_opened']} / {r['shards']}", "{}")]
    for cache in flat:
        for label, _, _ in READINGS:
            res = flat[cache][label]
            print(f"\n{label}, {cache} page cache: {res[a]['steps']} steps after the first, seq {SEQ}, global batch "
                  f"{GLOBAL_BATCH}; baseline RSS after imports {res[a]['baseline']['rss']:,.0f} / "
                  f"{res[b]['baseline']['rss']:,.0f} MiB, its peak so far (the imports') "
                  f"{res[a]['baseline']['peak']:,.0f} / {res[b]['baseline']['peak']:,.0f} MiB")
            print(f"| measurement | {a} | {b} | {b} / {a} |")
            print("|---|---:|---:|---:|")
            for text, get, fmt in rows:
                x, y = get(res[a]), get(res[b])
                ratio = f"{y / x:.2f}" if isinstance(x, float) and x > 0 else "-"
                print(f"| {text} | {fmt.format(x)} | {fmt.format(y)} | {ratio} |")


def measure_readers(path: str, steps: int, caches: tuple) -> dict:
    """{reader: {reading: {cache: child's figures}}} on one corpus, for the readers other than train/data.py's."""
    out = {}
    for reader in ("mmap", "madvise"):
        out[reader] = {}
        for label, rank, dp in READINGS:
            out[reader][label] = {}
            for cache in caches:
                if cache == "cold":
                    evict(path)
                out[reader][label][cache] = in_fresh_process(
                    {"data": path, "rank": rank, "dp": dp, "steps": steps, "reader": reader})
    return out


READERS = {"pread": "os.pread + POSIX_FADV_RANDOM (train/data.py)",
           "mmap": "np.memmap, the kernel's defaults (train/data.py before)",
           "madvise": "np.memmap + madvise(MADV_RANDOM)"}


def print_readers(flat: dict, readers: dict, name: str) -> None:
    every = {"pread": {label: {c: flat[c][label][name] for c in flat} for label, _, _ in READINGS},
             **readers}
    print(f"\nthe {name} corpus read three ways, the same steps as above")
    print("| reader | reading | page cache | start-up, ms | tokens/s | RSS over baseline, MiB: anonymous | "
          "file-backed | peak RSS, MiB | read from storage, MiB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for reader, by_reading in every.items():
        for label, by_cache in by_reading.items():
            for cache, r in by_cache.items():
                print(f"| {READERS[reader]} | {label} | {cache} | {1e3 * r['startup_s']:,.1f} | "
                      f"{r['tokens_per_s']:,.0f} | {r['anon_over_baseline']:,.1f} | {r['file_over_baseline']:,.1f} | "
                      f"{r['after']['peak']:,.0f} | {r['storage_read']:,.1f} |")


# -- 2: the loader against the trainer -----------------------------------------------------------
def loader_rate(data: str, dp: int, seconds: float) -> dict:
    """micro_batches of every rank of each step, for global batch TRAIN_MICRO x TRAIN_SEQ, for `seconds`."""
    from ultrascale.config import TrainConfig
    from ultrascale.train.data import run_batches

    train, _, _ = run_batches(TrainConfig(data=data, seq_len=TRAIN_SEQ, seed=0), TRAIN_MICRO)
    train.micro_batches(0, 0, dp, 1)
    step, start = 0, time.perf_counter()
    while step < 20 or time.perf_counter() - start < seconds:
        step += 1
        for rank in range(dp):
            train.micro_batches(step, rank, dp, 1)
    elapsed = time.perf_counter() - start
    return {"dp": dp, "steps": step, "tokens_per_s": step * TRAIN_MICRO * TRAIN_SEQ / elapsed,
            "step_ms": 1e3 * elapsed / step}


def trainer_rate(data: str, model: str, threads: int, steps: int, workdir: str) -> dict:
    log = os.path.join(workdir, f"train-{model}-{threads}.jsonl")
    cmd = [sys.executable, "-m", "ultrascale", "train", "--data", data, "--model", model, "--steps", str(steps),
           "--seq-len", str(TRAIN_SEQ), "--micro-batch", str(TRAIN_MICRO), "--peak", "1", "--no-progress",
           "--log-jsonl", log]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    with open(log) as f:
        rows = [r for r in map(json.loads, f) if isinstance(r, dict) and "tokens_per_s" in r]
    kept = rows[3:] or rows
    return {"model": model, "threads": threads, "steps": len(rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in kept),
            "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in kept),
            "command": f"OMP_NUM_THREADS={threads} " + " ".join(cmd[2:])}


def print_loader(loader: list[dict], trainer: list[dict]) -> None:
    one, every = loader
    print(f"\nglobal batch {TRAIN_MICRO} x {TRAIN_SEQ} (one process, micro-batch {TRAIN_MICRO}), the 10M corpus")
    print("| who | tokens/s | ms per step | loader (1 rank) / this | loader (8 ranks) / this |")
    print("|---|---:|---:|---:|---:|")
    print(f"| loader, 1 rank | {one['tokens_per_s']:,.0f} | {one['step_ms']:.3f} | | |")
    print(f"| loader, 8 ranks (every rank's call, 1 row each) | {every['tokens_per_s']:,.0f} | "
          f"{every['step_ms']:.3f} | | |")
    for t in trainer:
        threads = f"{t['threads']} thread{'s' if t['threads'] > 1 else ''}"
        print(f"| trainer, {t['model']}, {threads} (median of steps 4-{t['steps']}) | {t['tokens_per_s']:,.0f} | "
              f"{t['step_ms']:.1f} | {one['tokens_per_s'] / t['tokens_per_s']:,.0f}x | "
              f"{every['tokens_per_s'] / t['tokens_per_s']:,.0f}x |")


# -- 3: prepare against a plain loop -------------------------------------------------------------
def plain_loop(text_dir: str, out_path: str) -> dict:
    """nanoGPT's way, one process: each file's bytes as uint16, an end-of-document token after each."""
    import numpy as np

    eos = np.array([EOS], dtype=np.uint16)
    start, tokens = time.perf_counter(), 0
    with open(out_path, "wb") as out:
        for name in sorted(os.listdir(text_dir)):
            with open(os.path.join(text_dir, name), encoding="utf-8") as f:
                text = f.read()
            ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
            out.write(ids.tobytes())
            out.write(eos.tobytes())
            tokens += len(ids) + 1
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def measure_prepare_vs_loop(text_dir: str, workdir: str, repeats: int) -> dict:
    runners = {"plain loop, 1 process": lambda out: plain_loop(text_dir, out + ".bin"),
               "prepare --workers 1": lambda out: prepare(text_dir, out, 1),
               "prepare (default: every core)": lambda out: prepare(text_dir, out)}
    names, runs = list(runners), {n: [] for n in runners}
    for rep in range(repeats):
        for name in names[rep % 3:] + names[:rep % 3]:
            out = os.path.join(workdir, f"vs-{len(runs[name])}-{names.index(name)}")
            runs[name].append(runners[name](out))
            shutil.rmtree(out, ignore_errors=True)
            if os.path.exists(out + ".bin"):
                os.remove(out + ".bin")
    return runs


def print_prepare_vs_loop(runs: dict, text: dict) -> None:
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain loop, 1 process"])
    repeats = len(next(iter(runs.values())))
    print(f"\n{text['bytes'] / 1e6:,.0f} MB of text in {text['files']} files; medians of {repeats}")
    print("| runner | tokens | s | tokens/s | vs the plain loop | wall s (process start to exit) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        sec = statistics.median(r["seconds"] for r in rs)
        wall = f"{statistics.median(r['wall_s'] for r in rs):.1f}" if "wall_s" in rs[0] else "-"
        procs = f" ({rs[0]['processes']} processes)" if "default" in name else ""
        print(f"| {name}{procs} | {rs[0]['tokens']:,} | {sec:.2f} | {tps:,.0f} | {tps / plain:.2f}x | {wall} |")


def size_name(tokens: float) -> str:
    return f"{tokens / 1e9:.2f}B" if tokens >= 1e9 else f"{tokens / 1e6:,.0f}M"


# -- the run -------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 10M and 50M tokens, cold page cache only, 20 MB for prepare")
    ap.add_argument("--small-tokens", type=float, default=1e7, help="the small corpus (text bytes ~ tokens)")
    ap.add_argument("--large-tokens", type=float, default=1.05e9, help="the large corpus")
    ap.add_argument("--vs-bytes", type=float, default=1e8, help="text for prepare against the plain loop")
    ap.add_argument("--steps", type=int, default=200, help="steps drawn after the first, measurement 1")
    ap.add_argument("--train-steps", type=int, default=20, help="trainer steps, measurement 2")
    ap.add_argument("--trainer-threads", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                    help="OMP_NUM_THREADS of the trainer runs, measurement 2 (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3, help="turns of the plain loop and prepare, measurement 3")
    ap.add_argument("--workdir", default=None, help="where the scratch directory goes (default: the system's temp)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.quick:
        args.large_tokens, args.vs_bytes, args.steps = 5e7, 2e7, 50
        args.train_steps, args.repeats, args.trainer_threads = min(args.train_steps, 5), 1, [1]

    from _common import command_line, machine_info

    machine = machine_info()
    print(f"{machine['cpu']}, {machine['cores']} cores ({machine['isa']}), Python {machine['python']}, "
          f"torch {machine['torch']}; load average {machine['loadavg_start'][0]:.2f}", flush=True)
    began = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="bench_data-", dir=args.workdir)
    result = {"command": command_line(), "machine": machine, "scratch": scratch}
    try:
        names = [size_name(args.small_tokens), size_name(args.large_tokens)]
        corpora, made = {}, {}
        for name, size in zip(names, (args.small_tokens, args.large_tokens)):
            text_dir, out = os.path.join(scratch, f"text-{name}"), os.path.join(scratch, f"prepared-{name}")
            start = time.perf_counter()
            text = write_text(text_dir, int(size))
            text["write_s"] = time.perf_counter() - start
            made[name] = {"text": text, "prepare": prepare(text_dir, out), "disk_bytes": disk_bytes(out)}
            corpora[name] = out
            print(f"{name}: {text['bytes'] / 1e6:,.0f} MB of text in {text['files']:,} files "
                  f"(written in {text['write_s']:.1f} s); prepare: {made[name]['prepare']['line']}; "
                  f"{made[name]['disk_bytes'] / 2**30:.2f} GiB on disk, wall {made[name]['prepare']['wall_s']:.1f} s",
                  flush=True)
            if name == names[1]:
                shutil.rmtree(text_dir)  # the large text is not read again
        result["corpora"] = made

        print(f"\n1. Memory and start-up against the corpus size, a fresh process each, train/data.py's reader "
              f"({time.perf_counter() - began:.0f} s in)", flush=True)
        caches = ("cold",) if args.quick else ("cold", "warm")
        result["flat"] = measure_flat(corpora, args.steps, caches)
        print_flat(result["flat"], names)
        result["readers"] = measure_readers(corpora[names[1]], args.steps, caches)
        print_readers(result["flat"], result["readers"], names[1])

        print(f"\n2. The loader against the trainer ({time.perf_counter() - began:.0f} s in)", flush=True)
        small = corpora[names[0]]
        loader = [loader_rate(small, dp, 1.0) for dp in (1, 8)]
        trainer = [trainer_rate(small, model, threads, args.train_steps, scratch)
                   for model in ("tiny", "small") for threads in args.trainer_threads]
        result["loader_vs_trainer"] = {"loader": loader, "trainer": trainer}
        print_loader(loader, trainer)

        print(f"\n3. prepare against a plain single-process loop ({time.perf_counter() - began:.0f} s in)", flush=True)
        vs_dir = os.path.join(scratch, "text-vs")
        text = write_text(vs_dir, int(args.vs_bytes), seed=1)
        runs = measure_prepare_vs_loop(vs_dir, scratch, args.repeats)
        result["prepare_vs_loop"] = {"text": text, "runs": runs}
        print_prepare_vs_loop(runs, text)
    finally:
        if args.keep:
            print(f"\nkept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    machine["loadavg_end"] = os.getloadavg()
    print(f"\nload average at the end {machine['loadavg_end'][0]:.2f}; {time.perf_counter() - began:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
