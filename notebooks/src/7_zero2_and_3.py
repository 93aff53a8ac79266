"""Part 7 of the series: ZeRO-2 (gradients sharded) and ZeRO-3 (parameters sharded, gathered just in time).

The source of notebooks/7_zero2_and_3.ipynb (build it with `python notebooks/src/build.py 7`).
Everything about several ranks runs on 2 real gloo processes (`on_ranks`): memory per owner
as the engine measures it, the order of ZeRO-3's collectives, and the bytes every stage's
collectives move (counted by wrapping them). The planner extends the picture to real models.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import dataclasses

import torch
import torch.distributed as dist

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.model import count_params, get_preset
from ultrascale.series.ranks import on_ranks

# The flat collectives got new names in torch 2.13; older releases only have the old ones.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

WORLD = 2  # every multi-rank cell runs on 2 real gloo processes, started once and reused


def run_config(zero, micro_batches=1, layers=2, steps=1):
    """The engine's tiny Llama-style model: bf16 compute, fp32 master weights and gradients, AdamW."""
    cfg = RunConfig(model=get_preset("tiny", layers=layers), parallel=ParallelConfig(dp=WORLD, zero=zero),
                    train=TrainConfig(steps=steps, seq_len=16, micro_batch=1, grad_accum=micro_batches,
                                      dtype="bf16", progress=False, measure_activations=False))
    return validate(cfg, WORLD)


psi = count_params(get_preset("tiny"))
print(f"tiny model: psi = {psi:,} parameters")
''')

MEMORY = code(r'''
def train_and_measure(cfg):
    """Runs on every rank: one step, then the bytes each owner holds on this rank (measured on the tensors)."""
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import run_training

    return run_training(cfg, worker_context(cfg.parallel)).metrics[-1]["memory"]


print(f"bytes per parameter on each of {WORLD} ranks (bf16 parameters, fp32 gradients, AdamW with fp32 masters)")
for zero in range(4):
    mem = on_ranks(WORLD, train_and_measure, run_config(zero))
    assert all(mem[0][k] == mem[1][k] for k in ("params", "grads", "optim"))  # every rank holds the same
    owners = "  ".join(f"{k} {mem[0][k] / psi:5.2f}" for k in ("params", "grads", "optim"))
    print(f"ZeRO-{zero}: {owners}  | total {sum(mem[0][k] for k in ('params', 'grads', 'optim')) / psi:5.2f}")
''')

TRACE = code(r'''
def trace_zero3_step(cfg):
    """Runs on every rank: the engine's ZeRO-3 collectives and block computations of one step, in order."""
    import ultrascale.parallel.zero as zero
    import ultrascale.parallel.zero3 as zero3
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import Trainer

    trainer = Trainer(cfg, worker_context(cfg.parallel))
    trainer.train_step()  # a first step, so the trace shows a steady one
    units = trainer.grads
    name = {id(b): f"block {i}" for i, b in enumerate(units.block_units)}
    name[id(units.root)] = "root (embedding, final norm, head)"
    events = []

    def unit_of(tensor, attr):
        return next(name[id(b)] for b in units.buckets if getattr(b, attr) is tensor)

    gather, scatter = zero3._all_gather, zero._reduce_scatter

    def traced_gather(output, input, **kw):
        events.append(f"all-gather     {unit_of(output, 'param_flat')}")
        return gather(output, input, **kw)

    def traced_scatter(output, input, **kw):
        events.append(f"reduce-scatter {unit_of(input, 'grad')}")
        return scatter(output, input, **kw)

    hooks = []
    for i, block in enumerate(trainer.model.layers.values()):
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: events.append(f"    forward  block {i}")))
        hooks.append(block.register_full_backward_pre_hook(lambda m, g, i=i: events.append(f"    gradient reaches block {i}")))
    # The engine's modules bound the collectives when they were imported: wrap those names.
    zero3._all_gather, zero._reduce_scatter = traced_gather, traced_scatter
    try:
        trainer.train_step()
    finally:
        zero3._all_gather, zero._reduce_scatter = gather, scatter
        for h in hooks:
            h.remove()
    return events


print("\n".join(on_ranks(WORLD, trace_zero3_step, run_config(3, layers=3, steps=2))[0]))
''')

LINEAR_GRADS = code(r'''
def linear_grads(x, w, b, grad_out):
    """Gradients of y = x @ w.T + b (x: [batch, in]) with respect to x, w and b, given dL/dy."""
    return grad_out @ w, grad_out.t() @ x, grad_out.sum(0)


