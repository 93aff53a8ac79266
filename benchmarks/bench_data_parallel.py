"""Data parallelism and ZeRO of ultrascale against PyTorch DDP and FSDP2, on gloo processes.

Every runner trains the same model, from the same initial weights, on the same
batches, with the same recipe (fp32, AdamW (`build_adamw`, fused) with our decay groups,
gradient clipping at --grad-clip, our learning-rate schedule):

- ours: the real `Trainer.train_step` with `--dp-mode naive | overlap | bucket`
  (`--bucket-mb`), or `--zero 1 | 2 | 3`; its own `step_time_s` (data draw to
  the weights copied back);
- DDP: `torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=--bucket-mb)`
  over the same process group, the loop of tests/test_data_parallel.py's peer:
  forward, fp32 cross-entropy, backward, `torch.nn.utils.clip_grad_norm_`,
  AdamW, `zero_grad`; timed over the same span as ours;
- FSDP2: `fully_shard` on every block, then on the root (`reshard_after_forward`
  left at its default, True: parameters gathered again for backward, as our
  ZeRO-3 does), same loop. `fsdp2-keep` (optional) is FSDP2 with
  `reshard_after_forward=False`, the ZeRO-2-like setting.

Phases: `dp` runs naive, overlap, bucket and DDP; `zero` runs ZeRO-1, -2, -3 and
FSDP2; each phase in one set of processes, runners interleaved (benchmarks/_common.py).
A step's time is the slowest rank's.

Overlap (phase dp, after the timed rounds): --profile-steps more steps per
runner, each under torch.profiler. Gloo runs every collective on the process group's own worker
threads, and the profiler records each as a `gloo:*` event on that thread,
spanning the collective's execution there. Markers on the main thread give the
end of forward (= start of backward), the moment the last gradient is
accumulated (= end of backward compute) and the end of the gradient sync
(`finish()` for ours; `backward()` returning, for DDP, whose reducer waits for
its buckets at the end of backward). With U the union of the gradient
collectives' intervals: hidden = |U within backward|, exposed = |U after the
last gradient|, hidden fraction = hidden / |U|; "wait" = sync end - last gradient,
what the step pays after backward.

    .venv/bin/python benchmarks/bench_data_parallel.py --world 2 4 --json /tmp/bench_dp.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402

PHASES = {"dp": ["naive", "overlap", "bucket", "ddp"], "zero": ["zero1", "zero2", "zero3", "fsdp2"]}
PEER_OF = {"naive": "ddp", "overlap": "ddp", "bucket": "ddp", "zero1": "fsdp2", "zero2": "fsdp2", "zero3": "fsdp2"}
OURS = {"naive": ("naive", 0), "overlap": ("overlap", 0), "bucket": ("bucket", 0),
        "zero1": ("bucket", 1), "zero2": ("bucket", 2), "zero3": ("bucket", 3)}
LABELS = {"naive": "ours naive", "overlap": "ours overlap", "bucket": "ours bucket", "ddp": "PyTorch DDP",
          "zero1": "ours ZeRO-1", "zero2": "ours ZeRO-2", "zero3": "ours ZeRO-3", "fsdp2": "PyTorch FSDP2",
          "fsdp2-keep": "PyTorch FSDP2, reshard_after_forward=False"}


def run_config(spec: dict, world: int, mode: str = "bucket", zero: int = 0):
    from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
    from ultrascale.model.config import ModelConfig

    model = ModelConfig(**spec["model"])
    p = ParallelConfig(dp=world, dp_mode=mode, zero=zero, bucket_mb=spec["bucket_mb"])
    t = TrainConfig(steps=10**6, seq_len=spec["seq_len"], micro_batch=spec["micro_batch"],
                    grad_accum=spec["grad_accum"], grad_clip=spec["grad_clip"], seed=spec["seed"], device="cpu",
                    progress=False, measure_activations=spec["measure_activations"])
    return validate(RunConfig(model=model, parallel=p, train=t), world)


def _mark(name: str) -> None:
    """A zero-length event in the profiler trace, on this thread."""
    with torch.profiler.record_function(name):
        pass


class _Markers:
    """While profiling: mark the end of forward and every gradient accumulated."""

    def __init__(self, module, params):
        self.handles = [module.register_forward_hook(lambda m, a, out: _mark("bench:forward_end"))]
        self.handles += [p.register_post_accumulate_grad_hook(lambda p: _mark("bench:grad_ready")) for p in params]

    def remove(self):
        for h in self.handles:
            h.remove()


class Ours:
    def __init__(self, key: str, spec: dict, world: int):
        from ultrascale.testing.harness import worker_context
        from ultrascale.train.trainer import Trainer

        self.key, self.label = key, LABELS[key]
        cfg = run_config(spec, world, *OURS[key])
        self.trainer = Trainer(cfg, worker_context(cfg.parallel))
        self.losses: list[float] = []

    def step(self) -> float:
        m = self.trainer.train_step()
        self.losses.append(m["loss"])
        return m["step_time_s"]

    @contextlib.contextmanager
    def markers(self):
        grads = self.trainer.grads
        finish = grads.finish

        def marked_finish():
            finish()
            _mark("bench:sync_end")

        grads.finish = marked_finish
        marks = _Markers(self.trainer.model, grads.params)
        try:
            yield
        finally:
            marks.remove()
            del grads.finish


class Peer:
    """DDP or FSDP2 around our model, trained by the loop of tests/test_data_parallel.py's peer."""

    def __init__(self, key: str, spec: dict, world: int):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        from ultrascale.model import build_model
        from ultrascale.testing.harness import worker_context
        from ultrascale.train.data import TokenBatches, load_tokens
        from ultrascale.train.optim import build_adamw

        self.key, self.label = key, LABELS[key]
        cfg = self.cfg = run_config(spec, world)
        t = cfg.train
        self.ctx = worker_context(cfg.parallel)
        self.model = build_model(cfg.model, t.seed)
        if key == "ddp":
            self.wrapped = DistributedDataParallel(self.model, process_group=self.ctx.group("dp_cp"),
                                                   bucket_cap_mb=cfg.parallel.bucket_mb)
            self.no_sync = self.wrapped.no_sync
        else:
            mesh = DeviceMesh.from_group(self.ctx.group("dp_cp"), "cpu")
            reshard = key == "fsdp2"
            for block in self.model.layers.values():
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            self.wrapped = fully_shard(self.model, mesh=mesh, reshard_after_forward=reshard)
            self.no_sync = contextlib.nullcontext  # FSDP2 reduce-scatters every micro-batch, as our ZeRO-3 does
        self.params = list(self.model.parameters())
        self.opt = build_adamw(self.params, [p.ndim >= 2 for p in self.params], t)
        self.data = TokenBatches(load_tokens(t.data), t.seq_len, cfg.global_batch, t.seed)
        self.steps, self.losses, self.profiling = 0, [], False

    def step(self) -> float:
        from ultrascale.model import cross_entropy_loss
        from ultrascale.train.optim import lr_at

        cfg, t = self.cfg, self.cfg.train
        start = time.perf_counter()
        micro = self.data.micro_batches(self.steps, self.ctx.coords["dp"], cfg.parallel.dp, t.grad_accum)
        self.opt.zero_grad()
        total = 0.0
        for j, (x, y) in enumerate(micro):
            with self.no_sync() if j < len(micro) - 1 else contextlib.nullcontext():
                loss = cross_entropy_loss(self.wrapped(x), y)
                (loss / len(micro)).backward()
            total += loss.item()
        if self.profiling:
            _mark("bench:sync_end")  # DDP waits for its buckets at the end of backward
        torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.steps, t)
        self.opt.step()
        elapsed = time.perf_counter() - start
        self.steps += 1
        self.losses.append(self.ctx.all_reduce_mean(total / len(micro)))
        return elapsed

    @contextlib.contextmanager
    def markers(self):
        marks = _Markers(self.model, self.params)
        self.profiling = True
        try:
            yield
        finally:
            self.profiling = False
            marks.remove()


