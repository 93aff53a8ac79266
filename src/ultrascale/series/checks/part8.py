"""Part 8, tensor parallelism: a column- then row-parallel MLP with the conjugate f / g
operators, and the vocabulary-parallel cross-entropy, each on 2 real ranks.

Every expected value is computed here, in one process and float64, from the whole
weights or the whole logits (the MLP and its gradients by autograd, the loss by
F.cross_entropy); the learner's functions only run on the ranks.
"""

from __future__ import annotations

from ultrascale.series.checks import on_ranks, require_finite

WORLD = 2
B, S, H, FFN = 2, 3, 8, 16  # the MLP: x [B, S, H], w1 [FFN, H], w2 [H, FFN]
TOKENS, VOCAB = 12, 10  # the loss: logits [TOKENS, VOCAB], each rank VOCAB / WORLD columns


# -- exercise 1: the tensor-parallel MLP --------------------------------------------------
def _mlp_tensors(seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g)
    w1 = torch.randn(FFN, H, generator=g) / H**0.5
    w2 = torch.randn(H, FFN, generator=g) / FFN**0.5
    cot = torch.randn(B, S, H, generator=g)  # the loss is (out * cot).sum(): a gradient unlike any other
    return x, w1, w2, cot


def _mlp_case(tp_mlp, seed):
    """On each rank: the learner's MLP on its shards; its output and gradients."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x, w1, w2, cot = _mlp_tensors(seed)
    n = FFN // world
    mine = slice(rank * n, (rank + 1) * n)
    x = x.clone().requires_grad_()
    w1_shard = w1[mine].clone().requires_grad_()      # column-parallel: this rank's output features
    w2_shard = w2[:, mine].clone().requires_grad_()   # row-parallel: the matching input features
    out = tp_mlp(x, w1_shard, w2_shard)
    assert out is not None, "tp_mlp returned None: return the MLP's output"
    if out.requires_grad:
        (out * cot).sum().backward()
    grads = [None if t.grad is None else t.grad.detach().clone() for t in (x, w1_shard, w2_shard)]
    return out.detach().clone(), grads, out.requires_grad


def _mlp_reference(x, w1, w2, cot, scale_x=1.0, rows=None):
    """Output and (x, w1, w2) gradients in float64; `rows` keeps only those columns of w1 (rows of w2)."""
    import torch.nn.functional as F

    x, w1, w2 = (t.double().clone().requires_grad_() for t in (x, w1, w2))
    a, b = (w1, w2) if rows is None else (w1[rows], w2[:, rows])
    out = F.gelu((scale_x * x) @ a.t()) @ b.t()
    (out * cot.double()).sum().backward()
    return out.detach(), x.grad, w1.grad, w2.grad


def exercise_1(tp_mlp):
    """tp_mlp(x, w1_shard, w2_shard) on 2 ranks: column-parallel w1, row-parallel w2, f and g."""
    import torch

    seed = 81
    results = on_ranks(WORLD, _mlp_case, tp_mlp, seed, timeout=60)
    x, w1, w2, cot = _mlp_tensors(seed)
    out, gx, gw1, gw2 = _mlp_reference(x, w1, w2, cot)
    n = FFN // WORLD

    def near(a, b):
        return a is not None and tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b, atol=1e-5)

    for rank, (got, (got_x, got_w1, got_w2), differentiable) in enumerate(results):
        mine = slice(rank * n, (rank + 1) * n)
        own = _mlp_reference(x, w1, w2, cot, rows=mine)
        assert tuple(got.shape) == tuple(out.shape), (
            f"rank {rank} returned shape {tuple(got.shape)}: after g every rank holds the whole output "
            f"{tuple(out.shape)}; the row-parallel linear maps its {n} features back to h = {H}")
        require_finite(got, f"rank {rank}'s output")
        if not near(got, out):
            if near(got, own[0]):
                raise AssertionError(f"rank {rank}'s output is only its own partial sum (through its {n} of "
                                     f"{FFN} hidden features): g's forward must all-reduce (sum) the row-parallel "
                                     f"outputs over the ranks")
            if near(got, _mlp_reference(x, w1, w2, cot, scale_x=WORLD)[0]):
                raise AssertionError(f"rank {rank} computed the MLP of {WORLD}x its input: f's forward is the "
                                     f"identity (every rank already holds x); the all-reduce belongs to its backward")
            if near(got, WORLD * own[0]) or near(got, out / WORLD):
                raise AssertionError(f"rank {rank}'s output is off by a factor of {WORLD}: g sums the partial "
                                     f"outputs (no average, no scaling)")
            err = (got.double() - out).abs().max().item()
            raise AssertionError(f"rank {rank}'s output differs from the single-process MLP by {err:.2e}: "
                                 f"gelu(f(x) @ w1_shard.T) @ w2_shard.T, then g")
        if not differentiable or got_x is None:
            raise AssertionError(f"rank {rank}: no gradient reached x; the output must come from autograd "
                                 f"operations (your f and g's .apply, not a detached copy)")
        if got_w1 is None or got_w2 is None:
            raise AssertionError(f"rank {rank}: no gradient reached w1_shard or w2_shard: use them in the forward")
        require_finite([got_x, got_w1, got_w2], f"rank {rank}'s gradients of x, w1_shard and w2_shard")
        if near(got_x, WORLD * gx) and near(got_w1, WORLD * gw1[mine]):
            raise AssertionError(f"rank {rank}'s gradients are {WORLD}.000x the single-process ones: g's backward "
                                 f"is the identity (the output's gradient is already whole on every rank); "
                                 f"all-reducing it there sums {WORLD} copies")
        if not near(got_x, gx):
            if near(got_x, own[1]):
                raise AssertionError(f"rank {rank}'s x.grad only holds the part that flows through its own "
                                     f"{n} hidden features: f's backward must all-reduce (sum) the input gradient")
            if near(got_x, gx / WORLD):
                raise AssertionError(f"rank {rank}'s x.grad is 1/{WORLD} of the single-process one: f's backward "
                                     f"sums the partial gradients, it does not average them")
            err = (got_x.double() - gx).abs().max().item()
            raise AssertionError(f"rank {rank}'s x.grad differs from the single-process one by {err:.2e}: f's "
                                 f"backward all-reduces the gradient, g's backward passes it through")
        if not near(got_w1, gw1[mine]) or not near(got_w2, gw2[:, mine]):
            raise AssertionError(f"rank {rank}'s weight gradients differ from the single-process ones' "
                                 f"shards (w1 rows {mine.start}:{mine.stop}, w2 columns {mine.start}:{mine.stop})")


# -- exercise 2: vocabulary-parallel cross-entropy --------------------------------------------
def _ce_tensors(seed, shift):
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(TOKENS, VOCAB, generator=g) + shift
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    targets[0], targets[1] = 0, VOCAB - 1  # both shards own some targets
    return logits, targets


def _ce_case(vocab_parallel_ce, seed, shift):
    """On each rank: its columns of the logits -> the learner's loss, and whether it gathered logits."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    logits, targets = _ce_tensors(seed, shift)
    n = VOCAB // world
    names = [name for name in ("all_gather", "all_gather_into_tensor", "all_gather_object", "gather",
                               "broadcast", "send", "isend") if hasattr(dist, name)]
    real = {name: getattr(dist, name) for name in names}
    used = []

    def spy(name):
        def wrapped(*args, **kwargs):
            used.append(name)
            return real[name](*args, **kwargs)
        return wrapped

    for name in names:
        setattr(dist, name, spy(name))
    try:
        loss = vocab_parallel_ce(logits[:, rank * n:(rank + 1) * n].clone(), targets.clone(), rank * n)
    finally:
        for name in names:
            setattr(dist, name, real[name])
    assert loss is not None, "vocab_parallel_ce returned None: return the mean loss"
    return float(torch.as_tensor(loss).float().reshape(-1)[0]) if torch.as_tensor(loss).numel() == 1 else None, \
        used


