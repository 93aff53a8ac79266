"""Part 4 of the series: data parallelism and its three optimisations.

The source of notebooks/4_data_parallelism.ipynb (build it with
`python notebooks/src/build.py 4`). Everything about several ranks runs on 2 real
gloo processes through `on_ranks` (started once, reused); the timings are measured
on those ranks with the engine's data-parallel modes and with PyTorch DDP; the
exercise checks live in ultrascale.series.checks.part4.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ultrascale.series.ranks import on_ranks

WORLD = 2  # two real processes, as torchrun would start one per GPU


def make_model():
    """The same small MLP on every rank: DDP also starts every replica from identical weights
    (it broadcasts rank 0's parameters when it wraps the model)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def whoami():
    return f"rank {dist.get_rank()} of {dist.get_world_size()}, backend {dist.get_backend()}"


for line in on_ranks(WORLD, whoami):  # the first call starts the 2 processes (a few seconds)
    print(line)
''')

REPLICAS = code(r'''
torch.manual_seed(0)
x, y = torch.randn(16, 16), torch.randn(16, 4)   # one global batch of 16 samples
loss_fn = nn.MSELoss()                            # a mean over the samples of a batch

single = make_model()                             # the reference: one model sees the whole batch
loss_fn(single(x), y).backward()
single_grads = [p.grad.clone() for p in single.parameters()]


def dp_gradients(x, y, average):
    """On each rank: forward and backward on this rank's half of the batch, then all-reduce every gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    nn.MSELoss()(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)                   # ReduceOp.SUM, the default
        if average:
            p.grad.div_(world)
    return [p.grad for p in model.parameters()]


def compare(per_rank, reference):
    """Do the ranks agree, and how large is rank 0's gradient against the reference (ratio of norms)?"""
    agree = all(torch.equal(a, b) for grads in per_rank[1:] for a, b in zip(per_rank[0], grads))
    flat = lambda gs: torch.cat([g.reshape(-1) for g in gs])  # noqa: E731
    ratio = (flat(per_rank[0]).norm() / flat(reference).norm()).item()
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(per_rank[0], reference))
    return agree, ratio, same


for average in (False, True):
    agree, ratio, same = compare(on_ranks(WORLD, dp_gradients, x, y, average), single_grads)
    print(f"{'averaged' if average else 'summed  '}: ranks agree: {agree}, gradient / single-process gradient: "
          f"{ratio:.3f}, equal to it: {same}")
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

HOOK_ON_DDP = code(r'''
def hook_on_ddp(x, y, hook):
    """DDP, plus a per-parameter all-reduce hook on top of it (the mistake), on each rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    ddp = DDP(model)                    # DDP registers its own gradient hooks: it already averages
    extra = 0
    if hook != "none":
        def extra_allreduce(p):
            nonlocal extra
            if hook == "average":
                p.grad.div_(world)
            dist.all_reduce(p.grad)     # SUM
            extra += 1
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(extra_allreduce)
    nn.MSELoss()(ddp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    return [p.grad for p in model.parameters()], extra


for hook, label in (("none", "DDP alone                  "), ("sum", "DDP + SUM hook (the seed's)"),
                    ("average", "DDP + averaging hook       ")):
    results = on_ranks(WORLD, hook_on_ddp, x, y, hook)
    agree, ratio, _ = compare([g for g, _ in results], single_grads)
    print(f"{label}: gradients {ratio:.3f}x the single-process ones, ranks agree: {agree}, "
          f"extra all-reduces: {results[0][1]}")
''')

