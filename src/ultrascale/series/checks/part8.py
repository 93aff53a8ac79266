"""Part 8, tensor parallelism: a column- then row-parallel MLP with the conjugate f / g
operators, and the vocabulary-parallel cross-entropy, each on 2 real ranks.

Every expected value is computed here, in one process and float64, from the whole
weights or the whole logits (the MLP and its gradients by autograd, the loss by
F.cross_entropy); the learner's functions only run on the ranks. The collectives each
rank called are read back too (series/watch.py): the MLP is one all-reduce of the
[b, s, h] activation in forward (g's) and one in backward (f's), and the loss moves a
few numbers per token, never the logits. The right numbers reached another way (the
weights gathered, the logits all-reduced whole) are not tensor parallelism.
"""

from __future__ import annotations

from ultrascale.series.checks import RankError, on_ranks, require_finite
from ultrascale.testing.tolerance import BF16_FORMAT, FP16_FORMAT

WORLD = 2
# The MLP's cases, (seed, (b, s, h, f)): x [b, s, h], w1 [f, h], w2 [h, f]. The first has h = f/t, where
# shards used untransposed still fit and their product is named; the second has no power of two, h and
# f/t apart, s odd, so that a size written in (a view to 6 x 8, h = 8) fails.
MLP_CASES = ((81, (2, 3, 8, 16)), (82, (3, 5, 12, 20)))
TOKENS, VOCAB = 12, 64  # the loss: logits [TOKENS, VOCAB], each rank VOCAB / WORLD columns
# A few numbers per token may travel (the max, the sum of exp, the target logit, even in float64);
# a shard of logits is VOCAB / WORLD = 32 per token, at least 64 bytes a token in any float type.
PER_TOKEN_BYTES = 8 * 8
_GATHERS = ("all_gather", "all_gather_single", "all_gather_into_tensor", "gather", "all_gather_object")


def _sizes_failed(e: RankError) -> bool:
    first = str(e).splitlines()[0].lower()
    return "shape" in first or "size" in first


# -- exercise 1: the tensor-parallel MLP --------------------------------------------------
def _mlp_tensors(seed, dims):
    import torch

    b, s, h, f = dims
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, generator=g)
    w1 = torch.randn(f, h, generator=g) / h**0.5
    w2 = torch.randn(h, f, generator=g) / f**0.5
    cot = torch.randn(b, s, h, generator=g)  # the loss is (out * cot).sum(): a gradient unlike any other
    return x, w1, w2, cot


def _mlp_case(tp_mlp, seed, dims):
    """On each rank: the learner's MLP on its shards; its output, its gradients, and the collectives
    it called in forward and in backward."""
    import torch.distributed as dist

    from ultrascale.series import watch

    rank, world = dist.get_rank(), dist.get_world_size()
    x, w1, w2, cot = _mlp_tensors(seed, dims)
    n = w1.shape[0] // world
    mine = slice(rank * n, (rank + 1) * n)
    x = x.clone().requires_grad_()
    w1_shard = w1[mine].clone().requires_grad_()      # column-parallel: this rank's output features
    w2_shard = w2[:, mine].clone().requires_grad_()   # row-parallel: the matching input features
    out = tp_mlp(x, w1_shard, w2_shard)
    assert out is not None, "tp_mlp returned None: return the MLP's output"
    forward = watch.calls()
    if out.requires_grad:
        (out * cot).sum().backward()
    backward = watch.calls()[len(forward):]
    grads = [None if t.grad is None else t.grad.detach().clone() for t in (x, w1_shard, w2_shard)]
    return out.detach().clone(), grads, out.requires_grad, forward, backward


