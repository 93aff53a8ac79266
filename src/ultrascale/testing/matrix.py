"""Where features meet: every pair of feature values, each run against one process or refused.

Each technique has its own equivalence tests; the bugs live where two of them meet
(fp16 with data parallelism, an MoE layer's statistics under context parallelism, a
resume after an fp16 skip). The space is the product of the FACTORS below, far too
big to run; every *pair* of values is not. This module

- decides, from the engine's own validation (`check_run`), which pairs of values are
  refused, and with what line (`refused_pairs`: docs/engine.md's table is generated
  from it, `python -m ultrascale.testing.matrix --docs`);
- builds a covering set of cells (`space`): every allowed pair of values of
  two factors appears in at least one cell, and so does every triple of dtype x one
  value of a parallel factor x resume, and of fp32 x MoE x one value of a parallel
  factor. A seeded greedy set cover over random valid
  completions (AETG's idea): deterministic, about 55 cells where the product holds
  ~10^5;
- runs a cell (`run_cell`) on pooled gloo ranks and compares it with the one-process
  run of the same global batch, fed the same micro-batches, with the project's
  equivalence criterion (testing/compare.py), the fp16 steps skipped included: the
  overflow decisions must be the same steps.

Every cell trains a global batch of 4 sequences of 32 tokens (8 where DualPipeV
runs on 2 data-parallel ranks), one sequence per micro-batch, for 3 steps of the
4-layer `tiny` or `tiny-moe`, on at most 4 ranks. fp16 cells start at a loss scale at which one process skips
steps 1 and 3, so skip parity is part of every fp16 check; a resumed cell saves
after step 1 (for fp16, the skipped step: AdamW has made no update yet) and
continues from the checkpoint to step 3 in its layout.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import shutil
import tempfile
from dataclasses import dataclass

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.errors import ConfigError
from ultrascale.model import get_preset

# factor -> its values; the first is "off" (what a cell has unless it asks for more).
FACTORS = {
    "dtype": ("fp32", "bf16", "fp16"),
    "model": ("dense", "moe"),
    "capacity": (0.0, 1.0),  # an MoE layer's capacity factor (0: dropless)
    "dp": (1, 2),
    "tp": (1, 2),
    "sp": (False, True),
    "cp": ("none", "allgather", "ring", "zigzag", "ulysses"),
    "pp": ("none", "naive", "afab", "1f1b", "interleaved", "zero-bubble", "dualpipev"),
    "ep": (1, 2),
    "zero": (0, 1, 2, 3),
    "offload": ("none", "cpu", "disk"),
    "recompute": ("none", "selective", "full"),
    "compile": (False, True),
    "resume": (False, True),
}
# The factors that are a parallel axis or a way of sharding: with dtype and resume, every triple.
PARALLEL = ("dp", "tp", "sp", "cp", "pp", "ep", "zero", "offload")
MAX_WORLD = 4  # the pooled ranks a 2-core machine runs
SEQ_LEN, STEPS, SAVE_AT, LAYERS = 32, 3, 1, 4


def global_batch(cell: Cell) -> int:
    """Sequences per step, one per micro-batch: 4, or 8 where DualPipeV's V needs 2 x pp = 4
    micro-batches on each of 2 data-parallel ranks."""
    return 8 if cell["pp"] == "dualpipev" and cell["dp"] > 1 else 4

# fp16's first loss scale, measured on this model and batch.
# The loss scale per sequence of the global batch (each micro-batch's backward starts from scale /
# micro-batches): 2^17 x 4 makes one process skip steps 1 and 3, dense and MoE, at either batch.
FP16_SCALE_PER_SEQUENCE = 2.0 ** 17
SEED = 1

Cell = dict  # factor -> value


def off() -> Cell:
    return {f: values[0] for f, values in FACTORS.items()}


def world(cell: Cell) -> int:
    return (cell["dp"] * cell["tp"] * (1 if cell["cp"] == "none" else 2) * (1 if cell["pp"] == "none" else 2))


def name(cell: Cell) -> str:
    """A cell in a few words: the values that are not off."""
    default = off()
    words = [f"{f}={v}" if not isinstance(v, bool) else f for f, v in cell.items() if v != default[f]]
    return ",".join(words) or "one-process"


def repair(cell: Cell, fixed: set) -> Cell | None:
    """What a value needs to be run at all, filled in around the `fixed` factors: sp needs tp 2,
    offload a ZeRO stage, ZeRO a data- or context-parallel group, ep an MoE model and dp 2; and
    at most MAX_WORLD ranks. A factor not fixed gives way (its value back to off); None when the
    fixed ones cannot be met (such pairs are outside the pool, not refused by the engine)."""
    c = dict(cell)

    def give(factor, value):
        if factor in fixed and c[factor] != value:
            return False
        c[factor] = value
        return True

    for _ in range(4):
        if c["sp"] and c["tp"] == 1 and not (give("tp", 2) if "sp" in fixed else give("sp", False)):
            return None
        if c["offload"] != "none" and not c["zero"]:
            if not (give("zero", 1) if "offload" in fixed else give("offload", "none")):
                return None
        if c["zero"] and c["dp"] == 1 and c["cp"] == "none":
            if not (give("dp", 2) if "zero" in fixed else give("zero", 0) and give("offload", "none")):
                return None
        if c["capacity"] and c["model"] != "moe":
            if not (give("model", "moe") if "capacity" in fixed else give("capacity", 0.0)):
                return None
        if c["ep"] > 1 and (c["model"] != "moe" or c["dp"] == 1):
            if "ep" in fixed:
                if not (give("model", "moe") and give("dp", 2)):
                    return None
            elif not give("ep", 1):
                return None
        for axis, one in (("pp", "none"), ("cp", "none"), ("tp", 1), ("dp", 1)):
            if world(c) > MAX_WORLD and axis not in fixed:
                c[axis] = one
                if axis == "tp":
                    c["sp"] = False
                if axis == "dp":
                    c["ep"], c["zero"], c["offload"] = 1, 0, "none"
        if world(c) > MAX_WORLD:
            return None
    return c if needs_met(c) else None


def needs_met(c: Cell) -> bool:
    """Every need `repair` fills holds for c, and it fits on MAX_WORLD ranks."""
    return (not (c["sp"] and c["tp"] == 1) and not (c["offload"] != "none" and not c["zero"])
            and not (c["zero"] and c["dp"] == 1 and c["cp"] == "none")
            and not (c["ep"] > 1 and (c["model"] != "moe" or c["dp"] == 1))
            and not (c["capacity"] and c["model"] != "moe") and world(c) <= MAX_WORLD)


def cost(cell: Cell) -> float:
    """About what a cell costs to run, relative to a 2-rank eager one (measured on 2 cores): the
    covering set picks the cells that cover the most pairs per cost."""
    return (1 + 8 * cell["compile"]) * (1.5 if world(cell) == 4 else 1) * (1.3 if cell["resume"] else 1)


def config(cell: Cell, workdir: str = "", batch: int = 0) -> RunConfig:
    """The run a cell stands for (with a per-cell directory for what it writes); `batch`: another
    global batch than the cell's own (its one-process control runs the batch of the cell it controls)."""
    batch = batch or global_batch(cell)
    moe = cell["model"] == "moe"
    model = get_preset("tiny-moe" if moe else "tiny", layers=LAYERS,
                       **({"z_loss_coef": 1e-3, "capacity_factor": cell["capacity"]} if moe else {}))
    pp = cell["pp"]
    parallel = ParallelConfig(
        dp=cell["dp"], tp=cell["tp"], sp=cell["sp"], ep=cell["ep"], zero=cell["zero"],
        cp=1 if cell["cp"] == "none" else 2, cp_attention="ring" if cell["cp"] == "none" else cell["cp"],
        pp=1 if pp == "none" else 2, pp_schedule="1f1b" if pp == "none" else pp,
        pp_chunks=2 if pp == "interleaved" else 1, offload=cell["offload"], bucket_mb=0.05,
        offload_dir=os.path.join(workdir, "states") if cell["offload"] == "disk" else "")
    train = TrainConfig(steps=STEPS, seq_len=SEQ_LEN, micro_batch=1, grad_accum=batch // cell["dp"],
                        lr=3e-3, warmup_steps=1, dtype=cell["dtype"], recompute=cell["recompute"],
                        compile=cell["compile"], seed=SEED, loss_scale_init=FP16_SCALE_PER_SEQUENCE * batch,
                        progress=False, peak="1", nproc=world(cell), eval_every=STEPS, eval_batches=1,
                        lr_decay_steps=STEPS)
    return RunConfig(model=model, parallel=parallel, train=train)


