"""Part 13, expert parallelism: a top-k router with capacity, and the all-to-all dispatch on 4 ranks.

The expected values are written from the definitions here (loops over tokens and
experts), not taken from the engine or the learner's code.

exercise_2 checks the dispatch as well as the output: the expert_forward it hands the
learner records, on each rank, which expert ran on which rows (a rank may run only the
experts it owns, each on exactly the rows routed to it from all ranks), and the
collectives each rank called must be all-to-alls: one of the rank's own tokens out, one of
its experts' rows home. Every rank running every expert on its own tokens, or an
all-gather of every token, gives the right values and is said by name.
"""

from __future__ import annotations

import math
import re

from ultrascale.series.checks import on_ranks, require_finite

WORLD = 4
EXPERTS = 8


def _kept(idx, key, cap):
    """The (token, expert) assignments each expert keeps when it takes its `cap` assignments with the highest
    `key` [T, k], ties by token order."""
    t, k = idx.shape
    kept = set()
    for expert in range(EXPERTS):
        taken = [(-key[i, j].item(), i, j) for i in range(t) for j in range(k) if idx[i, j] == expert]
        kept |= {(i, expert) for _, i, j in sorted(taken)[:cap]}
    return kept


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
        kept = _kept(idx, chosen, math.ceil(capacity_factor * t * k / e))
        for i in range(t):
            for j in range(k):
                keep[i, j] = (i, int(idx[i, j])) in kept
    return idx, weights, keep


def _as_sets(idx, weights):
    """Per token: {expert: weight}, so the order of the k choices does not matter."""
    return [{int(e): float(w) for e, w in zip(row_i, row_w)} for row_i, row_w in zip(idx.tolist(), weights.tolist())]


def _check_weights(logits, idx, weights, want_idx, want_w, k):
    """The chosen experts and their weights, each known mistake named."""
    got_sets, want_sets = _as_sets(idx, weights), _as_sets(want_idx, want_w)
    if [set(s) for s in got_sets] != [set(s) for s in want_sets]:
        raise AssertionError(f"with k = {k} the chosen experts are not each token's k highest scores: take "
                             f"topk(k) of the router's softmax over experts, per token (dim=-1)")

    def near(got, want):  # not `any(... > 1e-5)`: NaN > x is False
        return all(abs(got[e] - want[e]) <= 1e-5 for e in got)

    right = all(near(g, w) for g, w in zip(got_sets, want_sets))
    raw = _as_sets(want_idx, logits.double().softmax(-1).gather(1, want_idx))
    if all(near(g, r) for g, r in zip(got_sets, raw)) and not right:
        raise AssertionError("the weights are the raw softmax scores of the chosen experts: renormalise "
                             "them to sum to 1 over the k chosen experts")
    sig = logits.double().sigmoid().gather(1, want_idx)  # with k = 1 every weight is 1, sigmoid or not
    sigmoid = _as_sets(want_idx, sig / sig.sum(-1, keepdim=True))
    if all(near(g, s) for g, s in zip(got_sets, sigmoid)) and not right:
        raise AssertionError("the weights are the chosen experts' sigmoid scores, renormalised: this router scores "
                             "with a softmax over the experts (DeepSeek-V3's sigmoid per expert is another router)")
    for t, (got, want) in enumerate(zip(got_sets, want_sets)):
        if not near(got, want):
            raise AssertionError(f"with k = {k}, token {t}'s weights {got} should be {want}: the k chosen "
                                 f"experts' softmax scores, divided by their sum")


