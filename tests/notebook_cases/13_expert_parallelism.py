"""Cases for Part 13: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

_ROUTE_HEAD = '''
def route(logits, k, capacity_factor):
    tokens, experts = logits.shape
    scores = logits.softmax(dim=-1)
    chosen, expert_idx = scores.topk(k, dim=-1)
'''

MISTAKES = [
    ("1", "raw scores", "renormalise them", _ROUTE_HEAD + '''
    return expert_idx, chosen, torch.ones_like(expert_idx, dtype=torch.bool)
'''),
    ("1", "first come first served", "keeps its first tokens in order", _ROUTE_HEAD + '''
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    keep = torch.ones_like(expert_idx, dtype=torch.bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        for e in range(experts):
            rows, slots = (expert_idx == e).nonzero(as_tuple=True)
            keep[rows[capacity:], slots[capacity:]] = False
    return expert_idx, weights, keep
'''),
    ("1", "capacity without k", "capacity counts assignments", _ROUTE_HEAD + '''
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    keep = torch.ones_like(expert_idx, dtype=torch.bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * tokens / experts)
        for e in range(experts):
            rows, slots = (expert_idx == e).nonzero(as_tuple=True)
            order = torch.sort(-chosen[rows, slots], stable=True).indices
            keep[rows[order[capacity:]], slots[order[capacity:]]] = False
    return expert_idx, weights, keep
'''),
    ("2", "local expert index", "called with their local index", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    per_expert = torch.bincount(expert_idx, minlength=n_experts)
    received, from_rank = exchange(tokens[order], per_expert.view(world, local).sum(1).tolist())
    split, _ = exchange(per_expert.view(world, local), [1] * world)
    outputs = []
    for rows, counts in zip(received.split(from_rank), split):
        for j, block in enumerate(rows.split(counts.tolist())):
            outputs.append(expert_forward(j, block))
    back, _ = exchange(torch.cat(outputs), from_rank)
    result = torch.empty_like(back)
    result[order] = back
    return result
'''),
    ("2", "never unsorts", "the right outputs in the wrong order", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    per_expert = torch.bincount(expert_idx, minlength=n_experts)
    received, from_rank = exchange(tokens[order], per_expert.view(world, local).sum(1).tolist())
    split, _ = exchange(per_expert.view(world, local), [1] * world)
    outputs = []
    for rows, counts in zip(received.split(from_rank), split):
        for j, block in enumerate(rows.split(counts.tolist())):
            outputs.append(expert_forward(rank * local + j, block))
    back, _ = exchange(torch.cat(outputs), from_rank)
    return back
'''),
    ("2", "round trip without experts", "came back unchanged", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    per_expert = torch.bincount(expert_idx, minlength=n_experts)
    received, from_rank = exchange(tokens[order], per_expert.view(world, local).sum(1).tolist())
    back, _ = exchange(received, from_rank)
    result = torch.empty_like(back)
    result[order] = back
    return result
'''),
    # Only the kept assignments get a weight; the dropped ones keep torch.empty's garbage (NaN here, every run).
    ("1", "weights only where kept", "a NaN or an infinity in your weights with capacity factor", _ROUTE_HEAD + '''
    keep = torch.ones_like(expert_idx, dtype=torch.bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        for e in range(experts):
            rows, slots = (expert_idx == e).nonzero(as_tuple=True)
            order = torch.sort(-chosen[rows, slots], stable=True).indices
            keep[rows[order[capacity:]], slots[order[capacity:]]] = False
    weights = torch.full_like(chosen, float("nan"))
    weights[keep] = (chosen / chosen.sum(dim=-1, keepdim=True))[keep]
    return expert_idx, weights, keep
'''),
    # The rows sent home added into an uninitialised buffer (torch.empty, not zeros; NaN here, every run).
    ("2", "index_add into torch.empty", "a NaN or an infinity in rank 0's outputs", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    per_expert = torch.bincount(expert_idx, minlength=n_experts)
    received, from_rank = exchange(tokens[order], per_expert.view(world, local).sum(1).tolist())
    split, _ = exchange(per_expert.view(world, local), [1] * world)
    outputs = []
    for rows, counts in zip(received.split(from_rank), split):
        for j, block in enumerate(rows.split(counts.tolist())):
            outputs.append(expert_forward(rank * local + j, block))
    back, _ = exchange(torch.cat(outputs), from_rank)
    return torch.full_like(back, float("nan")).index_add_(0, order, back)
'''),
]

PRINTED = [
    "mixtral-8x7b  :   8 experts, top-2:   46.7 B parameters,  12.9 B active per token (27.6%)",
    "deepseek-v3   : 256 experts, top-8:  704.9 B parameters,  38.7 B active per token ( 5.5%)",
    "capacity factor 1.25 (capacity 160 each): assignments kept per expert",
]