def make_runner(key, spec, world):
    return Peer(key, spec, world) if key in ("ddp", "fsdp2", "fsdp2-keep") else Ours(key, spec, world)


# -- overlap, from a profiler trace -------------------------------------------
def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _clip(union, lo, hi) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in union)


def overlap_of(runner) -> dict:
    """One profiled step; times in milliseconds, on the profiler's clock."""
    from torch.profiler import ProfilerActivity, profile

    with runner.markers(), profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step()
    ev = [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in prof.events()]
    bwd_start = min(s for n, s, _ in ev if n == "bench:forward_end")
    last_grad = max(s for n, s, _ in ev if n == "bench:grad_ready")
    sync_end = min(s for n, s, _ in ev if n == "bench:sync_end")
    comm = [(s, e) for n, s, e in ev if n.startswith("gloo:") and bwd_start <= s < sync_end]
    u = _union(comm)
    busy = _clip(u, bwd_start, float("inf"))
    hidden = _clip(u, bwd_start, last_grad)
    return {"backward_ms": last_grad - bwd_start, "comm_busy_ms": busy, "comm_sum_ms": sum(e - s for s, e in comm),
            "collectives": len(comm), "hidden_ms": hidden, "exposed_ms": busy - hidden,
            "hidden_fraction": hidden / busy if busy else float("nan"), "wait_ms": sync_end - last_grad}


