"""Part 9, sequence parallelism: the all-gather / reduce-scatter pair (g and g-bar) as
autograd functions on 2 real ranks, and the activation memory per rank of our block
under TP and TP+SP.

Exercise 1's expected values come from one process running the whole block in float64
(autograd for the gradients), and the collectives each rank called are read back
(series/watch.py): one all-gather of the [b, s/t, h] shard and one reduce-scatter of the
[b, s, h] partial outputs in forward, the same pair in backward, never an all-reduce
(right values, twice the bytes) nor an all-gather of whole partial outputs. Exercise 2's
come from the engine's own block, built by its TP (+SP) transform on 2 real ranks and
measured with its ActivationMeter (the bytes autograd keeps for backward, parameters
excluded), and from one process for t = 1; both are measured once per shape.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ultrascale.series.checks import RankError, on_ranks, require_finite

WORLD = 2
B, S, H, FFN = 2, 4, 8, 16  # x [B, S, H]; each rank holds S / WORLD positions
SHARD_BYTES = B * (S // WORLD) * H * 4  # what an all-gather puts in: this rank's fp32 [b, s/t, h]
WHOLE_BYTES = B * S * H * 4  # what a reduce-scatter puts in: the fp32 [b, s, h] partial sums
_GATHERS = ("all_gather", "all_gather_single", "all_gather_into_tensor")
_SCATTERS = ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor")


# -- exercise 1: the sequence-parallel block ----------------------------------------------------
def _block_tensors(seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g)
    w1 = torch.randn(FFN, H, generator=g) / H**0.5
    w2 = torch.randn(H, FFN, generator=g) / FFN**0.5
    cot = torch.randn(B, S, H, generator=g)
    return x, w1, w2, cot


def _block_case(sp_block, seed):
    """On each rank: the learner's block on its positions and shards; its output, its gradients, and the
    collectives it called in forward and in backward."""
    import torch.distributed as dist

    from ultrascale.series import watch

    rank, world = dist.get_rank(), dist.get_world_size()
    x, w1, w2, cot = _block_tensors(seed)
    n, m = FFN // world, S // world
    mine, rows = slice(rank * n, (rank + 1) * n), slice(rank * m, (rank + 1) * m)
    x_shard = x[:, rows].clone().requires_grad_()
    w1_shard = w1[mine].clone().requires_grad_()
    w2_shard = w2[:, mine].clone().requires_grad_()
    with _Layouts(world) as layouts:
        out = sp_block(x_shard, w1_shard, w2_shard)
    assert out is not None, "sp_block returned None: return the block's output for this rank's positions"
    forward = watch.calls()
    if out.requires_grad and tuple(out.shape) == tuple(cot[:, rows].shape):
        (out * cot[:, rows]).sum().backward()
    backward = watch.calls()[len(forward):]
    grads = [None if t.grad is None else t.grad.detach().clone() for t in (x_shard, w1_shard, w2_shard)]
    return out.detach().clone(), grads, forward, backward, _layout_mistake(layouts.seen, x, world)


def _Layouts(world: int):
    """A torch function mode keeping every tensor the block made or read in the shapes of the whole
    sequence, [b, s, h], or of the shards stacked along the batch, [t*b, s/t, h]: what attention would
    read in the region, which this block (each token alone) cannot show by its values."""
    import torch
    from torch.overrides import TorchFunctionMode

    shapes = {(B, S, H), (world * B, S // world, H)}

    class Layouts(TorchFunctionMode):
        seen: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out, *args):
                if torch.is_tensor(t) and tuple(t.shape) in shapes and t.dtype.is_floating_point:
                    Layouts.seen.append(t.detach().clone())
            return out

    Layouts.seen = []
    return Layouts()


def _layout_mistake(seen, x, world):
    """What the gathered sequence says, when it is not the sequence in order: 'interleaved' (the positions
    out of order in [b, s, h]) or 'batch' (the shards stacked along the batch); None when the sequence
    appeared in order (of x or of its norm), or never in either wrong form."""
    import torch
    import torch.nn.functional as F

    full = [x, F.rms_norm(x, (H,))]
    stacked = [torch.cat(r.chunk(world, dim=1), dim=0) for r in full]

    def close(a, b):
        return tuple(a.shape) == tuple(b.shape) and torch.allclose(a, b, atol=1e-5)

    def same_tokens(a, b):  # the same token vectors, in another order
        d = torch.cdist(a.reshape(-1, H).double(), b.reshape(-1, H).double())
        return bool((d.min(dim=1).values < 1e-4).all())

    if any(close(t, r) for t in seen for r in full):
        return None
    if any(tuple(t.shape) == (B, S, H) and same_tokens(t, r) for t in seen for r in full):
        return "interleaved"
    if any(close(t, r) for t in seen for r in stacked):
        return "batch"
    return None


_LAYOUT_MESSAGES = {
    "interleaved": "your gathered sequence has its positions out of order: all_gather_into_tensor stacks the "
                   "ranks' [b, s/t, h] shards along dim 0, so .view(b, s, h) interleaves the batch and the "
                   "positions; view it as [t, b, s/t, h] and move the rank axis next to the sequence, "
                   ".view(t, b, s // t, h).transpose(0, 1).reshape(b, s, h) (and the inverse before the "
                   "reduce-scatter)",
    "batch": "you gathered the shards along the batch dimension ([t*b, s/t, h]): g all-gathers along dim 1, "
             "the sequence, so that every position of each sequence is on every rank",
}


def _block_reference(x, w1, w2, cot, cols=None, cot_rows=None):
    """Output and (x, w1, w2) grads of x + gelu(rmsnorm(x) w1^T) w2^T in float64. `cols`: only those
    hidden features and no residual (one rank's partial output); `cot_rows`: the gradient kept on those
    positions only."""
    import torch
    import torch.nn.functional as F

    x, w1, w2 = (t.double().clone().requires_grad_() for t in (x, w1, w2))
    a, b = (w1, w2) if cols is None else (w1[cols], w2[:, cols])
    y = F.gelu(F.rms_norm(x, (H,)) @ a.t()) @ b.t()
    out = y if cols is not None else x + y
    c = cot.double()
    if cot_rows is not None:
        c = torch.zeros_like(c)
        c[:, cot_rows] = cot.double()[:, cot_rows]
    (out * c).sum().backward()
    return out.detach(), x.grad, w1.grad, w2.grad


def _sp_sizes_failed(e: RankError) -> AssertionError | None:
    first = str(e).splitlines()[0]
    if "shape" not in first.lower() and "size" not in first.lower():
        return None
    return AssertionError(f"a rank failed with a size error ({first[:160]}): g all-gathers along dim 1, the "
                          f"sequence ([b, s/t, h] -> [b, s, h], torch.cat(parts, dim=1)), and g-bar reduce-"
                          f"scatters along dim 1 too ([b, s, h] -> [b, s/t, h]); the batch and the hidden "
                          f"dims stay as they are")


def _sp_forbidden(rank, forward, backward):
    """An all-reduce, or an all-gather of whole partial sums: the right values without SP's memory."""
    for phase, calls in (("forward", forward), ("backward", backward)):
        for c in calls:
            if c.kind == "all_reduce":
                raise AssertionError(
                    f"rank {rank} called {c} in {phase}: sequence parallelism replaces each all-reduce by an "
                    f"all-gather and a reduce-scatter (same bytes in all); all_reduce and a slice move twice "
                    f"the data and hold the whole [b, s, h] sum on every rank")
            if c.kind in _GATHERS and c.bytes == WHOLE_BYTES:
                who = "g-bar's forward" if phase == "forward" else "g's backward"
                raise AssertionError(
                    f"rank {rank}: {who} all-gathered the whole [b, s, h] partial sums ({c}) and added them up: "
                    f"every rank then holds {WORLD} copies of the whole sequence. {who} is a reduce-scatter "
                    f"(dist.reduce_scatter): each rank receives only the sum of its own positions")
            if c.kind not in _GATHERS + _SCATTERS:
                raise AssertionError(
                    f"rank {rank} called {c} in {phase}: g and g-bar communicate by one all-gather and one "
                    f"reduce-scatter each way, nothing else")


def _sp_output(rank, got, x, w1, w2, cot, out):
    import torch

    n, m = FFN // WORLD, S // WORLD
    mine, rows = slice(rank * n, (rank + 1) * n), slice(rank * m, (rank + 1) * m)
    other = WORLD - 1 - rank
    want = out[:, rows]
    xd = x.double()

    def near(a, b):
        return a is not None and tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b, atol=1e-5)

    if tuple(got.shape) == tuple(out.shape):
        raise AssertionError(f"rank {rank} returned the whole sequence {tuple(got.shape)}: leaving the region, "
                             f"g-bar reduce-scatters, so each rank keeps its {m} positions {tuple(want.shape)}")
    assert tuple(got.shape) == tuple(want.shape), (
        f"rank {rank} returned shape {tuple(got.shape)}; it holds positions {rows.start}..{rows.stop - 1} of "
        f"the sequence: {tuple(want.shape)} (all-gather and reduce-scatter along dim 1, the sequence)")
    require_finite(got, f"rank {rank}'s output")
    if near(got, want):
        return
    partial = _block_reference(x, w1, w2, cot, cols=mine)[0]
    if near(got, xd[:, rows] + partial[:, rows]):
        raise AssertionError(f"rank {rank}'s output only has its own partial sum: the row-parallel outputs "
                             f"are partial sums over the hidden features; g-bar's forward reduce-scatters "
                             f"(sums, then keeps this rank's positions), not just slices")
    if near(got, xd[:, rows] + (out - xd)[:, rows] / WORLD):
        raise AssertionError(f"rank {rank}'s MLP output is 1/{WORLD} of the single-process one: the "
                             f"reduce-scatter sums the partial outputs over the ranks, with no division")
    theirs = slice(other * m, (other + 1) * m)
    if near(got, xd[:, rows] + (out - xd)[:, theirs]):
        raise AssertionError(f"rank {rank}'s output holds the MLP of rank {other}'s positions: g's all-gather "
                             f"must put the ranks' positions in rank order (rank 0's first), the order in "
                             f"which the reduce-scatter hands the chunks back")
    err = (got.double() - want).abs().max().item()
    raise AssertionError(f"rank {rank}'s output differs from the single-process block's rows by "
                         f"{err:.2e}: norm on the shard, all-gather, the two linears, reduce-scatter, "
                         f"then the residual")


