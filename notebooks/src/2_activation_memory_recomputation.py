"""Part 2 of the series: activation memory and recomputation.

The source of notebooks/2_activation_memory_recomputation.ipynb (build it with
`python notebooks/src/build.py 2`). Everything is measured in one CPU process on the engine's
`tiny` model with the engine's ActivationMeter (saved-tensor hooks); the 8B figures come from the
planner (`ultrascale plan memory`).
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SAVED = code(r'''
import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ultrascale.model import build_model, get_preset
from ultrascale.train.metrics import ActivationMeter

torch.set_num_threads(1)  # one core: steady timings, even on a busy laptop

cfg = get_preset("tiny")  # Llama-style: RMSNorm, RoPE, 8 query / 4 kv heads, SwiGLU
h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
kv = cfg.kv_heads * cfg.head_dim
print(f"tiny: h={h}, heads a={a}, kv width={kv}, SwiGLU f={f}, {cfg.layers} blocks")


def block_saved(b, s, dtype=torch.float32, eager=False, listing=None):
    """Bytes block 0 keeps for backward for a [b, s, h] input, measured by the engine's ActivationMeter.
    eager=True runs attention on SDPA's math backend: softmax(QK^T)V written out, as plain PyTorch code does.
    listing: a list that receives (shape, dtype, bytes) of each tensor kept."""
    model = build_model(cfg, seed=0).to(dtype)
    meter = ActivationMeter(list(model.parameters()) + list(model.buffers()))
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    kept = {}

    def pack(t):  # what the meter counts, with shapes
        meter.record(t)
        if t.untyped_storage()._cdata not in meter.param_storages:
            kept[t.untyped_storage().data_ptr()] = (tuple(t.shape), str(t.dtype)[6:], t.untyped_storage().nbytes())
        return t

    attention = sdpa_kernel(SDPBackend.MATH) if eager else contextlib.nullcontext()
    with attention, meter.forward(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x, model.rope_cos[:s], model.rope_sin[:s])
    if listing is not None:
        listing.extend(kept.values())
    return meter.take_peak()


total = block_saved(2, 16, torch.float32)
print(f"fp32: one block, b=2, s=16 keeps {total:,} bytes = {total // 32:,} per token")
kept = []
total = block_saved(2, 16, torch.bfloat16, listing=kept)
print(f"bf16: one block, b=2, s=16 keeps {total:,} bytes = {total // 32:,} per token:")
for shape, dt, nbytes in kept:
    print(f"   {str(shape):<16} {dt:<9} {nbytes // 32:5d} bytes/token")
''')

LINEAR = code(r'''
print("fused (flash) SDPA, fp32: bytes one block keeps")
for b in (1, 2, 4):
    row = []
    for s in (64, 128, 256):
        n = block_saved(b, s)
        row.append(f"s={s}: {n / 2**20:5.2f} MiB ({n // (b * s)} B/token)")
    print(f"  b={b}: " + "   ".join(row))
''')

QUADRATIC = code(r'''
print("eager attention (math backend), fp32, b=1: bytes one block keeps per token")
per_token = {}
for s in (32, 64, 128, 256):
    per_token[s] = block_saved(1, s, eager=True) / s
    print(f"  s={s:3d}: {per_token[s]:7,.0f} B/token (fused: {block_saved(1, s) / s:,.0f})")
slope = (per_token[256] - per_token[128]) / 128
print(f"each extra position adds {slope:g} bytes per token = 4 bytes x {slope / 4:g} heads: "
      f"one fp32 attention probability per head per key")
print(f"at s=256 the probabilities are {slope * 256:,.0f} of the {per_token[256]:,.0f} bytes per token "
      f"({slope * 256 / per_token[256]:.0%})")
''')

PLANNER = code(r'''
import contextlib
import io
import json

from ultrascale.cli import main as ultrascale  # the `ultrascale` command, run in this process


def planned_activations(seq_len, attention="flash", recompute="none"):
    """The planner's activation bytes for Llama 3 8B in bf16, one sequence per micro-batch, our engine's kernels:
    `ultrascale plan memory --model llama3-8b ... --json`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ultrascale(["plan", "memory", "--model", "llama3-8b", "--dp", "1", "--micro-batch", "1",
                    "--seq-len", str(seq_len), "--framework", "ultrascale", "--attention", attention,
                    "--recompute", recompute, "--json"])
    return json.loads(out.getvalue())["memory"]["activations"]


