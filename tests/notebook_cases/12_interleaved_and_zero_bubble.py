"""Cases for Part 12: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

MISTAKES = [
    ("1", "contiguous layers per rank", "one contiguous run of layers cut into chunks", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[r * v + c] for c in range(v)] for r in range(p)]


def v_placement(p):
    return [[r, 2 * p - 1 - r] for r in range(p)]
'''),
    ("1", "remainder dropped", "are on no rank", '''
def layer_assignment(n_layers, p, v):
    size = n_layers // (p * v)
    virtual = [list(range(s * size, (s + 1) * size)) for s in range(p * v)]
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]


def v_placement(p):
    return [[r, 2 * p - 1 - r] for r in range(p)]
'''),
    ("1", "remainder on the last stages", "take the extra layers (virtual stage 0 first)", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s >= stages - extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]


def v_placement(p):
    return [[r, 2 * p - 1 - r] for r in range(p)]
'''),
    ("1", "V placed as a loop", "is interleaving's loop", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]


def v_placement(p):
    return [[r, p + r] for r in range(p)]
'''),
    ("1", "V off by one", "are not", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]


def v_placement(p):
    return [[r, 2 * p - r] for r in range(p)]
'''),
    ("2", "weight gradient transposed", "it is transposed", '''
def input_grad(grad_out, weight):
    return grad_out @ weight

def weight_grad(x, grad_out):
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return x.reshape(-1, x.shape[-1]).t() @ g, g.sum(0)
'''),
    ("2", "input gradient with W transposed", "dL/dx = grad_out @ W", '''
def input_grad(grad_out, weight):
    return grad_out @ weight.t()

def weight_grad(x, grad_out):
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return g.t() @ x.reshape(-1, x.shape[-1]), g.sum(0)
'''),
    ("2", "per batch element", "sum over batch and sequence", '''
def input_grad(grad_out, weight):
    return grad_out @ weight

def weight_grad(x, grad_out):
    return grad_out.transpose(-1, -2) @ x, grad_out.sum((0, 1))
'''),
    ("2", "bias mean", "its gradient is the sum", '''
def input_grad(grad_out, weight):
    return grad_out @ weight

def weight_grad(x, grad_out):
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return g.t() @ x.reshape(-1, x.shape[-1]), g.mean(0)
'''),
    # Ragged chunks padded into one tensor with NaN: 10 layers over 4 virtual stages leave NaN ids.
    ("1", "NaN-padded chunks", "a NaN or an infinity in your layer ids", '''
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


def v_placement(p):
    return [[r, 2 * p - 1 - r] for r in range(p)]
'''),
    # The V walked stage by stage, one stage short: rank 0's second stage is never written.
    ("1", "V buffer one stage short", "a NaN or an infinity in your stages", '''
def layer_assignment(n_layers, p, v):
    stages = p * v
    base, extra = divmod(n_layers, stages)
    virtual, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        virtual.append(list(range(start, start + size)))
        start += size
    return [[virtual[c * p + r] for c in range(v)] for r in range(p)]


def v_placement(p):
    placement = torch.full((p, 2), float("nan"))
    for s in range(2 * p - 1):
        placement[s if s < p else 2 * p - 1 - s, s // p] = s
    return placement.tolist()
'''),
    # The weight gradient summed into an uninitialised buffer (torch.empty, not zeros; NaN here, the same every run).
    ("2", "summed into torch.empty", "a NaN or an infinity in your (weight, bias) gradients", '''
def input_grad(grad_out, weight):
    return grad_out @ weight

def weight_grad(x, grad_out):
    g, xs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_w = torch.full((g.shape[1], xs.shape[1]), float("nan"), dtype=x.dtype)
    for t in range(g.shape[0]):
        grad_w += torch.outer(g[t], xs[t])
    return grad_w, g.sum(0)
'''),
]

PRINTED = [
    "v = 1: rank 0 holds [[0, 1]]; rank 1 holds [[2, 3]]; rank 2 holds [[4, 5]]; rank 3 holds [[6, 7]]",
    "v = 2: rank 0 holds [[0], [4]]; rank 1 holds [[1], [5]]; rank 2 holds [[2], [6]]; rank 3 holds [[3], [7]]",
    "v = 1: bubble ratio 0.3750, (p - 1)/(v m) = 0.3750; point-to-point messages per step 48",
    "v = 2: bubble ratio 0.1875, (p - 1)/(v m) = 0.1875; point-to-point messages per step 112",
    "1f1b       : idle time per rank 9, bubble ratio 0.3750",
    "zero-bubble: idle time per rank 3, bubble ratio 0.1250",
    "(worst relative difference",
    "dualpipev  : idle time per rank 1.5, bubble ratio 0.0625, stages' activations in flight [4.5, 4.5, 4.5, 4.5]",
    "pp = 4 dualpipev",
]
