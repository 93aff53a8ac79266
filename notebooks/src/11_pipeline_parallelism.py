"""Part 11 of the series: pipeline parallelism.

The source of notebooks/11_pipeline_parallelism.ipynb (build it with
`python notebooks/src/build.py 11`). The engine trains on 4 real gloo processes,
one pipeline stage each; every figure is measured in the notebook: the losses
against one process, the bubble from the engine's recorded timeline and from its
simulator, and the activations each stage held.
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
from ultrascale.parallel.pipeline.partition import split
from ultrascale.parallel.pipeline.schedules import build, schedule
from ultrascale.parallel.pipeline.simulate import simulate
from ultrascale.series.ranks import on_ranks
from ultrascale.testing.compare import train_on
from ultrascale.train.startup import check_run

torch.set_num_threads(1)
WORLD = 4                                   # 4 real processes (gloo, this CPU), one pipeline stage each
MODEL = get_preset("tiny", layers=8)        # 8 transformer blocks: 2 per stage
TRACES = tempfile.mkdtemp()
''')

SPLIT = code(r'''
# The engine's split of 8 blocks over 4 stages (the embedding rides with stage 0, the head and loss with stage 3).
for stage, blocks in enumerate(split(MODEL.layers, WORLD)):
    extra = " + embedding" if stage == 0 else " + final norm, head, loss" if stage == WORLD - 1 else ""
    print(f"stage {stage}: blocks {list(blocks)}{extra}")

# One micro-batch at a time through the whole pipeline: the engine's simulator plays the schedule with
# a forward costing 1 and a backward 2 on every stage.
naive = simulate(schedule("naive", WORLD, 8), WORLD, t_f=1.0, t_b=2.0, t_w=0.0)
print(f"naive, p = 4, 8 micro-batches: step time {naive.makespan:g}, each stage computes {max(naive.busy):g}, "
      f"bubble ratio {naive.bubble_ratio:.2f} (idle time / compute time)")
''')

SCHEDULES = code(r'''
# The schedules are data: each rank's ordered list of actions, F k / B k for micro-batch k.
p, m = 4, 8
for name in ("afab", "1f1b"):
    print(name)
    for rank, acts in enumerate(build(name, p, m)):
        print(f"  rank {rank}: " + " ".join(map(repr, acts)))
''')

ENGINE = code(r'''
UNIT = 0.25   # seconds: what a stage's forward lasts in the paced step 2 (a backward: 2 units)


def paced_training(cfg, unit):
    """On each rank: train `cfg` with the engine, its last step paced. Each F of that step runs the
    stage's real layers, then waits until it has lasted `unit`; each B, 2 units. The data and the
    messages flow through the engine's pipeline runtime as ever; only the durations are fixed. Returns
    the rank's record and the real compute time of each of its paced F and B (before the wait)."""
    import contextlib
    import re
    import time

    from ultrascale.parallel.pipeline import runtime
    from ultrascale.testing.compare import RunRecord
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import run_training

    cost = {"F": unit, "B": 2 * unit}
    span, run_step, steps, computed = runtime.span, runtime.PipelineRuntime.run, [0], {"F": [], "B": []}

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


def run(name, m, world=WORLD, unit=UNIT):
    """Train 2 steps on `world` ranks with schedule `name` and m micro-batches of 2 sequences, step 2 paced
    at `unit` (one process when world is 1: the whole batch at once); every rank's record, the recorded
    step 2 (its timeline in seconds and on the engine's schedule clock), and the real compute time of
    its F and B on every rank."""
    trace = os.path.join(TRACES, f"{name}_{m}.json") if world > 1 else ""
    parallel = ParallelConfig(pp=world, pp_schedule=name) if world > 1 else ParallelConfig()
    train = TrainConfig(steps=2, seq_len=128, micro_batch=2 if world > 1 else 2 * m, grad_accum=m if world > 1 else 1,
                        seed=3, progress=False, pp_trace=trace)
    cfg = check_run(RunConfig(model=MODEL, parallel=parallel, train=train), world)
    if world == 1:
        return [train_on(cfg, 1)], None, None
    ranks = on_ranks(world, paced_training, cfg, unit)
    computed = {kind: [t for _, times in ranks for t in times[kind]] for kind in "FB"}
    return [record for record, _ in ranks], draw.read_trace(trace), computed


