"""Tensor (and sequence) parallelism of ultrascale against PyTorch DTensor TP, on gloo processes.

tp = number of ranks (no data parallelism). Every runner trains the same model
from the same initial weights on the same batches with the same recipe (fp32,
AdamW (`build_adamw`, fused) with our decay groups, clipping of the global gradient norm
at --grad-clip, our learning-rate schedule):

- ours: the real `Trainer.train_step` with `--tp N` (and `--sp`): Megatron
  column/row-parallel linears with one f/g (or SP all-gather/reduce-scatter)
  pair per attention and per MLP, a vocabulary-parallel embedding and head, and
  the vocabulary-parallel cross-entropy (logits never gathered);
- DTensor: `ultrascale.model.build_model` (the single-device model) transformed
  by `torch.distributed.tensor.parallel.parallelize_module` as torchtitan does
  for a Llama block:
    embed    RowwiseParallel(input_layouts=Replicate(), output_layouts=S)
    attn     PrepareModuleInput((S, None, None) -> (Replicate(), None, None))
    q/k/v    ColwiseParallel()      (use_local_output=True: the local heads,
                                     which the model's view(b, s, -1, head_dim) finds)
    o        RowwiseParallel(output_layouts=S)
    mlp      PrepareModuleInput((S,) -> (Replicate(),))
    gate/up  ColwiseParallel();  down RowwiseParallel(output_layouts=S)
    norms    SequenceParallel() with SP; plain replicated modules without
    head     ColwiseParallel(input_layouts=S, output_layouts=Shard(-1),
                             use_local_output=False)
  with S = Shard(1) under SP and Replicate() without; the loss is our fp32
  cross-entropy inside `loss_parallel()` (vocabulary-sharded logits, like ours).
  Without SP the PrepareModuleInput still makes q/k/v (gate/up) share one
  DTensor input, so their input gradients are summed as Partial and all-reduced
  once, as our one f does.
  Gradient clipping: `torch.nn.utils.clip_grad_norm_` refuses a mix of DTensor
  and plain parameters (the norms stay plain without SP), so the DTensor runners
  compute the global norm as ours does: squared norms of the local gradients
  (replicated ones weighted 1/tp), one scalar all-reduce, then scale.

Runners are interleaved (benchmarks/_common.py); a step's time is the slowest rank's.

    .venv/bin/python benchmarks/bench_tensor_parallel.py --tp 2 4 --json /tmp/bench_tp.json
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

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402

KEYS = ["ours-tp", "dtensor-tp", "ours-sp", "dtensor-sp"]
LABELS = {"ours-tp": "ours TP", "ours-sp": "ours TP+SP", "dtensor-tp": "DTensor TP", "dtensor-sp": "DTensor TP+SP"}
PEER_OF = {"ours-tp": "dtensor-tp", "ours-sp": "dtensor-sp"}


def run_config(spec: dict, tp: int, sp: bool):
    from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
    from ultrascale.model.config import ModelConfig

    model = ModelConfig(**spec["model"])
    p = ParallelConfig(dp=1, tp=tp, sp=sp)
    t = TrainConfig(steps=10**6, seq_len=spec["seq_len"], micro_batch=spec["micro_batch"],
                    grad_accum=spec["grad_accum"], grad_clip=spec["grad_clip"], seed=spec["seed"], device="cpu",
                    progress=False, measure_activations=spec["measure_activations"])
    return validate(RunConfig(model=model, parallel=p, train=t), tp)


class Ours:
    def __init__(self, key: str, spec: dict, tp: int):
        from ultrascale.testing.harness import worker_context
        from ultrascale.train.trainer import Trainer

        self.key, self.label = key, LABELS[key]
        cfg = run_config(spec, tp, key.endswith("sp"))
        self.trainer = Trainer(cfg, worker_context(cfg.parallel))
        self.losses: list[float] = []

    def step(self) -> float:
        m = self.trainer.train_step()
        self.losses.append(m["loss"])
        return m["step_time_s"]


def parallelize(model, mesh, sp: bool):
    """The torchtitan-style DTensor plan for our Transformer (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sp else Replicate()
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        plan = {
            "attn": PrepareModuleInput(input_layouts=(seq, None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.q_proj": ColwiseParallel(use_local_output=True),
            "attn.k_proj": ColwiseParallel(use_local_output=True),
            "attn.v_proj": ColwiseParallel(use_local_output=True),
            "attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=True),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(use_local_output=True),
            "mlp.up_proj": ColwiseParallel(use_local_output=True),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=True),
        }
        if sp:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        parallelize_module(block, mesh, plan)
    return model


@torch.no_grad()
def clip_global_norm_(params, max_norm: float, group, tp: int) -> float:
    """The global gradient norm from local shards (replicated gradients counted once), then clip."""
    from torch.distributed.tensor import DTensor

    sq = torch.zeros(())
    locals_ = []
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            share = 1.0 if any(pl.is_shard() for pl in g.placements) else 1.0 / tp
            g = g.to_local()
        else:
            share = 1.0 / tp
        locals_.append(g)
        sq += g.pow(2).sum() * share
    torch.distributed.all_reduce(sq, group=group)
    norm = sq.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in locals_:
            g.mul_(coef)
    return norm


class DTensorTP:
    def __init__(self, key: str, spec: dict, tp: int):
        from torch.distributed.device_mesh import DeviceMesh

        from ultrascale.model import build_model
        from ultrascale.testing.harness import worker_context
        from ultrascale.train.data import TokenBatches, load_tokens
        from ultrascale.train.optim import build_adamw

        self.key, self.label, self.tp = key, LABELS[key], tp
        cfg = self.cfg = run_config(spec, tp, False)
        t = cfg.train
        self.ctx = worker_context(cfg.parallel)
        self.group = self.ctx.group("tp")
        mesh = DeviceMesh.from_group(self.group, "cpu")
        self.model = parallelize(build_model(cfg.model, t.seed), mesh, key.endswith("sp"))
        self.params = list(self.model.parameters())
        self.opt = build_adamw(self.params, [p.ndim >= 2 for p in self.params], t)
        self.data = TokenBatches(load_tokens(t.data), t.seq_len, cfg.global_batch, t.seed)
        self.steps, self.losses = 0, []

    def step(self) -> float:
        from torch.distributed.tensor.parallel import loss_parallel

        from ultrascale.model import cross_entropy_loss
        from ultrascale.train.optim import lr_at

        t = self.cfg.train
        start = time.perf_counter()
        micro = self.data.micro_batches(self.steps, 0, 1, t.grad_accum)
        self.opt.zero_grad()
        total = 0.0
        for x, y in micro:
            with loss_parallel():
                loss = cross_entropy_loss(self.model(x), y)
                (loss / len(micro)).backward()
            total += loss.detach().to_local().item()
        clip_global_norm_(self.params, t.grad_clip, self.group, self.tp)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.steps, t)
        self.opt.step()
        elapsed = time.perf_counter() - start
        self.steps += 1
        self.losses.append(total / len(micro))
        return elapsed


def make_runner(key, spec, tp):
    return Ours(key, spec, tp) if key.startswith("ours") else DTensorTP(key, spec, tp)


def tp_worker(keys: list[str], spec: dict) -> dict:
    import torch.distributed as dist

    tp = dist.get_world_size()
    runners = [make_runner(k, spec, tp) for k in keys]
    times = common.interleave(runners, spec["warmup"], spec["repeats"], spec["steps"], dist.barrier)
    losses = {r.key: r.losses for r in runners}
    del runners
    gc.collect()
    return {"times": times, "losses": losses}


def bench(tp: int, keys: list[str], spec: dict, args) -> dict:
    from ultrascale.testing.harness import run_distributed

    print(f"\ntp {tp}: {', '.join(LABELS[k] for k in keys)}", flush=True)
    start = time.perf_counter()
    per_rank = run_distributed(tp, tp_worker, keys, spec, timeout=args.timeout)
    print(f"  {time.perf_counter() - start:.0f}s", flush=True)
    times, rounds = common.combine([r["times"] for r in per_rank], spec["steps"])
    rows = []
    for k in keys:
        lb = LABELS[k]
        row = {"tp": tp, "key": k, "runner": lb, **common.summary(times[lb]), "step_times_s": times[lb],
               "losses": per_rank[0]["losses"][k]}
        peer = PEER_OF.get(k)
        if peer in keys:
            row["peer"] = LABELS[peer]
            row["ratio_vs_peer"] = row["median_s"] / statistics.median(times[LABELS[peer]])
            row["paired_ratio_vs_peer"] = common.paired_ratio(rounds, lb, LABELS[peer])
            losses = per_rank[0]["losses"]
            row["loss_max_rel_diff_vs_peer"] = common.max_rel_diff(losses[k], losses[peer])
        rows.append(row)
        print(f"  {lb}: median {row['median_s']:.3f}s", flush=True)
    return {"tp": tp, "rows": rows}


def markdown(results, machine, spec, n_params, command) -> str:
    m = spec["model"]
    lines = [
        f"Command: `{command}`", "",
        common.machine_line(machine),
        f"Model: hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads ({m['kv_heads']} kv), ffn "
        f"{m['ffn_hidden']}, vocab {m['vocab_size']}: {n_params / 1e6:.2f}M parameters. Batch {spec['micro_batch']} "
        f"x {spec['seq_len']} tokens (every rank of the TP group sees the same batch), grad accum "
        f"{spec['grad_accum']}, fp32, activation meter {'on' if spec['measure_activations'] else 'off'}. "
        f"{spec['warmup']} warm-up steps per runner, then {spec['repeats']} interleaved rounds of {spec['steps']} "
        f"steps; step time = slowest rank; median [quartiles] over all timed steps.", "",
        "| tp | runner | step time (s) | best (s) | ours/DTensor (medians) | ours/DTensor (paired) "
        "| loss rel diff vs DTensor |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for r in res["rows"]:
            ratio = f"{r['ratio_vs_peer']:.3f}x" if "ratio_vs_peer" in r else "-"
            paired = f"{r['paired_ratio_vs_peer']:.3f}x" if "paired_ratio_vs_peer" in r else "-"
            diff = f"{r['loss_max_rel_diff_vs_peer']:.1e}" if "loss_max_rel_diff_vs_peer" in r else "-"
            lines.append(f"| {r['tp']} | {r['runner']} | {common.fmt_time(r)} | {r['min_s']:.3f} | {ratio} | "
                         f"{paired} | {diff} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tensor-parallel sizes = numbers of ranks")
    p.add_argument("--runners", nargs="+", choices=KEYS, default=KEYS)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn-hidden", type=int, default=1408)
    p.add_argument("--vocab-size", type=int, default=257)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--measure-activations", action="store_true",
                   help="keep our trainer's activation meter on (off by default: the peer does not measure)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--steps", type=int, default=2, help="steps per runner per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)

    from ultrascale.model.config import ModelConfig, count_params
    from ultrascale.testing.harness import shutdown_pools

    model = ModelConfig(name="bench", vocab_size=args.vocab_size, hidden=args.hidden, layers=args.layers,
                        heads=args.heads, kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden,
                        max_seq_len=max(256, args.seq_len))
    spec = {"model": dataclasses.asdict(model), **{k: getattr(args, k) for k in (
        "seq_len", "micro_batch", "grad_accum", "grad_clip", "measure_activations", "warmup", "repeats", "steps",
        "seed")}}
    machine = common.machine_info()
    command = common.command_line()
    print(f"{machine['cpu']} | {machine['cores']} cores | torch {machine['torch']}\n{command}", flush=True)
    results = []
    try:
        for tp in args.tp:
            results.append(bench(tp, args.runners, spec, args))
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
