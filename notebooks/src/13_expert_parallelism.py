"""Part 13 of the series: Mixture of Experts and expert parallelism.

The source of notebooks/13_expert_parallelism.ipynb (build it with
`python notebooks/src/build.py 13`). The router, capacity and balancing figures
come from the engine's MoE layer (ultrascale.model.moe); the dispatch runs on 4
real gloo processes; the engine trains with --ep 4 against one process.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import dataclasses
import math

import torch
import torch.distributed as dist

from ultrascale.model import get_preset
from ultrascale.model.config import count_active_params, count_params
from ultrascale.model.moe import MoE, moe_layers, step_loads, update_router_bias
from ultrascale.series.ranks import on_ranks

WORLD = 4
torch.set_num_threads(1)  # steadier timings on a shared CPU
''')

SIZES = code(r'''
# Total parameters against the ones a token's forward uses, counted from each model's shape as trained
# (the planner's: DeepSeek-V3's MLA attention and its 3 dense first blocks, Qwen3's 128-wide heads and
# q/k norms), beside the figures their authors published.
from ultrascale.plan.shape import get_shape

PUBLISHED = {"mixtral-8x7b": (46.7, 12.9), "qwen3-30b-a3b": (30.5, 3.3), "deepseek-v3": (671, 37)}
for name, (total_published, active_published) in PUBLISHED.items():
    shape = get_shape(name)
    total, active = shape.count(), shape.active_params()
    print(f"{name:14s}: {shape.experts:3d} experts, top-{shape.top_k}: {total / 1e9:6.1f} B parameters, "
          f"{active / 1e9:5.2f} B active per token ({active / total:5.1%}); published {total_published:g} B "
          f"and {active_published:g} B")
deepseek = get_shape("deepseek-v3")
without_embedding = deepseek.active_params() - deepseek.vocab * deepseek.hidden
print(f"deepseek-v3 active without the input embedding: {without_embedding / 1e9:.2f} B")
# The engine's presets of the same names build an approximation of these shapes (see below).
for name in ("qwen3-30b-a3b", "deepseek-v3"):
    cfg = get_preset(name)
    print(f"the engine's {name} preset: {count_params(cfg) / 1e9:6.1f} B parameters, "
          f"{count_active_params(cfg) / 1e9:5.2f} B active")
''')

ROUTER = code(r'''
cfg = dataclasses.replace(get_preset("tiny-moe"), aux_loss_coef=0.0)   # 8 experts, top-2, hidden 64
torch.manual_seed(0)
layer = MoE(cfg)
torch.nn.init.normal_(layer.router.weight, std=0.3)
tokens = torch.randn(6, cfg.hidden)
idx, weights, keep, scores, logits = layer.route(tokens)
for t in range(6):
    print(f"token {t}: experts {idx[t].tolist()}, weights {[round(w, 3) for w in weights[t].tolist()]} "
          f"(scores {[round(s, 3) for s in scores[t, idx[t]].tolist()]})")
''')

CAPACITY = code(r'''
# A skewed batch: tokens crowd one region of the hidden space, so a few experts are popular.
g = torch.Generator().manual_seed(1)
crowd = torch.randn(cfg.hidden, generator=g) * 1.5 + torch.randn(512, cfg.hidden, generator=g)
for factor in (0.0, 1.0, 1.25, 2.0):
    layer = MoE(dataclasses.replace(cfg, capacity_factor=factor))
    torch.manual_seed(0)
    torch.nn.init.normal_(layer.router.weight, std=0.3)
    idx, _, keep, _, _ = layer.route(crowd)              # the layer's own routing and capacity mask
    kept = torch.bincount(idx[keep], minlength=cfg.experts)
    cap = "dropless" if not factor else f"capacity {math.ceil(factor * 512 * cfg.top_k / cfg.experts)} each"
    print(f"capacity factor {factor:4.2f} ({cap:16s}): assignments kept per expert {kept.tolist()}, "
          f"dropped {1 - keep.float().mean().item():.1%}")
''')

ENGINE = code(r'''
from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.testing.compare import single_process_config, train_on


def config(dispatch):
    """tiny-moe on dp 4 = ep 4: each rank routes its own 8 sequences; experts 2 per rank."""
    return RunConfig(model=get_preset("tiny-moe"), parallel=ParallelConfig(dp=WORLD, ep=WORLD, dispatch=dispatch),
                     train=TrainConfig(steps=3, seq_len=32, micro_batch=8, seed=3, progress=False))


# The control: one process fed the same micro-batches (the auxiliary loss is a statistic of a
# micro-batch's tokens, so it must see the same groups of tokens).
single = train_on(single_process_config(validate(config("alltoall"), WORLD), same_micro_batches=True), 1).losses
print("one process     :", " ".join(f"{x:.6f}" for x in single))
for dispatch in ("alltoall", "allgather"):
    losses = train_on(config(dispatch), WORLD).losses
    worst = max(abs(a - b) / b for a, b in zip(losses, single))
    print(f"ep=4 {dispatch:10s}:", " ".join(f"{x:.6f}" for x in losses), f"(worst relative difference {worst:.1e})")
''')

BALANCE = code(r'''
def balance_run(score="softmax", aux=0.0, bias_rate=0.0, steps=60):
    """The engine's MoE layer learning a fixed function of skewed tokens; the load spread at the end."""
    layer_cfg = dataclasses.replace(cfg, router_score=score, aux_loss_coef=aux, router_bias_rate=bias_rate)
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(layer_cfg))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    g = torch.Generator().manual_seed(1)
    centre = torch.randn(cfg.hidden, generator=g) * 2
    target = torch.randn(cfg.hidden, cfg.hidden, generator=g) / cfg.hidden**0.5
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    spread = []
    for _ in range(steps):
        x = centre + torch.randn(128, cfg.hidden, generator=g)
        for m in moe_layers(model):
            m.reset_stats()
        loss = torch.nn.functional.mse_loss(model(x[None])[0], torch.tanh(x @ target))
        opt.zero_grad()
        loss.backward()                     # the aux loss's gradient is injected here by the layer
        opt.step()
        counts, _ = step_loads(model)
        update_router_bias(model, counts)  # moves the bias only if bias_rate > 0
        spread.append((counts[0].std(unbiased=False) / counts[0].mean()).item())
    return sum(spread[-10:]) / 10, [int(c) for c in counts[0].tolist()], loss.item()