DDP_BUCKETS = code(r'''
def exercise_model():
    """Exercise 2's model: parameters of 128, 16, 256, 16, 64 and 4 elements, in registration order."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def six_layers():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])  # 65,792 fp32 elements = 0.25 MiB each


def ddp_buckets(make, bucket_cap_mb=None, iterations=2):
    """The parameters in each bucket DDP all-reduces, per iteration (a comm hook sees every bucket)."""
    model = make()
    names = {p: n for n, p in model.named_parameters()}
    ddp = DDP(model) if bucket_cap_mb is None else DDP(model, bucket_cap_mb=bucket_cap_mb)
    seen = []

    def record(state, bucket):  # DDP calls it once per bucket; here: note, then DDP's default (average)
        seen[-1].append([names[p] for p in bucket.parameters()])
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, record)
    n_in = next(model.parameters()).shape[1]
    for _ in range(iterations):
        seen.append([])
        ddp(torch.randn(4, n_in)).sum().backward()
    return seen, ddp._get_ddp_logging_data()["bucket_sizes"]


from ultrascale.model import Transformer, get_preset

# An LLM's parameter tensors, counted on the meta device (shapes only, no memory, nothing initialised): one
# all-reduce each without buckets.
with torch.device("meta"):
    llama = Transformer(get_preset("llama3-8b"))
print(f"llama3-8b: {len(list(llama.parameters()))} parameter tensors")
print("torch", torch.__version__)
sizes = {n: p.numel() for n, p in exercise_model().named_parameters()}
cap = 300  # elements; in bytes: 1200 (fp32)
seen, logged = on_ranks(WORLD, ddp_buckets, exercise_model, cap * 4 / 2**20)[0]
print(f"exercise model, bucket_cap_mb = {cap} elements x 4 bytes (DDP's bucket_sizes log: {logged} bytes)")
for it, buckets in enumerate(seen, 1):
    print(f"  iteration {it}: " + " | ".join(f"{b} = {sum(sizes[n] for n in b)} elements" for b in buckets))

print(f"\nsix Linear(256, 256), default caps (first bucket {dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20:g} MiB, "
      f"then 25 MiB):")
seen, logged = on_ranks(WORLD, ddp_buckets, six_layers)[0]
layer_mib = (256 * 256 + 256) * 4 / 2**20
for it, buckets in enumerate(seen, 1):
    print(f"  iteration {it}: " + " | ".join(f"{len(b)} tensors = {len(b) // 2 * layer_mib:.3f} MiB" for b in buckets))
''')

TIMING = code(r'''
from ultrascale.parallel.data_parallel import BucketedDataParallel, NaiveDataParallel, OverlapDataParallel
from ultrascale.parallel.grads import LocalGrads


def time_sync(reps=10, width=384, layers=8, batch=64, bucket_mb=1.0):
    """Per rank, each mode on the same model and data: the fastest of `reps` timings (ms) of the forward and
    of backward + gradient sync; and the same all-reduces with nothing else running."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def net():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])

    torch.manual_seed(1 + rank)
    xb, yb = torch.randn(batch, width), torch.randn(batch, width)
    owners = {"backward only": lambda ps: LocalGrads(ps),  # the engine's gradient owner, no communication
              "naive": lambda ps: NaiveDataParallel(ps, "fp32", None, world),
              "overlap": lambda ps: OverlapDataParallel(ps, "fp32", None, world),
              "bucket": lambda ps: BucketedDataParallel(ps, "fp32", None, world, bucket_mb)}
    runs = {}
    for mode, make in owners.items():
        m = net()
        runs[mode] = (m, make(list(m.parameters())))
    ddp = DDP(net())
    runs["DDP, no_sync"] = runs["DDP"] = (ddp, None)
    fwd, sync, alone = {k: [] for k in runs}, {k: [] for k in runs}, []
    for r in range(reps + 2):  # 2 warm-up rounds (DDP rebuilds its buckets after the first)
        for mode, (model, owner) in runs.items():
            if owner is None:
                ddp.zero_grad()
            else:
                owner.zero()
            with ddp.no_sync() if mode == "DDP, no_sync" else contextlib.nullcontext():
                t0 = time.perf_counter()
                loss = nn.functional.mse_loss(model(xb), yb)
                t1 = time.perf_counter()
                dist.barrier()  # both ranks start backward together
                t2 = time.perf_counter()
                loss.backward()  # DDP waits for its last bucket at the end of backward
                if owner is not None:
                    owner.finish()  # the engine: wait for (naive: run) the all-reduces
                t3 = time.perf_counter()
            if r >= 2:
                fwd[mode].append((t1 - t0) * 1e3)
                sync[mode].append((t3 - t2) * 1e3)
        grads = [torch.randn_like(p) for p in ddp.parameters()]  # the same sizes, nothing else running
        dist.barrier()
        t0 = time.perf_counter()
        for g in grads:
            dist.all_reduce(g)
        if r >= 2:
            alone.append((time.perf_counter() - t0) * 1e3)
    same = all(torch.allclose(p.main_grad, q.grad, rtol=1e-4, atol=1e-7)
               for mode in ("naive", "overlap", "bucket")
               for p, q in zip(runs[mode][0].parameters(), ddp.module.parameters()))

    probe, ddp_buckets = DDP(net()), []  # how many buckets DDP makes here

    def count(state, bucket):  # a comm hook: note the bucket, then DDP's default (average)
        ddp_buckets.append(bucket.index())
        buf = bucket.buffer().div_(world)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])

    probe.register_comm_hook(None, count)
    for _ in range(2):  # the second iteration uses the rebuilt buckets
        ddp_buckets.clear()
        nn.functional.mse_loss(probe(xb), yb).backward()
    return {"forward": {k: min(v) for k, v in fwd.items()}, "sync": {k: min(v) for k, v in sync.items()},
            "alone": min(alone), "same": same, "params": sum(p.numel() for p in ddp.parameters()),
            "tensors": len(list(ddp.parameters())), "buckets": len(runs["bucket"][1].buckets),
            "ddp_buckets": len(ddp_buckets)}


t0 = time.perf_counter()
m = on_ranks(WORLD, time_sync)[0]
sync, fwd = m["sync"], m["forward"]
print(f"{m['params']:,} parameters in {m['tensors']} tensors ({m['params'] * 4 / 2**20:.1f} MiB of fp32 "
      f"gradients), 2 ranks, rank 0, best of 10")
print(f"the same all-reduces alone (one per tensor, nothing else running): {m['alone']:.1f} ms")
print(f"{'mode':<30}{'fwd+bwd+sync':>13}{'bwd+sync':>11}{'exposed comm':>14}{'hidden vs naive':>17}")
naive_exposed = sync["naive"] - sync["backward only"]
labels = {"bucket": f"bucket ({m['buckets']} buckets, cap 1 MiB)",
          "DDP": f"DDP ({m['ddp_buckets']} buckets, default caps)"}
for mode, base in (("backward only", None), ("naive", "backward only"), ("overlap", "backward only"),
                   ("bucket", "backward only"), ("DDP, no_sync", None), ("DDP", "DDP, no_sync")):
    line = f"{labels.get(mode, mode):<30}{fwd[mode] + sync[mode]:>10.1f} ms{sync[mode]:>8.1f} ms"
    if base is not None:
        exposed = sync[mode] - sync[base]
        line += f"{exposed:>11.1f} ms{1 - exposed / naive_exposed:>17.0%}"
    print(line)
print(f"every mode's averaged gradients equal DDP's: {m['same']}  ({time.perf_counter() - t0:.1f} s)")
''')