def _ce_variants(logits, targets):
    """Losses of the wrong answers, in float64."""
    import torch

    z = logits.double()
    n = VOCAB // WORLD
    shards = [z[:, r * n:(r + 1) * n] for r in range(WORLD)]
    gmax = z.max(-1).values
    # each rank shifts by its own max, the sums of exp still added together
    local = sum((s - s.max(-1, keepdim=True).values).exp().sum(-1) for s in shards)
    true_target = z.gather(1, targets[:, None]).squeeze(1)
    owner_max = torch.stack([s.max(-1).values for s in shards], 1).gather(1, (targets // n)[:, None]).squeeze(1)
    wrong_local = (local.log() - (true_target - owner_max)).mean().item()
    # every rank adds a target logit, clamped into its shard, owner or not
    clamped = sum((s - gmax[:, None]).gather(1, (targets - r * n).clamp(0, n - 1)[:, None]).squeeze(1)
                  for r, s in enumerate(shards))
    lse = torch.logsumexp(z - gmax[:, None], -1)
    return {"local": wrong_local, "clamped": (lse - clamped).mean().item(),
            "sum": (lse - (true_target - gmax)).sum().item()}


def exercise_2(vocab_parallel_ce):
    """vocab_parallel_ce(logits_shard, targets, vocab_start) on 2 ranks -> the mean cross-entropy."""
    import math

    import torch.nn.functional as F

    for seed, shift in ((82, 0.0), (83, 1000.0)):
        results = on_ranks(WORLD, _ce_case, vocab_parallel_ce, seed, shift, timeout=60)
        logits, targets = _ce_tensors(seed, shift)
        want = F.cross_entropy(logits.double(), targets).item()
        variants = _ce_variants(logits, targets)
        for rank, (got, used) in enumerate(results):
            assert got is not None, f"rank {rank} returned more than one number: return the mean loss, a scalar"
            if used:
                raise AssertionError(f"rank {rank} called dist.{used[0]}: the point is never to move the "
                                     f"[tokens, vocab] logits; all-reduce three numbers per token instead (the max, "
                                     f"the sum of exp, the target logit)")
            if not math.isfinite(got):
                if not shift:  # logits of a few units: no exp() overflows here
                    raise AssertionError(f"a NaN or an infinity in rank {rank}'s loss, with logits of a few units "
                                         f"where no exp() overflows: look for an inf or a NaN you put in (a -inf "
                                         f"mask summed over the ranks) or a log of 0")
                raise AssertionError(f"with logits around {shift:.0f} rank {rank}'s loss is {got}: exp overflows; "
                                     f"subtract the max over the whole vocabulary (all-reduce MAX) before exp")
            if abs(got - want) <= 1e-4 * max(1.0, abs(want)):
                continue
            if abs(got - variants["local"]) <= 1e-4 * max(1.0, abs(want)):
                raise AssertionError(f"rank {rank}: each rank shifted its logits by its own max, so the sums of "
                                     f"exp you added are in different units: all-reduce the max (ReduceOp.MAX) "
                                     f"first and subtract the global one everywhere")
            if abs(got - variants["clamped"]) <= 1e-4 * max(1.0, abs(want)):
                raise AssertionError(f"rank {rank}: every rank added a target logit, also for targets outside its "
                                     f"shard; only the owner (vocab_start <= target < vocab_start + shard) "
                                     f"contributes it, the others add 0 before the all-reduce")
            if abs(got - variants["sum"]) <= 1e-4 * max(1.0, abs(variants["sum"])):
                raise AssertionError(f"rank {rank} returned the sum over the {TOKENS} tokens ({got:.4f}); "
                                     f"F.cross_entropy averages: divide by the number of tokens")
            if abs(got - WORLD * want) <= 1e-4 * abs(want) or abs(got - want / WORLD) <= 1e-4 * abs(want):
                raise AssertionError(f"rank {rank}'s loss is off by a factor of {WORLD} ({got:.4f} vs {want:.4f}): "
                                     f"the loss is computed once from the all-reduced sums, not added over ranks")
            raise AssertionError(f"rank {rank}'s loss {got:.6f} differs from F.cross_entropy on the whole "
                                 f"logits, {want:.6f}: loss = log(sum exp(z - max)) - (z_target - max), "
                                 f"averaged over tokens")
