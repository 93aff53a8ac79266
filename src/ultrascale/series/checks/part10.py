"""Part 10, context parallelism: the log-sum-exp merge, and ring attention on 4 real ranks.

Every expected value is computed here from the definition (softmax attention over
all keys, in float64), never by the learner's code or the engine's.

exercise_2 checks the ring as well as the output: the collectives each rank called
(K/V may travel only point to point, to one neighbour, one block per hop, world - 1
hops), then the output against causal attention, and against what each known mistake
computes (future blocks attended, a causal mask on every block, a source formula that
runs against the ring, a block merged twice or replaced instead of merged, the
diagonal's lse of unmasked scores), so that each is said by name.
"""

from __future__ import annotations

import math

from ultrascale.series.checks import on_ranks, require_finite

WORLD = 4
ATOL = 1e-5


def _full(q, k, v, allowed=None):
    """Softmax attention of q over all of k, v in float64, and the rows' log-sum-exp; `allowed`
    [m, n] masks keys out where False."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s.softmax(-1) @ v.double(), s.logsumexp(-1)


def _partial(q, k, v):
    """(out, lse) of q against one block of keys, float32: what a ring step hands to the merge."""
    out, lse = _full(q, k, v)
    return out.float(), lse.float()


# -- exercise 1 -----------------------------------------------------------------------------------
def _merge(merge_partials, *args):
    """The learner's merge; a broadcasting error is the lse not given the head dimension."""
    try:
        return merge_partials(*(a.clone() for a in args))
    except RuntimeError as e:
        if "must match the size" in str(e):
            raise AssertionError(
                f"the merge failed with '{e}': lse is [batch, heads, queries] and out is [batch, heads, queries, "
                f"head_dim]; give each row's weight the head dimension, torch.exp(lse1 - lse).unsqueeze(-1), "
                f"before multiplying the output") from None
        raise


def _weights(out, o1, o2):
    """The per-row weights (w1, w2) with out = w1 * o1 + w2 * o2, float64, or None when out is no such sum."""
    import torch

    a = torch.stack((o1.double(), o2.double()), -1)  # [..., d, 2]
    w = torch.linalg.lstsq(a, out.double().unsqueeze(-1)).solution  # [..., 2, 1]
    if ((a @ w).squeeze(-1) - out.double()).abs().max().item() > ATOL:
        return None
    return w[..., 0, 0], w[..., 1, 0]


def _wrong_output(out, o1, l1, o2, l2, want_out):
    """The mistake in a merged output that is not the attention over both blocks, in words."""
    import torch

    if torch.allclose(out.double(), (o1.double() + o2.double()) / 2, atol=ATOL):
        return ("you averaged the two outputs: each block's softmax was normalised over its own keys only; weight "
                "out_i by exp(lse_i - lse), where lse = log(exp(lse1) + exp(lse2))")
    if torch.allclose(out.double(), o1.double() + o2.double(), atol=ATOL):
        return ("you added the two outputs: weight each by its share of the total, exp(lse_i - lse), so the weights "
                "sum to 1")
    err = (out.double() - want_out).abs().max().item()
    weights = _weights(out, o1, o2)
    if weights is not None:
        w1, w2 = weights
        lse = torch.logaddexp(l1.double(), l2.double())
        share1, share2 = torch.exp(l1.double() - lse), torch.exp(l2.double() - lse)
        if torch.allclose(w1, share2, atol=ATOL) and torch.allclose(w2, share1, atol=ATOL):
            return ("the weights are swapped: out1 is weighted by block 2's share exp(lse2 - lse) and out2 by block "
                    "1's; out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2")
        total = w1 + w2
        if (total - 1).abs().max().item() > 1e-4:
            return (f"your output is a weighted sum of out1 and out2 whose weights sum to {total.min().item():.3g} .. "
                    f"{total.max().item():.3g} per row, not 1: divide each block's exp(lse_i) by the total, "
                    f"exp(lse1) + exp(lse2), i.e. weight by exp(lse_i - lse) with lse = torch.logaddexp(lse1, lse2)")
    return (f"the merged output differs from attention over both blocks by {err:.2e}: "
            f"out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2")


