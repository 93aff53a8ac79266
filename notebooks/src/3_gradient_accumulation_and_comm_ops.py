"""Part 3 of the series: gradient accumulation, and a crash course in the collectives.

The source of notebooks/3_gradient_accumulation_and_comm_ops.ipynb (build it with
`python notebooks/src/build.py 3`). Gradient accumulation runs in the notebook's
process; every collective runs on 4 real gloo processes (`on_ranks`).
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import torch
import torch.nn as nn
import torch.distributed as dist

from ultrascale.series.ranks import on_ranks

WORLD = 4  # every collective below runs on 4 real processes, joined in one gloo process group
''')

GA_SUM = code(r'''
def make_model():
    """The same small MLP every time (fixed seed), so two copies start from identical weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def max_rel_diff(a, b):
    """Largest |a - b| over all parameters' gradients, relative to the largest |b|."""
    scale = max(q.grad.abs().max() for q in b.parameters())
    return max((p.grad - q.grad).abs().max() for p, q in zip(a.parameters(), b.parameters())).item() / scale.item()


loss_fn = nn.MSELoss()                            # a mean over the samples of a batch
x, y = torch.randn(8, 6), torch.randn(8, 3)       # one batch of 8 samples

big = make_model()                                # reference: all 8 samples in one pass
loss_fn(big(x), y).backward()

GA = 4                                            # the same 8 samples as 4 micro-batches of 2
summed = make_model()
for xb, yb in zip(x.chunk(GA), y.chunk(GA)):
    loss_fn(summed(xb), yb).backward()            # .grad adds up across backward passes

averaged = make_model()
for xb, yb in zip(x.chunk(GA), y.chunk(GA)):
    (loss_fn(averaged(xb), yb) / GA).backward()   # each micro-batch weighs 1/GA

ratio = (summed[0].weight.grad.norm() / big[0].weight.grad.norm()).item()
print(f"summed micro-batch gradients / one big batch:   {ratio:.3f}")
print(f"averaged micro-batch gradients vs one big batch: max relative difference {max_rel_diff(averaged, big):.1e}")
''')

GA_MEMORY = code(r'''
def saved_activation_bytes(model, xb, yb):
    """Bytes of the tensors autograd saves for backward during one forward pass."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(xb), yb)
    loss.backward()
    return total


wide = nn.Sequential(nn.Linear(6, 1024), nn.Tanh(), nn.Linear(1024, 3))   # activations dominate here
whole = saved_activation_bytes(wide, x, y)
micro = saved_activation_bytes(wide, x[:2], y[:2])
print(f"saved for backward, batch of 8: {whole:,} bytes; micro-batch of 2: {micro:,} bytes")
per_sample = (whole - micro) // 6
print(f"= {per_sample:,} bytes per sample + {micro - 2 * per_sample:,} bytes whatever the batch "
      f"(the last layer's weight, 3 x 1024 x 4 bytes, kept for the gradient of its input)")
''')

BROADCAST = code(r'''
def start(n=4):
    """Rank r's starting tensor: [10r+1, 10r+2, ...], so every value says where it came from."""
    return torch.arange(1.0, n + 1) + 10 * dist.get_rank()


def show(results):
    """Print what each rank held before and after."""
    for rank, (before, after) in enumerate(results):
        print(f"  rank {rank}: {before!s:<32} ->  {after}")


def values(t):
    return [int(v) for v in t.tolist()]


def broadcast_demo():
    t = start()
    before = values(t)
    dist.broadcast(t, src=0)          # rank 0's tensor overwrites everyone's
    return before, values(t)


print("broadcast (src=0)")
show(on_ranks(WORLD, broadcast_demo))
''')

REDUCE = code(r'''
def reduce_demo():
    t = start()
    before = values(t)
    dist.reduce(t, dst=0)             # op=SUM by default; only rank 0's result is defined
    return before, values(t) if dist.get_rank() == 0 else "(not defined: a scratch buffer)"


def all_reduce_demo():
    t = start()
    before = values(t)
    dist.all_reduce(t)                # every rank ends with the sum
    return before, values(t)


