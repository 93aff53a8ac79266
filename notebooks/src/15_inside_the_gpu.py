"""Part 15 of the series: inside the GPU.

The source of notebooks/15_inside_the_gpu.ipynb (build it with
`python notebooks/src/build.py 15`). The H100's datasheet figures are printed from
a dict and labelled as such; every other figure is measured in the notebook on this
machine: the bandwidth of an elementwise op, the FLOP/s of a matmul, a fused chain
against the unfused one, the online softmax against torch's, and the engine's
training step eager against `--compile`.
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import math
import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)  # one core: the figures below are one CPU core's
_ = torch.manual_seed(0)


def timed(fn, repeats=5):
    """Median wall time of fn() in seconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
''')

DATASHEET = code(r'''
# DATASHEET values of an NVIDIA H100 SXM5 80 GB (NVIDIA's H100 datasheet and Hopper whitepaper),
# not measurements: this notebook runs on a CPU.
H100_DATASHEET = {
    "streaming multiprocessors (SMs)": 132,
    "registers per SM (KiB)": 256,              # 65,536 32-bit registers
    "shared memory + L1 per SM (KiB)": 256,     # up to 228 KiB of it as shared memory (SRAM)
    "L2 cache (MiB)": 50,
    "HBM3 capacity (GB)": 80,
    "HBM3 bandwidth (TB/s)": 3.35,
    "dense BF16 tensor-core peak (TFLOP/s)": 989,
    "dense FP8 tensor-core peak (TFLOP/s)": 1979,
}
for name, value in H100_DATASHEET.items():
    print(f"datasheet  {name:40s} {value:>8}")
sram_mib = H100_DATASHEET["streaming multiprocessors (SMs)"] * H100_DATASHEET["shared memory + L1 per SM (KiB)"] / 1024
ridge = H100_DATASHEET["dense BF16 tensor-core peak (TFLOP/s)"] / H100_DATASHEET["HBM3 bandwidth (TB/s)"]
print(f"on-chip SRAM in all: {sram_mib:.0f} MiB, against 80 GB of HBM")
print(f"ridge point (BF16 peak / HBM bandwidth): {ridge:.0f} FLOP per byte read or written")
''')

ROOFLINE = code(r'''
# Two ops on this CPU core: an elementwise add (1 FLOP per 12 bytes moved) and a matmul.
n = 2**22
a, b = torch.randn(n), torch.randn(n)
out = torch.empty(n)
t_add = timed(lambda: torch.add(a, b, out=out))
add_bytes, add_flops = 3 * n * 4, n                     # read a and b, write out; one add per element

m = 384
A, B = torch.randn(m, m), torch.randn(m, m)
C = torch.empty(m, m)
t_mm = timed(lambda: torch.mm(A, B, out=C))
mm_bytes, mm_flops = 3 * m * m * 4, 2 * m**3            # a multiply and an add per (i, j, k)

bandwidth = add_bytes / t_add                           # what an elementwise op can stream
peak = mm_flops / t_mm                                  # this core's matmul ceiling, measured
for name, flops, nbytes, t in (("add", add_flops, add_bytes, t_add), ("matmul", mm_flops, mm_bytes, t_mm)):
    print(f"{name:6s}: intensity {flops / nbytes:6.2f} FLOP/byte, {t * 1e3:7.2f} ms, "
          f"{nbytes / t / 1e9:6.2f} GB/s, {flops / t / 1e9:7.2f} GFLOP/s")
print(f"this core's ridge point: {peak / 1e9:.1f} GFLOP/s / {bandwidth / 1e9:.1f} GB/s = "
      f"{peak / bandwidth:.1f} FLOP/byte")
print(f"the add reaches {add_flops / t_add / peak:.1%} of the matmul's FLOP/s: memory-bound")
''')

FUSION_EAGER = code(r'''
def chain(x):
    """Five elementwise ops: eager runs five kernels, each reading and writing all of x."""
    y = x * 1.5
    y = y + 0.25
    y = torch.sigmoid(y)
    y = y * x
    return y - 0.5


x = torch.randn(2**21)
t_eager = timed(lambda: chain(x), repeats=7)
moved = 5 * 2 * x.numel() * 4   # each op: read its input, write its output (the "* x" reads x too: ignored)
print(f"eager chain: {t_eager * 1e3:.2f} ms, at least {moved / 2**20:.0f} MiB moved "
      f"({moved / t_eager / 1e9:.1f} GB/s)")
