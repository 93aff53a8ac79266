"""Part 1 of the series: scaling basics - the training step, who owns the memory, batch size in
tokens, the parameter count, FLOPs per token, throughput and MFU.

The source of notebooks/1_scaling_basics.ipynb (build it with `python notebooks/src/build.py 1`).
Everything runs in one CPU process on the engine's `tiny` model; the 8B figures come from the
planner (`ultrascale plan memory`) and from the model's shape on the meta device.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Section, code, md


STEP = code(r'''
import torch

from ultrascale.model import build_model, count_params, cross_entropy_loss, get_preset
from ultrascale.train.metrics import ActivationMeter, optimizer_state_tensors, storage_bytes

torch.set_num_threads(1)  # one core: steady timings, even on a busy laptop

cfg = get_preset("tiny")           # a Llama-style decoder: 2 blocks, hidden 64, 8 query / 4 kv heads
model = build_model(cfg, seed=0)   # fp32 on the CPU
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
meter = ActivationMeter(list(model.parameters()) + list(model.buffers()))
N = count_params(cfg)

tokens = torch.randint(0, cfg.vocab_size, (8, 65), generator=torch.Generator().manual_seed(0))
inputs, targets = tokens[:, :-1], tokens[:, 1:]   # 8 sequences of 64 tokens, next-token targets


def owners(activations=0):
    """Bytes held right now by each owner, measured on the tensors themselves."""
    return {"params": storage_bytes(model.parameters()),
            "grads": storage_bytes(p.grad for p in model.parameters()),
            "optim": storage_bytes(optimizer_state_tensors(opt)),
            "activations": activations}


def show(when, mem):
    print(f"{when:<16}" + "  ".join(f"{k} {v / 1024:8.1f} KiB" for k, v in mem.items()))


print(f"tiny model: {N:,} parameters")
show("before", owners())
with meter.forward():                       # counts what autograd keeps for backward
    loss = cross_entropy_loss(model(inputs), targets)
show("after forward", owners(meter.peak))
loss.backward()                             # frees the activations, fills .grad
show("after backward", owners())
opt.step()                                  # AdamW creates its two moments on the first step
show("after step", owners())
opt.zero_grad(set_to_none=True)
show("after zero_grad", owners())
print(f"activations at the end of forward: {meter.peak / storage_bytes(model.parameters()):.1f} x the parameters")
''')

OWNERS = code(r'''
from ultrascale.config import RunConfig, TrainConfig
from ultrascale.testing.compare import train_single

runs = {}
for dtype in ("fp32", "bf16"):
    run_cfg = RunConfig(model=get_preset("tiny"),
                        train=TrainConfig(steps=4, seq_len=64, micro_batch=8, dtype=dtype, progress=False))
    runs[dtype] = train_single(run_cfg).metrics   # the engine's trainer, 4 steps on this CPU

for dtype, metrics in runs.items():
    mem = metrics[-1]["memory"]
    per_param = {k: mem[k] / N for k in ("params", "grads", "optim")}
    print(f"{dtype}: " + " + ".join(f"{k} {v:g}" for k, v in per_param.items())
          + f" = {sum(per_param.values()):g} bytes per parameter;"
          + f" activations {mem['activations'] / 2**20:.2f} MiB for 8 x 64 tokens")
act = {dtype: metrics[-1]["memory"]["activations"] for dtype, metrics in runs.items()}
from ultrascale.parallel.precision import flash_attention_fails_here
if flash_attention_fails_here("bf16"):  # an AMX CPU under ATEN_CPU_CAPABILITY below avx512 (Part 2)
    print("bf16 attention ran on SDPA's math kernel here (torch's CPU flash kernel cannot run bf16 under "
          "this ATen kernel set on a CPU with AMX): it keeps each head's s x s probabilities, so the ratio "
          "below is not flash attention's")
print(f"bf16 activations / fp32 activations: {act['bf16'] / act['fp32']:.2f}")
''')

PLANNER = code(r'''
import contextlib
import io
import json

from ultrascale.cli import main as ultrascale  # the `ultrascale` command, run in this process


def plan_states(precision):
    """The planner's model states for Llama 3 8B on one GPU (no parallelism), bytes per owner:
    `ultrascale plan memory --model llama3-8b ... --json`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ultrascale(["plan", "memory", "--model", "llama3-8b", "--dp", "1", "--zero", "0", "--micro-batch", "1",
                    "--seq-len", "4096", "--precision", precision, "--json"])
    plan = json.loads(out.getvalue())
    return plan["param_count"], {k: plan["memory"][k] for k in ("params", "grads", "optim")}


