"""Checks of Part 7 (ZeRO-2 and ZeRO-3).

exercise_1: the learner's just-in-time parameter gathering for a ZeRO-3 Linear layer
(gather_linear in forward, zero3_backward gathering again and reduce-scattering the
gradient) runs inside an autograd.Function on 2 real gloo ranks, three layers deep, and
must give one process's outputs, input gradient and (sharded) parameter gradients; the
collectives it calls are counted, so keeping the gathered parameters from forward to
backward shows.

exercise_2: the learner's bytes-per-rank-per-step formula for DP / ZeRO-1 / ZeRO-2 /
ZeRO-3 against the bytes the engine's collectives moved in one training step on 2 real
ranks (counted by wrapping the collectives), with 1 and 2 micro-batches.
"""

from __future__ import annotations

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
    import torch
    import torch.distributed as dist

    from ultrascale.parallel.zero import _all_gather, _reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    calls = {"forward": 0, "backward": 0, "reduce_scatter": 0, "gathered_numel": []}
    phase = ["forward"]

    def all_gather(output, input):
        calls[phase[0]] += 1
        calls["gathered_numel"].append(output.numel())
        return _all_gather(output, input)

    def reduce_scatter(output, input):
        calls["reduce_scatter"] += 1
        return _reduce_scatter(output, input)

    class Zero3Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, shape):
            w, b = gather_linear(shard, shape, all_gather)
            assert tuple(w.shape) == tuple(shape) and tuple(b.shape) == (shape[0],), (
                f"gather_linear returned a weight of shape {tuple(w.shape)} and a bias of shape {tuple(b.shape)}; "
                f"expected {tuple(shape)} and ({shape[0]},): the gathered vector is the flat weight (row by row), "
                f"then the bias, then zero padding - drop the padding")
            ctx.save_for_backward(x, shard)  # only the input and the shard: the gathered tensors go
            ctx.shape = shape
            return torch.nn.functional.linear(x, w, b)

        @staticmethod
        def backward(ctx, grad_out):
            x, shard = ctx.saved_tensors
            phase[0] = "backward"
            grad_x, grad_shard = zero3_backward(grad_out, x, shard, ctx.shape, all_gather, reduce_scatter)
            return grad_x, grad_shard, None

    layers = _layers()
    shards = []
    for layer in layers:
        flat, size = _flat_padded([layer.weight, layer.bias], world)
        shards.append(torch.nn.Parameter(flat[rank * size:(rank + 1) * size].clone()))
    x, y = _batch()
    xb, yb = x.chunk(world)[rank].clone().requires_grad_(True), y.chunk(world)[rank]
    out = _forward(layers, xb, lambda h, i: Zero3Linear.apply(h, shards[i], tuple(layers[i].weight.shape)))
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
            "grads": [None if s.grad is None else s.grad.detach() for s in shards], "local": local,
            "forward": calls["forward"], "backward": calls["backward"], "reduce_scatter": calls["reduce_scatter"]}


def exercise_1(gather_linear, zero3_backward) -> None:
    import torch

    want_out, want_gx, want_grads = _single()
    n_layers = len(SIZES) - 1
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
    for rank, r in enumerate(got):
        assert r["forward"] == n_layers, (
            f"rank {rank} called all_gather {r['forward']} times in the forward pass of {n_layers} layers: gather "
            f"each layer's parameters once, just before its forward")
        if r["backward"] == 0:
            raise AssertionError(
                f"rank {rank}'s backward never called all_gather: it reused parameters gathered in forward. Keeping "
                f"them until backward holds every layer's full parameters at once, as without ZeRO-3; drop them "
                f"after forward and gather them again in zero3_backward")
        for i in range(n_layers - 1):
            if r["grads"][i] is None and r["grads"][-1] is not None:
                raise AssertionError(
                    f"no gradient reached layer {i} on rank {rank}: zero3_backward must return the gradient with "
                    f"respect to the input x (grad_out @ W) as well as the shard's, or backward stops at the last layer")
        assert r["backward"] == n_layers, (
            f"rank {rank} called all_gather {r['backward']} times in backward for {n_layers} layers: once per layer")
        assert r["reduce_scatter"] == n_layers, (
            f"rank {rank} called reduce_scatter {r['reduce_scatter']} times in backward for {n_layers} layers: "
            f"reduce-scatter each layer's flat gradient once, so each rank keeps only its shard")
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


def count_config(zero: int, micro_batches: int):
    import dataclasses

    from ultrascale.config import validate
    from ultrascale.series.checks.part6 import engine_run_config

    cfg = engine_run_config(zero)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2, grad_accum=micro_batches))
    return validate(cfg, WORLD)


def root_params(model_cfg) -> int:
    """Parameters outside the transformer blocks (embedding, final norm, head): ZeRO-3's root unit."""
    import torch

    from ultrascale.model import build_model

    model = build_model(model_cfg, 0, torch.device("meta"))
    in_blocks = sum(p.numel() for p in model.layers.parameters())
    return sum(p.numel() for p in model.parameters()) - in_blocks


def exercise_2(fn) -> None:
    from ultrascale.model import count_params

    measured = {}
    for m in (1, 2):
        for stage in range(4):
            cfg = count_config(stage, m)
            calls = on_ranks(WORLD, _count_step, cfg)[0]
            measured[stage, m] = sum(KIND_FACTOR[k](WORLD) * b for k, b in calls)
    psi = count_params(cfg.model)
    kept = root_params(cfg.model)
    names = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    for m in (1, 2):
        for stage in range(4):
            want = measured[stage, m]
            got = fn(stage, psi, WORLD, micro_batches=m, param_bytes=2, grad_bytes=4, psi_kept=kept)
            got = float(got)
            require_finite(got, f"your count for {names[stage]} with {m} micro-batch{'es' if m > 1 else ''}")
            if abs(got - want) <= 2e-3 * want:
                continue
            r = got / want
            where = (f"{names[stage]} with {m} micro-batch{'es' if m > 1 else ''} (psi={psi:,}, N={WORLD}, bf16 "
                     f"parameters, fp32 gradients)")
            if m == 1 and abs(r - WORLD / (WORLD - 1)) < 0.01:
                raise AssertionError(
                    f"{where}: you count {got:,.0f} bytes, the engine's collectives sent {want:,.0f} per rank "
                    f"({r:.3f}x): in a ring each rank sends (N-1)/N of the buffer per phase - once for "
                    f"reduce-scatter or all-gather, twice for all-reduce")
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
