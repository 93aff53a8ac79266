"""Part 14 of the series: 5-D parallelism and finding the best configuration.

The source of notebooks/14_5d_parallelism.ipynb (build it with `python notebooks/src/build.py 14`).
The grid and its groups come from the engine (ultrascale.distributed.context), on 4 real gloo
processes; composed layouts are trained by the engine against one process; memory, batch and
throughput come from the planner (ultrascale.plan), checked against the playbook's measured runs.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import dataclasses
import os
import statistics
import tempfile

import torch
import torch.distributed as dist

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.distributed.context import build_context, grid_groups
from ultrascale.plan.calibration import get_framework
from ultrascale.plan.hardware import get_cluster
from ultrascale.plan.layout import Layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.search import search
from ultrascale.plan.shape import get_shape
from ultrascale.plan.time import step_time
from ultrascale.series.ranks import on_ranks
from ultrascale.testing.compare import train_on

torch.set_num_threads(1)  # tiny models: one thread per process is fastest
WORLD = 4                 # every multi-rank cell runs on 4 real processes (gloo, this CPU)
GiB = 2**30
H100 = get_cluster("playbook")  # the playbook's H100 cluster, whose runs calibrate the planner
PLANNER = dataclasses.replace(get_framework("playbook"), partition="even")  # as `ultrascale plan` uses it
LLAMA_70B = get_shape("llama3-70b")
print(f"llama3-70b: {LLAMA_70B.count() / 1e9:.1f}B parameters, {LLAMA_70B.layers} layers, {LLAMA_70B.heads} heads; "
      f"{H100.gpu.name}: {H100.memory_gib:.1f} GiB, {H100.node_size} GPUs per node")
''')

GRID_8 = code(r'''
# The groups the engine builds for dp 2 x pp 2 x tp 2 on 8 ranks (every process builds all of them).
groups = grid_groups(ParallelConfig(dp=2, pp=2, tp=2), 8)
print("rank grid, arange(8).reshape(dp, pp, cp, tp):", torch.arange(8).reshape(2, 2, 1, 2).tolist())
for name in ("tp", "pp", "dp", "cp", "dp_cp"):
    print(f"{name:5s} groups: {groups[name]}")
''')

REAL_GROUPS = code(r'''
def where_am_i(dp, pp, tp):
    """On each real rank: the engine's context for the layout, and an all-reduce over each group
    (each rank contributes 10**rank, so the sum spells out which ranks took part)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = build_context(ParallelConfig(dp=dp, pp=pp, tp=tp), rank, world)
    heard = {}
    for name in ("tp", "pp", "dp"):
        t = torch.tensor([10.0 ** rank], dtype=torch.float64)
        if ctx.group(name) is not None:
            dist.all_reduce(t, group=ctx.group(name))
        heard[name] = sorted(r for r in range(world) if int(t.item()) // 10**r % 10)
    coords = " ".join(f"{d}={ctx.coords[d]}" for d in ("dp", "pp", "tp"))
    return coords, {name: ctx.group_ranks[name] for name in ("tp", "pp", "dp")}, heard


for dp, pp, tp in ((2, 1, 2), (2, 2, 1)):
    print(f"dp {dp} x pp {pp} x tp {tp} on {WORLD} real ranks:")
    for rank, (coords, built, heard) in enumerate(on_ranks(WORLD, where_am_i, dp, pp, tp)):
        assert all(built[n] == heard[n] for n in built)  # the communicator joins exactly the listed ranks
        print(f"  rank {rank}: {coords}  tp {built['tp']}  pp {built['pp']}  dp {built['dp']}")
''')

COMPOSED = code(r'''
def train(world, mbs, ga=1, **layout):
    """The engine trains the tiny Llama-style model for 3 steps; 8 sequences of 32 tokens per step."""
    cfg = RunConfig(parallel=ParallelConfig(**layout),
                    train=TrainConfig(steps=3, seq_len=32, micro_batch=mbs, grad_accum=ga, nproc=world,
                                      progress=False))
    return train_on(cfg, world)


single = train(1, mbs=8).losses
print(f"one process          : losses {' '.join(f'{x:.6f}' for x in single)}")
for name, run in (("dp 2 x tp 2", dict(mbs=4, dp=2, tp=2)), ("dp 2 x pp 2", dict(mbs=2, ga=2, dp=2, pp=2))):
    record = train(WORLD, **run)
    worst = max(abs(a - b) / b for a, b in zip(record.losses, single))
    print(f"{name} on {WORLD} ranks: losses {' '.join(f'{x:.6f}' for x in record.losses)}  "
          f"(worst relative difference {worst:.0e})")
''')

STEP1 = code(r'''
# Step 1: fit in memory. Llama 3 70B, sequences of 4096 tokens, one sequence per micro-batch,
# 256 sequences (1M tokens) per step on 64 H100s: the planner's memory per GPU for a few layouts.
SEQS = 2**20 // 4096


def plan_70b(dp, tp=1, pp=1, zero=1, mbs=1):
    return Layout(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mbs, grad_accum=SEQS // (dp * mbs),
                  seq_len=4096, precision="bf16", schedule="1f1b", recompute="none")


for dp, tp, pp, zero in ((64, 1, 1, 0), (64, 1, 1, 3), (8, 8, 1, 1), (8, 4, 2, 1), (4, 4, 4, 1), (2, 8, 4, 1)):
    lay = plan_70b(dp, tp, pp, zero)
    peak = memory_plan(LLAMA_70B, lay, PLANNER).peak
    states = sum(peak.terms[k] for k in ("params", "grads", "optim"))
    fits = "fits" if peak.total <= H100.memory_bytes else "does not fit"
    print(f"dp{dp:<2d} tp{tp} pp{pp} zero{zero}: states {states / GiB:6.1f} GiB + activations "
          f"{peak.terms['activations'] / GiB:5.1f} GiB -> {peak.total / GiB:6.1f} GiB per GPU, {fits}")
''')

STEP2 = code(r'''
# Step 2: reach the global batch, 256 sequences = micro-batch x accumulation x dp, on the layout dp 8 x tp 4 x pp 2.
for mbs in (1, 2, 4):
    lay = plan_70b(8, tp=4, pp=2, mbs=mbs)
    peak = memory_plan(LLAMA_70B, lay, PLANNER).peak
    t = step_time(LLAMA_70B, lay, H100, PLANNER)
    fits = "fits" if peak.total <= H100.memory_bytes else "does not fit"
    print(f"mbs {mbs} x ga {lay.grad_accum:2d} x dp 8 = {lay.global_batch} sequences: {peak.total / GiB:5.1f} GiB "
          f"({fits}); pipeline bubble {t.breakdown['bubble']:.2f} s of a {t.step_s:.2f} s step")
''')

STEP3 = code(r'''
# Step 3: maximise throughput. The planner's search over every layout of 64 GPUs that fits and reaches the
# batch: dp, tp, pp, ZeRO stage, micro-batch, pipeline schedule (cp and recomputation pinned to keep it fast;
# `ultrascale plan --model llama3-70b --gpus 64 --cp 1 --recompute none` prints the same ranking).
found = search(LLAMA_70B, 64, H100, PLANNER, seq_len=4096, global_batch_tokens=2**20,
               fixed={"cp": 1, "recompute": "none"})
print(f"{len(found.ranked)} of {found.enumerated} layouts fit; the five fastest:")
for c in found.by_time[:5]:
    print(f"  {c.layout.label():55s} {c.memory.peak.total / GiB:5.1f} GiB  "
          f"{c.time.tokens_per_s_per_gpu:5.0f} tok/s/GPU")
group = found.top_group
print(f"\n{len(group)} layouts lie within the time model's error (±{100 * found.band:.1f}%) of the fastest; "
      f"the planner lists them first, by memory headroom, then simplicity:")
for c in group[:3]:
    print(f"  {c.layout.label():55s} {c.memory.peak.total / GiB:5.1f} GiB  "
          f"{c.time.tokens_per_s_per_gpu:5.0f} tok/s/GPU")

print("\nThe fastest fitting layout for each (tp, pp), and where its step time goes (seconds):")
best = {}
for c in found.by_time:
    best.setdefault((c.layout.tp, c.layout.pp), c)
for (tp, pp), c in sorted(best.items(), key=lambda kv: -kv[1].time.tokens_per_s_per_gpu)[:6]:
    b = c.time.breakdown
    print(f"  tp{tp} pp{pp} dp{c.layout.dp:<2d} {c.time.tokens_per_s_per_gpu:5.0f} tok/s/GPU: "
          f"compute {b['compute']:5.2f}"
          f"  tp comm {b['tp_comm']:4.2f}  bubble {b['bubble']:4.2f}  dp comm {b['dp_comm']:4.2f}"
          f"  sync {b['sync']:4.2f}  overhead {b['kernel_overhead']:4.2f}")
print(f"sync: {PLANNER.collective_step_s * 1e6:.0f} µs per ring step of a collective on the critical path, "
      f"x{PLANNER.pipeline_sync_factor:g} inside a pipeline (calibration.py); "
      f"{H100.node_pair_sync_s * 1e3:.1f} ms x nodes² per micro-batch, {H100.node_pair_sync_s * 64**2:.2f} s at "
      f"64 nodes (hardware.py)")
''')

VALIDATE = code(r'''
# The planner against the playbook's measured runs (H100s, sequences of 4096, 256 sequences per step).
from ultrascale.plan.validate import load_rows, row_layout, validate

rows, source = load_rows()
figures = validate(rows)
print(f"{figures['runs']:,} runs, {figures['finished']:,} finished")
print(f"fit / no-fit predicted correctly: {100 * figures['accuracy']:.1f}%; median peak-memory error "
      f"{100 * figures['median_memory_error']:.1f}%; mean Spearman (tokens/s/GPU, per group) "
      f"{figures['mean_spearman']:.3f}")
print("Spearman by (model, nodes):")
items = list(figures["spearman_by_group"].items())
for i in range(0, len(items), 4):
    print("  " + "  ".join(f"{k:<15}{v:6.3f}" for k, v in items[i:i + 4]))
''')

MEASURED = code(r'''
# Predicted vs measured, run by run: the time model with the calibration `validate` uses.
FW = get_framework(figures["framework"])


def predicted(r, cluster=None, framework=None):
    """The planner's tokens/s/GPU for run r: on the playbook's cluster and calibration unless others are given."""
    return step_time(get_shape(r["model"].lower()), row_layout(r), cluster or H100, framework or FW).tokens_per_s_per_gpu


# Bytes and FLOPs alone: the same model without its three synchronization constants.
BARE = dataclasses.replace(H100, node_pair_sync_s=0.0), dataclasses.replace(FW, collective_step_s=0.0,
                                                                                  pipeline_sync_factor=1.0)


ok = [r for r in rows if r["status"] == "ok"]
for model, nodes in (("8B", 1), ("8B", 8), ("8B", 64), ("80B", 8)):
    group = [r for r in ok if r["model"] == model and int(r["nodes"]) == nodes]
    r = max(group, key=lambda r: float(r["tokens_per_s_per_gpu"]))  # the group's fastest measured run
    layout = f"dp{r['dp']} tp{r['tp']} pp{r['pp']} zero{r['zero_stage']} mbs{r['micro_batch']}"
    print(f"{model:>3s} on {nodes:2d} nodes, fastest measured {layout}: "
          f"measured {float(r['tokens_per_s_per_gpu']):7,.0f}, predicted {predicted(r):7,.0f} tokens/s/GPU")
print("\npredicted / measured tokens/s/GPU over the finished runs: median, 90th percentile, and the median "
      "from bytes and FLOPs alone")
ratios = {}
for nodes in sorted({int(r["nodes"]) for r in ok}):
    runs = [r for r in ok if int(r["nodes"]) == nodes]
    ratios[nodes] = [predicted(r) / float(r["tokens_per_s_per_gpu"]) for r in runs]
    bare = statistics.median(predicted(r, *BARE) / float(r["tokens_per_s_per_gpu"]) for r in runs)
    p90 = statistics.quantiles(ratios[nodes], n=10, method="inclusive")[-1]
    mfu = statistics.median(float(r["mfu_pct"]) for r in runs)
    print(f"  {nodes:2d} nodes: {statistics.median(ratios[nodes]):5.2f}, p90 {p90:4.2f}; bytes and FLOPs alone "
          f"{bare:5.2f}  ({len(runs)} runs, median measured MFU {mfu:.1f}%)")
middle = [x for nodes in (4, 8, 16, 32) for x in ratios[nodes]]
print(f"at 4-32 nodes, runs 3 or more times slower than predicted: {sum(x >= 3 for x in middle) / len(middle):.0%}")

# The synchronization constants calibrated on two of the models, and what they give on the other two.
from ultrascale.plan.validate import cross_validate, cross_validation_lines

print("\n" + "\n".join(cross_validation_lines(cross_validate(rows))))
''')

EMIT = code(r'''
# plan -> train: the planner writes its choice as a TOML file; the engine reads it as `ultrascale train --config`.
# Scaled down: the tiny model, 8 sequences of 32 tokens per step, 4 "GPUs" (our 4 processes), fp32.
from ultrascale.config import build_config, load_toml
from ultrascale.plan import emit

TINY = get_shape("tiny")
free = search(TINY, 4, H100, PLANNER, seq_len=32, global_batch_tokens=256, precision="fp32",
              fixed={"recompute": "none", "zero": 0})
print(f"{len(free.top_group)} of the {len(free.ranked)} layouts that fit lie within ±{100 * free.band:.1f}% of the "
      f"fastest ({free.by_time[0].layout.label()})")
print("planner's choice for the tiny model:", free.ranked[0].layout.label())
pinned = search(TINY, 4, H100, PLANNER, seq_len=32, global_batch_tokens=256, precision="fp32",
                fixed={"recompute": "none", "zero": 0, "tp": 2})
choice = pinned.ranked[0].layout
print("with --tp 2:                        ", choice.label())

path = os.path.join(tempfile.mkdtemp(), "plan.toml")
emit.write(path, TINY, choice, framework=PLANNER.name)  # what `ultrascale plan ... --tp 2 --emit-config plan.toml` writes
print(open(path).read())
# What `ultrascale train --config plan.toml --data "" --steps 3` builds (file < flags: the data set, here the
# default corpus; for this look, 3 steps without the run's saves, validation and log), on the 4 processes,
# and the same [train] on one process taking the whole batch at once:
cfg = build_config(load_toml(path), {"train": {"steps": 3, "progress": False, "device": "cpu", "data": "", "save": "",
                                               "save_every": 0, "keep_last": 0, "eval_every": 0, "log_jsonl": ""}})
losses = train_on(cfg, WORLD).losses
whole = dataclasses.replace(cfg.train, micro_batch=cfg.global_batch, grad_accum=1, nproc=1)
one = train_on(dataclasses.replace(cfg, parallel=ParallelConfig(), train=whole), 1).losses
worst = max(abs(a - b) / b for a, b in zip(losses, one))
print(f"the emitted config on {WORLD} ranks: losses {' '.join(f'{x:.6f}' for x in losses)} "
      f"(worst relative difference from one process {worst:.0e})")
''')


EPISODE = Episode(
    number=14,
    title="5-D Parallelism and Finding the Best Configuration",
    slug="5d_parallelism",
    subtitle="One grid for dp x pp x cp x tp (+ ep), and the playbook's three steps as a search",
    overview=[
        "Composing the dimensions on one grid: the world is `arange(world).reshape(dp, pp, cp, tp)`, tp "
        "innermost; every group is a line through that grid",
        "The groups the engine builds for 8 ranks, and for 4 real ranks with an all-reduce over each group",
        "Composed layouts trained by the engine (dp 2 x tp 2, dp 2 x pp 2) give the losses of one process",
        "The playbook's three steps with the planner, for Llama 3 70B on 64 H100s: fit in memory, reach the "
        "global batch, maximise throughput - and why the winner wins",
        "How far to trust it: predicted against the playbook's measured runs (Spearman per group), and where "
        "single runs still stray at 4-32 nodes",
        "`plan --emit-config`: the planner's choice as a TOML file the engine trains",
    ],
    references=[
        Reference(5, "the global batch: micro-batch x accumulation x dp"),
        Reference(7, "ZeRO stages and what they shard"),
        Reference(10, "context parallelism and the dp x cp gradient group"),
        Reference(13, "expert parallelism carved out of data parallelism"),
    ],
    sections=[
        Section("Setup", [
            md(r'''
Two tools give this notebook its numbers. The **engine** builds the process groups and trains a tiny
Llama-style model on 4 real gloo processes (the same code runs on GPUs with NCCL). The **planner**
(`ultrascale.plan`, the command `ultrascale plan`) models memory and step time on a cluster of H100s,
calibrated on the playbook's measured runs.
'''),
            SETUP,
        ]),
        Section("One grid for every dimension", [
            md(r'''
Each technique of the previous parts needs a **group**: the ranks it communicates with. Data parallelism
averages gradients over its dp group, tensor parallelism all-reduces (or reduce-scatters) activations over
its tp group, pipeline parallelism sends activations to the next rank of its pp group, context parallelism
passes K/V around its cp group. Composing them means giving every rank one coordinate per dimension:

$$\text{rank} = ((d \cdot P + p) \cdot C + c) \cdot T + t \qquad\text{i.e.}\qquad
\text{ranks} = \texttt{arange(world).reshape(dp, pp, cp, tp)}$$

with $d, p, c, t$ the rank's coordinates and $P, C, T$ the pp, cp and tp sizes. A group is a line through this grid: the ranks that differ in one coordinate only. The **order** is a
decision about the network. tp is innermost, so a tp group is consecutive ranks - the GPUs of one node,
joined by NVLink, because tensor parallelism communicates inside every layer. dp is outermost: its one
gradient reduction per step (overlapped with backward) tolerates the slowest links. Megatron-LM and
torchtitan build the same kind of grid with other outer orders (torchtitan's device mesh is
`["pp", "dp_replicate", "dp_shard", "cp", "tp"]`, Megatron-LM's default order is `tp-cp-ep-dp-pp` from the
inside); all keep tp innermost. Gradients are averaged over dp and cp **together** (Part 10: both see different tokens of the same weights): that is the `dp_cp` group.
Expert parallelism is carved out of dp (Part 13), so it adds no dimension of its own to the world size.
'''),
            GRID_8,
            md(r'''
Read rank 5 off the grid: tp index 1, pp index 0, dp index 1. Its tp partner is rank 4 (stride 1), its
pipeline neighbour rank 7 (stride cp x tp = 2), its data-parallel partner rank 1 (stride pp x cp x tp = 4).
The same function builds the real communicators. On 4 real ranks, each rank builds the engine's context
(`build_context`) and all-reduces `10**rank` over each of its groups, so the sum spells out which ranks
actually took part:
'''),
            REAL_GROUPS,
        ]),
        Section("Composed layouts train like one process", [
            md(r'''
Once every technique asks the context for its group, they compose: the trainer applies them in a fixed
order (`ultrascale.parallel`: pipeline split, then tensor, then context parallelism on the model; then the
gradient owner for dp/ZeRO). Here the engine trains the same 8 sequences per step three ways: one process,
dp 2 x tp 2 on 4 ranks, and dp 2 x pp 2 on 4 ranks (two micro-batches, so the pipeline has something to
overlap):
'''),
            COMPOSED,
            md(r'''
The losses agree to float rounding. The mathematics does not change with the layout; only where the memory
goes and how long the step takes - which is what the rest of this notebook is about.
'''),
        ]),
        Section("Step 1: fit in memory", [
            md(r'''
The playbook's recipe for a configuration has three steps. The first: **make one training step fit**. A
70B model in bf16 mixed precision carries 16 bytes per parameter of states (bf16 weights and gradients
2 + 2, fp32 master weights and Adam's two moments 4 + 4 + 4: the planner's `bf16` recipe), plus the
activations. The planner's memory model per GPU:
'''),
            STEP1,
            md(r'''
Plain data parallelism replicates all the states and cannot fit at all. ZeRO-3 alone brings the states
down, but every GPU still runs the whole model on its micro-batch and keeps all the layers' activations. tp
divides both the weights and (with sequence parallelism) the activations of each layer; pp divides the
layers - but under 1F1B the first stage holds pp micro-batches in flight, each with its layers/pp
layers' activations, so pp divides the weights and not the activations (compare tp 4 with pp 2 and with
pp 4 above). Several layouts fit; memory does not choose among them.
'''),
        ]),
        Section("Step 2: reach the global batch", [
            md(r'''
