"""Part 6 of the series: ZeRO-1, the optimizer states sharded across the data-parallel ranks.

The source of notebooks/6_zero1.ipynb (build it with `python notebooks/src/build.py 6`).
Everything about several ranks runs on 2 real gloo processes (`on_ranks`); memory is
measured by the engine (bytes of the tensors each owner holds) and, for a real model
at scale, computed by the planner.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import torch
import torch.nn as nn
import torch.distributed as dist

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.model import count_params, get_preset
from ultrascale.series.ranks import on_ranks

# The flat collectives got new names in torch 2.13 (reduce_scatter_single, all_gather_single);
# older releases only have the old ones. Same semantics either way.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

WORLD = 2  # every multi-rank cell below runs on 2 real gloo processes, started once and reused
print("torch", torch.__version__)
''')

MEASURE = code(r'''
def run_config(zero, world=WORLD):
    """One training step of the engine's `tiny` Llama-style model: bf16 compute, fp32 master weights."""
    cfg = RunConfig(model=get_preset("tiny"), parallel=ParallelConfig(dp=world, zero=zero),
                    train=TrainConfig(steps=1, seq_len=16, micro_batch=1, dtype="bf16", progress=False,
                                      measure_activations=False))
    return validate(cfg, world)


def train_and_measure(cfg):
    """Runs on every rank: train, then the bytes each owner holds on this rank (the engine measures the
    tensors themselves: distinct storages of the parameters, of the gradient buffers, of the optimizer)."""
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import run_training

    return run_training(cfg, worker_context(cfg.parallel)).metrics[-1]["memory"]


psi = count_params(get_preset("tiny"))
print(f"tiny model: psi = {psi:,} parameters")
measured = {}
for zero in (0, 1):
    per_rank = on_ranks(WORLD, train_and_measure, run_config(zero))
    measured[zero] = per_rank
    for rank, mem in enumerate(per_rank):
        per_param = "  ".join(f"{k} {mem[k] / psi:5.2f}" for k in ("params", "grads", "optim"))
        total = sum(mem[k] for k in ("params", "grads", "optim"))
        print(f"ZeRO-{zero} rank {rank}: bytes per parameter: {per_param}  | total {total / psi:5.2f}")