def verdict(cell: Cell) -> str | None:
    """None when the engine runs the cell; the one line it refuses it with otherwise."""
    from ultrascale.train.startup import check_run

    try:
        check_run(config(cell, workdir=tempfile.gettempdir()), world(cell))
    except ConfigError as e:
        return str(e)
    return None


def _pairs():
    items = [(f, v) for f, values in FACTORS.items() for v in values]
    for (f1, v1), (f2, v2) in itertools.combinations(items, 2):
        if f1 != f2:
            yield ((f1, v1), (f2, v2))


def required_triples() -> list:
    """Beyond pairs: every dtype x value of a parallel factor x resume; and every value of a
    parallel factor with an MoE model in fp32, where the MoE layers are held to fp32's bound
    (bf16 cells can hold them only loosely: near-tie routings are decided by rounding)."""
    out = [(("dtype", d), (f, v), ("resume", r)) for d in FACTORS["dtype"] for f in PARALLEL
           for v in FACTORS[f] for r in FACTORS["resume"]]
    out += [(("dtype", "fp32"), ("model", "moe"), (f, v)) for f in PARALLEL for v in FACTORS[f]]
    return out


def _minimal(tup) -> Cell | None:
    cell = off()
    cell.update(dict(tup))
    return repair(cell, {f for f, _ in tup})


