"""Part 12 of the series: interleaved, zero-bubble and DualPipe pipeline schedules.

The source of notebooks/12_interleaved_and_zero_bubble.ipynb (build it with
`python notebooks/src/build.py 12`). The engine trains on 4 real gloo processes
with 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV; every figure is measured in the notebook:
the losses against one process, the recorded timelines drawn as Gantt charts, the
bubble measured (on stages paced to fixed durations) and simulated, and DeepSeek's
published DualPipe formula against the simulator's count.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import os
import tempfile

import torch
from IPython.display import Image, display

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import get_preset
from ultrascale.parallel.pipeline import draw
from ultrascale.parallel.pipeline.partition import rank_chunks, split
from ultrascale.parallel.pipeline.schedules import Action, build, schedule
from ultrascale.parallel.pipeline.simulate import simulate
from ultrascale.series.ranks import on_ranks
from ultrascale.testing.compare import train_on
from ultrascale.train.startup import check_run

torch.set_num_threads(1)
WORLD = 4                                   # 4 real processes (gloo, this CPU), one pipeline rank each
MODEL = get_preset("tiny", layers=8)        # 8 transformer blocks
OUT = tempfile.mkdtemp()
''')

CHUNKS = code(r'''
# The engine's partition: 8 blocks over p = 4 ranks, as 1 stage per rank and as v = 2 chunks per rank.
for v in (1, 2):
    stages = split(MODEL.layers, WORLD, v)
    print(f"v = {v}: " + "; ".join(f"rank {r} holds {[list(c) for c in rank_chunks(stages, r, WORLD, v)]}"
                                   for r in range(WORLD)))
''')

INTERLEAVED_SIM = code(r'''
p, m = 4, 8
print("interleaved, v = 2, rank 0:", " ".join(map(repr, build("interleaved", p, m, 2)[0])), "(Fk.1: chunk 1)")
# The simulator at unit cost per full model (a chunk of v costs 1/v): the bubble, and the messages sent.
for v in (1, 2, 4):
    name = "1f1b" if v == 1 else "interleaved"
    acts = schedule(name, p, m, v)
    tl = simulate(acts, p, v, t_f=1.0 / v, t_b=2.0 / v, t_w=0.0)
    messages = sum(a.kind.startswith("SEND") for rank in acts for a in rank)
    print(f"v = {v}: bubble ratio {tl.bubble_ratio:.4f}, (p - 1)/(v m) = {(p - 1) / (v * m):.4f}; "
          f"point-to-point messages per step {messages}")
''')

ZB_SIM = code(r'''
p, m = 4, 8
for rank, acts in enumerate(build("zero-bubble", p, m)):
    print(f"ZB-H1 rank {rank}: " + " ".join(map(repr, acts)))
# F, I (input gradient) and W (weight gradient) each cost 1: a full backward B = I + W costs 2.
for name in ("1f1b", "zero-bubble"):
    tl = simulate(schedule(name, p, m), p, t_f=1.0, t_b=1.0, t_w=1.0)
    print(f"{name:11s}: idle time per rank {tl.bubble_time:g}, bubble ratio {tl.bubble_ratio:.4f}, "
          f"micro-batches in flight {tl.peak_in_flight}")
''')

DUALPIPE_SIM = code(r'''
p, m = 4, 8
print("DualPipeV, rank 0:", " ".join(map(repr, build("dualpipev", p, m)[0])), "(Fk.1: the way back up)")
# The same model on the same 4 ranks: a 1F1B stage costs F = I = W = 1; a DualPipeV chunk is half a stage.
charts = []
for name, v, cost in (("1f1b", 1, 1.0), ("zero-bubble", 1, 1.0), ("dualpipev", 2, 0.5)):
    tl = simulate(schedule(name, p, m), p, v, t_f=cost, t_b=cost, t_w=cost, vshape=name == "dualpipev")
    held = [n / v for n in tl.peak_in_flight]          # in micro-batches of a whole stage
    print(f"{name:11s}: idle time per rank {tl.bubble_time:g}, bubble ratio {tl.bubble_ratio:.4f}, "
          f"stages' activations in flight {held}")
    charts.append(os.path.join(OUT, f"{name}_sim.png"))
    draw.draw(draw.spans_from_timeline(tl), f"{name}, pp = 4, m = 8: bubble {tl.bubble_ratio:.3f}", charts[-1])
display(*(Image(filename=c) for c in charts))
''')

DUALPIPE_FORMULA = code(r'''
# DeepSeek's formulas at the same costs: a 1F1B stage F = 1, W = 1, B = I + W = 2; PP counts stages.
F, B, W = 1.0, 2.0, 1.0
print(f"1F1B      (PP - 1)(F + B)          = {(WORLD - 1) * (F + B):g}   (PP = {WORLD} stages)")
print(f"ZB1P      (PP - 1)(F + B - 2W)     = {(WORLD - 1) * (F + B - 2 * W):g}   (PP = {WORLD} stages)")
f, b, w = F / 2, B / 2, W / 2        # DualPipeV: 2p = 8 stages, each chunk half a 1F1B stage
pair = f + b                         # F&B here: a forward and a backward, one after the other (no overlap)
pp = 2 * WORLD
print(f"DualPipeV (PP/2 - 1)(F&B + B - 3W) = {(pp // 2 - 1) * (pair + b - 3 * w):g}   "
      f"(PP = {pp} stages, F&B = F + B = {pair:g})")


def as_one_slot(actions):
    """Each overlapped pair as one slot that starts once both its inputs are in: the backward's gradient
    is received before the forward runs (DeepSeek's runtime receives both, then computes both), where
    the engine only posts that receive and runs the forward as soon as its own input is there."""
    out = []
    for rank in actions:
        posted, seq = set(), []
        for a in rank:
            if a.kind == "POST_B":
                posted.add((a.micro, a.chunk))
                seq.append(Action("RECV_B", a.micro, a.chunk))
            elif a.kind == "RECV_B" and (a.micro, a.chunk) in posted:
                posted.discard((a.micro, a.chunk))
            else:
                seq.append(a)
        out.append(seq)
    return out


acts = schedule("dualpipev", WORLD, 8)
for label, lists in (("the engine's order (a forward goes when its input is in)", acts),
                     ("each pair one slot, waiting for both inputs", as_one_slot(acts))):
    tl = simulate(lists, WORLD, 2, t_f=f, t_b=b - w, t_w=w, vshape=True)
    print(f"simulator, DualPipeV, {label}: idle time per rank {tl.bubble_time:g}")
''')

ENGINE = code(r'''
RUNS = {"1f1b": 1, "interleaved": 2, "zero-bubble": 1, "dualpipev": 2}   # schedule -> chunks per rank
M = 8


UNIT = 0.25   # seconds: what a 1F1B stage's forward, input gradient and weight gradient each last in step 2


def paced_training(cfg, unit):
    """On each rank: train `cfg` with the engine, its last step paced. Each compute action of that step
    (F, B, I, W) runs the real layers, then waits until it has lasted its planned time: `unit` for a
    stage's F, I or W, 2 units for a full B, a v-th of that for a chunk. The data and the real messages
    flow through the engine's pipeline runtime as ever; only the durations are fixed, so the 4
    processes sharing this CPU's cores do not stretch each other's compute. Returns the rank's record
    and the real compute time of each of its paced actions (before the wait), by kind."""
    import contextlib
    import re
    import time

    from ultrascale.parallel.pipeline import runtime
    from ultrascale.testing.compare import RunRecord
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import run_training

    v = 2 if cfg.parallel.pp_schedule == "dualpipev" else cfg.parallel.pp_chunks
    cost = {"F": unit / v, "I": unit / v, "W": unit / v, "B": 2 * unit / v}
    span, run_step, steps, computed = runtime.span, runtime.PipelineRuntime.run, [0], {kind: [] for kind in cost}

    @contextlib.contextmanager
    def paced(name):          # the runtime runs every action inside span("pp:<action>")
        kind = re.match(r"pp:([A-Z_]+)\d", name)
        start = time.perf_counter()
        with span(name):
            yield
        if kind and kind.group(1) in cost:
            computed[kind.group(1)].append(time.perf_counter() - start)
            time.sleep(max(0.0, start + cost[kind.group(1)] - time.perf_counter()))

    def step(self, micro_batches):
        steps[0] += 1
        runtime.span = paced if steps[0] == cfg.train.steps else span
        return run_step(self, micro_batches)

    runtime.PipelineRuntime.run = step
    try:
        return RunRecord.of(run_training(cfg, worker_context(cfg.parallel))), computed
    finally:               # the processes are reused: leave the engine as it was
        runtime.span, runtime.PipelineRuntime.run = span, run_step


def run(name, v, world=WORLD):
    """Train 2 steps on `world` ranks, step 2 paced (one process when world is 1, not paced); every
    rank's record, the recorded step 2 (its timeline in seconds and on the engine's schedule clock), and
    the real compute time of its actions by kind."""
    trace = os.path.join(OUT, f"{name}.json") if world > 1 else ""
    parallel = ParallelConfig(pp=world, pp_schedule=name, pp_chunks=v) if world > 1 else ParallelConfig()
    train = TrainConfig(steps=2, seq_len=128, micro_batch=2 if world > 1 else 2 * M,
                        grad_accum=M if world > 1 else 1, seed=3, progress=False, pp_trace=trace)
    cfg = check_run(RunConfig(model=MODEL, parallel=parallel, train=train), world)
    if world == 1:
        return [train_on(cfg, 1)], None, None
    ranks = on_ranks(world, paced_training, cfg, UNIT)
    computed = {kind: [t for _, times in ranks for t in times[kind]] for kind in "FBIW"}
    return [record for record, _ in ranks], draw.read_trace(trace), computed


single, _, _ = run("1f1b", 1, world=1)
print("one process        :", " ".join(f"{x:.6f}" for x in single[0].losses))
results = {}
for name, v in RUNS.items():
    results[name] = run(name, v)
    losses = results[name][0][0].losses
    worst = max(abs(a - b) / b for a, b in zip(losses, single[0].losses))
    print(f"pp = 4 {name:12s}: " + " ".join(f"{x:.6f}" for x in losses) + f"   (worst relative difference {worst:.1e})")
''')

GANTT = code(r'''
for name, v in RUNS.items():
    label = f"{name}, pp = 4" + (f", v = {v}" if v > 1 else "") + f", m = {M}"
    # The schedule as planned: the simulator at F = 1, I = 1, W = 1 per stage (a chunk costs 1/v of that).
    tl = simulate(schedule(name, WORLD, M, v), WORLD, v, t_f=1.0 / v, t_b=1.0 / v, t_w=1.0 / v,
                  vshape=name == "dualpipev")
    planned = os.path.join(OUT, f"{name}_simulated.png")
    draw.draw(draw.spans_from_timeline(tl), f"{label}: simulated, bubble {tl.bubble_ratio:.3f}", planned)
    # The same schedule as it ran: the engine's recorded step 2, in seconds.
    spans = draw.trace_spans(results[name][1])
    recorded = os.path.join(OUT, f"{name}_recorded.png")
    draw.draw(spans, f"{label}: recorded, bubble {draw.measured_bubble_ratio(spans):.3f}", recorded)
    display(Image(filename=planned), Image(filename=recorded))
''')

EXPLORER = code(r'''
# A pipeline schedule explorer, on the engine's schedules and its simulator (forward 1, backward 2).
# The figure for 1F1B with p = 4, m = 8; in Jupyter or Colab the controls below it redraw it.
from ultrascale.series.widgets import pipeline_explorer

explorer = pipeline_explorer(schedule="1f1b", p=4, m=8, v=2)
''')

BUBBLE = code(r'''
def mean_ms(times):
    return 1e3 * sum(times) / len(times)


for name, v in RUNS.items():
    records, trace, computed = results[name]
    spans, clocked = draw.trace_spans(trace), draw.trace_spans(trace, clock=True)   # seconds; the engine's clock
    # The simulator at the paced costs: F = I = W = UNIT per stage, a chunk a v-th of it.
    sim = simulate(schedule(name, WORLD, M, v), WORLD, v, t_f=UNIT / v, t_b=UNIT / v, t_w=UNIT / v,
                   vshape=name == "dualpipev")
    lasted = {kind: [e - s for rank in spans for _, k, s, e in rank if k == kind] for kind in "FBIW"}
    step = max(e for rank in spans for *_, e in rank) - min(s for rank in spans for _, _, s, _ in rank)
    took = ", ".join(f"{kind} {mean_ms(lasted[kind]):.0f} ms" for kind in "FBIW" if lasted[kind])
    real = ", ".join(f"{kind} {mean_ms(computed[kind]):.1f}" for kind in "FBIW" if computed[kind])
    print(f"{name:11s}: bubble simulated {sim.bubble_ratio:.3f}, on the engine's clock "
          f"{draw.measured_bubble_ratio(clocked):.3f}, measured {draw.measured_bubble_ratio(spans):.3f}"
          f"   (mean {took}; computing {real} ms; step {1e3 * (step - sim.makespan):.0f} ms longer than simulated)")
for name, v in RUNS.items():
    acts = [f"{r.memory[-1]['activations'] / 2**20:.1f}" for r in results[name][0]]
    print(f"{name:11s}: peak activations per rank {acts} MiB")
''')


EPISODE = Episode(
    number=12,
    title="Interleaved, Zero-Bubble and DualPipe Schedules",
    slug="interleaved_and_zero_bubble",
    subtitle="Shrinking the pipeline bubble: virtual stages, and a backward split in two",
    overview=[
        "Interleaved 1F1B: each rank holds v chunks of layers (virtual stages), the bubble falls to (p - 1)/(v m)",
        "The price of interleaving: about v times more point-to-point messages, and more activations in flight",
        "Zero bubble (ZB-H1): the backward split into the input gradient (I), which the previous stage waits "
        "for, and the weight gradient (W), which nobody waits for and which fills the bubble",
        "DualPipe (DeepSeek-V3) in its cut-in-half V form: two chunks per rank, down the ranks and back up, "
        "forwards paired with backwards; DeepSeek's bubble formula against the simulator, and what each counts",
        "The engine trains with each schedule on 4 real ranks: same losses as one process, its recorded "
        "timelines drawn as Gantt charts, the bubble measured on paced stages against the simulator",
    ],
    references=[
        Reference(11, "pipeline stages, AFAB, 1F1B and the bubble (p - 1)/m"),
        Reference(2, "what activations a layer keeps for its backward"),
    ],
    sections=[
        Section("Virtual stages", [
            md(r'''
In Part 11 the bubble was $(p-1)/m$: the fill and drain take $p - 1$ slots of one stage's work per
micro-batch. Interleaving (Megatron-LM, Narayanan et al. 2021) makes each slot shorter. The model is cut
into $p \cdot v$ **virtual stages** instead of $p$, and rank $r$ holds $v$ of them, the **chunks**
$r, r + p, r + 2p, \dots$ (chunk $c$ is virtual stage $c \cdot p + r$). A micro-batch goes through ranks
$0 \to 1 \to \dots \to p-1$, then back to rank 0 for chunk 1, and so on: $v$ laps of the ring.
'''),
            SETUP,
            CHUNKS,
            md(r'''
A chunk is $1/v$ of a stage's work, so the fill and drain, still $p - 1$ steps long, each cost a $v$-th of
what they did: the bubble becomes $(p-1)/(v\,m)$. Every lap crosses every rank boundary, so each
micro-batch now sends $2(p\,v - 1)$ point-to-point messages (activations forward, gradients back) instead
of $2(p - 1)$: about $v$ times more. Megatron's schedule runs forwards of $p$
micro-batches on chunk 0, then the same $p$ on chunk 1, ... (so $m$ must be a multiple of $p$ here), and
its warm-up is longer than 1F1B's: each rank keeps more activations in flight.
'''),
            INTERLEAVED_SIM,
        ]),
        Section("Zero bubble: split the backward", [
            md(r'''
A layer's backward computes two things: the gradient of its **input**, $\partial L/\partial x = g\,W$, which
the previous stage is waiting for, and the gradient of its **weights**, $\partial L / \partial W = g^\top x$,
which nobody needs before the optimizer step. Qi et al. (2023) split the backward into **I** and **W**:
send I's result on at once, and run W later, in time the rank would otherwise spend idle. W needs the
layer's input $x$ and output gradient $g$, so those stay in memory until W runs.

**ZB-H1** keeps 1F1B's memory (at most $p - r$ micro-batches between F and I on rank $r$) and moves W
passes into the cool-down. With $t_F = t_I = t_W$ its idle time is $(p-1)(t_F + t_I - t_W)$ against 1F1B's
$(p-1)(t_F + t_I + t_W)$: a third. Schedules that also reorder more freely (ZB-H2, DeepSeek's DualPipe)
reach nearly zero at the cost of more memory.

In the simulator's count below, a micro-batch is in flight from its F to its W. That is an upper bound: at
I a rank can free everything but what W still needs (the inputs of the linear layers and their output
gradients), and the engine's activation meter, which counts saved activations from F to I, reads the same
as 1F1B's further down. The linear layers' inputs held for W come on top of it.
'''),
            ZB_SIM,
        ]),
        Section("DualPipe: the pipeline folded in a V", [
            md(r'''
DeepSeek-V3's **DualPipe** feeds micro-batches from both ends of the pipeline: every rank holds two stages,
stage $i$ of one direction and stage $p - 1 - i$ of the other (two copies of the weights), so one
direction's warm-up fills the other's bubble. Its steady state pairs the **forward of one micro-batch with
the backward of another**: on a GPU the two run as one step, each one's communication (the pipeline's
sends, MoE's all-to-alls) hidden behind the other's compute. Around the steady state the backward is split
into I and W, as in zero bubble.

The engine runs its **cut-in-half** form, DualPipeV (Sea AI Lab, now in DeepSeek's repository): the model
is cut into $2p$ stages, and rank $r$ holds stage $r$ (chunk 0, on the way down) and stage $2p - 1 - r$
(chunk 1, on the way back up). A micro-batch goes $0 \to 1 \to \dots \to p - 1$, turns inside rank
$p - 1$ and comes back up to rank 0, which holds the embedding and the loss. One copy of the weights, the
same chunked runtime as interleaving, and the same idea: while rank 0 waits for micro-batch $k$ to come
back, it pushes others down. It needs $m \ge 2p$ micro-batches to fill the V.

The price is memory: every rank holds $2p + 1$ chunks' activations at its peak ($p + 1/2$ stages' worth),
where 1F1B's rank $r$ holds $p - r$. The simulator plays the three schedules on the same 4 ranks at the
same costs, a 1F1B stage's F, I and W each 1 (a DualPipeV chunk half of that):
'''),
            DUALPIPE_SIM,
            md(r'''
DeepSeek's DualPipe repository gives the bubble of each schedule per device, counted on the same number
of stages $PP$, where $F$ is a chunk's forward, $B$ its full backward, $W$ its weight-gradient half, and
$F\&B$ the time of one overlapped pair, a forward and a backward of two micro-batches:

| schedule | bubble per device | devices |
|---|---|---|
| 1F1B | $(PP-1)(F+B)$ | $PP$ |
| ZB1P (ZB-H1) | $(PP-1)(F+B-2W)$ | $PP$ |
| DualPipeV | $(PP/2-1)(F\&B+B-3W)$ | $PP/2$ |

On our 4 ranks 1F1B and ZB-H1 run $PP = 4$ stages, DualPipeV $PP = 8$ stages of half the layers. Below, the
formulas at the costs above ($F\&B = F + B$: on this CPU, as in the simulator, nothing overlaps), and the
simulator playing DualPipeV twice: in the engine's order, and with each pair made one slot that starts
only when both its inputs are in.
'''),
            DUALPIPE_FORMULA,
            md(r'''
For 1F1B and ZB-H1 formula and simulator agree (9 and 3). For DualPipeV the formula gives 3, the same as
ZB-H1 on these ranks, and the simulator of the engine's order 1.5, half of it. They count two different
executions of the same order of actions. In DeepSeek's runtime an overlapped pair is one step: it receives
the forward's activation and the backward's gradient, waits for both, then computes both (on a GPU, that is
what lets each hide the other's communication). The engine posts the gradient's receive, runs the forward
as soon as its own input is there, and waits for the gradient only before the backward, so a forward fills
time the pair would spend waiting. Played as one slot that waits for both inputs, the simulator gives
the formula's 3 exactly. Neither count has overlap: on a GPU $F\&B$ is shorter than $F + B$, each one's
messages hidden behind the other's compute, and the formula's figure falls with it. Either way DualPipeV
idles a third of 1F1B's time or less, for more memory: every rank holds what 1F1B's rank 0 holds, and
half a stage's activations more.
'''),
        ]),
        Section("On real ranks, drawn", [
            md(r'''
The engine runs every schedule from the same action lists (`ultrascale train --nproc 4 --pp 4
--pp-schedule interleaved --pp-chunks 2 --pp-trace FILE`); for zero bubble it swaps every linear layer for
one whose backward can leave the weight gradient for later. Each gives the losses of one process:
'''),
            ENGINE,
            md(r'''
Four processes on this CPU's few cores, shared with whatever else runs, stretch each other's compute: a
recorded timeline would then show the contention, not the schedule. So step 2 is **paced**: every F, I
and W runs its real layers and then waits until it has lasted `UNIT` seconds (a full B twice that, a
chunk a $v$-th), while the activations and gradients travel through the engine's runtime in its real
messages. Waiting costs no CPU, so the ranks no longer compete, and the durations are the ones the
simulator is given, as on a GPU per stage where each stage's compute takes its own fixed time.

For each schedule, two Gantt charts: the action lists played by the simulator at those costs (what the
schedule intends), then step 2 as the engine recorded it on the 4 processes, in seconds (`ultrascale
pp-schedule --trace FILE --out chart.png` draws the same). Forwards blue, full backwards green, input
gradients light green, weight gradients red (zero bubble splits every backward; DualPipeV some), idle
time blank.
'''),
            GANTT,
            md(r'''
The bubble of each recorded step beside the simulator's at the paced costs (the mean duration of each
kind of action shows the pacing held; "computing" is the part of it the real layers took), then the
activations each rank held at its peak (the engine's meter, from F to B or I). Between the two, the
bubble on the engine's **schedule clock**, recorded beside the seconds (`--pp-trace`): a Lamport clock in
which every action lasts its unit cost and every message carries the clock its sender was at. Made by
the runtime's real order of actions and the messages it really waited for, it cannot be stretched by the
machine, and it equals the simulator's: the runtime waits on nothing the schedule does not (for
DualPipeV, each pair's posted receive is waited for only after the forward). The seconds agree within a
few hundredths on a quiet machine: what they add, the tens of milliseconds by which each step outlasts
the simulated one, is the time of the messages and of waking a waiting process, small against
`UNIT` = 250 ms, and more when other work shares the cores. That is also the price interleaving pays $v$ times over: with the real chunks of a few
milliseconds printed as "computing", the messages would weigh as much as the compute, so interleave
only where a chunk's compute is large against a message. Its memory price shows on every rank: more
activations held than under 1F1B.
'''),
            BUBBLE,
            md(r'''
Now play with the schedules yourself: for each, the Gantt chart of every rank and its bubble as the
simulator plays the engine's own action lists, beside the closed formula the planner uses. Raise $m$ and
watch 1F1B's bubble fall as $(p-1)/m$; switch to interleaved and raise $v$; compare zero bubble and
DualPipeV at the same $m$ (DualPipeV needs $m \ge 2p$). (Without a widget front-end the cell shows the
figure for the values it was called with; `explorer.update(schedule="zero-bubble", m=16)` draws another.)
'''),
            EXPLORER,
        ]),
    ],
    exercises=[
        Exercise(
            title="Which chunk holds which layers, in a loop and in a V",
            instructions=r'''
Write `layer_assignment(n_layers, p, v)`: for each rank $r$, for each of its chunks $c$, the list of layer
ids it holds. The layers are cut, in order, into $p \cdot v$ virtual stages of equal size, the first
$n \bmod (p\,v)$ virtual stages taking one layer more; chunk $c$ of rank $r$ is virtual stage $c \cdot p + r$.
Return `[[chunk 0 layers, chunk 1 layers, ...] for each rank]`. The check compares with the engine's
partition for several (layers, p, v), uneven ones included.

Then fold it in a V, as DualPipeV does: write `v_placement(p)`, for each rank $r$ the pair
`[stage of chunk 0, stage of chunk 1]` of its two stages among $0 \dots 2p-1$, chunk 0 carrying the
micro-batches down the ranks ($0 \to p-1$) and chunk 1 bringing them back up ($p-1 \to 0$). The check
compares with the engine's placement and plays your placement's messages: consecutive stages must sit on
neighbouring ranks, or on the same rank at the turn of the V.
''',
            starter=r'''
def layer_assignment(n_layers, p, v):
    """[[layer ids of chunk c] for c in range(v)] for each rank r in range(p)."""
    # TODO: sizes of the p*v virtual stages, their layers in order, then deal them to (rank, chunk)
    raise NotImplementedError


def v_placement(p):
    """[[stage of chunk 0, stage of chunk 1] for each rank r in range(p)], stages 0 .. 2p-1."""
    # TODO: chunk 0 goes down the ranks, chunk 1 comes back up
    raise NotImplementedError
''',
            solution=r'''
def layer_assignment(n_layers, p, v):
    """[[layer ids of chunk c] for c in range(v)] for each rank r in range(p)."""
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]


def v_placement(p):
    """[[stage of chunk 0, stage of chunk 1] for each rank r in range(p)], stages 0 .. 2p-1."""
    return [[r, 2 * p - 1 - r] for r in range(p)]
''',
            check=r'''
from ultrascale.series.checks import part12
part12.exercise_1(layer_assignment)
part12.exercise_v(v_placement)
''',
            hints=[
                "First forget the ranks: cut the layers into p·v consecutive groups, the first n mod (p·v) one larger.",
                "`divmod(n_layers, p * v)` gives the base size and how many groups take one more.",
                "Then rank r's chunk c is group c·p + r: `[[groups[c * p + r] for c in range(v)] for r in range(p)]`.",
                "In the V, chunk 0 of rank r is stage r; stage p, the first on the way back, is on the last rank, "
                "and rank r's second stage is 2p - 1 - r.",
            ],
        ),
        Exercise(
            title="Split a linear layer's backward",
            instructions=r'''
For $y = x W^\top + b$ ($x$: `[batch, seq, in]`, $W$: `[out, in]`), write the two halves of the backward
pass that zero-bubble schedules run at different times, given $g = \partial L / \partial y$:

- `input_grad(grad_out, weight)`: $\partial L / \partial x$, what the previous stage waits for (I);
- `weight_grad(x, grad_out)`: `(grad_w, grad_b)`, which can wait (W).

The check compares with torch autograd on the same layer, then runs a backward that computes only input
gradients through your `input_grad`, and applies your `weight_grad` afterwards: the gradients must be
autograd's.
''',
            starter=r'''
def input_grad(grad_out, weight):
    """dL/dx of y = x W^T + b."""
    # TODO
    raise NotImplementedError


def weight_grad(x, grad_out):
    """(dL/dW, dL/db) of y = x W^T + b, over every token."""
    # TODO: flatten the batch and sequence dimensions into one
    raise NotImplementedError
''',
            solution=r'''
def input_grad(grad_out, weight):
    """dL/dx of y = x W^T + b."""
    return grad_out @ weight


def weight_grad(x, grad_out):
    """(dL/dW, dL/db) of y = x W^T + b, over every token."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return g.t() @ x.reshape(-1, x.shape[-1]), g.sum(0)