def _sp_gradients(rank, grads, x, w1, w2, cot, want):
    import torch

    got_x, got_w1, got_w2 = grads
    _, gx, gw1, gw2 = want
    n, m = FFN // WORLD, S // WORLD
    mine, rows = slice(rank * n, (rank + 1) * n), slice(rank * m, (rank + 1) * m)
    c = cot.double()

    def near(a, b):
        return a is not None and tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b, atol=1e-5)

    if got_x is None or got_w1 is None or got_w2 is None:
        raise AssertionError(f"rank {rank}: no gradient reached x_shard or the weights; build the output "
                             f"with your autograd functions' .apply")
    require_finite([got_x, got_w1, got_w2], f"rank {rank}'s gradients")
    if not (near(got_w1, gw1[mine]) and near(got_w2, gw2[:, mine])):
        masked = _block_reference(x, w1, w2, cot, cols=mine, cot_rows=rows)
        if near(got_w2, masked[3][:, mine]):
            raise AssertionError(f"rank {rank}'s weight gradients only see its own positions' gradient: "
                                 f"g-bar's backward must all-gather the output gradient (the row-parallel "
                                 f"output covered the whole sequence), not pad it with zeros")
        raise AssertionError(f"rank {rank}'s weight gradients differ from the single-process ones' shards: "
                             f"g-bar's backward all-gathers the gradient along the sequence")
    if near(got_x, gx[:, rows]):
        return
    own = _block_reference(x, w1, w2, cot, cols=mine)[1] + c
    if near(got_x, own[:, rows]):
        raise AssertionError(f"rank {rank}'s x gradient only holds the part through its own "
                             f"{n} hidden features: g's backward must reduce-scatter (sum over ranks, "
                             f"keep this rank's positions), not just slice the gradient")
    if near(got_x, gx[:, rows] * WORLD) or near(got_x - c[:, rows], WORLD * (gx - c)[:, rows]):
        raise AssertionError(f"rank {rank}'s x gradient is {WORLD}x too large through the MLP: the "
                             f"reduce-scatter sums, once")
    if near(got_x - c[:, rows], (gx - c)[:, rows] / WORLD):
        raise AssertionError(f"rank {rank}'s x gradient through the MLP is 1/{WORLD} of the single-process "
                             f"one: the reduce-scatter sums the partial gradients in g's backward, with no "
                             f"division")
    err = (got_x.double() - gx[:, rows]).abs().max().item()
    raise AssertionError(f"rank {rank}'s x gradient differs from the single-process one by {err:.2e}: "
                         f"g's backward reduce-scatters the gradient along the sequence")