# Against autograd, on one Linear layer:
layer = torch.nn.Linear(3, 2)
x = torch.randn(4, 3, requires_grad=True)
y = layer(x)
g = torch.randn_like(y)
y.backward(g)
mine = linear_grads(x.detach(), layer.weight.detach(), layer.bias.detach(), g)
print("linear_grads matches autograd:", all(torch.allclose(a, b) for a, b in zip(mine, (x.grad, layer.weight.grad, layer.bias.grad))))
''')

COUNT = code(r'''
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_gather": lambda n: (n - 1) / n}  # bytes each rank sends per byte of the full buffer


def count_step(cfg):
    """Runs on every rank: every collective of one training step (after a first one), as (kind, elements,
    bytes of the full buffer). torch.distributed's functions are wrapped, and so are the names the engine's ZeRO modules
    bound at import time."""
    import ultrascale.parallel.zero as zero
    import ultrascale.parallel.zero3 as zero3
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import Trainer

    trainer = Trainer(cfg, worker_context(cfg.parallel))
    trainer.train_step()
    calls = []

    def counted(kind, fn, which):
        def wrapper(*args, **kwargs):
            t = args[which]  # all-reduce: the tensor; reduce-scatter: its input; all-gather: its output
            calls.append((kind, t.numel(), t.numel() * t.element_size()))
            return fn(*args, **kwargs)
        return wrapper

    targets = [(dist, "all_reduce", "all_reduce", 0), (zero, "_reduce_scatter", "reduce_scatter", 1),
               (zero, "_all_gather", "all_gather", 0), (zero3, "_all_gather", "all_gather", 0)]
    targets += [(dist, n, "reduce_scatter", 1) for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)]
    targets += [(dist, n, "all_gather", 0) for n in ("all_gather_into_tensor", "all_gather_single") if hasattr(dist, n)]
    originals = [(mod, n, getattr(mod, n)) for mod, n, _, _ in targets]
    for mod, n, kind, which in targets:
        setattr(mod, n, counted(kind, getattr(mod, n), which))
    try:
        trainer.train_step()
    finally:
        for mod, n, fn in originals:
            setattr(mod, n, fn)
    return calls


sent, elements = {}, {}
print(f"one step on {WORLD} ranks, rank 0: calls x kind (payload), bytes sent per rank / psi")
for m in (1, 2):
    for zero in range(4):
        calls = on_ranks(WORLD, count_step, run_config(zero, micro_batches=m, steps=2))[0]
        big = [(k, b) for k, e, b in calls if e > 1]        # the model's tensors
        small = sum(b for k, e, b in calls if e == 1)       # scalars: the loss, the gradient norm
        kinds = {}
        for k, b in big:
            n, total = kinds.get(k, (0, 0))
            kinds[k] = (n + 1, total + b)
        sent[zero, m] = sum(RING[k](WORLD) * b for k, e, b in calls)
        # The playbook's unit: elements, an all-reduce counting twice (its two halves), scalars left out.
        elements[zero, m] = sum((2 if k == "all_reduce" else 1) * e for k, e, b in calls if e > 1)
        desc = ", ".join(f"{n} x {k} ({total / psi:.2f} psi B)" for k, (n, total) in kinds.items())
        print(f"micro-batches {m} | {['DP    ', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3'][zero]}: {desc} + {small} B of scalars"
              f" -> sent {sent[zero, m] / psi:.2f} B/param")
''')

PLAYBOOK_UNITS = code(r'''
from ultrascale.model import build_model

