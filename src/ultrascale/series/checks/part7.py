"""Checks of Part 7 (ZeRO-2 and ZeRO-3).

exercise_1: the learner's just-in-time parameter gathering for a ZeRO-3 Linear layer
(gather_linear in forward, zero3_backward gathering again and reduce-scattering the
gradient) runs inside an autograd.Function on 2 real gloo ranks, three layers deep, and
must give one process's outputs, input gradient and (sharded) parameter gradients. What
each layer's forward and backward call is watched (series/watch.py): one all-gather of
the shard in forward, one again in backward (keeping the gathered parameters from
forward to backward shows), one reduce-scatter of the padded flat gradient, and nothing
else - an all-reduce in place of either gives the right numbers at twice the bytes, an
all-reduce of the input's gradient mixes the ranks' micro-batches. The collectives of
torch.distributed count as much as the ones passed in. Per layer the (weight, bias)
gather_linear returns and the gradient of x zero3_backward returns are compared with
the layer's own, so the rank order of the shards, the row-by-row weight and an
averaged input gradient are named where they go wrong.

exercise_2: the learner's bytes-per-rank-per-step formula for DP / ZeRO-1 / ZeRO-2 /
ZeRO-3 against the bytes the engine's collectives moved in one training step on 2 real
ranks (counted by wrapping the collectives), with 1 and 2 micro-batches.
"""

from __future__ import annotations

import functools

from ultrascale.series.checks import RankError, on_ranks, require_finite

WORLD = 2
SIZES = (6, 8, 8, 3)  # three Linear layers: 56, 72 and 27 parameters (odd ones need padding)


# -- exercise 1 -----------------------------------------------------------------------------------
def _layers():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return [nn.Linear(i, o) for i, o in zip(SIZES[:-1], SIZES[1:])]


def _batch():
    import torch

    g = torch.Generator().manual_seed(3)
    return torch.randn(8, SIZES[0], generator=g), torch.randn(8, SIZES[-1], generator=g)


def _flat_padded(tensors, world):
    import torch

    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    size = -(-flat.numel() // world)
    out = torch.zeros(size * world)
    out[:flat.numel()] = flat
    return out, size


def _forward(layers, x, linear):
    import torch

    h = x
    for i, layer in enumerate(layers):
        h = linear(h, i)
        if i < len(layers) - 1:
            h = torch.tanh(h)
    return h


def _single():
    import torch

    layers = _layers()
    x, y = _batch()
    x = x.clone().requires_grad_(True)
    out = _forward(layers, x, lambda h, i: layers[i](h))
    torch.nn.functional.mse_loss(out, y).backward()
    grads = [_flat_padded([layer.weight.grad, layer.bias.grad], WORLD)[0] for layer in layers]
    return out.detach(), x.grad.detach(), grads


def _zero3_on_rank(gather_linear, zero3_backward):
    """On each rank: three ZeRO-3 layers of the learner's over this rank's half of the batch, and per layer
    what its forward and its backward called, the (weight, bias) gather_linear returned and the gradient
    with respect to x that zero3_backward returned, beside the right one (grad_out @ W)."""
    import torch
    import torch.distributed as dist

    from ultrascale.series import watch

    rank, world = dist.get_rank(), dist.get_world_size()
    # Looked up here, where the collectives are watched (the engine's module-level aliases are bound to
    # the functions as they were at import).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_gather(output, input):
        return gather(output, input)

    def reduce_scatter(output, input):
        return scatter(output, input)

    layers = _layers()
    seen = [{"forward": [], "backward": None, "weight": None, "bias": None, "grad_x": None, "want_x": None}
            for _ in layers]

    class Zero3Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, i):
            shape = tuple(layers[i].weight.shape)
            begin = len(watch.calls())
            w, b = gather_linear(shard, shape, all_gather)
            seen[i]["forward"] = watch.calls()[begin:]
            assert tuple(w.shape) == shape and tuple(b.shape) == (shape[0],), (
                f"gather_linear returned a weight of shape {tuple(w.shape)} and a bias of shape {tuple(b.shape)}; "
                f"expected {shape} and ({shape[0]},): the gathered vector is the flat weight (row by row), "
                f"then the bias, then zero padding - drop the padding")
            seen[i]["weight"], seen[i]["bias"] = w.detach().clone(), b.detach().clone()
            ctx.save_for_backward(x, shard)  # only the input and the shard: the gathered tensors go
            ctx.i = i
            return torch.nn.functional.linear(x, w, b)

        @staticmethod
        def backward(ctx, grad_out):
            x, shard = ctx.saved_tensors
            i = ctx.i
            begin = len(watch.calls())
            grad_x, grad_shard = zero3_backward(grad_out, x, shard, tuple(layers[i].weight.shape), all_gather,
                                                reduce_scatter)
            seen[i]["backward"] = watch.calls()[begin:]
            seen[i]["grad_x"] = None if grad_x is None else grad_x.detach().clone()
            seen[i]["want_x"] = grad_out @ layers[i].weight.detach()
            return grad_x, grad_shard, None

    shards = []
    for layer in layers:
        flat, size = _flat_padded([layer.weight, layer.bias], world)
        shards.append(torch.nn.Parameter(flat[rank * size:(rank + 1) * size].clone()))
    x, y = _batch()
    xb, yb = x.chunk(world)[rank].clone().requires_grad_(True), y.chunk(world)[rank]
    out = _forward(layers, xb, lambda h, i: Zero3Linear.apply(h, shards[i], i))
    # Each rank's loss is the mean over its half; the average over ranks of the gradients is then
    # the gradient of the mean over the whole batch.
    torch.nn.functional.mse_loss(out, yb).backward()
    # Local-only gradients of the same shards, to recognise a missing reduce-scatter.
    local = []
    for layer in layers:
        layer.zero_grad()
    lo = _forward(layers, xb.detach(), lambda h, i: layers[i](h))
    torch.nn.functional.mse_loss(lo, yb).backward()
    for layer in layers:
        flat, size = _flat_padded([layer.weight.grad, layer.bias.grad], world)
        local.append(flat[rank * size:(rank + 1) * size])
    return {"out": out.detach(), "grad_x": None if xb.grad is None else xb.grad.detach(),
            "grads": [None if s.grad is None else s.grad.detach() for s in shards], "local": local, "seen": seen}


