"""Cases for Part 16: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

from printed import Close

MISTAKES = [
    ("1", "not unscaled", "still multiplied by the loss scale", '''
def scaler_step(scaled_grads, state, window):
    if not all(torch.isfinite(g).all() for g in scaled_grads):
        state["scale"] /= 2
        state["good_steps"] = 0
        return None
    state["good_steps"] += 1
    if state["good_steps"] == window:
        state["scale"] *= 2
        state["good_steps"] = 0
    return [g.float() for g in scaled_grads]
'''),
    ("1", "isinf misses NaN", "torch.isinf misses NaN", '''
def scaler_step(scaled_grads, state, window):
    if any(torch.isinf(g).any() for g in scaled_grads):
        state["scale"] /= 2
        state["good_steps"] = 0
        return None
    grads = [g.float() / state["scale"] for g in scaled_grads]
    state["good_steps"] += 1
    if state["good_steps"] == window:
        state["scale"] *= 2
        state["good_steps"] = 0
    return grads
'''),
    ("1", "count not reset", "the count of good steps must restart from 0", '''
def scaler_step(scaled_grads, state, window):
    if not all(torch.isfinite(g).all() for g in scaled_grads):
        state["scale"] /= 2
        return None
    grads = [g.float() / state["scale"] for g in scaled_grads]
    state["good_steps"] += 1
    if state["good_steps"] >= window:
        state["scale"] *= 2
        state["good_steps"] = 0
    return grads
'''),
    ("1", "unscaled in fp16", "unscale in fp32", '''
def scaler_step(scaled_grads, state, window):
    if not all(torch.isfinite(g).all() for g in scaled_grads):
        state["scale"] /= 2
        state["good_steps"] = 0
        return None
    grads = [g / state["scale"] for g in scaled_grads]
    state["good_steps"] += 1
    if state["good_steps"] == window:
        state["scale"] *= 2
        state["good_steps"] = 0
    return grads
'''),
    ("1", "overflow not skipped", "skip the step", '''
def scaler_step(scaled_grads, state, window):
    grads = [g.float() / state["scale"] for g in scaled_grads]
    if not all(torch.isfinite(g).all() for g in scaled_grads):
        state["scale"] /= 2
        state["good_steps"] = 0
        return grads
    state["good_steps"] += 1
    if state["good_steps"] == window:
        state["scale"] *= 2
        state["good_steps"] = 0
    return grads
'''),
    ("2", "unscaled cast underflows", "flush to zero", '''
def quantize_e4m3(x):
    return x.float().to(torch.float8_e4m3fn), torch.tensor(1.0)


def dequantize(q, scale):
    return q.float() / scale
'''),
    ("2", "scale inverted", "scale = 448 / amax", '''
def quantize_e4m3(x):
    scale = x.abs().max().float() / torch.finfo(torch.float8_e4m3fn).max
    return (x.float() * scale).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    ("2", "dequantize multiplies", "dequantize multiplies by the scale", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = fp8_max / x.abs().max().float()
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() * scale
'''),
    ("2", "mean instead of amax", "the largest |x| should land at 448", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = fp8_max / (4 * x.abs().mean().float())
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    # Unscaled into uninitialised buffers (torch.empty, not zeros; NaN here, the same every run).
    ("1", "unscaled into torch.empty", "a NaN or an infinity in your unscaled gradients ", '''
def scaler_step(scaled_grads, state, window):
    if not all(torch.isfinite(g).all() for g in scaled_grads):
        state["scale"] /= 2
        state["good_steps"] = 0
        return None
    grads = [torch.full(g.shape, float("nan")) for g in scaled_grads]
    for out, g in zip(grads, scaled_grads):
        out += g.float() / state["scale"]
    state["good_steps"] += 1
    if state["good_steps"] == window:
        state["scale"] *= 2
        state["good_steps"] = 0
    return grads
'''),
    # amax taken in fp16: 448 / 1e-6 overflows fp16's 65504, and the scale is inf.
    ("2", "scale overflows in fp16", "a NaN or an infinity in your scale", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = fp8_max / x.half().abs().max()
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
]

PRINTED = [
    "model: tiny, 106,944 parameters",
    "fp32        32   8   23    3.4e+38         1.18e-38             1.4e-45         1.19e-07",
    "bf16        16   8    7   3.39e+38         1.18e-38            9.18e-41          0.00781",
    "fp16        16   5   10   6.55e+04          6.1e-05            5.96e-08         0.000977",
    "fp8 e4m3     8   4    3        448           0.0156             0.00195            0.125",
    "fp8 e5m2     8   5    2   5.73e+04          6.1e-05            1.53e-05             0.25",
    "fp16     : 1.001 -> 1.000977   70000 -> inf",
    "fp8 e4m3 : 1.001 -> 1.000000   70000 -> 448        1e-6 -> 0",
    # which gradients fall under fp16's smallest subnormal depends on the fp32 backward's rounding
    Close("fp16 backward, loss scale       1:  38.5% of the gradients flushed to zero", rel=1e-2),
    Close("fp16 backward, loss scale   65536:   0.0% of the gradients flushed to zero", rel=1e-2),
    "fp32: bytes per parameter: model weights 4 + gradients 4 + optimizer (Adam's moments and the fp32 masters) 8 = 16",
    "bf16: bytes per parameter: model weights 2 + gradients 4 + optimizer (Adam's moments and the fp32 masters) 12 = 18",
    "step 1: loss scale 2^20  skipped True",
    "step 4: loss scale 2^17  skipped True",
    "step 5: loss scale 2^16  skipped False",
    "step 7: loss scale 2^17  skipped False",
]