# The root unit: every parameter outside the transformer blocks (a model on the meta device costs no memory).
skeleton = build_model(get_preset("tiny"), 0, torch.device("meta"))
kept = psi - sum(p.numel() for p in skeleton.layers.parameters())
print(f"root unit, kept gathered from forward to backward: {kept:,} of {psi:,} parameters ({kept / psi:.1%})")
for zero, label in ((0, "DP"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3")):
    print(f"{label:6s}: {elements[zero, 1] / psi:.2f} psi elements per step (1 micro-batch) | bytes sent "
          f"{sent[zero, 1] / sent[0, 1]:.2f}x DP's | with 2 micro-batches: {sent[zero, 2] / sent[zero, 1]:.2f}x its own "
          f"1-micro-batch bytes")
print(f"ZeRO-3 without the kept root would be 3 psi; with it: 3 - {kept / psi:.2f} = {3 - kept / psi:.2f} psi")
''')

PLANNER = code(r'''
from ultrascale.plan.calibration import get_framework
from ultrascale.plan.hardware import get_cluster
from ultrascale.plan.layout import Layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.shape import get_shape
from ultrascale.plan.time import step_time

framework = dataclasses.replace(get_framework("playbook"), partition="even")
gpu = get_cluster("playbook")  # the playbook's H100 cluster
GiB = 2**30
for model in ("llama3-8b", "llama3-70b"):
    shape = get_shape(model)
    print(f"\n{model} ({shape.count() / 1e9:.1f} B), seq 4096, micro-batch 1, {gpu.gpu.name}: peak GiB per GPU "
          f"[states: params+grads+optim]  (* = fits in {gpu.memory_bytes / GiB:.0f} GiB)")
    print(f"{'N':>4} " + " ".join(f"{'ZeRO-' + str(z):>22}" for z in range(4)))
    for n in (1, 8, 64, 512):
        row = []
        for zero in range(4):
            plan = memory_plan(shape, Layout(dp=n, zero=zero, micro_batch=1, seq_len=4096, precision="bf16"),
                               framework).peak
            states = sum(plan.terms[k] for k in ("params", "grads", "optim"))
            mark = "*" if plan.total <= gpu.memory_bytes else " "
            row.append(f"{plan.total / GiB:8.1f}{mark} [{states / GiB:7.1f}]  ")
        print(f"{n:>4} " + " ".join(row))
''')

PAYOFF = code(r'''
def halving_stops_paying(shape, zero, threshold=0.10):
    """The smallest N (a power of 2) from which doubling the data-parallel GPUs cuts the peak memory
    per GPU by less than `threshold`."""
    n = 1
    while n <= 4096:
        now = memory_plan(shape, Layout(dp=n, zero=zero, micro_batch=1, seq_len=4096, precision="bf16"), framework).peak.total
        nxt = memory_plan(shape, Layout(dp=2 * n, zero=zero, micro_batch=1, seq_len=4096, precision="bf16"), framework).peak.total
        if (now - nxt) / now < threshold:
            return n, now
        n *= 2
    return n, nxt


for model in ("llama3-8b", "llama3-70b"):
    shape = get_shape(model)
    for zero in (1, 2, 3):
        n, peak = halving_stops_paying(shape, zero)
        lay = Layout(dp=n, zero=zero, micro_batch=1, seq_len=4096, precision="bf16")
        t = step_time(shape, lay, gpu, framework)
        print(f"{model} ZeRO-{zero}: doubling N saves < 10% from N = {n} on ({peak / GiB:.1f} GiB per GPU); "
              f"there, exposed DP communication {t.breakdown['dp_comm'] * 1e3:.0f} ms of a {t.step_s * 1e3:.0f} ms step")
''')


EXPLORER = code(r'''
# The playbook's memory widget, on the planner: pick a model and a layout, read the memory per GPU by owner.
# Here the figure for Llama 3 8B on 8 GPUs under ZeRO-1; in Jupyter or Colab the controls below it redraw it.
from ultrascale.series.widgets import memory_explorer

explorer = memory_explorer(model="llama3-8b", dp=8, zero=1)
''')

OFFLOAD_MEMORY = code(r'''
def with_offload(cfg, offload):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, offload=offload))


print(f"bytes per parameter on each of {WORLD} ranks: on the device, and moved off it by --offload cpu")
for zero in (1, 3):
    for offload in ("none", "cpu"):
        mem = on_ranks(WORLD, train_and_measure, with_offload(run_config(zero), offload))[0]
        moved = mem.get("offloaded") or {"optim": 0, "params": 0}
        device = "  ".join(f"{k} {mem[k] / psi:5.2f}" for k in ("params", "grads", "optim"))
        print(f"ZeRO-{zero}, offload {offload:4s}: device {device} | host {(moved['optim'] + moved['params']) / psi:5.2f}")
''')

OFFLOAD_PLAN = code(r'''
from ultrascale.plan.search import search

host = gpu.offload_host  # the planner's hardware table: what offload moves over, and the CPU's optimizer runs at
print(f"{gpu.gpu.name}, per GPU: PCIe {host.pcie_bandwidth / 1e9:.0f} GB/s to the host, HBM {gpu.hbm_bandwidth / 1e12:.2f} "
      f"TB/s, host memory {host.memory_bandwidth / 1e9:.0f} GB/s")
