"""Part 10's answers: the log-sum-exp merge of two blocks' attention, and ring attention on 4 ranks."""

from answers import PASSED, grade
from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 10

# Exercise 2's cell runs after exercise 1's: the learner's merge_partials is there.
_MERGE = '''
def merge_partials(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2
    return out, lse
'''


def _ring(body: str) -> str:
    """A ring_attention answer of the notebook's shape: K/V stacked, `world` steps, the block in hand from
    `source`; `body` is the loop's inside."""
    return _MERGE + '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = None, None
    kv = torch.stack((k, v))
    for step in range(world):
''' + body + '''
    return out
'''


_RIGHT_STEP = '''
        source = (rank - step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
'''

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "averages the outputs", "you averaged the two outputs", '''
def merge_partials(out1, lse1, out2, lse2):
    return (out1 + out2) / 2, torch.logaddexp(lse1, lse2)
'''),
    (1, "adds the outputs", "you added the two outputs", '''
def merge_partials(out1, lse1, out2, lse2):
    return out1 + out2, torch.logaddexp(lse1, lse2)
'''),
    (1, "lse is the max", "lse is max(lse1, lse2)", '''
def merge_partials(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2
    return out, torch.maximum(lse1, lse2)
'''),
    (1, "lse is the sum of the lses", "lse1 + lse2", '''
def merge_partials(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2
    return out, lse1 + lse2
'''),
    (1, "overflows", "exp(lse) overflows", '''
def merge_partials(out1, lse1, out2, lse2):
    w1, w2 = torch.exp(lse1), torch.exp(lse2)
    out = (w1.unsqueeze(-1) * out1 + w2.unsqueeze(-1) * out2) / (w1 + w2).unsqueeze(-1)
    return out, torch.log(w1 + w2)
'''),
    # A buffer read before it is written (torch.empty_like; NaN here, so that the garbage is the same every run).
    (1, "lse read before written", "a NaN or an infinity in your merged (out, lse)", '''
def merge_partials(out1, lse1, out2, lse2):
    lse = torch.full_like(lse1, float("nan"))
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2
    torch.logaddexp(lse1, lse2, out=lse)
    return out, lse
'''),
    # Shifted by lse2 always, not by the larger: stable only while lse1 is not far above lse2.
    (1, "shifted by lse2, not the max", "with lse1 200 above the other block's your merge gives inf/nan", '''
def merge_partials(out1, lse1, out2, lse2):
    lse = lse2 + torch.log1p(torch.exp(lse1 - lse2))
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return w1 * out1 + w2 * out2, lse
'''),
    (1, "weights swapped", "swapped", '''
def merge_partials(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse2 - lse).unsqueeze(-1) * out1 + torch.exp(lse1 - lse).unsqueeze(-1) * out2
    return out, lse
'''),
    (1, "weights not normalised", "weights sum to", '''
def merge_partials(out1, lse1, out2, lse2):
    m = torch.maximum(lse1, lse2)
    out = torch.exp(lse1 - m).unsqueeze(-1) * out1 + torch.exp(lse2 - m).unsqueeze(-1) * out2
    return out, torch.logaddexp(lse1, lse2)
'''),
    (1, "lse not unsqueezed", "unsqueeze(-1)", '''
def merge_partials(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse) * out1 + torch.exp(lse2 - lse) * out2, lse
'''),
    # The notebook's 4 ranks written in: right there, a hop too many (and a deadlock) on 3.
    (2, "four steps written in", "your ring is right on 4 ranks of 4 positions, but on 3 ranks of 5 positions",
     _ring(_RIGHT_STEP.replace("if step + 1 < world:", "if step + 1 < 4:")).replace(
         "for step in range(world):", "for step in range(4):")),
    (2, "all-gathers K and V", "all_gather", '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    n = q.shape[2]
    mine = torch.arange(rank * n, (rank + 1) * n)
    allowed = torch.arange(world * n)[None, :] <= mine[:, None]
    return F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=allowed)
'''),
    (2, "own block only", "only attends to its own block", '''
def ring_attention(q, k, v):
    return attend_block(q, k, v, causal=True)[0]
'''),
    (2, "no causal skip", "attends to every key, later ones too", _ring('''
        block_out, block_lse = attend_block(q, kv[0], kv[1], causal=False)
        out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
''')),
    (2, "diagonal unmasked", "its own block is unmasked", _ring('''
        source = (rank - step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=False)
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
''')),
    (2, "attends to future blocks", "blocks of later ranks", _ring('''
        source = (rank - step) % world
        block_out, block_lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
        out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
''')),
    (2, "causal mask on every block", "causal mask on every block", _ring('''
        source = (rank - step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=True)
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
''')),
    (2, "source formula against the ring", "the other way round", _ring('''
        source = (rank + step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_along(kv)
''')),
    (2, "own block merged twice", "merged twice", _MERGE + '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = attend_block(q, k, v, causal=True)
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
    (2, "keeps only the last block", "only the last block", _ring('''
        source = (rank - step) % world
        if source <= rank:
            out, lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
        if step + 1 < world:
            kv = pass_along(kv)
''')),
    (2, "forgets the last pass", "passed its K/V block 2 times", _MERGE + '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = None, None
    kv = torch.stack((k, v))
    for step in range(world - 1):
        source = (rank - step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world - 1:
            kv = pass_along(kv)
    return out
'''),
    (2, "passes world times", "passed its K/V block 4 times", _ring('''
        source = (rank - step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        kv = pass_along(kv)
''')),
    (2, "passes the queries too", "one K/V block", _MERGE + '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = None, None
    shard = torch.stack((q, k, v))
    for step in range(world):
        source = (rank - step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, shard[1], shard[2], causal=(source == rank))
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            shard = pass_along(shard)
    return out
'''),
    (2, "wrong lse on the diagonal", "log-sum-exp of the diagonal block", _MERGE + '''
def attend_diagonal(q, k, v):
    """The diagonal block with the library's causal attention, and its lse."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return F.scaled_dot_product_attention(q, k, v, is_causal=True), scores.logsumexp(-1)


def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = attend_diagonal(q, k, v)
    kv = torch.stack((k, v))
    for step in range(1, world):
        kv = pass_along(kv)
        if (rank - step) % world < rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=False)
            out, lse = merge_partials(out, lse, block_out, block_lse)
    return out
'''),
    # An empty accumulator merged with weight exp(-inf) = 0: but 0 * NaN (torch.empty's garbage) is NaN.
    (2, "accumulator from torch.empty", "a NaN or an infinity in rank 0's output", _MERGE + '''
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
    # Skipping a future block's pass too: the ring stops, and the ranks that still pass wait forever.
    (2, "passes only the blocks it attends to", "still pass it along", _ring('''
        source = (rank - step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
            if step + 1 < world:
                kv = pass_along(kv)
''')),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "sigmoid of the lse difference", '''
def merge_partials(out1, lse1, out2, lse2):
    w1 = torch.sigmoid(lse1 - lse2)          # exp(lse1) / (exp(lse1) + exp(lse2))
    out = w1.unsqueeze(-1) * out1 + (1 - w1).unsqueeze(-1) * out2
    return out, torch.logsumexp(torch.stack((lse1, lse2)), dim=0)
'''),
    (1, "max subtracted by hand", '''
def merge_partials(out1, lse1, out2, lse2):
    m = torch.maximum(lse1, lse2)
    e1, e2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    out = (e1.unsqueeze(-1) * out1 + e2.unsqueeze(-1) * out2) / (e1 + e2).unsqueeze(-1)
    return out, m + torch.log(e1 + e2)
'''),
    (1, "the engine's merge, in place", '''
def merge_partials(out1, lse1, out2, lse2):
    out, lse = out1.clone(), lse1.clone()
    merge(out, lse, out2, lse2)
    return out, lse
'''),
    (2, "the ring the other way, with its own source formula", _MERGE + '''
def pass_back(t):
    """Send t to the previous rank, return what the next rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(t)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t.contiguous(), (rank - 1) % world),
                                    dist.P2POp(dist.irecv, received, (rank + 1) % world)])
    for w in works:
        w.wait()
    return received


def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = None, None
    kv = torch.stack((k, v))
    for step in range(world):
        source = (rank + step) % world
        if source <= rank:
            block_out, block_lse = attend_block(q, kv[0], kv[1], causal=(source == rank))
            out, lse = (block_out, block_lse) if out is None else merge_partials(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = pass_back(kv)
    return out
'''),
    (2, "K and V passed separately, the engine's merge", '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = attend_block(q, k, v, causal=True)
    out, lse = out.clone(), lse.clone()
    for step in range(1, world):
        k, v = pass_along(k), pass_along(v)
        if (rank - step) % world < rank:
            merge(out, lse, *attend_block(q, k, v, causal=False))
    return out
'''),
    (2, "blocking send and recv, even ranks first", _MERGE + '''
def ring_attention(q, k, v):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    kv = torch.stack((k, v))
    for step in range(world):
        source = (rank - step) % world
        if source <= rank:
            out, lse = merge_partials(out, lse, *attend_block(q, kv[0], kv[1], causal=(source == rank)))
        if step + 1 < world:
            received = torch.empty_like(kv)
            if rank % 2 == 0:
                dist.send(kv, (rank + 1) % world)
                dist.recv(received, (rank - 1) % world)
            else:
                dist.recv(received, (rank - 1) % world)
                dist.send(kv, (rank + 1) % world)
            kv = received
    return out
'''),
]



def test_the_reference_solutions_pass():
    from answers import episode

    exercises = episode(PART).exercises
    assert grade(PART, 1, exercises[0].solution) == PASSED
    assert grade(PART, 2, _MERGE + exercises[1].solution) == PASSED
