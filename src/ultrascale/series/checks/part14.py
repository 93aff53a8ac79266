"""Checks of Part 14: 5-D parallelism and finding the best configuration.

exercise_1(grid_position)  a global rank's coordinates on the dp x pp x cp x tp grid and the ranks of
                           its tp / dp / pp groups, tp innermost: first for layouts of 8 to 48 ranks
                           against the engine's grid (grid_groups), with the engine's own functions
                           hidden from the learner's (looking the answer up is not computing it), then
                           on 4 real ranks against the groups the engine builds there (build_context),
                           where the learner's function must not communicate. A wrong answer is read
                           against the grids of the other orders of the four dimensions, to name the
                           order it laid out.
exercise_2(best_layout)    a small search over (dp, pp, tp) under the stated constraints, ranked by a
                           given throughput function: first on hand-made functions where each rule
                           decides the answer (the layouts the search asks the functions about are
                           noted, to say when it never looked at the best one), then with the
                           planner's memory and time models (cached: the same cases every run), compared
                           with the planner's own choice (ultrascale.plan.search, pinned to the same
                           knobs so that the search stays fast).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math

from ultrascale.series.checks import require_finite

DIMS = ("dp", "pp", "cp", "tp")


# ---- exercise 1 ---------------------------------------------------------------------------------

def _engine(layout: dict, rank: int):
    """(coords, {tp, dp, pp: ranks}) from the engine's grid."""
    from ultrascale.config import ParallelConfig
    from ultrascale.distributed.context import _coords, grid_groups

    world = math.prod(layout[d] for d in DIMS)
    groups = grid_groups(ParallelConfig(**layout), world)
    mine = {name: next(g for g in groups[name] if rank in g) for name in ("tp", "dp", "pp")}
    return _coords(ParallelConfig(**layout), rank), mine


def _on_rank(grid_position, layouts):
    """On each real rank: the learner's answer and the groups the engine built on this rank."""
    import torch.distributed as dist

    from ultrascale.config import ParallelConfig
    from ultrascale.distributed.context import build_context
    from ultrascale.series import watch

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for layout in layouts:
        with watch.unwatched():  # the engine's groups are the check's, not the learner's
            ctx = build_context(ParallelConfig(**layout), rank, world)
        engine = (dict(ctx.coords), {name: list(ctx.group_ranks[name]) for name in ("tp", "dp", "pp")})
        out.append((layout, engine, grid_position(rank, layout["dp"], layout["pp"], layout["cp"], layout["tp"])))
    return out


def _label(layout: dict) -> str:
    return " x ".join(f"{d}{layout[d]}" for d in DIMS if layout[d] > 1) or "one rank"