''')

FUSION_COMPILED = code(r'''
start = time.perf_counter()
fused = torch.compile(chain)
fused(x)                                   # the first call traces the chain and generates one kernel
compile_s = time.perf_counter() - start
t_fused = timed(lambda: fused(x), repeats=7)
print(f"compiled chain: {t_fused * 1e3:.2f} ms, eager / compiled = {t_eager / t_fused:.1f}x; compiling took "
      f"{compile_s:.1f} s (less when Inductor's on-disk cache already holds it)")
print("same values as eager:", torch.allclose(fused(x), chain(x), atol=1e-6))
print(f"the fused kernel reads x once and writes once: {2 * x.numel() * 4 / 2**20:.0f} MiB "
      f"instead of {moved / 2**20:.0f}")
''')

ONLINE_SOFTMAX = code(r'''
def online_softmax_normaliser(scores, block):
    """The max and sum of exp of one row, read in blocks: a running max, the sum rescaled whenever it grows."""
    running_max, running_sum = float("-inf"), 0.0
    for start in range(0, scores.numel(), block):
        chunk = scores[start:start + block]
        new_max = max(running_max, chunk.max().item())
        running_sum = running_sum * math.exp(running_max - new_max) + torch.exp(chunk - new_max).sum().item()
        running_max = new_max
    return running_max, running_sum


row = torch.randn(1000, dtype=torch.float64) * 5
mx, total = online_softmax_normaliser(row, block=64)
print("softmax from the blocked normaliser == torch.softmax:",
      torch.allclose(torch.exp(row - mx) / total, torch.softmax(row, 0)))

# What tiling saves: attention's score matrix, materialised by a naive implementation.
seq, heads, batch = 4096, 32, 1
scores_gib = batch * heads * seq * seq * 2 / 2**30
tile_kib = 128 * 64 * 2 / 1024
print(f"naive attention at {seq} tokens, {heads} heads: scores {scores_gib:.1f} GiB in bf16, written to and "
      f"read back from HBM; a tiled kernel keeps one {128}x{64} tile ({tile_kib:.0f} KiB) in SRAM at a time")
''')

ENGINE_COMPILE = code(r'''
# The engine's block under torch.compile (ultrascale train --compile): tiny model, one process.
from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.distributed.context import build_context
from ultrascale.model import get_preset
from ultrascale.train.trainer import Trainer


def trainer(compile_blocks):
    t = TrainConfig(steps=100, seq_len=64, micro_batch=4, seed=0, progress=False, measure_activations=False,
                    compile=compile_blocks)
    run = validate(RunConfig(model=get_preset("tiny"), parallel=ParallelConfig(), train=t), 1)
    return Trainer(run, build_context(run.parallel, 0, 1))


eager, compiled = trainer(False), trainer(True)
start = time.perf_counter()
first = compiled.train_step()          # traces and compiles the block's forward and backward
compile_s = time.perf_counter() - start
eager_first = eager.train_step()
print(f"step 1 losses: eager {eager_first['loss']:.6f}, compiled {first['loss']:.6f}; "
      f"the compiling step took {compile_s:.1f} s")
eager_t, compiled_t = [], []
for _ in range(5):                     # take turns, so both see the same machine load
    eager_t.append(eager.train_step()["step_time_s"])
    compiled_t.append(compiled.train_step()["step_time_s"])
e, c = statistics.median(eager_t), statistics.median(compiled_t)
print(f"median step time: eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms (eager / compiled = {e / c:.2f}x)")
''')

GPU_CELL = code(r'''
# On a GPU: SDPA picks the FlashAttention kernel (tiles in SRAM, no score matrix in HBM),
# and CUDA graphs replay a whole captured step with one launch.
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = torch.device("cuda")
q, k, v = (torch.randn(1, 16, 4096, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))