for precision in ("fp32", "bf16", "bf16-fp32-grads"):
    psi, states = plan_states(precision)
    per_param = " + ".join(f"{k} {v / psi:g}" for k, v in states.items())
    print(f"llama3-8b ({psi / 1e9:.2f}B), {precision:<16}: {per_param} = {sum(states.values()) / psi:g} bytes/param"
          f" = {sum(states.values()) / 2**30:.0f} GiB")
''')

BATCH = code(r'''
t = run_cfg.train   # one process, no gradient accumulation: a step is one micro-batch
print(f"the runs above: {t.micro_batch * t.grad_accum} samples x {t.seq_len} tokens"
      f" = {t.micro_batch * t.grad_accum * t.seq_len} tokens; the trainer counted {runs['fp32'][-1]['tokens']}"
      f" tokens per optimizer step")
for seq_len in (2048, 4096, 8192):
    print(f"4M-token batch ({4 * 2**20:,} tokens) at seq_len {seq_len}: {4 * 2**20 // seq_len:,} samples")
''')

DATA = code(r'''
import os
import sysconfig
import tempfile

# The `email` package of Python's standard library: about 2 MB of text on every machine with Python.
source = os.path.join(sysconfig.get_paths()["stdlib"], "email")
work = tempfile.mkdtemp()
# 1. Tokenize once into memory-mapped shards (bytes as tokens), holding 10% of the text out for validation.
ultrascale(["data", "prepare", source, f"{work}/email", "--val-fraction", "0.1", "--workers", "1"])
# 2. Train on it, with the validation loss every 50 steps, and save the model.
ultrascale(["train", "--model", "tiny", "--data", f"{work}/email", "--steps", "100", "--seq-len", "64",
            "--micro-batch", "8", "--lr", "1e-2", "--eval-every", "50", "--eval-batches", "4", "--log-every", "25",
            "--peak", "1", "--save", f"{work}/ck"])
# 3. Text from the trained model: sampled (temperature 0.8 among the 20 likeliest bytes), with a KV cache.
_ = ultrascale(["generate", f"{work}/ck", "--prompt", "def ", "--max-new-tokens", "60", "--temperature", "0.8",
                "--top-k", "20", "--seed", "0"])
''')

GPT_COUNT = code(r'''
from ultrascale.model import ModelConfig, playbook_param_formula
from ultrascale.model.transformer import Transformer