@dataclass
class Space:
    cells: list  # the covering set: cells the engine runs
    refused: list  # [(pair, the minimal cell, the line)]: pairs the engine refuses
    # Pairs no cell holds: three axes at 2 (more than MAX_WORLD ranks), or a value that needs one the
    # pair excludes (sp needs tp 2, offload a ZeRO stage, ep an MoE model and dp 2, capacity an MoE model).
    outside: list


_SPACE: Space | None = None


def space() -> Space:
    """The covering set and the refused pairs (computed once per process, deterministic)."""
    global _SPACE
    if _SPACE is None:
        _SPACE = _build()
    return _SPACE


def _build() -> Space:
    rng = random.Random(0)
    wanted, refused, outside = [], [], []
    triples = required_triples()
    for tup in list(_pairs()) + triples:
        cell = _minimal(tup)
        if cell is None:
            outside.append(tup)
            continue
        why = verdict(cell)
        if why is None:
            wanted.append(tup)
        elif len(tup) == 2:
            refused.append((tup, cell, why))
        # a triple whose minimal cell is refused holds a refused pair: listed there
    uncovered = set(wanted)
    cells, seen = [], set()
    ok_cache: dict = {}

    def valid(cell):
        key = tuple(cell.values())
        if key not in ok_cache:
            ok_cache[key] = verdict(cell) is None
        return ok_cache[key]

    def covers(cell, tup):
        return all(cell[f] == v for f, v in tup)

    while uncovered:
        target = min(uncovered, key=repr)  # deterministic: sets of tuples iterate by hash
        best, gain = None, -1
        candidates = [_minimal(target)]
        for _ in range(60):
            c = {f: rng.choice(values) for f, values in FACTORS.items()}
            c["compile"] = False  # a compiled cell costs ~10x another: only where a pair asks for it
            c.update(dict(target))
            candidates.append(repair(c, {f for f, _ in target}))
        for c in candidates:
            # The all-off cell is its own control: nothing to compare.
            if c is None or c == off() or tuple(c.values()) in seen or not valid(c):
                continue
            g = sum(covers(c, t) for t in uncovered) / cost(c)
            if g > gain:
                best, gain = c, g
        if best is None:  # no valid completion found: count it refused in this company
            uncovered.discard(target)
            continue
        seen.add(tuple(best.values()))
        cells.append(best)
        uncovered = {t for t in uncovered if not covers(best, t)}
    return Space(cells, refused, outside)