def _place(order: tuple, layout: dict, rank: int):
    """(coords, {tp, dp, pp: ranks}) of `rank` on the grid laid out as arange(world).reshape(*order)."""
    strides, s = {}, 1
    for d in reversed(order):  # the last dimension of the reshape is the innermost
        strides[d] = s
        s *= layout[d]
    coords = {d: rank // strides[d] % layout[d] for d in DIMS}
    groups = {}
    for name in ("tp", "dp", "pp"):
        first = rank - coords[name] * strides[name]
        groups[name] = [first + i * strides[name] for i in range(layout[name])]
    return coords, groups


def _other_order(layout: dict, answers: dict):
    """The order of dimensions, other than the engine's, whose grid gives most of the learner's answers
    ({rank: (coords, groups)}), or None when no other order explains any of them."""
    best, score = None, 0
    for order in itertools.permutations(DIMS):
        if order == DIMS:
            continue
        matched = 0
        for rank, (coords, groups) in answers.items():
            want_coords, want_groups = _place(order, layout, rank)
            matched += (coords == want_coords) + sum(groups[n] == want_groups[n] for n in ("tp", "dp", "pp"))
        if matched > score:
            best, score = order, matched
    return best


def _wrong_order(call: str, layout: dict, order: tuple, what: str) -> AssertionError:
    shown = [d for d in order if layout[d] > 1]
    if shown[-1] == "dp":
        why = "as if dp were innermost"
    elif shown[0] == "tp":
        why = "as if tp were outermost"
    else:
        why = f"{shown[-1]} innermost"
    left_out = " (the sizes of 1 left out)" if len(shown) < len(DIMS) else ""
    return AssertionError(
        f"{call}: {what} ({_label(layout)}): you laid the grid out as arange(world).reshape({', '.join(shown)})"
        f"{left_out}, {why}; the engine's grid is arange(world).reshape(dp, pp, cp, tp), tp innermost (tp groups "
        f"are consecutive ranks, on one node), so tp = rank % tp comes first, then cp, pp and dp, and a dimension's "
        f"stride is the product of the sizes inside it (cp: tp, pp: cp x tp, dp: pp x cp x tp)")


def _call(layout: dict, rank: int) -> str:
    return f"grid_position({rank}, dp={layout['dp']}, pp={layout['pp']}, cp={layout['cp']}, tp={layout['tp']})"


def _read(layout: dict, rank: int, got):
    """The learner's answer as ({dim: int}, {name: [int]}), after checking its form."""
    call = _call(layout, rank)
    assert isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], dict) and isinstance(got[1], dict), (
        f"{call} returned {got!r}: return a tuple (coords, groups) of two dicts")
    require_finite(got, f"what {call} returned")  # int(nan) would fail with a ValueError
    coords, groups = got
    for d in DIMS:
        assert d in coords, f"{call}: coords has no {d!r} entry; give all four: dp, pp, cp, tp"
    for name in ("tp", "dp", "pp"):
        assert name in groups, f"{call}: groups has no {name!r} entry; give tp, dp and pp"
    return {d: int(coords[d]) for d in DIMS}, {name: [int(r) for r in groups[name]] for name in ("tp", "dp", "pp")}


def _check_layout(layout: dict, results: dict) -> None:
    """results: {rank: (engine, learner's answer)} for ranks of one layout. Every rank's coordinates first
    (a wrong order shows there), then the groups."""
    answers = {rank: _read(layout, rank, got) for rank, (_, got) in results.items()}
    for rank, (engine, _) in results.items():
        got_coords, want_coords = answers[rank][0], engine[0]
        if got_coords == want_coords:
            continue
        call = _call(layout, rank)
        if layout["cp"] > 1 and all(coords["cp"] == 0 for coords, _ in answers.values()):
            raise AssertionError(f"{call}: coords {got_coords}, the engine's {want_coords} ({_label(layout)}): your "
                                 f"cp index is 0 on a grid with cp = {layout['cp']}: peel cp off the rank between tp "
                                 f"and pp (every size counts, cp included)")
        order = _other_order(layout, answers)
        if order is not None and _place(order, layout, rank)[0] == got_coords:
            raise _wrong_order(call, layout, order, f"coords {got_coords}, the engine's {want_coords}")
        raise AssertionError(f"{call}: coords {got_coords}, the engine's {want_coords} ({_label(layout)}): the grid "
                             f"is arange(world).reshape(dp, pp, cp, tp): tp = rank % tp, then rank //= tp, and so "
                             f"on through cp, pp, dp (every size counts, cp included)")
    for rank, (engine, _) in results.items():
        _compare_groups(layout, rank, engine[1], answers[rank][1], answers)


