"""Context parallelism on the CPU: step time, per-rank attention time and activations of the four variants.

Each configuration trains the same model on the same long sequences with the
real `Trainer.train_step` (micro-batch 1, fp32, one process per cp rank, no
data parallelism: every rank holds a shard of the same sequence), at cp 1 (the
single-process run, attention by scaled_dot_product_attention) and at each
--cp size for allgather, ring, zigzag and ulysses. Measured per rank:

- step time: a step ends when its slowest rank ends; median over the timed steps;
- attention time: forward + backward of this rank's attention computation per
  step, communication excluded. For allgather, ring and zigzag that is the
  per-block attention (blocks.block_forward / block_backward, timed around each call);
  for ulysses and cp 1 it is scaled_dot_product_attention and its backward
  (timed by identity autograd functions on its output and its query input);
- attention work: (query, key) score elements computed by the blocks
  (blocks.WORK; a diagonal block counts whole, as it is computed whole);
- activations: the trainer's meter (bytes autograd keeps for backward, per micro-batch).

PyTorch's own `context_parallel` is not a peer on this machine: it replaces
only the CUDA SDPA kernels (flash, memory-efficient, cuDNN), and CPU attention
runs `_scaled_dot_product_flash_attention_for_cpu`.

    .venv/bin/python benchmarks/bench_context_parallel.py --cp 2 4 --seq-len 4096 --repeats 3 --json /tmp/bench_cp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402

VARIANTS = ("allgather", "ring", "zigzag", "ulysses")


class AttentionClock:
    """Seconds spent computing attention on this rank, and the patches that measure them."""

    def __init__(self):
        self.seconds, self._backward_start = 0.0, None

    def timed(self, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return out
        return call

    def mark(self, end: bool) -> None:
        now = time.perf_counter()
        if end and self._backward_start is not None:
            self.seconds += now - self._backward_start
            self._backward_start = None
        elif not end:
            self._backward_start = now

    def sdpa(self, sdpa):
        """SDPA timed forward, and backward from its output's gradient to its query's."""
        clock = self

        class Mark(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, end):
                ctx.end = end
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                clock.mark(ctx.end)
                return grad, None

        def call(q, k, v, **kwargs):
            out = self.timed(sdpa)(Mark.apply(q, True), k, v, **kwargs)
            return Mark.apply(out, False)
        return call


def run_config(spec: dict, cp: int, variant: str):
    from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
    from ultrascale.model import get_preset

    model = get_preset(spec["model"], max_seq_len=spec["seq_len"], **spec["overrides"])
    t = TrainConfig(steps=10**6, seq_len=spec["seq_len"], micro_batch=1, seed=spec["seed"], progress=False)
    return RunConfig(model=model, parallel=ParallelConfig(cp=cp, cp_attention=variant), train=t)


def cp_worker(variant: str, spec: dict) -> dict:
    from unittest import mock

    import torch.distributed as dist
    import torch.nn.functional as F

    from ultrascale.config import validate
    from ultrascale.parallel.context import blocks
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import Trainer

    cp = dist.get_world_size()
    cfg = validate(run_config(spec, cp, variant), cp)
    clock = AttentionClock()
    with mock.patch.object(blocks, "block_forward", clock.timed(blocks.block_forward)), \
            mock.patch.object(blocks, "block_backward", clock.timed(blocks.block_backward)), \
            mock.patch.object(F, "scaled_dot_product_attention", clock.sdpa(F.scaled_dot_product_attention)):
        trainer = Trainer(cfg, worker_context(cfg.parallel))
        for _ in range(spec["warmup"]):
            trainer.train_step()
        clock.seconds = 0.0
        blocks.WORK.clear()
        steps = []
        for _ in range(spec["steps"]):
            dist.barrier()
            steps.append(trainer.train_step())
    return {"step_s": [m["step_time_s"] for m in steps], "losses": [m["loss"] for m in steps],
            "attention_s": clock.seconds / spec["steps"],
            "work": (blocks.WORK["forward"] + blocks.WORK["backward"]) // spec["steps"],
            "activations": steps[-1]["memory"]["activations"]}


def bench(cp: int, variant: str, spec: dict, timeout: float) -> dict:
    from ultrascale.testing.harness import run_distributed

    start = time.perf_counter()
    per_rank = run_distributed(cp, cp_worker, variant, spec, timeout=timeout)
    step = [max(ts) for ts in zip(*(r["step_s"] for r in per_rank))]
    row = {"cp": cp, "variant": variant if cp > 1 else "(one process)", "step_s": statistics.median(step),
           "step_times_s": step, "losses": per_rank[0]["losses"],
           "attention_s": [r["attention_s"] for r in per_rank], "work": [r["work"] for r in per_rank],
           "activations": [r["activations"] for r in per_rank]}
    print(f"  cp {cp} {row['variant']}: step {row['step_s']:.2f}s, attention per rank "
          f"{', '.join(f'{a:.2f}' for a in row['attention_s'])}s ({time.perf_counter() - start:.0f}s)", flush=True)
    return row


def merge_repeats(rows: list[dict]) -> dict:
    """One row from the repeats of a configuration: the median over all their timed steps, and per
    rank the median attention time."""
    step = [t for r in rows for t in r["step_times_s"]]
    att = [statistics.median(ts) for ts in zip(*(r["attention_s"] for r in rows))]
    return {**rows[0], "step_s": statistics.median(step), "step_times_s": step, "attention_s": att,
            "repeats": len(rows)}


def markdown(rows, machine, spec, command) -> str:
    lines = [
        f"Command: `{command}`", "",
        common.machine_line(machine),
        f"Model: `{spec['model']}` {spec['overrides'] or ''} at {spec['seq_len']} tokens per sequence, micro-batch "
        f"1, fp32, one process per cp rank; {spec['warmup']} warm-up step(s), then {spec['steps']} timed steps, "
        f"the whole sweep {spec['repeats']} time(s) over. Step time: the slowest rank's, median over all timed "
        f"steps; vs Ulysses: its ratio to Ulysses' step at the same cp in the same sweep, median over the "
        f"sweeps. Attention: this rank's forward + backward attention computation per step (communication "
        f"excluded; median over the sweeps). Work: score elements the blocks computed "
        f"per step (forward + backward; SDPA's are not counted).", "",
        "| cp | variant | step (s) | vs Ulysses | attention per rank (s) | slowest / fastest | work per rank (M) "
        "| activations per rank (MiB) |",
        "|---:|---|---:|---:|---|---:|---|---|",
    ]
    for r in rows:
        att = r["attention_s"]
        work = " / ".join(f"{w / 1e6:.1f}" for w in r["work"]) if any(r["work"]) else "-"
        act = " / ".join(f"{a / 2**20:.1f}" for a in r["activations"])
        vs = f"{r['vs_ulysses']:.2f}x" if r["vs_ulysses"] else "-"
        lines.append(f"| {r['cp']} | {r['variant']} | {r['step_s']:.2f} | {vs} | "
                     f"{' / '.join(f'{a:.2f}' for a in att)} | "
                     f"{max(att) / min(att):.2f}x | {work} | {act} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="context-parallel sizes (cp 1 always runs)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, help="override the preset's layers")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="run the whole sweep this many times (a shared machine)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)

    from ultrascale.testing.harness import shutdown_pools

    spec = {"model": args.model, "overrides": {"layers": args.layers} if args.layers else {},
            **{k: getattr(args, k) for k in ("seq_len", "warmup", "steps", "seed", "repeats")}}
    machine = common.machine_info()
    command = common.command_line()
    print(f"{machine['cpu']} | {machine['cores']} cores | torch {machine['torch']}\n{command}", flush=True)
    configs = [(1, "ring")] + [(cp, v) for cp in args.cp for v in args.variants]
    runs = {c: [] for c in configs}
    try:
        for _ in range(args.repeats):  # the whole sweep again: load that comes and goes falls on every row
            for cp, variant in configs:
                runs[(cp, variant)].append(bench(cp, variant, spec, args.timeout))
    finally:
        shutdown_pools()
    rows = [merge_repeats(r) for r in runs.values()]
    for (cp, variant), row in zip(runs, rows):  # paired: against Ulysses' step in the same sweep, median over sweeps
        uly = runs.get((cp, "ulysses"))
        row["vs_ulysses"] = statistics.median(a["step_s"] / u["step_s"] for a, u in zip(runs[(cp, variant)], uly)) \
            if uly and cp > 1 else None
    machine["loadavg_end"] = os.getloadavg()
    first = rows[0]["losses"]
    for r in rows:  # every layout trains the same sequences from the same weights: the same losses
        r["loss_max_rel_diff_vs_cp1"] = common.max_rel_diff(r["losses"], first)
    table = markdown(rows, machine, spec, command)
    print("\n" + table + "\n\nlargest loss difference to cp 1: "
          f"{max(r['loss_max_rel_diff_vs_cp1'] for r in rows):.1e} (relative)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": machine, "spec": spec, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
