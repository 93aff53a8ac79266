"""Part 4 of the series: data parallelism and its three optimisations.

The source of notebooks/4_data_parallelism.ipynb (build it with
`python notebooks/src/build.py`). Everything runs in one CPU process: a real
gloo process group of size 1 for the torch.distributed and DDP calls, and
ranks simulated as a list of model replicas where several must be seen at once.
"""

from ultrascale.series.episode import Cell, Episode, Exercise, QuizQuestion, Reference, Section


def md(text):
    return Cell("markdown", text.strip("\n"))


def code(text, needs_gpu=False):
    return Cell("code", text.strip("\n"), needs_gpu)


SETUP = code(r'''
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)

# On a cluster, torchrun starts one process per GPU and each one calls
# dist.init_process_group("nccl"). Here: one CPU process, the gloo backend and an
# in-memory store. It is a real process group (of size 1), so every torch.distributed
# and DDP call below runs exactly as written.
if not dist.is_initialized():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
print("backend:", dist.get_backend(), "| world size:", dist.get_world_size())
''')

REPLICAS = code(r'''
def make_model():
    """The same small MLP every time: DDP also starts every replica from identical weights
    (it broadcasts rank 0's parameters when it wraps the model)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def all_reduce_sum(tensors):
    """What dist.all_reduce does, for ranks simulated in one process: `tensors` holds the same
    tensor from every rank; afterwards each one holds the sum over all ranks (ReduceOp.SUM,
    the default)."""
    total = torch.stack(tensors).sum(dim=0)
    for t in tensors:
        t.copy_(total)


loss_fn = nn.MSELoss()                     # a mean over the samples of a batch
x, y = torch.randn(32, 16), torch.randn(32, 4)   # one global batch of 32 samples

# Reference: one model sees the whole batch.
single = make_model()
loss_fn(single(x), y).backward()

# Data parallelism on 4 simulated ranks: replica r trains on samples 8r .. 8r+7.
world = 4
replicas = [make_model() for _ in range(world)]
for r, (xb, yb) in enumerate(zip(x.chunk(world), y.chunk(world))):
    loss_fn(replicas[r](xb), yb).backward()

# All-reduce every gradient across the replicas, as-is.
for params in zip(*(m.parameters() for m in replicas)):
    all_reduce_sum([p.grad for p in params])

w_dp, w_single = next(replicas[0].parameters()), next(single.parameters())
print(f"replica 0's summed gradient / single-model gradient: {(w_dp.grad.norm() / w_single.grad.norm()).item():.3f}")
''')

ORDER = code(r'''
model = make_model()
ready = []
for name, p in model.named_parameters():
    # Called by autograd the moment p.grad is complete for this backward pass.
    p.register_post_accumulate_grad_hook(lambda p, name=name: ready.append(name))
loss_fn(model(x), y).backward()
print("gradients ready, in this order:", ready)
''')

TIMELINE = code(r'''
# A toy timeline of one backward pass through 3 layers (times in ms).
backward_ms = [4, 4, 4]    # backward of layer 3, 2, 1: the last layer comes first
allreduce_ms = [3, 3, 3]   # all-reduce of each layer's gradients

naive = sum(backward_ms) + sum(allreduce_ms)   # communicate only once backward is over

compute_done = link_free = 0
for b, c in zip(backward_ms, allreduce_ms):
    compute_done += b                                # this layer's gradients are ready
    link_free = max(link_free, compute_done) + c     # its all-reduce starts when the link is free
overlapped = max(compute_done, link_free)

print(f"naive: {naive} ms, overlapped: {overlapped} ms, speed-up {naive / overlapped:.2f}x")
print(f"exposed communication: naive {naive - sum(backward_ms)} ms, overlapped {overlapped - sum(backward_ms)} ms")
''')

