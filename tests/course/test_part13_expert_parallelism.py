"""Part 13's answers: a top-k router with capacity, and the all-to-all dispatch of tokens to experts on 4 ranks."""

import pytest

from answers import PASSED, grade
from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 13

_ROUTE_HEAD = '''
def route(logits, k, capacity_factor):
    tokens, experts = logits.shape
    scores = logits.softmax(dim=-1)
    chosen, expert_idx = scores.topk(k, dim=-1)
'''

_KEEP_BY = '''
    keep = torch.ones_like(expert_idx, dtype=torch.bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        for e in range(experts):
            rows, slots = (expert_idx == e).nonzero(as_tuple=True)
            order = torch.sort(-{by}[rows, slots], stable=True).indices
            keep[rows[order[capacity:]], slots[order[capacity:]]] = False
    return expert_idx, weights, keep
'''


def _route(weights: str, by: str = "chosen", capacity: str = "math.ceil(capacity_factor * tokens * k / experts)"):
    """A route answer: top-k of the softmax, `weights` from `chosen`, each expert keeping its best by `by`."""
    return (_ROUTE_HEAD + f"    weights = {weights}\n" + _KEEP_BY.format(by=by)).replace(
        "math.ceil(capacity_factor * tokens * k / experts)", capacity)


_RENORMALISED = "chosen / chosen.sum(dim=-1, keepdim=True)"

# The dispatch's first half as the notebook's solution writes it: sort by expert, send, learn the per-expert counts.
_SEND = '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    per_expert = torch.bincount(expert_idx, minlength=n_experts)
    received, from_rank = exchange(tokens[order], per_expert.view(world, local).sum(1).tolist())
    split, _ = exchange(per_expert.view(world, local), [1] * world)
'''

_RUN_EXPERTS = '''
    outputs = []
    for rows, counts in zip(received.split(from_rank), split):
        for j, block in enumerate(rows.split(counts.tolist())):
            outputs.append(expert_forward({expert}, block))
'''

_SEND_HOME = '''
    back, _ = exchange(torch.cat(outputs), from_rank)
    result = torch.empty_like(back)
    result[order] = back
    return result