for label, kw in [("softmax, no balancing      ", {}), ("softmax, aux loss 0.1      ", {"aux": 0.1}),
                  ("sigmoid, no balancing      ", {"score": "sigmoid"}),
                  ("sigmoid, bias, rate 0.03   ", {"score": "sigmoid", "bias_rate": 0.03})]:
    cv, last, loss = balance_run(**kw)
    print(f"{label}: CV of tokens per expert {cv:4.2f}, last step {last}, loss {loss:.4f}")
''')


EPISODE = Episode(
    number=13,
    title="Expert Parallelism",
    slug="expert_parallelism",
    subtitle="Mixture of Experts: routers, capacity, the all-to-all dispatch, and keeping the experts busy",
    overview=[
        "A Mixture of Experts replaces a block's MLP by many MLPs of which each token visits a few: "
        "parameters grow, FLOPs per token do not",
        "The router: top-k of a softmax (or sigmoid) over experts, weights renormalised",
        "Capacity: each expert takes at most ceil(F x tokens x k / experts) assignments; the rest are dropped",
        "Expert parallelism: experts split over ranks, tokens sent to them and back with two all-to-alls",
        "Load balance: the auxiliary loss, and DeepSeek-V3's bias that needs no loss, measured",
    ],
    references=[
        Reference(3, "all-to-all among the collectives"),
        Reference(4, "data parallelism, which expert parallelism shares its ranks with"),
    ],
    sections=[
        Section("Many experts, few active", [
            md(r'''
A **Mixture of Experts (MoE)** block keeps attention as it is and replaces the MLP by $E$ expert MLPs;
a small **router** sends every token to $k$ of them and sums their outputs, weighted. Parameters grow
with $E$, the compute per token only with $k$: the model knows more for the same FLOPs. Three MoE models,
counted from their shapes as they were trained:
'''),
            SETUP,
            SIZES,
            md(r'''
The counts match what was published, and where they seem not to, the published figure counts something
else. DeepSeek-V3's 671 B leaves out its multi-token-prediction module, used in training only (DeepSeek's
README gives 685 B with it: 14 B more), as this count does; its 37 B active is the count without the
input embedding (of which a token reads one row and multiplies nothing), 36.6 B, rounded. Qwen3-30B-A3B's
3.3 B active is 3.35 B to one decimal, cut rather than rounded. The engine's presets of the same names
are what the engine builds of them (grouped-query attention in place of DeepSeek's MLA, heads of
hidden / heads wide, every block MoE): close in total, not equal, and this notebook trains only the small
`tiny-moe`.
'''),
        ]),
        Section("The router", [
            md(r'''
The router is one linear layer, hidden → $E$, in fp32. Its softmax scores pick each token's top-$k$
experts; their scores, renormalised to sum to 1 over the $k$ chosen, weight the experts' outputs
(DeepSeek-V3 uses a sigmoid per expert instead of a softmax over them). The engine's MoE layer routing
six tokens:
'''),
            ROUTER,
        ]),
        Section("Capacity: how many tokens an expert takes", [
            md(r'''
