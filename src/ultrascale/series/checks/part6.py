"""Checks of Part 6 (ZeRO-1).

exercise_1: the learner's ZeRO-1 functions (shard_parameters, zero1_step) run on 2 real gloo ranks, each
on its half of the batch, and must end with the parameters one process gets with
torch.optim.Adam on the whole batch; its master shard must be 1/world of the padded
flat vector, and its gradient the average over the ranks. What each rank calls is watched: one
reduce-scatter of the padded gradient before opt.step(), one all-gather of the updated shards after it
(or its equal in bytes, one broadcast per owner), and no optimizer over more than the rank's shard -
every rank running Adam on the whole model, an all-reduce where ZeRO-1 reduce-scatters or all-gathers
(twice the bytes: the communication ZeRO-1 matches data parallelism's with), or one rank broadcasting
everything give the right numbers without being ZeRO-1.

exercise_2: the learner's bytes-per-rank formula against the engine's measured memory
per owner (bf16 run of ZeRO-1 on 2 real ranks, fp32 gradients) and against the
planner's figures for Llama 3 8B over N = 1..64 (bf16 and fp32 gradients).
"""

from __future__ import annotations

import functools

from ultrascale.series.checks import RankError, on_ranks, require_finite

WORLD = 2
STEPS = 3
LR = 1e-2


# -- exercise 1 -----------------------------------------------------------------------------------
def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    # 4*5 + 5 + 5*3 + 3 = 43 parameters: odd, so 2 ranks need one element of padding.
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _flat(params):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in params])


def _single():
    """One process, whole batch, torch.optim.Adam: the parameters after STEPS steps and the first gradient."""
    import torch

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = _batch()
    first = None
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if first is None:
            first = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        opt.step()
    return _flat(model.parameters()), first


def _zero1_on_rank(shard_parameters, zero1_step):
    """On each rank: the learner's functions over this rank's half of the batch, and what each step did:
    the collectives before and after `opt.step()` (the gradients' and the parameters' communication)
    and the elements any other optimizer stepped (a rank updating more than its shard)."""
    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from ultrascale.series import watch

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    params = list(model.parameters())
    master = shard_parameters(params)
    assert isinstance(master, torch.Tensor), (
        f"shard_parameters returned {type(master).__name__}, not a tensor: return this rank's slice of the "
        f"flat, padded parameters as an nn.Parameter")
    if not isinstance(master, torch.nn.Parameter):
        master = torch.nn.Parameter(master.detach())
    start = master.detach().clone()
    opt = torch.optim.Adam([master], lr=LR)
    x, y = _batch()
    xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
    steps, seen = [], []  # seen: (the check's opt?, elements it updates, calls so far) at each optimizer step

    def on_step(optimizer, args, kwargs):
        numel = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        seen.append((optimizer is opt, numel, len(watch.calls())))

    first_grad, local = None, None
    handle = register_optimizer_step_pre_hook(on_step)
    try:
        for step in range(STEPS):
            for p in params:
                p.grad = None
            master.grad = None
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            if step == 0:
                local = torch.cat([p.grad.reshape(-1) for p in params]).clone()
            begin, before = len(watch.calls()), len(seen)
            zero1_step(params, master, opt)
            calls, mine = watch.calls()[begin:], seen[before:]
            at = next((n - begin for own, _, n in mine if own), None)  # where opt.step() ran
            steps.append({"stepped": at is not None,
                          "before": calls if at is None else calls[:at], "after": [] if at is None else calls[at:],
                          "others": max([numel for own, numel, _ in mine if not own], default=0)})
            if step == 0:
                first_grad = None if master.grad is None else master.grad.detach().clone()
    finally:
        handle.remove()
    return {"params": _flat(params), "master_numel": master.numel(), "start": start, "first_grad": first_grad,
            "local": local, "steps": steps}


REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter")
ALL_GATHERS = ("all_gather_single", "all_gather")


def _said(calls) -> str:
    from ultrascale.series.watch import kinds

    return ", ".join(kinds(calls)) or "nothing"