The second step (Part 5): the global batch, here 1M tokens = 256 sequences, must be micro-batch x
accumulation x dp with whole numbers. Model parallelism lowers dp, so accumulation grows: on dp 8 x tp 4 x
pp 2, how the 256 sequences can be made, and what the micro-batch costs:
'''),
            STEP2,
            md(r'''
A larger micro-batch means more activations (and does not fit past the first), and fewer micro-batches
mean a larger pipeline bubble: with $m$ micro-batches on $p$ stages, 1F1B's idle time is $(p-1)/m$ of its
compute time (Part 11's bubble ratio).
Under pipeline parallelism the accumulation steps **are** the pipeline's micro-batches, so a small
micro-batch is doubly welcome.
'''),
        ]),
        Section("Step 3: maximise throughput", [
            md(r'''
Among what fits and reaches the batch, the planner predicts each layout's step time - compute from FLOPs,
each collective on the link it crosses (NVLink inside a node, InfiniBand between nodes), what overlaps
with what, the bubble - and sorts by tokens/s/GPU. It also knows how far to trust that sort: its
predictions of the published throughputs it is checked against (`ultrascale plan published`) are off by
up to about a fifth, so every layout within that band (printed below) of the fastest is one group it cannot order. `ultrascale plan` lists that group first, those with
room for the memory model's error first, then the simplest (fewer model-parallel ranks, fewer axes, no
recomputation, a lower ZeRO stage); after it, strictly by predicted speed. Below, the five fastest by
prediction, then the head of that group.
'''),
            STEP3,
            md(r'''