Experts run as batched matmuls of fixed shape on a GPU, and a popular expert would make its rank the
straggler. **Capacity** (Switch Transformer, GShard) caps each expert at
$\lceil F \cdot T \cdot k / E \rceil$ assignments of the $T$ tokens in hand; over it, the lowest-scoring
assignments are **dropped** (the token keeps its residual, and its other expert). $F = 0$ means dropless
(what Mixtral, DeepSeek and Qwen3 train with, with kernels that take ragged groups). Measured on the
engine's layer with a skewed batch:
'''),
            CAPACITY,
        ]),
        Section("Expert parallelism: the all-to-all dispatch", [
            md(r'''
With **expert parallelism (EP)**, $E/\mathrm{ep}$ experts live on each rank of an `ep` group, and each
rank routes its own tokens. The dispatch, Megatron's "all-to-all token dispatcher":

1. sort the token copies by expert: expert-major order is destination-rank-major (expert $e$ lives on rank
   $e / (E/\mathrm{ep})$);
2. all-to-all the counts (how many rows each rank will receive, per expert), then the rows themselves;
3. each rank runs its experts on what it received;
4. the reverse all-to-all sends the outputs home, where they are put back in token order and weighted.

The other option is to all-gather every rank's tokens and let each rank pick those for its experts, then
reduce-scatter the outputs: simpler, but it moves every token to every rank. The engine has both
(`ultrascale train --ep 4 --dispatch alltoall|allgather`); trained on 4 ranks against one process:
'''),
            ENGINE,
        ]),
        Section("Load balance: the auxiliary loss and the bias", [
            md(r'''
Left alone, a router collapses: the experts that happen to be chosen early train faster, get chosen
more, and the rest starve. Two remedies:

- the **auxiliary loss** (Switch Transformer): $E \sum_e f_e P_e$, with $f_e$ the fraction of assignments
  to expert $e$ and $P_e$ its mean router score, added to the loss with a small coefficient; it is smallest
  when both are uniform, but it also pulls the router away from what the language-modelling loss wants;
- **aux-loss-free balancing** (DeepSeek-V3): a per-expert bias added to the scores for the *choice only*
  (the weights stay the scores), nudged after each step by $\pm$ rate towards the mean load.

The engine's layer, trained on a skewed stream of tokens for 60 steps each way; the coefficient of
variation (std / mean) of the tokens per expert over the last 10 steps:
'''),
            BALANCE,
        ]),
    ],
    exercises=[
        Exercise(
            title="A top-k router with capacity",
            instructions=r'''
Write `route(logits, k, capacity_factor)` for router logits `[T, E]`: each token's `k` experts with the
highest softmax scores (`expert_idx`, `[T, k]`), their weights (the chosen scores renormalised to sum to
1 per token, `[T, k]`), and `keep` (`[T, k]`, bool): with `capacity_factor` 0 everything is kept;
otherwise each expert keeps its $\lceil F \cdot T \cdot k / E \rceil$ **highest-scoring** assignments and
drops the others (ties: the earlier token first).
''',
            starter=r'''
def route(logits, k, capacity_factor):
    """Top-k routing with renormalised weights and a per-expert capacity: (expert_idx, weights, keep)."""
    # TODO: softmax over experts, top-k per token, renormalise; then each expert keeps its
    # ceil(F * T * k / E) highest-scoring assignments (all of them when capacity_factor is 0)
    raise NotImplementedError
''',
            solution=r'''