def _check_master(got, n, padded, size):
    """shard_parameters: one slice of the padded flat parameters, this rank's."""
    import torch

    start, _ = _flat_padded(_model().parameters(), padded)
    for rank, r in enumerate(got):
        if r["master_numel"] >= n:
            raise AssertionError(
                f"rank {rank}'s master weights (what shard_parameters returned) hold {r['master_numel']} elements, "
                f"the whole model ({n}): ZeRO-1 keeps only this rank's shard of the padded flat vector, {size} "
                f"elements on {WORLD} ranks")
        assert r["master_numel"] == size, (
            f"rank {rank}'s master shard has {r['master_numel']} elements; with {n} parameters padded to {padded} "
            f"on {WORLD} ranks each shard has {size}")
        slices = [start[s * size:(s + 1) * size] for s in range(WORLD)]
        if torch.allclose(r["start"], slices[rank]):
            continue
        for owner, piece in enumerate(slices):
            if torch.allclose(r["start"], piece):
                raise AssertionError(
                    f"rank {rank}'s master weights hold rank {owner}'s slice of the flat parameters: rank r owns "
                    f"elements [r*{size}, (r+1)*{size}) - slice with dist.get_rank()")
        raise AssertionError(
            f"rank {rank}'s master weights are not its slice of the flat parameters: flatten them in parameter "
            f"order, pad with zeros at the end to {padded}, and return elements [{rank * size}, {(rank + 1) * size})")


def _check_optimizers(got, n, size):
    """Each rank runs Adam on its shard only: the check's `opt`, and no other optimizer."""
    for rank, r in enumerate(got):
        for s in r["steps"]:
            if s["others"]:
                whole = f"all {n} parameters of the model" if s["others"] >= n else f"{s['others']} elements"
                raise AssertionError(
                    f"rank {rank} ran an optimizer over {whole} besides opt: every rank updating everything is "
                    f"plain data parallelism, with Adam's states for the whole model on every rank. ZeRO-1 steps only "
                    f"opt, the Adam over this rank's {size}-element master shard, and all-gathers the others' shards")
            if not s["stepped"]:
                raise AssertionError(
                    f"rank {rank}'s zero1_step never called opt.step(): set master.grad to the averaged shard of the "
                    f"gradient, then step opt, the Adam over this rank's master shard")


def _check_gradient_calls(rank, calls, n, padded):
    """Before opt.step(): one reduce-scatter of the padded flat gradient."""
    from ultrascale.series.watch import kinds

    said = kinds(calls)
    if not calls:
        raise AssertionError(
            f"rank {rank}'s zero1_step called no collective before opt.step(): its shard gradient is its own "
            f"micro-batch's gradient only - reduce-scatter the flat gradients so each rank receives the sum of its "
            f"slice over all ranks (then divide by the world size)")
    if "all_reduce" in said and any(k in REDUCE_SCATTERS for k in said):
        raise AssertionError(
            f"rank {rank} called {_said(calls)} on the gradients before opt.step(): the all-reduce of plain data "
            f"parallelism and a reduce-scatter. ZeRO-1's reduce-scatter replaces the all-reduce (each rank needs "
            f"only its slice): drop the all-reduce")
    if "all_reduce" in said:
        raise AssertionError(
            f"rank {rank} all-reduced the gradients before opt.step() ({_said(calls)}): every rank then receives "
            f"every reduced gradient, though it updates only its slice. ZeRO-1 reduce-scatters the padded flat "
            f"gradient (half an all-reduce's bytes), so that with the all-gather after the step it moves what "
            f"data parallelism's all-reduce moves, no more")
    other = [k for k in said if k not in REDUCE_SCATTERS]
    if other:
        raise AssertionError(
            f"rank {rank} called {_said(calls)} on the gradients before opt.step(): ZeRO-1 reduce-scatters the "
            f"padded flat gradient, so each rank receives the sum over the ranks of its own slice only, "
            f"not {other[0]}")
    moved = sum(c.bytes for c in calls)
    if said[0] in REDUCE_SCATTERS and moved != 4 * padded:
        raise AssertionError(
            f"rank {rank} reduce-scattered {moved} B of gradients per step ({_said(calls)}); the padded flat "
            f"gradient is {padded} fp32 elements, {4 * padded} B: reduce-scatter it whole, once per step")