def gpu_time(fn, repeats=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1e3


outputs = {}
for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
    with sdpa_kernel(backend):
        torch.cuda.reset_peak_memory_stats()
        t = gpu_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        print(f"{backend.name:16s}: {t * 1e3:.3f} ms, peak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
        outputs[backend] = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
difference = (outputs[SDPBackend.FLASH_ATTENTION] - outputs[SDPBackend.MATH]).abs().max().item()
largest = outputs[SDPBackend.MATH].abs().max().item()
print(f"flash against math: max |difference| {difference:.1e}, on outputs of up to {largest:.2f} in bf16")

# Many small kernels: launch overhead dominates; a CUDA graph replays them all at once.
small = torch.randn(256, device=dev)
side = torch.cuda.Stream()                 # warm up on a side stream before capturing, as CUDA graphs require
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        chain(small)
torch.cuda.current_stream().wait_stream(side)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    static_out = chain(small)
launched = gpu_time(lambda: chain(small))
print(f"chain of 5 tiny kernels: eager {launched * 1e6:.1f} us ({launched / 5 * 1e6:.1f} us a kernel), "
      f"CUDA graph replay {gpu_time(g.replay) * 1e6:.1f} us")
''', needs_gpu=True)


EPISODE = Episode(
    number=15,
    title="Inside the GPU",
    slug="inside_the_gpu",
    subtitle="Memory hierarchy, the roofline, kernel fusion, FlashAttention's tiling and torch.compile",
    overview=[
        "The memory hierarchy of a GPU: registers, SRAM (shared memory), L2 and HBM, from an H100 datasheet",
        "Arithmetic intensity and the roofline: an elementwise op and a matmul measured on this CPU",
        "Kernel fusion: a chain of elementwise ops, eager against torch.compile, measured",
        "FlashAttention: tiles of keys in SRAM and the online softmax (running max and sum)",
        "torch.compile on the engine's transformer block (`--compile`), eager against compiled step time",
        "What a GPU adds: SDPA's flash kernel and CUDA graphs (a GPU-only cell)",
    ],
    references=[
        Reference(1, "FLOPs per token and MFU against a peak"),
        Reference(2, "activation memory and recomputation"),
        Reference(10, "the log-sum-exp merge of attention blocks across GPUs"),
    ],
    sections=[
        Section("The memory hierarchy", [
            md(r'''
A GPU is a few big, slow memories and many small, fast ones. **HBM** (high-bandwidth memory, the "80 GB"
of an H100) holds the weights, gradients, optimizer states and activations; every kernel starts by
reading its inputs from it and ends by writing its outputs to it. On the chip, each **streaming
multiprocessor (SM)** has its **registers** (per thread) and **shared memory / L1** (SRAM, per block of
threads, managed by the kernel); an **L2** cache sits between the SMs and HBM. The fast memories are tiny:
the whole chip's SRAM is a few tens of MiB. The figures below are from the datasheet (this notebook runs
on a CPU):
'''),
            SETUP,
            DATASHEET,
            md(r'''
The **ridge point** is the number of FLOPs a kernel must do per byte it moves for the tensor cores,
rather than HBM, to be the limit. Anything below it waits on memory.
'''),
        ]),
        Section("Arithmetic intensity and the roofline", [
            md(r'''
**Arithmetic intensity** = FLOPs / bytes moved between the kernel and main memory. A kernel can go no faster
than $\min(\text{peak FLOP/s},\ \text{intensity} \times \text{bandwidth})$: the **roofline**. An
elementwise add does 1 FLOP per 12 bytes (two fp32 reads, one write), whatever the size: it is
memory-bound everywhere. A square matmul of side $m$ does $2m^3$ FLOPs on $3m^2$ elements: its intensity
grows with $m$ and crosses the ridge. The same holds on a CPU, whose caches play the role of SRAM; measured
on one core here (the matmul's FLOP/s is this core's practical ceiling):
'''),
            ROOFLINE,
            md(r'''
This is why the layers of a transformer divide into two kinds: the matmuls (projections, MLP), which
can approach peak, and everything else (norms, activations, residual adds, softmax, dropout, casts),
which cannot and is limited by bytes, not FLOPs. MFU (Part 1) counts only the matmuls' FLOPs; the time
of the elementwise ops is pure loss against it.
'''),
        ]),
        Section("Fusion: one kernel instead of five", [
            md(r'''
Eager PyTorch runs one kernel per op: `sigmoid(x * 1.5 + 0.25) * x - 0.5` reads and writes the whole tensor
at every step (and allocates a fresh output for each). A **fused** kernel reads `x` once, keeps the intermediates in registers, and writes
the result once: same FLOPs, a fraction of the bytes. `torch.compile` traces the Python into a graph and
its backend (Inductor) generates fused kernels (Triton on a GPU, C++/OpenMP on a CPU).
'''),
            FUSION_EAGER,
            FUSION_COMPILED,
        ]),
        Section("FlashAttention: tiling and the online softmax", [
            md(r'''
Naive attention writes the scores $S = QK^\top$ ($s \times s$ per head) to HBM, reads them back for the
softmax, writes $P$, reads it back for $PV$: memory-bound and quadratic in memory. **FlashAttention** loads
a block of queries into SRAM, streams the keys and values through in blocks, and never writes $S$ or $P$
to HBM. The difficulty is the softmax, which needs the max and the sum of a whole row before any output.
The **online softmax** computes them in one pass over blocks: keep a running max $m$ and a running sum
$\ell$; when a block raises the max to $m'$, multiply what was summed so far by $e^{m - m'}$:
'''),
            ONLINE_SOFTMAX,
            md(r'''