def _check_capacity(factor, k, idx, keep, want_idx, want_w, chosen):
    """The assignments kept with capacity factor `factor`, each known mistake named."""
    tokens = len(idx)
    cap = math.ceil(factor * tokens * k / EXPERTS)
    got_kept = {(t, int(e)) for t in range(tokens) for e, kk in zip(idx[t].tolist(), keep[t].tolist()) if kk}
    want_kept = _kept(want_idx, chosen, cap)
    if got_kept == want_kept:
        return
    load = max(sum(1 for t, e in got_kept if e == x) for x in range(EXPERTS))
    if load > cap:
        raise AssertionError(f"with capacity factor {factor} an expert keeps {load} assignments, over its "
                             f"capacity ceil({factor} * {tokens} * {k} / {EXPERTS}) = {cap}")
    if got_kept == _kept(want_idx, 0 * chosen, cap):
        raise AssertionError("each expert keeps its first tokens in order: it should keep the assignments "
                             "with the highest router scores and drop the lowest")
    if got_kept == _kept(want_idx, -chosen, cap):
        raise AssertionError("each expert keeps its lowest-scoring assignments and drops the highest: sort the "
                             "scores in descending order (torch.sort(-scores) or descending=True)")
    if got_kept == _kept(want_idx, want_w, cap):
        raise AssertionError("each expert ranks its assignments by the renormalised weights: rank them by the "
                             "router's scores (the softmax over all experts); a token's renormalised weight depends "
                             "on its other choices, not only on how much it wants this expert")
    token_cap = math.ceil(factor * tokens / EXPERTS)
    if load <= token_cap < cap:
        raise AssertionError(f"with capacity factor {factor} no expert keeps more than {load}: capacity counts "
                             f"assignments (tokens x k), ceil({factor} * {tokens} * {k} / {EXPERTS}) = {cap}, not "
                             f"tokens, ceil({factor} * {tokens} / {EXPERTS}) = {token_cap}")
    if load < cap:
        raise AssertionError(f"with capacity factor {factor} you keep {len(got_kept)} assignments where "
                             f"{len(want_kept)} fit: capacity is ceil(F * tokens * k / experts) = {cap} per "
                             f"expert (round up: {factor} * {tokens} * {k} / {EXPERTS} = "
                             f"{factor * tokens * k / EXPERTS:g})")
    raise AssertionError(f"with capacity factor {factor} the kept assignments differ: each expert keeps its "
                         f"{cap} highest-scoring assignments")


def exercise_1(route):
    """route(logits [T, E], k, capacity_factor) -> (expert_idx [T, k], weights [T, k], keep [T, k])."""
    import torch

    g = torch.Generator().manual_seed(13)
    logits = torch.randn(24, EXPERTS, generator=g) * 2
    logits[:, 0] += 1.5  # a popular expert, so capacity bites
    # k = 2 first (where the raw scores differ from the renormalised ones), then 3 and 1: a k written as a number,
    # or weights renormalised over another count, shows. 1.25 makes F * T * k / E fractional (7.5, 11.25, 3.75):
    # rounding down shows.
    for k in (2, 3, 1):
        idx, weights, keep = route(logits.clone(), k, 0.0)
        require_finite(weights, f"your weights with k = {k}")
        want_idx, want_w, _ = _route_reference(logits, k, 0.0)
        assert tuple(idx.shape) == (24, k) and tuple(weights.shape) == (24, k), (
            f"with k = {k}, expert_idx and weights should be [tokens, k] = [24, {k}], got {tuple(idx.shape)} and "
            f"{tuple(weights.shape)}")
        _check_weights(logits, idx, weights, want_idx, want_w, k)
        assert keep.dtype == torch.bool and bool(keep.all()), \
            "with capacity_factor 0 (dropless) every assignment is kept: keep should be all True"
        chosen = logits.double().softmax(-1).gather(1, want_idx)
        for factor in (1.0, 1.25, 1.5):
            idx, weights, keep = route(logits.clone(), k, factor)
            # Dropped assignments keep their weight too: a NaN there poisons the output even times a 0.
            require_finite(weights, f"your weights with k = {k} and capacity factor {factor}")
            _check_capacity(factor, k, idx, keep, want_idx, want_w, chosen)
    # Exact ties: 2 distinct rows, each 32 times over, so an expert's capacity falls among equal scores and
    # the earlier token must win (an unstable sort picks among them as it likes).
    tied = logits[:2].repeat(32, 1)
    want_idx, want_w, _ = _route_reference(tied, 2, 0.0)
    chosen = tied.double().softmax(-1).gather(1, want_idx)
    idx, weights, keep = route(tied.clone(), 2, 1.0)
    require_finite(weights, "your weights on tied scores")
    got = {(t, int(e)) for t in range(len(idx)) for e, kk in zip(idx[t].tolist(), keep[t].tolist()) if kk}
    if got != _kept(want_idx, chosen, math.ceil(len(tied) * 2 / EXPERTS)):
        raise AssertionError("where tokens score exactly the same for an expert, the earlier token keeps its place "
                             "and the later ones are dropped: rank with a stable sort (torch.sort(-scores, "
                             "stable=True)) or by (score, token)")