M = 8
single, _, _ = run("1f1b", M, world=1)
print("one process     :", " ".join(f"{x:.6f}" for x in single[0].losses))
results = {}
for name in ("afab", "1f1b"):
    results[name] = records, _, _ = run(name, M)
    worst = max(abs(a - b) / b for a, b in zip(records[0].losses, single[0].losses))
    print(f"pp = 4, {name:4s}  : " + " ".join(f"{x:.6f}" for x in records[0].losses)
          + f"   (worst relative difference {worst:.1e})")
''')

BUBBLE = code(r'''
def mean_ms(times):
    return 1e3 * sum(times) / len(times)


p = WORLD
charts = []
for name in ("afab", "1f1b"):
    _, trace, computed = results[name]
    spans = draw.trace_spans(trace)                    # in seconds
    clocked = draw.trace_spans(trace, clock=True)      # on the engine's schedule clock
    lasted = {kind: [e - s for rank in spans for _, k, s, e in rank if k == kind] for kind in "FB"}
    # The simulator at the paced costs: F = UNIT, B = 2 UNIT on every stage.
    sim = simulate(schedule(name, p, M), p, t_f=UNIT, t_b=2 * UNIT, t_w=0.0)
    measured = draw.measured_bubble_ratio(spans)
    print(f"{name:4s}: bubble ratio simulated {sim.bubble_ratio:.3f}, on the engine's clock "
          f"{draw.measured_bubble_ratio(clocked):.3f}, formula (p - 1)/m = {(p - 1) / M:.3f}; measured {measured:.3f}"
          f"   (mean F {mean_ms(lasted['F']):.0f} ms, B {mean_ms(lasted['B']):.0f} ms; "
          f"their real compute {mean_ms(computed['F']):.1f} and {mean_ms(computed['B']):.1f} ms)")
    for label, drawn, ratio in (("simulated", draw.spans_from_timeline(sim), sim.bubble_ratio),
                                ("recorded", spans, measured)):
        charts.append(os.path.join(TRACES, f"{name}_{label}.png"))
        draw.draw(drawn, f"{name}, pp = 4, m = {M}: {label}, bubble {ratio:.3f}", charts[-1])
display(*(Image(filename=chart) for chart in charts))
''')

SWEEP = code(r'''
# More micro-batches shrink the bubble (simulator, F = 1, B = 2): the fill and drain stay p - 1 slots long.
for m in (4, 8, 16, 32, 64):
    tl = simulate(schedule("1f1b", 4, m), 4, t_f=1.0, t_b=2.0, t_w=0.0)
    print(f"p = 4, m = {m:2d}: bubble ratio {tl.bubble_ratio:.4f}  (p - 1)/m = {3 / m:.4f}")
''')

MEMORY = code(r'''
# Activations each stage held at its peak (the engine's meter: bytes saved for backward, summed over the
# micro-batches in flight), in units of one micro-batch: a run with m = 1 measures one on each stage.
one, _, _ = run("1f1b", 1, unit=0.0)       # not paced: only the bytes count here
per_micro = [r.memory[-1]["activations"] for r in one]
print(f"one micro-batch: {[f'{x / 2**20:.2f} MiB' for x in per_micro]} per rank")
for name in ("afab", "1f1b"):
    peaks = [r.memory[-1]["activations"] for r in results[name][0]]
    held = [round(x / y, 2) for x, y in zip(peaks, per_micro)]
    sim = simulate(schedule(name, WORLD, M), WORLD).peak_in_flight
    print(f"{name:4s}: peak activations per rank {[f'{x / 2**20:.1f} MiB' for x in peaks]}; "
          f"micro-batches held {held}; simulator {sim}")