def _sp_collectives(rank, forward, backward):
    """Right values: now how. Forward: g's all-gather, g-bar's reduce-scatter; backward: g-bar's
    all-gather, then g's reduce-scatter; each over both ranks, summing."""
    everyone = tuple(range(WORLD))
    expected = (("all-gather", _GATHERS, SHARD_BYTES, "the [b, s/t, h] shard"),
                ("reduce-scatter", _SCATTERS, WHOLE_BYTES, "the [b, s, h] partial sums"))
    for phase, calls, names in (("forward", forward, ("g's", "g-bar's")),
                                ("backward", backward, ("g-bar's", "g's"))):
        said = "; ".join(map(str, calls)) or "nothing"
        if len(calls) != 2 or any(c.kind not in kinds for c, (_, kinds, _, _) in zip(calls, expected)):
            raise AssertionError(f"rank {rank} called {said} in {phase}: sequence parallelism is one all-gather "
                                 f"({names[0]}) then one reduce-scatter ({names[1]}) along the sequence")
        for c, (what, _, size, of), who in zip(calls, expected, names):
            if c.group != everyone:
                raise AssertionError(f"rank {rank}'s {phase} {what} ran over ranks {list(c.group)}: {who} spans "
                                     f"the whole tensor-parallel group {list(everyone)}")
            if c.op not in (None, "SUM"):
                raise AssertionError(f"rank {rank}'s {phase} {what} is {c}: the reduce-scatter sums")
            if c.bytes != size:
                raise AssertionError(f"rank {rank}'s {phase} {what} put in {c.bytes} B: {who} {what} starts from "
                                     f"{of}, {size} B in fp32")


