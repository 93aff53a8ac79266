"""Part 12's answers: the layers of each rank's virtual stages (interleaved, and DualPipeV's V), and a
linear layer's backward split into its input-gradient and weight-gradient halves."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 12

# Exercise 1's check grades both functions; a wrong answer to one comes with the right other one.
RIGHT_LAYERS = '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]
'''
RIGHT_V = '''
def v_placement(p):
    return [[r, 2 * p - 1 - r] for r in range(p)]
'''
RIGHT_INPUT = '''
def input_grad(grad_out, weight):
    return grad_out @ weight
'''
RIGHT_WEIGHT = '''
def weight_grad(x, grad_out):
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return g.t() @ x.reshape(-1, x.shape[-1]), g.sum(0)
'''

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "contiguous layers per rank", "one contiguous run of layers cut into chunks", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[r * v + c] for c in range(v)] for r in range(p)]
''' + RIGHT_V),
    (1, "remainder dropped", "are on no rank", '''
def layer_assignment(n_layers, p, v):
    size = n_layers // (p * v)
    virtual = [list(range(s * size, (s + 1) * size)) for s in range(p * v)]
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]
''' + RIGHT_V),
    (1, "remainder on the last stages", "take the extra layers (virtual stage 0 first)", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s >= stages - extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]
''' + RIGHT_V),
    (1, "rounded up, the rest to the last", "differ by at most one", '''
import math


def layer_assignment(n_layers, p, v):
    size = math.ceil(n_layers / (p * v))
    virtual = [list(range(min(s * size, n_layers), min((s + 1) * size, n_layers))) for s in range(p * v)]
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]
''' + RIGHT_V),
    (1, "a lap of v ranks", "chunk c of rank r is virtual stage c·p + r", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[c * v + r] for c in range(v)] for r in range(p)]
''' + RIGHT_V),
    (1, "layers counted from 1", "layer ids count from 0", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 1
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]
''' + RIGHT_V),
    # Ragged chunks padded into one tensor with NaN: 10 layers over 4 virtual stages leave NaN ids.
    (1, "NaN-padded chunks", "a NaN or an infinity in your layer ids", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    ids = torch.full((stages, base + (extra > 0)), float("nan"))
    start = 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        ids[s, :size] = torch.arange(start, start + size)
        start += size
    return [[ids[c * p + r].tolist() for c in range(v)] for r in range(p)]
''' + RIGHT_V),
    (1, "the engine's partition called", "calls the engine's partition", '''
def layer_assignment(n_layers, p, v):
    return [[list(c) for c in rank_chunks(split(n_layers, p, v), r, p, v)] for r in range(p)]
''' + RIGHT_V),
    (1, "V placed as a loop", "is interleaving's loop", RIGHT_LAYERS + '''
def v_placement(p):
    return [[r, p + r] for r in range(p)]
'''),
    (1, "V off by one", "are not", RIGHT_LAYERS + '''
def v_placement(p):
    return [[r, 2 * p - r] for r in range(p)]
'''),
    # The V walked stage by stage, one stage short: rank 0's second stage is never written.
    (1, "V buffer one stage short", "a NaN or an infinity in your stages", RIGHT_LAYERS + '''
def v_placement(p):
    placement = torch.full((p, 2), float("nan"))
    for s in range(2 * p - 1):
        placement[s if s < p else 2 * p - 1 - s, s // p] = s
    return placement.tolist()
'''),
    (1, "V chunks swapped", "chunk 0 carries the micro-batches down", RIGHT_LAYERS + '''
def v_placement(p):
    return [[2 * p - 1 - r, r] for r in range(p)]
'''),
    (1, "V upside down", "stage 0 on rank 0", RIGHT_LAYERS + '''
def v_placement(p):
    return [[p - 1 - r, p + r] for r in range(p)]
'''),
    (2, "weight gradient transposed", "it is transposed", RIGHT_INPUT + '''
def weight_grad(x, grad_out):
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return x.reshape(-1, x.shape[-1]).t() @ g, g.sum(0)
'''),
    (2, "input gradient with W transposed", "dL/dx = grad_out @ W", '''
def input_grad(grad_out, weight):
    return grad_out @ weight.t()
''' + RIGHT_WEIGHT),
    (2, "per batch element", "sum over batch and sequence", RIGHT_INPUT + '''
def weight_grad(x, grad_out):
    return grad_out.transpose(-1, -2) @ x, grad_out.sum((0, 1))
'''),
    (2, "bias mean", "its gradient is the sum", RIGHT_INPUT + '''
def weight_grad(x, grad_out):
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return g.t() @ x.reshape(-1, x.shape[-1]), g.mean(0)
'''),
    # The weight gradient summed into an uninitialised buffer (torch.empty, not zeros; NaN here, the same every run).
    (2, "summed into torch.empty", "a NaN or an infinity in your (weight, bias) gradients", RIGHT_INPUT + '''
def weight_grad(x, grad_out):
    g, xs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_w = torch.full((g.shape[1], xs.shape[1]), float("nan"), dtype=x.dtype)
    for t in range(g.shape[0]):
        grad_w += torch.outer(g[t], xs[t])
    return grad_w, g.sum(0)
'''),
    (2, "weight gradient a mean over tokens", "the mean over the 10 tokens", RIGHT_INPUT + '''
def weight_grad(x, grad_out):
    g, xs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    return g.t() @ xs / g.shape[0], g.sum(0)
'''),
    (2, "a float32 buffer", "float32", RIGHT_INPUT + '''
def weight_grad(x, grad_out):
    g, xs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_w, grad_b = torch.zeros(g.shape[1], xs.shape[1]), torch.zeros(g.shape[1])
    for t in range(g.shape[0]):
        grad_w += torch.outer(g[t], xs[t])
        grad_b += g[t]
    return grad_w, grad_b
'''),
    (2, "bias summed over the batch only", "the bias is added to every token", RIGHT_INPUT + '''
def weight_grad(x, grad_out):
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return g.t() @ x.reshape(-1, x.shape[-1]), grad_out.sum(0)
'''),
    (2, "not flattened", "flatten x and grad_out", RIGHT_INPUT + '''
def weight_grad(x, grad_out):
    return grad_out.t() @ x, grad_out.sum((0, 1))
'''),
    (2, "bias gradient left out", "the bias gradient is NoneType", RIGHT_INPUT + '''
def weight_grad(x, grad_out):
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return g.t() @ x.reshape(-1, x.shape[-1]), None  # the bias has no weight to wait for
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "tensor_split and a zipped V", '''
def layer_assignment(n_layers, p, v):
    groups = [g.tolist() for g in torch.arange(n_layers).tensor_split(p * v)]
    return [[groups[c * p + r] for c in range(v)] for r in range(p)]


def v_placement(p):
    return list(zip(range(p), reversed(range(p, 2 * p))))
'''),
    (1, "ranges, dealt stage by stage", '''
def layer_assignment(n_layers, p, v):
    out = [[None] * v for _ in range(p)]
    start = 0
    for s in range(p * v):
        size = n_layers // (p * v) + (s < n_layers % (p * v))
        out[s % p][s // p] = range(start, start + size)
        start += size
    return out


def v_placement(p):
    placement = [[None, None] for _ in range(p)]
    for s in range(2 * p):
        rank = s if s < p else 2 * p - 1 - s
        placement[rank][s // p] = s
    return placement
'''),
    (2, "einsum", '''
def input_grad(grad_out, weight):
    return torch.einsum("bso,oi->bsi", grad_out, weight)


def weight_grad(x, grad_out):
    return torch.einsum("bso,bsi->oi", grad_out, x), torch.einsum("bso->o", grad_out)
'''),
    (2, "per sequence, then summed", '''
def input_grad(grad_out, weight):
    return torch.nn.functional.linear(grad_out, weight.t())


def weight_grad(x, grad_out):
    return (grad_out.transpose(-1, -2) @ x).sum(0), grad_out.sum(0).sum(0)
'''),
    (2, "tensordot", '''
def input_grad(grad_out, weight):
    return torch.tensordot(grad_out, weight, dims=1)


def weight_grad(x, grad_out):
    return torch.tensordot(grad_out, x, dims=([0, 1], [0, 1])), grad_out.flatten(0, -2).sum(0)
'''),
]