def numel(cfg):
    """Parameters of the engine's model for cfg, built on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


# The playbook's block: LayerNorm, a 4h GELU MLP, biases everywhere, tied embeddings, no position table.
for h, L, heads, v in ((64, 2, 8, 257), (768, 12, 12, 50257), (4096, 32, 32, 131072)):
    gpt = ModelConfig(name="gpt", vocab_size=v, hidden=h, layers=L, heads=heads, kv_heads=heads,
                      ffn_hidden=4 * h, norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)
    counted, formula = numel(gpt), playbook_param_formula(h, v, L)
    print(f"h={h:5d} L={L:2d} v={v:6d}: model {counted:>13,}  formula {formula:>13,}  "
          f"equal: {counted == formula}   12h² share of the total: {L * 12 * h * h / counted:.0%}")
''')

FLOPS = code(r'''
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

b, s = 4, 64
x = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(1))
# The math backend writes attention as two batched matmuls (QK^T, then AV), so the counter sees them.
with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
    cross_entropy_loss(model(x[:, :-1]), x[:, 1:]).backward()
by_op = {str(op): n / (b * s) for op, n in counter.get_flop_counts()["Global"].items()}
model.zero_grad(set_to_none=True)

h, L, v = cfg.hidden, cfg.layers, cfg.vocab_size
matmul_params = sum(p.numel() for name, p in model.named_parameters() if "proj" in name or name == "head.weight")
print("measured FLOPs per token, forward + backward:", {k: int(n) for k, n in by_op.items()})
print(f"  weight matmuls (aten.mm): {by_op['aten.mm']:,.0f} = 6 x {matmul_params:,} parameters in matmuls: "
      f"{by_op['aten.mm'] == 6 * matmul_params}")
print(f"  attention (aten.bmm):     {by_op['aten.bmm']:,.0f} = 12 x L x h x s = {12 * L * h * s:,}: "
      f"{by_op['aten.bmm'] == 12 * L * h * s}")
print(f"parameters that do no matmul: embedding {v * h:,} + norms {(2 * L + 1) * h:,} of N = {N:,}"
      f" ({(v * h + (2 * L + 1) * h) / N:.0%}); in llama3-8b: "
      f"{(lambda c: (c.vocab_size * c.hidden) / count_params(c))(get_preset('llama3-8b')):.1%}")
''')

THROUGHPUT = code(r'''
import statistics
import time

steps = runs["fp32"][1:]   # the first step pays for warm-up
tokens_per_s = statistics.median(m["tokens_per_s"] for m in steps)
engine_tflops = statistics.median(m["tflops"] for m in steps)
print(f"fp32 tiny model, 512 tokens per step: {tokens_per_s:,.0f} tokens/s (median of steps 2-4)")
print(f"the trainer's own figure: {engine_tflops * 1e12 / 1e9:.2f} GFLOP/s of model FLOPs")

# A peak to compare with: the fastest this core multiplies large fp32 matrices.
a, c = torch.randn(1024, 1024), torch.randn(1024, 1024)
best = float("inf")
for _ in range(5):
    start = time.perf_counter()
    a @ c
    best = min(best, time.perf_counter() - start)
cpu_peak = 2 * 1024**3 / best
print(f"this CPU core's fp32 matmul peak: {cpu_peak / 1e9:.1f} GFLOP/s (a 1024 x 1024 matmul, best of 5)")

from ultrascale.train.metrics import PEAK_TFLOPS
print("data-sheet dense peaks the trainer uses on GPUs, TFLOP/s:", PEAK_TFLOPS)
''')

GPU = code(r'''
# Needs a GPU: the same trainer in bf16 on CUDA, where it knows the data-sheet peak and reports MFU itself.
from ultrascale.config import validate
from ultrascale.distributed.context import build_context
from ultrascale.train.trainer import run_training

gpu_cfg = validate(RunConfig(model=get_preset("small"),
                             train=TrainConfig(steps=6, seq_len=512, micro_batch=16, dtype="bf16", progress=False)), 1)
last = run_training(gpu_cfg, build_context(gpu_cfg.parallel, 0, 1, device=torch.device("cuda"))).metrics[-1]
mfu = "no data-sheet peak for this GPU" if last["mfu"] is None else f"{last['mfu']:.1%}"
print(f"{torch.cuda.get_device_name()}: {last['tokens_per_s']:,.0f} tokens/s, "
      f"{last['tflops']:.2f} TFLOP/s, MFU {mfu}")
''', needs_gpu=True)


EPISODE = Episode(
    number=1,
    title="Scaling Basics",
    slug="scaling_basics",
    subtitle="What one training step holds in memory, how many FLOPs it does, and how much of the hardware it uses",
    overview=[
        "The training step: forward (keeps activations), backward (makes gradients), optimizer step "
        "(Adam's two moments) - measured owner by owner on the engine's tiny model",
        "Bytes per parameter: 4 + 4 + 8 = 16 in fp32, 2 + 2 + 4 + 4 + 4 = 16 in bf16 mixed precision "
        "(fp32 master weights and Adam); what our engine holds (18), and the planner's figures for Llama 3 8B",
        "Batch size in samples and in tokens",
        "Where the tokens come from: a corpus prepared once, a held-out validation loss, text from the model",
        "Counting parameters: the playbook's GPT formula checked against a real model",
        "FLOPs per token: 6N for the weights plus the attention term, measured with PyTorch's FLOP counter",
        "Throughput (tokens/s, measured) and MFU: model FLOP/s over the hardware's peak",
    ],
    sections=[
        Section("One training step, owner by owner", [
            md(r'''
Training an LLM repeats one step billions of tokens long:

1. **forward**: the batch goes through the model to a loss; every operation keeps what its backward
   will need (the **activations**);
2. **backward**: the gradient of the loss with respect to every parameter, written into `.grad`; the
   activations are freed as backward consumes them;
3. **optimizer step**: Adam updates every parameter from its gradient and its two running moments
   (the **optimizer states**).

So four owners share a GPU's memory: **parameters**, **gradients**, **optimizer states** and
**activations**. Let us watch them appear on the engine's `tiny` model (the same Llama-style decoder as
Llama 3: RMSNorm, RoPE, grouped-query attention, SwiGLU), measuring bytes on the tensors themselves.
'''),
            STEP,
            md(r'''
Parameters (4 bytes each in fp32) are there from the start. Forward adds the activations - for this tiny
model and 512 tokens, 12.7 times the parameters. Backward frees them and creates the gradients (4
bytes each). The optimizer step creates Adam's first and second moments (4 + 4 bytes). `zero_grad` with
`set_to_none=True` drops the gradients until the next backward.

The peak of a step is therefore not a simple sum: activations peak at the end of forward, gradients
during backward, and the states persist through the whole run.
'''),
        ]),
        Section("Bytes per parameter: fp32 and mixed precision", [
            md(r'''
In **fp32**, every parameter costs 4 (weight) + 4 (gradient) + 8 (Adam's two moments) = **16 bytes**.

**bf16 mixed precision** runs forward and backward in bf16 (2-byte weights, 2-byte gradients), but the
update cannot be done in bf16: a small update added to a large weight would round away. So the optimizer
keeps an **fp32 master copy** of the weights (4) next to its two fp32 moments (4 + 4):

$$2 + 2 + 4 + 4 + 4 = 16 \text{ bytes per parameter}$$

Mixed precision saves no model-state memory; it saves **activations** (2 bytes per value instead of 4,
for the values kept in bf16) and time: an H100's data sheet gives 989.5 TFLOP/s in bf16, twice its 494.7
in fp32 on TF32 tensor cores (the trainer's table, printed in the MFU section). Here is the engine's
trainer on the tiny model, in both dtypes:
'''),
            OWNERS,
            md(r'''
fp32 measures 4 + 4 + 8 = 16. In bf16 the engine measures 2 + 4 + 12 = **18**: like Megatron-LM, it adds
each bf16 gradient into an **fp32** gradient buffer (`main_grad`) and frees the bf16 one at once, so that
gradient accumulation over micro-batches and the all-reduce happen in fp32. The optimizer's 12 bytes
are the fp32 master weights (4) and the two moments (8). The playbook's 16 keeps bf16 gradients; frameworks
that also keep an fp32 accumulator beside them (nanotron, the playbook's benchmark runs) hold 20.

The activations shrink to 0.67 of fp32's, not to half: even in bf16 the norms, RoPE and the loss compute
in fp32 and keep fp32 tensors for backward (Part 2 lists them tensor by tensor).

The planner (`ultrascale plan memory`) models each recipe. For Llama 3 8B on a single GPU:
'''),
            PLANNER,
            md(r'''
About 120 GiB of model states before a single activation: an 8B model does not train on one 80 GB GPU,
whatever the precision. That is the first reason for the parallelism of this series (ZeRO, Parts 6 and 7,
shards exactly these states across GPUs).
'''),
        ]),
        Section("Batch size: samples and tokens", [
            md(r'''
The batch size of a step is counted in **samples** (sequences) or in **tokens**:
tokens = samples x sequence length. The token count is what matters for training dynamics and
what papers report: the playbook cites recent pre-training runs with batches of 4-60 million tokens.
Sequence length changes how many samples a batch of a given token count holds:
'''),
            BATCH,
            md(r'''
Part 5 splits the global batch into micro-batches, gradient-accumulation steps and data-parallel ranks.
'''),
        ]),
        Section("Where the tokens come from", [
            md(r'''
The runs above drew their batches from the engine's default corpus (Python's own source code). A real
corpus is **tokenized once** into files of token ids that training reads **memory-mapped**: a step
touches only its own windows, so a trillion-token corpus costs no more memory or start-up than a small
one (nanoGPT's `prepare.py`, Megatron's indexed datasets). A share of the text is **held out**: the loss
on it, the **validation loss**, says whether the model learned the language or memorized its batches.
Within an **epoch** every window of the corpus is seen once. Then the trained model **writes text**:
'''),
            DATA,
            md(r'''
A hundred steps of a 107K-parameter model on one CPU core learn the byte-level statistics of Python
(indentation, common letters, newlines), not programs; the validation loss falls with the training loss
because both splits are the same kind of text, never seen in training. The epoch column is small: 100
steps x 512 tokens are a few percent of this corpus. `ultrascale data prepare` takes a directory, a glob,
JSONL, parquet or a Hugging Face dataset directory, on every core; `--data` trains on any size.
'''),
        ]),
        Section("Counting parameters", [
            md(r'''
The playbook counts the parameters of a GPT-style transformer with hidden size $h$, vocabulary $v$ and
$L$ layers:

$$N = h\,v + L\,(12h^2 + 13h) + 2h$$

Per layer: attention's four $h \times h$ matrices ($4h^2$), a $4h$-wide MLP's two matrices ($8h^2$), their
biases ($4h + 5h$) and two LayerNorms ($4h$); $h\,v$ for the embedding, shared with the output head; $2h$
for the final LayerNorm. The engine can build that block (`norm="layernorm", mlp="gelu", bias=True`),
so we count a real model instead of trusting the algebra:
'''),
            GPT_COUNT,
            md(r'''
The formula is exact. With a real vocabulary the embedding is a large share of a narrow model (GPT-2 small,
the second line), but the $12h^2$ term takes over as the width grows: parameters grow with the **square**
of the width. Our Llama-style block differs in three places - grouped-query attention
(k and v are narrower than q), a three-matrix SwiGLU MLP of width $f$, RMSNorm without biases - and
Llama 3 8B does not tie its embeddings. Exercise 1 is its count.
'''),
        ]),
        Section("FLOPs per token", [
            md(r'''
A weight matrix $W$ of $m \times n$ parameters multiplies every token's input: $2mn$ FLOPs per token
(a multiply and an add per weight) in **forward**. **Backward** does two such matmuls - the gradient with
respect to the input (to continue backward) and with respect to $W$ - so $4mn$. Training costs

$$6N \text{ FLOPs per token for the weights} \; + \; 12\,L\,h\,s \text{ for attention}$$

The attention term has no weights: per token and layer, $QK^T$ costs $2sh$ (one dot product of size
$h$ with each of the $s$ keys, over all heads) and the weighted sum $AV$ another $2sh$; backward doubles
it, $4sh \cdot 3 = 12sh$. It grows with the sequence length. PyTorch's FLOP counter measures both:
'''),
            FLOPS,
            md(r'''
Both terms are exact for the operations that run. The playbook's $6N$ (and the engine's
`flops_per_token`, which reproduces the MFU column of the playbook's benchmark runs) counts **every**
parameter, embedding included, although looking up an embedding row is not a matmul; on the tiny model
that is 16% of $N$, on Llama 3 8B 6.5% (the last line above). And with a causal mask half of $QK^T$ is never needed:
FlashAttention skips it, the $12Lhs$ convention does not. Conventions differ; what matters is to say which one
a reported MFU uses.
'''),
        ]),
        Section("Throughput and MFU", [
            md(r'''
**Throughput** is tokens processed per second. **Model FLOPs utilisation** (MFU) asks how much of the
hardware that is:

$$\text{MFU} = \frac{\text{tokens/s} \times \text{FLOPs per token}}{\text{peak FLOP/s}}$$

Model FLOPs count only the FLOPs of the model itself: recomputing activations (Part 2) costs time but adds
no model FLOPs, so it lowers MFU. (Hardware FLOPs utilisation, HFU, would count them.) The peak is the data
sheet's dense figure for the dtype (the trainer's table is printed below). On this CPU we measure a peak
ourselves: the fastest large matmul this core can do.
'''),
            THROUGHPUT,
            md(r'''
A tiny model reaches only part of that peak: its matmuls are small, and norms, RoPE, softmax and the
Python around every operation take time and do no model FLOPs. Exercise 2 computes the MFU of such a
run (its check trains this model again and prints the figure), and reproduces the MFU the playbook reports
for its best 8B runs on H100s.

On a GPU the trainer reports MFU itself (it knows the data-sheet peaks):
'''),
            GPU,
        ]),
    ],
    exercises=[
        Exercise(
            title="Count the parameters of a Llama-style model",
            instructions=r'''
Write `count_params_llama(cfg)`: the number of parameters of the engine's model for a `ModelConfig`, from
its shape alone. The block is Llama's:

- attention: `q_proj` and `o_proj` are $h \times h$; `k_proj` and `v_proj` are
  $h \times (\text{kv\_heads} \cdot \text{head\_dim})$ with `head_dim = hidden // heads` (grouped-query attention);
- MLP: SwiGLU, three $h \times f$ matrices (`gate_proj`, `up_proj`, `down_proj`), `f = cfg.ffn_hidden`;
- two RMSNorms per block and one before the head, a weight of $h$ each; no biases anywhere;
- the embedding is $v \times h$; the output head is another $v \times h$ unless `cfg.tie_embeddings`.

The check compares with the real model (built on the meta device, parameters counted one by one) for
seven shapes, from `tiny` to Llama 3 8B.
''',
            starter=r'''
def count_params_llama(cfg):
    """Parameters of the engine's Llama-style model for cfg (a ModelConfig)."""
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)   # width of k_proj and v_proj
    # TODO: attention, MLP and norms of one block; embedding, head and final norm once.
    raise NotImplementedError