Why the winner wins, read from the breakdowns above: compute is nearly the same for every layout (the same
FLOPs split over 64 GPUs; the slowest pipeline stage sets the pace), so the ranking is decided by what is
**not** hidden. tp 8 pays more than twice the tensor-parallel communication of tp 4: it sits on the
critical path of every layer, and its share of the work per collective shrinks as tp grows. Longer
pipelines shrink dp and its gradient reduction, but add bubble, and here they also make every
tensor-parallel collective dearer (`sync`): the framework whose runs calibrate this model (nanotron)
reads the shape of every tensor a pipeline stage receives on the host, which stops the CPU from running
ahead of the GPU, so the collectives after it are paid as they are launched - eight times the 20 µs per
ring step they cost without a pipeline (the constants printed last). The winner is the balance: tp 8 inside a node and no pipeline,
dp for the rest, with ZeRO-1 sharding the optimizer states (ZeRO-2 is as fast to within 1%). A framework whose pipeline never synchronizes the host would shift the balance
towards the pipelined layouts; `--framework` says which one is planned for.
'''),
        ]),
        Section("How far to trust the planner", [
            md(r'''
A planner is worth what its predictions are worth. The playbook published thousands of measured runs on
H100s (1B to 80B models, 1 to 64 nodes, every combination of dp, tp, pp, ZeRO and micro-batch); the
planner ships them and compares itself: does it predict which runs fit, how much memory they take, and -
what a search needs - **the order** of their throughputs within each (model, nodes) group, by Spearman's
rank correlation (1: the same order, 0: unrelated):
'''),
            VALIDATE,
            MEASURED,
            md(r'''
