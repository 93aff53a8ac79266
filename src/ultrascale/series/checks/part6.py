"""Checks of Part 6 (ZeRO-1).

exercise_1: the learner's ZeRO-1 functions (shard_parameters, zero1_step) run on 2 real gloo ranks, each
on its half of the batch, and must end with the parameters one process gets with
torch.optim.Adam on the whole batch; its master shard must be 1/world of the padded
flat vector, and its gradient the average over the ranks.

exercise_2: the learner's bytes-per-rank formula against the engine's measured memory
per owner (bf16 run of ZeRO-1 on 2 real ranks, fp32 gradients) and against the
planner's figures for Llama 3 8B over N = 1..64 (bf16 and fp32 gradients).
"""

from __future__ import annotations

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
    """On each rank: the learner's functions over this rank's half of the batch."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    params = list(model.parameters())
    master = shard_parameters(params)
    assert isinstance(master, torch.Tensor), (
        f"shard_parameters returned {type(master).__name__}, not a tensor: return this rank's slice of the "
        f"flat, padded parameters as an nn.Parameter")
    if not isinstance(master, torch.nn.Parameter):
        master = torch.nn.Parameter(master.detach())
    master_numel = master.numel()
    opt = torch.optim.Adam([master], lr=LR)
    x, y = _batch()
    xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
    first_grad, local = None, None
    for step in range(STEPS):
        for p in params:
            p.grad = None
        master.grad = None
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        if step == 0:
            local = torch.cat([p.grad.reshape(-1) for p in params]).clone()
        zero1_step(params, master, opt)
        if step == 0:
            first_grad = None if master.grad is None else master.grad.detach().clone()
    return {"params": _flat(params), "master_numel": master_numel, "first_grad": first_grad, "local": local}


def exercise_1(shard_parameters, zero1_step) -> None:
    import torch

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
    for rank, r in enumerate(got):
        if r["master_numel"] >= n:
            raise AssertionError(
                f"rank {rank}'s master weights (what shard_parameters returned) hold {r['master_numel']} elements, the whole model ({n}): ZeRO-1 keeps "
                f"only this rank's shard of the padded flat vector, {size} elements on {WORLD} ranks")
        assert r["master_numel"] == size, (
            f"rank {rank}'s master shard has {r['master_numel']} elements; with {n} parameters padded to {padded} "
            f"on {WORLD} ranks each shard has {size}")
    lo = [rank * size for rank in range(WORLD)]
    want_padded = torch.cat([want_grad, torch.zeros(padded - n)])
    for rank, r in enumerate(got):
        g = r["first_grad"]
        assert g is not None, (
            f"after step 1 rank {rank}'s master shard has no .grad: set master.grad to this rank's slice "
            f"of the reduce-scattered gradient before optimizer.step()")
        require_finite(g, f"rank {rank}'s master shard .grad after step 1")
        want = want_padded[lo[rank]:lo[rank] + size]
        assert g.shape == want.shape, f"rank {rank}'s master .grad has shape {tuple(g.shape)}, expected ({size},)"
        if torch.allclose(g, WORLD * want, rtol=1e-4, atol=1e-7) and not torch.allclose(g, want, atol=1e-7):
            raise AssertionError(
                f"rank {rank}'s shard gradient is {WORLD}.000x the single-process gradient: reduce-scatter sums "
                f"over the ranks - divide by the world size to average")
        local = torch.cat([r["local"], torch.zeros(padded - n)])[lo[rank]:lo[rank] + size]
        if torch.allclose(g, local, atol=1e-7) and not torch.allclose(g, want, atol=1e-6):
            raise AssertionError(
                f"rank {rank}'s shard gradient is its own micro-batch's gradient only: reduce-scatter the flat "
                f"gradients so each rank receives the sum of its slice over all ranks (then divide by the world "
                f"size)")
        if not torch.allclose(g, want, rtol=1e-4, atol=1e-6):
            other = want_padded[lo[1 - rank]:lo[1 - rank] + size] if WORLD == 2 else None
            if other is not None and torch.allclose(g, other, rtol=1e-4, atol=1e-6):
                raise AssertionError(
                    f"rank {rank} received the other rank's slice of the gradient: rank r owns elements "
                    f"[r*{size}, (r+1)*{size}) of the padded flat vector")
            raise AssertionError(
                f"rank {rank}'s shard gradient differs from the single-process gradient's slice "
                f"[{lo[rank]}, {lo[rank] + size}) by up to {(g - want).abs().max().item():.2e}: flatten the grads in "
                f"parameter order, pad, reduce-scatter, divide by the world size")
    for rank, r in enumerate(got):
        p = r["params"]
        require_finite(p, f"rank {rank}'s parameters after {STEPS} steps")
        diff = (p - want_params).abs()
        if not diff.max().item() <= 1e-5:  # `not <=`: a NaN is off too
            mine = torch.zeros(n, dtype=torch.bool)
            mine[lo[rank]:min(lo[rank] + size, n)] = True
            start = _flat(_model().parameters())
            if torch.equal(p[~mine], start[~mine]) and not torch.equal(p[mine], start[mine]):
                raise AssertionError(
                    f"on rank {rank} only its own shard of the parameters was updated, the rest never changed: "
                    f"all-gather the updated master shards and copy the result (without the padding) into every "
                    f"parameter")
            raise AssertionError(
                f"after {STEPS} steps rank {rank}'s parameters differ from one process's Adam by up to "
                f"{diff.max().item():.2e}: update the master shard with Adam, all-gather it, and copy it into "
                f"the parameters in the same order you flattened them")


# -- exercise 2 -----------------------------------------------------------------------------------
def _engine_memory(cfg):
    from ultrascale.testing.harness import worker_context
    from ultrascale.train.trainer import run_training

    return run_training(cfg, worker_context(cfg.parallel)).metrics[-1]["memory"]


def engine_run_config(zero: int, hidden: int = 64, layers: int = 2, dp: int = WORLD):
    """A one-step bf16 run of the tiny model under ZeRO `zero` on `dp` ranks, validated."""
    from ultrascale.config import ParallelConfig, RunConfig, TrainConfig, validate
    from ultrascale.model import get_preset

    model = get_preset("tiny", hidden=hidden, layers=layers)
    cfg = RunConfig(model=model, parallel=ParallelConfig(dp=dp, zero=zero),
                    train=TrainConfig(steps=1, seq_len=16, micro_batch=1, dtype="bf16", progress=False,
                                      measure_activations=False))
    return validate(cfg, dp)


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
        if owner == "grads" and grad_bytes != 2 and abs(r - 2 / grad_bytes) < 0.01:
            raise AssertionError(
                f"{where}: your gradients are {r:.3f}x the measured ones: they are kept in {grad_bytes} bytes per "
                f"parameter here - use grad_bytes, not a fixed 2")
        raise AssertionError(f"{where}: {owner} is {g:,.0f} bytes per rank, measured {w:,.0f} ({r:.3f}x)")


def exercise_2(fn) -> None:
    from ultrascale.model import count_params

    # The planner: Llama 3 8B, bf16 gradients (the playbook's recipe) and fp32 gradients, N = 1..64.
    for precision, grad_bytes in (("bf16", 2), ("bf16-fp32-grads", 4)):
        for n in (1, 2, 4, 8, 16, 32, 64):
            psi, want = _planner_states("llama3-8b", n, precision)
            _compare(fn, psi, n, grad_bytes, want,
                     f"the planner's Llama 3 8B (psi={psi:,}, N={n}, {grad_bytes}-byte gradients)")
    # The engine: bf16 parameters, fp32 gradients (grad_bytes=4), mixed-precision AdamW, on 2 real ranks.
    for hidden, layers in ((64, 2), (32, 3)):
        cfg = engine_run_config(1, hidden, layers)
        psi = count_params(cfg.model)
        measured = on_ranks(WORLD, _engine_memory, cfg)[0]
        _compare(fn, psi, WORLD, 4, measured,
                 f"the engine's ZeRO-1 run (psi={psi:,}, N={WORLD}, fp32 gradients)")