FlashAttention carries the output's accumulator the same way (the exercise below), so the kernel's memory
is linear in $s$ and its intensity high: it is compute-bound where naive attention was memory-bound.
The backward recomputes $S$ and $P$ tile by tile from $Q$, $K$, $V$ and the saved row statistics
rather than storing them: recomputation (Part 2) that is *faster* than reading, because HBM, not
compute, was the limit. Part 10 uses the same merge across GPUs.
'''),
        ]),
        Section("torch.compile on the engine's block", [
            md(r'''
`ultrascale train --compile` compiles each transformer block's forward (regional compilation, as
torchtitan does; `parallel/compile.py`): all blocks share one shape, so one compiled graph serves them
all, and AOTAutograd compiles the matching backward. The first step pays the compilation; every later
step runs the fused kernels. Eager and compiled on the tiny model, measured here:
'''),
            ENGINE_COMPILE,
            md(r'''
On a CPU and a model this small the gain is small, often within the noise of a shared machine: the
step is dominated by the matmuls, the optimizer and Python overhead, none of which the compiled
block changes (`docs/benchmarks.md` measures about 1.1x on the `small` model). On a GPU the fused norms,
activations and residual adds save HBM traffic and kernel launches, which is where compilation pays.
Compilation is paid once per run, in the first step (above: with Inductor's on-disk cache empty it takes
longer, 7 s for this block in `docs/benchmarks.md`, and minutes for a large model).
'''),
        ]),
        Section("On a GPU", [
            md(r'''
Two things only a GPU shows. `F.scaled_dot_product_attention` dispatches to the FlashAttention kernel
(bf16/fp16 on Ampere and later): the math backend's result up to rounding (the cell prints the largest
difference), no $s \times s$ matrix in memory. And **CUDA graphs** record a sequence of kernel launches
once and replay it with one call, removing the CPU's launch overhead (a few microseconds per kernel,
timed below) that dominates when kernels are small;
`torch.compile(mode="reduce-overhead")` uses them. The cell below runs only where CUDA is available:
'''),
            GPU_CELL,
        ]),
    ],
    exercises=[
        Exercise(
            title="FlashAttention's forward for one query block",
            instructions=r'''
Write `flash_attention_forward(q, k, v, block)`: softmax attention (no mask, scale $1/\sqrt{d}$) of one
block of queries `q` `[m, d]` over keys and values `k`, `v` `[n, d]`, reading the keys and values in
blocks of `block` rows, as a FlashAttention kernel streams them through SRAM. Never form the full
`[m, n]` score matrix. Keep, per query row, a running max `m_i`, a running sum `l_i` of
`exp(score - m_i)`, and an output accumulator `acc` `[m, d]`. Return the `[m, d]` output; the check
compares it with `F.scaled_dot_product_attention`.
''',
            starter=r'''
def flash_attention_forward(q, k, v, block):
    """Attention of q [m, d] over k, v [n, d], keys read `block` at a time with an online softmax."""
    scale = q.shape[-1] ** -0.5
    row_max = torch.full((q.shape[0], 1), float("-inf"))
    row_sum = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        k_blk, v_blk = k[start:start + block], v[start:start + block]
        # TODO: scores of this block, the new running max, rescale row_sum and acc, add this block
        raise NotImplementedError
    return acc
''',
            solution=r'''
def flash_attention_forward(q, k, v, block):
    """Attention of q [m, d] over k, v [n, d], keys read `block` at a time with an online softmax."""
    scale = q.shape[-1] ** -0.5
    row_max = torch.full((q.shape[0], 1), float("-inf"))
    row_sum = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        k_blk, v_blk = k[start:start + block], v[start:start + block]
        s = (q @ k_blk.T) * scale
        new_max = torch.maximum(row_max, s.max(dim=-1, keepdim=True).values)
        correction = torch.exp(row_max - new_max)
        p = torch.exp(s - new_max)
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
''',
            check=r'''