OVERLAP = code(r'''
class OverlapDataParallel:
    """Data parallelism with one asynchronous all-reduce per gradient, started as soon as that
    gradient is ready, while backward goes on with the earlier layers.

    Use it on a plain model, never on top of DDP: DDP already reduces every gradient, and a second
    all-reduce would count each contribution again."""

    def __init__(self, model, group=None):
        self.world = dist.get_world_size(group)
        self.group = group
        self.pending = []
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p):
        p.grad.div_(self.world)  # all-reduce sums; dividing first turns the sum into the average
        self.pending.append(dist.all_reduce(p.grad, group=self.group, async_op=True))

    def finish(self):
        """Wait for every all-reduce of this backward pass; call it before optimizer.step()."""
        for work in self.pending:
            work.wait()
        launched, self.pending = len(self.pending), []
        return launched


model = make_model()
dp = OverlapDataParallel(model)
loss_fn(model(x), y).backward()    # the all-reduces start inside this call
print("all-reduces launched during backward:", dp.finish())
''')

DDP_BUCKETS = code(r'''
def ddp_bucket_sizes(bucket_cap_mb):
    """Elements per bucket that DDP all-reduces in one backward pass of a 6-layer model."""
    torch.manual_seed(0)
    net = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]), bucket_cap_mb=bucket_cap_mb)
    sizes = []

    def record(state, bucket):  # a communication hook: DDP calls it once per bucket
        sizes.append(bucket.buffer().numel())
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])

    net.register_comm_hook(None, record)
    for _ in range(2):  # DDP re-forms its buckets after the first backward, in the order gradients arrived
        sizes.clear()
        net(torch.randn(4, 256)).sum().backward()
    return sizes


print("one Linear(256, 256) =", 256 * 256 + 256, "elements =", (256 * 256 + 256) * 4 / 2**20, "MB in fp32")
for cap in (25, 0.5, 0.25):
    print(f"bucket_cap_mb={cap}: buckets of {ddp_bucket_sizes(cap)} elements")
''')

NO_SYNC = code(r'''
import contextlib


def allreduce_calls(forward_inside_no_sync, accum=4):
    """All-reduce calls DDP makes after each micro-batch of one optimizer step, and whether the
    accumulated gradient equals the full-batch gradient."""
    model = make_model()
    ddp = DDP(model)                  # uses the gloo process group created at the top
    calls = []

    def counting_hook(state, bucket):
        # DDP's default (average the bucket across ranks), plus a note of each call.
        calls.append(bucket.buffer().numel())
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, counting_hook)
    after_each = []
    for i, (xb, yb) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        last = i == accum - 1
        quiet = contextlib.nullcontext() if last else ddp.no_sync()
        if forward_inside_no_sync:
            with quiet:
                loss = loss_fn(ddp(xb), yb) / accum   # divide: the accumulated gradient must be a mean
                loss.backward()
        else:
            loss = loss_fn(ddp(xb), yb) / accum
            with quiet:                              # only backward inside: too late
                loss.backward()
        after_each.append(len(calls))
    same = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), single.parameters()))
    return after_each, same


for inside, how in ((True, "forward + backward inside no_sync"), (False, "only backward inside no_sync     ")):
    counts, same = allreduce_calls(inside)
    print(f"{how}: all-reduce calls after each micro-batch {counts}, full-batch gradient: {same}")
''')

GPU = code(r'''
# Needs a GPU: the notebook runner skips this cell on a CPU-only machine.
# The same model on CUDA; on a cluster each of the N processes started by torchrun
# would call dist.init_process_group("nccl") and wrap its replica in DDP.
device = torch.device("cuda", torch.cuda.current_device())
gpu_model = make_model().to(device)
loss_fn(gpu_model(x.to(device)), y.to(device)).backward()
torch.cuda.synchronize()
print("backward ran on", torch.cuda.get_device_name(device))
''', needs_gpu=True)