for seq_len in (2048, 4096, 8192):
    flash, eager = planned_activations(seq_len), planned_activations(seq_len, "eager")
    print(f"llama3-8b, one sequence of {seq_len:5d}: flash {flash / 2**30:6.1f} GiB, eager {eager / 2**30:6.1f} GiB"
          f"  (flash: {flash / seq_len / 2**20:.2f} MiB per token)")
''')

RECOMPUTE = code(r'''
import time

from torch.utils.flop_counter import FlopCounterMode

from ultrascale.model import cross_entropy_loss
from ultrascale.train.recompute import apply_recompute

b, s = 2, 256
tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))


def step_costs(mode, eager):
    """Activations kept by one forward of the whole model, FLOPs and time of forward + backward."""
    model = build_model(cfg, seed=0)
    apply_recompute(model, mode)  # the engine's --recompute none | selective | full
    meter = ActivationMeter(list(model.parameters()) + list(model.buffers()))
    attention = (lambda: sdpa_kernel(SDPBackend.MATH)) if eager else contextlib.nullcontext

    def fwd_bwd(measure=contextlib.nullcontext()):
        with attention(), measure:
            loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        with attention():
            loss.backward()
        model.zero_grad(set_to_none=True)

    fwd_bwd(meter.forward())
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # math: attention is counted
        fwd_bwd()
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        fwd_bwd()
        seconds.append(time.perf_counter() - start)
    return meter.take_peak(), counter.get_total_flops() / (b * s), min(seconds)


costs = {(mode, eager): step_costs(mode, eager) for eager in (True, False) for mode in ("none", "selective", "full")}
for eager in (True, False):
    print(f"{'eager attention' if eager else 'fused (flash) attention'}, fp32, b={b}, s={s}, {cfg.layers} blocks:")
    base_act, base_flops, base_time = costs[("none", eager)]
    for mode in ("none", "selective", "full"):
        act, flops, seconds = costs[(mode, eager)]
        print(f"  {mode:<9}: activations {act / 2**20:5.2f} MiB ({act / base_act:4.0%}), FLOPs/token {flops:>9,.0f} "
              f"(+{flops / base_flops - 1:5.1%}), forward+backward {1000 * seconds:5.1f} ms")
added = costs[("selective", True)][1] - costs[("none", True)][1]
print(f"selective adds {added:,.0f} FLOPs per token: QK^T once more, 2 x L x h x s = {2 * cfg.layers * h * s:,}")
''')

PLAN_RECOMPUTE = code(r'''
for mode in ("none", "selective", "full"):
    print(f"llama3-8b, seq 4096, flash attention, --recompute {mode:<9}: "
          f"activations {planned_activations(4096, recompute=mode) / 2**30:5.1f} GiB")