''')

COLLECTIVES = code(r'''
def show_collectives():
    """On each rank: a flat 'gradient' that differs per rank, reduce-scattered, then all-gathered."""
    rank, world = dist.get_rank(), dist.get_world_size()
    grad = torch.arange(6.0) + 10 * rank          # rank 0: 0..5, rank 1: 10..15
    shard = torch.empty(grad.numel() // world)
    reduce_scatter(shard, grad)                    # rank r receives the SUM over ranks of slice r
    full = torch.empty_like(grad)
    all_gather(full, shard)                        # every rank receives every rank's slice, in rank order
    summed = grad.clone()
    dist.all_reduce(summed)
    return grad.tolist(), shard.tolist(), full.tolist(), torch.equal(full, summed)


for rank, (grad, shard, full, same) in enumerate(on_ranks(WORLD, show_collectives)):
    print(f"rank {rank}: local {grad} -> reduce-scatter {shard} -> all-gather {full} | equals all-reduce: {same}")
''')

ENGINE_ZERO1 = code(r'''
dp_mem, z1_mem = measured[0][0], measured[1][0]
for owner in ("params", "grads", "optim"):
    print(f"{owner:6s}: DP {dp_mem[owner]:>9,} B  ZeRO-1 {z1_mem[owner]:>9,} B  ratio {z1_mem[owner] / dp_mem[owner]:.3f}")

# The formula of this engine's recipe: bf16 parameters (2), fp32 gradients (4), k = 12 sharded over N.
formula = {"params": 2 * psi, "grads": 4 * psi, "optim": 12 * psi / WORLD}
print("engine = 2*psi + 4*psi + 12*psi/N on every owner:",
      all(abs(z1_mem[k] - formula[k]) <= 0.001 * formula[k] for k in formula))
''')

PLANNER = code(r'''
import dataclasses

from ultrascale.plan.calibration import get_framework
from ultrascale.plan.layout import Layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.shape import get_shape

shape = get_shape("llama3-8b")
framework = dataclasses.replace(get_framework("playbook"), partition="even")
P = shape.count()
GiB = 2**30
print(f"{shape.name}: psi = {P / 1e9:.2f} B parameters; model states in GiB per GPU "
      f"(bf16 parameters and gradients, AdamW with fp32 master weights)")
print(f"{'N':>3} {'params':>7} {'grads':>7} {'optim':>7} {'states':>7} | {'k=12 formula':>12} {'k=8 (wrong)':>11}")
for n in (1, 2, 4, 8, 16, 32, 64):
    lay = Layout(dp=n, zero=1, micro_batch=1, seq_len=4096, precision="bf16")
    t = memory_plan(shape, lay, framework).peak.terms
    states = t["params"] + t["grads"] + t["optim"]
    k12 = (2 + 2 + 12 / n) * P
    k8 = (2 + 2 + 8 / n) * P
    print(f"{n:>3} {t['params'] / GiB:7.1f} {t['grads'] / GiB:7.1f} {t['optim'] / GiB:7.1f} {states / GiB:7.1f} | "
          f"{k12 / GiB:12.1f} {k8 / GiB:11.1f}")

# The saving of ZeRO-1 over plain DP per GPU: the planner's, and what k = 8 would claim.
dp_states = sum(memory_plan(shape, Layout(dp=64, zero=0, micro_batch=1, seq_len=4096, precision="bf16"),
                            framework).peak.terms[k] for k in ("params", "grads", "optim"))
print(f"ZeRO-1 on 64 GPUs saves {(dp_states - states) / GiB:.1f} GiB per GPU (planner); "
      f"k = 8 would claim {8 * P * (1 - 1 / 64) / GiB:.1f} GiB")
''')

PLANNER_CLI = code(r'''
import subprocess
import sys

# The same figure from the command line (one layout: 8 data-parallel GPUs under ZeRO-1).
out = subprocess.run([sys.executable, "-m", "ultrascale", "plan", "memory", "--model", "llama3-8b", "--dp", "8",
                      "--zero", "1", "--micro-batch", "1", "--seq-len", "4096", "--json"],
                     capture_output=True, text=True, check=True).stdout
import json

mem = json.loads(out)["memory"]
print("ultrascale plan memory --model llama3-8b --dp 8 --zero 1: optimizer states per GPU "
      f"{mem['optim'] / 2**30:.1f} GiB, parameters {mem['params'] / 2**30:.1f} GiB, gradients {mem['grads'] / 2**30:.1f} GiB")
''')

EX1_STARTER = r'''
def shard_parameters(params):
    # Flatten all parameters (in order) into one vector, zero-padded to a multiple of the world size,
    # and return this rank's slice of it as a new fp32 nn.Parameter (the master copy of the shard).
    # Rank r owns elements [r * shard_size, (r + 1) * shard_size), shard_size = padded length / world.
    world, rank = dist.get_world_size(), dist.get_rank()
    # TODO
    raise NotImplementedError


def zero1_step(params, master, opt):
    # After backward (each p.grad holds this rank's local gradient): one ZeRO-1 step.
    # opt is torch.optim.Adam over [master] only: its moments exist for this rank's slice.
    world, rank = dist.get_world_size(), dist.get_rank()
    # TODO: flatten the gradients into a zero-padded vector, reduce-scatter it, average -> master.grad,
    # opt.step(), then all-gather the updated slices and copy them (without the padding) into params.
    raise NotImplementedError
'''

EX1_SOLUTION = r'''
def shard_parameters(params):
    # Flatten all parameters (in order) into one vector, zero-padded to a multiple of the world size,
    # and return this rank's slice of it as a new fp32 nn.Parameter (the master copy of the shard).
    # Rank r owns elements [r * shard_size, (r + 1) * shard_size), shard_size = padded length / world.
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = sum(p.numel() for p in params)
    shard_size = -(-numel // world)  # ceil: the padding makes every slice equal
    flat = torch.zeros(shard_size * world)
    flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
    return nn.Parameter(flat[rank * shard_size:(rank + 1) * shard_size].clone())


def zero1_step(params, master, opt):
    # After backward (each p.grad holds this rank's local gradient): one ZeRO-1 step.
    # opt is torch.optim.Adam over [master] only: its moments exist for this rank's slice.
    world, rank = dist.get_world_size(), dist.get_rank()
    numel, padded = sum(p.numel() for p in params), master.numel() * world
    flat_grad = torch.zeros(padded)
    flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
    shard_grad = torch.empty(master.numel())
    reduce_scatter(shard_grad, flat_grad)  # the sum over ranks of this rank's slice
    master.grad = shard_grad / world       # average, as data parallelism must
    opt.step()
    full = torch.empty(padded)
    all_gather(full, master.detach())      # every rank's updated slice, in rank order
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''

EX2_STARTER = r'''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    """Bytes of model states on one of n ZeRO-1 ranks, for psi parameters trained in bf16 with AdamW
    (mixed precision: fp32 master weights and two fp32 moments).

    grad_bytes: bytes per gradient element (2 for bf16 gradients, 4 for fp32 ones).
    Returns {"params": ..., "grads": ..., "optim": ...} in bytes (padding ignored).
    """
    # TODO: what each owner holds per parameter, and which of them ZeRO-1 divides by n
    raise NotImplementedError
'''

EX2_SOLUTION = r'''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    """Bytes of model states on one of n ZeRO-1 ranks, for psi parameters trained in bf16 with AdamW
    (mixed precision: fp32 master weights and two fp32 moments).

    grad_bytes: bytes per gradient element (2 for bf16 gradients, 4 for fp32 ones).
    Returns {"params": ..., "grads": ..., "optim": ...} in bytes (padding ignored).
    """
    k = 4 + 4 + 4  # fp32 master weights + Adam's first and second moments, all sharded by ZeRO-1
    return {"params": 2 * psi, "grads": grad_bytes * psi, "optim": k * psi / n}
'''


EPISODE = Episode(
    number=6,
    title="ZeRO-1: Sharding the Optimizer States",
    slug="zero1",
    subtitle="Every data-parallel rank keeps the whole optimizer; ZeRO-1 gives each rank 1/N of it",
    overview=[
        "Where a data-parallel rank's memory goes: parameters, gradients and optimizer states, measured by the "
        "engine on 2 real ranks",
        "Mixed-precision Adam keeps **12 bytes per parameter** of optimizer state (fp32 master weights + two "
        "moments), and ZeRO-1 shards all 12: $2\\Psi + 2\\Psi + 12\\Psi/N$",
        "The ZeRO-1 step: reduce-scatter the gradients, each rank updates its shard, all-gather the parameters - "
        "shown on real ranks",
        "The planner's figure for Llama 3 8B from 1 to 64 GPUs, and why the 8-bytes-per-parameter version of "
        "the formula underestimates the savings",
        "Exercises: write the ZeRO-1 optimizer step on 2 ranks; predict the memory per rank and check it against "
        "the engine and the planner",
    ],
    references=[
        Reference(1, "the memory of a training step: parameters, gradients, optimizer states, activations"),
        Reference(3, "reduce-scatter and all-gather, the two halves of a ring all-reduce"),
        Reference(4, "data parallelism and its averaged all-reduce"),
    ],
    sections=[
        Section("Setup", [
            md(r'''
Every cell that involves several GPUs runs here on **2 real processes** joined in a gloo process group
(`on_ranks(2, fn)` runs `fn` on both and returns each rank's result): the same `torch.distributed` calls
as with NCCL on GPUs, on a laptop CPU. The first call starts the two processes (a few seconds); later calls
reuse them.
'''),
            SETUP,
        ]),
        Section("What every data-parallel rank holds", [
            md(r'''
Data parallelism (Part 4) replicates **everything** on every rank. With $\Psi$ parameters trained in bf16
with mixed-precision AdamW, each rank holds:

| owner | bytes per parameter | what |
| --- | --- | --- |
| parameters | 2 | bf16 weights the forward and backward use |
| gradients | 2 (bf16) or 4 (fp32) | the playbook's recipe keeps bf16 gradients; this engine, like Megatron-LM with bf16, accumulates and reduces them in fp32 |
| optimizer states | $k = 12$ | fp32 **master weights** (4) + Adam's first moment (4) + second moment (4) |

The optimizer states are by far the largest owner, and every rank holds an identical copy of them. The next
cell trains the engine's tiny model one step on 2 real ranks, plain DP (ZeRO-0) and ZeRO-1, and prints what
each owner holds, in bytes per parameter (measured on the tensors, not predicted). The equivalent command line
is `ultrascale train --nproc 2 --dp 2 --zero 1 --dtype bf16 --model tiny --steps 1`.
'''),
            MEASURE,
            md(r'''
Under plain DP every rank holds $2 + 4 + 12 = 18$ bytes per parameter (fp32 gradients), and the 12 bytes of
optimizer state are identical on both ranks: pure redundancy. Under ZeRO-1 the optimizer column is halved on
each of the 2 ranks, and nothing else changes.
'''),
        ]),
        Section("The ZeRO-1 step: reduce-scatter, update a shard, all-gather", [
            md(r'''
Adam updates every element independently, so the update of element $i$ only needs element $i$ of the
gradient, the master weight and the two moments. ZeRO-1 (Rajbhandari et al., 2020) uses that: flatten all
parameters into one vector, **pad** it with zeros to a multiple of $N$, and let rank $r$ own the $r$-th
slice. One step:

1. forward and backward as in DP: every rank computes the **full** local gradient of its micro-batch;
2. **reduce-scatter** the flat gradient: rank $r$ receives the *sum* over ranks of slice $r$ only - divide
   by $N$ to average, as in Part 4;
3. each rank runs Adam on **its slice**: its fp32 master weights and moments exist only for that slice;
4. **all-gather** the updated slices (cast to bf16) so every rank has all the parameters for the next forward.

Reduce-scatter followed by all-gather *is* an all-reduce (a ring all-reduce is exactly these two phases,
Part 3), so ZeRO-1 moves no more bytes than DP's all-reduce (Part 7 counts them): the memory saving is
almost free. On 2 real ranks:
'''),
            COLLECTIVES,
            md(r'''
In the engine the flat vector is cut into size-capped buckets (the same buckets as Part 4's DP), each
padded to a multiple of $N$ and reduce-scattered as soon as its gradients are ready, overlapping backward;
the all-gather runs after the step. With bf16 training the masters are fp32 and what is all-gathered is the
bf16 copy of the updated slice.
'''),
        ]),
        Section("Measured: ZeRO-1 in the engine", [
            md(r'''
Back to the two measurements above, owner by owner: ZeRO-1 against DP on the same rank, and the formula
of this engine's recipe, $2\Psi + 4\Psi + 12\Psi/N$ (bf16 parameters, fp32 gradients):
'''),
            ENGINE_ZERO1,
            md(r'''
Only the optimizer states shrink, by exactly $N$ (padding adds at most $N-1$ elements per bucket).
'''),
        ]),
        Section("At scale: Llama 3 8B on 1 to 64 GPUs, and k = 12, not 8", [
            md(r'''
For the playbook's recipe (bf16 gradients), ZeRO-1 holds per rank

$$2\Psi + 2\Psi + \frac{12\Psi}{N}.$$

**A correction to the published Part 6 of this series:** it computed ZeRO-1's savings with 8 bytes per
parameter of optimizer state - Adam's two moments only. With mixed precision, the fp32 master weights are
optimizer state too, and ZeRO-1 shards them with the moments: each rank updates only its slice, so it only
needs the fp32 masters of that slice. $k = 12$. Using $k = 8$ understates both the memory of plain DP
(by $4\Psi$ bytes per GPU) and the saving of ZeRO-1: compare the last two columns below at $N = 1$.

The planner (`ultrascale plan memory`, the same model as the engine's memory accounting, at the scale of
real models) gives the model states per GPU for Llama 3 8B; the last two columns are the formula with
$k = 12$ and with the wrong $k = 8$:
'''),
            PLANNER,
            md(r'''
The planner agrees with $k = 12$ at every $N$. Note what the table says about the limit of ZeRO-1: the
optimizer shrinks towards zero, but $2\Psi + 2\Psi = 4\Psi$ (the params and grads columns) stays on every GPU
however many you add - that is what ZeRO-2 and ZeRO-3 attack (Part 7). Activations are not sharded by
ZeRO at all (Part 2's recomputation, and later parallelisms, deal with them).

The command line gives the same figures for one layout:
'''),
            PLANNER_CLI,
        ]),
    ],
    exercises=[
        Exercise(
            title="The ZeRO-1 optimizer step on 2 ranks",
            instructions=r'''
Write the two halves of a ZeRO-1 optimizer; they run on every rank:

- `shard_parameters(params)`: flatten all parameters (in order) into one vector, pad it with zeros to a
  multiple of the world size, and return **only this rank's slice** as a new fp32 `nn.Parameter`, the master
  copy. The check then builds `torch.optim.Adam([master])`, so Adam's moments exist for the slice only.
- `zero1_step(params, master, opt)` (called after backward, each rank holding its local gradients): flatten
  and pad the gradients, **reduce-scatter** them into this rank's slice, **average**, set `master.grad`, step
  Adam, then **all-gather** the updated slices and copy them into the parameters (dropping the padding).

Use `reduce_scatter(output, input)` and `all_gather(output, input)` from the setup cell. The check runs your
functions on 2 real ranks, each on half of a batch, with a model of 43 parameters (an odd number: padding
matters), and compares with one process running `torch.optim.Adam` on the whole batch. It also watches
what each rank does: one reduce-scatter of the gradients before `opt.step()`, one all-gather of the updated
shards after it, and no optimizer over more than the rank's own shard.
''',
            starter=EX1_STARTER,
            solution=EX1_SOLUTION,
            check=r'''
from ultrascale.series.checks import part6

part6.exercise_1(shard_parameters, zero1_step)
''',
            hints=[
                "The padded length is `shard_size * world` with `shard_size = ceil(numel / world)`; rank r's slice "
                "starts at `r * shard_size`. Allocate the padded vector with `torch.zeros` and fill the first "
                "`numel` elements with `torch.cat` of the flattened tensors.",
                "In `zero1_step`: `reduce_scatter(shard_grad, flat_grad)` with `shard_grad` of length "
                "`master.numel()` leaves the **sum** over ranks; divide by `world` before assigning `master.grad`.",
                "After `opt.step()`: `all_gather(full, master.detach())` with `full` of the padded length, "
                "then walk the parameters with an offset and `p.copy_(full[offset:offset + p.numel()].view_as(p))` "
                "inside `torch.no_grad()`.",
            ],
        ),
        Exercise(
            title="Memory per rank under ZeRO-1",
            instructions=r'''
Write `zero1_bytes_per_rank(psi, n, grad_bytes)`: the bytes of parameters, gradients and optimizer states on
one of `n` ZeRO-1 ranks, for `psi` parameters trained in bf16 with mixed-precision AdamW.

Decide for each owner how many bytes per parameter it holds and whether ZeRO-1 divides it by `n`. The check
compares your figures with the engine's measured memory per owner on 2 real ranks (two model sizes; the
engine keeps fp32 gradients, `grad_bytes=4`) and with the planner's for Llama 3 8B at N = 1 to 64, with bf16
and with fp32 gradients.
''',
            starter=EX2_STARTER,
            solution=EX2_SOLUTION,
            check=r'''
from ultrascale.series.checks import part6

part6.exercise_2(zero1_bytes_per_rank)
''',
            hints=[
                "Only one owner is sharded by ZeRO-1; the parameters and the gradients stay whole on every rank.",
                "Parameters are bf16 (2 bytes); gradients take `grad_bytes`; the optimizer holds three fp32 values "
                "per parameter.",
                "`{'params': 2 * psi, 'grads': grad_bytes * psi, 'optim': ... * psi / n}` - the fp32 master "
                "weights count with the two moments.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            "A 7B-parameter model is trained in bf16 with mixed-precision AdamW (bf16 gradients) on 8 data-parallel "
            "GPUs with ZeRO-1. About how many GB of model states does each GPU hold?",
            ["7 x (2 + 2 + 8/8) = 35 GB", "7 x (2 + 2 + 12) = 112 GB", "7 x 16 / 8 = 14 GB",
             "7 x (2 + 2 + 12/8) = 38.5 GB"],
            3,
            "k = 12: fp32 master weights plus two moments are all sharded; parameters and gradients stay whole.",
        ),
        QuizQuestion(
            "Why does ZeRO-1 cost about the same communication as plain data parallelism?",
            ["It skips the gradient all-reduce",
             "It compresses gradients to 8 bits",
             "Reduce-scatter + all-gather move the same bytes as the all-reduce they replace",
             "It communicates only every N steps"],
            2,
            "A ring all-reduce is a reduce-scatter followed by an all-gather; ZeRO-1 splits them around the "
            "optimizer step.",
        ),
        QuizQuestion(
            "With ZeRO-1 on N GPUs, what does the memory of the model states per GPU (parameters, gradients and "
            "optimizer states) approach as N grows very large (playbook recipe)?",
            ["Zero", "4 bytes per parameter: bf16 parameters and bf16 gradients stay whole",
             "12 bytes per parameter", "16/N bytes per parameter"],
            1,
            "Only the 12 bytes of optimizer state are divided by N; 2 + 2 bytes remain on every rank (the planner's "
            "table: 31.3 GiB at N = 64 for Llama 3 8B, towards 4 bytes x 8.03 B parameters = 29.9 GiB). "
            "Activations come on top of the model states, and ZeRO does not shard them.",
        ),
        QuizQuestion(
            "Why must the flat vector be padded before the reduce-scatter?",
            ["Reduce-scatter and all-gather need equal slices: its length "
             "must be a multiple of the number of ranks", "To align it to 128 bytes for the GPU",
             "Adam needs an even number of elements",
             "To leave room for the gradient norm"],
            0,
            "Each rank receives exactly length/N elements, so the length is padded up to a multiple of N with zeros.",
        ),
    ],
)