ALL_GATHERS = ("all_gather_single", "all_gather")
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter")


def _said(calls) -> str:
    from ultrascale.series.watch import kinds

    return ", ".join(kinds(calls)) or "nothing"


def _sizes():
    """Per layer: the padded length of its flat parameters and one rank's shard of it."""
    padded = []
    for i, o in zip(SIZES[:-1], SIZES[1:]):
        size = -(-(o * i + o) // WORLD)
        padded.append((size * WORLD, size))
    return padded


def _check_forward_calls(rank, i, calls, padded, size):
    """gather_linear: one all-gather of the layer's shards, nothing else."""
    from ultrascale.series.watch import kinds

    said = kinds(calls)
    if "all_reduce" in said:
        raise AssertionError(
            f"rank {rank} gathered layer {i}'s parameters with {_said(calls)}: an all-reduce of a zero-filled vector "
            f"gives the same values at twice the bytes of an all-gather, and ZeRO-3 gathers every layer twice per "
            f"step - call all_gather(full, shard.detach()), the one passed in")
    gathers = [c for c in calls if c.kind.startswith("all_gather")]
    if not gathers or len(gathers) != len(calls):
        raise AssertionError(
            f"rank {rank}'s forward of layer {i} called {_said(calls)}: gather_linear all-gathers the layer's "
            f"shards from every rank - all_gather(full, shard.detach()), one collective every rank joins")
    if len(gathers) > 1:
        raise AssertionError(
            f"rank {rank} called all_gather {len(gathers)} times in the forward of layer {i}: gather each layer's "
            f"parameters once, just before its forward")
    assert gathers[0].bytes == 4 * size, (
        f"rank {rank}'s all-gather in the forward of layer {i} sent {gathers[0].bytes} B; its shard is {size} fp32 "
        f"elements ({4 * size} B) of the layer's {padded} padded parameters: gather the shard itself")


def _check_backward_calls(rank, i, calls, padded, size):
    """zero3_backward: one all-gather (again) and one reduce-scatter of the padded flat gradient."""
    from ultrascale.series.watch import kinds

    said = kinds(calls)
    if not any(k in ALL_GATHERS for k in said):
        raise AssertionError(
            f"rank {rank}'s backward of layer {i} never called all_gather: it reused parameters gathered in forward. "
            f"Keeping them until backward holds every layer's full parameters at once, as without ZeRO-3; drop them "
            f"after forward and gather them again in zero3_backward")
    for c in calls:
        if c.kind == "all_reduce" and c.bytes == 4 * padded:
            raise AssertionError(
                f"rank {rank} all-reduced layer {i}'s whole flat gradient ({c}): every rank receives all of it, at "
                f"twice the bytes, and holds the full gradient ZeRO-3 shards - reduce-scatter it so each rank "
                f"receives only its shard (then divide by the world size)")
        if c.kind == "all_reduce":
            raise AssertionError(
                f"rank {rank}'s backward of layer {i} all-reduced {c.bytes} B besides the layer's gradient ({c}): "
                f"the gradient with respect to x stays on its rank - each rank backpropagates its own micro-batch, "
                f"and only the parameters' gradients are reduce-scattered")
    other = [k for k in said if k not in ALL_GATHERS + REDUCE_SCATTERS]
    if other:
        raise AssertionError(
            f"rank {rank}'s backward of layer {i} called {_said(calls)}: zero3_backward all-gathers the shards and "
            f"reduce-scatters the padded flat gradient, nothing else")
    gathers = sum(k in ALL_GATHERS for k in said)
    assert gathers == 1, (
        f"rank {rank} called all_gather {gathers} times in the backward of layer {i}: once per layer")
    scatters = [c for c in calls if kinds([c])[0] in REDUCE_SCATTERS]
    assert len(scatters) == 1, (
        f"rank {rank} called reduce_scatter {len(scatters)} times in the backward of layer {i}: reduce-scatter each "
        f"layer's flat gradient once, so each rank keeps only its shard")
    assert scatters[0].bytes == 4 * padded, (
        f"rank {rank} reduce-scattered {scatters[0].bytes} B in the backward of layer {i}; the layer's padded flat "
        f"gradient is {padded} fp32 elements, {4 * padded} B: pad it like the parameters")


def _check_gathered(rank, i, seen, layers):
    """What gather_linear returned against the layer's own weight and bias."""
    import torch

    w, b = seen["weight"], seen["bias"]
    layer = layers[i]
    if torch.allclose(w, layer.weight) and torch.allclose(b, layer.bias):
        return
    out_f, in_f = layer.weight.shape
    flat, size = _flat_padded([layer.weight, layer.bias], WORLD)
    backwards = torch.cat(list(flat.split(size))[::-1])
    if torch.allclose(w, backwards[:out_f * in_f].view(out_f, in_f)):
        raise AssertionError(
            f"layer {i}'s weight on rank {rank} was assembled from the shards in reverse rank order: rank r holds "
            f"slice r of the flat vector - concatenate the gathered shards in rank order (all_gather's output "
            f"already is)")
    if torch.allclose(w, flat[:out_f * in_f].view(in_f, out_f).t()):
        raise AssertionError(
            f"layer {i}'s weight on rank {rank} is read column by column: the flat vector holds the weight row by "
            f"row - view its first out*in elements as (out_features, in_features)")
    raise AssertionError(
        f"gather_linear's (weight, bias) for layer {i} on rank {rank} differ from the layer's by up to "
        f"{max((w - layer.weight).abs().max().item(), (b - layer.bias).abs().max().item()):.2e}: the gathered "
        f"vector is the flat weight (row by row), then the bias, then the padding, in rank order")


def _check_grad_x(rank, i, seen):
    """zero3_backward's gradient with respect to x: grad_out @ W, this rank's own (activations are not averaged)."""
    import torch

    got, want = seen["grad_x"], seen["want_x"]
    if got is None:
        raise AssertionError(
            f"zero3_backward returned no gradient for the input of layer {i} on rank {rank}: it must return the "
            f"gradient with respect to the input x (grad_out @ W) as well as the shard's, or backward stops there")
    require_finite(got, f"the gradient of layer {i}'s input on rank {rank}")
    if tuple(got.shape) == tuple(want.shape) and torch.allclose(got, want, rtol=1e-4, atol=1e-6):
        return
    if tuple(got.shape) == tuple(want.shape) and torch.allclose(got * WORLD, want, rtol=1e-4, atol=1e-6):
        raise AssertionError(
            f"zero3_backward divided the gradient of the input by the world size (layer {i}, rank {rank}): the "
            f"gradient with respect to x belongs to this rank's micro-batch, and flows on to the layer below as it "
            f"is; only the parameters' gradients are averaged over the ranks")
    raise AssertionError(
        f"the gradient of layer {i}'s input on rank {rank} is wrong: return grad_out @ W for x, with the full "
        f"gathered weight W")


def exercise_1(gather_linear, zero3_backward) -> None:
    import torch

    want_out, want_gx, want_grads = _single()
    n_layers = len(SIZES) - 1
    sizes = _sizes()
    try:
        got = on_ranks(WORLD, _zero3_on_rank, gather_linear, zero3_backward)
    except RankError as e:
        first = str(e).splitlines()[0][:200]
        if "size" in first.lower() or "shape" in first.lower():
            raise AssertionError(
                f"a rank failed with a size error ({first}): each shard is 1/{WORLD} of the layer's flat parameters "
                f"padded to a multiple of {WORLD}; the all-gather output has the padded length and the "
                f"reduce-scatter input must be padded the same way") from None
        raise
    layers = _layers()
    for rank, r in enumerate(got):
        for i, seen in enumerate(r["seen"]):
            _check_forward_calls(rank, i, seen["forward"], *sizes[i])
            _check_gathered(rank, i, seen, layers)
        top = r["seen"][-1]["backward"] is not None
        for i, seen in enumerate(r["seen"]):
            if seen["backward"] is None and top:
                raise AssertionError(
                    f"no gradient reached layer {i} on rank {rank}: zero3_backward must return the gradient with "
                    f"respect to the input x (grad_out @ W) as well as the shard's, or backward stops at the last "
                    f"layer")
            assert seen["backward"] is not None, f"layer {i}'s backward never ran on rank {rank}"
            _check_backward_calls(rank, i, seen["backward"], *sizes[i])
        for i, seen in enumerate(r["seen"]):
            _check_grad_x(rank, i, seen)
        require_finite(r["out"], f"rank {rank}'s output")
        rows = want_out.chunk(WORLD)[rank]
        diff = (r["out"] - rows).abs().max().item()
        assert diff < 1e-5, (
            f"rank {rank}'s output differs from one process's by up to {diff:.2e}: the gathered vector is the flat "
            f"weight (row by row) then the bias, in rank order")
    for rank, r in enumerate(got):
        for i in range(n_layers):
            g = r["grads"][i]
            assert g is not None, f"layer {i}'s shard got no gradient on rank {rank}: return it from zero3_backward"
            require_finite(g, f"layer {i}'s shard gradient on rank {rank}")
            flat = want_grads[i]
            size = flat.numel() // WORLD
            want = flat[rank * size:(rank + 1) * size]
            assert g.shape == want.shape, (
                f"layer {i}'s shard gradient on rank {rank} has shape {tuple(g.shape)}, the shard has ({size},): "
                f"reduce-scatter the padded flat gradient so each rank receives its slice")
            if i == n_layers - 1 or torch.count_nonzero(g) > 0:
                if torch.allclose(g, WORLD * want, rtol=1e-4, atol=1e-7) and not torch.allclose(g, want, atol=1e-7):
                    raise AssertionError(
                        f"layer {i}'s shard gradient on rank {rank} is {WORLD}.000x the single-process one: "
                        f"reduce-scatter sums over the ranks - divide by the world size")
                if torch.allclose(g, r["local"][i], atol=1e-7) and not torch.allclose(g, want, atol=1e-6):
                    raise AssertionError(
                        f"layer {i}'s shard gradient on rank {rank} is this rank's own micro-batch's only: "
                        f"reduce-scatter the full flat gradient so each rank receives the sum over the ranks of its "
                        f"slice (then divide by the world size)")
            if torch.count_nonzero(g) == 0 and torch.count_nonzero(want) > 0:
                raise AssertionError(
                    f"layer {i}'s shard gradient is zero on rank {rank}: no gradient reached the layers below the "
                    f"last one - zero3_backward must return the gradient with respect to the input x as well")
            diff = (g - want).abs().max().item()
            assert diff < 1e-5, (
                f"layer {i}'s shard gradient on rank {rank} differs from one process's by up to {diff:.2e}: flatten "
                f"the weight gradient then the bias gradient, pad, reduce-scatter, divide by the world size")
        gx = r["grad_x"]
        # The rank's loss is the mean over its half of the batch: its input gradient is WORLD x the rows of
        # the whole-batch one (activation gradients are local; only parameter gradients are averaged).
        want_x = WORLD * want_gx.chunk(WORLD)[rank]
        require_finite(gx, f"the gradient of the input on rank {rank}")
        assert gx is not None and (gx - want_x).abs().max().item() < 1e-5, (
            f"the gradient of the input on rank {rank} is wrong: return grad_out @ W for x, with the full "
            f"gathered weight W")


# -- exercise 2 -----------------------------------------------------------------------------------
KIND_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n}