''')


EPISODE = Episode(
    number=11,
    title="Pipeline Parallelism",
    slug="pipeline_parallelism",
    subtitle="Layers split into stages, micro-batches through the pipe: AFAB, 1F1B and the bubble",
    overview=[
        "The naive split: consecutive layers on each GPU, one micro-batch at a time, every other stage idle",
        "Schedules as lists of actions: all-forward-all-backward (AFAB, GPipe) and one-forward-one-backward (1F1B)",
        "The engine trains on 4 real stages with each schedule: the same losses as one process",
        "The bubble (p - 1)/m measured from the engine's recorded timeline on paced stages, against its simulator and the formula",
        "Activation memory in flight: AFAB holds all m micro-batches, 1F1B at most p - stage; measured",
    ],
    references=[
        Reference(2, "activation memory: what a stage holds per micro-batch"),
        Reference(3, "gradient accumulation: micro-batches summed into one step"),
        Reference(8, "tensor parallelism, the other way to split a model too big for one GPU"),
    ],
    sections=[
        Section("Layers on different GPUs", [
            md(r'''
Tensor parallelism (Part 8) splits every matrix and needs an all-reduce inside every layer: fast inside a
node, too slow across nodes. **Pipeline parallelism (PP)** cuts the model the other way: GPU $r$ holds a
contiguous group of layers, a *stage*, and only the activations at the cut travel, point to point, to the
next stage (and their gradients back). Each stage stores $1/p$ of the parameters, gradients and optimizer
states, and the messages are small: $b \cdot s \cdot h$ values per micro-batch per cut.

The catch is sequential dependence: stage 1 cannot start before stage 0 has finished the same input. Fed
one micro-batch at a time, only one stage works at any moment:
'''),
            SETUP,
            SPLIT,
            md(r'''
With $p = 4$ stages each GPU is busy a quarter of the time: idle time is 3 times the compute time. The
fix is the one of Part 3: cut the batch into $m$ **micro-batches** and keep several in the pipe at once,
so that stage 1 works on micro-batch 0 while stage 0 already runs micro-batch 1.
'''),
        ]),
        Section("AFAB and 1F1B", [
            md(r'''
Two schedules, each written as an ordered list of actions per rank (the engine executes exactly these
lists; its runtime inserts the sends and receives):

- **All-forward-all-backward (AFAB, GPipe)**: every rank runs the forwards of all $m$ micro-batches, then
  all the backwards. Simple, but a rank keeps the activations of **all $m$** micro-batches until their
  backward.
- **One-forward-one-backward (1F1B, PipeDream-Flush)**: rank $r$ runs $p - r - 1$ warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards. A micro-batch's backward
  starts as soon as it can, so rank $r$ holds at most $p - r$ micro-batches.
'''),
            SCHEDULES,
            md(r'''
The engine runs both on 4 ranks (`ultrascale train --nproc 4 --pp 4 --pp-schedule 1f1b --grad-accum 8`),
and records every action's start and end (`--pp-trace FILE`). The loss of the last stage is divided by
$m$, so the gradients summed over micro-batches are those of the whole batch: the losses equal one
process taking the whole batch at once.
'''),
            ENGINE,
        ]),
        Section("The bubble, measured", [
            md(r'''
Over one step each rank computes $m(t_F + t_B)$. The first micro-batch reaches the last stage after
$(p-1)\,t_F$, and the last gradient reaches the first stage $(p-1)\,t_B$ after the last stage is done:
every rank idles $(p-1)(t_F + t_B)$ in total, the **bubble**. Over the compute time:

$$r_{\text{bubble}} = \frac{(p-1)(t_F + t_B)}{m\,(t_F + t_B)} = \frac{p-1}{m}$$

