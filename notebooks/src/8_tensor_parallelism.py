"""Part 8 of the series: tensor parallelism.

The source of notebooks/8_tensor_parallelism.ipynb (build it with
`python notebooks/src/build.py 8`). Every multi-rank cell runs on 2 real gloo
processes (ultrascale.series.ranks.on_ranks); every figure is measured in the
notebook: errors against one process, the engine's parameter shards, its
training losses, its memory per rank and the bytes of its TP collectives.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import collections

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import get_preset
from ultrascale.series.ranks import on_ranks

WORLD = 2  # every multi-rank cell below runs on 2 real processes (gloo, this CPU)
torch.set_num_threads(1)
''')

SPLITS = code(r'''
def mlp_splits(seed=0):
    """One MLP, gelu(x A) B, split over this rank's half of the hidden features, two ways."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    x, A, B = torch.randn(4, 8, generator=g), torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
    reference = F.gelu(x @ A) @ B
    half = slice(rank * 8, (rank + 1) * 8)

    # Column-parallel A (its output features), row-parallel B (the matching input features):
    # GELU acts on whole features, so the only communication is one all-reduce of the output.
    out = F.gelu(x @ A[:, half]) @ B[half]
    dist.all_reduce(out)

    # Row-parallel A instead: x @ A is a partial sum on each rank, and GELU of a partial sum is not
    # a part of GELU of the sum. Summing after GELU is wrong; it needs an all-reduce before GELU.
    rows = slice(rank * 4, (rank + 1) * 4)  # this rank's half of A's 8 input features (and of x's)
    wrong = F.gelu(x[:, rows] @ A[rows]) @ B
    dist.all_reduce(wrong)
    return (out - reference).abs().max().item(), (wrong - reference).abs().max().item()


for rank, (column_row, row_first) in enumerate(on_ranks(WORLD, mlp_splits)):
    print(f"rank {rank}: column-then-row, one all-reduce: max |error| {column_row:.1e}; "
          f"row-parallel first, summed after GELU: max |error| {row_first:.2f}")
''')

SHAPES = code(r'''
MODEL = get_preset("tiny")  # h = 64, 8 query heads, 4 key/value heads, FFN 128, vocabulary 257


def tp_shards():
    """This rank's parameters after the engine's tensor-parallel transform (tp = 2)."""
    from ultrascale.distributed.context import build_context
    from ultrascale.model import build_model
    from ultrascale.parallel import shard_model

    cfg = RunConfig(model=MODEL, parallel=ParallelConfig(dp=1, tp=dist.get_world_size()))
    ctx = build_context(cfg.parallel, dist.get_rank(), dist.get_world_size())
    model = build_model(cfg.model, 0, ctx.device, transform=shard_model(ctx, cfg))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


shards = on_ranks(WORLD, tp_shards)
for name, shape in shards[0].items():
    if name.startswith("layers.0.") or not name.startswith("layers."):
        print(f"{name:32s} rank 0 {str(shape):11s} rank 1 {shards[1][name]}")
print(f"llama3-8b's vocabulary: {get_preset('llama3-8b').vocab_size:,} logits per token")
''')

ENGINE = code(r'''
from ultrascale.testing.compare import train_on

MB, SEQ, STEPS = 2, 32, 2


def config(tp):
    # peak="1": MFU against a given ceiling; measuring this CPU's would add all-reduces of its own at start.
    return RunConfig(model=MODEL, parallel=ParallelConfig(dp=1, tp=tp),
                     train=TrainConfig(steps=STEPS, seq_len=SEQ, micro_batch=MB, seed=5, peak="1", progress=False))


def engine_run(cfg):
    """Train with the engine on this rank, recording the size of every all-reduce it calls."""
    from ultrascale.distributed.context import build_context
    from ultrascale.train.trainer import run_training

    sizes, real = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted  # the engine looks dist.all_reduce up at each call: this sees all of them
    try:
        result = run_training(cfg, build_context(cfg.parallel, dist.get_rank(), dist.get_world_size()))
    finally:
        dist.all_reduce = real
    return result.losses, result.metrics[-1]["memory"], sizes


single = train_on(config(1), 1)
tp_losses, tp_memory, sizes = on_ranks(WORLD, engine_run, config(WORLD))[0]
print("one process:", " ".join(f"{x:.6f}" for x in single.losses))
print("tp = 2     :", " ".join(f"{x:.6f}" for x in tp_losses),
      f"(worst relative difference {max(abs(a - b) / b for a, b in zip(tp_losses, single.losses)):.1e})")
for what in ("params", "grads", "optim", "activations"):
    one, two = single.memory[-1][what], tp_memory[what]
    print(f"{what:11s} one process {one:9,d} B   tp = 2, per rank {two:9,d} B   ({two / one:.3f}x)")