# -- one phase, on every rank ----------------------------------------------------
def phase_worker(keys: list[str], spec: dict, profile_steps: int) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size()
    runners = [make_runner(k, spec, world) for k in keys]
    times = common.interleave(runners, spec["warmup"], spec["repeats"], spec["steps"], dist.barrier)
    overlap = {}
    for r in runners:
        if profile_steps and r.key in ("naive", "overlap", "bucket", "ddp"):
            per_step = []
            for _ in range(profile_steps):
                dist.barrier()
                per_step.append(overlap_of(r))
            overlap[r.key] = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
    losses = {r.key: r.losses for r in runners}
    del runners
    gc.collect()
    return {"times": {LABELS[k]: times[LABELS[k]] for k in keys}, "overlap": overlap, "losses": losses}


def bench(world: int, phase: str, keys: list[str], spec: dict, args) -> dict:
    from ultrascale.testing.harness import run_distributed

    print(f"\nworld {world}, phase {phase}: {', '.join(LABELS[k] for k in keys)}", flush=True)
    start = time.perf_counter()
    per_rank = run_distributed(world, phase_worker, keys, spec, args.profile_steps if phase == "dp" else 0,
                               timeout=args.timeout)
    print(f"  {time.perf_counter() - start:.0f}s", flush=True)
    times, rounds = common.combine([r["times"] for r in per_rank], spec["steps"])
    rows = []
    for k in keys:
        lb = LABELS[k]
        row = {"world": world, "phase": phase, "key": k, "runner": lb, **common.summary(times[lb]),
               "step_times_s": times[lb], "losses": per_rank[0]["losses"][k]}
        peer = PEER_OF.get(k)
        if peer in keys:
            row["peer"] = LABELS[peer]
            row["ratio_vs_peer"] = row["median_s"] / statistics.median(times[LABELS[peer]])
            row["paired_ratio_vs_peer"] = common.paired_ratio(rounds, lb, LABELS[peer])
            losses = per_rank[0]["losses"]
            row["loss_max_rel_diff_vs_peer"] = common.max_rel_diff(losses[k], losses[peer])
        if phase == "dp" and k != "naive" and "naive" in keys:
            row["paired_ratio_vs_naive"] = common.paired_ratio(rounds, lb, LABELS["naive"])
        if k in per_rank[0]["overlap"]:
            ov = [r["overlap"][k] for r in per_rank]
            row["overlap"] = {m: statistics.fmean(o[m] for o in ov) for m in ov[0]}  # mean over ranks
        rows.append(row)
        print(f"  {lb}: median {row['median_s']:.3f}s", flush=True)
    return {"world": world, "phase": phase, "rows": rows}


