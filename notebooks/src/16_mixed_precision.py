"""Part 16 of the series: mixed precision.

The source of notebooks/16_mixed_precision.ipynb (build it with
`python notebooks/src/build.py 16`). Every figure is measured in the notebook: the
formats' range and resolution from torch.finfo, fp16's underflow on real gradients,
and the engine's runs in fp32, bf16 (fp32 master weights), fp16 (dynamic loss scale,
read back from its JSONL metrics) and FP8 (torchao, emulated on the CPU).
"""

from ultrascale.series.episode import Episode, Exercise, QuizQuestion, Reference, Section, code, md


SETUP = code(r'''
import json
import math
import os
import tempfile

import torch

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import build_model, count_params, cross_entropy_loss, get_preset
from ultrascale.testing.compare import train_single

torch.set_num_threads(1)
MODEL = get_preset("tiny")
N_PARAMS = count_params(MODEL)
print(f"model: {MODEL.name}, {N_PARAMS:,} parameters")


def train(steps=4, **options):
    """The engine's training loop in this process (what `ultrascale train` runs); its per-step metrics."""
    t = TrainConfig(steps=steps, seq_len=64, micro_batch=4, seed=0, progress=False, **options)
    return train_single(RunConfig(model=MODEL, parallel=ParallelConfig(), train=t)).metrics
''')

FORMATS = code(r'''
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp8 e4m3": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2}
print(f"{'format':9s} {'bits':>4s} {'exp':>3s} {'mant':>4s} {'largest':>10s} {'smallest normal':>16s} "
      f"{'smallest subnormal':>19s} {'eps (1 -> next)':>16s}")
for name, dtype in FORMATS.items():
    fi = torch.finfo(dtype)
    mantissa = round(-math.log2(fi.eps))        # eps = 2^-mantissa bits
    exponent = fi.bits - 1 - mantissa           # the rest, after the sign bit
    print(f"{name:9s} {fi.bits:4d} {exponent:3d} {mantissa:4d} {fi.max:10.3g} {fi.smallest_normal:16.3g} "
          f"{fi.smallest_normal * fi.eps:19.3g} {fi.eps:16.3g}")
''')

ROUNDING = code(r'''
for name, dtype in FORMATS.items():
    x = torch.tensor([1.0 + 1e-3, 70000.0, 1e-6, 3e-8])
    y = x.to(dtype).float()
    print(f"{name:9s}: 1.001 -> {y[0].item():.6f}   70000 -> {y[1].item():<8g}   1e-6 -> {y[2].item():<10.4g} "
          f"3e-8 -> {y[3].item():.3g}")
''')

UNDERFLOW = code(r'''
# Real gradients of the tiny model, fp32 against fp16 backward. Under gradient accumulation each
# micro-batch's loss is divided by the number of micro-batches (Part 3): here 4096, as for a
# micro-batch of one sequence in a 4096-sequence global batch.
g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, MODEL.vocab_size, (4, 65), generator=g)
inputs, targets, positions = tokens[:, :-1], tokens[:, 1:], torch.arange(64)


def gradients(dtype, loss_scale=1.0, share=1 / 4096):
    model = build_model(MODEL, seed=0).to(dtype)
    loss = cross_entropy_loss(model(inputs, positions), targets) * share
    (loss * loss_scale).backward()
    return torch.cat([p.grad.float().flatten() / loss_scale for p in model.parameters()])


reference = gradients(torch.float32)
nonzero = reference != 0
print(f"fp32 gradients: median |g| {reference[nonzero].abs().median().item():.1e}; below fp16's smallest "
      f"normal {(reference[nonzero].abs() < torch.finfo(torch.float16).smallest_normal).float().mean().item():.0%}, "
      f"below its smallest subnormal {(reference[nonzero].abs() < 2**-24).float().mean().item():.0%}")
for scale in (1.0, 2.0**10, 2.0**16):
    got = gradients(torch.float16, loss_scale=scale)
    flushed = ((got == 0) & nonzero).float().sum() / nonzero.sum()
    error = (got - reference).norm() / reference.norm()
    print(f"fp16 backward, loss scale {scale:>7g}: {flushed.item():6.1%} of the gradients flushed to zero, "
          f"relative error {error.item():.1e}")
''')

