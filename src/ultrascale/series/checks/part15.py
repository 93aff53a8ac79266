"""Part 15, inside the GPU: FlashAttention's online-softmax forward over key blocks, and the
arithmetic intensity of matmuls and elementwise ops against a device's ridge point.

Expected values are computed here: attention by torch's scaled_dot_product_attention (and
from the definition in float64), intensities from the FLOP and byte counts written out.
"""

from __future__ import annotations

import math

from ultrascale.series.checks import max_rel_diff, require_finite


def _blocked_variants(q, k, v, block):
    """What the classic mistakes produce, computed block by block (float64)."""
    import torch

    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5
    s = (q @ k.T) * scale
    rows = q.shape[0]
    # 1. accumulator (and sum) never rescaled when the max grows
    m = torch.full((rows, 1), -math.inf, dtype=torch.float64)
    l = torch.zeros(rows, 1, dtype=torch.float64)
    l_never = torch.zeros(rows, 1, dtype=torch.float64)
    acc = torch.zeros(rows, v.shape[-1], dtype=torch.float64)
    for start in range(0, k.shape[0], block):
        sb = s[:, start:start + block]
        new = torch.maximum(m, sb.max(-1, keepdim=True).values)
        p = torch.exp(sb - new)
        acc = acc + p @ v[start:start + block]
        l = l * torch.exp(m - new) + p.sum(-1, keepdim=True)
        l_never = l_never + p.sum(-1, keepdim=True)
        m = new
    no_rescale = acc / l  # the sum rescaled, the accumulator not
    # 2. each block normalised on its own, then summed or averaged
    per_block = [torch.softmax(s[:, i:i + block], -1) @ v[i:i + block] for i in range(0, k.shape[0], block)]
    summed, averaged = sum(per_block), sum(per_block) / len(per_block)
    # 3. no final division: the accumulator exp(s - m_final) @ v
    unnormalised = torch.exp(s - s.max(-1, keepdim=True).values) @ v
    return {"no_rescale": no_rescale, "summed": summed, "averaged": averaged, "unnormalised": unnormalised,
            "no_rescale_at_all": acc / l_never}


def _ShapeWatch(m, n):
    """A torch function mode noting whether any op returns an [m, n] (or [n, m]) tensor: the full scores."""
    from torch.overrides import TorchFunctionMode

    class Watch(TorchFunctionMode):
        full = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shape = tuple(getattr(out, "shape", ()))
            if len(shape) >= 2 and shape[-2:] in ((m, n), (n, m)):
                Watch.full = True
            return out

    return Watch()