from ultrascale.series.checks import part15
part15.exercise_1(flash_attention_forward)
''',
            hints=[
                "For each block: `s = (q @ k_blk.T) * scale`, then the new max is the larger of `row_max` and "
                "this block's row max.",
                "Everything accumulated so far was computed with the old max: multiply both `row_sum` and `acc` "
                "by `exp(row_max - new_max)` before adding `exp(s - new_max)` and `exp(s - new_max) @ v_blk`.",
                "Divide once, at the very end: `return acc / row_sum`.",
            ],
        ),
        Exercise(
            title="Arithmetic intensity and the ridge point",
            instructions=r'''
Write `roofline(kind, shape, dtype, peak_flops, bandwidth)` returning `(intensity, bound)`:
`intensity` is FLOPs per byte moved to and from memory, `bound` is `"memory"` or `"compute"` on a
device with the given peak (FLOP/s) and memory bandwidth (bytes/s). Count each tensor read or written
once, in `dtype` (a `torch.dtype`: `x.element_size()` or `torch.finfo(dtype).bits // 8`).
- `kind == "matmul"`, `shape == (m, k, n)`: `[m, k] @ [k, n]`; a multiply and an add per term.
- `kind == "elementwise"`, `shape == (numel,)`: `c = a + b`, one FLOP per element.

An op whose intensity is below the ridge point (peak / bandwidth) is memory-bound.
''',
            starter=r'''
def roofline(kind, shape, dtype, peak_flops, bandwidth):
    """(FLOPs per byte, "memory" or "compute") of a matmul (m, k, n) or an elementwise add (numel,)."""
    nbytes = torch.finfo(dtype).bits // 8
    # TODO: FLOPs and bytes moved for each kind, then compare with the ridge point
    raise NotImplementedError
''',
            solution=r'''
def roofline(kind, shape, dtype, peak_flops, bandwidth):
    """(FLOPs per byte, "memory" or "compute") of a matmul (m, k, n) or an elementwise add (numel,)."""
    nbytes = torch.finfo(dtype).bits // 8
    if kind == "matmul":
        m, k, n = shape
        flops = 2 * m * k * n
        moved = (m * k + k * n + m * n) * nbytes
    else:
        (numel,) = shape
        flops = numel
        moved = 3 * numel * nbytes
    intensity = flops / moved
    return intensity, "compute" if intensity >= peak_flops / bandwidth else "memory"
''',
            check=r'''
from ultrascale.series.checks import part15
part15.exercise_2(roofline)
''',
            hints=[
                "A matmul `[m, k] @ [k, n]` has m·n outputs, each a sum of k products: a multiply and an add "
                "for each.",
                "Bytes: the matmul reads both inputs and writes its output, (mk + kn + mn) elements; the add "
                "reads two tensors and writes one. Multiply by the dtype's bytes.",
                "Ridge point = peak_flops / bandwidth; intensity at or above it is compute-bound.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            question="An H100 has ~989 TFLOP/s of dense BF16 and 3.35 TB/s of HBM. Which is memory-bound?",
            options=["A bf16 matmul [8192, 8192] @ [8192, 8192]",
                     "A bf16 RMSNorm over a [4096, 4096] activation",
                     "Both", "Neither"],
            answer=1,
            why="A norm does a few FLOPs per element moved, far below the ~295 FLOP/byte ridge; the big matmul "
                "does ~2700.",
        ),
        QuizQuestion(
            question="What does FlashAttention avoid writing to HBM?",
            options=["Q, K and V", "The output", "The softmax's row max", "The s × s scores and probabilities"],
            answer=3,
            why="It keeps each tile of scores in SRAM; only the output and per-row statistics go to HBM.",
        ),
        QuizQuestion(
            question="In the online softmax, a new block raises a row's max from m to m'. What must happen "
                     "to the running sum and the output accumulator?",
            options=["Nothing: the final division fixes it", "Divide both by the block's sum",
                     "Multiply both by exp(m - m')", "Reset both to zero"],
            answer=2,
            why="Everything accumulated was exp(score - m); it must become exp(score - m') before the new terms "
                "are added.",
        ),
        QuizQuestion(
            question="Why does torch.compile speed up a chain of elementwise ops?",
            options=["It lowers their precision",
                     "It fuses them into one kernel that reads and writes memory once",
                     "It runs them on the tensor cores",
                     "It skips the ops whose results are unused in backward"],
            answer=1,
            why="The chain is memory-bound; fusion keeps the intermediates in registers and cuts the bytes moved.",
        ),
    ],
)