The ranking is good (a mean Spearman above 0.8; the weakest groups are 8B on 1 and 4 nodes and 80B on 8
and 32 nodes, where a few measured runs are several times slower than any collective explains), and the
medians of predicted over measured throughput are within [0.8, 1.25] at every node count. Bytes and FLOPs
alone do not get there: without its synchronization costs the model predicts the median run 3.6 times too
fast at 32 nodes, 14 times at 64. It adds three, the constants printed in step 3: every ring step of a
collective the compute waits for (tensor parallelism) costs 20 µs (the framework's, `calibration.py`); eight
times that inside a pipeline, because nanotron's pipeline receive reads the incoming tensor's shape on the
host, which stops the CPU from running ahead of the GPU; and each micro-batch pays 0.2 ms times the square
of the job's node count (0.82 s at 64 nodes, the same for the 1B and the 80B model: a cost of the cluster,
`hardware.py`, not of bytes). Calibrated on two of the models, they come out the same and predict the other
two as well (the cross-validation above, `ultrascale plan validate --cross-validate`). Single runs still
stray: at 4-32 nodes the 90th percentile of predicted over measured is 2.9 to 4.4, a tenth of the runs
there being 3 times slower than predicted or more. Use the planner to **rank and prune**, then measure the
few best layouts on the real cluster before a long run - especially at scale.
'''),
        ]),
        Section("From the plan to a training run", [
            md(r'''
