"""Part 15's answers: FlashAttention's forward with an online softmax over blocks of keys, and the
arithmetic intensity of a matmul and an elementwise add against a device's ridge point."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 15

_FA_HEAD = '''
def flash_attention_forward(q, k, v, block):
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
'''

_RF_HEAD = '''
def roofline(kind, shape, dtype, peak_flops, bandwidth):
    nbytes = torch.finfo(dtype).bits // 8
'''


def _roofline(matmul, elementwise, bound='"compute" if ai >= peak_flops / bandwidth else "memory"', head=_RF_HEAD):
    """A roofline answer from its two counts, each `flops, moved = ...`, and its bound."""
    return head + f'''
    if kind == "matmul":
        m, k, n = shape
        {matmul}
    else:
        (numel,) = shape
        {elementwise}
    ai = flops / moved
    return ai, {bound}
'''


_MATMUL = "flops, moved = 2 * m * k * n, (m * k + k * n + m * n) * nbytes"
_ADD = "flops, moved = numel, 3 * numel * nbytes"

WRONG = [  # (exercise, label, what the check must say, answer source)
    (2, 'compute only above the ridge (strict >)', 'at the ridge point itself', '''
def roofline(kind, shape, dtype, peak_flops, bandwidth):
    nbytes = torch.finfo(dtype).bits // 8
    if kind == "matmul":
        m, k, n = shape
        flops, moved = 2 * m * k * n, (m * k + k * n + m * n) * nbytes
    else:
        (numel,) = shape
        flops, moved = numel, 3 * numel * nbytes
    intensity = flops / moved
    return intensity, "compute" if intensity > peak_flops / bandwidth else "memory"
'''),
    (1, "the running max as the block's own max", "your running max fell to the block's own max", '''
def flash_attention_forward(q, k, v, block):
    scale = q.shape[-1] ** -0.5
    row_max = torch.full((q.shape[0], 1), float("-inf"))
    row_sum = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        k_blk, v_blk = k[start:start + block], v[start:start + block]
        s = (q @ k_blk.T) * scale
        new_max = s.max(dim=-1, keepdim=True).values     # this block's max
        correction = torch.exp(row_max - new_max)
        p = torch.exp(s - new_max)
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    (1, "scaled_dot_product_attention called", "your code calls scaled_dot_product_attention", '''
def flash_attention_forward(q, k, v, block):
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]
'''),
    (1, "SDPA per block, merged by log-sum-exp", "your code calls scaled_dot_product_attention", '''
def flash_attention_forward(q, k, v, block):
    out, lse = 0, None
    for start in range(0, k.shape[0], block):
        k_blk, v_blk = k[start:start + block], v[start:start + block]
        o = torch.nn.functional.scaled_dot_product_attention(q[None], k_blk[None], v_blk[None])[0]
        l = torch.logsumexp(q @ k_blk.T / math.sqrt(q.shape[-1]), dim=-1, keepdim=True)
        if lse is None:
            out, lse = o, l
        else:
            new = torch.logaddexp(lse, l)
            out, lse = out * torch.exp(lse - new) + o * torch.exp(l - new), new
    return out
'''),
    (1, "an online softmax with no running max", "exp() of a raw score is inf", '''
def flash_attention_forward(q, k, v, block):
    scale = q.shape[-1] ** -0.5
    row_sum = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        p = torch.exp((q @ k[start:start + block].T) * scale)
        row_sum = row_sum + p.sum(dim=-1, keepdim=True)
        acc = acc + p @ v[start:start + block]
    return acc / row_sum
'''),
    # The block size written in, not taken from the argument: right output, blocks of the wrong size.
    (1, "block size fixed at 16", "scored 16 keys at once where a block holds 12",
     _FA_HEAD.replace("    scale =", "    block = 16\n    scale =") + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    # One max for the whole block: any shift cancels in a row's softmax, but not when rows lie far apart.
    (1, "one scalar max per block", "your max is one number for the whole block",
     _FA_HEAD.replace("s.max(dim=-1, keepdim=True).values", "s.max()") + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    (1, "accumulator not rescaled", "you rescale row_sum but not acc", _FA_HEAD + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    (1, "running sum not rescaled", "you rescale acc but not row_sum", _FA_HEAD + '''
        row_sum = row_sum + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    (1, "nothing rescaled", "neither acc nor row_sum is rescaled", _FA_HEAD + '''
        row_sum = row_sum + p.sum(dim=-1, keepdim=True)
        acc = acc + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    (1, "the block's max, not the running max", "with this block's own max, not the running max", '''
def flash_attention_forward(q, k, v, block):
    scale = q.shape[-1] ** -0.5
    row_max = torch.full((q.shape[0], 1), float("-inf"))
    row_sum = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        k_blk, v_blk = k[start:start + block], v[start:start + block]
        s = (q @ k_blk.T) * scale
        block_max = s.max(dim=-1, keepdim=True).values
        new_max = torch.maximum(row_max, block_max)
        correction = torch.exp(row_max - new_max)
        p = torch.exp(s - block_max)
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    (1, "divides at every block", "you divide acc by the running sum at every block", _FA_HEAD + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = (acc * correction + p @ v_blk) / row_sum
        row_max = new_max
    return acc
'''),
    (1, "normalised per block", "you normalise each block on its own", '''
def flash_attention_forward(q, k, v, block):
    scale = q.shape[-1] ** -0.5
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        s = (q @ k[start:start + block].T) * scale
        acc = acc + torch.softmax(s, dim=-1) @ v[start:start + block]
    return acc
'''),
    (1, "no final division", "without the final division", _FA_HEAD + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc
'''),
    (1, "scores not scaled", "your scores are not scaled", _FA_HEAD.replace(") * scale", ")") + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    (1, "the last partial block skipped", "skipped the last, partial block",
     _FA_HEAD.replace("range(0, k.shape[0], block)", "range(0, k.shape[0] - block + 1, block)") + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    # exp(s - row_max) with the old max, -inf on the first block: exp(inf) = inf, then inf - inf = NaN.
    (1, "old max in exp", "you subtracted the old running max", '''
def flash_attention_forward(q, k, v, block):
    scale = q.shape[-1] ** -0.5
    row_max = torch.full((q.shape[0], 1), float("-inf"))
    row_sum = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        k_blk, v_blk = k[start:start + block], v[start:start + block]
        s = (q @ k_blk.T) * scale
        p = torch.exp(s - row_max)
        new_max = torch.maximum(row_max, s.max(dim=-1, keepdim=True).values)
        correction = torch.exp(row_max - new_max)
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    (1, "correction upside down", "not exp(new_max - old_max)",
     _FA_HEAD.replace("torch.exp(row_max - new_max)", "torch.exp(new_max - row_max)") + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    (1, "two passes over the keys", "reads every block of K twice", '''
def flash_attention_forward(q, k, v, block):
    scale = q.shape[-1] ** -0.5
    row_max = torch.full((q.shape[0], 1), float("-inf"))
    for start in range(0, k.shape[0], block):  # first pass: the max of every row
        s = (q @ k[start:start + block].T) * scale
        row_max = torch.maximum(row_max, s.max(dim=-1, keepdim=True).values)
    row_sum = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):  # second pass: no rescaling needed
        p = torch.exp((q @ k[start:start + block].T) * scale - row_max)
        row_sum = row_sum + p.sum(dim=-1, keepdim=True)
        acc = acc + p @ v[start:start + block]
    return acc / row_sum
'''),
    # The same two passes over a copy of K, and over blocks copied one by one: K is read twice all the same.
    (1, "two passes over a copy of the keys", "reads every block of K twice", '''
def flash_attention_forward(q, k, v, block):
    scale = q.shape[-1] ** -0.5
    keys = k.clone()
    row_max = torch.full((q.shape[0], 1), float("-inf"))
    for start in range(0, keys.shape[0], block):  # first pass: the max of every row
        s = (q @ keys[start:start + block].T) * scale
        row_max = torch.maximum(row_max, s.max(dim=-1, keepdim=True).values)
    row_sum = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, keys.shape[0], block):  # second pass: no rescaling needed
        k_blk = keys[start:start + block].to(torch.float64).float()
        p = torch.exp((q @ k_blk.T) * scale - row_max)
        row_sum = row_sum + p.sum(dim=-1, keepdim=True)
        acc = acc + p @ v[start:start + block]
    return acc / row_sum
'''),
    (1, "whole score matrix", "your code formed a [8, 64] tensor", '''
def flash_attention_forward(q, k, v, block):
    scores = (q @ k.T) * q.shape[-1] ** -0.5
    return torch.softmax(scores, dim=-1) @ v
'''),
    (2, "matmul FLOPs without the add", "2*m*k*n FLOPs",
     _roofline("flops, moved = m * k * n, (m * k + k * n + m * n) * nbytes", _ADD)),
    (2, "a square matmul's counts", "you counted a square 1024 x 1024 x 1024 matmul",
     _roofline("flops, moved = 2 * m ** 3, 3 * m * m * nbytes", _ADD)),
    (2, "output bytes forgotten", "you counted the inputs' bytes but not the output's",
     _roofline("flops, moved = 2 * m * k * n, (m * k + k * n) * nbytes", _ADD)),
    (2, "only the weights' bytes", "you counted only B [k, n]",
     _roofline("flops, moved = 2 * m * k * n, k * n * nbytes", _ADD)),
    (2, "the add reads one tensor", "you counted one tensor's bytes",
     _roofline(_MATMUL, "flops, moved = numel, numel * nbytes")),
    (2, "always 4 bytes", "you counted 4 bytes per element",
     _roofline(_MATMUL, _ADD, head="\ndef roofline(kind, shape, dtype, peak_flops, bandwidth):\n    nbytes = 4\n")),
    (2, "always bf16's 2 bytes", "you counted 2 bytes per element",
     _roofline(_MATMUL, _ADD, head="\ndef roofline(kind, shape, dtype, peak_flops, bandwidth):\n    nbytes = 2\n")),
    (2, "bits for bytes", "you counted bits, not bytes", _roofline(_MATMUL, _ADD, head='''
def roofline(kind, shape, dtype, peak_flops, bandwidth):
    nbytes = torch.finfo(dtype).bits
''')),
    (2, "ridge reversed", "below the ridge, memory is the limit",
     _roofline(_MATMUL, _ADD, bound='"memory" if ai >= peak_flops / bandwidth else "compute"')),
    (2, "ridge as bandwidth over peak", "your ridge point is bandwidth / peak",
     _roofline(_MATMUL, _ADD, bound='"compute" if ai >= bandwidth / peak_flops else "memory"')),
    # The bytes of an empty tensor (0), not of an element: a tensor divided by 0 is inf, not an error.
    (2, "bytes of an empty tensor", "a NaN or an infinity in your intensity", '''
def roofline(kind, shape, dtype, peak_flops, bandwidth):
    nbytes = torch.empty(0, dtype=dtype).nbytes
    dims = torch.tensor(shape)
    if kind == "matmul":
        m, k, n = dims
        flops, moved = 2 * m * k * n, (m * k + k * n + m * n) * nbytes
    else:
        flops, moved = dims[0], 3 * dims[0] * nbytes
    ai = flops / moved
    return ai, "compute" if ai >= peak_flops / bandwidth else "memory"
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    # Each block copied to float64 once, its copies freed as it goes: one product per block of K.
    (1, "each block copied to float64", '''
def flash_attention_forward(q, k, v, block):
    q64, scale = q.double(), q.shape[-1] ** -0.5
    row_max = torch.full((q.shape[0], 1), float("-inf"), dtype=torch.float64)
    row_sum = torch.zeros(q.shape[0], 1, dtype=torch.float64)
    acc = torch.zeros(q.shape[0], v.shape[-1], dtype=torch.float64)
    for start in range(0, k.shape[0], block):
        k_blk, v_blk = k[start:start + block].double().contiguous(), v[start:start + block].double()
        s = (q64 @ k_blk.T) * scale
        new_max = torch.maximum(row_max, s.max(dim=-1, keepdim=True).values)
        p = torch.exp(s - new_max)
        c = torch.exp(row_max - new_max)
        row_sum = row_sum * c + p.sum(dim=-1, keepdim=True)
        acc = acc * c + p @ v_blk
        row_max = new_max
    return (acc / row_sum).float()
'''),
    (1, "normalised output updated every block", '''
def flash_attention_forward(q, k, v, block):
    scale = q.shape[-1] ** -0.5
    row_max = torch.full((q.shape[0], 1), float("-inf"))
    row_sum = torch.zeros(q.shape[0], 1)
    out = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        s = (q @ k[start:start + block].T) * scale
        new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
        p = torch.exp(s - new_max)
        new_sum = row_sum * torch.exp(row_max - new_max) + p.sum(dim=-1, keepdim=True)
        out = out * (row_sum * torch.exp(row_max - new_max) / new_sum) + (p @ v[start:start + block]) / new_sum
        row_max, row_sum = new_max, new_sum
    return out
'''),
    (1, "a running log-sum-exp", '''
def flash_attention_forward(q, k, v, block):
    lse = torch.full((q.shape[0], 1), float("-inf"))
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        s = q @ k[start:start + block].T / math.sqrt(q.shape[-1])
        new_lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1, keepdim=True))
        acc = acc * torch.exp(lse - new_lse) + torch.exp(s - new_lse) @ v[start:start + block]
        lse = new_lse
    return acc
'''),
    (1, "blocks from the last, in base 2", '''
def flash_attention_forward(q, k, v, block):
    log2e = 1.4426950408889634
    scale = q.shape[-1] ** -0.5 * log2e  # exp(x) = 2 ** (x * log2(e)), as the kernels compute it
    row_max = torch.full((q.shape[0], 1), float("-inf"))
    row_sum = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[-1])
    starts = list(range(0, k.shape[0], block))
    for start in reversed(starts):
        s = (q @ k[start:start + block].T) * scale
        new_max = torch.maximum(row_max, s.max(dim=-1, keepdim=True).values)
        correction = torch.exp2(row_max - new_max)
        p = torch.exp2(s - new_max)
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v[start:start + block]
        row_max = new_max
    return acc / row_sum
'''),
    (2, "itemsize, math.prod and a strict comparison", '''
def roofline(kind, shape, dtype, peak_flops, bandwidth):
    if kind == "matmul":
        m, k, n = shape
        flops = 2 * math.prod(shape)
        elements = m * k + k * n + m * n
    else:
        flops = math.prod(shape)
        elements = 3 * math.prod(shape)
    intensity = flops / (elements * dtype.itemsize)
    ridge = peak_flops / bandwidth
    return intensity, "memory" if intensity < ridge else "compute"
'''),
    (2, "times, not intensities", '''
from fractions import Fraction


def roofline(kind, shape, dtype, peak_flops, bandwidth):
    size = torch.tensor([], dtype=dtype).element_size()
    if kind == "matmul":
        m, k, n = shape
        flops, moved = 2 * m * k * n, (m * k + k * n + m * n) * size
    else:
        flops, moved = shape[0], 3 * shape[0] * size
    # the slower of doing the FLOPs and moving the bytes is the limit
    compute_s, memory_s = flops / peak_flops, moved / bandwidth
    return float(Fraction(flops, moved)), "memory" if memory_s > compute_s else "compute"
'''),
]