The same for AFAB and 1F1B: 1F1B moves the backwards earlier, it does not remove the fill and drain.
Below, the engine's recorded timeline of step 2 on 4 processes, against the engine's simulator and the
formula. Four processes on this CPU's few cores, shared with whatever else runs, stretch each other's
compute wherever several ranks compute at once: a recorded timeline would show that contention, not the
schedule. So step 2 is **paced**: every F runs the stage's real layers and then waits until it has lasted
`UNIT` seconds (every B twice that), while the activations and gradients travel in the engine's real
messages. Waiting costs no CPU, so the ranks no longer compete, and each stage's compute takes a fixed
time, as on a GPU per stage: the time the simulator is given. For each schedule, the simulator's Gantt
chart and the engine's recorded one (forwards blue, backwards green, idle time blank):
'''),
            BUBBLE,
            md(r'''
The simulator gives the formula exactly. So does the engine's own **schedule clock**, recorded beside the
seconds (`--pp-trace`): a Lamport clock, in which every action lasts its unit cost (F 1, B 2) and every
message carries the clock its sender was at, so a receive moves the receiver's clock up to it. It is made
by the order in which the runtime really acted and the messages it really waited for, and nothing the
machine does can stretch it: equal to the simulator's, it says that the runtime waits on nothing the
schedule does not. The seconds add what the clock leaves out, the time of the messages and of waking a
waiting process: a few hundredths on a quiet machine, more when other work shares its cores (that part
is the machine's, not the schedule's). The real compute of an action, printed last, is a few
milliseconds for this tiny model: pacing makes every action far longer than that, so that the schedule,
not the load of the machine, shapes the timeline.

The only lever in the formula is $m$: more micro-batches per step (a larger global batch, or smaller
micro-batches) make the fill and drain a smaller part of the step.
'''),
            SWEEP,
        ]),
        Section("Activations in flight", [
            md(r'''
The bubble is the same; memory is not. A stage keeps a micro-batch's activations from its forward until its
backward. Under AFAB every rank holds all $m$ at the peak; under 1F1B rank $r$ holds at most $p - r$ (its
warm-up forwards plus the one of the steady state), **independent of $m$**: 1F1B is what lets $m$ grow to
shrink the bubble. The engine measured the bytes each stage saved for backward:
'''),
            MEMORY,
            md(r'''
Rank 0 holds the most under 1F1B ($p$ micro-batches), so with pipeline parallelism the first stage sets
the memory peak; under AFAB the last stage is highest, as its micro-batches also keep the logits.
'''),
        ]),
    ],
    exercises=[
        Exercise(
            title="Write the 1F1B schedule of one stage",
            instructions=r'''
Write `one_f_one_b_stage(p, stage, m)`: the ordered actions of stage `stage` (0 .. p-1) under 1F1B with `m`
micro-batches, as a list of `('F', k)` and `('B', k)`. Warm up with $\min(p - \text{stage} - 1, m)$
forwards, then alternate one forward and one backward (forward first) while forwards remain, then run the
remaining backwards. The check plays all stages together in the engine's simulator (a wrong order can make
the stages wait on each other forever) and compares with the definition for several $(p, m)$, $m < p$
included.
''',
            starter=r'''
def one_f_one_b_stage(p, stage, m):
    """1F1B on one stage: [('F', k) / ('B', k), ...] in the order the stage runs them."""
    # TODO: the warm-up forwards, the steady one-forward-one-backward, the cool-down backwards
    raise NotImplementedError
''',
            solution=r'''