''')

GPU = code(r'''
# Needs a GPU: the allocator's own peak for one forward + backward of a bigger model, per recompute mode.
for mode in ("none", "selective", "full"):
    gpu_model = build_model(get_preset("small"), seed=0, device="cuda").to(torch.bfloat16)
    apply_recompute(gpu_model, mode)
    x = torch.randint(0, 257, (8, 513), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    cross_entropy_loss(gpu_model(x[:, :-1]), x[:, 1:]).backward()
    print(f"{mode:<9}: peak allocated {torch.cuda.max_memory_allocated() / 2**20:7.1f} MiB")
''', needs_gpu=True)


EPISODE = Episode(
    number=2,
    title="Activation Memory and Recomputation",
    slug="activation_memory_recomputation",
    subtitle="What a forward pass keeps for backward, why it grows with the sequence, and what recomputing buys",
    overview=[
        "Activations are the tensors autograd saves in forward for backward: measured tensor by tensor on one "
        "block of our model",
        "With fused (flash) attention they grow linearly with micro-batch and sequence length: a fixed number "
        "of bytes per token",
        "Eager attention adds a term quadratic in the sequence length (the s x s attention probabilities); "
        "FlashAttention keeps only the output and one logsumexp per head instead",
        "Selective recomputation (only the attention core) and full recomputation (whole blocks) with the "
        "engine's `--recompute`: memory saved and compute added, both measured",
        "The same figures for Llama 3 8B from the planner",
    ],
    references=[
        Reference(1, "the four memory owners, and MFU (recomputation adds hardware FLOPs, not model FLOPs)"),
    ],
    sections=[
        Section("What autograd keeps for backward", [
            md(r'''
Part 1 measured four memory owners; three of them (parameters, gradients, optimizer states) depend only on
the model. The fourth, **activations**, depends on the batch: every operation in forward saves what its
backward needs - a matmul keeps its input, a SiLU its input, a softmax its output - and these tensors stay
alive from forward until backward consumes them.

The engine's `ActivationMeter` counts them with PyTorch's saved-tensor hooks (every tensor autograd saves
passes through a hook), excluding the parameters, which are not activations. Here is what one block of our
model keeps, tensor by tensor:
'''),
            SAVED,
            md(r'''
The bf16 listing, in order, on the attention side: the RMSNorm's input, its `rstd` (one value per token) and `x·rstd` - all
**fp32** even in bf16, because our norm computes in fp32; the norm's output (input of q, k, v
projections); q and k after RoPE, and v (k and v are `kv` wide: grouped-query attention); the attention's
**logsumexp** (fp32, one per head per token) and output (input of `o_proj`). On the MLP side: the same three
norm tensors and the norm output; then SwiGLU's gate, up, silu(gate) and their product, `f` wide each.
(The `[1, s, 1, d/2]` RoPE tables are views of model buffers and are not counted.)

Nothing here has a dimension other than b, s and a width: with fused attention a block keeps a **fixed number
of bytes per token**.
'''),
        ]),
        Section("Linear in micro-batch and sequence length", [
            LINEAR,
            md(r'''
Doubling the micro-batch or the sequence doubles the activations, byte for byte. For a real model the
per-token figure is large: the planner below puts Llama 3 8B (32 blocks of width 4096, in bf16) at 6.67 MiB
per token with flash attention, so one 8,192-token sequence keeps 53.3 GiB of activations - and 181.3 GiB
with eager attention.
Exercise 1 writes this block's formula.
'''),
        ]),
        Section("Eager attention: the quadratic term", [
            md(r'''
Attention written plainly computes the scores $QK^T$ - an $s \times s$ matrix per head - then their softmax,
then multiplies by $V$. The softmax's backward needs its output, so the $s \times s$ probabilities of every
head are kept: per token, one value per head **per key**. That term grows with $s$ per token, so
quadratically per sequence. Korthikanti et al. count a GPT block at $sbh(34 + 5as/h)$ bytes in 16-bit: the
$5as/h$ term is the softmax output (2 bytes), its dropout mask (1) and the dropout output (2), per head and
key. We measure PyTorch's own plain implementation (SDPA's math backend; no dropout in our model):
'''),
            QUADRATIC,
            md(r'''
The fused per-token figure stays flat; the eager one grows by a fixed amount for every position added. At
$s = 256$ the attention probabilities are already most of the block's activations (64%), and at real sequence
lengths they dominate everything. The planner, which counts the same tensors for any shape, shows it for
Llama 3 8B:
'''),
            PLANNER,
        ]),
        Section("What FlashAttention keeps instead", [
            md(r'''