# -- reporting -------------------------------------------------------------------
def markdown(results: list[dict], machine: dict, spec: dict, n_params: int, command: str) -> str:
    m = spec["model"]
    grad_mb = n_params * 4 / 2**20
    lines = [
        f"Command: `{command}`", "",
        common.machine_line(machine),
        f"Model: hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads ({m['kv_heads']} kv), ffn "
        f"{m['ffn_hidden']}, vocab {m['vocab_size']}: {n_params / 1e6:.2f}M parameters, {grad_mb:.1f} MiB of fp32 "
        f"gradients. Micro-batch {spec['micro_batch']} x {spec['seq_len']} tokens per rank, grad accum "
        f"{spec['grad_accum']}, bucket cap {spec['bucket_mb']} MB (ours and DDP), fp32, activation meter "
        f"{'on' if spec['measure_activations'] else 'off'}. {spec['warmup']} warm-up steps per runner, then "
        f"{spec['repeats']} interleaved rounds of {spec['steps']} steps; step time = slowest rank; median "
        f"[quartiles] over all timed steps.", "",
        "| ranks | runner | step time (s) | best (s) | ours/peer (medians) | ours/peer (paired) | vs naive (paired) "
        "| loss rel diff vs peer |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for r in res["rows"]:
            ratio = f"{r['ratio_vs_peer']:.3f}x" if "ratio_vs_peer" in r else "-"
            paired = f"{r['paired_ratio_vs_peer']:.3f}x" if "paired_ratio_vs_peer" in r else "-"
            naive = f"{r['paired_ratio_vs_naive']:.3f}x" if "paired_ratio_vs_naive" in r else "-"
            diff = f"{r['loss_max_rel_diff_vs_peer']:.1e}" if "loss_max_rel_diff_vs_peer" in r else "-"
            lines.append(f"| {r['world']} | {r['runner']} | {common.fmt_time(r)} | {r['min_s']:.3f} | {ratio} | "
                         f"{paired} | {naive} | {diff} |")
    ov_rows = [r for res in results for r in res["rows"] if "overlap" in r]
    if ov_rows:
        lines += ["", "Overlap of the gradient collectives with backward, in milliseconds: each figure is the "
                  "median over the profiled steps of that runner, then the mean over ranks (medians taken figure "
                  "by figure, so hidden + exposed need not add up to busy exactly):", "",
                  "| ranks | runner | backward compute | collectives | comm busy (union) | hidden | exposed "
                  "| hidden fraction | wait after backward |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in ov_rows:
            o = r["overlap"]
            lines.append(f"| {r['world']} | {r['runner']} | {o['backward_ms']:.0f} | {o['collectives']:.0f} | "
                         f"{o['comm_busy_ms']:.0f} | {o['hidden_ms']:.0f} | {o['exposed_ms']:.0f} | "
                         f"{100 * o['hidden_fraction']:.0f}% | {o['wait_ms']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="numbers of ranks (default: 2 4)")
    p.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES))
    p.add_argument("--fsdp2-keep", action="store_true",
                   help="add FSDP2 with reshard_after_forward=False to the zero phase")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn-hidden", type=int, default=1408)
    p.add_argument("--vocab-size", type=int, default=257)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--measure-activations", action="store_true",
                   help="keep our trainer's activation meter on (off by default: the peers do not measure)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per runner first")
    p.add_argument("--repeats", type=int, default=6, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=2, help="steps per runner per round")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps per runner for the overlap table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per phase before the ranks are killed")
    p.add_argument("--json", metavar="OUT", help="write every step time, loss and overlap figure here")
    args = p.parse_args(argv)

    from ultrascale.model.config import ModelConfig, count_params
    from ultrascale.testing.harness import shutdown_pools

    model = ModelConfig(name="bench", vocab_size=args.vocab_size, hidden=args.hidden, layers=args.layers,
                        heads=args.heads, kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden,
                        max_seq_len=max(256, args.seq_len))
    spec = {"model": dataclasses.asdict(model), **{k: getattr(args, k) for k in (
        "seq_len", "micro_batch", "grad_accum", "bucket_mb", "grad_clip", "measure_activations", "warmup",
        "repeats", "steps", "seed")}}
    machine = common.machine_info()
    command = common.command_line()
    print(f"{machine['cpu']} | {machine['cores']} cores | torch {machine['torch']}\n{command}", flush=True)
    results = []
    try:
        for world in args.world:
            for phase in args.phases:
                keys = PHASES[phase] + (["fsdp2-keep"] if phase == "zero" and args.fsdp2_keep else [])
                results.append(bench(world, phase, keys, spec, args))
    finally:
        shutdown_pools()
    machine["loadavg_end"] = os.getloadavg()
    table = markdown(results, machine, spec, count_params(model), command)
    print("\n" + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": machine, "spec": spec, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