`ultrascale plan ... --emit-config plan.toml` writes the chosen layout in the engine's own configuration
format, which `ultrascale train --config plan.toml` runs. Scaled down to what runs here: the tiny model,
4 "GPUs" and 8 sequences of 32 tokens. For a model this small nothing is worth splitting: the fastest
layouts lie within the time model's error of each other, so the planner's free choice is the simplest of
them: plain data parallelism. Pinning `--tp 2` asks for
its best layout with tensor parallelism, which is then written and trained:
'''),
            EMIT,
        ]),
    ],
    exercises=[
        Exercise(
            title="Where a rank sits on the grid",
            instructions=r'''
Write `grid_position(rank, dp, pp, cp, tp)` returning `(coords, groups)` for a global rank on the engine's
grid `arange(dp * pp * cp * tp).reshape(dp, pp, cp, tp)` (tp innermost):

- `coords`: `{"dp": ..., "pp": ..., "cp": ..., "tp": ...}`, the rank's index along each dimension;
- `groups`: `{"tp": [...], "dp": [...], "pp": [...]}`, the global ranks of its tp, dp and pp groups, each
  listed by increasing index along that dimension (the rank at pp index i is the i-th pipeline stage).

The check compares with the engine's grid for layouts of 8 to 48 ranks, then runs your function on 4 real
ranks, each computing its own place, next to the groups the engine built on that rank.
''',
            starter=r'''