''',
            solution=r'''
def count_params_llama(cfg):
    """Parameters of the engine's Llama-style model for cfg (a ModelConfig)."""
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)   # width of k_proj and v_proj
    attention = 2 * h * h + 2 * h * kv              # q, o: h x h; k, v: h x kv
    mlp = 3 * h * f                                 # gate, up, down
    norms = 2 * h                                   # attn_norm, mlp_norm
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (attention + mlp + norms) + h   # + the final norm
''',
            check=r'''
from ultrascale.series.checks import part1
part1.exercise_1(count_params_llama)
''',
            hints=[
                "Go matrix by matrix through one block (`print(model)` above shows them), then add what exists "
                "once: the embedding, the final norm, and the head when it is not tied.",
                "With 8 query heads and 4 kv heads, k_proj and v_proj are half as wide as q_proj. SwiGLU has "
                "three matrices, not two. Each RMSNorm is one vector of h weights.",
                "`2*h*h + 2*h*kv + 3*h*f + 2*h` per block, times L; plus `v*h` (twice if not tied) plus `h`.",
            ],
        ),
        Exercise(
            title="FLOPs per token and MFU of a measured run",
            instructions=r'''
Write `model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops)` returning the pair
`(flops_per_token, mfu)`:

- `flops_per_token`: training FLOPs per token as the playbook counts them, $6N + 12\,L\,h\,s$, with
  $N$ **every** parameter (use `count_params(cfg)`, the engine's count, which Exercise 1 rebuilt) and
  $s$ = `seq_len`;
- `mfu`: `tokens_per_s` x `flops_per_token` / `peak_flops`, as a fraction (0.43, not 43).

The check compares the FLOPs for five shapes, the MFU of a short run of the engine's trainer (measured
on this CPU, against a given peak) with the trainer's own figure, and the MFU of the playbook's best 8B
runs on H100s (989.5 TFLOP/s) with the percentage the playbook reports.
''',
            starter=r'''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    """(training FLOPs per token, MFU as a fraction) of a run of a cfg model."""
    N = count_params(cfg)
    # TODO: 6N for the weights, plus the attention term; then MFU against peak_flops.
    raise NotImplementedError