def exercise_1(merge_partials):
    """merge_partials(out1, lse1, out2, lse2) -> (out, lse): two blocks' attention combined exactly."""
    import torch

    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    k2, v2 = torch.randn(2, 3, 7, 8, generator=g), torch.randn(2, 3, 7, 8, generator=g)
    o1, l1 = _partial(q, k, v)
    o2, l2 = _partial(q, k2, v2)
    got = _merge(merge_partials, o1, l1, o2, l2)
    assert isinstance(got, tuple) and len(got) == 2, "return a tuple (out, lse)"
    out, lse = got
    want_out, want_lse = _full(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2))
    assert tuple(out.shape) == tuple(want_out.shape), (
        f"out has shape {tuple(out.shape)}; the merged output has the shape of each partial one, "
        f"{tuple(want_out.shape)}")
    assert tuple(lse.shape) == tuple(want_lse.shape), (
        f"lse has shape {tuple(lse.shape)}; one log-sum-exp per query row: {tuple(want_lse.shape)}")
    require_finite([out, lse], "your merged (out, lse)")
    if not torch.allclose(out.double(), want_out, atol=ATOL):
        raise AssertionError(_wrong_output(out, o1, l1, o2, l2, want_out))
    if not torch.allclose(lse.double(), want_lse, atol=ATOL):
        if torch.allclose(lse.double(), torch.maximum(l1, l2).double(), atol=ATOL):
            raise AssertionError("the output is right but lse is max(lse1, lse2): the merged lse is "
                                 "log(exp(lse1) + exp(lse2)) (torch.logaddexp), or the next merge will be wrong")
        if torch.allclose(lse.double(), l1.double() + l2.double(), atol=ATOL):
            raise AssertionError("the output is right but lse is lse1 + lse2, the log of the product of the two "
                                 "denominators; the merged denominator is their sum: lse = log(exp(lse1) + exp(lse2)) "
                                 "(torch.logaddexp), or the next merge will be weighted wrongly")
        raise AssertionError("the output is right but the merged lse is not log(exp(lse1) + exp(lse2)); "
                             "a third block merged later would be weighted wrongly")
    # Large scores: exp(lse) overflows float32 past ~88; a stable merge never forms it.
    big1, big2 = l1 + 200.0, l2 + 200.0
    out, lse = _merge(merge_partials, o1, big1, o2, big2)
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        raise AssertionError("with large scores (lse around 200) your merge gives inf/nan: exp(lse) overflows; "
                             "work with differences, exp(lse1 - lse), and torch.logaddexp for lse")
    scale = torch.logaddexp(big1, big2)
    want = torch.exp(big1 - scale).unsqueeze(-1) * o1 + torch.exp(big2 - scale).unsqueeze(-1) * o2
    assert torch.allclose(out, want, atol=ATOL), "with large scores (lse around 200) the merge loses accuracy"
    # Far apart, each way round: one block's lse 200 above the other's. A shift by one fixed side
    # (lse2 + log1p(exp(lse1 - lse2))) overflows when the other side is the larger; the max never does.
    for name, (a, b) in (("lse1", (l1 + 200.0, l2)), ("lse2", (l1, l2 + 200.0))):
        out, lse = _merge(merge_partials, o1, a, o2, b)
        scale = torch.logaddexp(a, b)
        want = torch.exp(a - scale).unsqueeze(-1) * o1 + torch.exp(b - scale).unsqueeze(-1) * o2
        finite = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())
        if not finite or not torch.allclose(out, want, atol=ATOL) or not torch.allclose(lse, scale, atol=1e-3):
            raise AssertionError(
                f"with {name} 200 above the other block's your merge gives "
                f"{'inf/nan' if not finite else 'another result'}: exp() of a difference overflows when it is "
                f"taken against the smaller lse; shift by the larger, m = max(lse1, lse2), "
                f"lse = m + log(exp(lse1 - m) + exp(lse2 - m)) (torch.logaddexp does)")


