"""Cases for Part 8: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

_F = '''
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
'''
_REDUCE = "out = partial.contiguous().clone(); dist.all_reduce(out); return out"
_REDUCE_GRAD = "grad = grad.contiguous().clone(); dist.all_reduce(grad); return grad"


def _mlp(f_backward, g_forward, g_backward):
    return ("def tp_mlp(x, w1_shard, w2_shard):" + _F % (f_backward, g_forward, g_backward) + '''
    hidden = F.gelu(EnterRegion.apply(x) @ w1_shard.t())
    return LeaveRegion.apply(hidden @ w2_shard.t())
''')


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

MISTAKES = [
    ("1", "f backward is the identity", "only holds the part that flows through its own",
     _mlp("return grad", _REDUCE, "return grad")),
    ("1", "g forward does not reduce", "only its own partial sum", _mlp(_REDUCE_GRAD, "return partial.view_as(partial)",
                                                                       "return grad")),
    ("1", "g backward all-reduces too", "gradients are 2.000x the single-process ones",
     _mlp(_REDUCE_GRAD, _REDUCE, _REDUCE_GRAD)),
    ("1", "f backward averages", "sums the partial gradients, it does not average",
     _mlp("grad = grad.contiguous().clone(); dist.all_reduce(grad); return grad / dist.get_world_size()",
          _REDUCE, "return grad")),
    # all_reduce taken for a collective with a receive buffer: it reduces a fresh torch.empty_like
    # (NaN here, the same every run) in place, and the partial sums never travel.
    ("1", "g forward reduces a fresh buffer", "a NaN or an infinity in rank 0's output",
     _mlp(_REDUCE_GRAD, "out = torch.full_like(partial, float('nan')); dist.all_reduce(out); return out",
          "return grad")),
    ("2", "local max", "each rank shifted its logits by its own max", _CE % ("", " * mine", "mean")),
    ("2", "no mask on the target", "only the owner", _CE % (_MAX, "", "mean")),
    ("2", "sum over tokens", "F.cross_entropy averages", _CE % (_MAX, " * mine", "sum")),
    ("2", "no max at all", "exp overflows", '''
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
    ("2", "-inf for the targets of other shards", "a NaN or an infinity in rank 0's loss", '''
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
    ("2", "gathers the logits", "never to move the", '''
def vocab_parallel_ce(logits, targets, vocab_start):
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits.contiguous())
    return F.cross_entropy(torch.cat(parts, dim=-1), targets)
'''),
]

PRINTED = [
    "rank 0: column-then-row, one all-reduce: max |error|",
    "params      one process   427,776 B   tp = 2, per rank   214,784 B   (0.502x)",
    "layers.0.attn.q_proj.weight      rank 0 (32, 64)    rank 1 (32, 64)",
    "all-reduces of a [b, s, h] activation (16,384 B) per step on rank 0: 10 = 4 x 2 blocks + 2 (4L + 2 = 10)",
]