BF16_RUN = code(r'''
fp32_run, bf16_run = train(), train(dtype="bf16")
print("fp32 losses:", " ".join(f"{m['loss']:.5f}" for m in fp32_run))
print("bf16 losses:", " ".join(f"{m['loss']:.5f}" for m in bf16_run),
      f"(largest relative difference {max(abs(a['loss'] - b['loss']) / b['loss'] for a, b in zip(bf16_run, fp32_run)):.1e})")
for name, run in (("fp32", fp32_run), ("bf16", bf16_run)):
    mem = run[-1]["memory"]
    per = {owner: mem[owner] / N_PARAMS for owner in ("params", "grads", "optim")}
    print(f"{name}: bytes per parameter: model weights {per['params']:.0f} + gradients {per['grads']:.0f} + "
          f"optimizer (Adam's moments and the fp32 masters) {per['optim']:.0f} = {sum(per.values()):.0f}; "
          f"activations {mem['activations'] / 2**20:.2f} MiB")
''')

FP16_RUN = code(r'''
# fp16 with the engine's dynamic loss scaler. The first scale is set too high on purpose (2^20) so that
# the backward overflows; the scale doubles after 2 good steps in a row (--loss-scale-window 2).
log = os.path.join(tempfile.mkdtemp(), "fp16.jsonl")
train(steps=8, dtype="fp16", loss_scale_init=2.0**20, loss_scale_window=2, log_jsonl=log)
with open(log) as f:
    for line in f:
        m = json.loads(line)
        norm = "-" if m["grad_norm"] is None else f"{m['grad_norm']:.3f}"
        print(f"step {m['step']}: loss scale 2^{int(math.log2(m['loss_scale'])):<2d}  skipped {str(m['skipped']):5s}  "
              f"grad norm {norm:>6s}  loss {m['loss']:.4f}")
''')

FP8_RUN = code(r'''
# What e4m3 covers below its largest value: full resolution down to the smallest normal, then subnormals.
e4m3 = torch.finfo(torch.float8_e4m3fn)
print(f"e4m3: largest {e4m3.max:g}; smallest normal {e4m3.smallest_normal:g}, 2^{math.log2(e4m3.max / e4m3.smallest_normal):.1f} "
      f"below it; smallest subnormal {e4m3.smallest_normal * e4m3.eps:g}, "
      f"2^{math.log2(e4m3.max / (e4m3.smallest_normal * e4m3.eps)):.1f} below it")

# FP8 (torchao float8 training; on the CPU its casts and scales are emulated, the matmul runs in high precision).
import logging

for noisy in ("torchao", "torch.utils._pytree"):   # torchao's notes about GPU kernels a CPU cannot load
    logging.getLogger(noisy).setLevel(logging.ERROR)
try:
    import torchao  # noqa: F401 - the engine's --fp8 needs it: pip install 'ultrascale[fp8]'
except ImportError:
    print("torchao is not installed: the FP8 runs are skipped")
else:
    def median_step_ms(run):
        times = sorted(m["step_time_s"] for m in run[1:])   # step 1 builds the caches: left out
        return times[len(times) // 2] * 1e3

    runs = {"fp32": fp32_run, "bf16": bf16_run, "fp32 + FP8": train(fp8=True), "bf16 + FP8": train(dtype="bf16", fp8=True)}
    for name, run in runs.items():
        mem = run[-1]["memory"]
        losses = " ".join(f"{m['loss']:.5f}" for m in run)
        line = (f"{name:10s}: losses {losses}, "
                f"params+grads+optim {(mem['params'] + mem['grads'] + mem['optim']) / 2**20:.2f} MiB, "
                f"activations {mem['activations'] / 2**20:.2f} MiB, median step {median_step_ms(run):.0f} ms")
        if "FP8" in name:
            base = fp32_run if name.startswith("fp32") else bf16_run
            diff = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(run, base))
            line += f"; loss vs {name.split()[0]} without FP8: {diff:.1e}"
        print(line)
''')