print("reduce (dst=0, SUM)")
show(on_ranks(WORLD, reduce_demo))
print("all-reduce (SUM)")
show(on_ranks(WORLD, all_reduce_demo))
''')

GATHER = code(r'''
def gather_demo():
    t = start(2)
    before = values(t)
    pieces = [torch.empty(2) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(t, pieces, dst=0)     # rank 0 receives every rank's tensor, in rank order
    return before, [values(p) for p in pieces] if pieces else "(receives nothing)"


def all_gather_demo():
    t = start(2)
    before = values(t)
    pieces = [torch.empty(2) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, t)        # every rank receives every rank's tensor
    return before, [values(p) for p in pieces]


print("gather (dst=0)")
show(on_ranks(WORLD, gather_demo))
print("all-gather")
show(on_ranks(WORLD, all_gather_demo))
''')

SCATTER = code(r'''
def scatter_demo():
    t = start(8)
    before = values(t)
    mine = torch.empty(2)
    dist.scatter(mine, list(t.chunk(dist.get_world_size())) if dist.get_rank() == 0 else None, src=0)
    return before, values(mine)       # rank r gets the r-th quarter of rank 0's tensor


def reduce_scatter_demo():
    t = start(8)
    before = values(t)
    mine = torch.empty(2)
    dist.reduce_scatter(mine, list(t.chunk(dist.get_world_size())))
    return before, values(mine)       # rank r gets the sum over ranks of the r-th quarter


def all_to_all_demo():
    t = start(8)
    before = values(t)
    received = [torch.empty(2) for _ in range(dist.get_world_size())]
    dist.all_to_all(received, list(t.chunk(dist.get_world_size())))
    return before, [values(p) for p in received]   # quarter j of rank i lands on rank j, slot i


print("scatter (src=0)")
show(on_ranks(WORLD, scatter_demo))
print("reduce-scatter (SUM)")
show(on_ranks(WORLD, reduce_scatter_demo))
print("all-to-all")
show(on_ranks(WORLD, all_to_all_demo))
''')

COMPOSE = code(r'''
def compose_demo():
    t = torch.randn(8, generator=torch.Generator().manual_seed(dist.get_rank()))
    direct = t.clone()
    dist.all_reduce(direct)
    n = dist.get_world_size()
    mine = torch.empty(8 // n)
    dist.reduce_scatter(mine, list(t.clone().chunk(n)))   # step 1: each rank sums one quarter
    pieces = [torch.empty(8 // n) for _ in range(n)]
    dist.all_gather(pieces, mine)                        # step 2: everyone collects the summed quarters
    return (torch.cat(pieces) - direct).abs().max().item()


diffs = on_ranks(WORLD, compose_demo)
print("all-reduce vs reduce-scatter + all-gather, largest difference per rank:", [f"{d:.1e}" for d in diffs])
''')

ROOT = code(r'''
def exchange(send, recv, right, left):
    """Send `send` to the right-hand neighbour while receiving `recv` from the left-hand one.
    isend returns at once; without it, 4 ranks all blocked in send would wait for each other."""
    request = dist.isend(send, right)
    dist.recv(recv, left)
    request.wait()


def root_all_reduce(t):
    """All-reduce through rank 0: everyone sends to 0, which adds and sends the sum back.
    Returns the bytes this rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sent = 0
    if rank == 0:
        buf = torch.empty_like(t)
        for src in range(1, world):
            dist.recv(buf, src)
            t += buf
        for dst in range(1, world):
            dist.send(t, dst)
            sent += t.numel() * t.element_size()
    else:
        dist.send(t, 0)
        sent += t.numel() * t.element_size()
        dist.recv(t, 0)
    return sent


def root_demo():
    t = torch.ones(4096)               # 4096 fp32 values: 16,384 bytes per rank
    sent = root_all_reduce(t)
    return sent, t[0].item()


for rank, (sent, value) in enumerate(on_ranks(WORLD, root_demo)):
    print(f"rank {rank}: sent {sent:>6,} bytes, result {value:.0f}")
print(f"rank 0 sends (N-1) x 16,384 = {(WORLD - 1) * 16384:,} bytes and receives as many")
''')

RING_GATHER = code(r'''
def ring_all_gather(t):
    """All-gather around a ring: on entry rank r has filled in chunk r of t; on exit every rank
    has every chunk. N - 1 steps; in each, every rank passes one chunk to its right-hand
    neighbour. Returns the bytes this rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.tensor_split(world))  # views into t: writing a chunk writes t
    sent = 0
    for step in range(world - 1):
        out, into = (rank - step) % world, (rank - step - 1) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, right, left)
        chunks[into].copy_(buf)
        sent += chunks[out].numel() * chunks[out].element_size()
    return sent


def ring_gather_demo():
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.zeros(4096)
    t.tensor_split(world)[rank].fill_(rank + 1)      # my chunk only
    sent = ring_all_gather(t)
    return sent, [int(c[0]) for c in t.tensor_split(world)]


nbytes = 4096 * 4
for rank, (sent, firsts) in enumerate(on_ranks(WORLD, ring_gather_demo)):
    print(f"rank {rank}: sent {sent:,} bytes, first value of each chunk {firsts}")
print(f"(N-1)/N x {nbytes:,} = {(WORLD - 1) * nbytes // WORLD:,} bytes; "
      f"a ring all-reduce, twice that: 2(N-1)/N x {nbytes:,} = {2 * (WORLD - 1) * nbytes // WORLD:,} bytes")
''')

EPISODE = Episode(
    number=3,
    title="Gradient Accumulation and the Collectives",
    slug="gradient_accumulation_and_comm_ops",
    subtitle="Big batches from small ones, and the eight operations every parallelism is built from",
    overview=[
        "Gradient accumulation: several forward/backward passes on micro-batches, one optimizer step - the "
        "accumulated gradient equals the big batch's only if it **averages**",
        "Why accumulate: the activations kept for backward scale with the micro-batch, not with the batch "
        "(measured)",
        "The collectives crash course on 4 real processes: broadcast, reduce, all-reduce, gather, all-gather, "
        "scatter, reduce-scatter, all-to-all - what every rank holds before and after",
        "All-reduce = reduce-scatter + all-gather, and why the ring all-reduce sends only 2(N-1)/N of the "
        "tensor per rank (bytes counted)",
    ],
    references=[
        Reference(2, "activation memory, which grows with the micro-batch size"),
    ],
    sections=[
        Section("Setup", [
            md(r'''
Gradient accumulation needs one process; the collectives need several. `on_ranks(4, fn)` runs a function
defined in this notebook on **4 real processes** joined in one gloo process group - what `torchrun
--nproc-per-node 4` does on a node with 4 GPUs - and returns what each rank returned. Inside `fn`,
`dist.get_rank()`, `dist.all_reduce(...)` and the rest work exactly as on a cluster (there with the NCCL
backend and CUDA tensors). The processes start on the first call and are reused afterwards.
'''),
            SETUP,
        ]),
        Section("Gradient accumulation must average", [
            md(r'''
When the batch we want does not fit in memory, we cut it into **micro-batches**, run forward and backward on
each one after the other, and step the optimizer once at the end. `.grad` **adds** the gradients of
successive backward passes, so this costs no extra code - and gives the wrong answer if we are careless.

The loss of a micro-batch is a **mean** over its samples. The gradient of the whole batch (of $B$ samples,
in micro-batches $b_1, \dots, b_k$) is the mean over all samples, which is the weighted mean of the
micro-batch gradients:

$$g_{\text{batch}} = \sum_{i=1}^{k} \frac{|b_i|}{B}\, g_{b_i} \;=\; \frac{1}{k}\sum_{i=1}^{k} g_{b_i}\quad
\text{when all micro-batches have the same size.}$$

Calling `backward()` on each micro-batch loss as it is adds the $g_{b_i}$ with weight 1: a **sum**, $k$
times too large. Here is the measurement, with a batch of 8 samples as 4 micro-batches of 2:
'''),
            GA_SUM,
            md(r'''
The sum is exactly $k = 4$ times the big-batch gradient; dividing each micro-batch loss by 4 gives the
big-batch gradient up to float rounding (the additions happen in another order). Training on the sum would
behave as if the learning rate were 4 times larger (with SGD; Adam divides most of the scale away, but
gradient clipping and the epsilon still see it). The same fix appears in every trainer: Megatron and
torchtitan scale the loss by the number of micro-batches.

For a language model the "samples" of the mean are **tokens**: when micro-batches hold different numbers of
(non-padding) tokens, weighting by $1/k$ is no longer exact - each micro-batch must weigh its share of the
tokens. Exercise 1 handles micro-batches of unequal size.

**Why accumulate at all?** Activations are kept from forward to backward (Part 2), and they scale with the
micro-batch, not with the batch. Measured with autograd's saved-tensor hooks on a wider layer:
'''),
            GA_MEMORY,
            md(r'''
The activation memory follows the micro-batch: 8,240 bytes per sample here, so the samples' part of a
micro-batch of 2 is a quarter of the batch of 8's (16,480 of 65,920 bytes); with the 12,288 bytes of the
weight that autograd also saves, whatever the batch, the micro-batch keeps 28,768 of 78,208 bytes, 37%.
The larger the batch, the closer that share comes to a quarter. The price is time: the $k$ micro-batches run **one after another**, so a step takes $k$
forward/backward passes. Part 5 puts numbers on the trade-off between accumulation and more GPUs.
'''),
        ]),
        Section("The collectives, on 4 real ranks", [
            md(r'''
Every form of parallelism in this course - data, ZeRO, tensor, context, expert - is written with a handful
of **collective operations** (pipeline parallelism adds point-to-point `send`/`recv` between neighbouring
stages): calls that **every rank of a group** makes together, each with its own tensor. If one rank does not join, the others wait forever. The names say what they do:

- **broadcast**: one rank (the *source*) sends its tensor to all;
- **reduce**: combine (sum, by default) everyone's tensor onto one rank (the *destination*);
- **all-reduce**: combine everyone's tensor and give the result to all;
- **gather / all-gather**: collect every rank's tensor, on one rank / on all;
- **scatter**: cut one rank's tensor into N pieces, piece $r$ to rank $r$;
- **reduce-scatter**: combine, then give piece $r$ of the result to rank $r$;
- **all-to-all**: every rank sends piece $j$ of its tensor to rank $j$ - a transpose across ranks.

Every rank starts with its own tensor; rank $r$'s values are $10r + 1, 10r + 2, \dots$ so each number says
where it came from. Broadcast first:
'''),
            BROADCAST,
            md(r'''
**Reduce** sums onto one rank; the other ranks' buffers are scratch space afterwards (PyTorch documents only
the destination's result). **All-reduce** gives the sum to everyone - the collective of data parallelism
(Part 4), where every replica needs the same averaged gradient.
'''),
            REDUCE,
            md(r'''
**Gather** and **all-gather** collect the ranks' tensors side by side, in rank order - all-gather is how
ZeRO-3 rebuilds a layer's weights from the shards that each rank keeps (Part 7).
'''),
            GATHER,
            md(r'''
**Scatter** is the reverse of gather. **Reduce-scatter** sums like all-reduce but leaves each rank only its
quarter of the sum - what ZeRO uses to give each rank the gradients of the parameters it updates (Part 6).
**All-to-all** routes piece $j$ of every rank to rank $j$ - how expert parallelism sends tokens to the GPU
holding their expert.
'''),
            SCATTER,
            md(r'''
The first value of each result checks out: the sum of the first elements is $1 + 11 + 21 + 31 = 64$, and
reduce-scatter's pieces are the all-reduce's result cut in four. That is an identity worth remembering:

$$\text{all-reduce} = \text{reduce-scatter} + \text{all-gather}$$

Measured on random tensors (differences at float rounding, from another order of additions, or exactly 0):
'''),
            COMPOSE,
        ]),
        Section("The ring all-reduce and what it costs", [
            md(r'''
How would you build an all-reduce from point-to-point messages (`dist.send` / `dist.recv`)? The obvious way
goes through one rank: everyone sends its tensor to rank 0, which adds them up and sends the sum back. Count
the bytes each rank sends, for a tensor of 16,384 bytes:
'''),
            ROOT,
            md(r'''
Rank 0 sends $(N-1)$ tensors and receives $N-1$: its link carries $2(N-1)$ times the tensor while the
others idle, and the time grows linearly with the number of GPUs. The **ring** spreads the work: arrange the
ranks in a circle, cut the tensor into $N$ chunks, and in each step let **every** rank send one chunk to its
right-hand neighbour and receive one from its left-hand neighbour, all at once.

The all-gather phase of the ring is the simplest to see. Rank $r$ starts with chunk $r$ filled in; in
step $s$ it passes on chunk $(r - s) \bmod N$ - the one it received in the previous step - and receives
chunk $(r - s - 1) \bmod N$. After $N-1$ steps every rank has every chunk:
'''),
            RING_GATHER,
            md(r'''
Every rank sent $N-1$ chunks of $1/N$ of the tensor: $(N-1)/N$ of its bytes, **the same on every rank**. The
ring all-reduce is two such passes:

1. **reduce-scatter**: the same rotation, but each rank **adds** the received chunk to its own copy of that
   chunk before passing it on. After $N-1$ steps rank $r$ holds the full sum of chunk $(r + 1) \bmod N$;
2. **all-gather**: the ring above passes those summed chunks around, each rank **copying** what it receives.

Per rank that is $2(N-1)/N$ times the tensor's bytes: **almost constant in N** (at most twice the tensor),
while the root all-reduce makes one link carry $2(N-1)$ times. Bandwidth is why NCCL uses rings for large
messages. The ring has $2(N-1)$ steps, though, each paying the link's latency: for small messages and
thousands of GPUs the latency term dominates, and NCCL switches to tree algorithms.

In Exercise 2 you write the ring all-reduce; the check counts the bytes your ring sends (by wrapping
`dist.send` and `dist.isend`) and prints them next to $2(N-1)/N$ times the tensor.
'''),
        ]),
    ],
    exercises=[
        Exercise(
            title="Accumulate gradients that equal the big batch",
            instructions=r'''
Write `accumulate_gradients(model, loss_fn, x, y, num_micro_batches)`: cut the batch `(x, y)` into
`num_micro_batches` micro-batches with `tensor_split` (given in the starter: when the batch does not divide
evenly, the micro-batches differ in size, e.g. 8 samples in 3 micro-batches are 3, 3 and 2), run forward and
backward on each, and leave in every parameter's `.grad` **exactly the gradient of the whole batch in one
pass**. `loss_fn` returns the **mean** over a micro-batch's samples. Do not step an optimizer; the model's
`.grad` starts empty.

The check compares with one pass over the whole batch, for equal and unequal micro-batches, and watches
the passes: each micro-batch's forward, then its backward, before the next.
''',
            starter=r'''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    """Leave in each parameter's .grad the gradient of loss_fn over the whole batch (x, y),
    computed one micro-batch at a time."""
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        # TODO: forward and backward of this micro-batch, its loss weighted so that the
        # accumulated .grad is the whole batch's gradient
        raise NotImplementedError
''',
            solution=r'''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    """Leave in each parameter's .grad the gradient of loss_fn over the whole batch (x, y),
    computed one micro-batch at a time."""
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        loss = loss_fn(model(xb), yb) * (len(xb) / len(x))  # this micro-batch's share of the samples
        loss.backward()                                      # .grad accumulates across micro-batches
''',
            check=r'''
from ultrascale.series.checks import part3
part3.exercise_1(accumulate_gradients)
''',
            hints=[
                "`.grad` adds up the gradients of every `backward()` call, so the loop only has to choose the "
                "weight of each micro-batch's loss. The whole-batch loss is a mean over all samples.",
                "A micro-batch's loss is the mean over its own samples. In the mean over the whole batch, its "
                "samples carry the weight `len(xb) / len(x)` - which is `1 / num_micro_batches` only when the "
                "micro-batches are equal.",
                "`loss = loss_fn(model(xb), yb) * (len(xb) / len(x))`, then `loss.backward()` - and no "
                "`zero_grad()` inside the loop.",
            ],
        ),
        Exercise(
            title="A ring all-reduce from send and recv",
            instructions=r'''
Write `ring_all_reduce(t)`, run on each of 4 ranks: sum `t` over all ranks **in place**, using only
point-to-point messages (`dist.send`, `dist.recv`, `dist.isend`, `dist.irecv`, or the `exchange` helper above)
- no collectives. The starter cuts `t` into N chunks (views, so writing a chunk writes `t`); the chunks
may differ in size when N does not divide `t`'s length.

1. **Reduce-scatter**, N-1 steps: in step `s`, send chunk `(rank - s) % N` to the right-hand neighbour,
   receive chunk `(rank - s - 1) % N` from the left-hand one and **add** it to yours.
2. **All-gather**, N-1 steps: in step `s`, send chunk `(rank + 1 - s) % N` (after phase 1 you hold the full
   sum of chunk `(rank + 1) % N`), receive chunk `(rank - s) % N` and **copy** it into yours.

The check runs your function on 4 real ranks, compares every rank's result with `dist.all_reduce`, and reads
the messages each rank sent: no collective, only to its neighbour, $2(N-1)$ chunks of $1/N$ of the tensor, so
$2(N-1)/N$ times the tensor in all.
''',
            starter=r'''
def ring_all_reduce(t):
    """Sum t over all ranks, in place, with a ring of point-to-point messages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.tensor_split(world))  # views into t: writing a chunk writes t
    # TODO phase 1, reduce-scatter: world - 1 steps of send one chunk right, receive one from
    # the left and add it to yours
    # TODO phase 2, all-gather: world - 1 steps passing the summed chunks around, copying them
    raise NotImplementedError
''',
            solution=r'''
def ring_all_reduce(t):
    """Sum t over all ranks, in place, with a ring of point-to-point messages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.tensor_split(world))  # views into t: writing a chunk writes t
    for step in range(world - 1):  # reduce-scatter: pass partial sums around, adding
        out, into = (rank - step) % world, (rank - step - 1) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, right, left)
        chunks[into] += buf
    for step in range(world - 1):  # all-gather: pass the complete sums around, copying
        out, into = (rank + 1 - step) % world, (rank - step) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, right, left)
        chunks[into].copy_(buf)
