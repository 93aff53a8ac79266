"""Part 8's answers: the tensor-parallel MLP with f and g, and the vocabulary-parallel cross-entropy, on 2 ranks."""
from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 8

# The MLP of exercise 1 with f and g filled in: f's backward, g's forward, g's backward.
_MLP = '''
def tp_mlp(x, w1_shard, w2_shard):
    class EnterRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            %s

    class LeaveRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            %s

        @staticmethod
        def backward(ctx, grad):
            %s

    hidden = F.gelu(EnterRegion.apply(x) @ w1_shard.t())
    return LeaveRegion.apply(hidden @ w2_shard.t())
'''
_REDUCE = "out = partial.contiguous().clone(); dist.all_reduce(out); return out"
_REDUCE_GRAD = "grad = grad.contiguous().clone(); dist.all_reduce(grad); return grad"
_PASS = "return grad"


def _mlp(f_backward, g_forward, g_backward):
    return _MLP % (f_backward, g_forward, g_backward)


# Exercise 2's loss with three holes: the max's all-reduce, the target's mask, the reduction over tokens.
_CE = '''
def vocab_parallel_ce(logits, targets, vocab_start):
    n = logits.shape[-1]
    zmax = logits.max(dim=-1).values
    %s
    z = logits - zmax.unsqueeze(-1)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp)
    local = targets - vocab_start
    mine = (local >= 0) & (local < n)
    z_target = z.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1)%s
    dist.all_reduce(z_target)
    return (sum_exp.log() - z_target).%s()
'''
_MAX = "dist.all_reduce(zmax, op=dist.ReduceOp.MAX)"


def _ce_without(line, instead):
    """The right loss with one line changed."""
    return (_CE % (_MAX, " * mine", "mean")).replace(line, instead)