''',
            check=r'''
from ultrascale.series.checks import part12
part12.exercise_2(input_grad, weight_grad)
''',
            hints=[
                "Write y = x Wᵀ for one token and differentiate: which shapes can multiply to give [.., in] and "
                "[out, in]?",
                "dL/dx = grad_out @ W. The weight is shared by every token, so its gradient sums over all of them.",
                "Reshape both to [tokens, features]: grad_w = g.t() @ x, grad_b = g.sum(0).",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            question="With p = 4, m = 8 and v = 2 chunks per rank, what is the interleaved schedule's bubble ratio?",
            options=["3/8", "3/16", "3/4", "1/8"],
            answer=1,
            why="(p - 1)/(v m) = 3/16: each fill or drain step is one chunk, half a stage.",
        ),
        QuizQuestion(
            question="What does interleaving cost?",
            options=["About v times more point-to-point messages, and more activations in flight",
                     "v times more parameters per rank",
                     "An all-reduce per layer",
                     "Nothing: it is free"],
            answer=0,
            why="Every micro-batch crosses every rank v times, and the longer warm-up keeps more micro-batches alive.",
        ),
        QuizQuestion(
            question="With F, I and W of equal cost, how does ZB-H1's idle time compare with 1F1B's?",
            options=["The same", "Half", "Zero", "A third"],
            answer=3,
            why="(p - 1)(t_F + t_I - t_W) against (p - 1)(t_F + t_I + t_W): 1 against 3.",
        ),
        QuizQuestion(
            question="In DualPipeV on p ranks, which rank computes the loss?",
            options=["Rank p - 1, as in 1F1B",
                     "Every rank, for its own micro-batches",
                     "Rank 0: it holds the first stage and, at the top of the V, the last",
                     "Rank p - 1, at the turn of the V"],
            answer=2,
            why="Rank r holds stages r and 2p - 1 - r: stage 2p - 1, with the head and the loss, is on rank 0.",
        ),
    ],
)