shape = get_shape("llama3-70b")
pins = {"pp": 1, "cp": 1}  # 8 GPUs, one node, without pipeline or context parallelism
plain = search(shape, 8, gpu, framework, 4096, 16 * 4096, "bf16", {**pins, "offload": "none"})
smallest = plain.smallest
print(f"llama3-70b on 8 x {gpu.gpu.name}, no offload: {plain.enumerated} layouts, {len(plain.ranked)} fit; "
      f"the smallest needs {smallest.memory.peak.total / GiB:.1f} GiB per GPU ({smallest.layout.label()})")
best = search(shape, 8, gpu, framework, 4096, 16 * 4096, "bf16", pins).ranked[0]
b = best.time.breakdown
print(f"the planner's answer: {best.layout.label()}")
print(f"  {best.memory.peak.total / GiB:.1f} GiB per GPU, {best.memory.peak.offloaded / GiB:.1f} GiB per GPU in host memory")
print(f"  step {best.time.step_s:.2f} s: optimizer on the host {b['optimizer']:.2f} s, PCIe copies not hidden "
      f"{b['offload']:.2f} s, compute {b['compute'] + b['recompute']:.2f} s")
''')


EX1_STARTER = r'''
def gather_linear(shard, shape, all_gather):
    # Just in time, before the layer's forward (and again before its backward): all-gather the layer's
    # flat parameters from every rank's shard and return the full (weight, bias) of a Linear layer.
    # The flat vector is weight (shape = (out_features, in_features), row by row), then bias, then zero
    # padding up to world * shard.numel(). all_gather(output, input) as in the setup cell.
    world = dist.get_world_size()
    # TODO
    raise NotImplementedError


def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
    # The layer's backward under ZeRO-3: forward did not keep the gathered parameters, so gather them
    # again; then compute the gradients (linear_grads), flatten and pad the parameter gradients,
    # reduce-scatter them and average. Return (gradient of x, gradient of this rank's shard).
    world = dist.get_world_size()
    # TODO
    raise NotImplementedError
'''

EX1_SOLUTION = r'''
def gather_linear(shard, shape, all_gather):
    # Just in time, before the layer's forward (and again before its backward): all-gather the layer's
    # flat parameters from every rank's shard and return the full (weight, bias) of a Linear layer.
    # The flat vector is weight (shape = (out_features, in_features), row by row), then bias, then zero
    # padding up to world * shard.numel(). all_gather(output, input) as in the setup cell.
    world = dist.get_world_size()
    out_f, in_f = shape
    full = torch.empty(shard.numel() * world)
    all_gather(full, shard.detach())
    weight = full[:out_f * in_f].view(out_f, in_f)
    bias = full[out_f * in_f:out_f * in_f + out_f]  # the padding after it is dropped
    return weight, bias


def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
    # The layer's backward under ZeRO-3: forward did not keep the gathered parameters, so gather them
    # again; then compute the gradients (linear_grads), flatten and pad the parameter gradients,
    # reduce-scatter them and average. Return (gradient of x, gradient of this rank's shard).
    world = dist.get_world_size()
    weight, bias = gather_linear(shard, shape, all_gather)  # freed after forward: gather again
    grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
    flat = torch.zeros(shard.numel() * world)
    n = grad_w.numel() + grad_b.numel()
    flat[:n] = torch.cat([grad_w.reshape(-1), grad_b])
    grad_shard = torch.empty(shard.numel())
    reduce_scatter(grad_shard, flat)  # each rank receives the sum over ranks of its slice only
    return grad_x, grad_shard / world
'''

EX2_STARTER = r'''
def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
    """Bytes each of n ranks sends in one optimizer step of data parallelism with ZeRO stage `stage`
    (0 = plain DP with no_sync accumulation, 1, 2 or 3), over ring collectives.

    psi: parameters; micro_batches: gradient-accumulation steps per optimizer step;
    param_bytes / grad_bytes: bytes per parameter / gradient element on the wire;
    psi_kept: (ZeRO-3) parameters of units kept gathered from forward to backward.
    """
    ring = (n - 1) / n  # a ring reduce-scatter or all-gather: each rank sends this much of the full buffer
    # TODO: which collectives each stage runs, on what, and how many times per step
    raise NotImplementedError