'''

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "raw scores", "renormalise them", _route("chosen")),
    (1, "first come first served", "keeps its first tokens in order", _ROUTE_HEAD + '''
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    keep = torch.ones_like(expert_idx, dtype=torch.bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        for e in range(experts):
            rows, slots = (expert_idx == e).nonzero(as_tuple=True)
            keep[rows[capacity:], slots[capacity:]] = False
    return expert_idx, weights, keep
'''),
    (1, "k written as 2", "with k = 3, expert_idx and weights should be [tokens, k] = [24, 3]",
     _route(_RENORMALISED).replace("scores.topk(k, dim=-1)", "scores.topk(2, dim=-1)")),
    # Ranked with an unstable sort: among exactly tied scores it keeps whichever it likes.
    (1, "unstable sort among ties", "the earlier token keeps its place", _ROUTE_HEAD + '''
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    keep = torch.ones_like(expert_idx, dtype=torch.bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        flat_e, flat_s, flat_keep = expert_idx.reshape(-1), chosen.reshape(-1), keep.reshape(-1)
        for e in range(experts):
            pos = (flat_e == e).nonzero().flatten()
            ranked = pos[(-flat_s[pos]).argsort()]
            flat_keep[ranked[capacity:]] = False
    return expert_idx, weights, keep
'''),
    (1, "capacity without k", "capacity counts assignments",
     _route(_RENORMALISED, capacity="math.ceil(capacity_factor * tokens / experts)")),
    (1, "capacity rounded down", "round up",
     _route(_RENORMALISED, capacity="int(capacity_factor * tokens * k / experts)")),
    (1, "capacity ignored", "over its capacity", _ROUTE_HEAD + '''
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    return expert_idx, weights, torch.ones_like(expert_idx, dtype=torch.bool)
'''),
    (1, "ranks by the renormalised weight", "renormalised weights", _route(_RENORMALISED, by="weights")),
    (1, "drops the highest scores", "drops the highest", _route(_RENORMALISED, by="-chosen")),
    (1, "sigmoid scores", "sigmoid", '''
def route(logits, k, capacity_factor):
    tokens, experts = logits.shape
    scores = torch.sigmoid(logits)
    chosen, expert_idx = scores.topk(k, dim=-1)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    return expert_idx, weights, torch.ones_like(expert_idx, dtype=torch.bool)
'''),
    (1, "softmax over the tokens", "softmax over experts", '''
def route(logits, k, capacity_factor):
    scores = logits.softmax(dim=0)
    chosen, expert_idx = scores.topk(k, dim=-1)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    return expert_idx, weights, torch.ones_like(expert_idx, dtype=torch.bool)
'''),
    # Only the kept assignments get a weight; the dropped ones keep torch.empty's garbage (NaN here, every run).
    (1, "weights only where kept", "a NaN or an infinity in your weights with k = 2 and capacity factor", _ROUTE_HEAD + '''
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
    (2, "every expert run locally", "which lives on rank", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    out = torch.zeros_like(tokens)
    for e in range(n_experts):
        rows = expert_idx == e
        if rows.any():
            out[rows] = expert_forward(e, tokens[rows])
    return out
'''),
    (2, "all-gathers every token", "all_gather", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    every_token = [torch.empty_like(tokens) for _ in range(world)]
    every_idx = [torch.empty_like(expert_idx) for _ in range(world)]
    dist.all_gather(every_token, tokens)
    dist.all_gather(every_idx, expert_idx)
    x, idx = torch.cat(every_token), torch.cat(every_idx)
    out = torch.zeros_like(x)
    for e in range(rank * local, (rank + 1) * local):
        out[idx == e] = expert_forward(e, x[idx == e])
    dist.all_reduce(out)
    t = tokens.shape[0]
    return out[rank * t:(rank + 1) * t]
'''),
    (2, "local expert index", "called with their local index", _SEND + _RUN_EXPERTS.format(expert="j") + _SEND_HOME),
    (2, "never unsorts", "the right outputs in the wrong order", _SEND + _RUN_EXPERTS.format(expert="rank * local + j")
     + '''
    back, _ = exchange(torch.cat(outputs), from_rank)
    return back
'''),
    (2, "round trip without experts", "came back unchanged", '''
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
    (2, "outputs never sent home", "never sent the experts' outputs home",
     _SEND + _RUN_EXPERTS.format(expert="rank * local + j") + '''
    return torch.cat(outputs)
'''),
    (2, "experts dealt round-robin", "contiguous", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    home = expert_idx % world                                  # expert e on rank e % world
    order = torch.argsort(home * n_experts + expert_idx, stable=True)
    # [rank, j]: how many go to expert rank + world * j
    per_expert = torch.bincount(expert_idx, minlength=n_experts).view(local, world).T
    received, from_rank = exchange(tokens[order], per_expert.sum(1).tolist())
    split, _ = exchange(per_expert.contiguous(), [1] * world)
    outputs = []
    for rows, counts in zip(received.split(from_rank), split):
        for j, block in enumerate(rows.split(counts.tolist())):
            outputs.append(expert_forward(rank + world * j, block))
''' + _SEND_HOME),
    (2, "received rows split by the totals", "grouped by source rank", _SEND + '''
    totals = split.sum(0).tolist()                          # rows for each of our experts, from all ranks
    outputs = [expert_forward(rank * local + j, rows) for j, rows in enumerate(received.split(totals))]
''' + _SEND_HOME),
    (2, "sends without sorting", "sort the token copies by expert", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    per_expert = torch.bincount(expert_idx, minlength=n_experts)
    received, from_rank = exchange(tokens, per_expert.view(world, local).sum(1).tolist())
    split, _ = exchange(per_expert.view(world, local), [1] * world)
''' + _RUN_EXPERTS.format(expert="rank * local + j") + '''
    back, _ = exchange(torch.cat(outputs), from_rank)
    return back
'''),
    (2, "send counts per expert, not per rank", "add up to the rows", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    per_expert = torch.bincount(expert_idx, minlength=n_experts)
    received, from_rank = exchange(tokens[order], per_expert[:world].tolist())
    split, _ = exchange(per_expert.view(world, local), [1] * world)
''' + _RUN_EXPERTS.format(expert="rank * local + j") + _SEND_HOME),
    # The counts of the ranks present, not of every rank: rank 1 sends nothing to rank 2.
    (2, "send counts from unique", "one entry per rank, 0 included", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    per_expert = torch.bincount(expert_idx, minlength=n_experts)
    _, to_rank = torch.unique(expert_idx // local, return_counts=True)
    received, from_rank = exchange(tokens[order], to_rank.tolist())
    split, _ = exchange(per_expert.view(world, local), [1] * world)
''' + _RUN_EXPERTS.format(expert="rank * local + j") + _SEND_HOME),
    # bincount as long as the highest expert used: rank 2 routes nothing to expert 7.
    (2, "bincount without minlength", "pass minlength=n_experts", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    per_expert = torch.bincount(expert_idx)
    received, from_rank = exchange(tokens[order], per_expert.view(world, local).sum(1).tolist())
    split, _ = exchange(per_expert.view(world, local), [1] * world)
''' + _RUN_EXPERTS.format(expert="rank * local + j") + _SEND_HOME),
    # The rows sent home added into an uninitialised buffer (torch.empty, not zeros; NaN here, every run).
    (2, "index_add into torch.empty", "a NaN or an infinity in rank 0's outputs",
     _SEND + _RUN_EXPERTS.format(expert="rank * local + j") + '''
    back, _ = exchange(torch.cat(outputs), from_rank)
    return torch.full_like(back, float("nan")).index_add_(0, order, back)
'''),
    # Destination counts by bincount without minlength: short where a rank sends nothing to the last rank.
    (2, "destination counts without minlength", "minlength=world", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    """Each token to its expert's rank and back: the experts' outputs, in the tokens' order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world  # experts per rank
    order = torch.argsort(expert_idx, stable=True)
    dest = expert_idx[order] // local
    send_counts = torch.bincount(dest).tolist()          # rows for each rank
    rows, recv_counts = exchange(tokens[order], send_counts)
    ids, _ = exchange(expert_idx[order].unsqueeze(-1), send_counts)
    ids = ids.squeeze(-1)
    out = torch.empty_like(rows)
    for e in ids.unique().tolist():
        m = ids == e
        out[m] = expert_forward(e, rows[m])
    back, _ = exchange(out, recv_counts)
    result = torch.empty_like(back)
    result[order] = back
    return result
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "softmax of the chosen logits", '''
def route(logits, k, capacity_factor):
    tokens, experts = logits.shape
    top_logits, expert_idx = logits.topk(k, dim=-1)         # softmax is monotone: the same experts
    weights = top_logits.softmax(dim=-1)                      # = the chosen scores renormalised
    scores = logits.softmax(dim=-1).gather(1, expert_idx)
    keep = torch.ones_like(expert_idx, dtype=torch.bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        for e in range(experts):
            rows, slots = (expert_idx == e).nonzero(as_tuple=True)
            order = torch.sort(scores[rows, slots], descending=True, stable=True).indices
            keep[rows[order[capacity:]], slots[order[capacity:]]] = False
    return expert_idx, weights, keep
'''),
    (1, "one pass over all assignments, best first", '''
def route(logits, k, capacity_factor):
    tokens, experts = logits.shape
    chosen, expert_idx = logits.softmax(dim=-1).topk(k, dim=-1)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    keep = torch.ones_like(expert_idx, dtype=torch.bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        taken = [0] * experts
        flat = torch.sort(-chosen.flatten(), stable=True).indices   # token-major: ties go to the earlier token
        for i in flat.tolist():
            t, j = divmod(i, k)
            e = int(expert_idx[t, j])
            keep[t, j] = taken[e] < capacity
            taken[e] += 1
    return expert_idx, weights, keep
'''),
    (2, "one exchange of the count table", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    table = torch.bincount(expert_idx, minlength=n_experts).view(world, local)
    incoming = torch.empty_like(table)
    dist.all_to_all_single(incoming, table)            # [source rank, our expert]: rows coming to us
    send, recv = table.sum(1).tolist(), incoming.sum(1).tolist()
    received = tokens.new_empty((sum(recv), tokens.shape[1]))
    dist.all_to_all_single(received, tokens[order], recv, send)
    outputs = torch.cat([expert_forward(rank * local + j, block)
                         for rows, counts in zip(received.split(recv), incoming)
                         for j, block in enumerate(rows.split(counts.tolist()))])
    back = torch.empty_like(tokens)
    dist.all_to_all_single(back, outputs, send, recv)
    return back[torch.argsort(order)]
'''),
    (2, "each row's expert sent along, each expert once", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    send = torch.bincount(expert_idx // local, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send, recv = send.tolist(), recv.tolist()
    rows = tokens.new_empty((sum(recv), tokens.shape[1]))
    idx = expert_idx.new_empty(sum(recv))
    dist.all_to_all_single(idx, expert_idx[order], recv, send)      # each row's expert travels with it
    dist.all_to_all_single(rows, tokens[order], recv, send)
    done = torch.empty_like(rows)
    for e in range(rank * local, (rank + 1) * local):               # each of our experts once, on all its rows
        done[idx == e] = expert_forward(e, rows[idx == e])
    back = torch.empty_like(tokens)
    dist.all_to_all_single(back, done, send, recv)
    result = torch.empty_like(back)
    result[order] = back
    return result
'''),
    (2, "each row's expert as an extra column of the rows sent", '''
def dispatch(tokens, expert_idx, n_experts, expert_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = n_experts // world
    order = torch.argsort(expert_idx, stable=True)
    send = torch.bincount(expert_idx // local, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send, recv = send.tolist(), recv.tolist()
    packed = torch.cat([tokens, expert_idx[:, None].to(tokens.dtype)], dim=1)[order]   # [T, h + 1]
    rows = packed.new_empty((sum(recv), packed.shape[1]))
    dist.all_to_all_single(rows, packed, recv, send)
    idx, rows = rows[:, -1].long(), rows[:, :-1].contiguous()
    done = torch.empty_like(rows)
    for e in range(rank * local, (rank + 1) * local):
        done[idx == e] = expert_forward(e, rows[idx == e])
    back = torch.empty_like(tokens)
    dist.all_to_all_single(back, done, send, recv)
    return back[torch.argsort(order)]
'''),
]



@pytest.mark.parametrize("k", [1, 2])
def test_the_reference_solution_passes(k):
    from answers import episode

    assert grade(PART, k, episode(PART).exercises[k - 1].solution) == PASSED