def _count_step(cfg):
    """On each rank: one warm-up step, then every collective of the next step, as (kind, payload bytes)."""
    import torch.distributed as dist

    import ultrascale.parallel.zero as zero
    import ultrascale.parallel.zero3 as zero3
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import Trainer

    trainer = Trainer(cfg, worker_context(cfg.parallel))
    trainer.train_step()
    calls = []

    def counted(kind, fn, which):
        def wrapper(*args, **kwargs):
            t = args[which]  # the full buffer: all-reduce's tensor, reduce-scatter's input, all-gather's output
            calls.append((kind, t.numel() * t.element_size()))
            return fn(*args, **kwargs)
        return wrapper

    targets = [(dist, "all_reduce", "all_reduce", 0), (zero, "_reduce_scatter", "reduce_scatter", 1),
               (zero, "_all_gather", "all_gather", 0), (zero3, "_all_gather", "all_gather", 0)]
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            targets.append((dist, name, "reduce_scatter", 1))
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            targets.append((dist, name, "all_gather", 0))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _, _ in targets]
    for mod, name, kind, which in targets:
        setattr(mod, name, counted(kind, getattr(mod, name), which))
    try:
        trainer.train_step()
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    return calls


def count_config(zero: int, micro_batches: int, world: int = WORLD):
    import dataclasses

    from ultrascale.config import validate
    from ultrascale.series.checks.part6 import engine_run_config

    cfg = engine_run_config(zero, dp=world)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2, grad_accum=micro_batches))
    return validate(cfg, world)