''',
            check=r'''
from ultrascale.series.checks import part3
part3.exercise_2(ring_all_reduce)
''',
            hints=[
                "Both phases have the shape of `ring_all_gather` above: a loop of `world - 1` steps, each one "
                "`exchange(chunks[out], buf, right, left)` with a fresh `buf = torch.empty_like(chunks[into])`.",
                "Phase 1 uses `out, into = (rank - step) % world, (rank - step - 1) % world` and ends each step "
                "with `chunks[into] += buf`. Afterwards rank r holds the complete sum of chunk (r + 1) % world.",
                "Phase 2 uses `out, into = (rank + 1 - step) % world, (rank - step) % world` and ends each step "
                "with `chunks[into].copy_(buf)` - a copy, because the received chunk is already the full sum.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            "You accumulate 4 equal micro-batches, calling `loss.backward()` on each micro-batch's mean loss as "
            "it is. Compared with the gradient of the whole batch in one pass, `.grad` holds:",
            ["The same gradient", "4 times the gradient: divide each micro-batch loss by 4 so it averages",
             "A quarter of the gradient", "Only the last micro-batch's gradient"],
            1,
            "`.grad` sums the 4 micro-batch gradients; the whole-batch gradient is their average, so "
            "accumulation must average.",
        ),
        QuizQuestion(
            "Which collective leaves each of the N ranks with a different 1/N of the sum of everyone's tensors?",
            ["all-reduce", "all-gather", "reduce-scatter", "broadcast"],
            2,
            "Reduce-scatter sums, then scatters the result: rank r keeps piece r.",
        ),
        QuizQuestion(
            "A ring all-reduce of a 1 GB gradient on 8 GPUs: how many bytes does each GPU send?",
            ["1 GB", "1.75 GB", "7 GB", "8 GB"],
            1,
            "2(N-1)/N x 1 GB = 2 x 7/8 GB: N-1 chunks in the reduce-scatter and N-1 in the all-gather.",
        ),
        QuizQuestion(
            "Why does the ring all-reduce scale better in bandwidth than sending everything to rank 0?",
            ["It compresses the gradients",
             "Every link carries about 2x the tensor whatever N, instead of one rank's link carrying 2(N-1)x",
             "It needs fewer steps", "It skips the reduction"],
            1,
            "The ring spreads the traffic evenly; its cost is 2(N-1) latency-bound steps, not bandwidth.",
        ),
    ],
)