def route(logits, k, capacity_factor):
    """Top-k routing with renormalised weights and a per-expert capacity: (expert_idx, weights, keep)."""
    tokens, experts = logits.shape
    scores = logits.softmax(dim=-1)
    chosen, expert_idx = scores.topk(k, dim=-1)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    keep = torch.ones_like(expert_idx, dtype=torch.bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        for e in range(experts):
            rows, slots = (expert_idx == e).nonzero(as_tuple=True)
            order = torch.sort(-chosen[rows, slots], stable=True).indices   # highest score first, ties by token
            keep[rows[order[capacity:]], slots[order[capacity:]]] = False
    return expert_idx, weights, keep
''',
            check=r'''
from ultrascale.series.checks import part13
part13.exercise_1(route)
''',
            hints=[
                "`logits.softmax(-1).topk(k, dim=-1)` gives the chosen scores and their experts.",
                "Capacity counts assignments, not tokens: ceil(F x T x k / E), rounded up with math.ceil.",
                "For one expert, `(expert_idx == e).nonzero(as_tuple=True)` gives (token, slot) pairs; sort them "
                "by score, descending and stable, and drop all after the first `capacity`.",
            ],
        ),
        Exercise(
            title="The all-to-all dispatch on 4 ranks",
            instructions=r'''
Write `dispatch(tokens, expert_idx, n_experts, expert_forward)`, run on 4 real ranks. Each rank has its
own `tokens` (`[T, h]`) and one expert per token (`expert_idx`, `[T]`, top-1 for simplicity); rank $r$
holds experts $r \cdot E/4 \dots (r+1) \cdot E/4 - 1$. Send each token to its expert's rank, apply
`expert_forward(e, rows)` there (`e` is the **global** expert index), send the outputs back, and return
them in the tokens' order (`[T, h]`). `exchange(x, send_counts)` (given) does one all-to-all of rows:
`send_counts[r]` consecutive rows of `x` go to rank $r$; it returns the rows received and how many came
from each rank.
''',
            starter=r'''
def exchange(x, send_counts):
    """All-to-all of rows: send_counts[r] consecutive rows of x to rank r -> (rows received, counts received)."""
    send = torch.tensor(send_counts)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)                       # first, how many rows each rank will send us
    out = x.new_empty((int(recv.sum()), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv.tolist(), list(send_counts))
    return out, recv.tolist()


def dispatch(tokens, expert_idx, n_experts, expert_forward):
    """Each token to its expert's rank and back: the experts' outputs, in the tokens' order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world  # experts per rank
    # TODO: sort by expert, send, apply the local experts (global index!), send back, unsort
    raise NotImplementedError
''',
            solution=r'''
def exchange(x, send_counts):
    """All-to-all of rows: send_counts[r] consecutive rows of x to rank r -> (rows received, counts received)."""
    send = torch.tensor(send_counts)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)                       # first, how many rows each rank will send us
    out = x.new_empty((int(recv.sum()), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv.tolist(), list(send_counts))
    return out, recv.tolist()


def dispatch(tokens, expert_idx, n_experts, expert_forward):
    """Each token to its expert's rank and back: the experts' outputs, in the tokens' order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world  # experts per rank
    order = torch.argsort(expert_idx, stable=True)           # expert-major = destination-rank-major
    per_expert = torch.bincount(expert_idx, minlength=n_experts)
    received, from_rank = exchange(tokens[order], per_expert.view(world, local).sum(1).tolist())
    # How many of the received rows are for each of our experts, per source rank: [world, local].
    split, _ = exchange(per_expert.view(world, local), [1] * world)
    outputs = []
    for rows, counts in zip(received.split(from_rank), split):
        for j, block in enumerate(rows.split(counts.tolist())):
            outputs.append(expert_forward(rank * local + j, block))
    back, _ = exchange(torch.cat(outputs), from_rank)
    result = torch.empty_like(back)
    result[order] = back                                     # undo the sort
    return result
''',
            check=r'''
from ultrascale.series.checks import part13
part13.exercise_2(dispatch)
''',
            hints=[
                "`order = torch.argsort(expert_idx, stable=True)`: `tokens[order]` is grouped by expert, and so "
                "by destination rank. The rows for rank r are `bincount(...).view(world, local)[r].sum()`.",
                "The receiving rank also needs how many rows are for each of its experts: exchange the "
                "`[world, local]` count table with one row to each rank.",
                "Outputs return in the order they were sent; `result[order] = back` puts each at its token.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            question="A model has 8 experts per block and routes each token to 2. Compared with one dense MLP "
                     "of the same width, its MLP compute per token is about:",
            options=["the same", "2x", "8x", "a quarter"],
            answer=1,
            why="Each token runs through k = 2 expert MLPs; the other 6 hold parameters it does not use.",
        ),
        QuizQuestion(
            question="512 tokens, top-2, 8 experts, capacity factor 1.25: how many assignments can one expert "
                     "take?",
            options=["80", "160", "128", "64"],
            answer=1,
            why="ceil(1.25 x 512 x 2 / 8) = 160: capacity counts assignments, tokens x k.",
        ),
        QuizQuestion(
            question="Why does the all-to-all dispatch sort the token copies by expert before sending?",
            options=["So each destination rank's rows are contiguous, ready for all_to_all_single's splits",
                     "So the experts see the tokens in sequence order",
                     "To balance the load",
                     "Because the router returns sorted indices"],
            answer=0,
            why="Experts are laid out rank by rank, so expert-major order is destination-major order.",
        ),
        QuizQuestion(
            question="What does DeepSeek-V3's aux-loss-free balancing change?",
            options=["A per-expert bias added to the scores for choosing experts only, nudged after each step",
                     "The weights of the chosen experts",
                     "The loss, with a balancing term",
                     "The number of experts per token"],
            answer=0,
            why="The bias steers the choice; the weights stay the router's scores, and no gradient is involved.",
        ),
    ],
)