EPISODE = Episode(
    number=16,
    title="Mixed Precision",
    slug="mixed_precision",
    subtitle="fp32, bf16, fp16 and fp8: master weights, loss scaling and per-tensor scaling",
    overview=[
        "Number formats: sign, exponent and mantissa bits of fp32, bf16, fp16 and FP8 (e4m3, e5m2); range "
        "and resolution from torch.finfo",
        "What fp16 loses: small gradients flush to zero; loss scaling moves them back into range, measured",
        "bf16 with fp32 master weights in the engine: the loss against fp32 and the bytes per parameter",
        "fp16 with a dynamic loss scaler: an overflow, a skipped step and the scale backing off, from the "
        "engine's JSONL metrics",
        "FP8 with per-tensor scaling (torchao, emulated on the CPU): losses, memory and speed as the engine "
        "measures them",
    ],
    references=[
        Reference(1, "bytes per parameter and MFU against a peak"),
        Reference(3, "gradient accumulation divides each micro-batch's loss"),
        Reference(6, "ZeRO shards the fp32 master weights with the optimizer state"),
        Reference(15, "the roofline: fewer bytes per element is more FLOP per byte"),
    ],
    sections=[
        Section("Number formats", [
            md(r'''
A floating-point number is a sign, an **exponent** (the range: how large and how small) and a
**mantissa** (the resolution: how many distinct values between two powers of two). Training in 16 or 8
bits halves or quarters the bytes of weights, activations and communication, and an H100's tensor cores run
bf16/fp16 at 2x and FP8 at 4x the FLOP/s of TF32, and more than 10x plain fp32's (NVIDIA's H100 SXM
datasheet, dense: 495 TFLOP/s in TF32, 989 in bf16/fp16, 1979 in FP8, 67 in fp32 without tensor cores).
What is given up, format by format, from `torch.finfo`:
'''),
            SETUP,
            FORMATS,
            md(r'''
**bf16** keeps fp32's 8 exponent bits (the same range) with 7 mantissa bits: coarse, but nothing
overflows or underflows that did not in fp32. **fp16** has 10 mantissa bits but 5 exponent bits: the
largest value is 65504, the smallest (subnormal) one is $2^{-24} \approx 6 \cdot 10^{-8}$, and values below
half of it, $2^{-25} \approx 3 \cdot 10^{-8}$, become 0 (3e-8 above rounds up to the smallest, 5.96e-8). The FP8 formats split 7 bits:
**e4m3** (more resolution, max 448: weights and activations) and **e5m2** (more range: gradients).
'''),
            ROUNDING,
        ]),
        Section("fp16 underflow and loss scaling", [
            md(r'''
Gradients are small, and smaller in a bigger model, a longer sequence, a deeper accumulation. In fp16
the ones below the smallest normal ($6.1 \cdot 10^{-5}$) lose precision as subnormals, those below the
smallest subnormal $2^{-24} \approx 6 \cdot 10^{-8}$ keep nothing of their value, and those below half of
it ($2^{-25}$) are **rounded to zero**: those weights stop learning. **Loss
scaling** multiplies the loss by $S$ before backward, so every gradient is computed $S$ times larger,
inside fp16's range, and divides the (fp32) gradients by $S$ before the optimizer: the update is
unchanged, the underflow gone. Measured on the tiny model's real gradients:
'''),
            UNDERFLOW,
        ]),
        Section("bf16 with fp32 master weights", [
            md(r'''
The standard recipe (`--dtype bf16`): the model's weights and its forward and backward in bf16; the
gradients accumulated in fp32 (`main_grad`); the optimizer updates an **fp32 master copy** and copies it
back to the bf16 weights after each step. Without the masters, an update smaller than the weight's
resolution ($2^{-8}$ relative in bf16) would round away: a weight of 1.0 cannot move by $10^{-4}$. The
cost, per parameter: 2 (bf16 weights) + 4 (fp32 gradients) + 4 (masters) + 8 (Adam's two moments) =
18 bytes; the playbook's 16 keeps the gradients in bf16 (2 + 2 + 4 + 4 + 4), and some frameworks add an
fp32 copy of them, 20. The engine's runs, 4 steps, and its memory per owner:
'''),
            BF16_RUN,
            md(r'''
Mixed precision does not save weight memory; it *adds* the masters. What it saves is activations
(bf16) and time: the matmuls at the 16-bit tensor-core rate, half the bytes through HBM and over the
network. ZeRO (Part 6) then shards the masters with the moments: $k = 12$ bytes per parameter.
'''),
        ]),
        Section("fp16 and the dynamic loss scale", [
            md(r'''
The right scale is not known in advance: too small and gradients underflow, too large and they
overflow to inf. A **dynamic loss scaler** starts large ($2^{16}$), checks the gradients after each
backward, and on an inf or a NaN **skips the step** (no update: the gradients are garbage) and halves
the scale; after a window of good steps in a row (2000 by default) it doubles the scale to try a larger
one again. On several ranks the "found inf" flag is all-reduced so that every rank skips together.
The engine, started at a scale of $2^{20}$, read back from its JSONL metrics:
'''),
            FP16_RUN,
            md(r'''
bf16 needs none of this: its range is fp32's. That is why bf16 became the default on hardware that has
it (A100 and later), and fp16 with loss scaling is the recipe of V100-era training.
'''),
        ]),
        Section("FP8: per-tensor scaling", [
            md(r'''
FP8 has so little range (e4m3: $2^{-9}$ to 448) that no single scale suits every tensor. **Per-tensor
dynamic scaling** gives each tensor its own: at every call, $\text{scale} = \text{fp8 max} /
\max|x|$, the tensor is multiplied by it and cast, and the matmul's result is divided by the product of
the two scales. The largest element lands at the top of the format, and the resolution is relative,
so every other element keeps about 3 mantissa bits, as long as it is within about $2^{15}$ of the largest
(below that it falls into the subnormals, then to zero). `--fp8` converts the blocks' linear layers with
torchao (e4m3 for weights and activations, e5m2 for gradients); the embedding, norms and output head
stay in the compute dtype. On a CPU the casts are emulated, so the numbers are FP8's and the speed is not
(nor is bf16's: this CPU core has no bf16 matrix units):
'''),
            FP8_RUN,
            md(r'''
FP8 changes no memory owner here: torchao keeps the weights in the recipe's dtype and casts them at each
call, and the CPU emulation saves the high-precision inputs for backward. On an H100 the FP8 matmuls run
at twice the bf16 rate (datasheet: 1979 against 989 TFLOP/s dense) and the saved casts take 1 byte per
element; the extra amax reductions and casts are memory-bound work (Part 15) that fusion hides. DeepSeek-V3
goes further, with one scale per 1×128 tile of activations and 128×128 block of weights, because a
single outlier in a per-tensor amax crushes every other element's resolution.
'''),
        ]),
    ],
    exercises=[
        Exercise(
            title="A dynamic loss scaler",
            instructions=r'''
Write `scaler_step(scaled_grads, state, window)`: what happens between fp16 backward and the optimizer.
`scaled_grads` is a list of fp16 gradients computed from `loss * state["scale"]`; `state` is a dict
`{"scale": float, "good_steps": int}`, updated in place. Return the **fp32** unscaled gradients
when the step should be taken, or `None` when it must be skipped:
- if any gradient holds an inf or a NaN: skip, halve the scale, reset the count of good steps;
- otherwise: count a good step; after `window` good steps in a row double the scale (and restart the count).

The check runs a scripted sequence of steps, some overflowing, against its own scaler.
''',
            starter=r'''
def scaler_step(scaled_grads, state, window):
    """Unscaled fp32 gradients, or None to skip the step; updates state["scale"], state["good_steps"]."""
    # TODO: detect inf/NaN; on overflow back off and skip; otherwise unscale in fp32, count, maybe grow
    raise NotImplementedError
''',
            solution=r'''
def scaler_step(scaled_grads, state, window):
    """Unscaled fp32 gradients, or None to skip the step; updates state["scale"], state["good_steps"]."""
    if not all(torch.isfinite(g).all() for g in scaled_grads):
        state["scale"] /= 2
        state["good_steps"] = 0
        return None
    grads = [g.float() / state["scale"] for g in scaled_grads]
    state["good_steps"] += 1
    if state["good_steps"] == window:
        state["scale"] *= 2
        state["good_steps"] = 0
    return grads
''',
            check=r'''
from ultrascale.series.checks import part16
part16.exercise_1(scaler_step)
''',
            hints=[
                "`torch.isfinite(g).all()` is False for a tensor holding inf or NaN (`torch.isinf` misses NaN).",
                "Unscale after casting: `g.float() / state['scale']`; dividing in fp16 would underflow the "
                "small gradients again.",
                "On overflow: `state['scale'] /= 2; state['good_steps'] = 0; return None`. Otherwise count, and "
                "when the count reaches `window`, double the scale and set the count back to 0.",
            ],
        ),
        Exercise(
            title="Per-tensor FP8 quantisation",
            instructions=r'''
Write `quantize_e4m3(x)` returning `(q, scale)`: `q` the tensor in `torch.float8_e4m3fn` and `scale` a
float32 scalar tensor, with per-tensor dynamic scaling: the element of largest magnitude maps to the
format's largest value (`torch.finfo(torch.float8_e4m3fn).max`, 448). And `dequantize(q, scale)`
returning the float32 tensor it stands for.

The check measures what the scaling does, on tensors whose values are far from 1 (activations of 1e3,
gradients of 1e-6, weights of 0.02) and on a tensor of zeros:
- **one scale** for the whole tensor, finite and not 0 (a tensor of zeros has amax 0);
- **the range is used**: the largest |x| lands at most at 448 (beyond, it saturates) and at least at 224
  (within a factor 2 of 448, so that a power-of-two scale, exact to apply and undo, also passes);
- **the round trip**: `dequantize(quantize_e4m3(x))` is `x` to within half a spacing of e4m3 (3 mantissa
  bits: `torch.finfo(torch.float8_e4m3fn).eps / 2` relative).

Either convention passes, as long as `dequantize` undoes what `quantize_e4m3` did with the same scale:
multiply by `448 / amax` and divide it back, or divide by `amax / 448` (what one unit of `q` is worth)
and multiply it back.
''',
            starter=r'''
def quantize_e4m3(x):
    """(float8_e4m3fn tensor, float32 scale) with x ~= dequantize(q, scale)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    # TODO: a scale from the tensor's amax, then scale and cast
    raise NotImplementedError


def dequantize(q, scale):
    # TODO: back to float32
    raise NotImplementedError
''',
            solution=r'''
def quantize_e4m3(x):
    """(float8_e4m3fn tensor, float32 scale) with x ~= dequantize(q, scale)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    amax = x.abs().max().float().clamp(min=1e-12)
    scale = fp8_max / amax
    q = (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q, scale):
    return q.float() / scale
''',
            check=r'''
from ultrascale.series.checks import part16
part16.exercise_2(quantize_e4m3, dequantize)
''',
            hints=[
                "The scale maps amax to 448: `scale = fp8_max / x.abs().max()`, with amax clamped away from 0 "
                "(`.clamp(min=1e-12)`).",
                "Quantise `x * scale` (clamped to ±448 against rounding), cast with `.to(torch.float8_e4m3fn)`; "
                "dequantise by dividing by the same scale.",
                "Without a scale, 1e-6 is below e4m3's smallest subnormal (2^-9): every element becomes 0.",
            ],
        ),
    ],
    quiz=[
        QuizQuestion(
            question="Why does bf16 training usually need no loss scaling while fp16 does?",
            options=["bf16 has more mantissa bits than fp16",
                     "bf16 has fp32's 8 exponent bits, so its range is fp32's",
                     "bf16 gradients are kept in fp32",
                     "bf16 matmuls accumulate in fp64"],
            answer=1,
            why="Underflow is a matter of range (exponent bits); fp16 has only 5, bf16 has 8 and 3 fewer "
                "mantissa bits than fp16.",
        ),
        QuizQuestion(
            question="A dynamic loss scaler finds an inf in the gradients. What does it do?",
            options=["Skips the optimizer step and halves the scale",
                     "Clips the gradients and steps",
                     "Replaces the inf with zero and steps",
                     "Doubles the scale"],
            answer=0,
            why="The gradients of that step are unusable; a smaller scale avoids the overflow next time.",
        ),
        QuizQuestion(
            question="With Adam and bf16 mixed precision (fp32 gradients, as in this engine), how many bytes "
                     "per parameter do weights, gradients, masters and moments take?",
            options=["16", "12", "8", "18 (2 + 4 + 4 + 8)"],
            answer=3,
            why="bf16 weights 2, fp32 gradients 4, fp32 masters 4, two fp32 moments 8; with bf16 gradients it "
                "is the playbook's 16.",
        ),
        QuizQuestion(
            question="Why does per-tensor FP8 scaling divide the format's max by the tensor's amax?",
            options=["To make every element equal to 448",
                     "To convert FP8 to bf16",
                     "So the largest element uses the top of FP8's range and small ones do not underflow",
                     "To normalise the tensor's mean to zero"],
            answer=2,
            why="FP8's range is tiny; the scale moves the tensor's values where the format has them.",
        ),
    ],
)
