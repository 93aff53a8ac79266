"""Cases for Part 10: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

MISTAKES = [
    ("1", "averages the outputs", "you averaged the two outputs", '''
def merge_partials(out1, lse1, out2, lse2):
    return (out1 + out2) / 2, torch.logaddexp(lse1, lse2)
'''),
    ("1", "lse is the max", "lse is max(lse1, lse2)", '''
def merge_partials(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2
    return out, torch.maximum(lse1, lse2)
'''),
    ("1", "overflows", "exp(lse) overflows", '''
def merge_partials(out1, lse1, out2, lse2):
    w1, w2 = torch.exp(lse1), torch.exp(lse2)
    out = (w1.unsqueeze(-1) * out1 + w2.unsqueeze(-1) * out2) / (w1 + w2).unsqueeze(-1)
    return out, torch.log(w1 + w2)
'''),
    ("2", "no causal skip", "attends to every key, later ones too", '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = None, None
    kv = torch.stack((k, v))
    for step in range(world):
        block_out, block_lse = attend_block(q, kv[0], kv[1], causal=False)
        out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
    return out
'''),
    ("2", "diagonal unmasked", "its own block is unmasked", '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = None, None
    kv = torch.stack((k, v))
    for step in range(world):
        source = (rank - step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=False)
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
    return out
'''),
    ("2", "own block only", "only attends to its own block", '''
def ring_attention(q, k, v):
    return attend_block(q, k, v, causal=True)[0]
'''),
    # A buffer read before it is written (torch.empty_like; NaN here, so that the garbage is the same every run).
    ("1", "lse read before written", "a NaN or an infinity in your merged (out, lse)", '''
def merge_partials(out1, lse1, out2, lse2):
    lse = torch.full_like(lse1, float("nan"))
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2
    torch.logaddexp(lse1, lse2, out=lse)
    return out, lse
'''),
    # An empty accumulator merged with weight exp(-inf) = 0: but 0 * NaN (torch.empty's garbage) is NaN.
    ("2", "accumulator from torch.empty", "a NaN or an infinity in rank 0's output", '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:-1], float("-inf"))
    kv = torch.stack((k, v))
    for step in range(world):
        source = (rank - step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
            out, lse = merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
    return out
'''),
]

PRINTED = [
    "cp = 1: activations + logits  90.1 GiB, total 143.6 GiB per GPU -> does not fit in 79 GiB",
    "cp = 4: activations + logits  22.5 GiB, total  47.9 GiB per GPU -> fits in 79 GiB",
    "MLP on the second half alone  == its rows of the MLP on everything: True",
    "attention of the second half alone == its rows of attention on everything: False",
    "attention work per rank [512, 1024, 1536, 2048] (max / mean 1.60)",
    "attention work per rank [1152, 1152, 1152, 1152] (max / mean 1.00)",
    "rank 3: (1, 4, 4, 8) -> (1, 1, 16, 8); its sequence positions came from ranks [0, 1, 2, 3]",
]