def expert_forward(e, x):
    """Expert e (global index) applied to rows x: a different function for every expert."""
    import torch

    return torch.tanh(x * (e + 1)) + e


TOKENS, HIDDEN = 10, 6  # per rank
SEED = 130


def _dispatch_inputs(seed, rank):
    """Rank `rank`'s tokens [T, h] and their experts [T]. Every rank but the last sends to the last rank,
    rank 1 sends nothing to rank 2 (a send count of 0: counts read off the experts present, `unique`, come
    out short), rank 2 routes nothing to the last expert (a `bincount` of experts without `minlength` comes
    out short) and the last rank nothing to itself (so does a `bincount` of destination ranks)."""
    import torch

    g = torch.Generator().manual_seed(seed + rank)
    tokens = torch.randn(TOKENS, HIDDEN, generator=g)
    expert_idx = torch.randint(0, EXPERTS, (TOKENS,), generator=g)
    expert_idx[0] = EXPERTS - 1
    local = EXPERTS // WORLD
    if rank == 1:
        expert_idx[expert_idx // local == 2] -= 2 * local
    if rank == 2:
        expert_idx[expert_idx == EXPERTS - 1] = EXPERTS - 2
    if rank == WORLD - 1:
        expert_idx[expert_idx // local == rank] -= rank * local
    return tokens, expert_idx


def _dispatch_case(dispatch, seed):
    """On each rank: the learner's dispatch with an expert_forward that records which expert ran on which rows."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    tokens, expert_idx = _dispatch_inputs(seed, rank)
    ran = []

    def recorded(e, x):
        ran.append((int(e), x.detach().double().clone()))
        return expert_forward(e, x)

    out = dispatch(tokens.clone(), expert_idx.clone(), EXPERTS, recorded)
    want = torch.stack([expert_forward(int(e), tokens[i:i + 1])[0] for i, e in enumerate(expert_idx)])
    return rank, out, want, tokens, ran


def _by_rows(x):
    """Rows in a canonical order (by their first value, random and distinct), to compare them as a set."""
    return x[x[:, 0].argsort()] if len(x) else x


def _same_rows(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.allclose(_by_rows(a), _by_rows(b), atol=1e-12)


def _run_dispatch(dispatch, calls):
    from ultrascale.series.checks import RankError

    try:
        return on_ranks(WORLD, _dispatch_case, dispatch, SEED, timeout=60, calls=calls)
    except RankError as e:
        first = str(e).splitlines()[0]
        short = re.search(r"is invalid for input of size (\d+)", first)
        if short and int(short.group(1)) < EXPERTS:
            raise AssertionError(
                f"a rank's count table holds {short.group(1)} counts for {EXPERTS} experts ({first[:160]}): "
                f"torch.bincount counts up to the highest expert present, and rank 2 routes nothing to expert "
                f"{EXPERTS - 1}; pass minlength=n_experts, so that every expert has its count, 0 included") from None
        if "died" in str(e):
            # Gloo aborts a process whose peer sends a message of another size than it posted for.
            raise AssertionError(
                f"a rank died during the exchange ({str(e).splitlines()[-1][:120]}): gloo ends a process when a "
                f"peer sends another number of rows than it expects. Every rank's send counts need one entry per "
                f"rank, 0 included (rank 1 sends nothing to rank 2, rank {WORLD - 1} nothing to itself, the last entry): count the tokens per destination rank with "
                f"torch.bincount(expert_idx // experts_per_rank, minlength=world), and the counts must add up to "
                f"the rows sent") from None
        if "split" in first.lower() or "invalid tensor size" in first:
            raise AssertionError(
                f"a rank failed exchanging or splitting rows ({first[:160]}): send_counts[r] is how many of this "
                f"rank's rows go to rank r, the tokens whose expert lives there (expert // (E/4)); the counts must "
                f"add up to the rows sent, and the rows received split by the counts that came back") from None
        raise


def _check_collectives(rank, mine):
    from ultrascale.series.watch import kinds

    for call, kind in zip(mine, kinds(mine)):
        if kind in ("all_to_all", "all_to_all_single", "barrier"):
            continue
        if kind.startswith("all_gather"):
            raise AssertionError(
                f"rank {rank} called {kind} ({call}): every rank sees every token, and the experts' outputs go "
                f"back with a reduction; the all-to-all dispatch sends each token only to its expert's rank and its "
                f"output only back home: two all-to-alls")
        raise AssertionError(
            f"rank {rank} called {kind} ({call}): the dispatch needs only all-to-alls (dist.all_to_all_single, "
            f"as exchange does): one to send each token to its expert's rank, one to send the outputs home")


def _check_experts_ran(results, owned, routed):
    """Each rank ran only its own experts, each on exactly the rows routed to it from every rank."""
    import torch

    local = EXPERTS // WORLD
    ran = {rank: [(e, x) for e, x in r[4] if len(x)] for rank, r in enumerate(results)}
    if not any(ran.values()):
        raise AssertionError("expert_forward was never called: the tokens came back unchanged. Apply each "
                             "received row's expert (expert_forward(e, rows), e the global index) before sending "
                             "the rows home")
    for rank, calls in ran.items():
        experts = sorted({e for e, _ in calls})
        foreign = [e for e in experts if e not in owned[rank]]
        if not foreign:
            continue
        if rank > 0 and all(e < local for e in experts):
            raise AssertionError(f"rank {rank}: the experts were called with their local index (0..{local - 1}): "
                                 f"call expert_forward with the global index, rank * experts_per_rank + local")
        if all(e % WORLD == rank for e in experts):
            raise AssertionError(
                f"rank {rank} ran experts {experts}, every {WORLD}th: the experts are split in contiguous ranges, "
                f"rank r holds experts r * E/{WORLD} .. (r + 1) * E/{WORLD} - 1, so expert e lives on rank "
                f"e // (E/{WORLD}); send each token there")
        e = foreign[0]
        raise AssertionError(
            f"rank {rank} ran expert {e}, which lives on rank {e // local}: a rank runs only its own experts "
            f"({owned[rank][0]}..{owned[rank][-1]} here). Send each token to its expert's rank with an all-to-all, "
            f"run the experts there, and send the outputs back")
    for rank, calls in ran.items():
        got = {e: torch.cat([x for f, x in calls if f == e]) for e in owned[rank] if any(f == e for f, _ in calls)}
        arrived = torch.cat(list(got.values())) if got else torch.zeros(0, HIDDEN, dtype=torch.float64)
        expected = torch.cat([routed[e] for e in owned[rank]])
        if len(arrived) != len(expected):
            raise AssertionError(
                f"rank {rank}'s experts ran on {len(arrived)} rows, and {len(expected)} of the 4 ranks' tokens are "
                f"routed to them: each token goes to its expert's rank exactly once, and each expert runs on every "
                f"row sent to it")
        if not _same_rows(arrived, expected):
            raise AssertionError(
                f"rank {rank}'s experts ran on rows that are not the tokens routed to them: sort the token copies "
                f"by expert before sending (tokens[order]), so that the send_counts[r] consecutive rows for rank r "
                f"are the tokens whose expert lives there")
        for e in owned[rank]:
            rows = got.get(e, torch.zeros(0, HIDDEN, dtype=torch.float64))
            if not _same_rows(rows, routed[e]):
                raise AssertionError(
                    f"rank {rank} received the right rows but expert {e} ran on {len(rows)} rows that are not the "
                    f"{len(routed[e])} routed to it: the received rows are grouped by source rank, then by expert "
                    f"within each source; split them by source (the counts received) and each source's by the "
                    f"per-expert counts that source sent")


def _check_all_to_all_pair(rank, mine, received_rows):
    """A dispatch all-to-all of this rank's TOKENS rows, then a combine of the rows its experts computed.
    A row is the token's HIDDEN floats, or those with a column or two beside them (the expert id, the token's
    position), sent in the same message rather than in an all-to-all of their own."""
    widths = [(HIDDEN + extra) * 4 for extra in range(3)]  # float32 rows
    sizes = [c.bytes for c in mine if c.kind in ("all_to_all", "all_to_all_single")]
    dispatched = [i for i, b in enumerate(sizes) if b in [TOKENS * w for w in widths]]
    if not dispatched:
        raise AssertionError(
            f"rank {rank} sent no all-to-all of its {TOKENS} tokens ({TOKENS * widths[0]} B, {HIDDEN} floats a "
            f"row; all-to-alls of {sizes} B): the dispatch sends each token once, to its expert's rank")
    after = sizes[dispatched[0] + 1:]
    if not any(received_rows * w in after for w in widths):
        raise AssertionError(
            f"rank {rank} never sent the experts' outputs home: after the dispatch its experts computed "
            f"{received_rows} rows ({received_rows * widths[0]} B) for other ranks' tokens; the second all-to-all "
            f"(the dispatch reversed: the received counts become the send counts) returns each to its token's rank")


def exercise_2(dispatch):
    """dispatch(tokens [T, h], expert_idx [T], n_experts, expert_forward) on 4 ranks, experts split evenly."""
    import torch

    local = EXPERTS // WORLD
    owned = {r: list(range(r * local, (r + 1) * local)) for r in range(WORLD)}
    inputs = [_dispatch_inputs(SEED, r) for r in range(WORLD)]
    routed = {e: torch.cat([t[i == e] for t, i in inputs]).double() for e in range(EXPERTS)}
    calls = []
    results = _run_dispatch(dispatch, calls)
    for rank, mine in enumerate(calls):
        _check_collectives(rank, mine)
    _check_experts_ran(results, owned, routed)
    for rank, mine in enumerate(calls):
        _check_all_to_all_pair(rank, mine, sum(len(routed[e]) for e in owned[rank]))
    for rank, out, want, tokens, _ in results:
        assert isinstance(out, torch.Tensor), f"rank {rank}: return a tensor of the tokens' expert outputs"
        assert tuple(out.shape) == tuple(want.shape), (
            f"rank {rank} returned shape {tuple(out.shape)}: one output row per token of this rank, "
            f"{tuple(want.shape)}, in the tokens' order")
        require_finite(out, f"rank {rank}'s outputs")
        if torch.allclose(out, want, atol=1e-6):
            continue
        if torch.allclose(out.sort(0).values, want.sort(0).values, atol=1e-6):
            raise AssertionError(f"rank {rank}: the right outputs in the wrong order: the rows come back "
                                 f"sorted by expert; put each back at its token's position (invert the sort)")
        raise AssertionError(f"rank {rank}: the outputs differ from each token's expert applied in one process "
                             f"(max |difference| {(out - want).abs().max().item():.2e})")