# -- running a cell ------------------------------------------------------------------
_REFERENCES: dict = {}


def reference(cell: Cell):
    """One process on the cell's global batch, fed the same micro-batches (one sequence each),
    in this process; cached by what changes it (dtype, model, capacity)."""
    from ultrascale.testing.compare import RunRecord, train_single

    key = (cell["dtype"], cell["model"], cell["capacity"], global_batch(cell))
    if key not in _REFERENCES:
        one = dict(off(), dtype=cell["dtype"], model=cell["model"], capacity=cell["capacity"])
        _REFERENCES[key] = RunRecord.of(train_single(config(one, batch=global_batch(cell))))
    return _REFERENCES[key]


# Each cell is held to its dtype's tolerance class (testing/tolerance.py): fp32 cells to fp32
# reordering, bf16 and fp16 cells (one process fed the same micro-batches) to their format's class,
# except the MoE layers' tensors, and the norm before them, where the routing is decided in 16 bits
# (bf16 cells; fp16 cells with a capacity, where a near-tie at the capacity's edge decides which token
# an expert drops): there a layout moves a share of the assignments, bounded by `tolerance.routed`
# (measured, for the record: 0.12 at most with capacity 1.0; the same cells in fp32 within 1e-6).

def _routing_bound(cell: Cell) -> bool:
    """Whether the cell's MoE layers are held to the 16-bit routing bound (testing/tolerance.py, `routed`)."""
    return cell["model"] == "moe" and (cell["dtype"] == "bf16" or (cell["dtype"] == "fp16" and bool(cell["capacity"])))


def _routed(name: str) -> bool:
    """A tensor of an MoE layer, or the norm that feeds it."""
    return ".mlp." in name or "mlp_norm" in name


def _tolerance(dtype: str, routed: bool = False):
    from ultrascale.testing import tolerance

    cls = tolerance.for_dtype(dtype)
    return tolerance.routed(cls) if routed else cls.tolerance


# The compiler the covering set's compiled cells use. What meets parallelism under --compile is
# dynamo's tracing (graph breaks at collectives, the hooks of data parallelism and ZeRO-3 around
# compiled blocks, recomputation's replays) and AOTAutograd's backward graphs; both run under
# "aot_eager". Inductor's generated kernels do not depend on the layout (tests/test_compile.py
# checks them against eager in three layouts), and cost 5-35 s a cell on 2 cores.
COMPILE_BACKEND = "aot_eager"


def _train_on_worker(cfg, fault, backend, single=False):
    """compare's worker (or, single, one process here) with torch.compile's backend chosen."""
    import functools

    import torch

    from ultrascale.testing import compare

    def train():
        if single:
            return compare.RunRecord.of(compare.train_single(cfg, fault))
        return compare._train_on_worker(cfg, fault)

    if not cfg.train.compile or backend == "inductor":
        return train()
    real = torch.compile
    torch.compile = functools.partial(real, backend=backend)
    try:
        return train()
    finally:
        torch.compile = real


def run_cell(cell: Cell, fault: str | None = None, backend: str = COMPILE_BACKEND):
    """The cell on world(cell) pooled ranks (saved after step 1 and resumed, if asked): rank 0's
    RunRecord of all the steps."""
    from ultrascale.testing.compare import RunRecord
    from ultrascale.testing.harness import run_distributed
    from ultrascale.train.startup import check_run

    workdir = tempfile.mkdtemp(prefix="matrix-")
    try:
        cfg = config(cell, workdir)
        n = world(cell)

        def run(c):
            c = check_run(c, n)
            if n == 1:  # in this process: no process group, as one process runs
                return _train_on_worker(c, fault, backend, single=True)
            return run_distributed(n, _train_on_worker, c, fault, backend, timeout=300)[0]

        if not cell["resume"]:
            return run(cfg)
        save = os.path.join(workdir, "ck")
        # (The first part evaluates nothing: the uninterrupted run's only evaluation is at the last step.)
        first = run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=SAVE_AT, save=save,
                                                                        eval_every=0)))
        rest = run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=save)))
        return RunRecord(first.losses + rest.losses, first.grad_norms + rest.grad_norms, first.lrs + rest.lrs,
                         first.first_grads or rest.first_grads, rest.state, val_losses=rest.val_losses)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def skipped(record) -> list[int]:
    return [i + 1 for i, n in enumerate(record.grad_norms) if n is None]