def root_params(model_cfg) -> int:
    """Parameters outside the transformer blocks (embedding, final norm, head): ZeRO-3's root unit."""
    import torch

    from ultrascale.model import build_model

    model = build_model(model_cfg, 0, torch.device("meta"))
    in_blocks = sum(p.numel() for p in model.layers.parameters())
    return sum(p.numel() for p in model.parameters()) - in_blocks


# (N, micro-batches) measured: N = 2 with 1 and 2 micro-batches, then N = 4, where 2(N-1)/N = 3/2 and
# (N-1)/N = 3/4: on 2 ranks alone a count with the ring's factors written as 1 and 1/2 would pass.
RUNS = ((WORLD, 1), (WORLD, 2), (4, 1))


@functools.lru_cache(maxsize=None)
def _measured():
    """The bytes each rank sent per step, by (stage, N, micro-batches), with psi and the kept root unit's
    parameters: twelve engine steps on 2 and 4 ranks, the same on every call of the check."""
    from ultrascale.model import count_params

    measured = {}
    for world, m in RUNS:
        for stage in range(4):
            cfg = count_config(stage, m, world)
            calls = on_ranks(world, _count_step, cfg)[0]
            measured[stage, world, m] = sum(KIND_FACTOR[k](world) * b for k, b in calls)
    return measured, count_params(cfg.model), root_params(cfg.model)