def _check_parameter_calls(rank, calls, n, padded, size):
    """After opt.step(): every rank's updated shard reaches every rank - an all-gather (or its equal in
    bytes, one broadcast per owner)."""
    from ultrascale.series.watch import kinds

    said = kinds(calls)
    if not calls:
        raise AssertionError(
            f"rank {rank} called no collective after opt.step(): the other ranks' updated shards never reached it - "
            f"all-gather the updated master shards and copy the result (without the padding) into every parameter")
    broadcasts = [c for c in calls if c.kind == "broadcast"]
    if any(c.bytes > 4 * size for c in broadcasts):
        whole = max(c.bytes for c in broadcasts) // 4
        raise AssertionError(
            f"rank {rank}'s parameters came from one rank's broadcast of all {whole} elements ({_said(calls)}): "
            f"that rank had to hold (or collect) every shard. In ZeRO-1 no rank holds more than its own: "
            f"all-gather the updated shards, one collective in which every rank sends its slice to all the others")
    if "all_reduce" in said:
        raise AssertionError(
            f"rank {rank} all-reduced after opt.step() ({_said(calls)}): summing a vector each rank filled with "
            f"its own slice gathers the shards, at twice the bytes of an all-gather (a reduce-scatter and an "
            f"all-gather in one). all_gather(full, master.detach()) sends each rank's slice once to every rank")
    if said == ["broadcast"] * len(said) and len(said) == WORLD:
        return  # each owner broadcasts its own shard
    if set(said) <= set(ALL_GATHERS):
        moved = sum(c.bytes for c in calls)
        assert moved == 4 * size, (
            f"rank {rank} all-gathered {moved} B per step ({_said(calls)}); its updated shard is {size} fp32 "
            f"elements, {4 * size} B: all-gather it once, after opt.step()")
        return
    raise AssertionError(
        f"rank {rank} called {_said(calls)} after opt.step(): ZeRO-1 all-gathers the updated master shards - "
        f"one all_gather(full, master.detach()) that every rank joins - and copies the result into the parameters")


def _check_calls(got, n, padded, size):
    for rank, r in enumerate(got):
        for s in r["steps"]:
            for c in s["before"] + s["after"]:
                assert c.group == tuple(range(WORLD)), (
                    f"rank {rank}'s {c} ran over ranks {list(c.group)} only: ZeRO-1's reduce-scatter and all-gather "
                    f"span all {WORLD} data-parallel ranks (the default group)")
            _check_gradient_calls(rank, s["before"], n, padded)
            _check_parameter_calls(rank, s["after"], n, padded, size)


def _flat_padded(params, padded):
    import torch

    flat = _flat(params)
    return torch.cat([flat, flat.new_zeros(padded - flat.numel())]), flat.numel()


def _check_gradients(got, want_grad, padded, size):
    """What opt.step() saw: this rank's slice of the gradient averaged over the ranks."""
    import torch

    want_padded, _ = _flat_padded([want_grad], padded)
    for rank, r in enumerate(got):
        lo = rank * size
        g = r["first_grad"]
        assert g is not None, (
            f"after step 1 rank {rank}'s master shard has no .grad: set master.grad to this rank's slice "
            f"of the reduce-scattered gradient before optimizer.step()")
        require_finite(g, f"rank {rank}'s master shard .grad after step 1")
        want = want_padded[lo:lo + size]
        assert g.shape == want.shape, f"rank {rank}'s master .grad has shape {tuple(g.shape)}, expected ({size},)"
        if torch.allclose(g, WORLD * want, rtol=1e-4, atol=1e-7) and not torch.allclose(g, want, atol=1e-7):
            raise AssertionError(
                f"rank {rank}'s shard gradient is {WORLD}.000x the single-process gradient: reduce-scatter sums "
                f"over the ranks - divide by the world size to average")
        local = _flat_padded([r["local"]], padded)[0][lo:lo + size]
        if torch.allclose(g, local, atol=1e-7) and not torch.allclose(g, want, atol=1e-6):
            raise AssertionError(
                f"rank {rank}'s shard gradient is its own micro-batch's gradient only: reduce-scatter the flat "
                f"gradients so each rank receives the sum of its slice over all ranks (then divide by the world "
                f"size)")
        if not torch.allclose(g, want, rtol=1e-4, atol=1e-6):
            for owner in range(WORLD):
                if owner != rank and torch.allclose(g, want_padded[owner * size:(owner + 1) * size], rtol=1e-4,
                                                    atol=1e-6):
                    raise AssertionError(
                        f"rank {rank} received rank {owner}'s slice of the gradient: rank r owns elements "
                        f"[r*{size}, (r+1)*{size}) of the padded flat vector")
            raise AssertionError(
                f"rank {rank}'s shard gradient differs from the single-process gradient's slice "
                f"[{lo}, {lo + size}) by up to {(g - want).abs().max().item():.2e}: flatten the grads in "
                f"parameter order, pad, reduce-scatter, divide by the world size")


