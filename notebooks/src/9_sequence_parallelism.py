"""Part 9 of the series: sequence parallelism.

The source of notebooks/9_sequence_parallelism.ipynb (build it with
`python notebooks/src/build.py 9`). Every multi-rank cell runs on 2 real gloo
processes (ultrascale.series.ranks.on_ranks); every figure is measured in the
notebook: the tensors the engine's block keeps under TP and TP+SP, the
engine's losses, activations and the bytes of its collectives.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import collections
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import get_preset
from ultrascale.series.ranks import on_ranks

WORLD = 2  # every multi-rank cell below runs on 2 real processes (gloo, this CPU)
MODEL = get_preset("tiny")  # h = 64, 8 heads, 4 key/value heads, FFN 128
torch.set_num_threads(1)
''')

SAVED = code(r'''
def saved_by_block(sp, b=1, s=24):
    """The tensors block 0 of the engine's TP (sp=False) or TP+SP model keeps for backward on this rank."""
    from ultrascale.distributed.context import build_context
    from ultrascale.model import build_model
    from ultrascale.parallel import shard_model

    t = dist.get_world_size()
    # f = 192 here, so that f/t = 96 is not mistaken for h = 64 in the listing
    cfg = RunConfig(model=replace(MODEL, layers=1, ffn_hidden=192), parallel=ParallelConfig(dp=1, tp=t, sp=sp))
    ctx = build_context(cfg.parallel, dist.get_rank(), t)
    model = build_model(cfg.model, 0, ctx.device, transform=shard_model(ctx, cfg))
    params = {p.untyped_storage().data_ptr() for p in list(model.parameters()) + list(model.buffers())}
    kept = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = (tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""), tensor.untyped_storage().nbytes())
        return tensor

    x = torch.randn(b, s // t if sp else s, MODEL.hidden, requires_grad=True)  # SP: this rank's s/t positions
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.layers["0"](x, model.rope_cos[:s], model.rope_sin[:s])
    return sorted(kept.values(), key=lambda k: -k[2])


for sp in (False, True):
    kept = on_ranks(WORLD, saved_by_block, sp)[0]
    print(f"tp = 2{' + sp' if sp else '     '}: rank 0 keeps {sum(k[2] for k in kept):,} bytes for block 0 (b=1, s=24)")
    for (shape, dtype), n in collections.Counter((k[0], k[1]) for k in kept).items():
        print(f"    {n} x {str(shape):14s} {dtype}")
''')

PAIR = code(r'''
def allreduce_vs_pair(b=2, s=8, h=4):
    """The same partial sums [b, s, h], summed by one all-reduce or by a reduce-scatter along the
    sequence followed by an all-gather; the bytes each puts on the wire from this rank (ring algorithms)."""
    rank, t = dist.get_rank(), dist.get_world_size()
    partial = torch.randn(b, s, h, generator=torch.Generator().manual_seed(rank))
    summed = partial.clone()
    dist.all_reduce(summed)

    shard = torch.empty(b, s // t, h)
    dist.reduce_scatter(shard, [c.contiguous() for c in partial.chunk(t, dim=1)])  # sum, keep my positions
    parts = [torch.empty_like(shard) for _ in range(t)]
    dist.all_gather(parts, shard)                                                   # whole sequence again
    n = partial.numel() * partial.element_size()
    return (torch.cat(parts, dim=1) - summed).abs().max().item(), 2 * (t - 1) / t * n, 2 * ((t - 1) / t * n)


err, ar_bytes, pair_bytes = on_ranks(WORLD, allreduce_vs_pair)[0]
print(f"reduce-scatter + all-gather vs all-reduce: max |difference| {err:.1e} (measured); bytes each rank "
      f"sends, by the ring's formula 2 (t - 1)/t x n: all-reduce {ar_bytes:,.0f}, reduce-scatter + all-gather "
      f"{pair_bytes:,.0f} (the same count: the pair is how a ring all-reduce works)")
''')

ENGINE = code(r'''
from ultrascale.testing.compare import train_on

MB, SEQ, STEPS = 2, 32, 2


def config(tp, sp=False):
    return RunConfig(model=MODEL, parallel=ParallelConfig(dp=1, tp=tp, sp=sp),
                     train=TrainConfig(steps=STEPS, seq_len=SEQ, micro_batch=MB, seed=5, progress=False))


def engine_run(cfg):
    """Train with the engine on this rank; record every TP collective it calls and its size."""
    import ultrascale.parallel.tensor.comm as tp_comm
    from ultrascale.distributed.context import build_context
    from ultrascale.train.trainer import run_training

    calls = []
    real = dist.all_reduce, tp_comm._all_gather, tp_comm._reduce_scatter

    def counted(name, fn, which):  # which: the argument whose size is the whole [b, s, h] tensor
        def wrapped(*args, **kwargs):
            calls.append((name, args[which].numel() * args[which].element_size(), tuple(args[which].shape)))
            return fn(*args, **kwargs)
        return wrapped

    dist.all_reduce = counted("all-reduce", real[0], 0)
    tp_comm._all_gather = counted("all-gather", real[1], 0)          # (output, input): the output is whole
    tp_comm._reduce_scatter = counted("reduce-scatter", real[2], 1)  # (output, input): the input is whole
    try:
        result = run_training(cfg, build_context(cfg.parallel, dist.get_rank(), dist.get_world_size()))
    finally:
        dist.all_reduce, tp_comm._all_gather, tp_comm._reduce_scatter = real
    return result.losses, result.metrics[-1]["memory"]["activations"], calls


single = train_on(config(1), 1)
print(f"one process : losses {' '.join(f'{x:.6f}' for x in single.losses)}, "
      f"activations {single.memory[-1]['activations']:,} B")
runs = {}
for sp in (False, True):
    losses, activations, calls = runs[sp] = on_ranks(WORLD, engine_run, config(WORLD, sp))[0]
    print(f"tp = 2{' + sp' if sp else '     '}: losses {' '.join(f'{x:.6f}' for x in losses)}, "
          f"activations {activations:,} B per rank")
''')

VOLUME = code(r'''
activation = MB * SEQ * MODEL.hidden * 4  # one whole [b, s, h] fp32 tensor
share = (WORLD - 1) / WORLD               # a ring all-gather or reduce-scatter sends (t-1)/t of it per rank
for sp in (False, True):
    calls = collections.Counter(name for name, size, _ in runs[sp][2] if size == activation)
    sent = sum(n * (2 if name == "all-reduce" else 1) * share * activation for name, n in calls.items())
    print(f"tp = 2{' + sp' if sp else '     '}: per step {', '.join(f'{n // STEPS} {name}s' for name, n in calls.items())}"
          f" of [b, s, h]; sent per rank {sent / STEPS:,.0f} B")
small = collections.Counter(shape for name, size, shape in runs[True][2] if name == "all-reduce" and size < activation)
print(f"tp = 2 + sp, the small all-reduces of the run's {STEPS} steps (shape: count):", dict(sorted(small.items())))
''')

PER_BLOCK = code(r'''
from ultrascale.series.checks.part9 import block_activation_bytes_on_ranks

h = MODEL.hidden
for b, s in ((2, 32), (1, 64), (4, 48)):
    tp = block_activation_bytes_on_ranks(MODEL, b, s, sp=False)
    tp_sp = block_activation_bytes_on_ranks(MODEL, b, s, sp=True)
    print(f"b={b}, s={s:2d}: one block keeps {tp:7,d} B per rank with tp = 2, {tp_sp:7,d} B with tp = 2 + sp: "
          f"{tp / (b * s):.0f} and {tp_sp / (b * s):.0f} per token")
print(f"the difference per token, 2 norms x (8h + 4) x (1 - 1/t): {2 * (8 * h + 4) * (1 - 1 / WORLD):.0f}")
''')


EPISODE = Episode(
    number=9,
    title="Sequence Parallelism",
    slug="sequence_parallelism",
    subtitle="Sharding along the sequence what tensor parallelism leaves whole, for the same communication",
    overview=[
        "The regions tensor parallelism leaves whole: norms, residuals, dropout; measured in the engine's block",
        "All-gather entering the tensor-parallel region and reduce-scatter leaving it, instead of one all-reduce",
        "The same bytes on the wire: measured in the engine's collectives",
        "Activation memory per rank, TP against TP+SP, measured and written as a formula",
    ],
    references=[
        Reference(2, "activation memory of one block"),
        Reference(3, "all-gather and reduce-scatter, and why their sum is an all-reduce"),
        Reference(8, "tensor parallelism: the f and g operators this part replaces"),
        Reference(10, "context parallelism, which shards the sequence inside attention too"),
    ],
    sections=[
        Section("What tensor parallelism leaves whole", [
            md(r'''
Tensor parallelism (Part 8) splits the attention heads and the MLP's features, and with them the
activations *inside* those regions. Between them, the norms and the residual additions (and dropout, in
models that use it) need the whole hidden vector of each token, so under TP every rank runs them on the
whole $[b, s, h]$ tensor and keeps the same copy of their activations. Below, the tensors block 0 of the
engine's model keeps for backward on rank 0 of 2 ($b = 1$, $s = 24$, $h = 64$, $f = 192$). Under plain TP
eight tensors are whole on every rank: each norm's fp32 input and $x \cdot \mathrm{rstd}$ ($[1, 24, 64]$)
with its `rstd` ($[1, 24, 1]$), and the two norm outputs ($[24, 64]$, as the linears see them); q
($[1, \text{heads}/t, 24, 8]$), k and v ($[1, \text{kv heads}/t, 24, 8]$), the logsumexp, the attention
output ($[24, h/t = 32]$) and the MLP's four $f/t = 96$-wide tensors are split.
'''),
            SETUP,
            SAVED,
            md(r'''
These ops act on **each token alone**. So they can run on a shard of the *sequence*: rank $i$ keeps
positions $i\frac{s}{t} \dots (i+1)\frac{s}{t} - 1$. That is **sequence parallelism (SP)** (Korthikanti
et al., 2022): with `--sp`, the norms' tensors become $[1, 12, 64]$ (and $[1, 12, 1]$). The norm outputs do not shrink: they are the
inputs of the column-parallel linears, which need the whole sequence (below). Megatron keeps only the shard of that
input and all-gathers it again in backward; our engine keeps the gathered copy, trading
$(1 - 1/t) \cdot 4h$ bytes per token for each of the two norm outputs for one all-gather less.
'''),
        ]),
        Section("All-gather in, reduce-scatter out", [
            md(r'''
Entering the TP region, a rank needs the whole sequence; leaving it, the row-parallel output is a partial
sum that TP's $g$ would all-reduce. SP replaces the pair $f$ / $g$ of Part 8 by another conjugate pair
along the sequence dimension:

| | forward | backward |
|---|---|---|
| $g$ (entering) | all-gather along the sequence | reduce-scatter of the gradient |
| $\bar g$ (leaving) | reduce-scatter along the sequence | all-gather of the gradient |

A reduce-scatter followed by an all-gather **is** an all-reduce: the ring all-reduce of Part 3 is exactly
these two phases. So SP splits TP's all-reduce in two and runs the per-token ops in between on $1/t$ of
the tokens. The volume is the same: each phase sends $\frac{t-1}{t}$ of the tensor per rank, the
all-reduce $2\frac{t-1}{t}$. On 2 ranks:
'''),
            PAIR,
            md(r'''
One more change: the norms' weights now see only $s/t$ tokens on each rank, so their gradients are partial
sums and need an all-reduce over the TP group (small: $h$ values each). And dropout, in models that use it:
without SP, dropout after $g$ acts on the same replicated tensor on every TP rank and must draw the same
mask everywhere (one seed for the TP group); under SP each rank drops out its own positions, so the ranks
draw different masks (a per-rank stream, as Megatron already uses inside the TP region, where ranks hold
different heads). You write $g$ and $\bar g$ in exercise 1.
'''),
        ]),
        Section("The engine with --sp: same losses, same bytes, fewer activations", [
            md(r'''
`ultrascale train --nproc 2 --tp 2 --sp` on 2 ranks against one process, and `--tp 2` alone; each rank
recorded the collectives the engine called (by wrapping them in the process before training):
'''),
            ENGINE,
            md(r'''
Every all-reduce of a $[b, s, h]$ activation became one all-gather and one reduce-scatter, and the bytes
per rank are equal. The small all-reduces under SP are, per step, the loss's three per-token reductions
($[b, s]$), the gradient norm (one value) and the new one: the 5 norm weights' gradients ($h$ fp32 values
each); and, once per run, one value at start-up (the ranks agreeing on a cached peak FLOP/s).
'''),
            VOLUME,
        ]),
        Section("Activation memory per rank", [
            md(r'''
Per block and per rank, measured with the engine's `ActivationMeter` for a few $(b, s)$: both grow with
$b \cdot s$ (attention here is flash-style: nothing grows with $s^2$), and SP removes $(1 - 1/t)$ of the
norms' share. Korthikanti et al. count a GPT block in 16-bit with dropout and eager attention:
$sbh\,(10 + \frac{24}{t} + \frac{5as}{ht})$ bytes per rank under TP and $\frac{sbh}{t}(34 + \frac{5as}{h})$
under TP+SP (with flash attention the $5as/h$ term goes). For our block (RMSNorm in fp32, SwiGLU, GQA, no
dropout) and an engine that keeps the gathered linear inputs, the count differs, and you derive it in
exercise 2. Where the whole block divides by $t$, as in Megatron, TP+SP turns every extra TP rank into
longer sequences; what still grows with $s$ on each rank is what context parallelism (Part 10) cuts.
'''),
            PER_BLOCK,
        ]),
    ],
    exercises=[
        Exercise(
            title="The sequence-parallel pair as autograd functions",
            instructions=r'''
Write the two autograd functions of `sp_block(x_shard, w1_shard, w2_shard)`, run on 2 real ranks. The block is
$x + \mathrm{GELU}(\mathrm{RMSNorm}(x) W_1^\top) W_2^\top$ (no norm weight), with $W_1$ column-parallel
(`w1_shard`: this rank's rows, `[f/t, h]`) and $W_2$ row-parallel (`w2_shard`: the matching columns,
`[h, f/t]`). `x_shard` is `[b, s/t, h]`: this rank's positions of the sequence (dim 1); the return value
is the block's output for the same positions.

`GatherSequence` ($g$): all-gather along dim 1 forward, reduce-scatter backward. `ScatterSequence`
($\bar g$): reduce-scatter along dim 1 forward, all-gather backward. `dist.all_gather(list, t)` and
`dist.reduce_scatter(out, list)` work on gloo. The check reads the collectives each rank called (one
all-gather and one reduce-scatter each way, no `dist.all_reduce`) and compares the output and the
gradients of `x_shard` and both weight shards with one process running the whole block.
''',
            starter=r'''
def sp_block(x_shard, w1_shard, w2_shard):
    """x + MLP(RMSNorm(x)) for this rank's positions, with g and g-bar around the TP region."""
    t = dist.get_world_size()

    class GatherSequence(torch.autograd.Function):  # g
        @staticmethod
        def forward(ctx, x):
            # TODO: [b, s/t, h] on each rank -> [b, s, h], the ranks' positions in rank order
            raise NotImplementedError

        @staticmethod
        def backward(ctx, grad):
            # TODO
            raise NotImplementedError

    class ScatterSequence(torch.autograd.Function):  # g-bar
        @staticmethod
        def forward(ctx, partial):
            # TODO: [b, s, h] partial sums -> [b, s/t, h], the sum over ranks of this rank's positions
            raise NotImplementedError

        @staticmethod
        def backward(ctx, grad):
            # TODO
            raise NotImplementedError

    normed = F.rms_norm(x_shard, (x_shard.shape[-1],))        # per token: runs on the shard
    hidden = F.gelu(GatherSequence.apply(normed) @ w1_shard.t())
    return x_shard + ScatterSequence.apply(hidden @ w2_shard.t())
''',
            solution=r'''
def sp_block(x_shard, w1_shard, w2_shard):
    """x + MLP(RMSNorm(x)) for this rank's positions, with g and g-bar around the TP region."""
    t = dist.get_world_size()

    def all_gather(x):
        parts = [torch.empty_like(x) for _ in range(t)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    def reduce_scatter(x):
        out = torch.empty_like(x.chunk(t, dim=1)[0]).contiguous()
        dist.reduce_scatter(out, [c.contiguous() for c in x.chunk(t, dim=1)])
        return out

    class GatherSequence(torch.autograd.Function):  # g
        @staticmethod
        def forward(ctx, x):
            return all_gather(x)

        @staticmethod
        def backward(ctx, grad):
            return reduce_scatter(grad)

    class ScatterSequence(torch.autograd.Function):  # g-bar
        @staticmethod
        def forward(ctx, partial):
            return reduce_scatter(partial)

        @staticmethod
        def backward(ctx, grad):
            return all_gather(grad)

    normed = F.rms_norm(x_shard, (x_shard.shape[-1],))        # per token: runs on the shard
    hidden = F.gelu(GatherSequence.apply(normed) @ w1_shard.t())
    return x_shard + ScatterSequence.apply(hidden @ w2_shard.t())
''',
            check=r'''
from ultrascale.series.checks import part9
part9.exercise_1(sp_block)
''',
            hints=[
                "Write two helpers first: `all_gather(x)` (a list of `t` empty tensors, `dist.all_gather`, "
                "`torch.cat(..., dim=1)`) and `reduce_scatter(x)` (`x.chunk(t, dim=1)`, made contiguous, "
                "`dist.reduce_scatter` into an empty `[b, s/t, h]`).",
                "Each function's backward is the other's forward: g is all_gather forward and reduce_scatter "
                "backward; g-bar the reverse.",
                "Why reduce-scatter in g's backward: every rank computed a partial gradient for the whole "
                "sequence through its own features; sum them, and keep your positions.",
            ],
        ),
        Exercise(
            title="Activation memory per rank, TP against TP+SP",
            instructions=r'''
Write `activation_bytes_per_rank(cfg, b, s, t, sp)`: the bytes one block of our model keeps for backward on
each rank, in fp32 with flash attention, for $b$ sequences of $s$ tokens, tensor-parallel over $t$ ranks,
with (`sp=True`) or without sequence parallelism. `cfg` gives $h$ (`cfg.hidden`), the heads, the
key/value heads and $f$ (`cfg.ffn_hidden`).

Start from what one process keeps (Part 2: per token, two fp32 norms of $8h + 4$ bytes, two norm outputs
of $4h$, q, k, v, the fp32 logsumexp per head, the attention output, four $f$-wide MLP tensors) and decide,
tensor by tensor, what $t$ divides with and without SP, using the listing at the top. The check measures
the engine's block on 2 real ranks with `ActivationMeter` (and on one process for $t = 1$), for two
shapes and several $(b, s)$.
''',
            starter=r'''
def activation_bytes_per_rank(cfg, b, s, t, sp):
    """Bytes one block keeps per rank (fp32, flash attention), TP over t ranks, with or without SP."""
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a)
    # TODO: per token: the norms, the norm outputs, the inside of attention and MLP; each divided by
    # what t divides it by; then times b * s.
    raise NotImplementedError
''',
            solution=r'''
def activation_bytes_per_rank(cfg, b, s, t, sp):
    """Bytes one block keeps per rank (fp32, flash attention), TP over t ranks, with or without SP."""
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a)
    norms = 2 * (8 * h + 4) / (t if sp else 1)      # fp32 input, rstd, x*rstd: on s/t positions under SP
    norm_outputs = 2 * 4 * h                        # the column-parallel inputs, kept gathered: whole
    inside = (4 * (2 * h + 2 * kv) + 4 * a + 16 * f) / t  # q, k, v, output, logsumexp, MLP: a/t heads, f/t
    return b * s * (norms + norm_outputs + inside)