def check_cell(cell: Cell, fault: str | None = None, backend: str = COMPILE_BACKEND):
    """Run the cell and its one-process control; (comparison, the failures: empty when it holds)."""
    from ultrascale.testing.compare import compare

    ref, got = reference(cell), run_cell(cell, fault, backend)
    problems = []
    if skipped(got) != skipped(ref):
        problems.append(f"fp16 skipped steps {skipped(got)}, one process {skipped(ref)}")
    if cell["dtype"] == "fp16" and not skipped(ref):
        problems.append("no fp16 step overflowed: raise FP16_SCALE_PER_SEQUENCE, the check needs a skip")
    if not ref.val_losses or len(got.val_losses) != len(ref.val_losses):
        problems.append(f"validation losses: {len(got.val_losses)}, one process {len(ref.val_losses)} (want 1 each)")
    if problems:  # another trajectory: nothing more to compare
        return None, problems
    keep = [i for i, n in enumerate(ref.grad_norms) if n is not None]

    def finite_only(r):
        return dataclasses.replace(r, grad_norms=[r.grad_norms[i] for i in keep])

    label = name(cell) + (f" [fault: {fault}]" if fault else "")
    ref, got = finite_only(ref), finite_only(got)
    if not _routing_bound(cell):
        c = compare(label, ref, got, record=fault is None)
        return c, problems + c.failures(_tolerance(cell["dtype"]))
    # 16-bit routing: the MoE layers' tensors against their own bound (see BF16_ROUTED).
    c = compare(label, _only(ref, False), _only(got, False), record=fault is None)
    routed = compare(label + " (MoE layers)", _only(ref, True), _only(got, True), record=fault is None)
    return c, problems + c.failures(_tolerance(cell["dtype"])) + routed.failures(_tolerance(cell["dtype"], routed=True))


def _only(record, routed: bool):
    """The record with the MoE layers' tensors alone, or every other tensor."""
    def pick(d):
        return None if d is None else {k: v for k, v in d.items() if _routed(k) == routed}

    return dataclasses.replace(record, first_grads=pick(record.first_grads), state=pick(record.state))


# The faults of testing/faults.py that were once the engine's behaviour where two features meet,
# and the cells each can show in: the covering set must catch every one.
FAULT_CELLS = {
    "fp16-scale-times-dp-cp": lambda c: c["dtype"] == "fp16" and (c["dp"] > 1 or c["cp"] != "none"),
    "adam-steps-from-training-step": lambda c: c["dtype"] == "fp16" and c["resume"],
    "moe-loads-per-cp-shard": lambda c: c["model"] == "moe" and c["cp"] != "none",
    "moe-loads-per-sp-shard": lambda c: c["model"] == "moe" and c["sp"],
    # The validation loss (--eval-every, at each cell's last step): the mistakes of a first evaluation loop.
    "eval-loss-not-averaged": lambda c: c["dp"] > 1 or c["cp"] != "none",
    "eval-rows-of-rank-0": lambda c: c["dp"] > 1,
}


# -- the docs' table ---------------------------------------------------------------
DOCS_BEGIN = "<!-- refused pairs: generated by `python -m ultrascale.testing.matrix --docs`; do not edit -->"
DOCS_END = "<!-- end of refused pairs -->"


def _value(f, v) -> str:
    return f if v is True else f"no {f}" if v is False else f"{f} {v}"


def refused_table() -> str:
    """The markdown table of every refused pair, with the engine's own line."""
    s = space()
    rows = ["| pair | refused with |", "| --- | --- |"]
    for (a, b), _, why in s.refused:
        rows.append(f"| {_value(*a)} + {_value(*b)} | {why.replace('|', '/')} |")
    fitting = sum(1 for t in _pairs() if _minimal(t) is not None)
    head = (f"{len(s.refused)} of the {fitting} "
            f"pairs of values that fit on {MAX_WORLD} ranks are refused before the run; the covering set runs the "
            f"others in {len(s.cells)} cells.")
    return "\n".join([DOCS_BEGIN, head, "", *rows, DOCS_END])