# -- exercise 2 -----------------------------------------------------------------------------------
def _ring_case(ring_attention, seed, per_rank=4, head_dim=8):
    """On each rank: its contiguous shard of one sequence's q, k, v -> (its output, the reference)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, per_rank * world, head_dim, generator=g) for _ in range(3))
    n = q.shape[2] // world
    mine = slice(rank * n, (rank + 1) * n)
    out = ring_attention(q[:, :, mine].clone(), k[:, :, mine].clone(), v[:, :, mine].clone())
    return rank, out.detach().float(), (q, k, v)


def _run_ring(ring_attention, calls):
    try:
        return on_ranks(WORLD, _ring_case, ring_attention, 20, timeout=60, calls=calls)
    except AssertionError as e:
        if not str(e).startswith("deadlock"):
            raise
        raise AssertionError(
            f"{e}. In the ring every rank passes the block in hand on at every step but the last, also at a step "
            f"whose block it skips (a later rank's): the ring is a chain of sends and receives, and a rank that "
            f"does not pass leaves its neighbour waiting - still pass it along") from None


def _check_ring_calls(calls, kv_bytes):
    """K/V move only point to point, to one neighbour, one block per hop, WORLD - 1 hops: said rank by rank."""
    from ultrascale.series.watch import POINT_TO_POINT, kinds, sent

    directions = {}
    for rank, mine in enumerate(calls):
        for call, kind in zip(mine, kinds(mine)):
            if call.kind not in POINT_TO_POINT and kind != "barrier":
                raise AssertionError(
                    f"rank {rank} called {kind} ({call}): ring attention moves K/V only point to point, one block "
                    f"to the next rank per step (pass_along). Collecting K and V with {kind} puts the whole sequence's "
                    f"keys and values on every rank at once, the memory context parallelism is there to avoid: keep "
                    f"one block in hand, attend, merge, pass it on")
        sends = [c for c in mine if c.kind in ("send", "isend")]
        if not sends:
            raise AssertionError(
                f"rank {rank} sent no K/V block to another rank: it only attends to its own block. Pass the K/V "
                f"blocks around the ring ({WORLD - 1} hops, pass_along) and merge each block's result")
        big = max(sends, key=lambda c: c.bytes)
        if big.bytes > kv_bytes:
            raise AssertionError(
                f"rank {rank} sent {big.bytes} B in one hop ({big}); a hop carries one K/V block, {kv_bytes} B "
                f"(its keys and values): the queries and the running (out, lse) stay on their rank")
        peers = sorted({c.peer for c in sends})
        neighbours = {(rank + 1) % WORLD, (rank - 1) % WORLD}
        if len(peers) > 1 or peers[0] not in neighbours:
            raise AssertionError(
                f"rank {rank} sent to rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}: in a ring "
                f"each rank sends only to one neighbour, the same one every step (rank + 1, or rank - 1 all round)")
        directions[rank] = (peers[0] - rank) % WORLD
        total = sent(mine)
        if total != (WORLD - 1) * kv_bytes:
            hops = total / kv_bytes
            why = ("the last pass sends a block that no rank uses any more: pass after every step but the last"
                   if total > (WORLD - 1) * kv_bytes else
                   "the last blocks never arrive (the last rank never sees block 0): pass after every step but "
                   "the last, world - 1 times")
            raise AssertionError(
                f"rank {rank} passed its K/V block {hops:g} times ({total} B, {kv_bytes} B a block); a ring of "
                f"{WORLD} needs {WORLD - 1} hops for every block to reach every rank: {why}")
    if len(set(directions.values())) > 1:
        raise AssertionError(
            "the ranks send in different directions (" + ", ".join(
                f"rank {r} to rank {(r + d) % WORLD}" for r, d in directions.items()) + "): a ring runs one way")


def _attend(q, k, v, causal, lse_of_unmasked=False):
    """(out, lse) in float64 of q against one key block; causal masks it as a diagonal block."""
    import torch

    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    masked = s
    if causal:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril()
        masked = s.masked_fill(~keep, float("-inf"))
    return masked.softmax(-1) @ v.double(), (s if lse_of_unmasked else masked).logsumexp(-1)


def _merged(q, k, v, rank, entries):
    """Rank `rank`'s queries against the key blocks `entries` [(block, causal, lse_of_unmasked)], each attended
    alone and merged exactly: what a ring that merges those blocks returns."""
    import torch

    n = q.shape[2] // WORLD
    qr = q[:, :, rank * n:(rank + 1) * n]
    out = lse = None
    for block, causal, unmasked in entries:
        ks = slice(block * n, (block + 1) * n)
        o, l = _attend(qr, k[:, :, ks], v[:, :, ks], causal, unmasked)
        if out is None:
            out, lse = o, l
        else:
            new = torch.logaddexp(lse, l)
            out = torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(l - new).unsqueeze(-1) * o
            lse = new
    return out


def _against_the_ring(rank, sign):
    """The blocks a rank merges when its source formula counts against the ring: the block in hand at step s
    came from (rank - sign * s), the formula says (rank + sign * s)."""
    entries = []
    for step in range(WORLD):
        came, believed = (rank - sign * step) % WORLD, (rank + sign * step) % WORLD
        if believed <= rank:
            entries.append((came, believed == rank, False))
    return entries


def _mistakes(rank):
    """(name, the blocks merged) of each known mistake, for one rank; `name` is its message's key."""
    earlier = [(b, b == rank, False) for b in range(rank + 1)]
    every = range(WORLD)
    return [
        ("nothing masked", [(b, False, False) for b in every]),
        ("future blocks", [(b, b == rank, False) for b in every]),
        ("diagonal open", [(b, False, False) for b in range(rank + 1)]),
        ("causal everywhere", [(b, True, False) for b in range(rank + 1)]),
        ("causal everywhere, future too", [(b, True, False) for b in every]),
        ("against the ring", _against_the_ring(rank, 1)),
        ("against the ring", _against_the_ring(rank, -1)),
        ("own block twice", earlier + [(rank, True, False)]),
        ("only the last", [(0, rank == 0, False)]),
        ("unmasked lse", [(b, b == rank, b == rank) for b in range(rank + 1)]),
        ("own block only", [(rank, True, False)]),
    ]