'''

EX2_SOLUTION = r'''
def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
    """Bytes each of n ranks sends in one optimizer step of data parallelism with ZeRO stage `stage`
    (0 = plain DP with no_sync accumulation, 1, 2 or 3), over ring collectives.

    psi: parameters; micro_batches: gradient-accumulation steps per optimizer step;
    param_bytes / grad_bytes: bytes per parameter / gradient element on the wire;
    psi_kept: (ZeRO-3) parameters of units kept gathered from forward to backward.
    """
    ring = (n - 1) / n  # a ring reduce-scatter or all-gather: each rank sends this much of the full buffer
    grads, params = grad_bytes * psi, param_bytes * psi
    if stage == 0:
        return 2 * ring * grads                               # one all-reduce per step
    if stage == 1:
        return ring * (grads + params)                        # reduce-scatter once, all-gather after the step
    if stage == 2:
        return ring * (micro_batches * grads + params)        # reduce-scatter every micro-batch
    gathers = 2 * params - param_bytes * psi_kept             # forward and backward, the kept unit once
    return micro_batches * ring * (gathers + grads)           # all of it every micro-batch
'''


EPISODE = Episode(
    number=7,
    title="ZeRO-2 and ZeRO-3",
    slug="zero2_and_3",
    subtitle="Shard the gradients, then the parameters themselves: memory per rank against bytes on the wire",
    overview=[
        "ZeRO-2: gradients sharded too - each bucket is reduce-scattered during backward and only this rank's "
        "shard is kept; memory per rank measured by the engine on 2 real ranks for every stage",
        "ZeRO-3 (FSDP): parameters sharded, all-gathered just before each block's forward and backward and freed "
        "after, the next block's gather prefetched - the engine's own sequence of collectives, traced",
        "Communication per step, counted by wrapping the engine's collectives: DP and ZeRO-1/2 move about "
        "$2\\Psi$, ZeRO-3 about $3\\Psi$; ZeRO-2 reduce-scatters and ZeRO-3 does everything on every micro-batch",
        "Where each stage stops paying off: the planner across N and model sizes (Llama 3 8B and 70B)",
        "Offload: the optimizer shard (and ZeRO-3's parameters) moved to host memory, measured on the engine; "
        "and when it pays - the planner's answer for a model that fits only with it",
        "Exercises: just-in-time gathering of a ZeRO-3 layer on 2 ranks; bytes per rank per step for every stage, "
        "checked against what the engine's collectives moved",
    ],
    references=[
        Reference(6, "ZeRO-1: the optimizer states sharded, reduce-scatter + all-gather, k = 12"),
        Reference(4, "data parallelism: buckets, overlap, and no_sync for gradient accumulation"),
        Reference(3, "ring reduce-scatter and all-gather, and what each rank sends"),
    ],
    sections=[
        Section("Setup", [
            md(r'''
As in Part 6, every multi-rank cell runs on **2 real gloo processes** (`on_ranks`), the engine's tiny
Llama-style model trained in bf16 with fp32 master weights and fp32 gradients.
'''),
            SETUP,
        ]),
        Section("ZeRO-2: shard the gradients", [
            md(r'''
After ZeRO-1 (Part 6), every rank still holds the full parameters and the **full gradients**. Yet after the
reduce-scatter a rank only ever *uses* its own slice of the gradient: the optimizer step on its shard needs
nothing else. **ZeRO-2** therefore keeps only that slice:

- during backward, each bucket is **reduce-scattered as soon as its gradients are complete** (overlapping the
  rest of backward, as DP's all-reduce did in Part 4), the rank keeps its shard, and the full bucket buffer
  is freed - at most a couple of full buckets exist at any moment;
- with gradient accumulation this happens **every micro-batch**: a rank that keeps only a shard cannot add
  the next micro-batch's full gradient to it locally, so `no_sync` has nothing to offer;
- after the optimizer step, the parameters are all-gathered as in ZeRO-1.

The communication is the same reduce-scatter + all-gather as ZeRO-1 (per micro-batch for the first), and
the gradients drop from $\Psi$ to $\Psi/N$ elements per rank. Measured, for every stage:
'''),
            MEMORY,
            md(r'''
Read it column by column: ZeRO-1 halves the optimizer states on 2 ranks, ZeRO-2 the gradients as well,
ZeRO-3 the parameters too - $(2 + 4 + 12)\Psi/N$ for this recipe. The general formulas, with $b$, $g$ and
$k$ the bytes per parameter of the parameters, gradients and optimizer states:

| stage | per rank |
| --- | --- |
| DP | $(b + g + k)\Psi$ |
| ZeRO-1 | $(b + g)\Psi + k\Psi/N$ |
| ZeRO-2 | $b\Psi + (g + k)\Psi/N$ |
| ZeRO-3 | $(b + g + k)\Psi/N$ |
'''),
        ]),
        Section("ZeRO-3: shard the parameters, gather them just in time", [
            md(r'''
ZeRO-3 (PyTorch calls it FSDP, *fully sharded data parallel*) shards the parameters as well. A rank can
only compute a layer whose parameters it holds in full, so:

- the model is cut into **units** - in the engine one per transformer block, plus a *root* unit for what lies
  outside the blocks (embedding, final norm, head);
- just **before** a unit's forward, its parameters are **all-gathered**; right **after** it, the gathered
  copy is **freed**, so only one or two units are ever whole on a rank;
- backward needs them again: they are all-gathered once more just before the unit's backward, and freed
  once its gradients are reduce-scattered (as in ZeRO-2);
- **prefetch**: while block $i$ computes, the all-gather of block $i+1$ (of $i-1$ in backward) is already in
  flight, so communication hides behind compute when compute is long enough;
- the root unit is needed at the very start of forward and at the very end of backward; the engine keeps it
  gathered in between, so it is gathered once per micro-batch instead of twice (PyTorch's FSDP2 does the
  same: the root module is not resharded after forward, since backward needs it at once).

The next cell wraps the engine's collectives on both ranks and records, in order, every all-gather and
reduce-scatter of one ZeRO-3 step of a 3-block model, interleaved with the blocks' forward and backward:
'''),
            TRACE,
            md(r'''
Each block is gathered before it computes, the next one already on its way; in backward the order reverses
and every block's gradients are reduce-scattered as soon as they are complete. The last block is freed at
the end of forward and gathered again at once for backward - which is why torchtitan does not reshard the
last block after forward. Only the units in flight are ever whole; the price is one more all-gather of the
parameters per micro-batch.

Exercise 1 builds the heart of this for a Linear layer. Its backward needs the gradients of
$y = xW^\top + b$, given here and checked against autograd:
'''),
            LINEAR_GRADS,
        ]),
        Section("Communication per step, counted", [
            md(r'''
What does each stage cost on the wire? The next cell wraps `torch.distributed`'s collectives on each rank
(and the names the engine's ZeRO modules bound to them at import), runs one training step per stage, and
records every call with the size of its full buffer. In a ring, each rank **sends** $(N-1)/N$ of the buffer
for a reduce-scatter or an all-gather and twice that for an all-reduce (Part 3), so the bytes a rank sends
follow from the calls. One micro-batch per step, then two:
'''),
            COUNT,
            md(r'''
In the playbook's unit - elements per micro-batch, an all-reduce counted as its two halves, the factor
$(N-1)/N$ left out - DP's all-reduce is $2\Psi$ (reduce-scatter $\Psi$ + all-gather $\Psi$), ZeRO-1 and
ZeRO-2 replace it by the same two halves, $2\Psi$, and ZeRO-3 adds the second all-gather: $3\Psi$. The
engine's counts refine that in three ways (the next cell puts the measurements side by side):

- **widths**: gradients travel in fp32 (4 bytes) and parameters in bf16 (2 bytes), so ZeRO-1's
  all-gather of bf16 parameters is *cheaper* than the second half of DP's fp32 all-reduce;
- **micro-batches**: DP and ZeRO-1 communicate once per step, ZeRO-2 reduce-scatters and ZeRO-3 does
  everything once per micro-batch;
- **the kept root**: ZeRO-3 gathers the root unit once, not twice, per micro-batch.
'''),
            PLAYBOOK_UNITS,
        ]),
        Section("Where each stage stops paying off", [
            md(r'''
On 2 ranks ZeRO saves at most half. At scale the planner (`ultrascale plan memory`, the same accounting as
the engine) shows the whole trade. Peak memory per H100 for Llama 3 8B and 70B (bf16 gradients, the
playbook's recipe, no recomputation), with the model states in brackets:
'''),
            PLANNER,
            md(r'''
Each stage divides some owners by $N$ and leaves the rest: ZeRO-1 keeps $4\Psi$ (parameters and gradients)
on every GPU, ZeRO-2 keeps $2\Psi$, ZeRO-3 only activations - which no ZeRO stage shards, and which set
the floor of all three. So adding GPUs stops helping at some point; the planner says where, and what the
communication costs there:
'''),
            PAYOFF,
            md(r'''
The planner counts ZeRO-1/2's all-gather after the optimizer step as exposed (Megatron-LM's distributed
optimizer can overlap it with the next forward, `--overlap-param-gather`), while ZeRO-3's gathers are
prefetched behind the blocks' compute.

Past the point where memory stops shrinking, more GPUs still add throughput (more samples in parallel, as
far as the global batch allows: Part 5), but no memory headroom; for memory the next levers are activation
recomputation (Part 2) and the parallelisms that shard activations and compute - tensor, sequence, context
and pipeline parallelism, the next parts. ZeRO-3's own limit is time,
not memory: every micro-batch all-gathers every block twice, and when a block's compute gets shorter
than its all-gather (small micro-batches, slow links between nodes, thousands of GPUs adding latency
steps), prefetching can no longer hide it.

Try it: move the ZeRO stage from 0 to 3 and watch the parameters, gradients and optimizer states shrink in
turn while the activations stay; then raise the sequence length, or switch recomputation on, and see which
owner sets the floor. (Without a widget front-end, as on GitHub, the cell shows the figure for the values
it was called with; `explorer.update(zero=3)` draws another.)
'''),
            EXPLORER,
        ]),
        Section("Offload: when even 1/N does not fit", [
            md(r'''
ZeRO divides the model states by $N$; with few GPUs and a large model even that is too much. The playbook's
last lever here is **offload** (ZeRO-Offload, Ren et al. 2021): move this rank's **optimizer shard** - the
fp32 master weights and Adam's two moments - off the GPU into host memory, and run the optimizer step **on
the CPU**. With ZeRO-3 the parameter shard moves too, copied to the GPU just before each gather (PyTorch's
FSDP2 `CPUOffloadPolicy`). ZeRO-Infinity goes one tier further: the states in files on NVMe drives, streamed
through host memory.

The engine's `--offload cpu|disk` (parallel/offload.py) does exactly that, one segment of the shard at a
time: the gradient segment is copied to the host, AdamW updates the segment there (read from and written
back to the files with `disk`), and the new values are copied back to the device's parameters - on a GPU on
a side stream, so the next segment's copy runs while the CPU computes. On this CPU "host" and "device" are
the same memory, so the copies are between two CPU tensors - but the code path is the real one, and so is
the accounting:
'''),
            OFFLOAD_MEMORY,
            md(r'''
The optimizer column drops to zero on the device and reappears on the host, $12\Psi/N$ = 6 bytes per
parameter on 2 ranks; with ZeRO-3 the bf16 parameter shard (1 byte per parameter) leaves as well. The
gradients stay: they are produced on the device and copied over, segment by segment, during the step.

The price is time: every step sends the gradients down and the parameters up over PCIe (50 GB/s per
GPU, against 3.35 TB/s of HBM), and the CPU's AdamW runs at the host's memory bandwidth (46 GB/s per GPU):
the planner's hardware table, printed below. So offload pays only
where nothing else fits - and that is when the planner proposes it. Llama 3 70B on one node of 8 H100s,
without pipeline or context parallelism:
'''),
            OFFLOAD_PLAN,
            md(r'''
Without offload no layout fits; with it, ZeRO-3 over the 8 GPUs keeps the model states in host memory, and
the step pays for it in the CPU optimizer step and the copies the host step does not hide (the planner's
hardware table holds the PCIe, host memory and NVMe bandwidth per GPU). More GPUs, or pipeline parallelism,
would fit without that tax: offload is for when there are no more GPUs to add.
'''),
        ]),
    ],
    exercises=[
        Exercise(
            title="ZeRO-3: gather just in time, on 2 ranks",
            instructions=r'''
Write the two pieces of a ZeRO-3 Linear layer. Each rank holds only a **shard** of the layer's flat
parameters (weight row by row, then bias, zero-padded to a multiple of the world size; rank r holds slice r).

- `gather_linear(shard, shape, all_gather)`: all-gather the shards into the full flat vector and return the
  layer's `(weight, bias)`, the padding dropped. The check calls it in the layer's forward, and keeps nothing
  it returns: the gathered tensors die after forward.
- `zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter)`: gather the parameters **again**,
  compute the gradients with `linear_grads`, flatten and pad the weight and bias gradients like the
  parameters, **reduce-scatter** them, average, and return `(grad_x, grad_shard)`.

The check runs a 3-layer network of such layers on 2 real ranks (each on half of the batch) and compares
outputs, the input's gradient and every shard's gradient with one process; it also watches the collectives
each rank calls: per layer one all-gather in forward, another in backward and one reduce-scatter of the
padded gradient (an all-reduce in place of either moves twice the bytes, and is refused).
''',
            starter=EX1_STARTER,
            solution=EX1_SOLUTION,
            check=r'''
from ultrascale.series.checks import part7

part7.exercise_1(gather_linear, zero3_backward)
''',
            hints=[
                "The full flat vector has `shard.numel() * world` elements: allocate it with `torch.empty` and call "
                "`all_gather(full, shard.detach())`. The weight is its first `out * in` elements, the bias the next "
                "`out`.",
                "In `zero3_backward`, call `gather_linear` again rather than keeping anything from forward; "
                "`linear_grads(x, weight, bias, grad_out)` returns `(grad_x, grad_w, grad_b)`.",
                "Build `flat = torch.zeros(shard.numel() * world)`, fill its first `grad_w.numel() + grad_b.numel()` "
                "elements with `torch.cat([grad_w.reshape(-1), grad_b])`, `reduce_scatter(grad_shard, flat)`, and "
                "return `grad_x, grad_shard / world`.",
            ],
        ),
        Exercise(
            title="Bytes on the wire per stage",
            instructions=r'''
Write `comm_bytes_per_rank`: the bytes each of `n` ranks sends in one optimizer step, for plain DP
(`stage=0`) and ZeRO-1, -2 and -3, with ring collectives (each rank sends $(N-1)/N$ of the full buffer per
reduce-scatter or all-gather, twice that per all-reduce).

Account for what the counts above showed: which collectives each stage runs and on which tensors (gradients
travel with `grad_bytes` per element, parameters with `param_bytes`), which ones repeat for every
micro-batch, and the `psi_kept` parameters that ZeRO-3 gathers only once per micro-batch. The check compares
your figure for every stage, with 1 and 2 micro-batches, against the bytes the engine's collectives moved in
a real step on 2 ranks (counted by its own wrapper).
''',
            starter=EX2_STARTER,
            solution=EX2_SOLUTION,
            check=r'''
from ultrascale.series.checks import part7

part7.exercise_2(comm_bytes_per_rank)
''',
            hints=[
                "DP: one all-reduce of the gradients per step. ZeRO-1: a reduce-scatter of the gradients and an "
                "all-gather of the parameters, once per step.",
                "ZeRO-2 reduce-scatters the gradients every micro-batch but all-gathers the parameters once per step; "
                "ZeRO-3 repeats everything every micro-batch.",
                "ZeRO-3 per micro-batch: `ring * (2 * param_bytes * psi - param_bytes * psi_kept + grad_bytes * psi)`.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            "Why does ZeRO-2 communicate the gradients after every micro-batch when gradient accumulation is on?",
            ["To keep the loss scale in range", "A rank keeps only its shard, so it cannot accumulate the next "
             "micro-batch's full gradient locally", "Because the optimizer steps every micro-batch",
             "It does not: it uses no_sync like DP"],
            1,
            "Skipping the reduce-scatter would mean keeping the full gradient buffer - exactly what ZeRO-2 removes.",
        ),
        QuizQuestion(
            "In the playbook's unit, how much does ZeRO-3 communicate per micro-batch, against $2\\Psi$ for DP's "
            "all-reduce?",
            ["$\\Psi$", "$2\\Psi$", "$3\\Psi$: all-gather in forward, all-gather in backward, reduce-scatter",
             "$2N\\Psi$"],
            2,
            "Parameters are gathered twice (forward and backward) and the gradients reduce-scattered once.",
        ),
        QuizQuestion(
            "With ZeRO-3 on very many GPUs, what stops shrinking the memory per GPU?",
            ["The parameters", "The optimizer states", "The activations, which no ZeRO stage shards",
             "The gradients"],
            2,
            "Model states go as 1/N under ZeRO-3; activations depend on the micro-batch and sequence, not on N.",
        ),
        QuizQuestion(
            "What does ZeRO-Offload trade, and when does the planner propose it?",
            ["Communication for compute, always", "Step time (PCIe copies, a CPU optimizer step) for GPU memory, "
             "only where no layout fits without it", "Accuracy for memory: the host keeps bf16 moments",
             "Nothing: the copies are free behind compute"],
            1,
            "The states leave the GPU, but every step moves gradients and parameters over PCIe and runs Adam on "
            "the host: worth it only when nothing else fits.",
        ),
    ],
)