WRONG = [  # (exercise, label, what the check must say, answer source)
    # The sizes of the notebook's example written in: right there, a size error on another shape.
    (1, "the hidden features flattened to the notebook's 6 x 8", "take every size from the tensors",
     _mlp(_REDUCE_GRAD, _REDUCE, _PASS).replace(
         "    hidden = F.gelu(EnterRegion.apply(x) @ w1_shard.t())",
         "    hidden = F.gelu(EnterRegion.apply(x).reshape(6, 8) @ w1_shard.t()).reshape(2, 3, -1)")),
    (1, "f backward is the identity", "only holds the part that flows through its own",
     _mlp(_PASS, _REDUCE, _PASS)),
    (1, "g forward does not reduce", "only its own partial sum",
     _mlp(_REDUCE_GRAD, "return partial.view_as(partial)", _PASS)),
    (1, "g backward all-reduces too", "gradients are 2.000x the single-process ones",
     _mlp(_REDUCE_GRAD, _REDUCE, _REDUCE_GRAD)),
    (1, "f backward averages", "it does not average them",
     _mlp("grad = grad.contiguous().clone(); dist.all_reduce(grad); return grad / dist.get_world_size()",
          _REDUCE, _PASS)),
    (1, "g forward averages", "g sums the partial outputs (no average",
     _mlp(_REDUCE_GRAD, "out = partial.contiguous().clone(); dist.all_reduce(out, op=dist.ReduceOp.AVG); "
          "return out", _PASS)),
    # all_reduce taken for a collective with a receive buffer: it reduces a fresh buffer (NaN here,
    # the same every run, where torch.empty_like would hold whatever memory held) and the partial
    # sums never travel.
    (1, "g forward reduces a fresh buffer", "a NaN or an infinity in rank 0's output",
     _mlp(_REDUCE_GRAD, "out = torch.full_like(partial, float('nan')); dist.all_reduce(out); return out", _PASS)),
    (1, "f forward all-reduces x too", "the MLP of 2x its input", '''
def tp_mlp(x, w1_shard, w2_shard):
    class EnterRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.contiguous().clone()
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
            return grad

    class LeaveRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            out = partial.contiguous().clone()
            dist.all_reduce(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad

    hidden = F.gelu(EnterRegion.apply(x) @ w1_shard.t())
    return LeaveRegion.apply(hidden @ w2_shard.t())
'''),
    # The right numbers with a second all-reduce in forward: f "synchronises" x, then undoes the sum.
    (1, "f forward all-reduces x and divides it back", "2 all-reduces in forward", '''
def tp_mlp(x, w1_shard, w2_shard):
    class EnterRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.contiguous().clone()
            dist.all_reduce(x)  # make sure every rank has the same x
            return x / dist.get_world_size()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
            return grad

    class LeaveRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            out = partial.contiguous().clone()
            dist.all_reduce(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad

    hidden = F.gelu(EnterRegion.apply(x) @ w1_shard.t())
    return LeaveRegion.apply(hidden @ w2_shard.t())
'''),
    # The right numbers and gradients with no tensor parallelism at all: every rank holds the whole
    # weights (the other ranks' shards gathered, its own kept in the graph) and runs the whole MLP.
    (1, "gathers the whole weights", "gathered the weights", '''
def tp_mlp(x, w1_shard, w2_shard):
    t, rank = dist.get_world_size(), dist.get_rank()
    w1_parts = [torch.empty_like(w1_shard) for _ in range(t)]
    w2_parts = [torch.empty_like(w2_shard) for _ in range(t)]
    dist.all_gather(w1_parts, w1_shard.detach().contiguous())
    dist.all_gather(w2_parts, w2_shard.detach().contiguous())
    w1_parts[rank], w2_parts[rank] = w1_shard, w2_shard
    w1, w2 = torch.cat(w1_parts, dim=0), torch.cat(w2_parts, dim=1)
    return F.gelu(x @ w1.t()) @ w2.t()
'''),
    # g's sum done by hand: every rank receives every partial output, t copies of [b, s, h].
    (1, "g as an all-gather and a local sum", "g's forward all-gathered", _mlp(
        _REDUCE_GRAD,
        "parts = [torch.empty_like(partial) for _ in range(dist.get_world_size())]\n"
        "            dist.all_gather(parts, partial.contiguous())\n"
        "            return torch.stack(parts).sum(dim=0)", _PASS)),
    (1, "weights used as [in, out]", "stored as nn.Linear does", '''
def tp_mlp(x, w1_shard, w2_shard):
    class EnterRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
            return grad

    class LeaveRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            out = partial.contiguous().clone()
            dist.all_reduce(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad

    hidden = F.gelu(EnterRegion.apply(x) @ w1_shard)
    return LeaveRegion.apply(hidden @ w2_shard)
'''),
    # x split like a row-parallel input: but the column-parallel layer needs the whole x.
    (1, "f splits x by rank", "x is whole on every rank", '''
def tp_mlp(x, w1_shard, w2_shard):
    t, rank = dist.get_world_size(), dist.get_rank()

    class EnterRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.chunk(t, dim=-1)[rank]

        @staticmethod
        def backward(ctx, grad):
            parts = [torch.empty_like(grad) for _ in range(t)]
            dist.all_gather(parts, grad.contiguous())
            return torch.cat(parts, dim=-1)

    class LeaveRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            out = partial.contiguous().clone()
            dist.all_reduce(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad

    hidden = F.gelu(EnterRegion.apply(x) @ w1_shard.t())
    return LeaveRegion.apply(hidden @ w2_shard.t())
'''),
    # Only rank 0 sums: rank 1's forward all-reduce is never matched.
    (1, "only rank 0 all-reduces in g", "deadlock on 2 ranks",
     _mlp(_REDUCE_GRAD, "out = partial.contiguous().clone()\n"
          "            if dist.get_rank() == 0:\n"
          "                dist.all_reduce(out)\n"
          "            return out", _PASS)),

    (2, "local max", "each rank shifted its logits by its own max", _CE % ("", " * mine", "mean")),
    (2, "no mask on the target", "only the owner", _CE % (_MAX, "", "mean")),
    (2, "owner test includes the next shard's first id", "off by one at a shard's edge (local <= n",
     (_CE % (_MAX, " * mine", "mean")).replace("(local < n)", "(local <= n)")),
    (2, "owner test leaves out the shard's first id", "off by one at a shard's edge (local > 0",
     (_CE % (_MAX, " * mine", "mean")).replace("(local >= 0)", "(local > 0)")),
    (2, "sum over tokens", "F.cross_entropy averages", _CE % (_MAX, " * mine", "sum")),
    (2, "the sums of exp in fp16", "the size of a 16-bit rounding", _ce_without(
        "sum_exp = z.exp().sum(dim=-1)", "sum_exp = z.exp().half().sum(dim=-1)")),
    (2, "the sums of exp all-reduced in bf16", "the size of a 16-bit rounding", _ce_without(
        "dist.all_reduce(sum_exp)", "sum_exp = sum_exp.bfloat16(); dist.all_reduce(sum_exp); sum_exp = sum_exp.float()")),
    (2, "no max at all", "exp overflows", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    n = logits.shape[-1]
    sum_exp = logits.exp().sum(dim=-1)
    dist.all_reduce(sum_exp)
    local = targets - vocab_start
    mine = (local >= 0) & (local < n)
    z_target = logits.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(z_target)
    return (sum_exp.log() - z_target).mean()
'''),
    (2, "-inf for the targets of other shards", "a NaN or an infinity in rank 0's loss", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    n = logits.shape[-1]
    zmax = logits.max(dim=-1).values
    dist.all_reduce(zmax, op=dist.ReduceOp.MAX)
    z = logits - zmax.unsqueeze(-1)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp)
    local = targets - vocab_start
    mine = (local >= 0) & (local < n)
    z_target = z.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1)
    z_target[~mine] = float("-inf")  # not this shard's target: masked out
    dist.all_reduce(z_target)
    return (sum_exp.log() - z_target).mean()
'''),
    (2, "gathers the logits", "never to move the", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits.contiguous())
    return F.cross_entropy(torch.cat(parts, dim=-1), targets)
'''),
    # The whole logits on every rank by an all-reduce of zero-padded shards: only all-reduces, the right
    # loss, and exactly the [tokens, vocab] memory the lesson saves.
    (2, "all-reduces the zero-padded logits", "that is the whole [tokens, vocab] logits", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    n = logits.shape[-1]
    full = torch.zeros(logits.shape[0], n * dist.get_world_size())
    full[:, vocab_start:vocab_start + n] = logits
    dist.all_reduce(full)
    return F.cross_entropy(full, targets)
'''),
    (2, "sends the shard to rank 0", "never to move the", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    t = dist.get_world_size()
    loss = torch.zeros(())
    if dist.get_rank() == 0:
        parts = [logits] + [torch.empty_like(logits) for _ in range(t - 1)]
        for r in range(1, t):
            dist.recv(parts[r], src=r)
        loss = F.cross_entropy(torch.cat(parts, dim=-1), targets)
    else:
        dist.send(logits.contiguous(), dst=0)
    dist.broadcast(loss, src=0)
    return loss
'''),
    (2, "the target logit stays on its owner", "add the target logits of the tokens",
     _ce_without("    dist.all_reduce(z_target)\n", "")),
    (2, "the sum of exp stays on its shard", "the sum of exp over its own",
     _ce_without("    dist.all_reduce(sum_exp)\n", "")),
    (2, "target not shifted by vocab_start", "targets - vocab_start",
     _ce_without("local = targets - vocab_start", "local = targets")),
    (2, "the loss summed over the ranks", "off by a factor of 2", _ce_without(
        "    return (sum_exp.log() - z_target).mean()",
        "    loss = (sum_exp.log() - z_target).mean()\n    dist.all_reduce(loss)\n    return loss")),
    # The shard's first id from the global rank, vocab_start unread: right only while the two agree.
    (2, "vocab_start ignored: rank * n", "take the shard's first id from vocab_start", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    """Mean cross-entropy from this rank's vocabulary shard of the logits."""
    n = logits.shape[-1]
    zmax = logits.max(dim=-1).values
    dist.all_reduce(zmax, op=dist.ReduceOp.MAX)
    z = logits - zmax.unsqueeze(-1)
    sum_exp = z.exp().sum(dim=-1)
    dist.all_reduce(sum_exp)
    local = targets - dist.get_rank() * n       # assumes rank r owns columns r*n ... (r+1)*n-1
    mine = (local >= 0) & (local < n)
    z_target = z.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(z_target)
    return (sum_exp.log() - z_target).mean()
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "f and g with the functional all-reduce", '''
def tp_mlp(x, w1_shard, w2_shard):
    import torch.distributed._functional_collectives as funcol

    class EnterRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return funcol.all_reduce(grad.contiguous(), "sum", dist.group.WORLD).wait()

    class LeaveRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            return funcol.all_reduce(partial.contiguous(), "sum", dist.group.WORLD).wait()

        @staticmethod
        def backward(ctx, grad):
            return grad

    hidden = F.gelu(EnterRegion.apply(x) @ w1_shard.t())
    return LeaveRegion.apply(hidden @ w2_shard.t())
'''),
    (1, "async all-reduces, F.linear and a clone for f", '''
def tp_mlp(x, w1_shard, w2_shard):
    def summed(t):
        t = t.contiguous().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True).wait()
        return t

    class EnterRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return summed(grad)

    class LeaveRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            return summed(partial)

        @staticmethod
        def backward(ctx, grad):
            return grad.clone()

    return LeaveRegion.apply(F.linear(F.gelu(F.linear(EnterRegion.apply(x), w1_shard)), w2_shard))