def one_f_one_b_stage(p, stage, m):
    """1F1B on one stage: [('F', k) / ('B', k), ...] in the order the stage runs them."""
    warmup = min(p - stage - 1, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
''',
            check=r'''
from ultrascale.series.checks import part11
part11.exercise_1(one_f_one_b_stage)
''',
            hints=[
                "The last stage needs no warm-up: its forward produces the loss, so it can go backward at once. "
                "Each stage before it needs one more forward in flight.",
                "Warm-up: `min(p - stage - 1, m)` forwards. Steady state: for k = 0 .. m - warmup - 1, "
                "`('F', warmup + k)` then `('B', k)`.",
                "Cool-down: the backwards of the micro-batches still in flight, `range(m - warmup, m)`, in order.",
            ],
        ),
        Exercise(
            title="Step time and bubble of a schedule",
            instructions=r'''
Write `step_time(stages, t_f, t_b)`: `stages[s]` is stage $s$'s ordered list of `('F', k)` / `('B', k)`,
`t_f[s]` and `t_b[s]` its forward and backward time per micro-batch. Each action starts when its stage is
free **and** its input is there: `('F', k)` on stage $s > 0$ after `('F', k)` on stage $s - 1$;
`('B', k)` on stage $s < p - 1$ after `('B', k)` on stage $s + 1$ (communication free). Return
`(T, bubble)`: $T$ the time the step ends, when the stage that finishes last is done (all start at 0), and
$\text{bubble} = (T - \text{busy}) / \text{busy}$ with busy the compute time of the busiest stage. The
check compares with the engine's simulator for AFAB and 1F1B at several $(p, m)$, and with unequal stages.
''',
            starter=r'''
def step_time(stages, t_f, t_b):
    """(step time, bubble ratio) of per-stage action lists with per-stage F and B durations."""
    p = len(stages)
    # TODO: advance each stage through its list while the next action's input has arrived,
    # recording when each (kind, micro-batch, stage) ends; repeat until every list is done
    raise NotImplementedError
''',
            solution=r'''
def step_time(stages, t_f, t_b):
    """(step time, bubble ratio) of per-stage action lists with per-stage F and B durations."""
    p = len(stages)
    end, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 else None
                if dep is not None and dep not in end:
                    break  # the input has not arrived yet: another stage first
                start = max(clock[s], end.get(dep, 0.0))
                clock[s] = start + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    T = max(clock)
    return T, (T - busy) / busy
''',
            check=r'''
from ultrascale.series.checks import part11
part11.exercise_2(step_time)
''',
            hints=[
                "Keep, for each stage, a clock (when it is next free) and a position in its list; keep a dict "
                "of when each (kind, micro-batch, stage) ended.",
                "An action can run only if the action it waits for has ended: if not, leave this stage and come "
                "back after the others have advanced. Its start is max(own clock, that end time).",
                "busy = the largest sum of a stage's durations; bubble = (T - busy) / busy, not / T.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            question="With p = 8 stages and m = 32 micro-batches, what is the bubble ratio of 1F1B (equal stages)?",
            options=["7/256", "7/32, the same as AFAB", "1/8", "0: 1F1B has no bubble"],
            answer=1,
            why="(p - 1)/m for both: 1F1B reorders the backwards but keeps the fill and drain.",
        ),
        QuizQuestion(
            question="What does 1F1B improve over AFAB?",
            options=["The bubble: it halves it",
                     "Communication: fewer point-to-point messages",
                     "Parameter memory per stage",
                     "Activation memory: at most p micro-batches in flight instead of m"],
            answer=3,
            why="Backwards start as soon as possible, freeing each micro-batch's activations early.",
        ),
        QuizQuestion(
            question="Under 1F1B on 4 stages, which stage holds the most activations at its peak?",
            options=["Stage 3, the last", "All hold the same", "Stage 0", "Stage 1"],
            answer=2,
            why="Stage r warms up with p - r - 1 forwards: stage 0 holds p micro-batches, the last one 1.",
        ),
        QuizQuestion(
            question="Why does the loss on the last stage get divided by m before the backward?",
            options=["To keep the activations small",
                     "So the gradients summed over the m micro-batches are the mean over the whole batch",
                     "Because m stages share the loss",
                     "To shrink the bubble"],
            answer=1,
            why="It is gradient accumulation (Part 3): the step must equal one pass over the global batch.",
        ),
    ],
)
