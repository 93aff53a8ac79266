"""Regional compilation on the CPU: tokens/s of one training step, eager against `--compile`
against the same model in Hugging Face transformers, in one process and one run.

Runners (the same shape, the same initial weights, the same batches):
- ultrascale eager: `Trainer.train_step` as `ultrascale train` runs it;
- ultrascale --compile: the same, each transformer block under `torch.compile`
  (parallel/compile.py); its first step, which compiles, is timed on its own and
  reported as the compile cost;
- transformers `LlamaForCausalLM` (sdpa), built from a `LlamaConfig` of the same shape
  (no download), trained by the plain loop of bench_single_vs_hf.py.
The activation meter (saved-tensor hooks) is off for both of ours, so that the
compiled code is timed, not the hook. After warm-up the runners take turns
(`--repeats` rounds of `--steps` steps, rotating order); reported: median step time,
tokens/s, and the ratio to HF (above 1: faster), plus the median over rounds of the
eager step time over the compiled one in the same round (`paired`).

    .venv/bin/python benchmarks/bench_compile.py --model small --seq-len 256 --micro-batch 8
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402
from bench_single_vs_hf import HF, Ours, model_config  # noqa: E402
from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.model import build_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per runner after the compiling one")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="steps per runner per round")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    # bench_single_vs_hf's model_config reads these overrides
    for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "rope_theta", "norm_eps"):
        p.add_argument("--" + name.replace("_", "-"), type=float if name in ("rope_theta", "norm_eps") else int,
                       default=None)
    p.add_argument("--tie-embeddings", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = common.machine_info()

    cfg = model_config(args.model, args)
    t = TrainConfig(steps=10**6, seq_len=args.seq_len, micro_batch=args.micro_batch, dtype=args.dtype,
                    device="cpu", progress=False, seed=args.seed, measure_activations=False)
    run = validate(RunConfig(model=cfg, parallel=ParallelConfig(dp=1), train=t), 1)
    compiled_run = dataclasses.replace(run, train=dataclasses.replace(t, compile=True))
    init = {n: q.detach().clone() for n, q in build_model(cfg, t.seed).named_parameters()}

    import transformers

    eager = Ours("ultrascale eager", run)
    compiled = Ours("ultrascale --compile", compiled_run)
    hf = HF(f"transformers {transformers.__version__} LlamaForCausalLM (sdpa)", cfg, run, init)
    start = time.perf_counter()
    compiled.step()
    compile_s = time.perf_counter() - start
    runners = [eager, compiled, hf]
    for r in runners:
        for _ in range(args.warmup):
            r.step()
    times = {r.label: [] for r in runners}
    rounds = []
    for rep in range(args.repeats):
        k = rep % len(runners)
        rounds.append({})
        for r in runners[k:] + runners[:k]:
            block = [r.step() for _ in range(args.steps)]
            times[r.label] += block
            rounds[-1][r.label] = statistics.fmean(block)

    tokens = run.global_batch * t.seq_len
    hf_med = statistics.median(times[hf.label])
    print(f"{machine['cpu']}, {machine['cores']} cores, {args.threads} torch threads, torch {machine['torch']}, "
          f"transformers {transformers.__version__}; load average {os.getloadavg()[0]:.2f}")
    print(f"model {cfg.name}, batch {args.micro_batch} x {args.seq_len}, {args.dtype}; first compiled step "
          f"(compiles) {compile_s:.1f}s; {args.repeats} rounds x {args.steps} steps after {args.warmup} warm-up")
    print("| runner | step time (s), median [quartiles] | tokens/s | vs HF |")
    print("|---|---:|---:|---:|")
    for r in runners:
        s = common.summary(times[r.label])
        print(f"| {r.label} | {common.fmt_time(s)} | {tokens / s['median_s']:,.0f} | {hf_med / s['median_s']:.2f}x |")
    paired = statistics.median([rd[eager.label] / rd[compiled.label] for rd in rounds])
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(compiled.losses, eager.losses))
    print(f"compiled vs eager, paired by round: {paired:.2f}x; losses compiled vs eager: max rel diff {loss_rel:.1e} "
          f"over {len(compiled.losses)} steps")


if __name__ == "__main__":
    main()