def _mlp_reference(x, w1, w2, cot, scale_x=1.0, rows=None):
    """Output and (x, w1, w2) gradients in float64; `rows` keeps only those columns of w1 (rows of w2)."""
    import torch.nn.functional as F

    x, w1, w2 = (t.double().clone().requires_grad_() for t in (x, w1, w2))
    a, b = (w1, w2) if rows is None else (w1[rows], w2[:, rows])
    out = F.gelu((scale_x * x) @ a.t()) @ b.t()
    (out * cot.double()).sum().backward()
    return out.detach(), x.grad, w1.grad, w2.grad


def _mlp_untransposed(x, w1, w2):
    """The sum over ranks of gelu(x @ w1_shard) @ w2_shard: the shards taken as [in, out] (h = f/t here,
    so the shapes let it through)."""
    import torch.nn.functional as F

    n = w1.shape[0] // WORLD
    return sum(F.gelu(x.double() @ w1.double()[r * n:(r + 1) * n]) @ w2.double()[:, r * n:(r + 1) * n]
               for r in range(WORLD))


def _mlp_forbidden(rank, forward, backward, shard_bytes):
    """Any collective but all-reduce: the weights gathered, or an all-reduce written by hand."""
    for phase, calls in (("forward", forward), ("backward", backward)):
        for c in calls:
            if c.kind == "all_reduce":
                continue
            if c.kind in _GATHERS and c.bytes == shard_bytes:
                raise AssertionError(
                    f"rank {rank} called {c} in {phase}: it gathered the weights of the other ranks, so every rank "
                    f"holds and runs the whole MLP, as without tensor parallelism. Never move the weights: compute "
                    f"your f/t hidden features with w1_shard, your partial output with w2_shard, and let g "
                    f"all-reduce the [b, s, h] partial outputs")
            if c.kind in _GATHERS:
                who = "g's forward" if phase == "forward" else "f's backward"
                raise AssertionError(
                    f"rank {rank}: {who} all-gathered ({c}) and summed locally: every rank then holds {WORLD} "
                    f"copies of the [b, s, h] tensor. {who} is one all-reduce (dist.all_reduce), which sums the "
                    f"partial tensors in place")
            raise AssertionError(
                f"rank {rank} called {c} in {phase}: the tensor-parallel MLP communicates only through g's "
                f"all-reduce in forward and f's all-reduce in backward")


def _mlp_values(rank, got, x, w1, w2, cot, want):
    """The output against one process's, naming the known wrong versions."""
    import torch

    out = want[0]
    h, f = x.shape[-1], w1.shape[0]
    n = f // WORLD
    mine = slice(rank * n, (rank + 1) * n)

    def near(a, b):
        return a is not None and tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b, atol=1e-5)

    own = _mlp_reference(x, w1, w2, cot, rows=mine)
    assert tuple(got.shape) == tuple(out.shape), (
        f"rank {rank} returned shape {tuple(got.shape)}: after g every rank holds the whole output "
        f"{tuple(out.shape)}; the row-parallel linear maps its {n} features back to h = {h}")
    require_finite(got, f"rank {rank}'s output")
    if near(got, out):
        return own
    if near(got, own[0]):
        raise AssertionError(f"rank {rank}'s output is only its own partial sum (through its {n} of "
                             f"{f} hidden features): g's forward must all-reduce (sum) the row-parallel "
                             f"outputs over the ranks")
    if near(got, _mlp_reference(x, w1, w2, cot, scale_x=WORLD)[0]):
        raise AssertionError(f"rank {rank} computed the MLP of {WORLD}x its input: f's forward is the "
                             f"identity (every rank already holds x); the all-reduce belongs to its backward")
    if near(got, WORLD * own[0]) or near(got, out / WORLD):
        raise AssertionError(f"rank {rank}'s output is off by a factor of {WORLD}: g sums the partial "
                             f"outputs (no average, no scaling)")
    if near(got, _mlp_untransposed(x, w1, w2)):
        raise AssertionError(f"rank {rank} multiplied by the shards as they are: the weights are stored as "
                             f"nn.Linear does, [out, in] (w1_shard is [f/t, h]); use x @ w1_shard.t() and "
                             f"hidden @ w2_shard.t()")
    err = (got.double() - out).abs().max().item()
    raise AssertionError(f"rank {rank}'s output differs from the single-process MLP by {err:.2e}: "
                         f"gelu(f(x) @ w1_shard.T) @ w2_shard.T, then g")


