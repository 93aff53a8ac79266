"""Cases for Part 15: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

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

MISTAKES = [
    ("1", "accumulator not rescaled", "multiply acc (and row_sum) by exp(old_max - new_max)", _FA_HEAD + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc + p @ v_blk
        row_max = new_max
    return acc / row_sum
'''),
    ("1", "normalised per block", "you normalise each block on its own", '''
def flash_attention_forward(q, k, v, block):
    scale = q.shape[-1] ** -0.5
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for start in range(0, k.shape[0], block):
        s = (q @ k[start:start + block].T) * scale
        acc = acc + torch.softmax(s, dim=-1) @ v[start:start + block]
    return acc
'''),
    ("1", "no final division", "without the final division", _FA_HEAD + '''
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v_blk
        row_max = new_max
    return acc
'''),
    ("2", "matmul FLOPs without the add", "2*m*k*n FLOPs", _RF_HEAD + '''
    if kind == "matmul":
        m, k, n = shape
        flops, moved = m * k * n, (m * k + k * n + m * n) * nbytes
    else:
        flops, moved = shape[0], 3 * shape[0] * nbytes
    ai = flops / moved
    return ai, "compute" if ai >= peak_flops / bandwidth else "memory"
'''),
    ("2", "output bytes forgotten", "you counted the inputs' bytes but not the output's", _RF_HEAD + '''
    if kind == "matmul":
        m, k, n = shape
        flops, moved = 2 * m * k * n, (m * k + k * n) * nbytes
    else:
        flops, moved = shape[0], 3 * shape[0] * nbytes
    ai = flops / moved
    return ai, "compute" if ai >= peak_flops / bandwidth else "memory"
'''),
    ("2", "always 4 bytes", "you counted 4 bytes per element", '''
def roofline(kind, shape, dtype, peak_flops, bandwidth):
    if kind == "matmul":
        m, k, n = shape
        flops, moved = 2 * m * k * n, (m * k + k * n + m * n) * 4
    else:
        flops, moved = shape[0], 3 * shape[0] * 4
    ai = flops / moved
    return ai, "compute" if ai >= peak_flops / bandwidth else "memory"
'''),
    ("2", "ridge reversed", "below the ridge, memory is the limit", _RF_HEAD + '''
    if kind == "matmul":
        m, k, n = shape
        flops, moved = 2 * m * k * n, (m * k + k * n + m * n) * nbytes
    else:
        flops, moved = shape[0], 3 * shape[0] * nbytes
    ai = flops / moved
    return ai, "memory" if ai >= peak_flops / bandwidth else "compute"
'''),
    # exp(s - row_max) with the old max, -inf on the first block: exp(inf) = inf, then inf - inf = NaN.
    ("1", "old max in exp", "a NaN or an infinity in your output", '''
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
    # The bytes of an empty tensor (0), not of an element: a tensor divided by 0 is inf, not an error.
    ("2", "bytes of an empty tensor", "a NaN or an infinity in your intensity", '''
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

PRINTED = [
    "datasheet  HBM3 bandwidth (TB/s)                        3.35",
    "on-chip SRAM in all: 33 MiB, against 80 GB of HBM",
    "ridge point (BF16 peak / HBM bandwidth): 295 FLOP per byte read or written",
    "add   : intensity   0.08 FLOP/byte",
    "matmul: intensity  64.00 FLOP/byte",
    "same values as eager: True",
    "softmax from the blocked normaliser == torch.softmax: True",
    "naive attention at 4096 tokens, 32 heads: scores 1.0 GiB in bf16",
]

MISTAKES.append(("1", "whole score matrix", "your code formed a [8, 64] tensor", '''
def flash_attention_forward(q, k, v, block):
    scores = (q @ k.T) * q.shape[-1] ** -0.5
    return torch.softmax(scores, dim=-1) @ v
'''))
