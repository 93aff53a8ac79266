"""Part 16, mixed precision: a dynamic loss scaler, and per-tensor FP8 (e4m3) quantisation.

The loss scaler is run on a scripted sequence of steps whose fp16 gradients are made here
from fp32 ones times the learner's current scale (so an overflow comes from the scale, as in
training), plus one step with a NaN; its decisions, state and gradients are compared with
the rule written out below. FP8 is checked against e4m3's resolution, from torch.finfo.
"""

from __future__ import annotations

import math

from ultrascale.series.checks import require_finite

WINDOW = 3


def _script():
    """(label, fp32 gradients) per step: magnitudes chosen so that scale * g overflows fp16 (65504) at step 2, with a NaN at step 6."""
    import torch

    g = torch.Generator().manual_seed(16)

    def grads(magnitude, nan=False):
        out = [torch.randn(40, generator=g) * magnitude, torch.randn(3, 5, generator=g) * magnitude]
        out[1][0, 0] = 1.5 * magnitude  # the largest element: scale * it decides the overflow
        if nan:
            out[0][7] = float("nan")
        return out

    return [
        ("small gradients", grads(1e-6)),      # 2^16 * 1e-6: fine; 1e-6 alone would be a subnormal in fp16
        ("large gradients", grads(1.0)),       # 2^16 * 1.5 > 65504: overflow
        ("small gradients", grads(1e-6)),
        ("small gradients", grads(1e-6)),
        ("small gradients", grads(1e-6)),      # third good step in a row: the scale doubles
        ("a NaN", grads(1e-6, nan=True)),      # NaN: skip
        ("medium gradients", grads(0.25)),     # 2^15 * 0.375 = 12288: fine
        ("small gradients", grads(1e-6)),
    ]


def exercise_1(scaler_step):
    """scaler_step(scaled_grads, state, window) -> fp32 grads or None; state updated in place."""
    import torch

    state = {"scale": 2.0 ** 16, "good_steps": 0}
    want = {"scale": 2.0 ** 16, "good_steps": 0}
    for step, (label, fp32) in enumerate(_script(), start=1):
        scaled = [(x * state["scale"]).half() for x in fp32]
        overflow = not all(torch.isfinite(x).all() for x in scaled)
        has_nan = any(torch.isnan(x).any() for x in scaled)
        before = dict(want)
        if overflow:
            want = {"scale": want["scale"] / 2, "good_steps": 0}
        else:
            count = want["good_steps"] + 1
            want = ({"scale": want["scale"] * 2, "good_steps": 0} if count == WINDOW
                    else {"scale": want["scale"], "good_steps": count})
        got = scaler_step([x.clone() for x in scaled], state, WINDOW)
        where = f"step {step} ({label}, scale {before['scale']:g})"
        if overflow:
            if got is not None:
                kind = "a NaN" if has_nan else "an inf"
                if has_nan and not any(torch.isinf(x).any() for x in scaled):
                    raise AssertionError(f"{where}: the gradients hold a NaN and you did not skip: torch.isinf misses "
                                         f"NaN; test with torch.isfinite(g).all()")
                raise AssertionError(f"{where}: the gradients hold {kind} and you returned them: skip the step "
                                     f"(return None), or the optimizer writes inf/NaN into the weights")
            if state["scale"] != want["scale"]:
                raise AssertionError(f"{where}: after an overflow the scale should back off to {want['scale']:g} "
                                     f"(halved), it is {state['scale']:g}")
            if state["good_steps"] != 0:
                raise AssertionError(f"{where}: after an overflow the count of good steps must restart from 0 "
                                     f"(it is {state['good_steps']}): growth needs `window` good steps in a row")
            continue
        if got is None:
            raise AssertionError(f"{where}: every gradient is finite (largest |g| * scale "
                                 f"{max(x.float().abs().max().item() for x in scaled):.4g} < 65504) but you skipped "
                                 f"the step: skip only on inf or NaN")
        assert isinstance(got, (list, tuple)) and len(got) == len(fp32), (
            f"{where}: return a list with one unscaled gradient per input gradient")
        require_finite(list(got), f"your unscaled gradients at {where}")  # every scaled one was finite
        for i, (x, ref) in enumerate(zip(got, fp32)):
            if x.dtype != torch.float32:
                raise AssertionError(f"{where}: gradient {i} is {x.dtype}: unscale in fp32 (g.float() / scale); "
                                     f"dividing in fp16 flushes the small gradients to zero again")
            expected = scaled[i].float() / before["scale"]
            if torch.allclose(x, scaled[i].float(), rtol=1e-3):
                raise AssertionError(f"{where}: your gradients are still multiplied by the loss scale "
                                     f"({before['scale']:g}x too large): divide them by state['scale'] before "
                                     f"returning, and before updating the scale")
            if torch.allclose(x, scaled[i].float() / state["scale"], rtol=1e-3) and state["scale"] != before["scale"]:
                raise AssertionError(f"{where}: you unscaled with the scale after updating it; divide by the scale "
                                     f"the backward used, then grow it")
            if not torch.allclose(x, expected, rtol=1e-3, atol=0):
                err = ((x - ref).norm() / ref.norm()).item()
                raise AssertionError(f"{where}: gradient {i} is {err:.1e} (relative) away from the fp32 one: the "
                                     f"unscaled gradient is scaled_grad.float() / scale")
        if state["scale"] != want["scale"] or state["good_steps"] != want["good_steps"]:
            if state["scale"] == before["scale"] * 2 and want["scale"] == before["scale"]:
                raise AssertionError(f"{where}: you doubled the scale after {before['good_steps'] + 1} good steps in a "
                                     f"row; it grows after window = {WINDOW} (and did the count restart at 0 after "
                                     f"the last overflow?)")
            if want["scale"] == before["scale"] * 2 and state["scale"] == before["scale"]:
                raise AssertionError(f"{where}: this is good step {WINDOW} in a row: the scale should double to "
                                     f"{want['scale']:g} and the count restart at 0 (you have {state['scale']:g}, "
                                     f"{state['good_steps']} good steps)")
            raise AssertionError(f"{where}: state should be {want}, it is {state}")