FlashAttention (and PyTorch's fused SDPA, the engine's default) never writes the $s \times s$ matrix to
memory: it walks over blocks of keys with a running ("online") softmax, keeping in fast on-chip memory only
one tile of scores at a time. For backward it keeps the output and the **logsumexp** of each query's scores
(the fp32 `[b, a, s]` tensor in the listing above: 4 bytes per head per token) and **recomputes** the scores
tile by tile. It is recomputation built into the kernel - recompute the cheap, huge thing instead of storing
it - and it is faster, not slower, because reading an $s \times s$ matrix from GPU memory costs more than
recomputing it.
'''),
        ]),
        Section("Selective and full recomputation", [
            md(r'''
Recomputation (activation checkpointing) trades compute for memory: keep fewer activations in forward and
run part of forward again during backward to get them back. The engine offers two granularities
(`ultrascale train --recompute ...`, implemented in `ultrascale/train/recompute.py` with
`torch.utils.checkpoint`):

- **full**: each block keeps only its input; its whole forward runs again in backward. Activations drop to
  one hidden vector per token per layer; compute rises by about one forward pass;
- **selective**: only the attention core, softmax(QK^T)V, is recomputed (Korthikanti et al. 2022). It
  holds the quadratic term and has no weights, so recomputing it is cheap.

Measured on the whole tiny model, with both attention implementations (FLOPs counted with the math backend
so the attention is included; times are best of three on this CPU):
'''),
            RECOMPUTE,
            md(r'''
With eager attention, selective recomputation removes the quadratic term for the price of $QK^T$ once more
($2Lhs$ FLOPs per token: non-reentrant checkpointing stops as soon as the saved tensors are rebuilt, so $AV$ is
not redone); full recomputation removes nearly everything, for a forward of every block again (the usual
estimate is $8N$ instead of $6N$, +33%; here +26.3%, as the embedding and head are not recomputed and each block's
last matmul is not needed). With fused attention, selective has almost nothing left to remove -
FlashAttention already recomputes the scores - so the choice is between none and full. Recomputation does
not change the model FLOPs that MFU counts (Part 1): the extra forward is hardware work only.

For Llama 3 8B (bf16, flash attention, one 4096-token sequence), the planner's figures:
'''),
            PLAN_RECOMPUTE,
            md(r'''
On a GPU, the allocator's peak shows the same ordering (this cell does nothing on a CPU):
'''),
            GPU,
        ]),
    ],
    exercises=[
        Exercise(
            title="The activation formula of one block",
            instructions=r'''
Write `block_activation_bytes(cfg, b, s, dtype_bytes)`: the bytes one block of our model keeps for backward,
with the default fused (flash) attention, for a micro-batch of `b` sequences of `s` tokens, in fp32
(`dtype_bytes=4`) or bf16 (`dtype_bytes=2`). Use the listing above: which tensors, how wide (`h`, the kv
width, `f`, the number of heads), and in which dtype - some of them are fp32 whatever `dtype_bytes` is.

The check measures a real block with the engine's `ActivationMeter` for three shapes (GQA and multi-head),
several `(b, s)` and both dtypes.
''',
            starter=r'''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    """Bytes one block (fused attention) keeps for backward for b sequences of s tokens."""
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    # TODO: bytes per token: the two norms (fp32), the attention side, the MLP side; then times b * s.
    raise NotImplementedError
''',
            solution=r'''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    """Bytes one block (fused attention) keeps for backward for b sequences of s tokens."""
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    norm = 4 * h + 4 + 4 * h                          # fp32 input, rstd, x*rstd
    attention = dtype_bytes * (h + h + 2 * kv + h) + 4 * a   # norm output, q, k, v, output; fp32 logsumexp
    mlp = dtype_bytes * (h + 4 * f)                   # norm output; gate, up, silu(gate), product
    return b * s * (2 * norm + attention + mlp)
''',
            check=r'''