PROFILE = code(r'''
# The engine's profiler: a torch.profiler trace per rank (`ultrascale train --profile DIR`), read by
# `ultrascale trace DIR`, which intersects the communication intervals with the compute intervals.
import tempfile

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import get_preset
from ultrascale.testing.compare import train_on
from ultrascale.train.trace_report import report

for mode in ("naive", "bucket"):
    with tempfile.TemporaryDirectory() as traces:
        cfg = RunConfig(model=get_preset("tiny"), parallel=ParallelConfig(dp=WORLD, dp_mode=mode, bucket_mb=0.05),
                        train=TrainConfig(steps=3, seq_len=32, micro_batch=4, progress=False,
                                          profile=traces, profile_steps="2:3"))
        train_on(cfg, WORLD)  # the engine on the same 2 ranks, profiling steps 2 and 3
        ranks = report(traces)
    shares = ", ".join(f"rank {r['rank']} {r['hidden_share']:.0%}" for r in ranks)
    print(f"{mode:6s}: {ranks[0]['comm_ms']:5.1f} ms of communication on rank 0; hidden behind compute: {shares}")
''')

NO_SYNC = code(r'''
def no_sync_calls(x, y, forward_inside, accum=4):
    """DDP's all-reduce calls after each micro-batch of one optimizer step, on each rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    ddp = DDP(model)
    calls = []

    def counting(state, bucket):  # DDP's default (average the bucket), plus a note of each call
        calls.append(bucket.index())
        buf = bucket.buffer().div_(world)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, counting)
    after_each = []
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]           # this rank's 8 samples
    for i, (xb, yb) in enumerate(zip(xs.chunk(accum), ys.chunk(accum))):
        quiet = contextlib.nullcontext() if i == accum - 1 else ddp.no_sync()
        if forward_inside:
            with quiet:
                loss = nn.MSELoss()(ddp(xb), yb) / accum           # divide: the accumulated gradient is a mean
                loss.backward()
        else:
            loss = nn.MSELoss()(ddp(xb), yb) / accum
            with quiet:                                            # only backward inside: too late
                loss.backward()
        after_each.append(len(calls))
    return after_each, [p.grad for p in model.parameters()]


for inside, how in ((True, "forward + backward inside no_sync"), (False, "only backward inside no_sync     ")):
    results = on_ranks(WORLD, no_sync_calls, x, y, inside)
    agree, _, same = compare([g for _, g in results], single_grads)
    print(f"{how}: all-reduce calls after each micro-batch {results[0][0]}, ranks agree: {agree}, "
          f"full-batch gradient: {same}")
''')