def exercise_2(quantize_e4m3, dequantize):
    """quantize_e4m3(x) -> (float8_e4m3fn q, float32 scale); dequantize(q, scale) -> float32 x."""
    import torch

    fp8 = torch.float8_e4m3fn
    fi = torch.finfo(fp8)
    g = torch.Generator().manual_seed(16)
    grads = torch.randn(64, 32, generator=g) * 1e-6
    cases = [("gradients around 1e-6", grads),
             ("activations around 1e3", torch.randn(64, 32, generator=g) * 1e3),
             ("weights around 0.02", torch.randn(64, 32, generator=g) * 0.02)]
    for what, x in cases:
        got = quantize_e4m3(x.clone())
        assert isinstance(got, tuple) and len(got) == 2, "quantize_e4m3 returns a tuple (q, scale)"
        q, scale = got
        try:
            finite = bool(torch.isfinite(torch.as_tensor(scale, dtype=torch.float64)).all())
        except (TypeError, ValueError, RuntimeError):
            finite = True  # not a number: the checks below say what it should be
        if not finite:  # e4m3 has no inf, and q / inf is 0
            raise AssertionError(f"{what}: a NaN or an infinity in your scale ({scale}): compute amax and fp8 max / "
                                 f"amax in fp32 (fp16 overflows at 65504), with amax clamped away from 0")
        assert isinstance(q, torch.Tensor) and q.dtype == fp8, (
            f"{what}: q is {getattr(q, 'dtype', type(q))}; cast the scaled tensor with .to(torch.float8_e4m3fn)")
        assert q.shape == x.shape, f"{what}: q has shape {tuple(q.shape)}, x {tuple(x.shape)}"
        scale_t = torch.as_tensor(scale, dtype=torch.float64)
        amax = x.abs().max().double()
        back = dequantize(q, scale)
        assert isinstance(back, torch.Tensor) and back.dtype == torch.float32, (
            f"{what}: dequantize returns {getattr(back, 'dtype', type(back))}; return float32 (q.float() / scale)")
        if scale_t.item() == 1.0 and not math.isclose(amax.item(), fi.max, rel_tol=1e-2):
            raise AssertionError(f"{what}: your scale is 1, the tensor cast as it is: values of 1e3 saturate at 448 "
                                 f"and values of 1e-6 flush to zero; scale = fp8 max / amax")
        if math.isclose(scale_t.item(), (amax / fi.max).item(), rel_tol=1e-3) and not math.isclose(
                amax.item(), fi.max, rel_tol=1e-2):
            raise AssertionError(f"{what}: your scale is amax / 448; it is the other way round: x * scale must "
                                 f"bring amax to 448, scale = 448 / amax")
        if (q.float() == 0).float().mean().item() > 0.5 and (x != 0).all():
            raise AssertionError(f"{what}: {(q.float() == 0).float().mean().item():.0%} of q is 0: the values "
                                 f"underflowed; e4m3's smallest subnormal is {fi.smallest_normal * fi.eps:g}, so "
                                 f"unscaled values of 1e-6 all flush to zero. Scale by fp8_max / amax first")
        if not torch.isfinite(q.float()).all():
            raise AssertionError(f"{what}: q holds NaN: the scale must be finite, fp8 max / amax (amax clamped away "
                                 f"from 0), and x * scale clamped to +-448 against rounding")
        require_finite(back, f"dequantize's output for {what}")
        if not math.isclose(scale_t.item(), (fi.max / amax).item(), rel_tol=1e-3):
            raise AssertionError(f"{what}: scale is {scale_t.item():.4g}, expected fp8 max / amax = "
                                 f"{(fi.max / amax).item():.4g}: the largest |x| should land at 448")
        if torch.allclose(back.double(), q.float().double() * scale_t, rtol=1e-6) and not torch.allclose(
                back.double(), x.double(), rtol=0.1):
            raise AssertionError(f"{what}: dequantize multiplies by the scale; quantize multiplied, so dequantize "
                                 f"divides: q.float() / scale")
        # Round-to-nearest: at most half a spacing. Normal e4m3 numbers have 3 mantissa bits: 2^-4 relative.
        scaled = x.double() * scale_t
        bound = torch.maximum(scaled.abs() * 2.0 ** -4, torch.full_like(scaled, fi.smallest_normal * fi.eps / 2))
        err = (back.double() - x.double()).abs() * scale_t
        if not (err <= bound * (1 + 1e-6)).all():
            worst = (err / bound).max().item()
            raise AssertionError(f"{what}: the round trip errs by up to {worst:.2f}x e4m3's half spacing "
                                 f"(2^-4 relative): quantise x * scale, dequantise q.float() / scale")
        rel = ((back - x).norm() / x.norm()).item()
        assert rel < 0.05, f"{what}: round-trip relative error {rel:.3f}, e4m3 gives about 0.02"