def exercise_1(sp_block):
    """sp_block(x_shard, w1_shard, w2_shard) on 2 ranks: the SP residual MLP block with g and g-bar."""
    seed = 91
    try:
        results = on_ranks(WORLD, _block_case, sp_block, seed, timeout=60)
    except RankError as e:
        said = _sp_sizes_failed(e)
        if said is None:
            raise
        raise said from None
    x, w1, w2, cot = _block_tensors(seed)
    want = _block_reference(x, w1, w2, cot)
    for rank, (got, _, forward, backward, _) in enumerate(results):
        _sp_output(rank, got, x, w1, w2, cot, want[0])
        _sp_forbidden(rank, forward, backward)
    for rank, (_, grads, _, _, _) in enumerate(results):
        _sp_gradients(rank, grads, x, w1, w2, cot, want)
    for rank, (_, _, forward, backward, _) in enumerate(results):
        _sp_collectives(rank, forward, backward)
    for rank, (*_, layout) in enumerate(results):
        # This block acts on each token alone, so the right values hide a wrong layout that is undone on the
        # way out; attention, in the same region of a transformer, would read the wrong sequence.
        if layout is not None:
            raise AssertionError(f"rank {rank}: the output is right, but {_LAYOUT_MESSAGES[layout]}. (This block "
                                 f"acts on each token alone, so its values hide the layout; attention, in the same "
                                 f"region of a transformer, would read a wrong sequence.)")