def _mlp_gradients(rank, grads, differentiable, want, own):
    import torch

    got_x, got_w1, got_w2 = grads
    _, gx, gw1, gw2 = want
    n = gw1.shape[0] // WORLD
    mine = slice(rank * n, (rank + 1) * n)

    def near(a, b):
        return a is not None and tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b, atol=1e-5)

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
    if near(got_x, gx / WORLD) and near(got_w1, gw1[mine] / WORLD):
        raise AssertionError(f"rank {rank}'s gradients are 1/{WORLD} of the single-process ones: g's backward "
                             f"passes the gradient through as it is (no average, no scaling)")
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


def _mlp_collectives(rank, forward, backward, dims):
    """Right values: now how. One all-reduce (sum) of the [b, s, h] activation over both ranks each way."""
    everyone = tuple(range(WORLD))
    b, s, h, _ = dims
    activation = b * s * h * 4  # what f and g all-reduce: one fp32 [b, s, h] tensor
    for phase, calls, who, why in (
            ("forward", forward, "g's", "f's forward is the identity (every rank already holds x)"),
            ("backward", backward, "f's", "g's backward is the identity (the output's gradient is already whole "
                                          "on every rank)")):
        if len(calls) != 1:
            said = "; ".join(map(str, calls)) or "none"
            raise AssertionError(f"rank {rank} made {len(calls)} all-reduces in {phase} ({said}): the only one "
                                 f"is {who}; {why}")
        (c,) = calls
        if c.op != "SUM":
            raise AssertionError(f"rank {rank}'s {phase} all-reduce is {c}: {who} all-reduce sums (ReduceOp.SUM)")
        if c.group != everyone:
            raise AssertionError(f"rank {rank}'s {phase} all-reduce ran over ranks {list(c.group)}: {who} "
                                 f"all-reduce spans the whole tensor-parallel group {list(everyone)}")
        if c.bytes != activation:
            raise AssertionError(f"rank {rank}'s {phase} all-reduce carried {c.bytes} B: {who} all-reduce moves "
                                 f"the [b, s, h] activation, {b}*{s}*{h} fp32 values = {activation} B")


def exercise_1(tp_mlp):
    """tp_mlp(x, w1_shard, w2_shard) on 2 ranks: column-parallel w1, row-parallel w2, f and g."""
    for seed, dims in MLP_CASES:
        try:
            results = on_ranks(WORLD, _mlp_case, tp_mlp, seed, dims, timeout=60)
        except RankError as e:
            if not _sizes_failed(e):
                raise
            b, s, h, f = dims
            raise AssertionError(f"with x [{b}, {s}, {h}] and f = {f}, a rank failed with a size error "
                                 f"({str(e).splitlines()[0][:160]}): x is whole on every rank ([b, s, h]), so f's "
                                 f"forward is the identity; w1_shard [f/t, h] makes [b, s, f/t] hidden features, "
                                 f"w2_shard [h, f/t] maps them back to [b, s, h]; take every size from the "
                                 f"tensors") from None
        x, w1, w2, cot = _mlp_tensors(seed, dims)
        want = _mlp_reference(x, w1, w2, cot)
        shard_bytes = w1.shape[0] // WORLD * w1.shape[1] * 4  # w1_shard [f/t, h] and w2_shard [h, f/t] alike
        for rank, (_, _, _, forward, backward) in enumerate(results):
            _mlp_forbidden(rank, forward, backward, shard_bytes)
        for rank, (got, grads, differentiable, _, _) in enumerate(results):
            own = _mlp_values(rank, got, x, w1, w2, cot, want)
            _mlp_gradients(rank, grads, differentiable, want, own)
        for rank, (_, _, _, forward, backward) in enumerate(results):
            _mlp_collectives(rank, forward, backward, dims)


