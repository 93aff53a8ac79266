"""Part 5 of the series: global batch size = micro-batch size x gradient accumulation x data parallelism.

The source of notebooks/5_global_batch_size.ipynb (build it with
`python notebooks/src/build.py`). Runs on one CPU process; ranks are simulated
as a list of model replicas.
"""

from ultrascale.series.episode import Cell, Episode, Exercise, QuizQuestion, Reference, Section


def md(text):
    return Cell("markdown", text.strip("\n"))


def code(text):
    return Cell("code", text.strip("\n"))


EQUATION = code(r'''
import torch
import torch.nn as nn


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

SETUP_RANKS = code(r'''
def make_model():
    """The same small MLP every time (replicas start from identical weights)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def all_reduce_sum(tensors):
    """dist.all_reduce for ranks simulated in one process: every tensor ends with the sum over ranks."""
    total = torch.stack(tensors).sum(dim=0)
    for t in tensors:
        t.copy_(total)


loss_fn = nn.MSELoss()                           # a mean over the samples of a batch
x, y = torch.randn(8, 16), torch.randn(8, 4)     # one global batch of 8 samples

big = make_model()                               # reference: all 8 samples in one pass
loss_fn(big(x), y).backward()

accum = 4                                        # the same 8 samples as 4 micro-batches of 2
small = make_model()
for xb, yb in zip(x.chunk(accum), y.chunk(accum)):
    loss_fn(small(xb), yb).backward()            # .grad adds up across backward passes

w_small, w_big = small[0].weight.grad, big[0].weight.grad
print(f"accumulated / one big batch: {(w_small.norm() / w_big.norm()).item():.3f}")
''')

THROUGHPUT = code(r'''
# Illustrative numbers: one micro-batch (forward + backward) takes 0.25 s; the gradient all-reduce
# takes 0.3 s and, in the worst case, is not hidden behind computation at all.
t_micro, t_allreduce = 0.25, 0.3
samples, mbs = 1024, 2
for dp in (64, 128, 256, 512):
    ga = samples // (mbs * dp)
    compute = ga * t_micro
    step = compute + t_allreduce
    print(f"DP = {dp:3d}, GA = {ga}: step {step:4.2f} s, of which computing {compute / step:4.0%}, "
          f"{samples * 4096 / step / dp:8,.0f} tokens/s per GPU")
''')


EPISODE = Episode(
    number=5,
    title="Global Batch Size",
    slug="global_batch_size",
    subtitle="GBS = MBS x GA x DP: filling a batch with GPUs and with gradient accumulation",
    overview=[
        "The batch-size equation: global batch = micro-batch size (MBS) x gradient-accumulation steps (GA) "
        "x data-parallel ranks (DP)",
        "Counting in samples and in tokens: 4M tokens of 4096-token sequences are 1024 samples",
        "A worked example: 4 accumulation steps on 128 GPUs, and what GA < 1 means",
        "Gradient accumulation only matches one big batch if it averages",
        "Trading GA for DP, and why data parallelism alone stops scaling",
    ],
    references=[
        Reference(4, "data parallelism, the averaged all-reduce and `no_sync` for gradient accumulation"),
    ],
    sections=[
        Section("The batch-size equation", [
            md(r'''
The **global batch size** (GBS) is the number of samples that contribute to one optimizer step. Three
knobs multiply into it:

$$\text{GBS} = \text{MBS} \times \text{GA} \times \text{DP}$$

- **MBS, the micro-batch size**: the samples one GPU runs through forward and backward at once. It is
  limited by GPU memory (activations grow with it).
- **GA, gradient-accumulation steps**: micro-batches each GPU processes, one after another, before the
  optimizer step; their gradients add up in `.grad`.
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
3. find the largest **MBS** that fits in GPU memory - say 2;
4. take the GPUs you have for DP, and fill the rest with gradient accumulation:
   $\text{GA} = 1024 / (2 \times 128) = 4$ on 128 GPUs.

GA must be a whole number, at least 1. Below 1 there are more GPUs than the batch can feed: use fewer GPUs,
a smaller MBS, or a larger global batch.
'''),
            WORKED,
        ]),
        Section("Gradient accumulation must average", [
            md(r'''
Accumulating micro-batch gradients should give exactly the gradient of the whole batch. Here one model
sees all 8 samples at once, another sees them as 4 micro-batches of 2, calling `backward()` on each
micro-batch's loss as it is:
'''),
            SETUP_RANKS,
            md(r'''
Four times too large: each micro-batch loss is already a mean over its own samples, and `.grad` **adds**
the four gradients. Dividing each micro-batch's loss by the number of accumulation steps turns the sum into
the mean - the same fix as dividing the all-reduced sum by DP in Part 4. Exercise 2 puts both together.
'''),
        ]),
        Section("Trading GA for DP, and the limits of data parallelism", [
            md(r'''
For a fixed global batch, GA and DP are interchangeable in the mathematics - both produce the same
averaged gradient - but not in time: the DP replicas process their micro-batches **in parallel**, while the
GA micro-batches run **one after another**. So the rule is: use as much data parallelism as you have GPUs
for, then fill the rest of the batch with gradient accumulation.

Data parallelism stops paying off for two reasons:

- **the batch runs out**: with GBS fixed, each extra GPU means less work per GPU per step, until GA
  reaches 1 (and after that there is nothing left to give the extra GPUs);
- **communication does not shrink**: every step still all-reduces the full gradients, while the compute
  that could hide it shrinks with GA. At a few hundred GPUs and beyond, the all-reduce (and the latency of
  ring-shaped collectives over many nodes) dominates, and throughput per GPU falls.

A rough model of the second effect:
'''),
            THROUGHPUT,
            md(r'''
When even one sample no longer fits (MBS = 1 is too much) or DP stops scaling, other dimensions are needed:
sharding the optimizer states, gradients and parameters across the DP ranks (ZeRO), and splitting the
model itself (tensor, pipeline and context parallelism) - the next episodes.
'''),
        ]),
    ],
    exercises=[
        Exercise(
            title="How many accumulation steps?",
            instructions=r'''
Write `grad_accum_steps(gbs_tokens, seq_len, mbs, dp)`: the number of gradient-accumulation steps that
reach a global batch of `gbs_tokens` tokens with sequences of `seq_len` tokens, micro-batches of `mbs`
samples and `dp` data-parallel GPUs. Return an `int`. Raise `ValueError` (with a message saying why) when
the tokens are not a whole number of sequences, when the samples do not split into a whole number of
accumulation steps, or when there are more GPUs than the batch can feed (fewer than 1 step).
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
four_m = 4 * 2**20
got = grad_accum_steps(four_m, 4096, 2, 128)
assert got == 4, f"4M tokens / 4096 = 1024 samples; 1024 / (2 x 128) = 4 steps, but you returned {got!r}"
assert type(got) is int, f"return an int (4), not {type(got).__name__} ({got!r})"
for args, want in (((four_m, 4096, 2, 512), 1), ((four_m, 4096, 1, 128), 8), ((four_m, 2048, 2, 128), 8)):
    got = grad_accum_steps(*args)
    assert got == want, f"grad_accum_steps{args} should be {want}, got {got!r}"


def raises(*args):
    try:
        grad_accum_steps(*args)
    except ValueError:
        return True
    return False


assert raises(four_m, 4096, 2, 1024), (
    "2**22 tokens, MBS 2 on 1024 GPUs is GA = 0.5: raise ValueError - there are more GPUs than the batch can feed")
assert raises(4_000_000, 4000, 2, 128), (
    "1000 samples on 2 x 128 is GA = 3.906: raise ValueError - not a whole number of accumulation steps")
assert raises(4_000_000, 4096, 2, 128), (
    "4,000,000 tokens are 976.6 sequences of 4096: raise ValueError - not a whole number of sequences")
''',
        ),
        Exercise(
            title="GBS = MBS x GA x DP, end to end",
            instructions=r'''
Write `dp_ga_grads`: one optimizer step's gradients with `dp = len(replicas)` simulated ranks and
`grad_accum` micro-batches per rank. Rank `r` takes the `r`-th of `dp` equal shards of the global batch and
splits it into `grad_accum` micro-batches (given in the starter). Accumulate the micro-batch gradients so
that they **average**, then all-reduce each parameter's gradient across the replicas with `all_reduce_sum`
and **average** again. Afterwards every replica's `.grad` must equal one model's gradient on the whole
batch.
''',
            starter=r'''
def dp_ga_grads(replicas, x, y, loss_fn, grad_accum, all_reduce_sum):
    """Gradients of one step with DP = len(replicas) ranks, each accumulating grad_accum micro-batches.

    Rank r gets x.chunk(dp)[r] (and y's), split into grad_accum micro-batches.
    Afterwards every replica's .grad equals one model's gradient on the whole batch (x, y).
    """
    dp = len(replicas)
    for r, (xs, ys) in enumerate(zip(x.chunk(dp), y.chunk(dp))):
        for xb, yb in zip(xs.chunk(grad_accum), ys.chunk(grad_accum)):
            # TODO: forward and backward of this micro-batch on replica r, so that the
            # accumulated gradient is an average over the micro-batches
            raise NotImplementedError
    # TODO: all-reduce each parameter's gradient across the replicas, and average it
''',
            solution=r'''
def dp_ga_grads(replicas, x, y, loss_fn, grad_accum, all_reduce_sum):
    """Gradients of one step with DP = len(replicas) ranks, each accumulating grad_accum micro-batches.

    Rank r gets x.chunk(dp)[r] (and y's), split into grad_accum micro-batches.
    Afterwards every replica's .grad equals one model's gradient on the whole batch (x, y).
    """
    dp = len(replicas)
    for r, (xs, ys) in enumerate(zip(x.chunk(dp), y.chunk(dp))):
        for xb, yb in zip(xs.chunk(grad_accum), ys.chunk(grad_accum)):
            loss = loss_fn(replicas[r](xb), yb) / grad_accum  # average over the micro-batches
            loss.backward()
    for params in zip(*(m.parameters() for m in replicas)):
        grads = [p.grad for p in params]
        all_reduce_sum(grads)
        for g in grads:
            g.div_(dp)  # average over the ranks
''',
            check=r'''
for dp, ga in ((2, 4), (4, 2)):
    mbs = 2
    torch.manual_seed(10 * dp + ga)
    xs, ys = torch.randn(mbs * ga * dp, 16), torch.randn(mbs * ga * dp, 4)
    reference = make_model()
    nn.MSELoss()(reference(xs), ys).backward()
    reps = [make_model() for _ in range(dp)]
    dp_ga_grads(reps, xs, ys, nn.MSELoss(), ga, all_reduce_sum)
    for r, rep in enumerate(reps):
        assert all(p.grad is not None for p in rep.parameters()), (
            f"replica {r} has no gradients: run forward and backward on its micro-batches")
    for r, rep in enumerate(reps[1:], 1):
        assert all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(rep.parameters(), reps[0].parameters())), (
            f"replica {r}'s gradients differ from replica 0's: all-reduce every parameter across the replicas")
    ratio = (reps[0][0].weight.grad.norm() / reference[0].weight.grad.norm()).item()
    hint = {dp * ga: "nothing is averaged: divide each micro-batch loss by grad_accum and the all-reduced sum by DP",
            ga: "the accumulation sums: divide each micro-batch loss by grad_accum",
            dp: "the all-reduce sums: divide the result by the number of replicas"}
    for factor, why in hint.items():
        assert abs(ratio - factor) > 0.01 or factor == 1, (
            f"with DP={dp}, GA={ga} the gradients are {ratio:.2f}x one model's full-batch gradient: {why}")
    for p, q in zip(reps[0].parameters(), reference.parameters()):
        err = (p.grad - q.grad).abs().max().item()
        assert err < 1e-5, (f"with DP={dp}, GA={ga} the gradients are off by up to {err:.2e} from the full-batch "
                            f"gradient: rank r must use shard r and every one of its micro-batches once")
''',
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
            "Both produce the same averaged gradient; DP does the work in parallel, GA takes GA times as long on "
            "the same GPUs.",
        ),
    ],
)