# -- exercise 2: activation memory per rank, TP vs TP+SP -----------------------------------------
@functools.lru_cache(maxsize=None)
def block_activation_bytes_on_ranks(model_cfg, b: int, s: int, sp: bool, t: int = WORLD) -> int:
    """Bytes block 0 of the engine's model keeps for backward on rank 0 of a t-rank TP (+SP) group (2 unless
    told), fp32, measured with the engine's ActivationMeter (once per shape: the same every time)."""
    return on_ranks(t, _measure_block, model_cfg, b, s, sp, timeout=60)[0]


def _measure_block(model_cfg, b, s, sp):
    import torch
    import torch.distributed as dist

    from ultrascale.config import ParallelConfig, RunConfig
    from ultrascale.distributed.context import build_context
    from ultrascale.model import build_model
    from ultrascale.parallel import shard_model
    from ultrascale.train.metrics import ActivationMeter

    t = dist.get_world_size()
    mc = replace(model_cfg, layers=1, max_seq_len=max(s, model_cfg.max_seq_len))
    cfg = RunConfig(model=mc, parallel=ParallelConfig(dp=1, tp=t, sp=sp))
    ctx = build_context(cfg.parallel, dist.get_rank(), t)
    model = build_model(mc, 0, ctx.device, transform=shard_model(ctx, cfg))
    meter = ActivationMeter(list(model.parameters()) + list(model.buffers()))
    x = torch.randn(b, s // t if sp else s, mc.hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    with meter.forward():
        model.layers["0"](x.requires_grad_(), model.rope_cos[:s], model.rope_sin[:s])
    return meter.take_peak()


@functools.lru_cache(maxsize=None)
def _measured(cfg, b, s, t, sp) -> int:
    """What a rank keeps: one process's block for t = 1, the engine's on 2 ranks otherwise."""
    from ultrascale.series.checks.part2 import block_saved_bytes

    return block_saved_bytes(cfg, b, s, 4) if t == 1 else block_activation_bytes_on_ranks(cfg, b, s, sp, t)


def _formula(cfg, b, s, t, sp, norm_div=None, norm_out_div=1, inner_div=None, kv=None, lse=True):
    """Our block in fp32 per rank; the keywords make the known wrong versions."""
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a) if kv is None else kv
    norm_div = (t if sp else 1) if norm_div is None else norm_div
    inner_div = t if inner_div is None else inner_div
    norms = 2 * (8 * h + 4) / norm_div
    norm_outputs = 2 * 4 * h / norm_out_div
    inner = (4 * (2 * h + 2 * kv) + 4 * a * lse + 16 * f) / inner_div
    return b * s * (norms + norm_outputs + inner)


def _cases():
    from ultrascale.model import ModelConfig, get_preset

    tiny = get_preset("tiny")
    gqa = ModelConfig(name="gqa-128", vocab_size=257, hidden=128, layers=1, heads=8, kv_heads=2, ffn_hidden=352,
                      max_seq_len=256)
    return [(tiny, 2, 32), (tiny, 1, 64), (gqa, 2, 24)]


def _cases_of_4():
    """A GQA block whose 4 key/value heads split over 4 ranks: with t = 4, a 2 written where t belongs shows."""
    from ultrascale.model import ModelConfig

    gqa = ModelConfig(name="gqa-128-kv4", vocab_size=257, hidden=128, layers=1, heads=8, kv_heads=4, ffn_hidden=352,
                      max_seq_len=256)
    return [(gqa, 2, 24)]


def _any_split(cfg, b, s, t, sp, got, want, where):
    """Mistakes that show whatever t is: the tensors' sizes, the bytes per value, the tokens."""
    h, a = cfg.hidden, cfg.heads
    if abs(got - _formula(cfg, b, s, t, sp, kv=h)) < 1:
        raise AssertionError(f"{where}. k and v have kv_heads x head_dim = {cfg.kv_heads * (h // a)} features "
                             f"each (GQA: {cfg.kv_heads} key/value heads of {h // a}), not h = {h}")
    if abs(got - _formula(cfg, b, s, t, sp, lse=False)) < 1:
        raise AssertionError(f"{where}. You forgot the fp32 logsumexp flash attention keeps for backward: one "
                             f"per head and token, 4a bytes per token (a/t heads on a rank)")
    if abs(got * b * s - want) < 1:
        raise AssertionError(f"{where}: that is the bytes of one token; multiply by b * s, the tokens "
                             f"the block ran on")
    if abs(got * 2 - want) < 1 or abs(got - 2 * want) < 1:
        raise AssertionError(f"{where}: off by a factor of 2; these are fp32 bytes (4 per value, the "
                             f"logsumexp 4 per head) for b*s tokens")