# -- exercise 2: vocabulary-parallel cross-entropy --------------------------------------------
def _ce_tensors(seed, shift):
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(TOKENS, VOCAB, generator=g) + shift
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    # Every shard's first and last id among the targets: an owner test off by one at either end counts a
    # target twice or not at all.
    n = VOCAB // WORLD
    edges = [i for r in range(WORLD) for i in (r * n, (r + 1) * n - 1)]
    targets[:len(edges)] = torch.tensor(edges)
    return logits, targets


def _ce_case(vocab_parallel_ce, seed, shift, reversed_shards=False):
    """On each rank: its columns of the logits -> the learner's loss (None if not one number).
    reversed_shards: rank r holds shard world - 1 - r, as a tensor-parallel rank that is not the global
    rank would (a dp x tp grid): the shard's first id is vocab_start, never rank * n."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    logits, targets = _ce_tensors(seed, shift)
    n = VOCAB // world
    shard = world - 1 - rank if reversed_shards else rank
    loss = vocab_parallel_ce(logits[:, shard * n:(shard + 1) * n].clone(), targets.clone(), shard * n)
    assert loss is not None, "vocab_parallel_ce returned None: return the mean loss"
    loss = torch.as_tensor(loss)
    return float(loss.detach().double().reshape(-1)[0]) if loss.numel() == 1 else None


def _ce_variants(logits, targets):
    """Losses of the wrong answers, in float64: {name: [rank 0's, rank 1's, ...]}."""
    import torch

    z = logits.double()
    n = VOCAB // WORLD
    shards = [z[:, r * n:(r + 1) * n] for r in range(WORLD)]
    owner = targets // n
    gmax = z.max(-1).values
    lse = torch.logsumexp(z - gmax[:, None], -1)
    true_target = z.gather(1, targets[:, None]).squeeze(1) - gmax
    # each rank shifts by its own max, the sums of exp still added together
    local = sum((s - s.max(-1, keepdim=True).values).exp().sum(-1) for s in shards)
    owner_max = torch.stack([s.max(-1).values for s in shards], 1).gather(1, owner[:, None]).squeeze(1)
    wrong_local = (local.log() - (true_target + gmax - owner_max)).mean().item()
    # every rank adds a target logit, clamped into its shard, owner or not
    clamped = sum((s - gmax[:, None]).gather(1, (targets - r * n).clamp(0, n - 1)[:, None]).squeeze(1)
                  for r, s in enumerate(shards))
    # the target's column taken as `targets`, not `targets - vocab_start`: every rank "owns" the ids below n
    low = targets < n
    unshifted = sum(torch.where(low, (s - gmax[:, None]).gather(1, targets.clamp(0, n - 1)[:, None]).squeeze(1), 0)
                    for s in shards)
    # the owner's test off by one: `local <= n` also owns the next shard's first id (as its own last column),
    # `local > 0` disowns its own first id
    def owned_by(test):
        return sum(torch.where(test(targets - r * n), (s - gmax[:, None]).gather(
            1, (targets - r * n).clamp(0, n - 1)[:, None]).squeeze(1), 0) for r, s in enumerate(shards))

    return {
        "past_end": [(lse - owned_by(lambda lo: (lo >= 0) & (lo <= n))).mean().item()] * WORLD,
        "before_start": [(lse - owned_by(lambda lo: (lo > 0) & (lo < n))).mean().item()] * WORLD,
        "local": [wrong_local] * WORLD,
        "clamped": [(lse - clamped).mean().item()] * WORLD,
        "unshifted": [(lse - unshifted).mean().item()] * WORLD,
        "sum": [(lse - true_target).sum().item()] * WORLD,
        # the owner's target logit not all-reduced: each rank only has those of its own targets
        "own_target": [(lse - torch.where(owner == r, true_target, 0)).mean().item() for r in range(WORLD)],
        # the sum of exp of the rank's own columns, with the global max
        "own_sum": [((s - gmax[:, None]).exp().sum(-1).log() - true_target).mean().item() for s in shards],
    }


def _ce_moved_logits(rank, calls):
    """The point of the exercise: no rank receives logits, only a few numbers per token."""
    for c in calls:
        if c.kind.endswith("_object") or c.kind.endswith("_object_list"):
            raise AssertionError(f"rank {rank} called dist.{c.kind}: the point is never to move the "
                                 f"[tokens, vocab] logits; all-reduce three numbers per token instead (the max, "
                                 f"the sum of exp, the target logit)")
        if c.bytes < PER_TOKEN_BYTES * TOKENS:
            continue
        if c.kind == "all_reduce":
            raise AssertionError(f"rank {rank} all-reduced {c.bytes:,} B ({c}): that is the whole [tokens, "
                                 f"vocab] logits on every rank, the memory vocabulary parallelism saves. "
                                 f"all-reduce three numbers per token instead (the max, the sum of exp, the "
                                 f"target logit): [{TOKENS}] tensors of {TOKENS * 4} B")
        raise AssertionError(f"rank {rank} called {c}: the point is never to move the [tokens, vocab] logits "
                             f"(a shard is {TOKENS}x{VOCAB // WORLD} values); all-reduce three numbers per token "
                             f"instead (the max, the sum of exp, the target logit)")


def _ce_mistake(rank, got, want, variants, shift):
    """The message for a loss that is not F.cross_entropy's, naming the known mistakes."""
    import math

    def near(value, target):
        return abs(value - target) <= 1e-4 * max(1.0, abs(target))

    if not math.isfinite(got):
        if not shift:  # logits of a few units: no exp() overflows here
            raise AssertionError(f"a NaN or an infinity in rank {rank}'s loss, with logits of a few units "
                                 f"where no exp() overflows: look for an inf or a NaN you put in (a -inf "
                                 f"mask summed over the ranks) or a log of 0")
        raise AssertionError(f"with logits around {shift:.0f} rank {rank}'s loss is {got}: exp overflows; "
                             f"subtract the max over the whole vocabulary (all-reduce MAX) before exp")
    for name, end in (("past_end", "local <= n also takes the next shard's first id"),
                      ("before_start", "local > 0 leaves out the shard's own first id")):
        if near(got, variants[name][rank]):
            raise AssertionError(f"rank {rank}: your owner test is off by one at a shard's edge ({end}): a shard "
                                 f"of n = {VOCAB // WORLD} columns owns local ids 0 .. n - 1, mine = (local >= 0) & "
                                 f"(local < n)")
    if near(got, variants["local"][rank]):
        raise AssertionError(f"rank {rank}: each rank shifted its logits by its own max, so the sums of "
                             f"exp you added are in different units: all-reduce the max (ReduceOp.MAX) "
                             f"first and subtract the global one everywhere")
    if near(got, variants["clamped"][rank]):
        raise AssertionError(f"rank {rank}: every rank added a target logit, also for targets outside its "
                             f"shard; only the owner (vocab_start <= target < vocab_start + shard) "
                             f"contributes it, the others add 0 before the all-reduce")
    if near(got, variants["unshifted"][rank]):
        raise AssertionError(f"rank {rank} looked the targets up as columns of its shard as they are: a target "
                             f"id counts from the start of the whole vocabulary, so its column on this rank is "
                             f"targets - vocab_start (yours where 0 <= it < {VOCAB // WORLD})")
    if near(got, variants["own_target"][rank]):
        raise AssertionError(f"rank {rank} did not add the target logits of the tokens the other ranks own: "
                             f"the owner's z_target reaches everyone by an all-reduce (sum) of the target "
                             f"logit, 0 where this rank is not the owner")
    if near(got, variants["own_sum"][rank]):
        raise AssertionError(f"rank {rank} took the log of the sum of exp over its own {VOCAB // WORLD} "
                             f"columns: all-reduce (sum) the sums of exp(z - max) of all the shards before "
                             f"the log")
    if near(got, variants["sum"][rank]):
        raise AssertionError(f"rank {rank} returned the sum over the {TOKENS} tokens ({got:.4f}); "
                             f"F.cross_entropy averages: divide by the number of tokens")
    if abs(got - WORLD * want) <= 1e-4 * abs(want) or abs(got - want / WORLD) <= 1e-4 * abs(want):
        raise AssertionError(f"rank {rank}'s loss is off by a factor of {WORLD} ({got:.4f} vs {want:.4f}): "
                             f"the loss is computed once from the all-reduced sums, not added over ranks")
    rel = abs(got - want) / max(1.0, abs(want))
    if rel <= 2 * BF16_FORMAT.u:
        raise AssertionError(f"rank {rank}'s loss {got:.6f} is {rel:.1e} from F.cross_entropy's {want:.6f}: the size "
                             f"of a 16-bit rounding (fp16's u is {FP16_FORMAT.u:.1e}, bf16's {BF16_FORMAT.u:.1e}), "
                             f"far above what fp32 arithmetic leaves ({_ce_bound():.1e}): a max, a sum of exp or a "
                             f"target logit went through fp16 or bf16; keep the loss's arithmetic and its "
                             f"all-reduces in fp32")
    raise AssertionError(f"rank {rank}'s loss {got:.6f} differs from F.cross_entropy on the whole "
                         f"logits, {want:.6f}: loss = log(sum exp(z - max)) - (z_target - max), "
                         f"averaged over tokens")


