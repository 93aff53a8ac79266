"""Part 16's answers: a dynamic loss scaler between fp16 backward and the optimizer, and per-tensor FP8 (e4m3)
quantisation with its dequantisation."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 16


def _scaler(check='not all(torch.isfinite(g).all() for g in scaled_grads)', backoff='state["scale"] /= 2\n'
            '        state["good_steps"] = 0', unscale='[g.float() / state["scale"] for g in scaled_grads]',
            grow='state["good_steps"] == window', after_growth='state["good_steps"] = 0'):
    """A loss scaler written the usual way, one part of it replaced."""
    return f'''
def scaler_step(scaled_grads, state, window):
    if {check}:
        {backoff}
        return None
    grads = {unscale}
    state["good_steps"] += 1
    if {grow}:
        state["scale"] *= 2
        {after_growth}
    return grads
'''


_QUANTIZE = '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    amax = x.abs().max().float().clamp(min=1e-12)
'''

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "not unscaled", "still multiplied by the loss scale", _scaler(unscale="[g.float() for g in scaled_grads]")),
    (1, "multiplied to unscale", "you multiplied the gradients by the loss scale again",
     _scaler(unscale='[g.float() * state["scale"] for g in scaled_grads]')),
    (1, "isinf misses NaN", "your test catches an inf but not a NaN", _scaler(check="any(torch.isinf(g).any() for g in scaled_grads)")),
    (1, "only the last gradient tested", "you test only some of them",
     _scaler(check="not torch.isfinite(scaled_grads[-1]).all()")),
    (1, "count not reset", "the count of good steps must restart from 0", _scaler(backoff='state["scale"] /= 2')),
    (1, "count not restarted after growth", "restart it at 0 when the scale grows", _scaler(after_growth="pass")),
    (1, "grows on an overflow", "you grew the scale on an overflow",
     _scaler(backoff='state["scale"] *= 2\n        state["good_steps"] = 0')),
    (1, "grows one step early", "it grows after window = 3", _scaler(grow='state["good_steps"] == window - 1')),
    (1, "PyTorch's growth interval, not the window", "the scale should double",
     _scaler(grow='state["good_steps"] == 2000')),
    (1, "unscaled in fp16", "unscale in fp32", _scaler(unscale='[g / state["scale"] for g in scaled_grads]')),
    (1, "unscaled with the grown scale", "you unscaled with the scale after updating it", '''
def scaler_step(scaled_grads, state, window):
    if not all(torch.isfinite(g).all() for g in scaled_grads):
        state["scale"] /= 2
        state["good_steps"] = 0
        return None
    state["good_steps"] += 1
    if state["good_steps"] == window:
        state["scale"] *= 2
        state["good_steps"] = 0
    return [g.float() / state["scale"] for g in scaled_grads]
'''),
    (1, "overflow not skipped", "skip the step", '''
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
    # Unscaled into uninitialised buffers (torch.empty, not zeros; NaN here, the same every run).
    (1, "unscaled into torch.empty", "a NaN or an infinity in your unscaled gradients ", '''
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
    (2, "unscaled cast underflows", "flush to zero", '''
def quantize_e4m3(x):
    return x.float().to(torch.float8_e4m3fn), torch.tensor(1.0)


def dequantize(q, scale):
    return q.float() / scale
'''),
    (2, "scale inverted", "you multiply by amax / 448", '''
def quantize_e4m3(x):
    scale = x.abs().max().float() / torch.finfo(torch.float8_e4m3fn).max
    return (x.float() * scale).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    (2, "dequantize multiplies", "dequantize multiplies by the scale", _QUANTIZE + '''
    scale = fp8_max / amax
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() * scale
'''),
    (2, "the inverse scale, dequantize divides", "dequantize divides by the scale", _QUANTIZE + '''
    scale = amax / fp8_max
    return (x.float() / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    (2, "mean instead of amax", "your scale comes from the mean |x|", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = fp8_max / x.abs().mean().float()
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    (2, "a power of two rounded up", "saturates at 448", _QUANTIZE + '''
    scale = 2.0 ** torch.ceil(torch.log2(fp8_max / amax))
    return (x.float() * scale).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    (2, "e5m2's max for e4m3", "float8_e5m2's largest value", _QUANTIZE + '''
    scale = torch.finfo(torch.float8_e5m2).max / amax
    return (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    (2, "scale for 1.0, not for 448", "wastes the format's range", _QUANTIZE + '''
    scale = 1.0 / amax
    return (x.float() * scale).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    (2, "a scale per element", "one scale for the whole tensor", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = fp8_max / x.abs().float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    (2, "amax not clamped away from 0", "a tensor of zeros has amax 0", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = fp8_max / x.abs().max().float()
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    # amax taken in fp16: 448 / 1e-6 overflows fp16's 65504, and the scale is inf.
    (2, "scale overflows in fp16", "a NaN, an infinity or 0 in your scale", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = fp8_max / x.half().abs().max()
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    # One reduction for the test: a sum of finite fp16 values can overflow by itself.
    (1, "overflow tested on the fp16 sum", "a sum of fp16 values overflows where no value does", '''
def scaler_step(scaled_grads, state, window):
    """Unscaled fp32 gradients, or None to skip the step; updates state["scale"], state["good_steps"]."""
    # one cheap reduction: if the sum is finite, nothing is inf or NaN
    total = torch.stack([g.sum() for g in scaled_grads]).sum()
    if not torch.isfinite(total):
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
    # The largest value, not the largest magnitude.
    (2, "amax as the signed max", "your amax is x.max(), the largest signed value", '''
def quantize_e4m3(x):
    """(float8_e4m3fn tensor, float32 scale) with x ~= dequantize(q, scale)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    amax = x.max().float()                       # the largest element
    scale = torch.where(amax > 0, fp8_max / amax, torch.ones_like(amax)).float()
    return (x * scale).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    # amax + 1e-6 against a division by zero: larger than amax itself for tiny gradients.
    (2, "an epsilon added to amax", "an epsilon that is not small beside this amax", '''
def quantize_e4m3(x):
    """(float8_e4m3fn tensor, float32 scale) with x ~= dequantize(q, scale)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    amax = x.abs().max().float()
    scale = fp8_max / (amax + 1e-6)             # avoid dividing by zero
    return (x.float() * scale).to(torch.float8_e4m3fn), scale.float()


def dequantize(q, scale):
    return q.float() / scale
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "one finite test on the sums, growth by modulo", '''
def scaler_step(scaled_grads, state, window):
    sums = torch.stack([g.float().sum() for g in scaled_grads])  # an inf or a NaN anywhere reaches its sum
    if not torch.isfinite(sums).all():
        state.update(scale=state["scale"] * 0.5, good_steps=0)
        return None
    inverse = 1.0 / state["scale"]
    grads = [g.float() * inverse for g in scaled_grads]
    state["good_steps"] += 1
    if state["good_steps"] % window == 0:
        state.update(scale=state["scale"] * 2, good_steps=0)
    return grads
'''),
    (1, "the growth decided before unscaling", '''
def scaler_step(scaled_grads, state, window):
    bad = any(not torch.isfinite(g).all() for g in scaled_grads)
    used = state["scale"]
    if bad:
        state["scale"], state["good_steps"] = used / 2, 0
        return None
    grow = state["good_steps"] + 1 >= window
    state["scale"], state["good_steps"] = (used * 2, 0) if grow else (used, state["good_steps"] + 1)
    return [g.to(torch.float32).div(used) for g in scaled_grads]
'''),
    (2, "the inverse convention: divide by amax / 448", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = x.abs().max().float().clamp(min=1e-12) / fp8_max  # what one unit of q is worth
    return (x.float() / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() * scale
'''),
    (2, "a power-of-two scale, rounded down", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    amax = x.abs().max().float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(fp8_max / amax)))  # exact to apply and to undo
    return (x.float() * scale).to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    return q.float() / scale
'''),
    (2, "a margin below 448", '''
def quantize_e4m3(x):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    amax = torch.amax(torch.abs(x)).float()
    scale = 0.9 * fp8_max / torch.clamp(amax, min=1e-12)
    return torch.clamp(x.float() * scale, -fp8_max, fp8_max).to(torch.float8_e4m3fn), scale.float()


def dequantize(q, scale):
    return q.to(torch.float32) * (1 / scale)
'''),
]