''')

COMM = code(r'''
activation = MB * SEQ * MODEL.hidden * 4  # one [b, s, h] fp32 tensor
by_size = collections.Counter(sizes)
per_step = by_size[activation] // STEPS
print(f"all-reduces of a [b, s, h] activation ({activation:,} B) per step on rank 0: {per_step} "
      f"= 4 x {MODEL.layers} blocks + 2 (4L + 2 = {4 * MODEL.layers + 2})")
print("the other all-reduces per step:",
      {size: n // STEPS for size, n in sorted(by_size.items()) if size != activation}, "(bytes: count)")
ring = 2 * (WORLD - 1) / WORLD  # a ring all-reduce sends and receives 2(t-1)/t of the tensor per rank
print(f"sent per rank per step by the activation all-reduces: {per_step * activation * ring:,.0f} B; "
      f"per block {4 * activation * ring:,.0f} B = 8 (t-1)/t * b*s*h * 4 bytes")
''')


EPISODE = Episode(
    number=8,
    title="Tensor Parallelism",
    slug="tensor_parallelism",
    subtitle="Splitting every matrix multiplication across GPUs: Megatron's column and row parallel layers",
    overview=[
        "Column-parallel then row-parallel linears: one all-reduce per MLP, and why the order matters",
        "The conjugate operators f and g: where the all-reduces sit in forward and backward",
        "Attention heads split across ranks; the embedding and the loss split over the vocabulary",
        "The engine's shards, losses, memory per rank and the bytes of its all-reduces, measured on 2 ranks",
    ],
    references=[
        Reference(3, "the all-reduce and its ring cost"),
        Reference(6, "ZeRO, which shards the model states but not the computation"),
        Reference(9, "sequence parallelism, which shards what tensor parallelism leaves whole"),
    ],
    sections=[
        Section("Split the matrices, not the batch", [
            md(r'''
Data parallelism and ZeRO (Parts 4 to 7) split the *batch*; every rank still runs the whole model and holds
whole activations. **Tensor parallelism (TP)** splits the *weights* of each linear layer over $t$ ranks, and
with them the computation and most activations. Megatron-LM's recipe uses two ways to split $Y = XA$:

- **column-parallel**: $A = [A_1, A_2]$ split along its output features; rank $i$ computes
  $Y_i = X A_i$ from the whole $X$ and holds a slice of $Y$'s features;
- **row-parallel**: $A$ split along its input features and $X$ along its features;
  $Y = X_1 A_1 + X_2 A_2$, each rank holds a **partial sum**, and an all-reduce adds them.

An MLP is $\mathrm{GELU}(XA)B$. With $A$ column-parallel, each rank holds whole hidden features, so GELU
(elementwise) runs locally; $B$ row-parallel then takes exactly those features as its input shard. No
communication between the two; one all-reduce at the end. Splitting $A$ by rows instead would leave partial
sums before GELU, and $\mathrm{GELU}(a) + \mathrm{GELU}(b) \ne \mathrm{GELU}(a + b)$: a second
synchronisation. Note what is *not* there: a column-parallel layer used alone would end with an all-gather
of $Y$'s slices, and a row-parallel one would begin by scattering $X$; in the pair neither happens, because
the first layer's output slices are exactly the second layer's input shards. On 2 real ranks:
'''),
            SETUP,
            SPLITS,
        ]),
        Section("The conjugate operators f and g", [
            md(r'''
Autograd must see the communication too. Megatron wraps the sharded region in two operators:

| | forward | backward |
|---|---|---|
| **f** (entering: before the column-parallel linear) | identity: every rank already holds $X$ | all-reduce of $\partial L / \partial X$ |
| **g** (leaving: after the row-parallel linear) | all-reduce of the partial outputs | identity: the gradient is already whole on every rank |

They are *conjugate*: each one's backward is the other one's forward. Why $f$ all-reduces backward: rank
$i$ only computes the part of $\partial L/\partial X$ that flows through its columns $A_i$; the gradient
of $X$ is the sum over ranks. Why $g$ does not: its output is identical on every rank, so its gradient is
too; summing it would multiply by $t$. Per block, the forward has 2 all-reduces (attention, MLP) and the
backward 2 more: 4 all-reduces of a $[b, s, h]$ tensor, on the critical path (the next layer needs their
result), which is why TP stays inside a node's fast NVLink. You write f and g in exercise 1.
'''),
        ]),
        Section("Attention heads and the vocabulary", [
            md(r'''
Attention splits the same way, along **heads**: $W_Q, W_K, W_V$ are column-parallel (rank $i$ computes
its $a/t$ query heads and their key/value heads, so grouped-query groups stay whole on a rank: in our
engine $t$ must divide the number of key/value heads; Megatron replicates them when $t$ exceeds it), each rank runs attention on its heads alone, and $W_O$ is
row-parallel with one $g$. The norms stay whole (replicated) and see the whole hidden vector.

The **embedding** is split over the vocabulary: each rank holds $V/t$ rows, looks up the tokens it owns,
writes zeros for the others, and an all-reduce ($g$) assembles the embeddings. The **output head** is
column-parallel over the vocabulary, and its logits stay split: gathering $[b, s, V]$ logits (128,256
columns for Llama 3, printed below) would cost far more than the loss needs. The **vocabulary-parallel cross-entropy**
needs three numbers per token from the whole vocabulary (the max, for stability; $\sum_j e^{z_j - \max}$;
and the target's logit, from the rank that owns it), each an all-reduce of $[b, s]$ values. You write it in
exercise 2. Here is what the engine's TP transform leaves on each of 2 ranks of our `tiny` model (the
vocabulary, 257, is padded to 258 so that it divides by $t$):
'''),
            SHAPES,
        ]),
        Section("The engine on 2 ranks: losses, memory, communication", [
            md(r'''
The engine trains with `--tp 2` (`ultrascale train --nproc 2 --tp 2`). Below, the same 2 steps on one
process and on 2 ranks: the losses agree to float32 rounding. The memory is each rank's, measured by the
engine (parameters, gradients, optimizer states, and the activations autograd kept). Parameters are not
exactly halved: the norms are replicated on every rank and the vocabulary is padded. Activations are not
halved either: what lives outside the sharded region (the norms' inputs and outputs, the residual stream)
stays whole on every rank. Part 9 removes that.
'''),
            ENGINE,
            md(r'''
Each rank also recorded the size of every `dist.all_reduce` the engine called. The $[b, s, h]$ ones are
TP's: 4 per block (f and g of attention and MLP, forward and backward), plus the embedding's $g$ in forward
and the head's $f$ in backward. The small ones are the loss's three per-token reductions ($[b, s]$ values:
$2 \cdot 32 \cdot 4$ = 256 bytes each) and the gradient norm of the sharded parameters (one fp32 value, 4
bytes). The volume per block does not
shrink as $t$ grows: 4 ring all-reduces send $8\frac{t-1}{t}\,bsh$ values per rank (4 bytes each in
fp32, 2 in bf16), more as $t$ grows, while the compute per rank falls as $1/t$. That ratio is TP's limit.
'''),
            COMM,
        ]),
    ],
    exercises=[
        Exercise(
            title="A tensor-parallel MLP with f and g",
            instructions=r'''
Write `tp_mlp(x, w1_shard, w2_shard)`, run on 2 real ranks: the MLP $\mathrm{GELU}(x W_1^\top) W_2^\top$
(weights stored as `nn.Linear` does, `[out, in]`) with $W_1$ column-parallel and $W_2$ row-parallel.
`x` is `[b, s, h]`, the same on every rank; `w1_shard` is this rank's rows of $W_1$ (`[f/t, h]`),
`w2_shard` the matching columns of $W_2$ (`[h, f/t]`). Return the whole output on every rank.

Fill in the two autograd functions (they are defined inside `tp_mlp` so that they travel to the ranks with
it): **f** entering the region, **g** leaving it. The check compares the output and the gradients of `x`
and of both shards with one process running the whole MLP, and reads the collectives each rank called:
one all-reduce of the $[b, s, h]$ activation in forward, one in backward, and no weights moved.
''',
            starter=r'''
def tp_mlp(x, w1_shard, w2_shard):
    """Column-parallel w1, GELU, row-parallel w2, between f and g; the whole output on every rank."""

    class EnterRegion(torch.autograd.Function):  # f
        @staticmethod
        def forward(ctx, x):
            # TODO
            raise NotImplementedError

        @staticmethod
        def backward(ctx, grad):
            # TODO
            raise NotImplementedError

    class LeaveRegion(torch.autograd.Function):  # g
        @staticmethod
        def forward(ctx, partial):
            # TODO
            raise NotImplementedError

        @staticmethod
        def backward(ctx, grad):
            # TODO
            raise NotImplementedError

    # TODO: EnterRegion.apply(x), the two linears with GELU between, LeaveRegion.apply(...)
    raise NotImplementedError
''',
            solution=r'''
def tp_mlp(x, w1_shard, w2_shard):
    """Column-parallel w1, GELU, row-parallel w2, between f and g; the whole output on every rank."""

    class EnterRegion(torch.autograd.Function):  # f
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
            return grad

    class LeaveRegion(torch.autograd.Function):  # g
        @staticmethod
        def forward(ctx, partial):
            out = partial.contiguous().clone()
            dist.all_reduce(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad

    hidden = F.gelu(EnterRegion.apply(x) @ w1_shard.t())   # [b, s, f/t]: whole features, no communication
    return LeaveRegion.apply(hidden @ w2_shard.t())        # partial sums over the ranks -> one all-reduce
''',
            check=r'''
from ultrascale.series.checks import part8
part8.exercise_1(tp_mlp)
''',
            hints=[
                "f's forward returns x as it is (`x.view_as(x)`, so autograd records an operation); g's backward "
                "returns the gradient as it is. Each of the other two is one `dist.all_reduce`.",
                "`dist.all_reduce` works in place: all-reduce a copy (`t.contiguous().clone()`) and return it, "
                "rather than changing a tensor autograd may still need.",
                "`hidden = F.gelu(EnterRegion.apply(x) @ w1_shard.t())`, then "
                "`return LeaveRegion.apply(hidden @ w2_shard.t())`.",
            ],
        ),
        Exercise(
            title="Vocabulary-parallel cross-entropy",
            instructions=r'''
Write `vocab_parallel_ce(logits, targets, vocab_start)`, run on 2 real ranks. `logits` is this rank's
`[tokens, V/t]` shard, the columns `vocab_start ... vocab_start + V/t - 1` of the whole logits; `targets`
(`[tokens]`) holds token ids of the whole vocabulary. Return the mean cross-entropy over the tokens, equal
to `F.cross_entropy` on the whole logits, on every rank.

Never gather the logits: all-reduce per-token numbers only, namely the max (`op=dist.ReduceOp.MAX`), the sum of
$e^{z - \max}$, and the target's logit (its owner has it; the others contribute 0). The check also runs
logits around 1000, where $e^z$ overflows.
''',
            starter=r'''
def vocab_parallel_ce(logits, targets, vocab_start):
    """Mean cross-entropy from this rank's vocabulary shard of the logits."""
    n = logits.shape[-1]
    # TODO: the global max, the global sum of exp(z - max), the target logit from its owner;
    # loss per token = log(sum_exp) - (z_target - max), then the mean.
    raise NotImplementedError
''',
            solution=r'''
def vocab_parallel_ce(logits, targets, vocab_start):
    """Mean cross-entropy from this rank's vocabulary shard of the logits."""
    n = logits.shape[-1]
    zmax = logits.max(dim=-1).values
    dist.all_reduce(zmax, op=dist.ReduceOp.MAX)
    z = logits - zmax.unsqueeze(-1)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp)
    local = targets - vocab_start
    mine = (local >= 0) & (local < n)
    z_target = z.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(z_target)
    return (sum_exp.log() - z_target).mean()
''',
            check=r'''
from ultrascale.series.checks import part8
part8.exercise_2(vocab_parallel_ce)
''',
            hints=[
                "Three all-reduces of `[tokens]` tensors: MAX of the row maxima, SUM of the rows' "
                "`exp(z - max).sum(-1)` (with the global max), SUM of the target logits.",
                "The target's column on this rank is `targets - vocab_start`; it is yours only where "
                "`0 <= local < n`. Gather with the index clamped into range, then zero the others.",
                "`loss = (sum_exp.log() - z_target).mean()` with `z_target` already shifted by the global max.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            question="Why does Megatron make the MLP's first linear column-parallel and its second row-parallel?",
            options=["Row-parallel layers need less memory for their weights",
                     "The GELU between them then acts on whole features on each rank: one all-reduce per MLP",
                     "It lets the MLP run without any communication",
                     "Column-parallel layers are faster on GPUs"],
            answer=1,
            why="Column-parallel outputs are whole features, exactly the input shard a row-parallel layer needs.",
        ),
        QuizQuestion(
            question="What does g (the operator after the row-parallel linear) do in the backward pass?",
            options=["Nothing: the gradient is already the same on every rank",
                     "An all-reduce of the gradient",
                     "An all-gather of the gradient",
                     "It divides the gradient by t"],
            answer=0,
            why="g's forward all-reduces; its conjugate f is the one that all-reduces in backward.",
        ),
        QuizQuestion(
            question="How many all-reduces of a [b, s, h] activation does one transformer block cost per "
                     "micro-batch under tensor parallelism (forward and backward)?",
            options=["2", "1", "t", "4"],
            answer=3,
            why="One g each for attention and MLP in forward, one f each in backward; measured above.",
        ),
        QuizQuestion(
            question="Why is tensor parallelism usually kept inside one node?",
            options=["torch.distributed cannot span nodes",
                     "It needs the whole model on every GPU",
                     "Its all-reduces sit on the critical path of every layer, with volume that does not shrink "
                     "with t",
                     "It only works with 8 GPUs"],
            answer=2,
            why="The next layer waits for each all-reduce, so TP needs NVLink-class bandwidth.",
        ),
    ],
)
