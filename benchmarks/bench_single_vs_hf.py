"""One training step of ultrascale against Hugging Face transformers' Llama, in one process.

Both sides train the same shape on the same batches from the same initial weights:

- ours: the real `Trainer.train_step` (data draw, fp32 `main_grad` accumulation
  hooks, the activation meter, clipping, AdamW, copy back to the compute weights),
  once with `measure_activations=True` (the default) and once with it off, so the
  cost of the saved-tensor hooks is visible;
- HF: `LlamaForCausalLM` built from a `LlamaConfig` of the identical shape (no
  biases, `attn_implementation="sdpa"`, no cache), its weights copied from our
  initial weights, trained by a plain loop: the same `TokenBatches` draw, logits ->
  the same fp32 cross-entropy, `backward`, `torch.nn.utils.clip_grad_norm_`,
  `torch.optim.AdamW` with our decay groups and hyper-parameters, fused (`fused=True`:
  what transformers' `Trainer` uses by default with torch >= 2.8, `adamw_torch_fused`;
  ours is fused too, train/optim.py), the same learning-rate schedule.

MFU (on the CPU; `--no-peak` skips it): `ultrascale peak`'s measurement (square fp32 or
bf16 matmuls, best of 10 repeats) runs before the first and after the last round of each
shape, in the same process, behind the same idle gate; each runner's MFU is FLOPs per token (the
trainer's 6N + 12·L·h·s) x tokens/s at its median over the higher of the two ceilings.

dtype:
- fp32: both sides compute and update in fp32.
- bf16: ours keeps bf16 compute weights, fp32 master weights and fp32 gradients
  (`main_grad`), as `--dtype bf16` trains. HF does what its own `Trainer(bf16=True)`
  does: fp32 weights and gradients, forward under `torch.autocast("cpu", bfloat16)`.

The runs are interleaved: every runner does a few warm-up steps, then the runners
take turns running `--steps` steps each, `--repeats` times, in a rotating order,
so that load from other processes falls on all of them alike; on a shared machine,
each block also waits until other processes leave the CPUs mostly idle
(`--idle-below`, read from /proc/stat). Reported per runner:
the median step time over all its measured steps (with quartiles), the best step,
tokens/s at the median, and two ratios to HF (above 1: faster than HF): of the
medians, and "paired", the median over rounds of HF's time in a round over the
runner's time in the same round, which cancels load that changes between rounds.

    .venv/bin/python benchmarks/bench_single_vs_hf.py --model small medium --json /tmp/bench_fp32.json

`--device cuda`: both sides on the GPU (HF under `torch.autocast("cuda")` in bf16); the step
times end on a device synchronisation; the idle gate (a CPU matter) is off, and so is the
runner without the meter (three copies of a 1B model's states would crowd the GPU).
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
from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.distributed.context import build_context
from ultrascale.model import build_model, cross_entropy_loss, flops_per_token
from ultrascale.model.config import PRESETS, ModelConfig, count_params, get_preset
from ultrascale.model.hf import hf_name, to_hf_config
from ultrascale.train.data import TokenBatches, load_tokens
from ultrascale.train.metrics import ActivationMeter, optimizer_state_tensors, storage_bytes
from ultrascale.train.optim import lr_at
from ultrascale.train.peak import measure as peak_measure
from ultrascale.train.trainer import Trainer

# Shapes defined here, on top of the ultrascale presets.
SHAPES: dict[str, ModelConfig] = {
    "medium": dataclasses.replace(PRESETS["small"], name="medium", hidden=512, layers=8, heads=8, kv_heads=4,
                                  ffn_hidden=1408),
}

OVERRIDES = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "rope_theta", "norm_eps")


def model_config(name: str, args) -> ModelConfig:
    cfg = SHAPES[name] if name in SHAPES else get_preset(name)
    over = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    if args.tie_embeddings:
        over["tie_embeddings"] = True
    if over:
        cfg = dataclasses.replace(cfg, name=f"{cfg.name}*", **over)
    if cfg.max_seq_len < args.seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=args.seq_len)
    if cfg.norm != "rmsnorm" or cfg.mlp != "swiglu" or cfg.bias:
        sys.exit(f"{name}: only the Llama block (RMSNorm, SwiGLU, no biases) has a transformers twin")
    return cfg


# -- ours -------------------------------------------------------------------
class Ours:
    def __init__(self, label: str, run: RunConfig, device: torch.device):
        self.label = label
        self.trainer = Trainer(run, build_context(run.parallel, 0, 1, device=device))
        self.losses: list[float] = []
        self.activations = None

    def step(self) -> float:
        m = self.trainer.train_step()
        self.losses.append(m["loss"])
        if m["memory"]["activations"] is not None:
            self.activations = m["memory"]["activations"]
        return m["step_time_s"]

    def meter_cost(self) -> tuple[int, float]:
        """(tensors one forward saves, seconds the meter's hook takes over them, best of 20): the whole
        of what measuring activations adds to a step, timed apart from the step's noise."""
        t = self.trainer
        inputs, targets = t.data.micro_batches(0, 0, 1, 1, t.ctx.device)[0]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            loss = t.loss_fn(t.model(inputs), targets)
        del loss
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            for x in saved:
                t.meter._pack(x)
            best = min(best, time.perf_counter() - start)
        t.meter.saved = {}
        return len(saved), best

    def state_bytes(self) -> int:
        t = self.trainer
        return (storage_bytes(t.model.parameters()) + storage_bytes(t.grads.grads())
                + storage_bytes(optimizer_state_tensors(t.opt)) + t.main.master_bytes())


# -- Hugging Face -------------------------------------------------------------
def build_hf(cfg: ModelConfig, init: dict[str, torch.Tensor], device: torch.device):
    """LlamaForCausalLM of the same shape (ultrascale.model.hf's config and names), with our initial weights."""
    from transformers import LlamaForCausalLM

    hf_cfg = to_hf_config(cfg, dtype=torch.float32, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(hf_cfg).float().to(device).train()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in init.items():
            params[hf_name(name)].copy_(value)
    return model


class HF:
    def __init__(self, label: str, cfg: ModelConfig, run: RunConfig, init: dict[str, torch.Tensor],
                 device: torch.device):
        self.label, self.run, self.device = label, run, device
        t = run.train
        self.model = build_hf(cfg, init, device)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        decay = [p for _, p in named if p.ndim >= 2]
        no_decay = [p for _, p in named if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
        self.data = TokenBatches(load_tokens(t.data, t.tokenizer, t.data_column, t.data_split),
                                 t.seq_len, run.global_batch, t.seed)
        self.bf16 = t.dtype == "bf16"
        self.steps = 0
        self.losses: list[float] = []
        self.activations = None

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def step(self) -> float:
        t = self.run.train
        start = time.perf_counter()
        micro_batches = self.data.micro_batches(self.steps, 0, 1, t.grad_accum, self.device)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for inputs, targets in micro_batches:
            with self._autocast():
                logits = self.model(input_ids=inputs, use_cache=False).logits
            loss = cross_entropy_loss(logits, targets)
            (loss / len(micro_batches)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip).item()  # as the Trainer calls it
        lr = lr_at(self.steps, t)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.steps += 1
        self.losses.append(total / len(micro_batches))
        return elapsed

    def measure_activations(self) -> None:
        """Bytes saved for backward by one forward, with the meter ours uses (not timed, no update)."""
        inputs, targets = self.data.micro_batches(0, 0, 1, self.run.train.grad_accum, self.device)[0]
        meter = ActivationMeter(list(self.model.parameters()) + list(self.model.buffers()))
        with meter.forward(), self._autocast():
            loss = cross_entropy_loss(self.model(input_ids=inputs, use_cache=False).logits, targets)
        del loss
        self.activations = meter.take_peak()

    def state_bytes(self) -> int:
        grads = [p.grad for p in self.params]  # alive from backward until the next step's zero_grad
        return storage_bytes(self.params) + storage_bytes(grads) + storage_bytes(optimizer_state_tensors(self.opt))


# -- the measurement -----------------------------------------------------------
def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    total = sum(v[:8])  # guest time is already inside user
    return total - idle, total


def busy_elsewhere(interval: float = 0.5) -> float | None:
    """Fraction of all cores busy over `interval` seconds while this process sleeps: the
    load other processes put on the machine. None where /proc/stat is missing."""
    try:
        b0, t0 = _cpu_times()
        time.sleep(interval)
        b1, t1 = _cpu_times()
    except OSError:
        return None
    return (b1 - b0) / max(1, t1 - t0)


class IdleGate:
    """Before each measured block, wait (up to max_wait seconds) until the rest of the
    machine is quieter than `below`; record what it was when the block started."""

    def __init__(self, below: float, max_wait: float):
        self.below, self.max_wait = below, max_wait
        self.seen: list[float] = []
        self.gave_up = 0

    def wait(self) -> None:
        if self.below >= 1:
            return
        deadline = time.monotonic() + self.max_wait
        time.sleep(0.2)  # let this process's own worker threads stop spinning
        while True:
            busy = busy_elsewhere()
            if busy is None:
                return
            if busy < self.below or time.monotonic() > deadline:
                self.seen.append(busy)
                self.gave_up += busy >= self.below
                return


def check_same_function(ours: Ours, hf: HF) -> float:
    """Max |logits difference| of the two models on one batch, before any step (fp32 only)."""
    inputs, _ = hf.data.micro_batches(0, 0, 1, 1, hf.device)[0]
    with torch.no_grad():
        a = ours.trainer.model(inputs).float()
        b = hf.model(input_ids=inputs, use_cache=False).logits.float()
    return (a - b).abs().max().item()


def bench_shape(cfg: ModelConfig, args) -> dict:
    t = TrainConfig(steps=10**6, seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=1,
                    dtype=args.dtype, device=args.device, progress=False, seed=args.seed)
    run = validate(RunConfig(model=cfg, parallel=ParallelConfig(dp=1), train=t), 1)
    run_off = dataclasses.replace(run, train=dataclasses.replace(t, measure_activations=False))

    init = {n: p.detach().clone() for n, p in build_model(cfg, t.seed).named_parameters()}
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    ours = Ours("ultrascale", run, device)
    ours_off = Ours("ultrascale, measure_activations=False", run_off, device) if device.type == "cpu" else None
    hf = HF(f"transformers {_hf_version()} LlamaForCausalLM (sdpa)", cfg, run, init, device)

    n_ours = sum(p.numel() for p in ours.trainer.model.parameters())
    n_hf = sum(p.numel() for p in hf.model.parameters())
    if n_ours != n_hf or n_ours != count_params(cfg):
        sys.exit(f"{cfg.name}: parameter counts differ: ultrascale {n_ours:,}, transformers {n_hf:,}, "
                 f"count_params {count_params(cfg):,}")
    logits_diff = check_same_function(ours, hf) if args.dtype == "fp32" else None
    hf.measure_activations()
    meter_calls, meter_s = ours.meter_cost()

    runners = [r for r in (ours, ours_off, hf) if r is not None]
    gate = IdleGate(args.idle_below, args.max_wait)
    peaks = [measure_peak(device, args.dtype, gate)] if args.peak else []
    print(f"\n{cfg.name}: {n_ours:,} parameters in both models"
          + (f", max |logits diff| at init {logits_diff:.1e}" if logits_diff is not None else ""), flush=True)
    for r in runners:
        for _ in range(args.warmup):
            r.step()
    times: dict[str, list[float]] = {r.label: [] for r in runners}
    rounds: list[dict[str, float]] = []  # per round: each runner's mean step time in it
    for rep in range(args.repeats):
        order = runners[rep % len(runners):] + runners[:rep % len(runners)]
        rounds.append({})
        for r in order:
            gc.collect()
            gate.wait()
            block = [r.step() for _ in range(args.steps)]
            times[r.label] += block
            rounds[-1][r.label] = statistics.fmean(block)
            others = f" (others {100 * gate.seen[-1]:.0f}% busy at start)" if gate.seen else ""
            print(f"  round {rep + 1}/{args.repeats} {r.label}: "
                  + " ".join(f"{s:.3f}s" for s in block) + others, flush=True)

    if args.peak:
        peaks.append(measure_peak(device, args.dtype, gate))
    peak = max(peaks) if peaks else None  # the higher ceiling: the lower, safer MFU
    fpt = flops_per_token(cfg, t.seq_len)
    tokens = run.global_batch * t.seq_len
    hf_median = statistics.median(times[hf.label])
    rows = []
    for r in runners:
        ts = sorted(times[r.label])
        med = statistics.median(ts)
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [med, med, med]
        rows.append({
            "shape": cfg.name, "runner": r.label, "params": n_ours, "dtype": args.dtype, "tokens_per_step": tokens,
            "median_step_s": med, "q1_step_s": q[0], "q3_step_s": q[2], "min_step_s": ts[0],
            "tokens_per_s": tokens / med, "ratio_vs_hf": hf_median / med,
            # Each round's HF time over this runner's time in the same round (neighbours in time), median over rounds.
            "paired_ratio_vs_hf": statistics.median([rd[hf.label] / rd[r.label] for rd in rounds]),
            "mfu": tokens / med * fpt / 1e12 / peak if peak else None,
            "activations_bytes": r.activations, "state_bytes": r.state_bytes(),
            "step_times_s": times[r.label], "losses": r.losses,
        })
    # Same weights, same batches, same recipe: the losses must agree (fp32: to rounding).
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(ours.losses, hf.losses))
    same = next((i for i, (a, b) in enumerate(zip(ours.losses, hf.losses)) if a != b), len(hf.losses))
    meter_exact = ours.losses == ours_off.losses if ours_off is not None else None
    idle = {"below": args.idle_below, "blocks": len(gate.seen), "started_busy": gate.gave_up,
            "busy_elsewhere_at_start": gate.seen}
    return {"model": cfg.to_dict(), "rows": rows, "idle_gate": idle, "peaks_tflops": peaks,
            "flops_per_token": fpt, "logits_max_abs_diff_at_init": logits_diff,
            "loss_max_rel_diff_ours_vs_hf": loss_rel, "loss_identical_steps": same,
            "meter_changes_nothing": meter_exact, "meter_hook_calls": meter_calls, "meter_hook_s": meter_s}


def measure_peak(device: torch.device, dtype: str, gate: "IdleGate") -> float:
    """`ultrascale peak` in this process (its sizes, 10 repeats, 5 s budget), after the idle gate."""
    gc.collect()
    gate.wait()
    p = peak_measure(device, dtype, repeats=10, budget_s=5.0)
    print(f"  peak {p.tflops:.4g} TFLOP/s ({dtype} matmul, {p.device}; "
          + ", ".join(f"n={n}: {v:.3g}" for n, v in p.by_size.items()) + ")", flush=True)
    return p.tflops


# -- reporting ------------------------------------------------------------------
def _hf_version() -> str:
    import transformers

    return transformers.__version__


def machine_info(threads: int) -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {**common.machine_info(), "threads": threads, "transformers": _hf_version(), "gpu": gpu}


def markdown(results: list[dict], machine: dict, args) -> str:
    lines = [
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['threads']} torch threads; "
        f"Python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}. "
        f"Load average at start {machine['loadavg_start'][0]:.2f}, at end {machine['loadavg_end'][0]:.2f}.",
        f"Batch {args.micro_batch} x {args.seq_len} tokens, dtype {args.dtype}; {args.warmup} warm-up steps, "
        f"then {args.repeats} interleaved rounds of {args.steps} step(s) per runner; median step time "
        f"(quartiles in brackets).",
        "",
        "| shape | params | runner | step time (s), median [quartiles] | best (s) | tokens/s | MFU | vs HF "
        "| vs HF, paired | activations (MiB) | params+grads+optim (MiB) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for r in res["rows"]:
            act = "-" if r["activations_bytes"] is None else f"{r['activations_bytes'] / 2**20:.1f}"
            lines.append(
                f"| {r['shape']} | {r['params'] / 1e6:.2f}M | {r['runner']} | {r['median_step_s']:.3f} "
                f"[{r['q1_step_s']:.3f}-{r['q3_step_s']:.3f}] | {r['min_step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                f"{'-' if r['mfu'] is None else format(100 * r['mfu'], '.1f') + '%'} | "
                f"{r['ratio_vs_hf']:.2f}x | {r['paired_ratio_vs_hf']:.2f}x | "
                f"{act} | {r['state_bytes'] / 2**20:.1f} |")
    lines.append("")
    for res in results:
        name, rows = res["model"]["name"], res["rows"]
        diff = res["logits_max_abs_diff_at_init"]
        if diff is not None:  # fp32: the same computation, so the losses must agree to rounding
            check = (f"max |logits diff| at init {diff:.1e}; losses ours vs HF bitwise equal for the first "
                     f"{res['loss_identical_steps']} steps, max relative difference over all {len(rows[0]['losses'])} "
                     f"steps {res['loss_max_rel_diff_ours_vs_hf']:.1e}")
        else:  # bf16: two different mixed-precision recipes, the losses only follow the same course
            check = (f"different bf16 recipes; losses at steps 1 / {len(rows[0]['losses'])}: ours "
                     f"{rows[0]['losses'][0]:.3f} / {rows[0]['losses'][-1]:.3f}, HF {rows[-1]['losses'][0]:.3f} / "
                     f"{rows[-1]['losses'][-1]:.3f}")
        gate = res["idle_gate"]
        if gate["blocks"]:
            seen = gate["busy_elsewhere_at_start"]
            check += (f"; other processes used {100 * statistics.median(seen):.0f}% (median), at most "
                      f"{100 * max(seen):.0f}% of the CPUs when a block started ({gate['started_busy']} of "
                      f"{gate['blocks']} blocks started above the {100 * gate['below']:.0f}% threshold)")
        if res["peaks_tflops"]:
            check += ("; `ultrascale peak` in the same run, before / after the rounds: "
                      + " / ".join(f"{x:.4g}" for x in res["peaks_tflops"]) + " TFLOP/s (MFU against the higher), "
                      f"{res['flops_per_token'] / 1e6:.2f} MFLOP per token")
        meter = res["meter_changes_nothing"]
        check += (f"; the activation meter's hook: {res['meter_hook_calls']} calls per forward, "
                  f"{1e3 * res['meter_hook_s']:.2f} ms ({100 * res['meter_hook_s'] / rows[0]['median_step_s']:.2f}% "
                  f"of the median step)")
        lines.append(f"- {name}: {check}" + ("" if meter is None else "; losses with and without the activation meter "
                                              + ("identical" if meter else "DIFFERENT")))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", default=["small"],
                   help=f"shapes to run: an ultrascale preset or one of {', '.join(SHAPES)} (default: small)")
    for name in OVERRIDES:
        p.add_argument("--" + name.replace("_", "-"), type=float if name in ("rope_theta", "norm_eps") else int,
                       default=None, help="override this field of every --model shape")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=1, help="steps per runner per round")
    p.add_argument("--repeats", type=int, default=10, help="interleaved rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per runner first")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-below", type=float, default=0.2, metavar="FRACTION",
                   help="start each measured block only once other processes use less than this fraction of all "
                        "CPUs (from /proc/stat; 1 turns the wait off)")
    p.add_argument("--max-wait", type=float, default=120, metavar="SECONDS",
                   help="longest wait for a quiet machine before a block; then it runs anyway (and is counted)")
    p.add_argument("--json", metavar="OUT", help="write every step time and loss here")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--no-peak", dest="peak", action="store_false",
                   help="skip the matmul ceiling (`ultrascale peak`) before and after each shape, and MFU "
                        "(always skipped with --device cuda)")
    args = p.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_single_vs_hf: --device cuda: no CUDA device is visible: use --device cpu")
        args.idle_below = 1.0  # the gate watches the CPUs
        # A GPU's ceiling is its datasheet's (the trainer's default there); gpu-check's time is short.
        args.peak = False

    torch.set_num_threads(args.threads)
    machine = machine_info(args.threads)
    print(f"{machine['cpu']} | {machine['cores']} cores | {args.threads} threads | torch {machine['torch']} | "
          f"transformers {machine['transformers']}", flush=True)
    results = [bench_shape(model_config(name, args), args) for name in args.model]
    machine["loadavg_end"] = os.getloadavg()
    table = markdown(results, machine, args)
    print("\n" + table)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            # The figures make gpu-check's report lists: each shape's ratio of medians to HF, ours first.
            summary = {"device": machine["gpu"] if args.device == "cuda" else machine["cpu"]}
            for res in results:
                row = res["rows"][0]
                summary[f"{row['shape']}_ours_tokens_per_s"] = row["tokens_per_s"]
                summary[f"{row['shape']}_ours_vs_hf"] = row["ratio_vs_hf"]
                summary[f"{row['shape']}_ours_vs_hf_paired"] = row["paired_ratio_vs_hf"]
                if row["mfu"] is not None:
                    summary[f"{row['shape']}_ours_mfu"] = row["mfu"]
            json.dump({"command": sys.argv, "machine": machine, "args": vars(args), "summary": summary,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