def grid_position(rank, dp, pp, cp, tp):
    """(coords, groups) of `rank` on arange(dp*pp*cp*tp).reshape(dp, pp, cp, tp)."""
    # TODO: peel the coordinates off the rank, innermost (tp) first; then, for each of tp / dp / pp,
    # the ranks that differ from this one only along that dimension
    raise NotImplementedError
''',
            solution=r'''
def grid_position(rank, dp, pp, cp, tp):
    """(coords, groups) of `rank` on arange(dp*pp*cp*tp).reshape(dp, pp, cp, tp)."""
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    coords, rem = {}, rank
    for name in ("tp", "cp", "pp", "dp"):  # innermost first
        coords[name] = rem % sizes[name]
        rem //= sizes[name]
    strides = {"tp": 1, "cp": tp, "pp": cp * tp, "dp": pp * cp * tp}
    groups = {}
    for name in ("tp", "dp", "pp"):
        first = rank - coords[name] * strides[name]  # the same rank with index 0 along `name`
        groups[name] = [first + i * strides[name] for i in range(sizes[name])]
    return coords, groups
''',
            check=r'''
from ultrascale.series.checks import part14
part14.exercise_1(grid_position)
''',
            hints=[
                "A rank is a number written in mixed radix with digits (dp, pp, cp, tp), tp the last digit: "
                "`rank % tp` is the tp index, then `rank //= tp` and continue with cp, pp, dp.",
                "Moving one step along a dimension moves the rank by the product of the sizes inside it: "
                "1 for tp, tp for cp, cp x tp for pp, pp x cp x tp for dp. A group starts at "
                "`rank - index * stride`.",
                "`groups[name] = [first + i * stride for i in range(size)]` with `first = rank - coords[name] * "
                "stride`, strides `{'tp': 1, 'cp': tp, 'pp': cp * tp, 'dp': pp * cp * tp}`.",
            ],
        ),
        Exercise(
            title="A small configuration search",
            instructions=r'''
