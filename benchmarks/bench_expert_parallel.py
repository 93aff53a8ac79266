"""Expert parallelism: the all-gather dispatch against the all-to-all one, on gloo processes.

ep = dp = number of ranks. Both runners are the real `Trainer.train_step` with
`--ep N --dispatch allgather|alltoall`, from the same weights on the same batches
(dropless, so both compute the same thing: their losses are compared too).

Bytes moved: every collective of parallel/expert.py is wrapped to count what this
rank sends to the other ranks of its expert group during one step (forward and
backward): an all-to-all, the rows it sends to others; an all-gather of n bytes,
(ep - 1) n (each rank's piece reaches ep - 1 ranks, as in a ring); a
reduce-scatter of n bytes, (ep - 1) n / ep (a ring). The data-parallel gradient
reduction is the same for both and not counted.

Runners are interleaved (benchmarks/_common.py); a step's time is the slowest rank's.

    .venv/bin/python benchmarks/bench_expert_parallel.py --ep 2 4 --json /tmp/bench_ep.json

--vs-dense: experts at the speed of their FLOPs. `tiny-moe` (8 experts of width 64,
top-2) against `tiny`, the dense model with the same active FLOPs per token (its
MLP of width 128 = 2 x 64; the MoE adds only the router's h x E), each with the
trainer's defaults, in one process and at ep 2 (dp 2; the dense model dp 2); and
the same MoE with its experts run one after the other (`Experts._one_by_one`, the
loop the grouped matmul replaced), to measure that choice; at 2 processes also the
MoE data-parallel with every expert on every rank (no dispatch, the experts'
gradients all-reduced with the rest): the gap between it and ep 2 is what the
dispatch costs. Tokens per second relative to the dense model: the paired ratio
of step times, same tokens per step.

    .venv/bin/python benchmarks/bench_expert_parallel.py --vs-dense --json /tmp/bench_moe_dense.json

--waits: where the dispatch's time goes at ep 2. Every all-to-all of the dispatch is
timed on both ranks (called, returned; one monotonic clock): per call of a step,
how long the first rank to call it waited for the second, and how long the
collective took once both had; then the same steps with each all-to-all launched
and polled for completion instead of blocking in wait(), in rounds with blocking.

    .venv/bin/python benchmarks/bench_expert_parallel.py --waits --repeats 10 --steps 2 --json /tmp/waits.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402

KEYS = ["allgather", "alltoall"]


class _CountingDist:
    """torch.distributed as parallel/expert.py sees it, with all_to_all_single counted."""

    def __init__(self, dist, counter):
        self._dist, self._counter = dist, counter

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_to_all_single(self, out, inp, out_splits=None, in_splits=None, group=None):
        me, ep = self._dist.get_rank(group), self._dist.get_world_size(group)
        if in_splits is None:  # equal pieces (the counts per expert): all but this rank's own
            self._counter[0] += inp.numel() * inp.element_size() * (ep - 1) // ep
        else:
            row = inp.numel() // max(1, inp.shape[0]) * inp.element_size()
            self._counter[0] += (sum(in_splits) - in_splits[me]) * row
        return self._dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def count_bytes(counter):
    """Wrap the collectives of parallel/expert.py; counter[0] accumulates the bytes this rank sends."""
    import torch.distributed as dist

    from ultrascale.parallel import expert

    gather, scatter = expert._all_gather, expert._reduce_scatter

    def all_gather(out, inp, group=None):
        counter[0] += inp.numel() * inp.element_size() * (dist.get_world_size(group) - 1)
        return gather(out, inp, group=group)

    def reduce_scatter(out, inp, group=None):
        ep = dist.get_world_size(group)
        counter[0] += inp.numel() * inp.element_size() * (ep - 1) // ep
        return scatter(out, inp, group=group)

    expert.dist = _CountingDist(dist, counter)
    expert._all_gather, expert._reduce_scatter = all_gather, reduce_scatter


class Runner:
    def __init__(self, key: str, spec: dict, ep: int, counter):
        from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
        from ultrascale.model.config import ModelConfig
        from ultrascale.testing.harness import worker_context
        from ultrascale.train.trainer import Trainer

        self.key = self.label = key
        t = TrainConfig(steps=10**6, seq_len=spec["seq_len"], micro_batch=spec["micro_batch"], seed=spec["seed"],
                        device="cpu", progress=False, measure_activations=False)
        layout = ParallelConfig(dp=ep, ep=ep, dispatch=key)
        cfg = validate(RunConfig(model=ModelConfig(**spec["model"]), parallel=layout, train=t), ep)
        self.trainer, self.counter = Trainer(cfg, worker_context(cfg.parallel)), counter
        self.losses, self.bytes = [], []

    def step(self) -> float:
        before = self.counter[0]
        m = self.trainer.train_step()
        self.losses.append(m["loss"])
        self.bytes.append(self.counter[0] - before)
        return m["step_time_s"]


def ep_worker(spec: dict) -> dict:
    import torch.distributed as dist

    counter = [0]
    count_bytes(counter)
    runners = [Runner(k, spec, dist.get_world_size(), counter) for k in KEYS]
    times = common.interleave(runners, spec["warmup"], spec["repeats"], spec["steps"], dist.barrier)
    out = {"times": times, "losses": {r.key: r.losses for r in runners},
           "bytes": {r.key: max(r.bytes) for r in runners}}
    del runners
    gc.collect()
    return out


def bench(ep: int, spec: dict, timeout: float) -> list[dict]:
    from ultrascale.testing.harness import run_distributed

    start = time.perf_counter()
    per_rank = run_distributed(ep, ep_worker, spec, timeout=timeout)
    print(f"ep {ep}: {time.perf_counter() - start:.0f}s", flush=True)
    times, rounds = common.combine([r["times"] for r in per_rank], spec["steps"])
    rows = []
    for k in KEYS:
        rows.append({"ep": ep, "dispatch": k, **common.summary(times[k]), "step_times_s": times[k],
                     "bytes_per_rank": max(r["bytes"][k] for r in per_rank),
                     "paired_vs_alltoall": common.paired_ratio(rounds, k, "alltoall"),
                     "loss_max_rel_diff": common.max_rel_diff(per_rank[0]["losses"][k],
                                                              per_rank[0]["losses"]["alltoall"])})
    return rows


class DenseOrMoE:
    """One runner of --vs-dense: `tiny` or `tiny-moe` (grouped, or its experts one by one)."""

    def __init__(self, label: str, spec: dict, world: int):
        from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
        from ultrascale.model import get_preset
        from ultrascale.model.moe import Experts
        from ultrascale.testing.harness import worker_context
        from ultrascale.train.trainer import Trainer

        self.label = label
        t = TrainConfig(steps=10**6, seq_len=spec["seq_len"], micro_batch=spec["micro_batch"], seed=spec["seed"],
                        progress=False)
        moe = label != "dense"
        # "no dispatch": the MoE data-parallel with every expert on every rank, no all-to-all: what
        # the dispatch costs at ep = world is the gap between this runner and "moe".
        layout = ParallelConfig(dp=world, ep=world if moe and label != NO_DISPATCH else 1)
        cfg = validate(RunConfig(model=get_preset("tiny-moe" if moe else "tiny"), parallel=layout, train=t), world)
        self.trainer = Trainer(cfg, worker_context(cfg.parallel))
        if label == "moe, experts one by one":
            for m in self.trainer.model.modules():
                if isinstance(m, Experts):
                    m.forward = lambda x, counts, m=m: m._one_by_one(x, counts.tolist())
        self.losses = []

    def step(self) -> float:
        m = self.trainer.train_step()
        self.losses.append(m["loss"])
        return m["step_time_s"]


NO_DISPATCH = "moe, every expert on every rank (no dispatch)"
DENSE_KEYS = ["dense", "moe", "moe, experts one by one"]


def dense_keys(world: int) -> list[str]:
    return DENSE_KEYS + ([NO_DISPATCH] if world > 1 else [])


def dense_worker(spec: dict) -> dict:
    import torch.distributed as dist

    runners = [DenseOrMoE(k, spec, dist.get_world_size()) for k in dense_keys(dist.get_world_size())]
    times = common.interleave(runners, spec["warmup"], spec["repeats"], spec["steps"], dist.barrier)
    out = {"times": times, "losses": {r.label: r.losses for r in runners}}
    del runners
    gc.collect()
    return out


def bench_vs_dense(world: int, spec: dict, timeout: float) -> list[dict]:
    from ultrascale.testing.harness import run_distributed

    start = time.perf_counter()
    per_rank = run_distributed(world, dense_worker, spec, timeout=timeout)
    print(f"world {world}: {time.perf_counter() - start:.0f}s", flush=True)
    times, rounds = common.combine([r["times"] for r in per_rank], spec["steps"])
    tokens = world * spec["micro_batch"] * spec["seq_len"]
    return [{"world": world, "runner": k, **common.summary(times[k]), "step_times_s": times[k],
             "tokens_per_s": tokens / common.summary(times[k])["median_s"],
             "tokens_per_s_vs_dense": 1 / common.paired_ratio(rounds, k, "dense"),
             "tokens_per_s_vs_grouped": 1 / common.paired_ratio(rounds, k, "moe")} for k in dense_keys(world)]


def main_vs_dense(args, machine, command) -> None:
    from ultrascale.testing.harness import shutdown_pools

    spec = {k: getattr(args, k) for k in ("seq_len", "micro_batch", "warmup", "repeats", "steps", "seed")}
    rows = []
    try:
        for world in (1, 2):
            rows += bench_vs_dense(world, spec, args.timeout)
    finally:
        shutdown_pools()
    machine["loadavg_end"] = os.getloadavg()
    lines = [f"Command: `{command}`", "", common.machine_line(machine),
             f"`tiny-moe` (8 experts of width 64, top-2, aux loss 0.01) against `tiny` (MLP width 128: the same "
             f"active FLOPs per token), the trainer's defaults (fp32, activation meter on); per rank "
             f"{args.micro_batch} x {args.seq_len} tokens; 1 process, then ep 2 = dp 2 (the dense model dp 2). "
             f"Median [quartiles] over {args.repeats} interleaved rounds of {args.steps} steps; ratios paired "
             f"by round.", "",
             "| processes | model | step time (s) | tokens/s | tokens/s vs dense | vs grouped experts |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['runner']} | {common.fmt_time(r)} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s_vs_dense']:.2f}x | {r['tokens_per_s_vs_grouped']:.2f}x |")
    print("\n" + "\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": machine, "spec": spec, "rows": rows}, f, indent=1)


# -- --waits: where the dispatch's time goes at ep 2 ---------------------------------
def waits_worker(spec: dict) -> dict:
    """tiny-moe at ep = world with the trainer's defaults; every all-to-all of parallel/expert.py
    timed on this rank: when it was called and when it returned (time.monotonic: one clock for the
    processes of this machine)."""
    import torch.distributed as dist

    from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
    from ultrascale.model import get_preset
    from ultrascale.parallel import expert
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import Trainer

    calls, polling = [], [False]  # calls: (called, returned) of the blocking steps

    class Timed:
        def __getattr__(self, name):
            return getattr(dist, name)

        def all_to_all_single(self, *args, **kwargs):
            called = time.monotonic()
            if polling[0]:  # launch, then poll for completion instead of sleeping in wait()
                work = dist.all_to_all_single(*args, **kwargs, async_op=True)
                while not work.is_completed():
                    os.sched_yield()
                work.wait()
            else:
                dist.all_to_all_single(*args, **kwargs)
                calls.append((called, time.monotonic()))

    world = dist.get_world_size()
    t = TrainConfig(steps=10**6, seq_len=spec["seq_len"], micro_batch=spec["micro_batch"], seed=spec["seed"],
                    progress=False)
    cfg = validate(RunConfig(model=get_preset("tiny-moe"), parallel=ParallelConfig(dp=world, ep=world), train=t),
                   world)
    trainer = Trainer(cfg, worker_context(cfg.parallel))
    expert.dist = Timed()
    try:
        for _ in range(spec["warmup"]):
            trainer.train_step()
        dist.barrier()
        calls.clear()
        steps = [trainer.train_step()["step_time_s"] for _ in range(spec["repeats"] * spec["steps"])]
        timed = list(calls)  # the rounds below are timed step by step only
        # The same steps with each all-to-all polled: rounds of blocking and polling in turn.
        polled, blocking = [], []
        for _ in range(spec["repeats"]):
            for poll, times in ((True, polled), (False, blocking)):
                polling[0] = poll
                dist.barrier()
                times += [trainer.train_step()["step_time_s"] for _ in range(spec["steps"])]
    finally:
        expert.dist = dist
    return {"calls": timed, "steps": steps, "polled": polled, "blocking": blocking}


def main_waits(args, machine, command) -> None:
    """Per all-to-all of a step (in call order): how long the earlier rank waited for the later one
    to call it, and how long it took once both had (the later call to the first return)."""
    from ultrascale.testing.harness import run_distributed, shutdown_pools

    spec = {k: getattr(args, k) for k in ("seq_len", "micro_batch", "warmup", "repeats", "steps", "seed")}
    try:
        per_rank = run_distributed(2, waits_worker, spec, timeout=args.timeout)
    finally:
        shutdown_pools()
    n_steps = len(per_rank[0]["steps"])
    per_step = len(per_rank[0]["calls"]) // n_steps
    rows = []
    for j in range(per_step):
        both = [(a, b) for a, b in zip(per_rank[0]["calls"][j::per_step], per_rank[1]["calls"][j::per_step])]
        wait = [abs(a[0] - b[0]) for a, b in both]
        done = [min(a[1], b[1]) - max(a[0], b[0]) for a, b in both]
        inside = [(a[1] - a[0] + b[1] - b[0]) / 2 for a, b in both]
        rows.append({"call": j, "wait_ms": 1e3 * statistics.median(wait), "collective_ms": 1e3 * statistics.median(done),
                     "inside_ms": 1e3 * statistics.median(inside)})
    def slowest(key):
        return [max(a, b) for a, b in zip(per_rank[0][key], per_rank[1][key])]

    step = statistics.median(slowest("steps"))
    polled, blocking = slowest("polled"), slowest("blocking")
    n = spec["steps"]
    paired = statistics.median(statistics.fmean(blocking[i:i + n]) / statistics.fmean(polled[i:i + n])
                               for i in range(0, len(polled), n))
    machine["loadavg_end"] = os.getloadavg()
    lines = [f"Command: `{command}`", "", common.machine_line(machine),
             f"`tiny-moe` at ep 2 (dp 2), the trainer's defaults, per rank {args.micro_batch} x {args.seq_len} tokens; "
             f"{n_steps} steps after {args.warmup} warm-up; {per_step} all-to-alls a step; medians over the steps. "
             f"Step {1e3 * step:.1f} ms.", "",
             "| call | waiting for the other rank (ms) | the collective once both called (ms) | "
             "inside the call, mean of the ranks (ms) |", "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['call']} | {r['wait_ms']:.2f} | {r['collective_ms']:.2f} | {r['inside_ms']:.2f} |")
    lines.append(f"| all | {sum(r['wait_ms'] for r in rows):.2f} | {sum(r['collective_ms'] for r in rows):.2f} | "
                 f"{sum(r['inside_ms'] for r in rows):.2f} |")
    lines += ["", f"Each all-to-all launched and then polled (`is_completed()` with `os.sched_yield()`) instead of "
              f"blocking in `wait()`, {args.repeats} rounds of {n} steps in turn with blocking: step "
              f"{1e3 * statistics.median(polled):.1f} ms polled, {1e3 * statistics.median(blocking):.1f} ms "
              f"blocking; blocking over polled, paired by round: {paired:.2f}x."]
    print("\n" + "\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": machine, "spec": spec, "rows": rows, "step_s": step,
                       "polled_s": polled, "blocking_s": blocking, "blocking_over_polled": paired,
                       "per_rank": per_rank}, f, indent=1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-ffn-hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, help="default 128 (--vs-dense: the trainer's, 64)")
    p.add_argument("--micro-batch", type=int, help="default 8 (--vs-dense: the trainer's, 8)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--vs-dense", action="store_true", help="tiny-moe against the dense model of its active FLOPs "
                   "(1 process and ep 2; --seq-len and --micro-batch default to the trainer's 64 and 8)")
    p.add_argument("--waits", action="store_true", help="time each all-to-all of tiny-moe at ep 2 on both ranks: "
                   "the wait for the other rank, and the collective itself")
    args = p.parse_args(argv)
    if args.waits or args.vs_dense:  # the trainer's own model shapes and batch
        from ultrascale.config import TrainConfig

        args.seq_len = args.seq_len or TrainConfig.seq_len
        args.micro_batch = args.micro_batch or TrainConfig.micro_batch
        machine, command = common.machine_info(), common.command_line()
        print(f"{machine['cpu']} | {machine['cores']} cores | torch {machine['torch']}\n{command}", flush=True)
        return (main_waits if args.waits else main_vs_dense)(args, machine, command)

    from ultrascale.model.config import ModelConfig, count_params
    from ultrascale.testing.harness import shutdown_pools

    args.seq_len, args.micro_batch = args.seq_len or 128, args.micro_batch or 8
    model = ModelConfig(name="bench-moe", hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                        ffn_hidden=4 * args.hidden, experts=args.experts, top_k=args.top_k,
                        moe_ffn_hidden=args.moe_ffn_hidden, max_seq_len=max(256, args.seq_len))
    spec = {"model": dataclasses.asdict(model), **{k: getattr(args, k) for k in (
        "seq_len", "micro_batch", "warmup", "repeats", "steps", "seed")}}
    machine, command = common.machine_info(), common.command_line()
    print(f"{machine['cpu']} | {machine['cores']} cores | torch {machine['torch']}\n{command}", flush=True)
    rows = []
    try:
        for ep in args.ep:
            rows += bench(ep, spec, args.timeout)
    finally:
        shutdown_pools()
    machine["loadavg_end"] = os.getloadavg()
    lines = [f"Command: `{command}`", "", common.machine_line(machine),
             f"Model: hidden {args.hidden}, {args.layers} MoE layers of {args.experts} experts (ffn "
             f"{args.moe_ffn_hidden}), top-{args.top_k}: {count_params(model) / 1e6:.2f}M parameters. Per rank "
             f"{args.micro_batch} x {args.seq_len} tokens, fp32, dp = ep. Median [quartiles] over all timed steps.", "",
             "| ep | dispatch | step time (s) | vs all-to-all (paired) | MB sent per rank per step | loss rel diff |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['ep']} | {r['dispatch']} | {common.fmt_time(r)} | {r['paired_vs_alltoall']:.2f}x | "
                     f"{r['bytes_per_rank'] / 2**20:.2f} | {r['loss_max_rel_diff']:.1e} |")
    print("\n" + "\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": machine, "spec": spec, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