''',
            check=r'''
from ultrascale.series.checks import part9
part9.exercise_2(activation_bytes_per_rank)
''',
            hints=[
                "Three groups per token: the norms' own tensors, the norm outputs (the inputs of q/k/v and "
                "gate/up), and everything inside attention and the MLP.",
                "Inside the region everything divides by t in both cases. The norms divide by t only with SP. "
                "The norm outputs are all-gathered before the column-parallel linears, and the engine keeps "
                "that gathered copy: they never divide.",
                "`b * s * (2*(8*h + 4) / (t if sp else 1) + 8*h + (4*(2*h + 2*kv) + 4*a + 16*f) / t)`.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            question="Which activations does sequence parallelism shard that tensor parallelism alone keeps "
                     "whole on every rank?",
            options=["The attention scores",
                     "The MLP's hidden activations",
                     "Those of the per-token ops between the TP regions: norms, residuals, dropout",
                     "The model's weights"],
            answer=2,
            why="They need the whole hidden vector but only one token at a time, so they can split the sequence.",
        ),
        QuizQuestion(
            question="What replaces TP's all-reduce after the row-parallel linear under SP?",
            options=["An all-to-all",
                     "A reduce-scatter along the sequence (an all-gather in backward)",
                     "Nothing: SP removes that communication",
                     "Two all-reduces"],
            answer=1,
            why="Each rank keeps the summed output of its own positions; the whole sequence is gathered again "
                "only when the next TP region needs it.",
        ),
        QuizQuestion(
            question="How does the communication volume per rank of TP+SP compare with TP alone?",
            options=["The same", "Half", "Twice", "t times larger"],
            answer=0,
            why="Reduce-scatter plus all-gather is a ring all-reduce split in two; measured above.",
        ),
        QuizQuestion(
            question="Under SP, why do the norm weights' gradients need an all-reduce over the TP group?",
            options=["The norm weights are sharded across ranks",
                     "To average over data-parallel replicas",
                     "They do not: norm gradients are always local",
                     "Each rank saw only its s/t positions, so its gradient is a partial sum"],
            answer=3,
            why="The weight is replicated, but the tokens contributing to its gradient are split.",
        ),
    ],
)