Write `best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit)` returning the
best `(dp, pp, tp)` for `gpus` GPUs, or `None` when nothing fits. `memory_per_gpu(dp, pp, tp)` and
`tokens_per_s(dp, pp, tp)` are given functions (bytes per GPU, tokens/s per GPU). The rules, in the
playbook's order:

1. **Valid and fits**: `dp * pp * tp == gpus`; `tp <= 8` (one node) and `tp` divides `heads`; `pp`
   divides `layers`; `dp` divides the `sequences` of the global batch; `memory_per_gpu(...) <= limit`.
2. **Fastest**: among those, the highest `tokens_per_s`.
3. **Ties go to the simpler layout**: every layout within 1% of the fastest counts as a tie, 1% of the
   fastest's speed: `tokens_per_s >= 0.99 * best` (a layout exactly 1% slower ties); among them
   take the fewest pipeline stages, then the fewest tp ranks. (The planner's own band is its whole error,
   ±17.7%, and it puts memory headroom first inside it: a planner's caution; yours is the rule.)

The check first uses hand-made functions where each rule decides the answer, then the planner's own
memory and time models (Llama 3 8B and 70B on H100, H200 and A100 clusters, one sequence per micro-batch,
ZeRO-1, 1F1B), and compares your choice with the same rule over `ultrascale.plan.search`'s layouts, pinned
to the same knobs, sorted by its predicted speed (`SearchResult.by_time`).
''',
            starter=r'''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    """(dp, pp, tp) with the highest tokens_per_s among the valid layouts that fit (ties within 1%:
    fewest pp, then fewest tp), or None if nothing fits."""
    # TODO: enumerate (tp, pp), derive dp, keep what is valid and fits; then rank
    raise NotImplementedError
''',
            solution=r'''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    """(dp, pp, tp) with the highest tokens_per_s among the valid layouts that fit (ties within 1%:
    fewest pp, then fewest tp), or None if nothing fits."""
    fits = []
    for tp in range(1, 9):
        for pp in range(1, gpus + 1):
            if gpus % (tp * pp) or heads % tp or layers % pp:
                continue
            dp = gpus // (tp * pp)
            if sequences % dp == 0 and memory_per_gpu(dp, pp, tp) <= limit:
                fits.append((dp, pp, tp))
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    ties = [lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best]
    return min(ties, key=lambda lay: (lay[1], lay[2]))
''',
            check=r'''
from ultrascale.series.checks import part14
part14.exercise_2(best_layout)
''',
            hints=[
                "Loop over tp (1..8) and pp; dp is what is left, `gpus // (tp * pp)`, when it divides. Filter "
                "with every rule of step 1 before ranking anything.",
                "Ranking is two passes: first the best throughput among what fits, then the layouts with at "
                "least 99% of it; among those, `min(..., key=lambda lay: (pp, tp))`.",
                "`ties = [lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best]` then "
                "`return min(ties, key=lambda lay: (lay[1], lay[2]))`, and `None` when `fits` is empty.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            "On the engine's grid dp 2 x pp 2 x cp 1 x tp 2 (8 ranks, tp innermost), which ranks form rank 5's "
            "pipeline group?",
            ["[4, 5]", "[5, 7]", "[1, 5]", "[4, 6]"],
            1,
            "Rank 5 is dp 1, pp 0, tp 1; pipeline neighbours are cp x tp = 2 ranks apart, so [5, 7] "
            "([4, 5] is its tp group, [1, 5] its dp group).",
        ),
        QuizQuestion(
            "Why is tp the innermost dimension of the grid?",
            ["So that tp groups are consecutive ranks on one node, where NVLink carries tensor parallelism's "
             "per-layer collectives",
             "Because tensor parallelism needs the fewest GPUs",
             "So that data parallelism gets the fastest links",
             "The order does not matter for performance"],
            0,
            "tp communicates inside every layer, on the critical path; dp communicates once per step, overlapped "
            "with backward, and tolerates the inter-node links.",
        ),
        QuizQuestion(
            "Several layouts of 64 GPUs fit in memory and reach the global batch. How does the playbook's recipe "
            "choose among them?",
            ["The one that uses the least memory",
             "The one with the largest tensor-parallel degree",
             "The one with the highest throughput (tokens/s per GPU), measured or predicted",
             "The one with the most data-parallel replicas"],
            2,
            "Memory (step 1) and the batch (step 2) only filter; step 3 ranks what is left by throughput.",
        ),
        QuizQuestion(
            "The planner's ranking of the playbook's runs correlates well with the measured one and its median "
            "error is within 25% at every node count, yet a tenth of the runs at 4-32 nodes are 3 or more times "
            "slower than predicted. What follows?",
            ["The planner is useless at scale",
             "Use it to rank and prune layouts, then measure the best few on the real cluster",
             "Trust its absolute numbers and skip measuring",
             "Only use layouts on one node"],
            1,
            "Order and the typical run are what a search needs; single runs at scale stray for reasons no model "
            "of bytes and FLOPs captures, so the final choice is measured.",
        ),
    ],
)
