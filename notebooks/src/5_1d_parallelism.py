"""Part 5 of the series: the global batch size, GBS = MBS x GA x DP, and 1-D (data) parallelism.

The source of notebooks/5_1d_parallelism.ipynb (build it with `python notebooks/src/build.py 5`).
Every figure comes from the planner (ultrascale.plan: memory and time models of an
H100 cluster) or from a real run of the engine, on one process and on 2 gloo processes.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import dataclasses

import torch

from ultrascale.config import ConfigError
from ultrascale.plan.calibration import get_framework
from ultrascale.plan.hardware import get_cluster
from ultrascale.plan.layout import Layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.search import search
from ultrascale.plan.shape import get_shape

torch.set_num_threads(1)  # the engine runs below use a tiny model: one thread each is fastest

LLAMA3_8B = get_shape("llama3-8b")
H100 = get_cluster("playbook")  # the playbook's H100 cluster, whose runs calibrate the planner
PLAYBOOK = dataclasses.replace(get_framework("playbook"), partition="even")  # calibrated on the playbook's runs
ONE_D = {"tp": 1, "pp": 1, "cp": 1}  # 1-D parallelism: every GPU is a data-parallel replica
GiB = 2**30
print(f"llama3-8b: {LLAMA3_8B.count() / 1e9:.2f}B parameters; {H100.gpu.name}: {H100.memory_bytes / GiB:.1f} GiB")
''')

EQUATION = code(r'''
def global_batch(mbs, grad_accum, dp, seq_len):
    """Samples and tokens per optimizer step."""
    samples = mbs * grad_accum * dp
    return samples, samples * seq_len


samples, tokens = global_batch(mbs=2, grad_accum=4, dp=128, seq_len=4096)
print(f"MBS 2 x GA 4 x DP 128 = {samples} samples = {tokens:,} tokens per step")
''')

WORKED = code(r'''
target_tokens = 4 * 2**20   # "4M tokens" in the playbook's sense: 2**22 = 4,194,304
seq_len = 4096
mbs = 2
samples = target_tokens // seq_len
print(f"{target_tokens:,} tokens / {seq_len} tokens per sample = {samples} samples per step\n")

for dp in (64, 128, 256, 512, 1024):
    ga = samples / (mbs * dp)
    note = "" if ga >= 1 else "   <- less than one micro-batch per GPU: more GPUs than the batch can feed"
    print(f"DP = {dp:4d}: GA = {samples} / ({mbs} x {dp}) = {ga:g}{note}")

# With 4,000-token sequences the same "4M" does not divide evenly:
odd = 4_000_000 / 4000 / (mbs * 128)
print(f"\n4,000,000 tokens / 4000 = 1000 samples -> GA = 1000 / (2 x 128) = {odd:.3f}: not a whole number of steps")
''')

PLANNER = code(r'''
# `ultrascale plan --model llama3-8b --gpus 128 --global-batch-tokens 4194304 --tp 1 --pp 1 --cp 1`
found = search(LLAMA3_8B, 128, H100, PLAYBOOK, seq_len=4096, global_batch_tokens=4 * 2**20, fixed=ONE_D)
print(f"{len(found.ranked)} of {found.enumerated} 1-D layouts fit in {H100.memory_bytes / GiB:.1f} GiB; the fastest:")
for c in found.by_time[:4]:
    print(f"  {c.layout.label():40s} {c.memory.peak.total / GiB:5.1f} GiB  step {c.time.step_s:.2f} s  "
          f"{c.time.tokens_per_s_per_gpu:,.0f} tokens/s/GPU")
best = found.by_time[0].layout
print(f"planner's choice: MBS {best.micro_batch} x GA {best.grad_accum} x DP {best.dp} = {best.global_batch} sequences")
# `ultrascale plan` lists first the layouts its time model cannot tell apart (Part 14 says why).
print(f"{len(found.top_group)} layouts within the time model's error (±{100 * found.band:.1f}%) of the fastest")
''')

MEMORY = code(r'''
def peak_gib(zero, micro_batch, dp=128):
    lay = Layout(dp=dp, zero=zero, micro_batch=micro_batch, seq_len=4096)
    return memory_plan(LLAMA3_8B, lay, PLAYBOOK).peak.total / GiB


for m in (1, 2, 3, 4):
    gib = peak_gib(3, m)
    print(f"ZeRO-3, MBS {m}: {gib:5.1f} GiB {'fits' if gib * GiB <= H100.memory_bytes else 'does not fit'}")
plain = memory_plan(LLAMA3_8B, Layout(dp=128, zero=0, micro_batch=1, seq_len=4096), PLAYBOOK).peak
print(f"plain DP (no sharding), MBS 1: {plain.total / GiB:5.1f} GiB, of which parameters, gradients and optimizer "
      f"states {sum(plain.terms[k] for k in ('params', 'grads', 'optim')) / GiB:.1f} GiB")
''')

ENGINE = code(r'''
from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.testing.compare import train_on


def run(dp, mbs, ga, steps=3):
    """A real training run of the engine (the `tiny` Llama-style model) on dp gloo processes."""
    cfg = RunConfig(parallel=ParallelConfig(dp=dp),
                    train=TrainConfig(steps=steps, seq_len=32, micro_batch=mbs, grad_accum=ga, nproc=dp,
                                      warmup_steps=1, progress=False))
    return train_on(cfg, dp)


runs = {}
for dp, mbs, ga in ((1, 8, 1), (1, 2, 4), (2, 2, 2), (2, 4, 1)):
    runs[dp, mbs, ga] = record = run(dp, mbs, ga)
    losses = ", ".join(f"{loss:.4f}" for loss in record.losses)
    print(f"DP {dp} x MBS {mbs} x GA {ga} = {dp * mbs * ga} sequences: losses {losses}; "
          f"activations {record.memory[-1]['activations']:,} bytes per rank")
reference = runs[1, 8, 1].losses
gap = max(abs(a - b) / b for r in runs.values() for a, b in zip(r.losses, reference))
print(f"largest relative loss difference from one process with the whole batch: {gap:.1e}")
''')

SWEEP = code(r'''
for gpus in (64, 128, 256, 512, 1024, 2048):
    try:
        found = search(LLAMA3_8B, gpus, H100, PLAYBOOK, seq_len=4096, global_batch_tokens=4 * 2**20, fixed=ONE_D)
    except ConfigError:
        print(f"{gpus:5d} GPUs: no layout - 1024 sequences cannot give every GPU a micro-batch")
        continue
    c = found.by_time[0]
    t = c.time
    exposed = t.breakdown["dp_comm"]
    nodes = gpus // H100.node_size  # the cluster's synchronization: node_pair_sync_s x nodes² per micro-batch
    per_micro_batch = H100.node_pair_sync_s * nodes**2
    print(f"{gpus:5d} GPUs: MBS {c.layout.micro_batch} x GA {c.layout.grad_accum:2d}  step {t.step_s:5.2f} s  "
          f"{t.tokens_per_s_per_gpu:6,.0f} tokens/s/GPU  exposed DP communication {exposed:.3f} s  "
          f"sync {t.breakdown['sync']:.2f} s = GA x {per_micro_batch * 1e3:.0f} ms ({nodes} nodes)")
''')


EPISODE = Episode(
    number=5,
    title="The Global Batch Size and 1-D Parallelism",
    slug="1d_parallelism",
    subtitle="GBS = MBS x GA x DP: filling a batch with GPUs and with gradient accumulation",
    overview=[
        "The batch-size equation: global batch = micro-batch size (MBS) x gradient-accumulation steps (GA) "
        "x data-parallel ranks (DP)",
        "Counting in samples and in tokens: 4M tokens of 4096-token sequences are 1024 samples",
        "The planner's choice for Llama 3 8B on 128 H100s: MBS 2 x GA 4 x DP 128, and why MBS 2",
        "A real run of the engine: 8 sequences per step as 1 micro-batch of 8, as 4 accumulated micro-batches "
        "of 2, and on 2 real ranks (2 x 2, 1 x 4) - the same losses, different activation memory",
        "Trading GA for DP, and where data parallelism alone runs out",
    ],
    references=[
        Reference(3, "gradient accumulation must average, and the all-reduce"),
        Reference(4, "data parallelism: the averaged all-reduce and `no_sync` for gradient accumulation"),
    ],
    sections=[
        Section("Setup", [
            md(r'''
Two tools give this notebook its numbers. The **planner** (`ultrascale.plan`, also the command `ultrascale
plan`) models the memory and the step time of a configuration on a cluster of H100s, calibrated on the
playbook's measured runs. The **engine** trains a real (tiny) Llama-style model, here on one process and on
2 gloo processes - the same code that runs on GPUs with NCCL.
'''),
            SETUP,
        ]),
        Section("The batch-size equation", [
            md(r'''
The **global batch size** (GBS) is the number of samples that contribute to one optimizer step. Three
knobs multiply into it:

$$\text{GBS} = \text{MBS} \times \text{GA} \times \text{DP}$$

- **MBS, the micro-batch size**: the samples one GPU runs through forward and backward at once. It is
  limited by GPU memory (activations grow with it).
- **GA, gradient-accumulation steps**: micro-batches each GPU processes, one after another, before the
  optimizer step; their gradients are averaged (Part 3).
- **DP, data parallelism**: the number of model replicas (GPUs) working on different micro-batches at the
  same time; their gradients are averaged with an all-reduce (Part 4).

LLM recipes state the batch in **tokens**: GBS x sequence length.
'''),
            EQUATION,
        ]),
        Section("A worked example: 4M tokens on 128 GPUs", [
            md(r'''
The recipe for a training run goes in this order:

1. choose the global batch in tokens, from the literature or from experiments - say **4M tokens**
   ($2^{22}$, as the playbook counts it);
2. with the sequence length, convert it to samples: $2^{22} / 4096 = 1024$ samples;
3. find the largest **MBS** that fits in GPU memory;
4. take the GPUs you have for DP, and fill the rest with gradient accumulation:
   $\text{GA} = 1024 / (\text{MBS} \times 128)$ on 128 GPUs.

GA must be a whole number, at least 1. Below 1 there are more GPUs than the batch can feed: use fewer GPUs,
a smaller MBS, or a larger global batch.
'''),
            WORKED,
            md(r'''
Steps 3 and 4 are what the planner automates: it enumerates every layout of the GPUs that reaches the batch
with a whole number of accumulation steps, drops those that do not fit in memory, and ranks the rest by
predicted throughput. Restricted to 1-D parallelism (every GPU a data-parallel replica), for Llama 3 8B,
sequences of 4096 tokens and 4M tokens per step on 128 H100s:
'''),
            PLANNER,
            md(r'''
The planner reproduces the playbook's configuration: **MBS 2 x GA 4 x DP 128**. (Without the restriction,
`ultrascale plan --model llama3-8b --gpus 128 --global-batch-tokens 4194304` searches tensor, pipeline and
context parallelism too, and ranks the same layout first.) Why MBS 2, and why the `zero3` in its label?
The planner's memory model, per GPU:
'''),
            MEMORY,
            md(r'''
- **MBS 2 is the largest micro-batch that fits**: activations grow linearly with it, and MBS 3 goes past
  80 GB. MBS 1 also fits but needs GA 8: more, smaller micro-batches, which use the GPU less well (the
  planner predicts fewer tokens/s for it, above).
- **Plain data parallelism cannot train this model at all** on 80 GB GPUs: every replica holds all the
  parameters, gradients and Adam states (16 bytes per parameter in mixed precision). The planner's choice
  shards them over the 128 data-parallel ranks with ZeRO-3 - still data parallelism, one dimension, with
  the states split instead of copied (Parts 6 and 7).
'''),
        ]),
        Section("Same global batch, same training: a real run", [
            md(r'''
For a fixed global batch, MBS, GA and DP can be traded against each other **without changing the
mathematics**: accumulation averages over micro-batches (Part 3), the all-reduce averages over replicas
(Part 4), and the optimizer sees the mean gradient of the same samples either way. Here the engine trains
the same model on the same 8 sequences per step, four ways: one process with the whole batch, one process
accumulating 4 micro-batches, and **2 real ranks** with data parallelism, with and without accumulation:
'''),
            ENGINE,
            md(r'''
The losses agree to float rounding (the additions happen in another order), step after step. What changes
is the cost: the activations a rank keeps depend **only on the micro-batch** (MBS 8 keeps about 4x what
MBS 2 keeps), not on GA or DP. So the micro-batch is set by memory, and GA and DP fill the batch.
'''),
        ]),
        Section("Trading GA for DP, and where 1-D parallelism runs out", [
            md(r'''
GA and DP are interchangeable in the mathematics but not in time: DP replicas process their micro-batches
**in parallel**, GA micro-batches run **one after another** on the same GPU. So: use the GPUs you have for
DP, then fill the rest of the batch with accumulation. With the global batch fixed at 4M tokens, the
planner's choice as the number of GPUs grows:
'''),
            SWEEP,
            md(r'''
Up to 512 GPUs, doubling the GPUs halves GA, but the step time falls by less each time; the data-parallel
communication still hides behind each micro-batch's compute (0.000 s exposed). Throughput per GPU falls all
the same, because every micro-batch also waits on synchronization that grows with the job: the planner's
time model, calibrated on the playbook's measured runs, charges 0.2 ms per pair of nodes (nodes²) per
micro-batch - 51 ms at 16 nodes, 819 ms at 64 (the slowdown those runs show at scale, whatever the model
size), about half of the 1.70 s step at 512 GPUs. Then the batch runs out. At 512 GPUs GA is already 1;
at 1024 only MBS 1 is left and each GPU computes a single sequence per step: the synchronization at 128
nodes (3.28 s) is most of the 3.83 s step, and the data-parallel communication no longer hides behind the
compute (0.092 s exposed) - throughput per GPU drops to 1,070 tokens/s. At 2048 GPUs there is nothing
to give the extra GPUs at all. Communication does not shrink with more replicas (every step still reduces
the full gradients, over rings of more and more GPUs) while the compute that hides it does: that is the
second limit of data parallelism, which the playbook measures on real clusters.

Both limits lead out of one dimension: splitting the model itself over GPUs (tensor, pipeline and context
parallelism) lets more GPUs work on the same batch, and sharding the states (ZeRO, next parts) lets the
micro-batch grow.
'''),
        ]),
    ],
    exercises=[
        Exercise(
            title="How many accumulation steps?",
            instructions=r'''
Write `grad_accum_steps(gbs_tokens, seq_len, mbs, dp)`: the number of gradient-accumulation steps that
reach a global batch of `gbs_tokens` tokens with sequences of `seq_len` tokens, micro-batches of `mbs`
samples and `dp` data-parallel GPUs. Return an `int`. Raise `ValueError` (with a message saying why) when:

- the tokens are not a whole number of sequences,
- the samples do not split into a whole number of accumulation steps,
- there are more GPUs than the batch can feed (fewer than 1 step).

Each rule matters on its own: the check tries batches that break exactly one of them.
''',
            starter=r'''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    """Gradient-accumulation steps for a global batch of gbs_tokens tokens: an int >= 1.

    Raises ValueError if the batch is not a whole number of sequences, not a whole number
    of accumulation steps, or smaller than one micro-batch per GPU.
    """
    # TODO: tokens -> samples -> accumulation steps, checking each division
    raise NotImplementedError
''',
            solution=r'''
def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
    """Gradient-accumulation steps for a global batch of gbs_tokens tokens: an int >= 1.

    Raises ValueError if the batch is not a whole number of sequences, not a whole number
    of accumulation steps, or smaller than one micro-batch per GPU.
    """
    if gbs_tokens % seq_len:
        raise ValueError(f"{gbs_tokens} tokens are not a whole number of {seq_len}-token sequences")
    samples = gbs_tokens // seq_len
    per_step = mbs * dp  # samples all GPUs process in one micro-batch step
    if samples < per_step:
        raise ValueError(f"{samples} samples cannot feed {dp} GPUs with micro-batches of {mbs}: use fewer GPUs")
    if samples % per_step:
        raise ValueError(f"{samples} samples are not a whole number of steps of {per_step}")
    return samples // per_step
''',
            check=r'''
from ultrascale.series.checks import part5
part5.exercise_1(grad_accum_steps)
''',
            hints=[
                "Two divisions, each of which must come out whole: tokens into sequences (`seq_len`), then "
                "sequences into steps of `mbs * dp`. `%` tells you whether a division is whole.",
                "Floor division (`//`) never complains: 4,196,352 // 4096 is 1024, although the batch is 1024.5 "
                "sequences. Test `gbs_tokens % seq_len` before dividing, then `samples % (mbs * dp)`.",
                "Three `if ...: raise ValueError(...)`: `gbs_tokens % seq_len`, `samples < mbs * dp`, "
                "`samples % (mbs * dp)`; then `return samples // (mbs * dp)`.",
            ],
        ),
        Exercise(
            title="Choose MBS, GA and DP like the planner",
            instructions=r'''
Write `choose_layout(gbs_tokens, seq_len, gpus, max_mbs)` returning `(mbs, ga, dp)` for 1-D parallelism,
given the token budget per step, the sequence length, the number of GPUs and the largest micro-batch that
fits in memory (`max_mbs`). The rule:

1. **DP first**: every GPU is a data-parallel replica, `dp = gpus`. The sequences must split evenly over
   the GPUs, at least one each; otherwise raise `ValueError`.
2. **The largest micro-batch that fits**: `mbs` is the largest number up to `max_mbs` that **divides** the
   sequences each GPU gets (so that GA is whole).
3. **GA fills the rest**: `ga = sequences / (mbs x dp)`.

The check asks the planner (`ultrascale.plan.search`, restricted to data parallelism) for its fastest
layout in several cases - Llama 3 8B on H100s and H200s, SmolLM 1.7B - passes you the largest micro-batch
that fits by the planner's memory model, and compares your choice with the planner's.
''',
            starter=r'''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    """(mbs, ga, dp) for a batch of gbs_tokens tokens on `gpus` data-parallel GPUs, where at most
    max_mbs sequences fit in one micro-batch. Raises ValueError if the batch does not split evenly
    over the GPUs."""
    # TODO: sequences per step and per GPU; the largest mbs <= max_mbs dividing the per-GPU share; ga
    raise NotImplementedError
''',
            solution=r'''
def choose_layout(gbs_tokens, seq_len, gpus, max_mbs):
    """(mbs, ga, dp) for a batch of gbs_tokens tokens on `gpus` data-parallel GPUs, where at most
    max_mbs sequences fit in one micro-batch. Raises ValueError if the batch does not split evenly
    over the GPUs."""
    if gbs_tokens % seq_len:
        raise ValueError(f"{gbs_tokens} tokens are not a whole number of {seq_len}-token sequences")
    sequences = gbs_tokens // seq_len
    if sequences < gpus or sequences % gpus:
        raise ValueError(f"{sequences} sequences do not split evenly over {gpus} GPUs")
    per_gpu = sequences // gpus
    mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)
    return mbs, per_gpu // mbs, gpus
''',
            check=r'''
from ultrascale.series.checks import part5
part5.exercise_2(choose_layout)
''',
            hints=[
                "Work in sequences: `sequences = gbs_tokens // seq_len`, and each GPU gets `sequences // gpus` of "
                "them per step. Everything else is about that per-GPU share.",
                "`max_mbs` itself may not divide the per-GPU share (16 sequences with max_mbs 11): try the "
                "candidates from `min(max_mbs, per_gpu)` down to 1 and keep the first that divides it.",
                "`mbs = max(m for m in range(1, min(max_mbs, per_gpu) + 1) if per_gpu % m == 0)`, then "
                "`return mbs, per_gpu // mbs, gpus` - after raising ValueError when `sequences % gpus` or "
                "`sequences < gpus`.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            "In GBS = MBS x GA x DP, what is MBS?",
            ["The maximum batch size the optimizer allows",
             "The micro-batch size: samples one GPU runs through forward and backward at once",
             "The number of model shards", "The minimum batch size for stable training"],
            1,
            "The micro-batch is what one GPU processes at a time; GA and DP multiply it into the global batch.",
        ),
        QuizQuestion(
            "Target 4M tokens (2^22) per step, sequences of 4096 tokens, MBS = 2, 128 GPUs. How many "
            "gradient-accumulation steps?",
            ["1", "2", "4", "3.906"],
            2,
            "2^22 / 4096 = 1024 samples, and 1024 / (2 x 128) = 4.",
        ),
        QuizQuestion(
            "Your calculation gives GA = 0.5. What does it mean?",
            ["Halve the learning rate", "There are more GPUs than the global batch can feed",
             "The model does not fit in GPU memory", "Accumulate gradients every other step"],
            1,
            "Each GPU would get half a micro-batch: use fewer GPUs, a smaller MBS, or a larger global batch.",
        ),
        QuizQuestion(
            "For a fixed global batch, why fill it with data parallelism first and gradient accumulation second?",
            ["DP runs micro-batches at the same time on different GPUs; GA runs them one after another",
             "GA gives a different gradient than DP", "GA needs more GPU memory than DP",
             "GA cannot be combined with DP"],
            0,
            "Both produce the same averaged gradient (the engine's runs above agree); DP does the work in parallel, "
            "GA takes GA times as long on the same GPUs.",
        ),
    ],
)