def _check_parameters(got, want_params, n, size):
    """After the steps: every rank holds one process's Adam parameters, all of them."""
    import torch

    start = _flat(_model().parameters())
    for rank, r in enumerate(got):
        p = r["params"]
        require_finite(p, f"rank {rank}'s parameters after {STEPS} steps")
        diff = (p - want_params).abs()
        if diff.max().item() <= 1e-5:
            continue
        mine = torch.zeros(n, dtype=torch.bool)
        mine[rank * size:min((rank + 1) * size, n)] = True
        if torch.equal(p[~mine], start[~mine]) and not torch.equal(p[mine], start[mine]):
            raise AssertionError(
                f"on rank {rank} only its own shard of the parameters was updated, the rest never changed: "
                f"all-gather the updated master shards and copy the result (without the padding) into every "
                f"parameter")
        raise AssertionError(
            f"after {STEPS} steps rank {rank}'s parameters differ from one process's Adam by up to "
            f"{diff.max().item():.2e}: update the master shard with Adam, all-gather it, and copy it into "
            f"the parameters in the same order you flattened them")


def exercise_1(shard_parameters, zero1_step) -> None:
    want_params, want_grad = _single()
    n = want_params.numel()
    padded = -(-n // WORLD) * WORLD
    size = padded // WORLD
    try:
        got = on_ranks(WORLD, _zero1_on_rank, shard_parameters, zero1_step)
    except RankError as e:
        text = str(e)
        if "size" in text.lower() or "shape" in text.lower() or "numel" in text.lower():
            raise AssertionError(
                f"a collective failed on the ranks with a size error ({text.splitlines()[0][:160]}): the model has "
                f"{n} parameters, an odd number, and reduce-scatter / all-gather need a flat vector that divides "
                f"evenly - pad it with zeros to a multiple of the world size ({padded}), so each rank owns {size} "
                f"elements") from None
        raise
    _check_master(got, n, padded, size)
    _check_optimizers(got, n, size)
    _check_calls(got, n, padded, size)
    _check_gradients(got, want_grad, padded, size)
    _check_parameters(got, want_params, n, size)


# -- exercise 2 -----------------------------------------------------------------------------------
def _engine_memory(cfg):
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import run_training

    return run_training(cfg, worker_context(cfg.parallel)).metrics[-1]["memory"]


@functools.lru_cache(maxsize=None)
def _measured(hidden: int, layers: int):
    """psi and the engine's memory per owner on rank 0 of a ZeRO-1 run: the same on every call of the check."""
    from ultrascale.model import count_params

    cfg = engine_run_config(1, hidden, layers)
    return count_params(cfg.model), on_ranks(WORLD, _engine_memory, cfg)[0]


def engine_run_config(zero: int, hidden: int = 64, layers: int = 2, dp: int = WORLD):
    """A one-step bf16 run of the tiny model under ZeRO `zero` on `dp` ranks, validated."""
    from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
    from ultrascale.model import get_preset

    model = get_preset("tiny", hidden=hidden, layers=layers)
    cfg = RunConfig(model=model, parallel=ParallelConfig(dp=dp, zero=zero),
                    train=TrainConfig(steps=1, seq_len=16, micro_batch=1, dtype="bf16", progress=False,
                                      measure_activations=False))
    return validate(cfg, dp)


@functools.lru_cache(maxsize=None)
def _planner_states(psi_model: str, n: int, precision: str):
    from ultrascale.plan.calibration import get_framework
    from ultrascale.plan.layout import Layout
    from ultrascale.plan.memory import memory_plan
    from ultrascale.plan.shape import get_shape
    import dataclasses

    shape = get_shape(psi_model)
    fw = dataclasses.replace(get_framework("playbook"), partition="even")
    lay = Layout(dp=n, zero=1, micro_batch=1, seq_len=4096, precision=precision)
    terms = memory_plan(shape, lay, fw).peak.terms
    return shape.count(), {k: terms[k] for k in ("params", "grads", "optim")}


def _compare(fn, psi, n, grad_bytes, want, where):
    got = fn(psi, n, grad_bytes=grad_bytes)
    assert isinstance(got, dict) and set(got) >= {"params", "grads", "optim"}, (
        "return a dict with the keys 'params', 'grads' and 'optim' (bytes per rank)")
    require_finite({owner: float(got[owner]) for owner in ("params", "grads", "optim")}, f"your bytes for {where}")
    for owner in ("params", "grads", "optim"):
        g, w = float(got[owner]), float(want[owner])
        if abs(g - w) <= 2e-3 * w:
            continue
        r = g / w if w else float("inf")
        if owner == "optim" and abs(r - 2 / 3) < 0.01:
            raise AssertionError(
                f"{where}: your optimizer states are {r:.3f}x the measured ones ({g:,.0f} vs {w:,.0f} bytes): that is "
                f"8 bytes per parameter (Adam's two moments). Mixed precision also keeps fp32 master weights, "
                f"sharded with the moments: k = 4 + 4 + 4 = 12")
        if owner == "optim" and abs(r - n) < 0.01 * n and n > 1:
            raise AssertionError(
                f"{where}: your optimizer states are {r:.3f}x the measured ones: ZeRO-1 gives each of the {n} ranks "
                f"1/{n} of them - divide k*psi by N")
        if owner == "grads" and abs(r * n - 1) < 0.01 and n > 1:
            raise AssertionError(
                f"{where}: your gradients are 1/{n} of the measured ones: ZeRO-1 keeps the full gradient on every "
                f"rank (sharding them is ZeRO-2)")
        if owner == "params" and abs(r * n - 1) < 0.01 and n > 1:
            raise AssertionError(
                f"{where}: your parameters are 1/{n} of the measured ones: ZeRO-1 keeps all bf16 parameters on "
                f"every rank (sharding them is ZeRO-3)")
        if r < 1e-6:
            raise AssertionError(
                f"{where}: your {owner} are {g:,.3g}, the measured {w:,.0f} bytes: answer in bytes, not GiB or GB")
        if owner == "params" and abs(r - 3) < 0.01:
            raise AssertionError(
                f"{where}: your parameters are 3.000x the measured ones: 6 bytes per parameter counts the fp32 master "
                f"weights with the bf16 parameters. The fp32 master weights are optimizer state, sharded by ZeRO-1 "
                f"with the two moments: params 2 bytes, optim k = 12 over N")
        if owner == "params" and abs(r - 2) < 0.01:
            raise AssertionError(
                f"{where}: your parameters are 2.000x the measured ones: the parameters are bf16: 2 bytes each (the "
                f"fp32 copy is the master weights, counted in the optimizer states)")
        if owner == "grads" and grad_bytes != 2 and abs(r - 2 / grad_bytes) < 0.01:
            raise AssertionError(
                f"{where}: your gradients are {r:.3f}x the measured ones: they are kept in {grad_bytes} bytes per "
                f"parameter here - use grad_bytes, not a fixed 2")
        raise AssertionError(f"{where}: {owner} is {g:,.0f} bytes per rank, measured {w:,.0f} ({r:.3f}x)")


def exercise_2(fn) -> None:
    # The planner: Llama 3 8B, bf16 gradients (the playbook's recipe) and fp32 gradients, N = 1..64.
    for precision, grad_bytes in (("bf16", 2), ("bf16-fp32-grads", 4)):
        for n in (1, 2, 4, 8, 16, 32, 64):
            psi, want = _planner_states("llama3-8b", n, precision)
            _compare(fn, psi, n, grad_bytes, want,
                     f"the planner's Llama 3 8B (psi={psi:,}, N={n}, {grad_bytes}-byte gradients)")
    # The engine: bf16 parameters, fp32 gradients (grad_bytes=4), mixed-precision AdamW, on 2 real ranks.
    for hidden, layers in ((64, 2), (32, 3)):
        psi, measured = _measured(hidden, layers)
        _compare(fn, psi, WORLD, 4, measured,
                 f"the engine's ZeRO-1 run (psi={psi:,}, N={WORLD}, fp32 gradients)")