_SAID = {
    "nothing masked": "rank {rank} attends to every key, later ones too: in a causal model skip the blocks of later "
                      "ranks and mask the diagonal block (causal=True)",
    "future blocks": "rank {rank} attends to the blocks of later ranks: their keys come after all of its queries. "
                     "Skip a block whose source rank is greater than yours (but still pass it along)",
    "diagonal open": "rank {rank} skips later blocks but its own block is unmasked: attend to it with causal=True, "
                     "the earlier blocks with causal=False",
    "causal everywhere": "rank {rank} puts a causal mask on every block: only the diagonal block (source == rank) "
                         "needs causal=True; every key of an earlier rank's block comes before all of your queries, "
                         "so attend to it with causal=False",
    "causal everywhere, future too": "rank {rank} puts a causal mask on every block and attends to later ranks' "
                                     "blocks: skip a block from a later rank, attend to an earlier one with "
                                     "causal=False and to your own with causal=True",
    "against the ring": "rank {rank} merged the blocks of the wrong ranks: your source formula counts the other way "
                        "round from the ring. The block in hand at step s came from the rank pass_along receives "
                        "from, s steps back: (rank - s) % world when it sends to rank + 1, (rank + s) % world when it "
                        "sends to rank - 1",
    "own block twice": "rank {rank}'s own block is merged twice: it is the block in hand at step 0; start from its "
                       "result or merge it in the loop, not both",
    "only the last": "rank {rank} keeps only the last block it attended to: each step replaces (out, lse) instead of "
                     "merging into it; out, lse = merge_partials(out, lse, block_out, block_lse)",
    "unmasked lse": "rank {rank}'s output is normalised over the masked diagonal block, but the log-sum-exp of the "
                    "diagonal block is of its unmasked scores: the merge weights a block by the lse of the same "
                    "masked scores its output was normalised over (attend_block returns both)",
    "own block only": "rank {rank} only attends to its own block: merge the result of each earlier block that "
                      "passes by, not just the first",
}


