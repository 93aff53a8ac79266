"""Pipeline parallelism of ultrascale: the measured bubble of every schedule, and the step time
of 1F1B and interleaved 1F1B against `torch.distributed.pipelining`, on gloo processes.

One set of `--pp` processes (one torch thread each) runs these runners, interleaved
(benchmarks/_common.py: warm-up steps, then rounds in rotating order, a barrier before each block):

- ours, one per `--schedules` entry: the real `Trainer.train_step` with `--pp-schedule`
  naive | afab | 1f1b | interleaved (`--chunks` chunks per rank) | zero-bubble | dualpipev (two chunks
  per rank in a V), m = `--micro-batches`.
  `PipelineRuntime.run` is wrapped (here, not in the engine) to note the moment it is entered and left
  on the machine's monotonic clock, which all processes share; the runtime's recorded `trace`
  (start and end of every action, relative to its own start) is shifted by that moment, so the
  ranks' timelines are aligned on one clock.
- torch 1F1B / torch interleaved (when 1f1b / interleaved are among the schedules, unless
  `--no-peer`): the same single-device model (`build_model`, same seed, so the same weights), its
  layers cut by the same `split_layers` over pp x v stages (rank r holds stages r, r + pp, ...), each
  stage an nn.Module (first: token ids -> embedding -> its layers; last: its layers -> norm -> head ->
  logits; every block gets the RoPE tables `rope_cos[:s]`, `rope_sin[:s]`), wrapped in
  `PipelineStage` and driven by `Schedule1F1B` / `ScheduleInterleaved1F1B` with the same m micro-batches
  (the concatenation of ours, which their schedule splits back along the batch dimension), the loss our
  cross-entropy, `scale_grads=True` (their default: gradients divided by m; ours divides the loss by m),
  `return_outputs=False`. Then the same optimizer work as our trainer: gradient norm summed over the
  pipeline ranks and clipped (our `clip_grad_norm_`), our learning rate, AdamW (our `build_adamw`).

What is timed, on both sides:
- forward+backward: from the first rank entering the schedule (`PipelineRuntime.run` /
  `schedule.step`) to the last rank leaving it, on the shared clock. Ours includes the broadcast of the
  mean loss from the last stage at the end of `run` (one scalar); theirs includes splitting the batch
  into micro-batches and, on the first step only (a warm-up step), their shape inference.
- full step: per rank, from drawing the batch to the end of the optimizer step (ours: the trainer's own
  `step_time_s`; theirs: data draw, `zero_grad`, `schedule.step`, clip, AdamW); a step's time is the
  slowest rank's.

Bubble: for every recorded step of ours, `draw.measured_bubble_ratio` of the aligned timelines
((T - busy) / busy of the busiest rank, T from the first action's start to the last one's end;
receives and sends count as idle); the table gives the mean over steps. The mean cost of each compute
action (F, B, I, W: one chunk, over all ranks and steps) is fed to the simulator for the prediction,
next to the unit-cost prediction (the closed forms). Activations: the engine's activation meter
(bytes autograd saved for backward, held from a micro-batch's F to its B or I), its peak per rank
and step. Pictures: the recorded timeline of the step whose
bubble is the median (`draw.draw`) and the simulated one with the measured costs
(`ultrascale pp-schedule ... --out`), under `--img-dir`.

    .venv/bin/python benchmarks/bench_pipeline.py --pp 4 --json /tmp/bench_pp.json --img-dir docs/img
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402

SCHEDULE_NAMES = ("naive", "afab", "1f1b", "interleaved", "zero-bubble", "dualpipev")
PEERS = {"1f1b": "torch-1f1b", "interleaved": "torch-interleaved"}
LABELS = {"naive": "ours naive", "afab": "ours AFAB", "1f1b": "ours 1F1B", "interleaved": "ours interleaved",
          "zero-bubble": "ours ZB-H1", "dualpipev": "ours DualPipeV", "torch-1f1b": "torch Schedule1F1B",
          "torch-interleaved": "torch ScheduleInterleaved1F1B"}


def run_config(spec: dict, pp: int, name: str):
    from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
    from ultrascale.model.config import ModelConfig

    p = ParallelConfig(dp=1, pp=pp, pp_schedule=name, pp_chunks=chunks(name, spec))
    t = TrainConfig(steps=10**6, seq_len=spec["seq_len"], micro_batch=spec["micro_batch"],
                    grad_accum=spec["micro_batches"], grad_clip=spec["grad_clip"], seed=spec["seed"], device="cpu",
                    progress=False, measure_activations=True)
    return validate(RunConfig(model=ModelConfig(**spec["model"]), parallel=p, train=t), pp)


def chunks(name: str, spec: dict) -> int:
    return {"interleaved": spec["chunks"], "dualpipev": 2}.get(name, 1)


class Ours:
    def __init__(self, name: str, spec: dict, pp: int):
        from ultrascale.testing.harness import worker_context
        from ultrascale.train.trainer import Trainer

        self.key, self.label = name, LABELS[name]
        cfg = run_config(spec, pp, name)
        self.trainer = Trainer(cfg, worker_context(cfg.parallel))
        self.runtime = self.trainer.pipeline
        self.losses, self.spans, self.traces, self.activations = [], [], [], []
        run = self.runtime.run

        def timed_run(micro_batches):
            cpu, start = time.process_time(), time.perf_counter()
            out = run(micro_batches)
            self._span = (start, time.perf_counter(), time.process_time() - cpu)
            return out

        self.runtime.run = timed_run  # an instance attribute: the trainer calls self.pipeline.run

    def step(self) -> float:
        m = self.trainer.train_step()
        start = self._span[0]
        self.spans.append(self._span)
        self.traces.append([(lb, kind, start + s, start + e) for lb, kind, s, e in self.runtime.trace])
        self.losses.append(m["loss"])
        self.activations.append(m["memory"]["activations"])  # this rank's peak of the step, bytes
        return m["step_time_s"]


class StageModule(torch.nn.Module):
    """One pipeline stage of our single-device model, for torch.distributed.pipelining."""

    def __init__(self, model, layer_ids, first: bool, last: bool, seq_len: int):
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = torch.nn.ModuleList(model.layers[str(i)] for i in layer_ids)
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        self.register_buffer("cos", model.rope_cos[:seq_len].clone(), persistent=False)
        self.register_buffer("sin", model.rope_sin[:seq_len].clone(), persistent=False)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


class Peer:
    def __init__(self, key: str, spec: dict, pp: int):
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        from ultrascale.model import build_model, cross_entropy_loss
        from ultrascale.parallel.pipeline.stage import split_layers, virtual_stages
        from ultrascale.testing.harness import worker_context
        from ultrascale.train.data import TokenBatches, load_tokens
        from ultrascale.train.optim import build_adamw

        self.key, self.label = key, LABELS[key]
        name = key.removeprefix("torch-")
        cfg = self.cfg = run_config(spec, pp, name)
        t, v = cfg.train, cfg.parallel.pp_chunks
        self.ctx = worker_context(cfg.parallel)
        self.group = self.ctx.group("pp")
        rank = self.ctx.index("pp")
        model = build_model(cfg.model, t.seed)
        layers = split_layers(cfg.model.layers, pp * v)
        last = pp * v - 1
        mine = virtual_stages(rank, pp, v)
        self.modules = [StageModule(model, layers[s], s == 0, s == last, t.seq_len) for s in mine]
        stages = [PipelineStage(mod, s, pp * v, torch.device("cpu"), group=self.group)
                  for mod, s in zip(self.modules, mine)]
        m = t.grad_accum
        if name == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=cross_entropy_loss)
        else:
            self.schedule = Schedule1F1B(stages[0], m, loss_fn=cross_entropy_loss)
        self.first, self.last = 0 in mine, last in mine
        self.last_rank = dist.get_global_rank(self.group, pp - 1)
        self.params = [p for mod in self.modules for p in mod.parameters()]
        self.opt = build_adamw(self.params, [p.ndim >= 2 for p in self.params], t)
        self.data = TokenBatches(load_tokens(t.data), t.seq_len, cfg.global_batch, t.seed)
        self.steps, self.losses, self.spans = 0, [], []

    def step(self) -> float:
        import torch.distributed as dist

        from ultrascale.train.optim import clip_grad_norm_, lr_at

        t = self.cfg.train
        start = time.perf_counter()
        micro = self.data.micro_batches(self.steps, 0, 1, t.grad_accum)
        self.opt.zero_grad()
        args = (torch.cat([x for x, _ in micro]),) if self.first else ()
        losses = [] if self.last else None
        target = torch.cat([y for _, y in micro]) if self.last else None
        cpu, fb_start = time.process_time(), time.perf_counter()
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self.spans.append((fb_start, time.perf_counter(), time.process_time() - cpu))

        def reduce(sq):
            dist.all_reduce(sq, group=self.group)
            return sq

        clip_grad_norm_([p.grad for p in self.params], t.grad_clip, reduce)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.steps, t)
        self.opt.step()
        elapsed = time.perf_counter() - start
        self.steps += 1
        loss = torch.tensor(statistics.fmean(x.item() for x in losses) if self.last else 0.0, dtype=torch.float64)
        dist.broadcast(loss, src=self.last_rank, group=self.group)  # outside the timed span
        self.losses.append(loss.item())
        return elapsed


def make_runner(key, spec, pp):
    return Peer(key, spec, pp) if key.startswith("torch-") else Ours(key, spec, pp)


def worker(keys: list[str], spec: dict) -> dict:
    import torch.distributed as dist

    pp = dist.get_world_size()
    runners = [make_runner(k, spec, pp) for k in keys]
    times = common.interleave(runners, spec["warmup"], spec["repeats"], spec["steps"], dist.barrier)
    warm = spec["warmup"]
    out = {"times": {r.label: times[r.label] for r in runners},
           # interleave runs the warm-up steps first: the timed ones are the rest, in order
           "spans": {r.key: r.spans[warm:] for r in runners},
           "traces": {r.key: r.traces[warm:] for r in runners if isinstance(r, Ours)},
           "activations": {r.key: r.activations[warm:] for r in runners if isinstance(r, Ours)},
           "losses": {r.key: r.losses for r in runners}}
    del runners
    gc.collect()
    return out


# -- analysis ------------------------------------------------------------------------
def cost_of(traces_per_rank: list[list[list[tuple]]]) -> dict:
    """Mean duration (seconds) of each compute kind, over all ranks and steps."""
    d = {}
    for rank in traces_per_rank:
        for trace in rank:
            for _, kind, s, e in trace:
                if kind in ("F", "B", "I", "W"):
                    d.setdefault(kind, []).append(e - s)
    return {k: statistics.fmean(v) for k, v in d.items()}


def predictions(name: str, p: int, m: int, v: int, costs: dict) -> dict:
    from ultrascale.parallel.pipeline.partition import v_shaped
    from ultrascale.parallel.pipeline.schedules import schedule
    from ultrascale.parallel.pipeline.simulate import simulate

    acts, vshape = schedule(name, p, m, v), v_shaped(name)
    unit = simulate(acts, p, v, vshape=vshape)
    if "I" in costs:
        t_f, t_b, t_w = costs["F"], costs["I"], costs["W"]
    else:
        t_f, t_b, t_w = costs["F"], costs["B"], 0.0  # an unsplit B costs t_b + t_w
    sim = simulate(acts, p, v, t_f, t_b, t_w, vshape=vshape)
    return {"unit": unit.bubble_ratio, "measured_costs": sim.bubble_ratio, "sim_makespan_s": sim.makespan,
            "unit_in_flight": unit.peak_in_flight,
            "t_f": t_f, "t_b": t_b, "t_w": t_w}


CLOSED_FORM = {"naive": "p-1", "afab": "(p-1)/m", "1f1b": "(p-1)/m", "interleaved": "(p-1)/(v m)",
               "zero-bubble": "(p-1)/(3m)", "dualpipev": "(p-1)/(6m)"}


def bench(pp: int, keys: list[str], spec: dict, args) -> dict:
    from ultrascale.parallel.pipeline import draw
    from ultrascale.testing.harness import run_distributed

    print(f"\npp {pp}: {', '.join(LABELS[k] for k in keys)}", flush=True)
    wall = time.perf_counter()
    per_rank = run_distributed(pp, worker, keys, spec, timeout=args.timeout)
    print(f"  {time.perf_counter() - wall:.0f}s", flush=True)
    times, rounds = common.combine([r["times"] for r in per_rank], spec["steps"])
    m = spec["micro_batches"]
    rows = {}
    for k in keys:
        lb = LABELS[k]
        # forward+backward: first rank in to last rank out, on the shared clock
        fb = [max(e for _, e, _ in sp) - min(s for s, _, _ in sp) for sp in zip(*(r["spans"][k] for r in per_rank))]
        # CPU seconds of forward+backward, all threads of all ranks: what the step asks of the cores
        cpu = [sum(c for _, _, c in sp) for sp in zip(*(r["spans"][k] for r in per_rank))]
        row = {"pp": pp, "key": k, "runner": lb, "step": common.summary(times[lb]), "fb": common.summary(fb),
               "fb_cpu": common.summary(cpu), "step_times_s": times[lb], "fb_times_s": fb, "fb_cpu_s": cpu,
               "losses": per_rank[0]["losses"][k]}
        if k in per_rank[0]["traces"]:
            v = chunks(k, spec)
            steps = list(zip(*(r["traces"][k] for r in per_rank)))  # per step: each rank's trace
            bubbles = [draw.measured_bubble_ratio(list(s)) for s in steps]
            costs = cost_of([r["traces"][k] for r in per_rank])
            row.update(v=v, bubbles=bubbles, bubble_mean=statistics.fmean(bubbles), costs_s=costs,
                       prediction=predictions(k, pp, m, v, costs),
                       traces=[[list(map(list, rank)) for rank in s] for s in steps])  # per step, per rank
            comm = [e - s for r in per_rank for tr in r["traces"][k] for _, kind, s, e in tr
                    if kind.startswith(("SEND", "RECV"))]
            row["comm_actions_ms_mean"] = 1e3 * statistics.fmean(comm) if comm else 0.0
            # Peak activations per rank: the median over the timed steps (the meter counts bytes: steady).
            row["activations_mib"] = [statistics.median(r["activations"][k]) / 2**20 for r in per_rank]
            if args.img_dir and pp == args.img_pp:
                row["images"] = pictures(k, pp, m, v, steps, bubbles, row["prediction"], args.img_dir)
        rows[k] = row
    for k, peer in PEERS.items():
        if k in rows and peer in rows:
            a, b = LABELS[k], LABELS[peer]
            fb_rounds = _rounds(rows[k]["fb_times_s"], rows[peer]["fb_times_s"], spec["steps"])
            rows[k]["vs_peer"] = {
                "peer": b,
                "fb_ratio": rows[k]["fb"]["median_s"] / rows[peer]["fb"]["median_s"],
                "fb_paired_ratio": statistics.median(x / y for x, y in fb_rounds),
                "step_ratio": rows[k]["step"]["median_s"] / rows[peer]["step"]["median_s"],
                "step_paired_ratio": common.paired_ratio(rounds, a, b),
                "loss_max_rel_diff": common.max_rel_diff(rows[k]["losses"], rows[peer]["losses"]),
            }
    for r in rows.values():
        print(f"  {r['runner']}: fwd+bwd {r['fb']['median_s']:.3f}s (CPU {r['fb_cpu']['median_s']:.3f}s), "
              f"step {r['step']['median_s']:.3f}s"
              + (f", bubble {r['bubble_mean']:.3f}" if "bubble_mean" in r else ""), flush=True)
    return {"pp": pp, "rows": list(rows.values())}


def _rounds(a: list[float], b: list[float], steps: int) -> list[tuple]:
    n = len(a) // steps
    return [(statistics.fmean(a[i * steps:(i + 1) * steps]), statistics.fmean(b[i * steps:(i + 1) * steps]))
            for i in range(n)]


def pictures(name, p, m, v, steps, bubbles, pred, img_dir) -> dict:
    """The recorded timeline of the median-bubble step, and the simulated one with the measured costs."""
    from ultrascale.parallel.pipeline import draw

    tag = name.replace("-", "_")
    i = sorted(range(len(bubbles)), key=bubbles.__getitem__)[len(bubbles) // 2]
    measured = os.path.join(img_dir, f"pp_measured_{tag}.png")
    title = (f"{name}, pp={p}, m={m}" + (f", v={v}" if v > 1 else "")
             + f", recorded on CPU: measured bubble {bubbles[i]:.3f}")
    t0 = min(s for rank in steps[i] for _, _, s, _ in rank)
    # milliseconds from the step's first action, so the axis reads in ms
    draw.draw([[(lb, k, 1e3 * (s - t0), 1e3 * (e - t0)) for lb, k, s, e in rank] for rank in steps[i]],
              title, measured)
    simulated = os.path.join(img_dir, f"pp_sim_{tag}.png")
    cmd = ["pp-schedule", "--schedule", name, "--pp", str(p), "--micro-batches", str(m), "--chunks", str(v),
           "--t-f", f"{1e3 * pred['t_f']:.1f}", "--t-b", f"{1e3 * pred['t_b']:.1f}", "--t-w",
           f"{1e3 * pred['t_w']:.1f}", "--out", simulated]
    subprocess.run([sys.executable, "-m", "ultrascale", *cmd], check=True, capture_output=True, text=True)
    return {"measured": measured, "simulated": simulated, "measured_step": i,
            "sim_command": "ultrascale " + " ".join(cmd)}


# -- reporting -------------------------------------------------------------------------
def markdown(results: list[dict], machine: dict, spec: dict, n_params: int, command: str) -> str:
    md = spec["model"]
    m = spec["micro_batches"]
    lines = [
        f"Command: `{command}`", "",
        common.machine_line(machine),
        f"Model: hidden {md['hidden']}, {md['layers']} layers, {md['heads']} heads ({md['kv_heads']} kv), ffn "
        f"{md['ffn_hidden']}, vocab {md['vocab_size']}: {n_params / 1e6:.2f}M parameters, fp32. m = {m} "
        f"micro-batches of {spec['micro_batch']} x {spec['seq_len']} tokens per step; interleaved with v = "
        f"{spec['chunks']}. {spec['warmup']} warm-up steps per runner, then {spec['repeats']} interleaved rounds "
        f"of {spec['steps']} steps.", "",
        "Measured bubble (mean over the timed steps [min-max]) against the simulator; per-action costs in ms "
        "(one chunk; mean over ranks and steps; t_b is B for unsplit schedules, I for ZB-H1 and DualPipeV):", "",
        "| pp | schedule | measured bubble | t_f | t_b | t_w | predicted, measured costs | predicted, unit costs "
        "| closed form | send/recv (ms, mean) | fwd+bwd (s) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for res in results:
        for r in res["rows"]:
            if "bubble_mean" not in r:
                continue
            c, pr = r["costs_s"], r["prediction"]
            t_b = c.get("I", c.get("B"))
            t_w = f"{1e3 * c['W']:.1f}" if "W" in c else "-"
            vtag = f" (v={r['v']})" if r["v"] > 1 else ""
            lines.append(
                f"| {r['pp']} | {r['runner']}{vtag} | {r['bubble_mean']:.3f} "
                f"[{min(r['bubbles']):.3f}-{max(r['bubbles']):.3f}] | {1e3 * c['F']:.1f} | {1e3 * t_b:.1f} | {t_w} | "
                f"{pr['measured_costs']:.3f} | {pr['unit']:.3f} | {CLOSED_FORM[r['key']]} | "
                f"{r['comm_actions_ms_mean']:.2f} | {common.fmt_time(r['fb'])} |")
    lines += ["", "Bubble (median over the timed steps) and peak activations per rank (MiB: the engine's meter, "
              "median over the timed steps) beside the simulator's micro-batches in flight per rank (unit costs; "
              "chunks where v > 1; counted to B, or to W when split):", "",
              "| pp | schedule | measured bubble, median | activations per rank (MiB) | simulated in flight per rank |",
              "|---:|---|---:|---|---|"]
    for res in results:
        for r in res["rows"]:
            if "activations_mib" in r:
                lines.append(f"| {r['pp']} | {r['runner']} | {statistics.median(r['bubbles']):.3f} | "
                             + ", ".join(f"{a:.2f}" for a in r["activations_mib"]) + " | "
                             + ", ".join(map(str, r["prediction"]["unit_in_flight"])) + " |")
    peer_rows = [r for res in results for r in res["rows"] if "vs_peer" in r]
    if peer_rows:
        lines += ["", "Against torch.distributed.pipelining (median [quartiles] seconds; fwd+bwd = first rank into "
                  "the schedule to last rank out; its CPU seconds summed over ranks and threads; step = data draw "
                  "to end of AdamW, slowest rank):", "",
                  "| pp | ours | fwd+bwd ours | fwd+bwd torch | ours/torch fwd+bwd (medians) | (paired) "
                  "| fwd+bwd CPU s ours / torch | step ours | step torch | ours/torch step (medians) | (paired) "
                  "| loss rel diff |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        by_key = {(res["pp"], r["runner"]): r for res in results for r in res["rows"]}
        for r in peer_rows:
            vp = r["vs_peer"]
            q = by_key[(r["pp"], vp["peer"])]
            lines.append(
                f"| {r['pp']} | {r['runner']} vs {vp['peer']} | {common.fmt_time(r['fb'])} | "
                f"{common.fmt_time(q['fb'])} | "
                f"{vp['fb_ratio']:.3f}x | {vp['fb_paired_ratio']:.3f}x | {r['fb_cpu']['median_s']:.2f} / "
                f"{q['fb_cpu']['median_s']:.2f} | {common.fmt_time(r['step'])} | "
                f"{common.fmt_time(q['step'])} | {vp['step_ratio']:.3f}x | {vp['step_paired_ratio']:.3f}x | "
                f"{vp['loss_max_rel_diff']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[4], help="pipeline sizes = numbers of processes (default: 4)")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULE_NAMES, default=list(SCHEDULE_NAMES))
    p.add_argument("--no-peer", action="store_true", help="leave torch.distributed.pipelining out")
    p.add_argument("--micro-batches", type=int, default=8, help="m, micro-batches per step")
    p.add_argument("--chunks", type=int, default=2, help="v, chunks per rank of the interleaved schedule")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn-hidden", type=int, default=704)
    p.add_argument("--vocab-size", type=int, default=257)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per runner first")
    p.add_argument("--repeats", type=int, default=4, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=2, help="steps per runner per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--img-dir", help="write pp_measured_*.png and pp_sim_*.png here")
    p.add_argument("--img-pp", type=int, default=4, help="the pipeline size whose runs are drawn")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per pipeline size before the ranks are killed")
    p.add_argument("--json", metavar="OUT", help="write every step time, bubble, cost and loss here")
    args = p.parse_args(argv)

    from ultrascale.model.config import ModelConfig, count_params
    from ultrascale.testing.harness import shutdown_pools

    model = ModelConfig(name="bench", vocab_size=args.vocab_size, hidden=args.hidden, layers=args.layers,
                        heads=args.heads, kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden,
                        max_seq_len=max(256, args.seq_len))
    spec = {"model": dataclasses.asdict(model), **{k: getattr(args, k) for k in (
        "micro_batches", "chunks", "seq_len", "micro_batch", "grad_clip", "warmup", "repeats", "steps", "seed")}}
    keys = [s for s in SCHEDULE_NAMES if s in args.schedules]
    if not args.no_peer:
        keys += [PEERS[s] for s in keys if s in PEERS]
    machine = common.machine_info()
    command = common.command_line()
    print(f"{machine['cpu']} | {machine['cores']} cores | torch {machine['torch']}\n{command}", flush=True)
    results = []
    try:
        for pp in args.pp:
            results.append(bench(pp, keys, spec, args))
    finally:
        shutdown_pools()
    machine["loadavg_end"] = os.getloadavg()
    table = markdown(results, machine, spec, count_params(model), command)
    print("\n" + table)
    for res in results:
        for r in res["rows"]:
            if "images" in r:
                print(f"wrote {r['images']['measured']} and {r['images']['simulated']} "
                      f"(`{r['images']['sim_command']}`)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": machine, "spec": spec, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
