"""Part 16, mixed precision: a dynamic loss scaler, and per-tensor FP8 (e4m3) quantisation.

The loss scaler is run on a scripted sequence of steps whose fp16 gradients are made here
from fp32 ones times the learner's current scale (so an overflow comes from the scale, as in
training), plus one step with a NaN; its decisions, state and gradients are compared with
the rule written out below; an inf or a NaN that slips through is probed in the first and the last
gradient, to tell a test that misses NaN from one that looks at one gradient only.

FP8 is judged by what the quantisation does, whichever convention the learner picks (multiply by
448 / amax, or divide by amax / 448): one finite scale per tensor; the largest |x| lands in [224, 448],
so that the range is used without saturating (a power-of-two scale rounded down qualifies); and the
round trip is within half a spacing of e4m3 (from torch.finfo), with dequantize undoing quantize.
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
        # 2^15 * 0.6 = 19661 each, all of one sign: every value finite, their fp16 sum (786,432) is not
        ("large gradients of one sign", [torch.full((40,), 0.6), torch.full((3, 5), 0.6)]),
    ]


def _skips(scaler_step, grads) -> bool:
    """Whether scaler_step skips these gradients (on a state of its own, so the check's run is untouched)."""
    return scaler_step([g.clone() for g in grads], {"scale": 2.0 ** 16, "good_steps": 0}, WINDOW) is None


def _why_not_skipped(scaler_step, scaled, has_nan) -> str:
    """Why gradients holding an inf or a NaN came back: probes with one bad value in the first or the last
    gradient, an inf or a NaN, tell a test that misses NaN from one that looks at one gradient only."""
    import torch

    def spoiled(i, value):
        grads = [torch.zeros_like(g) for g in scaled]
        grads[i].view(-1)[0] = value
        return grads

    bad = {"inf": float("inf"), "nan": float("nan")}
    caught = {(i, v): _skips(scaler_step, spoiled(i, bad[v])) for i in (0, -1) for v in bad}
    if caught[(0, "inf")] != caught[(-1, "inf")] or caught[(0, "nan")] != caught[(-1, "nan")]:
        return ("an inf or a NaN in one of the gradients went unnoticed: you test only some of them; one bad "
                "gradient spoils the step, test all: all(torch.isfinite(g).all() for g in scaled_grads)")
    if has_nan and caught[(0, "inf")] and not caught[(0, "nan")]:
        return ("the gradients hold a NaN and you did not skip: your test catches an inf but not a NaN (as "
                "torch.isinf does, or a comparison such as g.abs().max() > 65504: every comparison with NaN is "
                "False); test with torch.isfinite(g).all()")
    kind = "a NaN" if has_nan else "an inf"
    return (f"the gradients hold {kind} and you returned them: skip the step (return None), or the optimizer writes "
            f"inf/NaN into the weights")


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
                raise AssertionError(f"{where}: " + _why_not_skipped(scaler_step, scaled, has_nan))
            if state["scale"] == before["scale"] * 2:
                raise AssertionError(f"{where}: you grew the scale on an overflow; back off instead: halve it to "
                                     f"{want['scale']:g}, so that the next backward does not overflow again")
            if state["scale"] != want["scale"]:
                raise AssertionError(f"{where}: after an overflow the scale should back off to {want['scale']:g} "
                                     f"(halved), it is {state['scale']:g}")
            if state["good_steps"] != 0:
                raise AssertionError(f"{where}: after an overflow the count of good steps must restart from 0 "
                                     f"(it is {state['good_steps']}): growth needs `window` good steps in a row")
            continue
        if got is None:
            summed = not all(torch.isfinite(x.sum()) for x in scaled)  # in fp16, as the gradients are
            raise AssertionError(f"{where}: every gradient is finite (largest |g| * scale "
                                 f"{max(x.float().abs().max().item() for x in scaled):.4g} < 65504) but you skipped "
                                 f"the step: skip only on inf or NaN" + (
                                     "; a sum of fp16 values overflows where no value does (this step's does): "
                                     "test each value, torch.isfinite(g).all()" if summed else ""))
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
            if torch.allclose(x, scaled[i].float() * before["scale"], rtol=1e-3):
                raise AssertionError(f"{where}: you multiplied the gradients by the loss scale again; unscaling "
                                     f"divides: g.float() / state['scale']")
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
            if state["scale"] == want["scale"] == before["scale"] * 2 and state["good_steps"] == WINDOW:
                raise AssertionError(f"{where}: the scale grew, but the count of good steps is still "
                                     f"{state['good_steps']}: restart it at 0 when the scale grows, so that the next "
                                     f"growth waits for another window = {WINDOW} good steps")
            raise AssertionError(f"{where}: state should be {want}, it is {state}")


def _rounded(scaled, q, fi):
    """Per element: is q (float64) `scaled` rounded to e4m3, within half a spacing (3 mantissa bits, so
    eps / 2 relative; half the smallest subnormal near 0)?"""
    import torch

    floor = torch.full_like(scaled, fi.smallest_normal * fi.eps / 2)
    return (q - scaled).abs() <= torch.maximum(scaled.abs() * fi.eps / 2, floor) * (1 + 1e-6)


def _convention(x, q, scale, fi):
    """How the learner's q was made from x: ("multiplies", scale) when q = x * scale rounded to e4m3,
    ("divides", 1 / scale) when q = x / scale; None when neither explains most of q. The second element
    is the factor that takes x to q."""
    import torch

    qd, finite = q.double(), torch.isfinite(q.double())
    share = {}
    for how, factor in (("multiplies", scale), ("divides", 1 / scale)):
        scaled = (x * factor).clamp(-fi.max, fi.max)  # saturated or clamped, the largest values stay at 448
        share[how] = (_rounded(scaled, qd, fi) & finite).double().mean().item()
    how = max(share, key=share.get)
    if share[how] < 0.5:
        return None
    return how, (scale if how == "multiplies" else 1 / scale)


def _check_fp8(what, x, q, scale, back, fi):
    """One tensor's quantisation, judged by what it does: the range e4m3 is given, and the round trip."""
    import torch

    amax = x.abs().max().double().item()
    s = scale.item()
    if s == 1.0 and amax > 0 and not math.isclose(amax, fi.max, rel_tol=0.5):
        raise AssertionError(f"{what}: your scale is 1, the tensor cast as it is: values of 1e3 saturate at 448 and "
                             f"values of 1e-6 flush to zero; scale so that amax lands at 448: x * (448 / amax)")
    found = _convention(x.double(), q, s, fi)
    if found is None:
        raise AssertionError(f"{what}: q is neither x * scale nor x / scale rounded to e4m3 (scale = {s:.4g}): "
                             f"quantise x * scale with scale = 448 / amax (or x / scale with scale = amax / 448) "
                             f"and return that same scale")
    how, factor = found
    lands = amax * factor  # where the learner's quantisation puts the largest |x|
    if amax > 0 and how == "multiplies" and math.isclose(s, amax / fi.max, rel_tol=1e-3):
        raise AssertionError(f"{what}: you multiply by amax / 448: that takes amax to amax² / 448 = {lands:.3g}, not "
                             f"to 448; multiply by 448 / amax, or divide by amax / 448 (and dequantize multiplies)")
    if amax > 0 and how == "divides" and math.isclose(s, fi.max / amax, rel_tol=1e-3):
        raise AssertionError(f"{what}: you divide by 448 / amax: that takes amax to amax² / 448 = {lands:.3g}, not "
                             f"to 448; divide by amax / 448, or multiply by 448 / amax (and dequantize divides)")
    signed = x.max().double().item()
    if 0 < signed < amax and math.isclose(lands, fi.max * amax / signed, rel_tol=1e-3):
        raise AssertionError(f"{what}: your amax is x.max(), the largest signed value ({signed:.4g}); the largest "
                             f"magnitude here is negative ({x.min().item():.4g}) and lands at {-lands:.4g}, beyond "
                             f"-448: amax = x.abs().max()")
    if not torch.isfinite(q.float()).all():
        raise AssertionError(f"{what}: q holds NaN: your scale puts amax at {lands:.4g}, and e4m3fn has no "
                             f"infinity: a value beyond 448 becomes NaN. Take the scale from amax so that amax "
                             f"lands at most at 448, and clamp x * scale to +-448 before the cast, against rounding")
    mean = x.abs().mean().double().item()
    if amax > 0 and lands > fi.max * (1 + fi.eps / 2):
        if math.isclose(lands, fi.max * amax / mean, rel_tol=1e-3):
            raise AssertionError(f"{what}: your scale comes from the mean |x|, not the amax: the largest |x| lands at "
                                 f"{lands:.4g}, beyond 448, and saturates; the largest |x| should land at 448 (at "
                                 f"least 224), scale = 448 / amax")
        e5m2 = torch.finfo(torch.float8_e5m2).max
        if math.isclose(lands, e5m2, rel_tol=1e-3):
            raise AssertionError(f"{what}: the largest |x| lands at {lands:.6g}, float8_e5m2's largest value; "
                                 f"e4m3's is {fi.max:g}: torch.finfo(torch.float8_e4m3fn).max, and everything "
                                 f"above it saturates")
        saturated = (q.float().abs() == fi.max).double().mean().item()
        raise AssertionError(f"{what}: the largest |x| lands at {lands:.4g}, beyond e4m3's 448: {saturated:.1%} of q "
                             f"saturates at 448 and loses its value; take the scale so that amax lands at most at 448 "
                             f"(a power of two, round it down)")
    if amax > 0 and lands < fi.max / 2 * (1 - 1e-6):
        eps = fi.max / lands * amax - amax if how == "multiplies" else 0.0  # what was added to amax, if anything
        added = (f"; your scale is 448 / (amax + {eps:.1g}): an epsilon that is not small beside this amax "
                 f"({amax:.1g}); keep amax from 0 with amax.clamp(min=1e-12) instead" if amax < eps < 1e-2 else "")
        raise AssertionError(f"{what}: the largest |x| lands at {lands:.4g}, less than half of e4m3's 448: the scale "
                             f"wastes the format's range, and the small values fall into the subnormals or flush "
                             f"to 0 for nothing; map amax to 448 (or within a factor 2 below it: a power-of-two "
                             f"scale rounded down)" + added)
    dequantised = q.double() / factor
    if not torch.allclose(back.double(), dequantised, rtol=1e-5, atol=0):
        if how == "multiplies" and torch.allclose(back.double(), q.double() * s, rtol=1e-5, atol=0):
            raise AssertionError(f"{what}: dequantize multiplies by the scale; quantize multiplied, so dequantize "
                                 f"divides: q.float() / scale")
        if how == "divides" and torch.allclose(back.double(), q.double() / s, rtol=1e-5, atol=0):
            raise AssertionError(f"{what}: dequantize divides by the scale; quantize divided, so dequantize "
                                 f"multiplies: q.float() * scale")
        raise AssertionError(f"{what}: dequantize(q, scale) is not q undone: quantize {how} x by the scale, so "
                             f"dequantize must do the inverse with the same scale, in float32")
    # Round-to-nearest: at most half a spacing of e4m3 (eps / 2 relative, half the smallest subnormal near 0).
    if not _rounded(x.double() * factor, back.double() * factor, fi).all():
        raise AssertionError(f"{what}: the round trip errs by more than e4m3's half spacing (eps / 2 = "
                             f"{fi.eps / 2:g} relative): quantise x * scale in float32, then cast once")
    if amax > 0:
        rel = ((back - x).norm() / x.norm()).item()
        assert rel < 0.05, f"{what}: round-trip relative error {rel:.3f}, e4m3 gives about 0.02"


def _negative_peak(g):
    import torch

    x = torch.randn(64, 32, generator=g) * 10
    x = x.clamp(-60, 60)
    x[5, 7] = -200.0
    return x


def exercise_2(quantize_e4m3, dequantize):
    """quantize_e4m3(x) -> (float8_e4m3fn q, scale); dequantize(q, scale) -> float32 x. Judged by the range and
    the round trip: either convention (multiply by 448 / amax, or divide by amax / 448), any scale that puts
    amax in [224, 448] (a power of two), with the round trip within e4m3's resolution."""
    import torch

    fp8 = torch.float8_e4m3fn
    fi = torch.finfo(fp8)
    g = torch.Generator().manual_seed(16)
    grads = torch.randn(64, 32, generator=g) * 1e-6
    cases = [("gradients around 1e-6", grads),
             ("activations around 1e3", torch.randn(64, 32, generator=g) * 1e3),
             ("weights around 0.02", torch.randn(64, 32, generator=g) * 0.02),
             # amax is a magnitude: here the largest one is negative (a signed max finds 3x less)
             ("activations around 10, the largest -200", _negative_peak(g)),
             # far below an epsilon added to amax for safety (1e-6 would halve 448 / amax and more)
             ("gradients around 1e-8", torch.randn(64, 32, generator=g) * 1e-8),
             ("a tensor of zeros (a frozen layer's gradients)", torch.zeros(16, 8))]
    for what, x in cases:
        got = quantize_e4m3(x.clone())
        assert isinstance(got, tuple) and len(got) == 2, "quantize_e4m3 returns a tuple (q, scale)"
        q, scale = got
        try:
            scale_t = torch.as_tensor(scale, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise AssertionError(f"{what}: scale is {scale!r}; return it as a float32 scalar tensor") from None
        if scale_t.numel() != 1:
            raise AssertionError(f"{what}: your scale has shape {tuple(scale_t.shape)}, one scale per element or row; "
                                 f"per-tensor scaling keeps one scale for the whole tensor, from its amax")
        if not torch.isfinite(scale_t).all() or scale_t.item() == 0:
            raise AssertionError(f"{what}: a NaN, an infinity or 0 in your scale ({scale_t.item()}): compute amax and "
                                 f"448 / amax in fp32 (fp16 overflows at 65504), with amax clamped away from 0 "
                                 f"(amax.clamp(min=1e-12): a tensor of zeros has amax 0)")
        assert isinstance(q, torch.Tensor) and q.dtype == fp8, (
            f"{what}: q is {getattr(q, 'dtype', type(q))}; cast the scaled tensor with .to(torch.float8_e4m3fn)")
        assert q.shape == x.shape, f"{what}: q has shape {tuple(q.shape)}, x {tuple(x.shape)}"
        back = dequantize(q, scale)
        assert isinstance(back, torch.Tensor) and back.dtype == torch.float32, (
            f"{what}: dequantize returns {getattr(back, 'dtype', type(back))}; return float32")
        assert back.shape == x.shape, f"{what}: dequantize returns shape {tuple(back.shape)}, x {tuple(x.shape)}"
        _check_fp8(what, x, q, scale_t.reshape(()), back, fi)