from ultrascale.series.checks import part2
part2.exercise_1(block_activation_bytes)
''',
            hints=[
                "Divide each line of the listing by b·s: every tensor is a whole number of bytes per token. "
                "Group them: two norms, the attention side, the MLP side.",
                "A norm keeps its fp32 input (4h), rstd (4) and x·rstd (4h) in both dtypes. In the compute "
                "dtype: the norm outputs (h each), q (h), k and v (kv each), the attention output (h), and "
                "four f-wide MLP tensors. The logsumexp is 4 bytes per head.",
                "`b * s * (2 * (8*h + 4) + dtype_bytes * (4*h + 2*kv + 4*f) + 4*a)`.",
            ],
        ),
        Exercise(
            title="Selective recomputation of the attention core",
            instructions=r'''
Write `recompute_attention_core(model)`: selective recomputation on a model of the engine. For every block
(`model.layers.values()`), make `block.attn.core_attention` run its forward under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, so that it keeps nothing for backward and is
recomputed there. Its forward takes `(q, k, v)` and returns the attention output.

The check runs the model with eager attention (where the core holds the $s \times s$ probabilities): the
loss and every gradient must equal the model's without recomputation, the saved memory, measured, must
drop to what the engine's own `--recompute selective` keeps, and in backward the attention core, and only
it, must run again.
''',
            starter=r'''
from torch.utils.checkpoint import checkpoint


def recompute_attention_core(model):
    """Wrap every block's attention core in activation checkpointing (in place)."""
    for block in model.layers.values():
        core = block.attn.core_attention
        # TODO: replace core.forward by a function of (q, k, v) that calls the original forward
        # through checkpoint(..., use_reentrant=False)
        raise NotImplementedError
''',
            solution=r'''
from torch.utils.checkpoint import checkpoint


def recompute_attention_core(model):
    """Wrap every block's attention core in activation checkpointing (in place)."""
    for block in model.layers.values():
        core = block.attn.core_attention
        plain = core.forward  # the original forward, bound to this core
        core.forward = lambda q, k, v, plain=plain: checkpoint(plain, q, k, v, use_reentrant=False)
''',
            check=r'''
from ultrascale.series.checks import part2
part2.exercise_2(recompute_attention_core)
''',
            hints=[
                "`checkpoint(fn, *args, use_reentrant=False)` runs `fn(*args)` keeping only `args`, and runs it "
                "again in backward. Replacing a module's `forward` attribute changes what calling the module does.",
                "Keep the original bound method (`plain = core.forward`) before replacing it, and make the new "
                "forward call `checkpoint(plain, q, k, v, use_reentrant=False)`; pass q, k, v themselves "
                "(not detached), so gradients flow through the recomputed attention.",
                "`core.forward = lambda q, k, v, plain=core.forward: checkpoint(plain, q, k, v, "
                "use_reentrant=False)` for each block.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            "With eager attention, the sequence length of a micro-batch doubles. What happens to a block's "
            "activation memory?",
            ["It doubles", "The per-token terms double and the attention-probability term quadruples",
             "It quadruples, all of it", "It is unchanged"],
            1,
            "Per token each position keeps one probability per head and key: s x s per head per sequence.",
        ),
        QuizQuestion(
            "What does FlashAttention keep for backward instead of the s x s attention probabilities?",
            ["Nothing: it recomputes q, k and v too", "The scores QK^T in bf16",
             "Its output and one logsumexp per head per token; the scores are recomputed tile by tile",
             "A compressed copy of the probabilities"],
            2,
            "With the logsumexp the softmax of any tile can be rebuilt exactly; the s x s matrix is never stored.",
        ),
        QuizQuestion(
            "Full recomputation of every block costs roughly how much compute per token?",
            ["Nothing: memory is free", "About one more forward pass: ~8N instead of 6N FLOPs",
             "Twice the whole step: 12N", "One more backward pass: 10N"],
            1,
            "Each block's forward (2N in total) runs again during backward.",
        ),
        QuizQuestion(
            "Why does selective recomputation target the attention core?",
            ["It has the most parameters", "It holds the activations that grow with s² and has no weights, "
             "so redoing it is cheap", "The MLP cannot be recomputed", "It is the only part in fp32"],
            1,
            "Large memory, small recompute: the best memory saved per FLOP added.",
        ),
    ],
)