def exercise_1(flash_attention_forward):
    """flash_attention_forward(q, k, v, block) -> [m, d], equal to SDPA of q over all of k, v."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(15)
    for m, n, d, block, spread in ((8, 64, 16, 16, 1.0), (5, 50, 8, 16, 3.0)):
        q = torch.randn(m, d, generator=g) * spread
        k = torch.randn(n, d, generator=g) * spread
        v = torch.randn(n, d, generator=g)
        # Keys sorted so that later blocks raise the max: the rescaling is exercised on every row.
        order = (q.mean(0, keepdim=True) @ k.T).squeeze(0).argsort()
        k, v = k[order].contiguous(), v[order].contiguous()
        with _ShapeWatch(m, n) as watch:
            got = flash_attention_forward(q.clone(), k.clone(), v.clone(), block)
        want = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        assert tuple(got.shape) == tuple(want.shape), (
            f"the output has shape {tuple(got.shape)}; one row per query, one column per value dimension: "
            f"{tuple(want.shape)}")
        if not torch.isfinite(got).all():
            raise AssertionError("a NaN or an infinity in your output: subtract the new running max (after "
                                 "torch.maximum with this block's) before exp, and start the running max at -inf "
                                 "only where it is combined with torch.maximum")
        if max_rel_diff(got, want) <= 1e-4:
            if watch.full:
                raise AssertionError(f"the output is right, but your code formed a [{m}, {n}] tensor: the scores of "
                                     f"every key at once, which is what FlashAttention never writes out; compute "
                                     f"q @ k_blk.T for one block of {block} keys at a time")
            continue
        wrong = _blocked_variants(q, k, v, block)
        if max_rel_diff(got, wrong["unnormalised"]) <= 1e-4:
            raise AssertionError("you return the accumulator without the final division: the weights of a row "
                                 "must sum to 1; return acc / row_sum at the end")
        if max_rel_diff(got, wrong["summed"]) <= 1e-4 or max_rel_diff(got, wrong["averaged"]) <= 1e-4:
            raise AssertionError("you normalise each block on its own (a softmax per block) and then combine the "
                                 "blocks: a block's softmax ignores the other blocks' keys; keep an unnormalised "
                                 "accumulator and divide once by the running sum at the end")
        if max_rel_diff(got, wrong["no_rescale"]) <= 1e-4 or max_rel_diff(got, wrong["no_rescale_at_all"]) <= 1e-4:
            raise AssertionError("when a block raises the running max, what was accumulated so far is still "
                                 "relative to the old max: multiply acc (and row_sum) by exp(old_max - new_max) "
                                 "before adding the new block")
        raise AssertionError(f"your output differs from scaled_dot_product_attention by "
                             f"{max_rel_diff(got, want):.2e} (relative to its largest value): scores are "
                             f"(q @ k_blk.T) / sqrt(d); acc = acc * exp(old_max - new_max) + exp(s - new_max) @ v_blk")


def _expected(kind, shape, dtype, peak, bw):
    import torch

    b = torch.finfo(dtype).bits // 8
    if kind == "matmul":
        m, k, n = shape
        flops, moved = 2 * m * k * n, (m * k + k * n + m * n) * b
    else:
        (numel,) = shape
        flops, moved = numel, 3 * numel * b
    ai = flops / moved
    return ai, ("compute" if ai >= peak / bw else "memory"), flops, moved, b


H100 = (989e12, 3.35e12)       # dense bf16 FLOP/s, HBM bytes/s (datasheet)
CPU_CORE = (50e9, 10e9)        # a CPU core, roughly: 50 GFLOP/s, 10 GB/s


def exercise_2(roofline):
    """roofline(kind, shape, dtype, peak_flops, bandwidth) -> (intensity, "memory" | "compute")."""
    import torch

    cases = [  # fp32 first: a wrong FLOP count shows there before a wrong element size can blur it
        ("matmul", (1024, 512, 256), torch.float32, H100),
        ("matmul", (64, 64, 64), torch.float32, CPU_CORE),
        ("matmul", (8, 8, 8), torch.float32, CPU_CORE),
        ("elementwise", (1 << 20,), torch.float32, H100),
        ("matmul", (4096, 4096, 4096), torch.bfloat16, H100),
        ("matmul", (16, 4096, 4096), torch.bfloat16, H100),     # a decode-like skinny matmul
        ("elementwise", (1 << 20,), torch.bfloat16, CPU_CORE),
    ]
    for kind, shape, dtype, (peak, bw) in cases:
        got = roofline(kind, shape, dtype, peak, bw)
        assert isinstance(got, tuple) and len(got) == 2, "return a tuple (intensity, 'memory' or 'compute')"
        ai, bound = got
        require_finite(float(ai), f"your intensity for {kind} {shape} in {dtype}")
        want_ai, want_bound, flops, moved, b = _expected(kind, shape, dtype, peak, bw)
        what = f"{kind} {shape} in {dtype} on peak {peak:.3g} FLOP/s, {bw:.3g} B/s"
        if not math.isclose(float(ai), want_ai, rel_tol=1e-6):
            r = float(ai) / want_ai
            if math.isclose(r, b / 4, rel_tol=1e-6) and b != 4:
                raise AssertionError(f"{what}: you counted 4 bytes per element; {dtype} has {b}: use the dtype's "
                                     f"size, torch.finfo(dtype).bits // 8")
            if kind == "matmul" and math.isclose(r, 0.5, rel_tol=1e-6):
                raise AssertionError(f"{what}: your intensity is half the right one: a matmul does m*k*n multiplies "
                                     f"AND m*k*n adds, 2*m*k*n FLOPs")
            if kind == "matmul" and math.isclose(float(ai), 2 * shape[0] * shape[1] * shape[2]
                                                 / ((shape[0] * shape[1] + shape[1] * shape[2]) * b), rel_tol=1e-6):
                raise AssertionError(f"{what}: you counted the inputs' bytes but not the output's: the [m, n] "
                                     f"result is written to memory too, (m*k + k*n + m*n) elements")
            if kind == "elementwise" and math.isclose(r, 1.5, rel_tol=1e-6):
                raise AssertionError(f"{what}: you counted two tensors' bytes; c = a + b reads a and b and writes c: "
                                     f"3 * numel elements")
            if math.isclose(r, b, rel_tol=1e-6) or math.isclose(r, 8.0 * b, rel_tol=1e-6):
                raise AssertionError(f"{what}: your intensity is per element, not per byte: multiply the elements "
                                     f"moved by {b} bytes")
            raise AssertionError(f"{what}: intensity {float(ai):.4g} FLOP/byte, expected {want_ai:.4g} "
                                 f"({flops:.4g} FLOPs / {moved:.4g} bytes)")
        if bound != want_bound:
            ridge = peak / bw
            raise AssertionError(f"{what}: intensity {want_ai:.4g} against a ridge point of {ridge:.4g} FLOP/byte "
                                 f"(peak / bandwidth) makes it {want_bound}-bound, you said {bound!r}: below the "
                                 f"ridge, memory is the limit")