def update_docs(path: str) -> bool:
    """Rewrite the generated table in `path`; True when it changed."""
    text = open(path).read()
    start, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    new = text[:start] + refused_table() + text[end:]
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


def full_product():
    """Every valid cell of the whole product (`make matrix`): each value combination that fits on
    MAX_WORLD ranks, repaired to what it needs and not refused, once."""
    seen = set()
    for values in itertools.product(*FACTORS.values()):
        cell = dict(zip(FACTORS, values))
        if not needs_met(cell):
            continue
        key = tuple(cell.values())
        if key in seen:
            continue
        seen.add(key)
        if verdict(cell) is None:
            yield cell


def run_all(which: str, results: str, backend: str, shard: str = "1/1") -> int:
    """Run every cell of the covering set or of the full product (in a seeded random order, so a
    run stopped early has sampled the whole space evenly), one JSON line per cell appended to
    `results`; cells already there are skipped (a stopped run continues). shard "I/N" runs every
    N-th cell from the I-th, for N machines. Returns the number of failed cells."""
    import json
    import platform
    import time

    from ultrascale.testing.harness import shutdown_pools

    cells = list(space().cells if which == "covering" else full_product())
    random.Random(1).shuffle(cells)
    i, n = (int(x) for x in shard.split("/"))
    cells = cells[i - 1::n]
    done = set()
    if os.path.exists(results):
        with open(results) as f:
            done = {json.loads(line)["cell"] for line in f if line.strip()}
    todo = [c for c in cells if name(c) not in done]
    print(f"{which}: {len(cells)} cells in this shard, {len(cells) - len(todo)} already in {results}", flush=True)
    failed, start = 0, time.time()
    try:
        with open(results, "a") as out:
            for k, cell in enumerate(todo, 1):
                t = time.time()
                try:
                    c, problems = check_cell(cell, backend=backend)
                    line = c.line() if c is not None else ""
                except Exception as e:  # noqa: BLE001 - a crash is a failed cell, recorded
                    problems, line = [f"{type(e).__name__}: {str(e)[-400:]}"], ""
                failed += bool(problems)
                out.write(json.dumps({"cell": name(cell), "ok": not problems, "problems": problems, "line": line,
                                      "seconds": round(time.time() - t, 2), "backend": backend,
                                      "machine": platform.processor() or platform.machine()}) + "\n")
                out.flush()
                left = (time.time() - start) / k * (len(todo) - k)
                print(f"[{k}/{len(todo)}] {'ok  ' if not problems else 'FAIL'} {name(cell)} "
                      f"({time.time() - t:.1f} s; about {left / 3600:.1f} h left)", flush=True)
    finally:
        shutdown_pools()
    return failed


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m ultrascale.testing.matrix")
    p.add_argument("--docs", metavar="FILE", help="rewrite the refused pairs' table in FILE (docs/engine.md)")
    p.add_argument("--list", action="store_true", help="print the covering set's cells")
    p.add_argument("--count", action="store_true", help="count the valid cells of the whole product")
    p.add_argument("--run", choices=("covering", "full"), help="run every cell of the covering set or the product")
    p.add_argument("--results", default="matrix-results.jsonl", help="JSON lines, one per cell (appended)")
    p.add_argument("--backend", default=COMPILE_BACKEND, help="torch.compile's backend for compiled cells")
    p.add_argument("--shard", default="1/1", help="I/N: this machine's share of the cells")
    a = p.parse_args(argv)
    if a.run:
        return 1 if run_all(a.run, a.results, a.backend, a.shard) else 0
    if a.docs:
        print(("updated " if update_docs(a.docs) else "unchanged ") + a.docs)
    if a.list:
        for c in space().cells:
            print(name(c))
        print(f"{len(space().cells)} cells, {len(space().refused)} refused pairs, {len(space().outside)} outside")
    if a.count:
        print(sum(1 for _ in full_product()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
