"""Part 13, expert parallelism: a top-k router with capacity, and the all-to-all dispatch on 4 ranks.

The expected values are written from the definitions here (loops over tokens and
experts), not taken from the engine or the learner's code.
"""

from __future__ import annotations

import math

from ultrascale.series.checks import on_ranks, require_finite

WORLD = 4
EXPERTS = 8


def _route_reference(logits, k, capacity_factor):
    """Top-k of the softmax, weights renormalised; each expert keeps its ceil(F*T*k/E) highest-scoring
    assignments, ties by token order."""
    import torch

    t, e = logits.shape
    scores = logits.double().softmax(-1)
    idx = scores.topk(k, dim=-1).indices
    chosen = scores.gather(1, idx)
    weights = chosen / chosen.sum(-1, keepdim=True)
    keep = torch.ones_like(idx, dtype=torch.bool)
    if capacity_factor:
        cap = math.ceil(capacity_factor * t * k / e)
        for expert in range(e):
            taken = [(-chosen[i, j].item(), i, j) for i in range(t) for j in range(k) if idx[i, j] == expert]
            for _, i, j in sorted(taken)[cap:]:
                keep[i, j] = False
    return idx, weights, keep


def _as_sets(idx, weights):
    """Per token: {expert: weight}, so the order of the k choices does not matter."""
    return [{int(e): float(w) for e, w in zip(row_i, row_w)} for row_i, row_w in zip(idx.tolist(), weights.tolist())]


def exercise_1(route):
    """route(logits [T, E], k, capacity_factor) -> (expert_idx [T, k], weights [T, k], keep [T, k])."""
    import torch

    g = torch.Generator().manual_seed(13)
    logits = torch.randn(24, EXPERTS, generator=g) * 2
    logits[:, 0] += 1.5  # a popular expert, so capacity bites
    k = 2
    idx, weights, keep = route(logits.clone(), k, 0.0)
    require_finite(weights, "your weights")
    want_idx, want_w, _ = _route_reference(logits, k, 0.0)
    assert tuple(idx.shape) == (24, k) and tuple(weights.shape) == (24, k), (
        f"expert_idx and weights should be [tokens, k] = [24, {k}], got {tuple(idx.shape)} and {tuple(weights.shape)}")
    got_sets, want_sets = _as_sets(idx, weights), _as_sets(want_idx, want_w)
    if [set(s) for s in got_sets] != [set(s) for s in want_sets]:
        raise AssertionError("the chosen experts are not each token's k highest scores: take topk of the "
                             "router's softmax over experts, per token (dim=-1)")
    raw = _as_sets(want_idx, logits.double().softmax(-1).gather(1, want_idx))
    for t, (got, want, unnorm) in enumerate(zip(got_sets, want_sets, raw)):
        right = all(abs(got[e] - want[e]) <= 1e-5 for e in got)  # not `any(... > 1e-5)`: NaN > x is False
        if all(abs(got[e] - unnorm[e]) < 1e-5 for e in got) and not right:
            raise AssertionError("the weights are the raw softmax scores of the chosen experts: renormalise "
                                 "them to sum to 1 over the k chosen experts")
        if not right:
            raise AssertionError(f"token {t}'s weights {got} should be {want}: the chosen experts' softmax "
                                 f"scores, divided by their sum")
    assert keep.dtype == torch.bool and bool(keep.all()), \
        "with capacity_factor 0 (dropless) every assignment is kept: keep should be all True"
    for factor in (1.0, 1.5):
        idx, weights, keep = route(logits.clone(), k, factor)
        # Dropped assignments keep their weight too: a NaN there poisons the output even times a 0.
        require_finite(weights, f"your weights with capacity factor {factor}")
        want_idx, want_w, want_keep = _route_reference(logits, k, factor)
        cap = math.ceil(factor * 24 * k / EXPERTS)
        got_kept = {(t, int(e)) for t in range(24) for e, kk in zip(idx[t].tolist(), keep[t].tolist()) if kk}
        want_kept = {(t, int(e)) for t in range(24) for e, kk in zip(want_idx[t].tolist(), want_keep[t].tolist())
                     if kk}
        if got_kept == want_kept:
            continue
        load = max(sum(1 for t, e in got_kept if e == x) for x in range(EXPERTS))
        if load > cap:
            raise AssertionError(f"with capacity factor {factor} an expert keeps {load} assignments, over its "
                                 f"capacity ceil({factor} * 24 * {k} / {EXPERTS}) = {cap}")
        first_come = set()
        for x in range(EXPERTS):
            rows = [(t, e) for t in range(24) for e in want_idx[t].tolist() if e == x]
            first_come |= set(rows[:cap])
        if got_kept == first_come:
            raise AssertionError("each expert keeps its first tokens in order: it should keep the assignments "
                                 "with the highest router scores and drop the lowest")
        token_cap = math.ceil(factor * 24 / EXPERTS)
        if load <= token_cap < cap:
            raise AssertionError(f"with capacity factor {factor} no expert keeps more than {load}: capacity counts "
                                 f"assignments (tokens x k), ceil({factor} * 24 * {k} / {EXPERTS}) = {cap}, not "
                                 f"tokens, ceil({factor} * 24 / {EXPERTS}) = {token_cap}")
        if load < cap:
            raise AssertionError(f"with capacity factor {factor} you keep {len(got_kept)} assignments where "
                                 f"{len(want_kept)} fit: capacity is ceil(F * tokens * k / experts) = {cap} per "
                                 f"expert (round up)")
        raise AssertionError(f"with capacity factor {factor} the kept assignments differ: each expert keeps its "
                             f"{cap} highest-scoring assignments")