def exercise_2(fn) -> None:
    measured, psi, kept = _measured()
    names = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    for world, m in RUNS:
        for stage in range(4):
            want = measured[stage, world, m]
            got = fn(stage, psi, world, micro_batches=m, param_bytes=2, grad_bytes=4, psi_kept=kept)
            got = float(got)
            require_finite(got, f"your count for {names[stage]} on {world} ranks with {m} micro-batch"
                                f"{'es' if m > 1 else ''}")
            if abs(got - want) <= 2e-3 * want:
                continue
            r = got / want
            if world != WORLD and all(abs(float(fn(st, psi, WORLD, micro_batches=1, param_bytes=2, grad_bytes=4,
                                                     psi_kept=kept)) - measured[st, WORLD, 1])
                                      <= 2e-3 * measured[st, WORLD, 1] for st in range(4)):
                raise AssertionError(
                    f"{names[stage]} on {world} ranks: you count {got:,.0f} bytes, the engine's collectives sent "
                    f"{want:,.0f} per rank ({r:.3f}x), where on {WORLD} ranks your counts were right: the ring's "
                    f"factors depend on N, 2(N-1)/N for an all-reduce (1 on 2 ranks, 3/2 on 4) and (N-1)/N for a "
                    f"reduce-scatter or an all-gather (1/2 on 2 ranks, 3/4 on 4); write them with N")
            where = (f"{names[stage]} with {m} micro-batch{'es' if m > 1 else ''} (psi={psi:,}, N={world}, bf16 "
                     f"parameters, fp32 gradients)")
            if m == 1 and abs(r - world / (world - 1)) < 0.01:
                raise AssertionError(
                    f"{where}: you count {got:,.0f} bytes, the engine's collectives sent {want:,.0f} per rank "
                    f"({r:.3f}x): in a ring each rank sends (N-1)/N of the buffer per phase - once for "
                    f"reduce-scatter or all-gather, twice for all-reduce")
            if stage == 0 and abs(r - 0.5) < 0.01:
                raise AssertionError(
                    f"{where}: you count half of what was sent: an all-reduce is a reduce-scatter then an all-gather, "
                    f"each rank sending (N-1)/N of the buffer in each phase - 2(N-1)/N in all")
            if stage == 0 and m > 1 and abs(r - m) < 0.01:
                raise AssertionError(
                    f"{where}: you count {r:.3f}x what was sent: plain DP accumulates micro-batches locally (no_sync) "
                    f"and all-reduces once per step")
            if stage == 2 and m > 1 and got < want:
                raise AssertionError(
                    f"{where}: you count {got:,.0f} bytes, {want:,.0f} were sent: ZeRO-2 reduce-scatters the "
                    f"gradients after every micro-batch (keeping only a shard, it cannot accumulate the full "
                    f"gradient), then all-gathers the parameters once")
            if stage == 3 and m > 1 and abs(got * m - want) <= 2e-3 * want:
                raise AssertionError(
                    f"{where}: you count 1/{m} of what was sent: ZeRO-3 gathers and reduce-scatters for every "
                    f"micro-batch - multiply by the number of micro-batches")
            if stage == 3 and got < want:
                raise AssertionError(
                    f"{where}: you count {got:,.0f} bytes, {want:,.0f} were sent: ZeRO-3 all-gathers the parameters "
                    f"in forward and again in backward (all but the {kept:,} parameters of the unit kept from "
                    f"forward to backward), then reduce-scatters the gradients - every micro-batch")
            if stage == 3 and got > want:
                raise AssertionError(
                    f"{where}: you count {got:,.0f} bytes, {want:,.0f} were sent: the root unit ({kept:,} "
                    f"parameters: embedding, final norm, head) stays gathered from forward to backward, so it is "
                    f"gathered once per micro-batch, not twice - that is what psi_kept is for")
            if stage in (1, 2) and m == 1:
                raise AssertionError(
                    f"{where}: you count {got:,.0f} bytes, {want:,.0f} were sent ({r:.3f}x): ZeRO-1 and ZeRO-2 "
                    f"reduce-scatter the gradients (grad_bytes each) and all-gather the updated parameters "
                    f"(param_bytes each)")
            raise AssertionError(f"{where}: you count {got:,.0f} bytes per rank, the engine's collectives sent "
                                 f"{want:,.0f} ({r:.3f}x)")