def _ce_bound() -> float:
    """What fp32 arithmetic may leave against the float64 reference, relative to max(1, loss): the fp32
    reordering class (testing/tolerance.py; the widest sum here, the vocabulary, is 64 terms)."""
    from ultrascale.testing.tolerance import FP32_REORDER

    return FP32_REORDER.tolerance.loss_rtol


def exercise_2(vocab_parallel_ce):
    """vocab_parallel_ce(logits_shard, targets, vocab_start) on 2 ranks -> the mean cross-entropy."""
    import torch.nn.functional as F

    for seed, shift in ((82, 0.0), (83, 1000.0)):
        calls = []
        results = on_ranks(WORLD, _ce_case, vocab_parallel_ce, seed, shift, timeout=60, calls=calls)
        for rank, made in enumerate(calls):
            _ce_moved_logits(rank, made)
        logits, targets = _ce_tensors(seed, shift)
        want = F.cross_entropy(logits.double(), targets).item()
        variants = _ce_variants(logits, targets)
        for rank, got in enumerate(results):
            assert got is not None, f"rank {rank} returned more than one number: return the mean loss, a scalar"
            if abs(got - want) > _ce_bound() * max(1.0, abs(want)):
                _ce_mistake(rank, got, want, variants, shift)
    # The shards the other way round: rank 0 holds ids n..2n-1 and is told so by vocab_start.
    results = on_ranks(WORLD, _ce_case, vocab_parallel_ce, 84, 0.0, True, timeout=60)
    logits, targets = _ce_tensors(84, 0.0)
    want = F.cross_entropy(logits.double(), targets).item()
    for rank, got in enumerate(results):
        if got is None or abs(got - want) > _ce_bound() * max(1.0, abs(want)):
            raise AssertionError(
                f"with the shards the other way round (rank 0 holding ids {VOCAB // WORLD}..{VOCAB - 1}, "
                f"vocab_start = {VOCAB // WORLD}) rank {rank}'s loss is {'not one number' if got is None else f'{got:.6f}'} where the whole batch's is "
                f"{want:.6f}: take the shard's first id from vocab_start, not from dist.get_rank(); on a dp x tp "
                f"grid the tensor-parallel rank is not the global rank")