'''),
    (1, "one class factory for the conjugate pair, einsum", '''
def tp_mlp(x, w1_shard, w2_shard):
    def region(reduce_forward):
        def reduce(t):
            t = t.contiguous().clone()
            dist.all_reduce(t, group=dist.group.WORLD)
            return t

        class Region(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return reduce(t) if reduce_forward else t.view_as(t)

            @staticmethod
            def backward(ctx, grad):
                return grad if reduce_forward else reduce(grad)
        return Region

    f, g = region(False), region(True)
    hidden = F.gelu(torch.einsum("bsh,fh->bsf", f.apply(x), w1_shard))
    return g.apply(torch.einsum("bsf,hf->bsh", hidden, w2_shard))
'''),
    (2, "the sum of exp and the target logit in one all-reduce", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    n = logits.shape[-1]
    zmax = logits.max(dim=-1).values
    dist.all_reduce(zmax, op=dist.ReduceOp.MAX)
    z = logits - zmax[:, None]
    local = targets - vocab_start
    mine = (local >= 0) & (local < n)
    picked = z.gather(1, local.clamp(0, n - 1)[:, None])[:, 0]
    both = torch.stack([z.exp().sum(-1), torch.where(mine, picked, torch.zeros_like(picked))])
    dist.all_reduce(both)
    return (both[0].log() - both[1]).mean()
'''),
    # Each rank's own log-sum-exp (stable by its own max), then the per-token numbers of all ranks
    # gathered and combined: [tokens] values move, never logits.
    (2, "per-shard log-sum-exp, gathered per token", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    n = logits.shape[-1]
    lse = torch.logsumexp(logits, dim=-1)
    parts = [torch.empty_like(lse) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, lse)
    total = torch.logsumexp(torch.stack(parts), dim=0)
    local = targets - vocab_start
    mine = (local >= 0) & (local < n)
    z_target = torch.where(mine, logits.gather(1, local.clamp(0, n - 1)[:, None])[:, 0], 0.0)
    dist.all_reduce(z_target)
    return (total - z_target).mean()
'''),
    (2, "the max added back instead of shifting the target", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    n = logits.shape[-1]
    zmax = logits.max(dim=-1).values
    dist.all_reduce(zmax, op=dist.ReduceOp.MAX)
    sum_exp = (logits - zmax[:, None]).exp().sum(-1)
    dist.all_reduce(sum_exp)
    z_target = torch.zeros_like(zmax)
    for i, target in enumerate(targets.tolist()):
        if vocab_start <= target < vocab_start + n:
            z_target[i] = logits[i, target - vocab_start]
    dist.all_reduce(z_target)
    return (sum_exp.log() + zmax - z_target).mean()
'''),
]
