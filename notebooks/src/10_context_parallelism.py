"""Part 10 of the series: context parallelism.

The source of notebooks/10_context_parallelism.ipynb (build it with
`python notebooks/src/build.py 10`). Every multi-rank cell runs on 4 real gloo
processes (ultrascale.series.ranks.on_ranks); every figure is measured in the
notebook: the planner's memory, attention errors against one process, the
engine's counted attention work and its training losses.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultrascale.series.ranks import on_ranks

WORLD = 4  # every multi-rank cell below runs on 4 real processes (gloo, this CPU)
_ = torch.manual_seed(0)
''')

MEMORY = code(r'''
# The planner's memory per GPU for Llama 3 8B at 128k tokens per sequence: tp 8 inside a node,
# selective recomputation (the attention core is recomputed), bf16 with fp32 master weights and Adam.
# The activations and logits grow with the sequence; context parallelism divides them by cp.
from ultrascale.plan.calibration import get_framework
from ultrascale.plan.hardware import get_gpu
from ultrascale.plan.layout import Layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.shape import get_shape

shape, fw, gpu = get_shape("llama3-8b"), get_framework("playbook"), get_gpu("h100-80gb")
GIB = 2**30
for cp in (1, 2, 4, 8):
    lay = Layout(dp=1, tp=8, pp=1, cp=cp, seq_len=131072, micro_batch=1, grad_accum=1,
                 precision="bf16", recompute="selective")
    peak = memory_plan(shape, lay, fw).peak
    acts = (peak.terms["activations"] + peak.terms["logits"]) / GIB
    verdict = "fits" if peak.total <= gpu.memory_bytes else "does not fit"
    print(f"cp = {cp}: activations + logits {acts:5.1f} GiB, total {peak.total / GIB:5.1f} GiB per GPU "
          f"-> {verdict} in {gpu.memory_gib:.0f} GiB")
''')

ONLY_ATTENTION = code(r'''
# Per-token layers do not care where the other tokens are; attention does.
x = torch.randn(1, 8, 16)                         # [batch, sequence, hidden]
mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16))
norm = torch.nn.RMSNorm(16)
second_half = slice(4, 8)
print("MLP on the second half alone  == its rows of the MLP on everything:",
      torch.allclose(mlp(norm(x))[:, second_half], mlp(norm(x[:, second_half]))))

q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))  # [batch, heads, sequence, head dim]
full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
alone = F.scaled_dot_product_attention(q[:, :, second_half], k[:, :, second_half], v[:, :, second_half],
                                       is_causal=True)
print("attention of the second half alone == its rows of attention on everything:",
      torch.allclose(full[:, :, second_half], alone))
''')

ALLGATHER = code(r'''
def allgather_attention_demo(seq_len):
    """On each rank: its quarter of one sequence's q, k, v; all-gather K and V, attend locally."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)                 # every rank builds the same full tensors ...
    q, k, v = (torch.randn(1, 2, seq_len, 16, generator=g) for _ in range(3))
    n = seq_len // world
    mine = slice(rank * n, (rank + 1) * n)               # ... and keeps only its shard
    q_mine, k_mine, v_mine = q[:, :, mine], k[:, :, mine].contiguous(), v[:, :, mine].contiguous()

    k_all = [torch.empty_like(k_mine) for _ in range(world)]
    v_all = [torch.empty_like(v_mine) for _ in range(world)]
    dist.all_gather(k_all, k_mine)
    dist.all_gather(v_all, v_mine)
    k_full, v_full = torch.cat(k_all, dim=2), torch.cat(v_all, dim=2)

    # Causal across shards: query i (global position rank*n + i) sees keys 0 .. rank*n + i.
    positions = torch.arange(rank * n, (rank + 1) * n)
    allowed = torch.arange(seq_len)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q_mine, k_full, v_full, attn_mask=allowed)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, mine]
    received = sum(t.numel() * t.element_size() for t in k_all + v_all) - 2 * k_mine.numel() * 4
    return (out - reference).abs().max().item(), received, k_full.numel() * 2 * 4