def _name_the_mistake(results, q, k, v, want):
    """The message for outputs that are not causal attention: a known mistake matching every rank, else the
    first wrong rank's own."""
    import torch

    outs = {rank: out.double() for rank, out, _ in results}
    per_rank = {rank: _mistakes(rank) for rank in outs}
    for i, (name, _) in enumerate(per_rank[0]):
        if all(torch.allclose(outs[r], _merged(q, k, v, r, per_rank[r][i][1]), atol=ATOL) for r in outs):
            wrong = next(r for r in outs if not torch.allclose(outs[r], want[r], atol=ATOL))
            return _SAID[name].format(rank=wrong)
    rank = next(r for r in outs if not torch.allclose(outs[r], want[r], atol=ATOL))
    for name, entries in per_rank[rank]:
        if torch.allclose(outs[rank], _merged(q, k, v, rank, entries), atol=ATOL):
            return _SAID[name].format(rank=rank)
    right = [(b, b == rank, False) for b in range(rank + 1)]
    for block in range(rank + 1):
        if torch.allclose(outs[rank], _merged(q, k, v, rank, right + [right[block]]), atol=ATOL):
            return (f"rank {rank} merged block {block} twice: merge every earlier block exactly once, with its own "
                    f"(out, lse)")
        if rank and torch.allclose(outs[rank], _merged(q, k, v, rank, right[:block] + right[block + 1:]), atol=ATOL):
            return (f"rank {rank} never merged block {block} (from rank {block}): merge every block from rank 0 up "
                    f"to your own exactly once")
    err = (outs[rank] - want[rank]).abs().max().item()
    return (f"rank {rank}'s output differs from causal attention over the whole sequence by {err:.2e}: is every "
            f"earlier block merged exactly once, with its own (out, lse)?")


def exercise_2(ring_attention):
    """ring_attention(q, k, v) on 4 ranks, each holding a contiguous quarter of the sequence."""
    import torch

    calls = []
    results = _run_ring(ring_attention, calls)
    q, k, v = results[0][2]
    s = q.shape[2]
    n = s // WORLD
    kv_bytes = 2 * q[:, :, :n].numel() * q.element_size()
    want = {r: _merged(q, k, v, r, [(b, b == r, False) for b in range(r + 1)]) for r in range(WORLD)}
    for rank, out, _ in results:
        assert tuple(out.shape) == tuple(want[rank].shape), (
            f"rank {rank} returned shape {tuple(out.shape)}; it should return the output of its own queries, "
            f"{tuple(want[rank].shape)}")
    _check_ring_calls(calls, kv_bytes)
    for rank, out, _ in results:
        require_finite(out, f"rank {rank}'s output")
    if not all(torch.allclose(out.double(), want[rank], atol=ATOL) for rank, out, _ in results):
        raise AssertionError(_name_the_mistake(results, q, k, v, want))
    _odd_ring(ring_attention)


def _odd_ring(ring_attention, world=3, per_rank=5, head_dim=6):
    """The same ring on 3 ranks of 5 positions, head dimension 6: a world size, a hop count or a block
    length written for the 4 x 4 case shows. Against causal attention over the whole sequence (float64)."""
    import torch

    from ultrascale.series.checks import RankError

    said = (f"your ring is right on {WORLD} ranks of 4 positions, but on {world} ranks of {per_rank} positions "
            f"(head dimension {head_dim}) {{}}: take N from dist.get_world_size(), the hops (N - 1), the "
            f"neighbours and every block's size from N and the tensors")
    try:
        results = on_ranks(world, _ring_case, ring_attention, 21, per_rank, head_dim, timeout=60)
    except (AssertionError, RankError) as e:
        raise AssertionError(said.format(f"it failed ({str(e).splitlines()[0][:160]})")) from None
    q, k, v = results[0][2]
    s = q.shape[2]
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(head_dim)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    full = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v.double()
    for rank, out, _ in results:
        want = full[:, :, rank * per_rank:(rank + 1) * per_rank]
        if tuple(out.shape) != tuple(want.shape):
            raise AssertionError(said.format(f"rank {rank} returns shape {tuple(out.shape)} for {tuple(want.shape)}"))
        require_finite(out, f"rank {rank}'s output on {world} ranks")
        if not torch.allclose(out.double(), want, atol=ATOL):
            err = (out.double() - want).abs().max().item()
            raise AssertionError(said.format(f"rank {rank}'s output differs from causal attention by {err:.2e}"))