def _split_mistake(cfg, b, s, t, sp, got, where):
    """What t divides, with and without SP."""
    if t == 1:
        raise AssertionError(f"{where}. With t = 1 nothing is split: this is Part 2's block, "
                             f"b*s*(2(8h + 4) + 4(4h + 2kv + 4f) + 4a) in fp32")
    if sp and abs(got - _formula(cfg, b, s, t, sp, norm_out_div=t)) < 1:
        raise AssertionError(f"{where}. The norm outputs are the inputs of the column-parallel linears: "
                             f"under SP they are all-gathered, and our engine keeps the gathered "
                             f"[b, s, h] copy for backward (Megatron re-gathers and keeps the shard), "
                             f"so they stay whole: 2 * 4h per token, not divided by t")
    if sp and abs(got - _formula(cfg, b, s, t, False)) < 1:
        raise AssertionError(f"{where}. Under SP the norms run on the rank's s/t positions: their "
                             f"fp32 input, rstd and x*rstd (8h + 4 per token each) are divided by t")
    if not sp and abs(got - _formula(cfg, b, s, t, False, norm_div=t, norm_out_div=t)) < 1:
        raise AssertionError(f"{where}. Tensor parallelism alone leaves the norms and their outputs "
                             f"whole on every rank (each needs the whole hidden vector of every token): "
                             f"only the attention and MLP internals divide by t")
    if not sp and abs(got - _formula(cfg, b, s, t, False, norm_out_div=t)) < 1:
        raise AssertionError(f"{where}. The norm outputs are the inputs of the column-parallel linears, and "
                             f"every rank needs the whole [b, s, h] of them (each multiplies it by its own "
                             f"columns): 2 * 4h per token, not divided by t")
    if not sp and abs(got - _formula(cfg, b, s, t, False, inner_div=1)) < 1:
        raise AssertionError(f"{where}. Inside the region each rank holds a/t heads and f/t features: "
                             f"q, k, v, the logsumexp, the attention output and the MLP's four "
                             f"tensors divide by t")


def exercise_2(activation_bytes_per_rank):
    """activation_bytes_per_rank(cfg, b, s, t, sp) -> bytes one block keeps per rank, fp32, flash SDPA."""
    runs = [(case, t, sp) for case in _cases() for t, sp in ((1, False), (WORLD, False), (WORLD, True))]
    runs += [(case, 4, sp) for case in _cases_of_4() for sp in (False, True)]
    for (cfg, b, s), t, sp in runs:
        got = activation_bytes_per_rank(cfg, b, s, t, sp)
        assert got is not None, "return the number of bytes"
        require_finite(got, f"your byte count for {cfg.name}, b={b}, s={s}, t={t}{' with SP' if sp else ''}")
        want = _measured(cfg, b, s, t, sp)
        if abs(got - want) <= 1e-9 * want:
            continue
        where = (f"{cfg.name} (h={cfg.hidden}, heads={cfg.heads}, kv_heads={cfg.kv_heads}, f={cfg.ffn_hidden}), "
                 f"b={b}, s={s}, t={t}{' with SP' if sp else ''}: you say {got:,.0f} bytes, a rank keeps {want:,}")
        if t != WORLD and abs(got - _formula(cfg, b, s, WORLD, sp)) < 1:
            raise AssertionError(f"{where}: that is what a rank keeps with t = {WORLD}; with t = {t} what the "
                                 f"split divides is divided by {t}: write t where you wrote {WORLD}")
        _any_split(cfg, b, s, t, sp, got, want, where)
        _split_mistake(cfg, b, s, t, sp, got, where)
        raise AssertionError(f"{where} ({got - want:+,.0f}). Per token: 2 norms (8h + 4, /t under SP), 2 norm "
                             f"outputs (4h, whole), and (4(2h + 2kv) + 4a + 16f)/t inside the region")