def expert_forward(e, x):
    """Expert e (global index) applied to rows x: a different function for every expert."""
    import torch

    return torch.tanh(x * (e + 1)) + e


def _dispatch_case(dispatch, seed):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed + rank)
    tokens = torch.randn(10, 6, generator=g)
    expert_idx = torch.randint(0, EXPERTS, (10,), generator=g)
    expert_idx[0] = EXPERTS - 1  # every rank sends to the last rank's experts at least once
    out = dispatch(tokens.clone(), expert_idx.clone(), EXPERTS, expert_forward)
    want = torch.stack([expert_forward(int(e), tokens[i:i + 1])[0] for i, e in enumerate(expert_idx)])
    wrong_local = torch.stack([expert_forward(int(e) % (EXPERTS // dist.get_world_size()), tokens[i:i + 1])[0]
                               for i, e in enumerate(expert_idx)])
    return rank, out, want, wrong_local, tokens


def exercise_2(dispatch):
    """dispatch(tokens [T, h], expert_idx [T], n_experts, expert_forward) on 4 ranks, experts split evenly."""
    import torch

    for rank, out, want, wrong_local, tokens in on_ranks(WORLD, _dispatch_case, dispatch, 130, timeout=60):
        assert isinstance(out, torch.Tensor), f"rank {rank}: return a tensor of the tokens' expert outputs"
        assert tuple(out.shape) == tuple(want.shape), (
            f"rank {rank} returned shape {tuple(out.shape)}: one output row per token of this rank, "
            f"{tuple(want.shape)}, in the tokens' order")
        require_finite(out, f"rank {rank}'s outputs")
        if torch.allclose(out, want, atol=1e-6):
            continue
        if torch.allclose(out, wrong_local, atol=1e-6):
            raise AssertionError(f"rank {rank}: the experts were called with their local index (0..1): call "
                                 f"expert_forward with the global index, rank * experts_per_rank + local")
        if torch.allclose(out.sort(0).values, want.sort(0).values, atol=1e-6):
            raise AssertionError(f"rank {rank}: the right outputs in the wrong order: the rows come back "
                                 f"sorted by expert; put each back at its token's position (invert the sort)")
        if torch.allclose(out, tokens, atol=1e-6):
            raise AssertionError(f"rank {rank}: the tokens came back unchanged: apply each received row's "
                                 f"expert before sending the rows home")
        raise AssertionError(f"rank {rank}: the outputs differ from each token's expert applied in one process "
                             f"(max |difference| {(out - want).abs().max().item():.2e})")