EPISODE = Episode(
    number=4,
    title="Data Parallelism",
    slug="data_parallelism",
    subtitle="One replica per GPU, one averaged gradient, and three ways to stop waiting for the network",
    overview=[
        "Data parallelism on 2 real processes: the model replicated on every rank, a different micro-batch on "
        "each, the gradients **averaged** with an all-reduce before the optimizer step",
        "The naive version waits for the whole backward pass before it communicates",
        "Optimisation 1: overlap each gradient's all-reduce with the rest of backward (hooks, async "
        "all-reduce) - and why a hook on top of DDP reduces twice",
        "Optimisation 2: buckets - how PyTorch DDP really forms them, and the simpler rule you implement",
        "Measured: backward + gradient sync for the engine's naive, overlap and bucket modes and for DDP, and "
        "how much communication hides behind backward on a CPU",
        "Optimisation 3: with gradient accumulation, communicate once per optimizer step (`no_sync`)",
    ],
    references=[
        Reference(3, "the all-reduce collective, and gradient accumulation (micro-batch losses averaged)"),
        Reference(1, "the memory budget of a training step (gradient buckets add to it)"),
    ],
    sections=[
        Section("Setup: two real ranks", [
            md(r'''
Everything about several GPUs in this notebook runs on **2 real processes** joined in one `torch.distributed`
process group (the **gloo** backend on CPU; GPUs use **NCCL**, with the same calls). `on_ranks(2, fn, ...)`
runs the function `fn` of a cell on both processes, the way `torchrun --nproc-per-node 2` would, and returns
what each rank returned. Inside `fn`, `dist.get_rank()`, `dist.all_reduce` and DDP work exactly as on a
cluster. The processes are started once and reused by every cell.
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
batch is the **average** of the micro-batch gradients $g_r$:

$$g_{\text{batch}} = \frac{1}{N}\sum_{r=1}^{N} g_r$$

But `dist.all_reduce` **sums** by default (`ReduceOp.SUM`). Both ranks below train on their half of a
16-sample batch; the reference is one model trained on all 16 samples in this process.
'''),
            REPLICAS,
            md(r'''
The summed gradient is 2x too large - N times too large on N GPUs. With plain SGD that is N times the
learning rate; Adam's update is nearly blind to the gradient's scale and gradient clipping caps it, which
makes the bug easy to miss. Every data-parallel implementation **averages**: divide by N before or after
the sum, or reduce with `ReduceOp.AVG`, which divides inside the collective (NCCL has it, and so does gloo
in this torch).

> In the playbook's figure of the DP timeline, the numbered boxes are the model's **layers** on one GPU
> (backward visits them in reverse), not GPUs.
'''),
        ]),
        Section("The naive version waits for the whole backward pass", [
            md(r'''
The simplest DP runs backward to the end, then all-reduces every gradient, then steps. While the gradients
travel, the GPU computes nothing, and while it computes, the network carries nothing. Yet backward produces
gradients **last layer first**, and those are final long before backward reaches the first layer:
'''),
            ORDER,
            md(r'''
So the all-reduce of the last layers' gradients could start while backward still computes the earlier ones.
(This is a different problem from gradient accumulation's "one all-reduce per micro-batch", which is the
third optimisation below.)
'''),
        ]),
        Section("Optimisation 1: overlap communication with the backward pass", [
            md(r'''
`p.register_post_accumulate_grad_hook(hook)` makes autograd call `hook(p)` the moment `p.grad` is complete.
The hook starts an **asynchronous** all-reduce, `dist.all_reduce(p.grad, async_op=True)`, which returns a
`Work` handle at once; backward goes on with the earlier layers while the gradient travels. Before
`optimizer.step()`, wait for every handle. Every rank runs the same graph, so the hooks fire in the same order
on every rank and the collectives pair up. You write exactly this in **Exercise 1**; the engine's
`--dp-mode overlap` is the same idea (`ultrascale.parallel.data_parallel.OverlapDataParallel`).

**Never put such a hook on top of DDP.** DDP already registers its own gradient hooks and averages every
gradient across the ranks. The example notebook this series started from did exactly that, with a `SUM`
hook. On 2 real ranks:
'''),
            HOOK_ON_DDP,
            md(r'''
What happened: the extra hook runs when the gradient is accumulated, before DDP copies it into its bucket, so
DDP averages gradients that were already summed - the result is the sum, N times the right value. With an
averaging hook the values come out right only because averaging an average changes nothing, and every
gradient still crosses the network twice. Timing "the speed-up of the hook on top of DDP" therefore measures
nothing meaningful: use DDP *or* your own hooks.
'''),
        ]),
        Section("Optimisation 2: bucket gradients by size", [
            md(r'''
One all-reduce per parameter pays the fixed cost of a collective (launch, latency) once per parameter -
hundreds of times per step for an LLM (Llama 3 8B has 291 parameter tensors, printed below). Networks move
a few large messages far better than many small ones, so gradients are packed into **buckets**, one
contiguous flat buffer each, and each bucket is all-reduced with **one** call as soon as its last gradient
is ready: the overlap of optimisation 1 with fewer, larger messages. The buffers are allocated once and kept, so they add to training memory.

How does PyTorch DDP (torch 2.13) actually assign parameters to buckets? A comm hook sees every bucket it
all-reduces, so we can ask it, on the 2 ranks, for the model of Exercise 2 and a cap of 300 fp32 elements,
and for a 6-layer model with the default caps:
'''),
            DDP_BUCKETS,
            md(r'''
What the measurement shows about DDP:

- **Iteration 1: one bucket with every parameter, in registration order.** Without
  `find_unused_parameters`, DDP does not guess the backward order: it waits for one backward, then
  **rebuilds** the buckets in the order the gradients actually arrived (here, the reverse of registration).
- **A bucket is closed once it reaches the cap**: the parameter that crosses the cap stays in, so a bucket
  can be larger than `bucket_cap_mb` (340 elements against 300 above; four 0.25 MiB layers against 1 MiB).
- **The first bucket is small by default**: with the default `bucket_cap_mb` (25 MiB), the first bucket after
  the rebuild is capped at `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB), so the first all-reduce starts early;
  passing `bucket_cap_mb` explicitly gives the first bucket that same cap.
- The logged `bucket_sizes` are the initial assignment (one bucket), not the rebuilt one.

**Exercise 2 uses a simpler, explicit rule** (the one of the engine's `ultrascale.parallel.buckets.make_buckets`):
walk the parameters **last to first** (the reverse of registration, which for these models is the order
backward produces them); put each into the current bucket **unless adding it would take the bucket over the
cap**, in which case close the bucket first; a parameter larger than the cap on its own gets a bucket of its
own; **keep the last, partial bucket**. So no bucket ever exceeds the cap unless it holds a single parameter;
there is no special first bucket, and no rebuild. With the cap of 300 elements, DDP's first bucket above takes
`2.weight` and reaches 340; under the exercise's rule, `2.weight` starts the next bucket instead.

Two more rules, in DDP and in the exercise: a bucket is one **contiguous** buffer, so the collective sends a
single message; a buffer built with `torch.cat` is a **copy**, so after the all-reduce its values must be
copied back into every `.grad` (DDP with `gradient_as_bucket_view=True` avoids the copy: each `.grad` is a
view into its bucket).
'''),
        ]),
        Section("Measured: what each mode costs on two CPU ranks", [
            md(r'''
Now the three modes of the engine (`ultrascale.parallel.data_parallel`, the classes behind
`ultrascale train --nproc 2 --dp 2 --dp-mode naive|overlap|bucket`) and PyTorch DDP, on the same
8-layer MLP and the same data, on the 2 ranks. For each, we time the forward and **backward plus the
gradient sync** (backward, then `finish()`, which waits for or, in naive mode, performs the all-reduces);
their sum is the step without the optimizer, which is the same in every mode. We compare with
**backward alone** (no communication; for DDP: backward inside `no_sync()`). The difference is the
communication left **exposed**. Naive hides nothing by construction, so the share of naive's exposed time
that a mode no longer shows is what it **hid** behind backward. Each figure is the fastest of 10
repetitions, the one least disturbed by other programs.
'''),
            TIMING,
            md(r'''
How to read it, and the limits of a CPU measurement:

- **Naive** pays backward, then all the communication. Its exposed time is what communication costs when
  nothing overlaps; it can exceed the same all-reduces measured alone, because the first all-reduce also
  waits for the slower rank to finish backward (a straggler costs every rank).
- **Overlap, bucket and DDP** start communicating during backward. How much they hide depends on the
  hardware. With gloo on a CPU, an all-reduce is partly CPU work (gloo's threads copy and sum every byte,
  competing with backward for the same cores) and partly waiting for the other process; the waiting can hide
  behind backward, the CPU work only where a core is free. This machine has 2 cores for 2 ranks, shared with
  other programs, so the figures change from run to run (run the cell again): read them as orders of
  magnitude, not as a benchmark. On GPUs, NCCL moves the data with its own kernels and the network card while
  the GPU computes, and backward is long, so most of the all-reduce can hide.
- **DDP with its default caps** makes 2 buckets for a model this small: about 1 MiB (the last layers), then
  everything else, which can only start when backward is done; the engine's 1 MiB buckets start earlier. On
  the other hand DDP's reducer is C++, while the engine's and your hooks run Python for every tensor. Which
  wins by a few milliseconds here is within the noise. On a real LLM (gigabytes of gradients) 25 MiB buckets
  are small, and DDP overlaps well.
- **Buckets** also cut the number of collectives (one per bucket instead of one per tensor), which is what
  matters when each call has a fixed cost, such as the latency of a message across nodes.

A stopwatch infers the overlap; a profiler shows it. The engine records a trace per rank
(`ultrascale train --profile DIR`, Chrome trace format: open it in Perfetto) with named spans for forward,
backward, the optimizer and every collective, and `ultrascale trace DIR` measures, per rank, how much of the
communication ran while backward was computing (the comm-compute overlap of Holistic Trace Analysis). Naive
hides none of it by construction; buckets launched during backward hide a share that varies from run to run
on a shared CPU:
'''),
            PROFILE,
        ]),
        Section("Optimisation 3: gradient accumulation and `no_sync`", [
            md(r'''
Gradient accumulation (Part 3) runs several micro-batches through forward and backward before one optimizer
step, adding up their gradients in `.grad`. With DP, the naive combination all-reduces after **every**
micro-batch's backward - but the optimizer only needs the gradients once. DDP's `no_sync()` context turns
communication off: backward passes inside it only accumulate locally, and the **first backward outside** the
context all-reduces everything accumulated so far, in one go.

Two details decide whether it works:

- DDP decides **at forward time** whether the coming backward communicates, so the **forward** must run
  inside `no_sync()` too; wrapping only `loss.backward()` still all-reduces every micro-batch;
- each micro-batch's loss is divided by the number of micro-batches, so the accumulated gradient is a mean.

Each rank below runs its 8 samples as 4 micro-batches of 2; the small model's gradients fit in one bucket:
'''),
            NO_SYNC,
            md(r'''
Done right, three micro-batches pass without communication and the fourth reduces all four at once. Done
wrong, the result is the same gradient (averaging identical accumulated values changes nothing) at 4 times
the communication. The engine's trainer runs all but the last micro-batch inside `no_sync()`.

On GPUs the code of this notebook is the same with `dist.init_process_group("nccl")` and the model on
`cuda:<local rank>`; nothing here needs a GPU.
'''),
        ]),
    ],
    exercises=[
        Exercise(
            title="Overlapped data parallelism with hooks",
            instructions=r'''
Write `overlapped_data_parallel(model, x, y, loss_fn)`: one data-parallel backward, run on **every rank**
with that rank's micro-batch `(x, y)`. No DDP: you write what it does.

- register a post-accumulate-grad hook on every parameter; in it, turn `p.grad` into its share of the
  average (`dist.all_reduce` sums) and start `dist.all_reduce(p.grad, async_op=True)`; keep the returned
  `Work`;
- run forward and `loss.backward()` - the all-reduces start during backward;
- wait for every `Work` (the optimizer step comes next), and remove the hooks.

The check runs your function on **2 real ranks** (each with half of a batch) and compares every `p.grad`
with one process trained on the whole batch. It also watches your collectives: once per gradient, started
during backward, asynchronous, waited for.
''',
            starter=r'''
def overlapped_data_parallel(model, x, y, loss_fn):
    """One data-parallel backward on this rank; (x, y) is this rank's micro-batch.

    Afterwards every p.grad holds the average over the ranks of that gradient, the same on every
    rank, reduced by asynchronous all-reduces started during backward.
    """
    world = dist.get_world_size()
    pending = []  # the Work handle of each asynchronous all-reduce

    def on_grad_ready(p):
        # Autograd calls this the moment p.grad is complete; backward then goes on with earlier layers.
        # TODO: average p.grad over the ranks with an asynchronous all-reduce; keep its Work in `pending`
        pass

    # TODO: register on_grad_ready on every parameter (keep the handles)
    loss_fn(model(x), y).backward()
    # TODO: wait for every all-reduce in `pending`, then remove the hooks
    raise NotImplementedError
''',
            solution=r'''
def overlapped_data_parallel(model, x, y, loss_fn):
    """One data-parallel backward on this rank; (x, y) is this rank's micro-batch.

    Afterwards every p.grad holds the average over the ranks of that gradient, the same on every
    rank, reduced by asynchronous all-reduces started during backward.
    """
    world = dist.get_world_size()
    pending = []  # the Work handle of each asynchronous all-reduce

    def on_grad_ready(p):
        p.grad.div_(world)  # all_reduce sums: dividing first makes the sum the average
        pending.append(dist.all_reduce(p.grad, async_op=True))

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters() if p.requires_grad]
    loss_fn(model(x), y).backward()
    for work in pending:
        work.wait()
    for h in handles:
        h.remove()
''',
            check=r'''
from ultrascale.series.checks import part4
part4.exercise_1(overlapped_data_parallel)
''',
            hints=[
                "`p.register_post_accumulate_grad_hook(on_grad_ready)` returns a handle (for `.remove()`); "
                "autograd then calls `on_grad_ready(p)` during backward with `p.grad` complete. "
                "`dist.all_reduce(t, async_op=True)` returns a `Work` at once and reduces `t` in place.",
                "The all-reduce **sums** over the ranks: divide `p.grad` by `world` (dividing before the sum "
                "is fine: the sum of halves is the mean). Do not wrap the model in DDP - it already reduces "
                "every gradient, and yours would reduce them a second time.",
                "In the hook: `p.grad.div_(world)` then `pending.append(dist.all_reduce(p.grad, "
                "async_op=True))`. Before backward: `handles = [p.register_post_accumulate_grad_hook("
                "on_grad_ready) for p in model.parameters()]`. After: `for w in pending: w.wait()`, then "
                "`h.remove()` for each handle.",
            ],
        ),
        Exercise(
            title="Buckets by size, on two ranks",
            instructions=r'''
Write `bucketed_all_reduce(params, cap_numel)`, the heart of bucketing: it runs on **every rank** after
backward, with `params` in registration order (each with its `.grad`), and averages every gradient over the
ranks with **one all-reduce per bucket**. The rule (the engine's, not DDP's - see the section on buckets):

1. walk the parameters **last to first** (`reversed(params)`);
2. add each to the current bucket, unless the bucket is not empty and adding it would make the bucket hold
   **more than `cap_numel` elements**: then close the bucket and start a new one with this parameter (so a
   parameter larger than the cap sits alone);
3. after the loop, close the **last, partial bucket** too;
4. for each bucket, in that order: one flat, contiguous 1-D buffer of its gradients (flattened, in bucket
   order), divided by the world size, **one** `dist.all_reduce(buffer)`, and each slice **copied back** into
   its `p.grad`.

The check runs it on **2 real ranks** with the model of the bucket section (parameters of 128, 16, 256, 16,
64 and 4 elements) for four caps (one a bucket fills exactly, one below every parameter), reads your buckets from the buffers
your all-reduces send, and compares every `p.grad` with one process trained on the whole batch.
''',
            starter=r'''
def bucketed_all_reduce(params, cap_numel):
    """Average every p.grad over the ranks with one all-reduce per bucket (the rule above).

    params: the parameters in registration order, each with .grad set
    cap_numel: the most elements a bucket may hold (a larger parameter gets a bucket of its own)
    """
    world = dist.get_world_size()
    # TODO: group the parameters into buckets: last parameter first, a new bucket when the next one
    #       would take the current bucket over cap_numel elements; keep the last, partial bucket
    # TODO: per bucket: one flat buffer, divided by world, one dist.all_reduce, each slice back into p.grad
    raise NotImplementedError
''',
            solution=r'''
def bucketed_all_reduce(params, cap_numel):
    """Average every p.grad over the ranks with one all-reduce per bucket (the rule above).

    params: the parameters in registration order, each with .grad set
    cap_numel: the most elements a bucket may hold (a larger parameter gets a bucket of its own)
    """
    world = dist.get_world_size()
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
        flat.div_(world)
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:  # torch.cat copied, so write the reduced values back
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
''',
            check=r'''
from ultrascale.series.checks import part4
part4.exercise_2(bucketed_all_reduce)
''',
            hints=[
                "Two phases: first build a list of buckets (lists of parameters) with a running element "
                "count; only then communicate. The test `current and size + p.numel() > cap_numel` decides "
                "when to close a bucket *before* adding `p`.",
                "`torch.cat([p.grad.reshape(-1) for p in bucket])` is one contiguous 1-D buffer, but a copy: "
                "after `dist.all_reduce(flat)` (which sums - divide by `world`), walk the bucket with an "
                "offset and `p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))`. Do not forget "
                "the bucket still open when the loop ends.",
                "Loop: `for p in reversed(params): if current and size + p.numel() > cap_numel: "
                "buckets.append(current); current, size = [], 0` then `current.append(p); size += "
                "p.numel()`; after it `if current: buckets.append(current)`. Then per bucket: cat, `div_(world)`, "
                "`dist.all_reduce`, copy the slices back.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            "Two ranks each compute the gradient of the mean loss on their own 8 samples. What must the "
            "all-reduce leave on every rank so that both take the step one model would take on all 16 samples?",
            ["The sum of the two gradients", "The average of the two gradients", "Rank 0's gradient",
             "The larger of the two gradients"],
            1,
            "The mean-loss gradient over 16 samples is the mean of the two 8-sample gradients; the sum measured "
            "above is 2.000x too large.",
        ),
        QuizQuestion(
            "What makes naive data parallelism waste time?",
            ["It all-reduces activations as well as gradients",
             "It waits for the whole backward pass before communicating, so computation and communication "
             "never run at the same time",
             "It runs the replicas' forward passes one after another",
             "It recomputes the forward pass during backward"],
            1,
            "The last layers' gradients are ready early; starting their all-reduce during the rest of backward "
            "hides communication behind computation (on GPUs, most of it).",
        ),
        QuizQuestion(
            "Which statement about PyTorch DDP's gradient buckets (torch 2.13, `find_unused_parameters=False`) "
            "is true?",
            ["There is one bucket per layer",
             "Buckets never hold more than `bucket_cap_mb`",
             "From the second iteration, buckets follow the order gradients arrived in; a bucket is closed once "
             "it reaches the cap, so it can exceed it; with the default cap the first bucket is limited to 1 MiB",
             "The first iteration already uses buckets of `bucket_cap_mb` in backward order"],
            2,
            "Measured in the bucket section: one bucket in iteration 1, then rebuilt buckets of 340 elements "
            "against a 300-element cap, and a first bucket of four 0.25 MiB layers (1.004 MiB) for the 1 MiB "
            "first-bucket cap.",
        ),
        QuizQuestion(
            "Each rank accumulates 4 micro-batches per optimizer step; forward and backward of the first 3 run "
            "inside `ddp.no_sync()`, the 4th outside. The model's gradients fit in one bucket. How many "
            "all-reduces does DDP run in this step, and when?",
            ["4, one at the end of each micro-batch's backward",
             "None: `no_sync` turned communication off for the step",
             "1, during the 4th backward (outside `no_sync`), reducing the gradients accumulated over all 4 "
             "micro-batches",
             "1, inside `optimizer.step()`"],
            2,
            "Measured above: [0, 0, 0, 1]. Only with the forward outside `no_sync` (just backward inside) does "
            "DDP still reduce every micro-batch: [1, 2, 3, 4].",
        ),
    ],
)
