"""Part 10, context parallelism: the log-sum-exp merge, and ring attention on 4 real ranks.

Every expected value is computed here from the definition (softmax attention over
all keys, in float64), never by the learner's code or the engine's.
"""

from __future__ import annotations

import math

from ultrascale.series.checks import on_ranks, require_finite

WORLD = 4


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


def exercise_1(merge_partials):
    """merge_partials(out1, lse1, out2, lse2) -> (out, lse): two blocks' attention combined exactly."""
    import torch

    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    k2, v2 = torch.randn(2, 3, 7, 8, generator=g), torch.randn(2, 3, 7, 8, generator=g)
    o1, l1 = _partial(q, k, v)
    o2, l2 = _partial(q, k2, v2)
    got = merge_partials(o1.clone(), l1.clone(), o2.clone(), l2.clone())
    assert isinstance(got, tuple) and len(got) == 2, "return a tuple (out, lse)"
    out, lse = got
    want_out, want_lse = _full(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2))
    assert tuple(out.shape) == tuple(want_out.shape), (
        f"out has shape {tuple(out.shape)}; the merged output has the shape of each partial one, "
        f"{tuple(want_out.shape)}")
    assert tuple(lse.shape) == tuple(want_lse.shape), (
        f"lse has shape {tuple(lse.shape)}; one log-sum-exp per query row: {tuple(want_lse.shape)}")
    require_finite([out, lse], "your merged (out, lse)")
    if not torch.allclose(out.double(), want_out, atol=1e-5):
        if torch.allclose(out.double(), (o1.double() + o2.double()) / 2, atol=1e-5):
            raise AssertionError("you averaged the two outputs: each block's softmax was normalised over its own "
                                 "keys only; weight out_i by exp(lse_i - lse), where lse = log(exp(lse1) + exp(lse2))")
        if torch.allclose(out.double(), o1.double() + o2.double(), atol=1e-5):
            raise AssertionError("you added the two outputs: weight each by its share of the total, "
                                 "exp(lse_i - lse), so the weights sum to 1")
        err = (out.double() - want_out).abs().max().item()
        raise AssertionError(f"the merged output differs from attention over both blocks by {err:.2e}: "
                             f"out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2")
    if not torch.allclose(lse.double(), want_lse, atol=1e-5):
        if torch.allclose(lse.double(), torch.maximum(l1, l2).double(), atol=1e-5):
            raise AssertionError("the output is right but lse is max(lse1, lse2): the merged lse is "
                                 "log(exp(lse1) + exp(lse2)) (torch.logaddexp), or the next merge will be wrong")
        raise AssertionError("the output is right but the merged lse is not log(exp(lse1) + exp(lse2)); "
                             "a third block merged later would be weighted wrongly")
    # Large scores: exp(lse) overflows float32 past ~88; a stable merge never forms it.
    big1, big2 = l1 + 200.0, l2 + 200.0
    out, lse = merge_partials(o1.clone(), big1.clone(), o2.clone(), big2.clone())
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        raise AssertionError("with large scores (lse around 200) your merge gives inf/nan: exp(lse) overflows; "
                             "work with differences, exp(lse1 - lse), and torch.logaddexp for lse")
    scale = torch.logaddexp(big1, big2)
    want = torch.exp(big1 - scale).unsqueeze(-1) * o1 + torch.exp(big2 - scale).unsqueeze(-1) * o2
    assert torch.allclose(out, want, atol=1e-5), "with large scores (lse around 200) the merge loses accuracy"


def _ring_case(ring_attention, seed):
    """On each rank: its contiguous shard of one sequence's q, k, v -> (its output, the reference)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 4 * world, 8, generator=g) for _ in range(3))
    n = q.shape[2] // world
    mine = slice(rank * n, (rank + 1) * n)
    out = ring_attention(q[:, :, mine].clone(), k[:, :, mine].clone(), v[:, :, mine].clone())
    return rank, out.detach().float(), (q, k, v)


def exercise_2(ring_attention):
    """ring_attention(q, k, v) on 4 ranks, each holding a contiguous quarter of the sequence."""
    import torch

    results = on_ranks(WORLD, _ring_case, ring_attention, 20, timeout=60)
    q, k, v = results[0][2]
    s = q.shape[2]
    n = s // WORLD
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    block_causal = torch.zeros(s, s, dtype=torch.bool)
    for r in range(WORLD):  # every key block up to and including the query's own, unmasked
        block_causal[r * n:(r + 1) * n, :(r + 1) * n] = True
    want = _full(q, k, v, causal)[0]
    nothing_masked = _full(q, k, v)[0]
    diagonal_open = _full(q, k, v, block_causal)[0]
    for rank, out, _ in results:
        mine = slice(rank * n, (rank + 1) * n)
        assert tuple(out.shape) == tuple(want[:, :, mine].shape), (
            f"rank {rank} returned shape {tuple(out.shape)}; it should return the output of its own queries, "
            f"{tuple(want[:, :, mine].shape)}")
        require_finite(out, f"rank {rank}'s output")
        if torch.allclose(out.double(), want[:, :, mine], atol=1e-5):
            continue
        if torch.allclose(out.double(), nothing_masked[:, :, mine], atol=1e-5):
            raise AssertionError(f"rank {rank} attends to every key, later ones too: in a causal model skip the "
                                 f"blocks of later ranks and mask the diagonal block (causal=True)")
        if torch.allclose(out.double(), diagonal_open[:, :, mine], atol=1e-5):
            raise AssertionError(f"rank {rank} skips later blocks but its own block is unmasked: attend to it "
                                 f"with causal=True, the earlier blocks with causal=False")
        own = _full(q[:, :, mine], k[:, :, mine], v[:, :, mine], torch.ones(n, n, dtype=torch.bool).tril())[0]
        if torch.allclose(out.double(), own, atol=1e-5):
            raise AssertionError(f"rank {rank} only attends to its own block: pass the K/V blocks around the "
                                 f"ring ({WORLD - 1} times) and merge each block's result")
        err = (out.double() - want[:, :, mine]).abs().max().item()
        raise AssertionError(f"rank {rank}'s output differs from causal attention over the whole sequence by "
                             f"{err:.2e}: is every earlier block merged exactly once, with its own (out, lse)?")