''',
            solution=r'''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    """(training FLOPs per token, MFU as a fraction) of a run of a cfg model."""
    N = count_params(cfg)
    flops_per_token = 6 * N + 12 * cfg.layers * cfg.hidden * seq_len   # weights + attention, fwd + bwd
    return flops_per_token, tokens_per_s * flops_per_token / peak_flops
''',
            check=r'''
from ultrascale.series.checks import part1
part1.exercise_2(model_flops_and_mfu)
''',
            hints=[
                "Forward is 2 FLOPs per parameter per token; backward is twice the forward. Attention adds "
                "QK^T and AV, which have no parameters but grow with seq_len.",
                "Per token and layer, QK^T and AV cost 2·s·h FLOPs each in forward. MFU divides the model "
                "FLOP/s you achieved by the peak FLOP/s; both are per second, no unit conversion.",
                "`flops = 6 * N + 12 * cfg.layers * cfg.hidden * seq_len`; "
                "`return flops, tokens_per_s * flops / peak_flops`.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            "A 7B-parameter model is trained with Adam in bf16 mixed precision, keeping bf16 gradients and "
            "fp32 master weights. How much memory do its model states take, before any activation?",
            ["56 GB (8 bytes per parameter)", "84 GB (12 bytes per parameter)",
             "112 GB (2 + 2 + 4 + 4 + 4 = 16 bytes per parameter)", "28 GB (4 bytes per parameter)"],
            2,
            "bf16 weights and gradients (2 + 2), fp32 master weights (4) and Adam's two fp32 moments (4 + 4).",
        ),
        QuizQuestion(
            "What does bf16 mixed precision save compared with fp32 training, with Adam?",
            ["Model-state memory: 8 bytes per parameter instead of 16", "Nothing at all",
             "Activation memory and time; model states stay at 16 bytes per parameter or more",
             "Only optimizer memory"],
            2,
            "The fp32 master weights and moments remain; activations shrink (2 bytes per value computed in bf16) "
            "and bf16 matmuls run faster.",
        ),
        QuizQuestion(
            "Why is the training cost of the weights 6N FLOPs per token?",
            ["Forward 2N, backward 4N: gradients with respect to inputs and to weights",
             "Forward N, backward 5N", "Adam's update costs 4N", "Forward 3N and backward 3N"],
            0,
            "A multiply-add per weight is 2 FLOPs forward; backward does two matmuls of the same size.",
        ),
        QuizQuestion(
            "A run recomputes activations during backward and gets slower. What happens to its MFU?",
            ["It rises: more FLOPs are done per second", "It falls: model FLOPs do not count the recomputation",
             "It is unchanged", "MFU cannot be defined with recomputation"],
            1,
            "MFU counts only the model's FLOPs (6N + attention); the extra forward is hardware work (HFU), not "
            "model work.",
        ),
    ],
)