EPISODE = Episode(
    number=4,
    title="Data Parallelism",
    slug="data_parallelism",
    subtitle="One replica per GPU, one averaged gradient, and three ways to stop waiting for the network",
    overview=[
        "Data parallelism: the model replicated on every GPU, a different micro-batch on each, the gradients "
        "**averaged** with an all-reduce before the optimizer step",
        "Why the average of the replicas' gradients equals one model's gradient on the whole batch",
        "The naive version waits for the whole backward pass before it communicates",
        "Optimisation 1: overlap each gradient's all-reduce with the rest of the backward pass",
        "Optimisation 2: bucket gradients by size - one all-reduce per bucket, the result written back "
        "into `.grad`",
        "Optimisation 3: with gradient accumulation, communicate once per optimizer step (`no_sync`)",
    ],
    references=[
        Reference(3, "the all-reduce collective, from the parallel programming crash course"),
        Reference(1, "the memory budget of a training step (communication buffers add to the peak)"),
    ],
    sections=[
        Section("Setup: one process, a real process group", [
            md(r'''
Everything in this notebook runs on a laptop CPU in a few seconds. `torch.distributed` works the same way
with the **gloo** backend on CPU as with **NCCL** on GPUs, so we create a real process group - with a single
process in it. Where we need to *see* several GPUs at once, we simulate them as a list of model replicas
in this one process.
'''),
            SETUP,
        ]),
        Section("Data parallelism: replicas, micro-batches, one averaged gradient", [
            md(r'''
Data parallelism (DP) puts a full copy of the model - a **replica** - on each of N GPUs. Every GPU runs
forward and backward on its **own micro-batch**, so the gradients differ from GPU to GPU. Before the
optimizer step they are combined with an **all-reduce**, so that every replica applies the same update and
the replicas stay identical.

What must the all-reduce produce? With a mean loss and N equal micro-batches, the gradient of the whole
batch is the **average** of the micro-batch gradients $g_r$ (each the gradient of the mean loss on rank
$r$'s micro-batch):

$$g_{\text{batch}} = \frac{1}{N}\sum_{r=1}^{N} g_r$$

But `dist.all_reduce` **sums** by default (`ReduceOp.SUM`). Let us see what a plain sum gives, with 4
simulated ranks and one model trained on the whole batch as the reference.

> In the playbook's figure of the DP timeline, the numbered boxes are the model's **layers** on one GPU
> (backward visits them in reverse), not GPUs.
'''),
            REPLICAS,
            md(r'''
The summed gradient is 4x too large - N times too large on N GPUs. Training would behave as if the learning
rate were multiplied by the number of GPUs. The all-reduce must be followed (or preceded) by a division by
N: every data-parallel implementation **averages**. (NCCL also offers `ReduceOp.AVG`; gloo does not, so we
divide.) Exercise 1 asks you to fix this.
'''),
        ]),
        Section("The naive version waits for the whole backward pass", [
            md(r'''
The simplest DP waits until backward is completely done, then all-reduces every gradient, then steps.
While the gradients travel, the GPUs have nothing to do. Yet backward produces gradients **last layer
first**, and those are final long before backward reaches the first layer:
'''),
            ORDER,
            md(r'''
So the all-reduce of the last layers could start while backward is still computing the earlier ones. A toy
timeline shows what that is worth: only the communication that outlasts the backward pass stays exposed.
'''),
            TIMELINE,
        ]),
        Section("Optimisation 1: overlap communication with the backward pass", [
            md(r'''
Attach a hook to every parameter that starts an **asynchronous** all-reduce of its gradient the moment the
gradient is ready. Backward keeps computing while the network moves the gradients, and before
`optimizer.step()` we wait for all of them. Two details matter:

- **average**: divide by the world size (before the all-reduce, which keeps low-precision sums in range);
- **never on top of DDP**: DDP already does exactly this internally (with buckets, below). A hook on a
  DDP-wrapped model reduces every gradient a second time - and timing "the hook on top of DDP" measures
  nothing meaningful.
'''),
            OVERLAP,
        ]),
        Section("Optimisation 2: bucket gradients by size", [
            md(r'''
One all-reduce per parameter pays the fixed cost of a collective (launch, latency) once per parameter -
hundreds of times per step for an LLM. GPUs and networks are far more efficient on a few large messages,
so DDP packs gradients into **buckets** and launches **one all-reduce per bucket**. Think of packing items
into boxes before shipping: a few big boxes travel better than many small ones.

How buckets are formed (in PyTorch DDP, in picotron's bucketed DP, and in `ultrascale.parallel.buckets`):

- **by size**, not per layer: parameters are added in **backward order** (last layer first) until the
  bucket reaches `bucket_cap_mb` (25 MB by default); a parameter bigger than the cap gets a bucket of its
  own;
- the **last bucket** is usually smaller than the cap, and it is all-reduced too;
- a bucket is one **contiguous** flat buffer, so the collective sends a single message. DDP copies each
  gradient into its bucket and, after the all-reduce, the result back into `.grad` (with
  `gradient_as_bucket_view=True`, each `.grad` *is* a view into its bucket and no copy is needed). A buffer
  built with `torch.cat` is a **copy** too: after the all-reduce its values must be copied back into every
  `.grad`, or the optimizer never sees them;
- as soon as the last gradient of a bucket is ready, the bucket's all-reduce starts - the overlap of
  optimisation 1, with fewer, larger messages.

The buffers are allocated once and kept for the whole run: they speed up communication but add to the peak
memory of training (the memory budget of Part 1).

Here is what real DDP does with a 6-layer model for a few caps - one `Linear(256, 256)` is about 0.25 MB:
'''),
            DDP_BUCKETS,
        ]),
        Section("Optimisation 3: gradient accumulation and `no_sync`", [
            md(r'''
Gradient accumulation runs several micro-batches through forward and backward before one optimizer step,
adding up their gradients in `.grad`. Combined with DP, the naive implementation all-reduces after **every**
micro-batch's backward - but the optimizer only needs the gradients once, at the end. DDP's `no_sync()`
context turns communication off: backward passes inside it only accumulate locally. The **first backward
outside** the context all-reduces everything accumulated so far, in one go. This is a different problem
from the idle time above: that was about *when* in one backward to communicate; this is about
communicating once per optimizer step instead of once per micro-batch.

Two details decide whether it works:

- DDP decides **at forward time** whether the coming backward communicates, so the **forward** pass must run
  inside `no_sync()` too; wrapping only `loss.backward()` still all-reduces every micro-batch;
- each micro-batch's loss is divided by the number of micro-batches, so the accumulated gradient is a mean.
'''),
            NO_SYNC,
            md(r'''
Done right, three micro-batches pass without communication and the fourth reduces everything at once; the
result is the gradient of the whole batch either way (with a single process there is nobody to disagree
with), but the wrong way pays for four all-reduces instead of one.

On a GPU machine the same code runs on CUDA and NCCL. The next cell is tagged `needs-gpu`: the notebook
runner skips it on a CPU-only machine.
'''),
            GPU,
        ]),
    ],
    exercises=[
        Exercise(
            title="Average, don't sum",
            instructions=r'''
Write `data_parallel_grads`: data parallelism on simulated ranks. Each replica runs forward and backward on
its own chunk of the batch (given), then every parameter's gradient is all-reduced across the replicas
with `all_reduce_sum` (defined above; it sums, like `dist.all_reduce`) and turned into the **average**.
Afterwards every replica's `.grad` must equal the gradient one model gets on the whole batch.

Run the cell, then the check below it.
''',
            starter=r'''
def data_parallel_grads(replicas, x, y, loss_fn, all_reduce_sum):
    """Data parallelism on simulated ranks: world = len(replicas).

    Rank r trains on x.chunk(world)[r], y.chunk(world)[r]. all_reduce_sum(list_of_tensors)
    leaves every tensor holding the sum over the ranks. Afterwards every replica's .grad
    equals one model's gradient on the whole batch (x, y).
    """
    world = len(replicas)
    for r, (xb, yb) in enumerate(zip(x.chunk(world), y.chunk(world))):
        loss_fn(replicas[r](xb), yb).backward()
    # TODO: all-reduce each parameter's gradient across the replicas (the same parameter of
    # every replica together), then turn the sum into the average.
    raise NotImplementedError
''',
            solution=r'''
def data_parallel_grads(replicas, x, y, loss_fn, all_reduce_sum):
    """Data parallelism on simulated ranks: world = len(replicas).

    Rank r trains on x.chunk(world)[r], y.chunk(world)[r]. all_reduce_sum(list_of_tensors)
    leaves every tensor holding the sum over the ranks. Afterwards every replica's .grad
    equals one model's gradient on the whole batch (x, y).
    """
    world = len(replicas)
    for r, (xb, yb) in enumerate(zip(x.chunk(world), y.chunk(world))):
        loss_fn(replicas[r](xb), yb).backward()
    for params in zip(*(m.parameters() for m in replicas)):
        grads = [p.grad for p in params]
        all_reduce_sum(grads)
        for g in grads:
            g.div_(world)  # the all-reduce summed: divide to average
''',
            check=r'''
for world in (2, 4):
    torch.manual_seed(world)
    xs, ys = torch.randn(8 * world, 16), torch.randn(8 * world, 4)
    reference = make_model()
    nn.MSELoss()(reference(xs), ys).backward()
    reps = [make_model() for _ in range(world)]
    data_parallel_grads(reps, xs, ys, nn.MSELoss(), all_reduce_sum)
    for r, rep in enumerate(reps):
        for (name, p), q in zip(rep.named_parameters(), reference.parameters()):
            assert p.grad is not None, f"replica {r} has no gradient for {name}: run backward on every replica"
            ratio = (p.grad.norm() / q.grad.norm()).item()
            assert abs(ratio - world) > 0.01, (
                f"with {world} replicas the gradients are {ratio:.2f}x the single-model gradient: "
                f"all-reduce sums - divide by the number of replicas")
    for r, rep in enumerate(reps[1:], 1):
        for (name, p), q in zip(rep.named_parameters(), reps[0].parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), (
                f"replica {r}'s gradient of {name} differs from replica 0's: every replica must end "
                f"with the same all-reduced gradient")
    for (name, p), q in zip(reps[0].named_parameters(), reference.parameters()):
        err = (p.grad - q.grad).abs().max().item()
        assert err < 1e-5, (
            f"with {world} replicas the gradient of {name} is off by up to {err:.2e} from the single model's "
            f"full-batch gradient: reduce each parameter over all replicas exactly once and average")
''',
        ),
        Exercise(
            title="Buckets by size",
            instructions=r'''
Write `bucketed_all_reduce`, the heart of DDP's bucketing: one all-reduce per **bucket** instead of one per
gradient.

- Walk the parameters in **backward order** (last one first) and fill a bucket until adding the next
  parameter would exceed `cap_numel` elements; then start a new bucket. A parameter larger than the cap gets
  a bucket of its own. Keep the last, partial bucket.
- For each bucket, flatten its gradients into **one contiguous 1-D buffer**, call `all_reduce(buffer)` once
  (it reduces in place, like `dist.all_reduce`), and **write the reduced values back** into each `p.grad`.

The check uses a stand-in collective that adds 1 to every element, so it can tell which gradients were
reduced, how often, and in which bucket.
''',
            starter=r'''
def bucketed_all_reduce(params, cap_numel, all_reduce):
    """One all_reduce call per bucket of gradients.

    params: parameters in registration order, each with .grad set
    cap_numel: the most elements a bucket may hold (a larger parameter gets its own bucket)
    all_reduce(buffer): reduces a flat, contiguous 1-D tensor in place
    Afterwards every p.grad holds its reduced values.
    """
    # TODO: group the parameters into buckets, in backward order, by size
    # TODO: per bucket: one flat buffer, one all_reduce, the results back into each p.grad
    raise NotImplementedError
''',
            solution=r'''
def bucketed_all_reduce(params, cap_numel, all_reduce):
    """One all_reduce call per bucket of gradients.

    params: parameters in registration order, each with .grad set
    cap_numel: the most elements a bucket may hold (a larger parameter gets its own bucket)
    all_reduce(buffer): reduces a flat, contiguous 1-D tensor in place
    Afterwards every p.grad holds its reduced values.
    """
    buckets, current, size = [], [], 0
    for p in reversed(params):  # backward order: the last layer's gradients are ready first
        if current and size + p.numel() > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(current)  # the last bucket, usually smaller than the cap
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # a copy: one contiguous message
        all_reduce(flat)
        offset = 0
        for p in bucket:  # torch.cat copied, so write the reduced values back
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
''',
            check=r'''
torch.manual_seed(2)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
params = list(net.parameters())  # 128, 16, 256, 16, 64 and 4 elements
names = [n for n, _ in net.named_parameters()]
for p in params:
    p.grad = torch.randn_like(p)
before = [p.grad.clone() for p in params]
sent = []

def plus_one(buf):
    assert buf.dim() == 1 and buf.is_contiguous(), (
        "all_reduce needs one flat, contiguous 1-D buffer per bucket: torch.cat the flattened gradients")
    sent.append(buf.clone())
    buf.add_(1)

cap = 300
bucketed_all_reduce(params, cap, plus_one)
assert sent, "all_reduce was never called"
twice = [n for n, p, b in zip(names, params, before) if torch.allclose(p.grad, b + 2)]
assert not twice, f"{twice} were reduced twice: each gradient belongs to exactly one bucket"
if all(torch.equal(p.grad, b) for p, b in zip(params, before)):
    raise AssertionError("all_reduce ran but no .grad changed: torch.cat makes a copy - copy each slice of "
                         "the reduced buffer back into its p.grad")
missed = [n for n, p, b in zip(names, params, before) if not torch.allclose(p.grad, b + 1)]
assert not missed, (f"{missed} were never reduced (or not written back): did you drop the last, partial "
                    f"bucket? It needs its all-reduce too")
expected, current, size = [], [], 0
for i in reversed(range(len(params))):
    if current and size + params[i].numel() > cap:
        expected.append(current)
        current, size = [], 0
    current.append(i)
    size += params[i].numel()
expected.append(current)
assert len(sent) == len(expected), (
    f"expected {len(expected)} all-reduce calls (one per bucket of at most {cap} elements), got {len(sent)}")
for k, (buf, idx) in enumerate(zip(sent, expected)):
    want = torch.cat([before[i].reshape(-1) for i in idx])
    assert buf.numel() == want.numel() and torch.equal(buf, want), (
        f"bucket {k} should hold {[names[i] for i in idx]} in that order: fill buckets by size "
        f"(not per layer) in backward order, last parameter first")
''',
        ),
    ],
    quiz=[
        QuizQuestion(
            "Four replicas each compute the gradient of the mean loss on their own 8 samples. What must the "
            "all-reduce leave on every replica so that they all take the step one model would take on all 32 "
            "samples?",
            ["The sum of the four gradients", "The average of the four gradients", "Rank 0's gradient",
             "The largest of the four gradients"],
            1,
            "The mean-loss gradient over 32 samples is the mean of the four 8-sample gradients; a sum is 4x too "
            "large.",
        ),
        QuizQuestion(
            "What makes naive data parallelism waste GPU time?",
            ["It all-reduces activations as well as gradients",
             "It waits for the whole backward pass before communicating, so GPUs idle during the all-reduce",
             "It runs the replicas' forward passes one after another",
             "It recomputes the forward pass during backward"],
            1,
            "The last layers' gradients are ready early; overlapping their all-reduce with the rest of backward "
            "hides most of the communication.",
        ),
        QuizQuestion(
            "How does PyTorch DDP decide which gradients share a bucket?",
            ["One bucket per layer", "By size: parameters in backward order until `bucket_cap_mb` is reached",
             "One bucket for the whole model", "At random, to balance the buckets"],
            1,
            "Buckets fill in the order gradients become ready, up to the cap (25 MB by default); the last one may "
            "be smaller and is reduced too.",
        ),
        QuizQuestion(
            "With 4 micro-batches per optimizer step, the first 3 backward passes run inside `ddp.no_sync()`. "
            "When are the gradients all-reduced?",
            ["After each of the 4 backward passes", "Never during this step: `no_sync` turned it off",
             "In the 4th backward pass, outside `no_sync`, together with everything accumulated",
             "Inside `optimizer.step()`"],
            2,
            "`no_sync` only skips communication; the first backward outside it reduces the accumulated gradients "
            "once.",
        ),
    ],
)
