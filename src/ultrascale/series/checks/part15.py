"""Part 15, inside the GPU: FlashAttention's online-softmax forward over key blocks, and the
arithmetic intensity of matmuls and elementwise ops against a device's ridge point.

Expected values are computed here: attention by torch's scaled_dot_product_attention (and
from the definition in float64), intensities from the FLOP and byte counts written out.
A wrong attention output is compared with what each classic mistake computes (float64, block
by block), and a torch function mode watches the learner's code for the full [m, n] score
matrix and for an exp() that overflows; a wrong intensity with the counts each miscounting
gives, and wrong bounds with the rules applied the wrong way, over all the cases at once.
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
    rows, n = q.shape[0], k.shape[0]
    m = torch.full((rows, 1), -math.inf, dtype=torch.float64)
    l = torch.zeros(rows, 1, dtype=torch.float64)
    l_never = torch.zeros(rows, 1, dtype=torch.float64)
    acc = torch.zeros(rows, v.shape[-1], dtype=torch.float64)    # never rescaled
    acc_ok = torch.zeros(rows, v.shape[-1], dtype=torch.float64)  # rescaled
    acc_blk = torch.zeros(rows, v.shape[-1], dtype=torch.float64)  # p relative to the block's own max
    l_blk = torch.zeros(rows, 1, dtype=torch.float64)
    out_div = torch.zeros(rows, v.shape[-1], dtype=torch.float64)  # divided by the running sum at every block
    for start in range(0, n, block):
        sb, vb = s[:, start:start + block], v[start:start + block]
        block_max = sb.max(-1, keepdim=True).values
        new = torch.maximum(m, block_max)
        c = torch.exp(m - new)
        p = torch.exp(sb - new)
        acc = acc + p @ vb
        acc_ok = acc_ok * c + p @ vb
        p_blk = torch.exp(sb - block_max)
        acc_blk = acc_blk * c + p_blk @ vb
        l_blk = l_blk * c + p_blk.sum(-1, keepdim=True)
        l = l * c + p.sum(-1, keepdim=True)
        l_never = l_never + p.sum(-1, keepdim=True)
        out_div = (out_div * c + p @ vb) / l
        m = new
    # each block normalised on its own, then summed or averaged
    per_block = [torch.softmax(s[:, i:i + block], -1) @ v[i:i + block] for i in range(0, n, block)]
    whole = n // block * block  # the keys of the full blocks only
    return {
        "acc_not_rescaled": acc / l, "sum_not_rescaled": acc_ok / l_never, "neither_rescaled": acc / l_never,
        "summed": sum(per_block), "averaged": sum(per_block) / len(per_block),
        "unnormalised": torch.exp(s - s.max(-1, keepdim=True).values) @ v,  # the accumulator, no final division
        "block_max": acc_blk / l_blk, "divided_each_block": out_div,
        "unscaled": torch.softmax(q @ k.T, -1) @ v, "scaled_by_d": torch.softmax((q @ k.T) / q.shape[-1], -1) @ v,
        "last_block_skipped": torch.softmax(s[:, :whole], -1) @ v[:whole] if 0 < whole < n else None,
    }


_MISTAKES = [  # (variant, what the check says)
    ("unnormalised", "you return the accumulator without the final division: the weights of a row must sum to 1; "
                     "return acc / row_sum at the end"),
    ("summed", "you normalise each block on its own (a softmax per block) and then combine the blocks: a block's "
               "softmax ignores the other blocks' keys; keep an unnormalised accumulator and divide once by the "
               "running sum at the end"),
    ("averaged", "you normalise each block on its own (a softmax per block) and then combine the blocks: a block's "
                 "softmax ignores the other blocks' keys; keep an unnormalised accumulator and divide once by the "
                 "running sum at the end"),
    ("acc_not_rescaled", "you rescale row_sum but not acc: when a block raises the running max, what was "
                         "accumulated so far is still relative to the old max; multiply acc (and row_sum) by "
                         "exp(old_max - new_max) before adding the new block"),
    ("sum_not_rescaled", "you rescale acc but not row_sum: the running sum, too, was accumulated relative to the "
                         "old max; multiply row_sum (and acc) by exp(old_max - new_max) before adding the new block"),
    ("neither_rescaled", "neither acc nor row_sum is rescaled when a block raises the running max: what was "
                         "accumulated so far is relative to the old max; multiply both by exp(old_max - new_max) "
                         "before adding the new block"),
    ("block_max", "you take exp(s - block max) with this block's own max, not the running max: the block's terms "
                  "and the rescaled old ones must share one reference; p = exp(s - new_max), new_max = "
                  "max(row_max, block max)"),
    ("divided_each_block", "you divide acc by the running sum at every block, then rescale it next block as if it "
                           "were unnormalised: keep acc unnormalised and divide once at the end (or, to keep it "
                           "normalised, rescale the old output by row_sum_old * exp(old_max - new_max) / row_sum_new)"),
    ("unscaled", "your scores are not scaled: attention's scores are (q @ k_blk.T) / sqrt(d), d = q.shape[-1]"),
    ("scaled_by_d", "your scores are divided by d: attention's scores are (q @ k_blk.T) / sqrt(d), not / d"),
    ("last_block_skipped", "your loop skipped the last, partial block of keys: range(0, n, block) visits every "
                           "start, and k[start:start + block] is shorter at the end"),
]


_MATMULS = ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum", "tensordot", "inner", "linear")


def _Watch(m, n, keys):
    """A torch function mode noting whether any op returns an [m, n] (or [n, m]) tensor: the full scores;
    the shape of the first exp() that overflowed to inf (the correction [m, 1], or a block's p); and how
    many products read the keys: once per block in one pass. The keys are followed through views (they share
    its storage) and through whatever else is made of them but a product (a clone, a cast, a concatenation),
    so a second pass over a copy of K is counted too; what is made of them is held, so that its storage is
    not reused by an unrelated tensor."""
    import torch
    from torch.overrides import TorchFunctionMode

    made_of_keys = {keys.untyped_storage().data_ptr()}
    held = []

    def tensors(args):
        for a in args:
            if torch.is_tensor(a):
                yield a
            elif isinstance(a, (list, tuple)):
                yield from (x for x in a if torch.is_tensor(x))

    def reads_keys(args):
        return any(t.untyped_storage().data_ptr() in made_of_keys for t in tensors(args))

    class Watch(TorchFunctionMode):
        full = False
        overflow = None
        key_reads = 0
        widest = 0  # the most keys one product of the keys scored at once: a block's
        called: set = set()  # the names of the torch functions the answer called

        def __torch_function__(self, func, types, args=(), kwargs=None):
            import torch

            Watch.called = Watch.called | {getattr(func, "__name__", "")}

            product = getattr(func, "__name__", "") in _MATMULS
            from_keys = reads_keys(args)
            out = func(*args, **(kwargs or {}))
            if product and from_keys:
                Watch.key_reads += 1
                scores = tuple(getattr(out, "shape", ()))[-2:]  # [m, keys] or [keys, m]
                if len(scores) == 2 and m in scores:
                    Watch.widest = max(Watch.widest, scores[1] if scores[0] == m else scores[0])
            if from_keys and not product:  # a copy of (part of) K: its products read K too
                for t in tensors(out if isinstance(out, (list, tuple)) else (out,)):
                    if t.untyped_storage().data_ptr():
                        made_of_keys.add(t.untyped_storage().data_ptr())
                        held.append(t)
            shape = tuple(getattr(out, "shape", ()))
            if len(shape) >= 2 and shape[-2:] in ((m, n), (n, m)):
                Watch.full = True
            if (Watch.overflow is None and getattr(func, "__name__", "") in ("exp", "exp_", "exp2", "exp2_")
                    and torch.is_tensor(out) and torch.isposinf(out).any()):
                Watch.overflow = shape
            return out

    return Watch()


# What a check may not see an answer call: the function the exercise is to write, and its kernels.
_ATTENTION = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "multi_head_attention_forward")
# What keeps an online softmax finite: a running max, or a running log-sum-exp.
_STABILISERS = ("max", "amax", "maximum", "fmax", "logsumexp", "logaddexp", "logaddexp2")


def _cases(g):
    """(m, n, d, block, spread, offset, falling, apart): sizes that do and do not divide into blocks; scores
    moved by `offset` (a constant a row's softmax ignores) far enough that exp() of a raw score overflows
    (+100) or underflows to 0 (-110) in float32: only the running max (or log-sum-exp) keeps them finite;
    a first block scoring 100 above the others, where a running max taken as the block's own max falls and
    exp(old_max - new_max) overflows (elsewhere the keys rise, so that every block rescales); and rows
    120 apart (every other row moved down), where one max for the whole block, not one per row, leaves the
    lower rows' exp() at 0."""
    return ((8, 64, 16, 16, 1.0, 0.0, False, False), (5, 50, 8, 12, 3.0, 0.0, False, False),
            (6, 40, 8, 16, 1.0, 100.0, False, False), (7, 33, 8, 8, 1.0, -110.0, False, False),
            (6, 48, 8, 16, 1.0, 0.0, True, False), (6, 40, 8, 10, 1.0, 0.0, False, True))


def exercise_1(flash_attention_forward):
    """flash_attention_forward(q, k, v, block) -> [m, d], equal to SDPA of q over all of k, v."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(15)
    for m, n, d, block, spread, offset, falling, apart in _cases(g):
        q = torch.randn(m, d, generator=g) * spread
        k = torch.randn(n, d, generator=g) * spread
        if offset:  # the last dimension adds offset to every score: q's is offset * sqrt(d), k's is 1
            q[:, -1], k[:, -1] = offset * math.sqrt(d), 1.0
        v = torch.randn(n, d, generator=g)
        # Keys sorted so that later blocks raise the max: the rescaling is exercised on every row.
        order = (q.mean(0, keepdim=True) @ k.T).squeeze(0).argsort()
        k, v = k[order].contiguous(), v[order].contiguous()
        if falling:  # the first block's scores 50 above the row's others, the rest 50 below: the max falls by 100
            q[:, -1], k[:, -1] = 50.0 * math.sqrt(d), -1.0
            k[:block, -1] = 1.0
        if apart:  # every other row's scores 120 below the rows beside it
            q[:, -1], k[:, -1] = 0.0, 1.0
            q[1::2, -1] = -120.0 * math.sqrt(d)
        keys = k.clone()
        with _Watch(m, n, keys) as watch:
            got = flash_attention_forward(q.clone(), keys, v.clone(), block)
        want = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        banned = sorted(set(_ATTENTION) & watch.called)
        if banned:
            raise AssertionError(f"your code calls {banned[0]}: that is the attention this exercise writes "
                                 f"itself, block by block; compute q @ k_blk.T, the online softmax and p @ v_blk")
        assert tuple(got.shape) == tuple(want.shape), (
            f"the output has shape {tuple(got.shape)}; one row per query, one column per value dimension: "
            f"{tuple(want.shape)}")
        if not torch.isfinite(got).all():
            if apart:
                raise AssertionError("a NaN or an infinity in your output where every other row's scores are 120 "
                                     "below the rows beside it: your max is one number for the whole block, so the "
                                     "lower rows' exp(s - max) are all 0 and their sum is 0; each row needs its own "
                                     "running max, s.max(dim=-1, keepdim=True)")
            if offset and not set(_STABILISERS) & watch.called:
                raise AssertionError(f"a NaN or an infinity in your output where every score is near {offset:+.0f}: "
                                     f"exp() of a raw score is {'inf' if offset > 0 else '0'} in float32. The online "
                                     f"softmax subtracts the running max before exp: new_max = max(row_max, block "
                                     f"max), p = exp(s - new_max), and rescales what it holds by "
                                     f"exp(old_max - new_max)")
            if watch.overflow is not None and watch.overflow[-1] == 1:
                if falling and "maximum" not in watch.called and "fmax" not in watch.called:
                    raise AssertionError("a NaN or an infinity in your output where a later block's scores are far "
                                         "below an earlier one's: your running max fell to the block's own max, and "
                                         "exp(old_max - new_max) overflowed; the running max only grows, new_max = "
                                         "torch.maximum(row_max, block max)")
                raise AssertionError("a NaN or an infinity in your output: your correction exp() overflowed to "
                                     "inf; it is exp(old_max - new_max), at most 1 (0 on the first block, where "
                                     "old_max is -inf), not exp(new_max - old_max)")
            if watch.overflow is not None:
                raise AssertionError("a NaN or an infinity in your output: exp() of a block's scores overflowed to "
                                     "inf: you subtracted the old running max (-inf on the first block); take the "
                                     "new max first, new_max = max(row_max, block max), then p = exp(s - new_max)")
            raise AssertionError("a NaN or an infinity in your output: subtract the new running max (after "
                                 "torch.maximum with this block's) before exp, and start the running max at -inf "
                                 "only where it is combined with torch.maximum")
        if max_rel_diff(got, want) <= 1e-4:
            if watch.full:
                raise AssertionError(f"the output is right, but your code formed a [{m}, {n}] tensor: the scores of "
                                     f"every key at once, which is what FlashAttention never writes out; compute "
                                     f"q @ k_blk.T for one block of {block} keys at a time")
            blocks = -(-n // block)
            if block < watch.widest < n:
                raise AssertionError(f"the output is right, but your code scored {watch.widest} keys at once where "
                                     f"a block holds {block}: take the block size from the argument, "
                                     f"k[start:start + block] for start in range(0, n, block)")
            if watch.key_reads > blocks:
                raise AssertionError(f"the output is right, but your code multiplied by the keys {watch.key_reads} "
                                     f"times for {blocks} blocks: it reads every block of K twice (a first pass "
                                     f"for the max, a second for the sums). The online softmax reads each block "
                                     f"once: keep the running max and rescale what was accumulated when it grows")
            continue
        wrong = _blocked_variants(q, k, v, block)
        for variant, message in _MISTAKES:
            if wrong[variant] is not None and max_rel_diff(got, wrong[variant]) <= 1e-4:
                raise AssertionError(message)
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


def _miscounts(kind, shape, b):
    """(what was miscounted, intensity) for the ways of counting FLOPs, tensors and bytes per element that
    learners get wrong, the fewest mistakes first."""
    if kind == "matmul":
        m, k, n = shape
        tensors = {"A [m, k]": m * k, "B [k, n]": k * n, "C [m, n]": m * n}
        flop_counts = {2: None, 1: "a matmul does m*k*n multiplies AND m*k*n adds, 2*m*k*n FLOPs"}
        work = m * k * n
    else:
        (numel,) = shape
        tensors = {"a": numel, "b": numel, "c": numel}
        flop_counts = {1: None, 2: "an add is one FLOP per element", 3: "an add is one FLOP per element"}
        work = numel
    names = list(tensors)
    subsets = [names[:i] + names[i + 1:] for i in range(len(names))] + [[x] for x in names]
    sizes = {b: None}
    for size, said in ((4, "you counted 4 bytes per element"), (2, "you counted 2 bytes per element"),
                       (8 * b, "you counted bits, not bytes: torch.finfo(dtype).bits // 8 is the size in bytes"),
                       (1, "your intensity is per element, not per byte")):
        sizes.setdefault(size, said)
    out = []
    for factor, flop_wrong in flop_counts.items():
        for counted in [names] + subsets:
            for size, size_wrong in sizes.items():
                wrong = [w for w in (flop_wrong, size_wrong) if w]
                if size_wrong and size != 1:
                    wrong[-1] = f"{size_wrong}, {b} for this dtype"
                if counted != names:
                    wrong.append(_tensors_wrong(kind, counted))
                if wrong:
                    elements = sum(tensors[t] for t in counted)
                    out.append((len(wrong), "; and ".join(wrong), factor * work / (elements * size)))
    return [(what, ai) for _, what, ai in sorted(out, key=lambda w: w[0])]


def _tensors_wrong(kind, counted):
    if kind == "matmul" and counted == ["A [m, k]", "B [k, n]"]:
        return ("you counted the inputs' bytes but not the output's: the [m, n] result is written to memory too, "
                "(m*k + k*n + m*n) elements")
    if kind == "matmul":
        return (f"you counted only {' and '.join(counted)}: a matmul reads A [m, k] and B [k, n] and writes "
                f"C [m, n], (m*k + k*n + m*n) elements")
    word = {1: "one tensor's", 2: "two tensors'"}[len(counted)]
    return f"you counted {word} bytes; c = a + b reads a and b and writes c: 3 * numel elements"


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
        # Exactly at the ridge: an fp32 add does 1 FLOP per 12 bytes, on a device of 1 TFLOP/s and 12 TB/s
        # (1e12 / 12e12 and 2^20 / (12 x 2^20) round to the same double): compute-bound, "at or above".
        ("elementwise", (1 << 20,), torch.float32, (1e12, 12e12)),
    ]
    bounds = []
    for kind, shape, dtype, (peak, bw) in cases:
        got = roofline(kind, shape, dtype, peak, bw)
        assert isinstance(got, tuple) and len(got) == 2, "return a tuple (intensity, 'memory' or 'compute')"
        ai, bound = got
        require_finite(float(ai), f"your intensity for {kind} {shape} in {dtype}")
        want_ai, want_bound, flops, moved, b = _expected(kind, shape, dtype, peak, bw)
        what = f"{kind} {shape} in {dtype} on peak {peak:.3g} FLOP/s, {bw:.3g} B/s"
        if not math.isclose(float(ai), want_ai, rel_tol=1e-6):
            # One of the sizes taken for all three (the square n x n x n matmul's 2n^3 / 3n^2 b = 2n / 3b).
            square = [d for d in dict.fromkeys(shape) if kind == "matmul" and len(set(shape)) > 1
                      and math.isclose(float(ai), 2 * d / (3 * b), rel_tol=1e-6)]
            if square:
                raise AssertionError(f"{what}: intensity {float(ai):.4g} FLOP/byte, expected {want_ai:.4g}: you "
                                     f"counted a square {square[0]} x {square[0]} x {square[0]} matmul; this one is "
                                     f"m x k x n = {' x '.join(map(str, shape))}: 2*m*k*n FLOPs over "
                                     f"(m*k + k*n + m*n) elements")
            for wrong, wrong_ai in _miscounts(kind, shape, b):
                if math.isclose(float(ai), wrong_ai, rel_tol=1e-6):
                    raise AssertionError(f"{what}: intensity {float(ai):.4g} FLOP/byte, expected {want_ai:.4g}: "
                                         f"{wrong}")
            raise AssertionError(f"{what}: intensity {float(ai):.4g} FLOP/byte, expected {want_ai:.4g} "
                                 f"({flops:.4g} FLOPs / {moved:.4g} bytes)")
        assert bound in ("memory", "compute"), f"{what}: say the bound as 'memory' or 'compute', not {bound!r}"
        bounds.append((what, want_ai, peak / bw, want_bound, bound))
    _judge_bounds(bounds)


def _judge_bounds(bounds):
    """Every case's bound against the ridge point: a rule applied the wrong way shows on all of them."""
    if all(got == want for *_, want, got in bounds):
        return

    def rule(compute_if):
        return all(got == ("compute" if compute_if(ai, ridge) else "memory") for _, ai, ridge, _, got in bounds)

    if rule(lambda ai, ridge: ai < ridge):
        raise AssertionError("your bounds are the wrong way round in every case: below the ridge, memory is the "
                             "limit (the compute units wait for data); at or above it, compute is")
    if rule(lambda ai, ridge: ai > ridge):
        raise AssertionError("at the ridge point itself you said memory: an intensity equal to peak / bandwidth "
                             "takes as long to move its bytes as to do its FLOPs, and the rule counts it as "
                             "compute-bound (intensity >= ridge)")
    if rule(lambda ai, ridge: ai >= 1 / ridge):
        raise AssertionError("your ridge point is bandwidth / peak; it is peak_flops / bandwidth, in FLOP per byte: "
                             "the intensity at which moving the bytes takes as long as doing the FLOPs")
    what, ai, ridge, want, got = next(b for b in bounds if b[3] != b[4])
    raise AssertionError(f"{what}: intensity {ai:.4g} against a ridge point of {ridge:.4g} FLOP/byte (peak / "
                         f"bandwidth) makes it {want}-bound, you said {got!r}: below the ridge, memory is the limit")