def _compare_groups(layout: dict, rank: int, want_groups: dict, got_groups: dict, answers: dict) -> None:
    call = _call(layout, rank)
    world = math.prod(layout[d] for d in DIMS)
    for name, stride_dims in (("tp", ()), ("dp", ("pp", "cp", "tp")), ("pp", ("cp", "tp"))):
        mine, want = got_groups[name], want_groups[name]
        if mine == want:
            continue
        stride = math.prod(layout[d] for d in stride_dims)
        size = layout[name]
        if sorted(mine) == want:
            raise AssertionError(f"{call}: your {name} group {mine} has the right ranks in another order; the "
                                 f"engine lists a group by increasing {name} index, {want}: the rank at {name} "
                                 f"index i is group[i] (pipeline stage i, shard i)")
        if mine in ([r + stride for r in want], [r - stride for r in want]):
            raise AssertionError(f"{call}: your {name} group {mine} is the engine's {want} moved by one stride: "
                                 f"off by one stride; the {name} indices run over range({name}) = 0..{size - 1}, "
                                 f"from first = rank - index * stride")
        if len(mine) != size:
            raise AssertionError(f"{call}: your {name} group has {len(mine)} ranks, {mine}; a {name} group holds "
                                 f"{name} = {size} ranks, one per {name} index: the ranks that differ from {rank} "
                                 f"only in their {name} coordinate ({_label(layout)}), the engine's {want}")
        if name == "dp" and mine == [rank // layout["dp"] * layout["dp"] + i for i in range(layout["dp"])]:
            raise AssertionError(f"{call}: your dp group {mine} is made of consecutive ranks, the engine's is "
                                 f"{want}: consecutive ranks are the tp group (tp is innermost); dp is outermost, "
                                 f"its ranks are pp x cp x tp = {stride} apart")
        if name == "pp" and layout["cp"] > 1 and len(mine) > 1 and mine[1] - mine[0] == layout["tp"]:
            raise AssertionError(f"{call}: your pp group {mine} steps by tp = {layout['tp']}, the engine's is {want} "
                                 f"({_label(layout)}): between two pipeline stages lie a whole cp x tp block, so "
                                 f"pp neighbours are cp x tp = {stride} ranks apart")
        order = _other_order(layout, answers)
        if order is not None and _place(order, layout, rank)[1][name] == mine:
            raise _wrong_order(call, layout, order, f"your {name} group is {mine}, the engine's {want}")
        if rank not in mine or not all(0 <= r < world for r in mine):
            raise AssertionError(f"{call}: your {name} group {mine} is not made of ranks of the grid that share "
                                 f"{rank}'s other coordinates: it must hold {rank} itself and ranks 0..{world - 1}; "
                                 f"the engine's is {want}")
        raise AssertionError(f"{call}: your {name} group is {mine}, the engine's {want} ({_label(layout)}): the "
                             f"ranks that differ only in their {name} coordinate, {name} index 0 first; they are "
                             f"{stride} apart (the product of the sizes inside {name})")


RANK_LAYOUTS = [dict(dp=2, pp=1, cp=1, tp=2), dict(dp=2, pp=2, cp=1, tp=1), dict(dp=1, pp=2, cp=1, tp=2),
                dict(dp=1, pp=2, cp=2, tp=1)]
GRID_LAYOUTS = [dict(dp=2, pp=2, cp=1, tp=2), dict(dp=2, pp=2, cp=2, tp=2), dict(dp=4, pp=2, cp=1, tp=2),
                dict(dp=2, pp=4, cp=2, tp=4), dict(dp=3, pp=2, cp=2, tp=2), dict(dp=2, pp=3, cp=1, tp=4)]
ENGINE = ("grid_groups", "build_context", "_coords")  # the engine's own answer to the exercise


class _AskedEngine(Exception):
    pass


@contextlib.contextmanager
def _engine_hidden(fn):
    """While the learner's function runs here, the engine's grid functions answer with _AskedEngine: the
    exercise is to compute a rank's place, not to look it up (grid_groups is among the notebook's imports)."""
    import ultrascale.distributed.context as context

    def asked(name):
        def trap(*args, **kwargs):
            raise _AskedEngine(name)
        return trap

    originals = {name: getattr(context, name) for name in ENGINE}
    namespace = getattr(fn, "__globals__", {})
    shadowed = {k: v for k, v in namespace.items() if any(v is f for f in originals.values())}
    try:
        for name in ENGINE:
            setattr(context, name, asked(name))
        for k, v in shadowed.items():
            namespace[k] = asked(v.__name__)
        yield
    finally:
        for name, f in originals.items():
            setattr(context, name, f)
        namespace.update(shadowed)


def _ask(grid_position, layout: dict, rank: int):
    """grid_position(rank, ...) in this process, where no process group exists and the engine is hidden."""
    try:
        with _engine_hidden(grid_position):
            return grid_position(rank, layout["dp"], layout["pp"], layout["cp"], layout["tp"])
    except _AskedEngine as e:
        raise AssertionError(f"grid_position asks the engine ({e}) where the rank sits: that is the answer, "
                             f"not the way to it; peel the coordinates off the rank, tp = rank % tp first, and "
                             f"build each group from its stride") from None
    except (ValueError, RuntimeError) as e:
        if "process group" not in str(e) and "init_process_group" not in str(e):
            raise
        raise AssertionError(f"grid_position called torch.distributed ({str(e).splitlines()[0][:80]}): a rank's "
                             f"place follows from its number and the four sizes alone; use the `rank` argument, "
                             f"not dist.get_rank(), and dp * pp * cp * tp for the world size") from None


def exercise_1(grid_position, world: int = 4):
    from ultrascale.series.ranks import on_ranks

    # Pure layouts first (cheap, and they name a wrong order before any process is involved).
    for layout in GRID_LAYOUTS:
        n = math.prod(layout[d] for d in DIMS)
        ranks = sorted({0, 1, 2, n // 2 - 1, n // 2 + 1, n - 2, n - 1})
        _check_layout(layout, {rank: (_engine(layout, rank), _ask(grid_position, layout, rank)) for rank in ranks})
    # Then on real ranks: each rank computes its own place, next to the groups the engine built there.
    calls = []
    per_rank = on_ranks(world, _on_rank, grid_position, RANK_LAYOUTS, calls=calls)
    for rank, made in enumerate(calls):
        if made:
            raise AssertionError(f"rank {rank}'s grid_position called {made[0]} ({len(made)} calls in all): no "
                                 f"communication is needed to know where a rank sits, its number and the sizes say "
                                 f"it; compute it locally")
    for i, layout in enumerate(RANK_LAYOUTS):
        _check_layout(layout, {rank: results[i][1:] for rank, results in enumerate(per_rank)})
    print(f"Same coordinates and groups as the engine: {len(GRID_LAYOUTS)} layouts of 8-48 ranks, and "
          f"{len(RANK_LAYOUTS)} layouts on {world} real ranks against the groups each rank built")


# ---- exercise 2 ---------------------------------------------------------------------------------

TIE = 0.01  # the exercise's rule: throughputs within 1% are a tie, the simpler layout wins


def _valid(gpus, heads, layers, sequences):
    for tp in range(1, gpus + 1):
        for pp in range(1, gpus // tp + 1):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            if tp <= 8 and heads % tp == 0 and layers % pp == 0 and sequences % dp == 0:
                yield dp, pp, tp


def reference(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [lay for lay in _valid(gpus, heads, layers, sequences) if memory_per_gpu(*lay) <= limit]
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    band = [lay for lay in fits if tokens_per_s(*lay) >= best * (1 - TIE)]
    return min(band, key=lambda lay: (lay[1], lay[2]))


def _watched(fn, seen: set):
    """fn, noting every (dp, pp, tp) it is asked about in `seen`: which layouts the search looked at."""
    def ask(dp, pp, tp):
        seen.add((dp, pp, tp))
        return fn(dp, pp, tp)
    return ask


def _judge(case: str, args, best_layout, fmt=str):
    gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit = args
    seen = set()
    got = best_layout(gpus, heads, layers, sequences, _watched(memory_per_gpu, seen), _watched(tokens_per_s, seen),
                      limit)
    want = reference(*args)
    if want is None:
        assert got is None, f"{case}: no layout fits in memory, return None; you returned {got!r}"
        return got
    assert got is not None, f"{case}: you returned None, but {want} (dp, pp, tp) fits and is valid"
    assert isinstance(got, tuple) and len(got) == 3 and all(isinstance(v, int) for v in got), (
        f"{case}: return a tuple of three ints (dp, pp, tp), got {got!r}")
    fits = [lay for lay in _valid(gpus, heads, layers, sequences) if memory_per_gpu(*lay) <= limit]
    best = max(tokens_per_s(*lay) for lay in fits)
    dp, pp, tp = got
    in_band = got in fits and tokens_per_s(*got) >= best * (1 - TIE)
    assert (dp, tp, pp) != want or pp == tp or in_band, (
        f"{case}: you returned {got}, which is the expected layout in the order (dp, tp, pp); return (dp, pp, tp)")
    assert dp * pp * tp == gpus, f"{case}: dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp}, not the {gpus} GPUs"
    assert tp <= 8, (f"{case}: tp = {tp} spans more than one 8-GPU node: tensor parallelism's per-layer "
                     f"collectives need NVLink, so tp <= 8")
    assert heads % tp == 0, (f"{case}: tp = {tp} does not divide the {heads} attention heads: each tensor-parallel "
                             f"rank holds a whole number of heads")
    assert layers % pp == 0, (f"{case}: pp = {pp} does not divide the {layers} layers: every stage holds the same "
                              f"number of layers")
    assert sequences % dp == 0, (f"{case}: dp = {dp} does not divide the {sequences} sequences of the global batch: "
                                 f"the batch must split evenly over the replicas (step 2)")
    mem = memory_per_gpu(*got)
    assert mem <= limit, (f"{case}: {got} needs {fmt(mem)} per GPU, above the limit of {fmt(limit)}: drop every "
                          f"layout that does not fit before ranking (step 1)")
    mine = tokens_per_s(*got)
    if mine < best * (1 - TIE):
        fastest = max(fits, key=lambda lay: tokens_per_s(*lay))
        said = f"{case}: {got} gives {mine:,.0f} tokens/s/GPU, {fastest} gives {best:,.0f}"
        if memory_per_gpu(*fastest) == limit and fastest in seen:
            raise AssertionError(f"{said}, which needs exactly the limit, {fmt(limit)}: a layout fits when its memory "
                                 f"is at most the limit (memory_per_gpu(...) <= limit)")
        if fastest not in seen:
            raise AssertionError(f"{said}, and your search never looked at {fastest}: enumerate every tp from 1 to "
                                 f"8 inclusive and every pp up to the GPUs, dp = gpus // (tp * pp)")
        least = min(memory_per_gpu(*lay) for lay in fits)
        if mem == least and any(memory_per_gpu(*lay) != least for lay in fits):
            raise AssertionError(f"{said} - you chose a layout that needs the least memory; fitting is only step 1, "
                                 f"among what fits take the fastest (step 3)")
        as_fast = [lay for lay in fits if tokens_per_s(*lay) >= mine]
        if got == min(as_fast, key=lambda lay: (lay[1], lay[2])) and mine >= best / 2:
            raise AssertionError(f"{said}: you counted {got} as a tie with the fastest, but it is "
                                 f"{1 - mine / best:.1%} slower; a tie is within 1% (tokens_per_s >= 0.99 x the "
                                 f"best), only then does the simpler layout win")
        raise AssertionError(f"{said}: rank what fits by tokens_per_s (step 3)")
    if got != want and got == min((lay for lay in fits if tokens_per_s(*lay) >= best * (1 - TIE)),
                                  key=lambda lay: (lay[2], lay[1])):
        raise AssertionError(f"{case}: {got} and {want} are both within 1% of the fastest, a tie; you took the "
                             f"fewest tp ranks first, the rule takes the fewest pipeline stages first, then the "
                             f"fewest tp ranks: min(ties, key=lambda lay: (pp, tp))")
    if tokens_per_s(*want) == best * (1 - TIE) and got != want:
        raise AssertionError(f"{case}: {want} gives exactly 0.99 x the fastest's tokens/s ({tokens_per_s(*want):,.1f} "
                             f"of {best:,.1f}): that is a tie (>= 0.99 x the best), and the simpler layout wins")
    assert got == want, (f"{case}: {got} is within 1% of the fastest ({mine:,.0f} vs {best:,.0f} tokens/s/GPU), a "
                         f"tie the time model cannot tell apart; the planner then takes the simplest, {want}: fewest "
                         f"pipeline stages, then fewest tp ranks")
    return got


def _synthetic():
    """(what it tests, args): hand-made memory and throughput functions, each case decided by one rule."""
    fits = lambda dp, pp, tp: 1.0  # noqa: E731
    return [
        ("memory first", (8, 8, 8, 8, lambda dp, pp, tp: 100.0 / (pp * tp), lambda dp, pp, tp: 100.0 * dp - pp, 30.0)),
        ("tp capped at a node", (32, 32, 8, 32, fits, lambda dp, pp, tp: 100.0 * tp + dp, 10.0)),
        ("tp divides the heads", (8, 12, 8, 8, fits, lambda dp, pp, tp: 100.0 * tp + dp, 10.0)),
        ("pp divides the layers", (8, 8, 6, 8, fits, lambda dp, pp, tp: 100.0 * pp + tp, 10.0)),
        ("dp divides the batch", (8, 8, 8, 4, fits, lambda dp, pp, tp: 100.0 * dp + tp, 10.0)),
        ("ties go to the simpler layout", (8, 8, 8, 8, fits, lambda dp, pp, tp: 1000.0 + pp + tp, 10.0)),
        ("fewest stages before fewest tp ranks",
         (8, 8, 8, 8, fits, lambda dp, pp, tp: {(1, 8): 1005.0, (1, 4): 1000.0, (2, 1): 1000.0}.get((pp, tp), 900.0),
          10.0)),
        ("nothing fits", (8, 8, 8, 8, lambda dp, pp, tp: 50.0, lambda dp, pp, tp: 1.0, 10.0)),
        # Sizes that are not powers of two: the best tp is 6 of 12 GPUs, the best pp 3 of 6.
        # The rules' boundaries, met exactly: memory equal to the limit fits (<=), a throughput of exactly
        # 0.99 x the best is a tie (>=); 990.0 == 0.99 * 1000.0 in binary floating point too.
        ("memory exactly at the limit", (8, 8, 8, 8, lambda dp, pp, tp: 10.0 if tp == 8 else 5.0,
                                         lambda dp, pp, tp: 100.0 * tp + dp, 10.0)),
        ("a tie at exactly 1%", (8, 8, 8, 8, fits, lambda dp, pp, tp: {(1, 8): 1000.0, (1, 1): 990.0}.get((pp, tp), 900.0),
                                 10.0)),
        ("12 GPUs, 12 heads", (12, 12, 6, 12, fits, lambda dp, pp, tp: 100.0 * tp + 10.0 * pp + dp, 10.0)),
        ("6 GPUs, 9 layers", (6, 8, 9, 6, fits, lambda dp, pp, tp: 100.0 * pp + dp, 10.0)),
    ]


PINNED = {"cp": 1, "zero": 1, "recompute": "none", "micro_batch": 1, "schedule": "1f1b"}
# (model, GPU, GPUs, tokens per step); sequences of 4096 tokens
PLANNER_CASES = [("llama3-70b", "h100-80gb", 64, 2**20), ("llama3-8b", "h100-80gb", 16, 2**20),
                 ("llama3-70b", "h200", 32, 2**20), ("llama3-8b", "a100-40gb", 8, 2**19)]


def _planner():
    """The playbook-calibrated framework with the even stage split, as `ultrascale plan` uses it."""
    from dataclasses import replace

    from ultrascale.plan.calibration import get_framework

    return replace(get_framework("playbook"), partition="even")


@functools.lru_cache(maxsize=None)  # the check is run again and again on the same cases
def planner_functions(model: str, gpu_name: str, gpus: int, tokens: int, seq_len: int = 4096):
    """The planner's memory per GPU and tokens/s/GPU of (dp, pp, tp), with the pinned knobs."""
    from ultrascale.plan.hardware import playbook_cluster
    from ultrascale.plan.layout import Layout
    from ultrascale.plan.memory import memory_plan
    from ultrascale.plan.shape import get_shape
    from ultrascale.plan.time import step_time

    shape, gpu, fw = get_shape(model), playbook_cluster(gpu_name), _planner()
    sequences = tokens // seq_len

    def layout(dp, pp, tp):
        return Layout(dp=dp, pp=pp, tp=tp, zero=1 if dp > 1 else 0, micro_batch=1, grad_accum=sequences // dp,
                      seq_len=seq_len, precision="bf16", schedule="1f1b", recompute="none")

    cache = {}

    def memory_per_gpu(dp, pp, tp):
        key = ("m", dp, pp, tp)
        if key not in cache:
            cache[key] = memory_plan(shape, layout(dp, pp, tp), fw).peak.total
        return cache[key]

    def tokens_per_s(dp, pp, tp):
        key = ("t", dp, pp, tp)
        if key not in cache:
            cache[key] = step_time(shape, layout(dp, pp, tp), gpu, fw).tokens_per_s_per_gpu
        return cache[key]

    return shape, gpu, sequences, memory_per_gpu, tokens_per_s


@functools.lru_cache(maxsize=None)
def planner_choice(model: str, gpu_name: str, gpus: int, tokens: int, seq_len: int = 4096):
    """(dp, pp, tp) that the exercise's rule picks among the planner's layouts with the pinned knobs: its
    fastest by predicted speed (`SearchResult.by_time`), ties within TIE to the fewest pp, then tp."""
    from ultrascale.plan.hardware import playbook_cluster
    from ultrascale.plan.search import search
    from ultrascale.plan.shape import get_shape

    found = search(get_shape(model), gpus, playbook_cluster(gpu_name), _planner(), seq_len, tokens, "bf16", PINNED)
    fastest = found.by_time[0].time.tokens_per_s_per_gpu
    ties = [c.layout for c in found.by_time if c.time.tokens_per_s_per_gpu >= fastest * (1 - TIE)]
    lay = min(ties, key=lambda lay: (lay.pp, lay.tp))
    return lay.dp, lay.pp, lay.tp


def exercise_2(best_layout):
    for what, args in _synthetic():
        gpus, heads, layers, sequences = args[:4]
        case = (f"[{what}] best_layout(gpus={gpus}, heads={heads}, layers={layers}, sequences={sequences}, "
                f"..., limit={args[6]:g})")
        _judge(case, args, best_layout)
    lines = []
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    for model, gpu_name, gpus, tokens in PLANNER_CASES:
        shape, gpu, sequences, mem, tps = planner_functions(model, gpu_name, gpus, tokens)
        args = (gpus, shape.heads, shape.layers, sequences, mem, tps, gpu.memory_bytes)
        case = f"{model} on {gpus} x {gpu_name}, {sequences} sequences"
        got = _judge(case, args, best_layout, gib)
        want = planner_choice(model, gpu_name, gpus, tokens)
        assert got == want, f"{case}: you chose {got}, the planner's fastest (ties within 1% to the simplest) {want}"
        lines.append(f"  {case}: (dp, pp, tp) = {got}, {gib(mem(*got))} per GPU, {tps(*got):,.0f} tokens/s/GPU")
    print("Same choice as the planner's fastest in every case:\n" + "\n".join(lines))