for seq_len in (64, 256):
    results = on_ranks(WORLD, allgather_attention_demo, seq_len)
    worst = max(r[0] for r in results)
    print(f"sequence {seq_len:3d}: max |error| vs one process {worst:.1e}; each rank received "
          f"{results[0][1]:,} bytes of K/V and holds {results[0][2]:,} bytes of the whole sequence's K/V")
''')

RING = code(r'''
from ultrascale.parallel.context.blocks import WORK, block_forward, merge
from ultrascale.parallel.context.comm import ContextGroup
from ultrascale.parallel.context.ring import ring_attention as engine_ring_attention
from ultrascale.parallel.context.sharding import shard_positions


def engine_ring_demo(layout, seq_len=64):
    """The engine's ring attention (forward and backward) on this rank's shard, against one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cpg = ContextGroup(dist.group.WORLD, tuple(range(world)), rank)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, seq_len, 16, generator=g, requires_grad=True) for _ in range(3))
    mine = shard_positions(seq_len, rank, world, layout)   # contiguous: one block; zigzag: two chunks
    shard = [t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v)]
    WORK.clear()
    out, _ = engine_ring_attention(*shard, cpg, layout)
    out.backward(torch.ones_like(out))
    work = sum(WORK.values())                               # score elements this rank computed
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # The loss of all ranks together is the sum of every output: its gradient for this rank's keys
    # gathers the queries of every later rank, which the ring's dK/dV pass carries home.
    full.sum().backward()
    dk_ref = k.grad[:, :, mine]
    return ((out - full[:, :, mine]).abs().max().item(), (shard[1].grad - dk_ref).abs().max().item(), work)


for layout in ("contiguous", "zigzag"):
    results = on_ranks(WORLD, engine_ring_demo, layout)
    works = [r[2] for r in results]
    print(f"{layout:10s}: max |out error| {max(r[0] for r in results):.1e}, max |dK error| "
          f"{max(r[1] for r in results):.1e}; attention work per rank {works} "
          f"(max / mean {max(works) / (sum(works) / len(works)):.2f})")
''')

ULYSSES = code(r'''
def ulysses_shapes(heads=4, seq_len=16):
    """Sequence shards -> all-to-all -> head shards: what each rank holds before and after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((1, heads, seq_len // world, 8), float(rank))   # [b, H, s/cp, d], tagged by rank
    parts = [p.contiguous() for p in x.chunk(world, dim=1)]       # one group of heads for each rank
    received = [torch.empty_like(p) for p in parts]
    dist.all_to_all(received, parts)
    y = torch.cat(received, dim=2)                                 # [b, H/cp, s, d]
    return tuple(x.shape), tuple(y.shape), [int(t) for t in y[0, 0, :, 0].tolist()]


for rank, (before, after, origin) in enumerate(on_ranks(WORLD, ulysses_shapes)):
    print(f"rank {rank}: {before} -> {after}; its sequence positions came from ranks {origin[::4]}")
''')

ENGINE = code(r'''
# The engine trains with each variant on 4 ranks; its losses against one process holding whole sequences.
from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import get_preset
from ultrascale.testing.compare import train_on

model = get_preset("tiny")  # 8 query heads, 4 key/value heads: Ulysses needs cp to divide both


def run(cp=1, variant="ring"):
    parallel = ParallelConfig(cp=cp, cp_attention=variant) if cp > 1 else ParallelConfig()
    cfg = RunConfig(model=model, parallel=parallel,
                    train=TrainConfig(steps=3, seq_len=32, micro_batch=2, seed=5, progress=False))
    return train_on(cfg, cp).losses


single = run()
print("one process:", " ".join(f"{x:.6f}" for x in single))
for variant in ("allgather", "ring", "zigzag", "ulysses"):
    start = time.perf_counter()
    losses = run(WORLD, variant)
    worst = max(abs(a - b) / b for a, b in zip(losses, single))
    print(f"cp=4 {variant:9s}: losses {' '.join(f'{x:.6f}' for x in losses)}, worst relative difference "
          f"{worst:.1e} ({time.perf_counter() - start:.1f} s)")
''')


EPISODE = Episode(
    number=10,
    title="Context Parallelism",
    slug="context_parallelism",
    subtitle="Splitting the sequence across GPUs: all-gather, ring attention, zig-zag and Ulysses",
    overview=[
        "Why long sequences need their own dimension: activations grow with the sequence, and tensor "
        "parallelism stops at a node",
        "Only attention mixes tokens: everything else runs on a rank's shard of the sequence unchanged",
        "The all-gather baseline, then ring attention: K/V blocks passed around while partial results "
        "merge exactly through their log-sum-exp",
        "Zig-zag sharding balances causal attention's work across ranks; measured per rank",
        "Ulysses: an all-to-all from sequence shards to head shards and back",
    ],
    references=[
        Reference(2, "activation memory and recomputation"),
        Reference(3, "the collectives: all-gather, all-to-all, send/recv rings"),
        Reference(9, "sequence parallelism, which shards the sequence only outside attention"),
    ],
    sections=[
        Section("Why split the sequence?", [
            md(r'''
Activation memory grows linearly with the sequence length $s$ (quadratically without fused attention,
Part 2). Tensor parallelism divides it by $t$, but $t$ stops at the 8 GPUs of a node, and even full
recomputation keeps every block's input, $s \cdot h$ values per block. At 128k tokens the activations
no longer fit next to the model. **Context parallelism (CP)** cuts every sequence into $cp$ shards, one per rank, on a new
axis of the grid (dp × pp × **cp** × tp). The planner shows what it buys for Llama 3 8B:
'''),
            SETUP,
            MEMORY,
        ]),
        Section("Only attention mixes tokens", [
            md(r'''
Embeddings, norms, the MLP, the output head and the loss act on each token alone: on a shard of the
sequence they compute exactly the rows they would compute on the whole. Attention is the one exception:
a query needs the keys and values of **every earlier token**, wherever they live. So CP changes two
things only: each rank gets its shard of the tokens (with their *global* positions for RoPE), and
attention is replaced by a version that fetches the other shards' K and V.
'''),
            ONLY_ATTENTION,
        ]),
        Section("The baseline: all-gather K and V", [
            md(r'''
The simplest correct version: every rank all-gathers K and V (the queries stay local), then attends its
queries to the whole sequence with the causal mask shifted by its offset. It is exact, and it is what
Llama 3's training used for its long-context stage (K/V are small under GQA). Its cost: each rank briefly
holds the whole sequence's K/V, which grows with $s$, and the gather is not overlapped with compute.
Below, 4 real processes, each with a quarter of the sequence, against one process with all of it:
'''),
            ALLGATHER,
        ]),
        Section("Ring attention: pass the blocks, merge the results", [
            md(r'''
Ring attention keeps one K/V block in hand at a time. At each of $cp$ steps a rank attends its queries to
the block it holds, then passes the block to the next rank (while computing, in the engine). After
$cp-1$ passes every rank has seen every block once.

The partial results must be combined **without** the whole row of scores. Attention over a block $B$
gives $O_B = \mathrm{softmax}(S_B) V_B$, normalised over $B$'s keys only, and its log-sum-exp
$\mathrm{lse}_B = \log \sum_{j \in B} e^{S_j}$. Two blocks merge exactly:

$$\mathrm{lse} = \log\left(e^{\mathrm{lse}_1} + e^{\mathrm{lse}_2}\right), \qquad
O = e^{\mathrm{lse}_1 - \mathrm{lse}}\, O_1 + e^{\mathrm{lse}_2 - \mathrm{lse}}\, O_2$$

(the weights are each block's share of the softmax's denominator; this is FlashAttention's online
softmax, across GPUs). With causal masking, a rank skips blocks of later ranks and masks its own block
on the diagonal. The backward is a second ring that carries dK and dV home. The engine's ring attention,
forward and backward, on 4 ranks:
'''),
            RING,
            md(r'''
With **contiguous** shards, rank $r$ computes $r + 1$ of the $cp$ blocks (the others are in its future):
the last rank works $2cp/(cp+1)$ times the average (1.6x at $cp = 4$, as the tally above shows; towards
2x as $cp$ grows), and the ring waits for it. **Zig-zag** gives each
rank two chunks of $2\,cp$, number $r$ and number $2cp - 1 - r$ (one early, one late), so every rank does
the same work; the counts above are the engine's own tally of score elements computed.
The engine's all-gather variant takes the same zig-zag shards (as Llama 3's all-gather attention does):
it gathers the whole sequence's K and V anyway, so the balance costs it nothing. Its ring keeps contiguous
shards, the naive form that zig-zag improves on.
'''),
        ]),
        Section("Ulysses: all-to-all over heads", [
            md(r'''
DeepSpeed-Ulysses takes another route: one all-to-all turns sequence shards of all heads
($[b, H, s/cp, d]$) into **all of the sequence for $H/cp$ heads** ($[b, H/cp, s, d]$); each rank runs
ordinary attention on its heads, and a second all-to-all turns the output back. Its communication per
rank does not grow with $cp$ (ring attention's does not either, but it is point-to-point), yet $cp$ must
divide the number of heads, and of key/value heads under GQA.
'''),
            ULYSSES,
            md(r'''
All four variants are in the engine (`ultrascale train --cp 4 --cp-attention allgather|ring|zigzag|ulysses`).
Trained on 4 ranks against one process that sees whole sequences, they give the same losses:
'''),
            ENGINE,
        ]),
    ],
    exercises=[
        Exercise(
            title="Merge two partial attentions",
            instructions=r'''
Write `merge_partials(out1, lse1, out2, lse2)`: the attention of the same queries over the keys of two
blocks, from each block's result. `out_i` is `[batch, heads, queries, head_dim]`, softmax-normalised over
block $i$'s keys only; `lse_i` is `[batch, heads, queries]`, the log-sum-exp of block $i$'s scores.
Return `(out, lse)` for both blocks together. It must stay finite when the scores are large (an `lse`
of 200 is fine; $e^{200}$ is not a float32).
''',
            starter=r'''
def merge_partials(out1, lse1, out2, lse2):
    """Combine two blocks' attention results exactly: (out, lse) over both blocks' keys."""
    # TODO: the merged lse, then each output weighted by its block's share of the softmax
    raise NotImplementedError
''',
            solution=r'''
def merge_partials(out1, lse1, out2, lse2):
    """Combine two blocks' attention results exactly: (out, lse) over both blocks' keys."""
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2
    return out, lse
''',
            check=r'''
from ultrascale.series.checks import part10
part10.exercise_1(merge_partials)
''',
            hints=[
                "Block $i$'s output was divided by $\\sum_{j \\in i} e^{S_j} = e^{\\mathrm{lse}_i}$. "
                "What should it have been divided by?",
                "The weight of block 1 is $e^{\\mathrm{lse}_1} / (e^{\\mathrm{lse}_1} + e^{\\mathrm{lse}_2})"
                " = e^{\\mathrm{lse}_1 - \\mathrm{lse}}$. `torch.logaddexp` gives $\\mathrm{lse}$ without "
                "overflowing.",
                "`lse.unsqueeze(-1)` broadcasts a weight per query row over the head dimension.",
            ],
        ),
        Exercise(
            title="Ring attention on 4 ranks",
            instructions=r'''
Write `ring_attention(q, k, v)`, run on 4 real ranks: each rank holds a **contiguous** quarter of one
sequence (`[1, heads, n, head_dim]` each; rank $r$ holds positions $rn \dots (r+1)n - 1$). Return the
causal attention output of the rank's own queries over the whole sequence, without gathering it: keep one
K/V block in hand, attend to it, merge, pass it on. Use `attend_block(q, k, v, causal)` (returns
`(out, lse)` for one block), `pass_along(t)` (sends `t` to the next rank, returns the previous rank's),
and your `merge_partials` (or the engine's, `merge(out, lse, block_out, block_lse)`, in place).
''',
            starter=r'''
def attend_block(q, k, v, causal):
    """(out, lse) of q against one block of keys; causal=True masks the diagonal block."""
    return block_forward(q, k, v, causal, q.shape[-1] ** -0.5)


def pass_along(t):
    """Send t to the next rank of the ring, return what the previous rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(t)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t.contiguous(), (rank + 1) % world),
                                    dist.P2POp(dist.irecv, received, (rank - 1) % world)])
    for w in works:
        w.wait()
    return received


def ring_attention(q, k, v):
    """Causal attention of this rank's queries over the whole sequence, its K/V blocks passed around."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # TODO: for each of the `world` steps, the block in hand came from rank (rank - step) % world;
    # attend to it if it is not in the future (causal on the diagonal), merge, then pass it along.
    raise NotImplementedError
''',
            solution=r'''
def attend_block(q, k, v, causal):
    """(out, lse) of q against one block of keys; causal=True masks the diagonal block."""
    return block_forward(q, k, v, causal, q.shape[-1] ** -0.5)


def pass_along(t):
    """Send t to the next rank of the ring, return what the previous rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(t)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t.contiguous(), (rank + 1) % world),
                                    dist.P2POp(dist.irecv, received, (rank - 1) % world)])
    for w in works:
        w.wait()
    return received


def ring_attention(q, k, v):
    """Causal attention of this rank's queries over the whole sequence, its K/V blocks passed around."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = None, None
    kv = torch.stack((k, v))
    for step in range(world):
        source = (rank - step) % world
        if source <= rank:  # blocks of later ranks hold only future keys: skipped
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
            if out is None:
                out, lse = block_out, block_lse
            else:
                out, lse = merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
    return out
''',
            check=r'''
from ultrascale.series.checks import part10
part10.exercise_2(ring_attention)
''',
            hints=[
                "At step 0 the block in hand is your own (source = rank): attend with causal=True. At step "
                "s it came from rank (rank - s) % world.",
                "A block from a source rank greater than yours holds only keys after all of your queries: skip "
                "it, but still pass it along, or the ring stops for everyone.",
                "Keep a running (out, lse): start from the first block's result, then "
                "`out, lse = merge_partials(out, lse, block_out, block_lse)` for each later one.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            question="Which layers of a transformer block need tokens held by other context-parallel ranks?",
            options=["Only attention", "Attention and the MLP", "The norms and attention", "Every layer"],
            answer=0,
            why="Every other layer acts on each token alone; attention's queries need all earlier keys and values.",
        ),
        QuizQuestion(
            question="Two blocks of keys give (O1, lse1) and (O2, lse2) for the same queries. What is the "
                     "attention over both?",
            options=["(O1 + O2) / 2",
                     "exp(lse1 - lse) O1 + exp(lse2 - lse) O2, with lse = log(exp(lse1) + exp(lse2))",
                     "The output of the block with the larger lse",
                     "O1 + O2"],
            answer=1,
            why="Each block's softmax was normalised over its own keys; re-weighting by its share of the "
                "total denominator makes it exact.",
        ),
        QuizQuestion(
            question="With contiguous shards and a causal mask on cp = 4 ranks, how many key blocks does the "
                     "last rank attend to, and the first?",
            options=["4 and 1", "4 and 4", "2 and 2", "1 and 4"],
            answer=0,
            why="Rank r attends to blocks 0..r; zig-zag sharding evens this out.",
        ),
        QuizQuestion(
            question="What limits Ulysses-style context parallelism that ring attention does not have?",
            options=["cp must divide the number of attention heads (and of K/V heads under GQA)",
                     "It cannot use a causal mask",
                     "It needs the whole sequence's K/V on every rank",
                     "It only works with cp = 2"],
            answer=0,
            why="Its all-to-all hands each rank whole sequences of H/cp heads.",
        ),
    ],
)
