"""Part 9's answers: the all-gather / reduce-scatter pair (g and g-bar) around a 2-rank MLP, and
one block's activation bytes per rank under TP and TP+SP."""
from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 9

# Exercise 1's block with its helpers; the holes are g's backward, g-bar's forward and g-bar's backward.
_BLOCK = '''
def sp_block(x_shard, w1_shard, w2_shard):
    t = dist.get_world_size()

    def all_gather(x):
        parts = [torch.empty_like(x) for _ in range(t)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    def reduce_scatter(x):
        out = torch.empty_like(x.chunk(t, dim=1)[0]).contiguous()
        dist.reduce_scatter(out, [c.contiguous() for c in x.chunk(t, dim=1)])
        return out

    def my_slice(x):
        return x.chunk(t, dim=1)[dist.get_rank()].contiguous()

    def zero_pad(x):
        parts = [torch.zeros_like(x) for _ in range(t)]
        parts[dist.get_rank()] = x
        return torch.cat(parts, dim=1)

    def all_reduce_slice(x):
        x = x.contiguous().clone()
        dist.all_reduce(x)
        return my_slice(x)

    def gather_and_sum(x):
        parts = [torch.empty_like(x) for _ in range(t)]
        dist.all_gather(parts, x.contiguous())
        return my_slice(torch.stack(parts).sum(dim=0))

    def averaged(x):
        return reduce_scatter(x) / t

    class GatherSequence(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return all_gather(x)

        @staticmethod
        def backward(ctx, grad):
            return %s(grad)

    class ScatterSequence(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            return %s(partial)

        @staticmethod
        def backward(ctx, grad):
            return %s(grad)

    normed = F.rms_norm(x_shard, (x_shard.shape[-1],))
    hidden = F.gelu(GatherSequence.apply(normed) @ w1_shard.t())
    return x_shard + ScatterSequence.apply(hidden @ w2_shard.t())
'''


def _block(g_backward="reduce_scatter", gbar_forward="reduce_scatter", gbar_backward="all_gather"):
    return _BLOCK % (g_backward, gbar_forward, gbar_backward)


def _block_gathering(forward):
    """The right block but for g's forward, whose body is `forward`."""
    return _block().replace("def forward(ctx, x):\n            return all_gather(x)",
                            "def forward(ctx, x):\n" + forward)


# g's forward writes this rank's slice into the gathered buffer and never receives the others'
# (torch.empty in a learner's code: NaN here, the same every run).
_OWN_SLICE_ONLY = _block_gathering(
    "            full = torch.full((x.shape[0], t * x.shape[1], x.shape[2]), float('nan'))\n"
    "            mine = slice(dist.get_rank() * x.shape[1], (dist.get_rank() + 1) * x.shape[1])\n"
    "            full[:, mine] = x\n"
    "            return full")

# Exercise 2: per token, the norms, the norm outputs and the inside of the region, each over a divisor.
_ACT = '''
def activation_bytes_per_rank(cfg, b, s, t, sp):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a)
    norms = 2 * (8 * h + 4) / %s
    norm_outputs = 2 * 4 * h / %s
    inside = (4 * (2 * h + 2 * kv) + 4 * a + 16 * f) / %s
    return b * s * (norms + norm_outputs + inside)
'''


def _act(norms="(t if sp else 1)", norm_outputs="1", inside="t"):
    return _ACT % (norms, norm_outputs, inside)


_TENSOR_FORMS = '''
def sp_block(x_shard, w1_shard, w2_shard):
    t = dist.get_world_size()

    def all_gather(x):
        b, m, h = x.shape
        out = x.new_empty(t * b, m, h)
        dist.all_gather_into_tensor(out, x.contiguous())
        return out.view(t, b, m, h).permute(1, 0, 2, 3).reshape(b, t * m, h)

    def reduce_scatter(x):
        b, s, h = x.shape
        stacked = x.reshape(b, t, s // t, h).permute(1, 0, 2, 3).contiguous()
        out = x.new_empty(b, s // t, h)
        dist.reduce_scatter_tensor(out, stacked.view(t * b, s // t, h))
        return out

    class GatherSequence(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return all_gather(x)

        @staticmethod
        def backward(ctx, grad):
            return reduce_scatter(grad)

    class ScatterSequence(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            return reduce_scatter(partial)

        @staticmethod
        def backward(ctx, grad):
            return all_gather(grad)

    normed = F.rms_norm(x_shard, (x_shard.shape[-1],))
    hidden = F.gelu(GatherSequence.apply(normed) @ w1_shard.t())
    return x_shard + ScatterSequence.apply(hidden @ w2_shard.t())
'''

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "g backward slices", "only holds the part through its own", _block(g_backward="my_slice")),
    (1, "g-bar forward slices", "only has its own partial sum", _block(gbar_forward="my_slice")),
    (1, "g-bar backward pads", "not pad it with zeros", _block(gbar_backward="zero_pad")),
    (1, "all-reduce and slice in g-bar", "all_reduce and a slice move twice",
     _block(gbar_forward="all_reduce_slice")),
    (1, "all-reduce and slice in g's backward", "all_reduce and a slice move twice",
     _block(g_backward="all_reduce_slice")),
    (1, "no scatter at all", "returned the whole sequence", _block().replace(
        "return x_shard + ScatterSequence.apply(hidden @ w2_shard.t())",
        "out = hidden @ w2_shard.t(); dist.all_reduce(out); return out")),
    (1, "gathers its own slice only", "a NaN or an infinity in rank 0's output", _OWN_SLICE_ONLY),
    # The right values, through an all-gather of the whole [b, s, h] partial outputs: t of them on
    # every rank, where the reduce-scatter leaves each rank [b, s/t, h].
    (1, "g-bar as an all-gather and a local sum", "all-gathered the whole", _block(gbar_forward="gather_and_sum")),
    (1, "gathers along the hidden dim", "along dim 1, the sequence", _block().replace(
        "return torch.cat(parts, dim=1)", "return torch.cat(parts, dim=-1)")),
    # torch.cat's default dim, 0, the batch: g's output is [t*b, s/t, h], g-bar scatters along the sequence.
    (1, "gathers along the batch", "along dim 1, the sequence", _block().replace(
        "return torch.cat(parts, dim=1)", "return torch.cat(parts)")),
    # The same wrong layout undone on the way out: the values are right (each token alone), the sequence
    # attention would read is not.
    (1, "all_gather_into_tensor viewed as [b, s, h] without the transpose", "positions out of order",
     _TENSOR_FORMS.replace("out.view(t, b, m, h).permute(1, 0, 2, 3).reshape(b, t * m, h)", "out.view(b, t * m, h)")
     .replace("stacked = x.reshape(b, t, s // t, h).permute(1, 0, 2, 3).contiguous()", "stacked = x.contiguous()")),
    (1, "gathers and scatters along the batch", "along the batch dimension",
     _block().replace("torch.cat(parts, dim=1)", "torch.cat(parts, dim=0)").replace("x.chunk(t, dim=1)", "x.chunk(t, dim=0)")),
    (1, "gathers in reverse rank order", "in rank order", _block().replace(
        "return torch.cat(parts, dim=1)", "return torch.cat(parts[::-1], dim=1)")),
    (1, "g-bar forward averages", "the reduce-scatter sums", _block(gbar_forward="averaged")),
    (1, "g backward averages", "the reduce-scatter sums", _block(g_backward="averaged")),
    # g's backward reduce-scatters on rank 0 only: rank 1 returns, rank 0 waits for it.
    (1, "only rank 0 reduce-scatters in g's backward", "deadlock on 2 ranks", _block().replace(
        "        def backward(ctx, grad):\n            return reduce_scatter(grad)",
        "        def backward(ctx, grad):\n"
        "            if dist.get_rank() == 0:\n                return reduce_scatter(grad)\n"
        "            return my_slice(grad)")),

    (2, "Megatron's shard-only inputs", "our engine keeps the gathered", _act(norm_outputs="(t if sp else 1)")),
    (2, "SP forgotten", "Under SP the norms run on the rank's s/t positions", _act(norms="1")),
    (2, "everything over t", "leaves the norms and their outputs whole", _act(norms="t", norm_outputs="t")),
    (2, "the inside not divided", "Inside the region each rank holds a/t heads", _act(inside="1")),
    (2, "the norm outputs over t under TP", "every rank needs the whole", _act(norm_outputs="t")),
    # `t * sp` is 0 without SP, not 1: a division by zero, inf in a float tensor.
    (2, "divided by t * sp", "a NaN or an infinity in your byte count", '''
def activation_bytes_per_rank(cfg, b, s, t, sp):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a)
    per_token = torch.tensor([2 * (8 * h + 4), 2 * 4 * h, 4 * (2 * h + 2 * kv) + 4 * a + 16 * f], dtype=torch.float64)
    split = torch.tensor([t * sp, 1, t])
    return b * s * (per_token / split).sum().item()
'''),
    (2, "bf16 bytes", "off by a factor of 2", '''
def activation_bytes_per_rank(cfg, b, s, t, sp):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a)
    norms = 2 * (4 * h + 2) / (t if sp else 1)
    norm_outputs = 2 * 2 * h
    inside = (2 * (2 * h + 2 * kv) + 2 * a + 8 * f) / t
    return b * s * (norms + norm_outputs + inside)
'''),
    # A 2 where t belongs: right on 2 ranks, and on 1 where t = 1 divides nothing anyway.
    (2, "2 written for t", "write t where you wrote 2",
     _act(norms="(2 if sp and t > 1 else 1)", inside="(2 if t > 1 else 1)")),
    (2, "k and v as wide as q", "key/value heads of", _act().replace("kv = cfg.kv_heads * (h // a)", "kv = h")),
    (2, "no logsumexp", "forgot the fp32 logsumexp", _act().replace(" + 4 * a + ", " + ")),
    (2, "bytes per token", "multiply by b * s", _act().replace("return b * s * (", "return (")),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    # The tensor forms of the collectives: all_gather_into_tensor stacks along dim 0, so the ranks' chunks
    # are moved to the sequence dim by hand, and back before reduce_scatter_tensor.
    (1, "all_gather_into_tensor and reduce_scatter_tensor", _TENSOR_FORMS),
    (1, "async collectives on the world group, split and stack", '''
def sp_block(x_shard, w1_shard, w2_shard):
    t, group = dist.get_world_size(), dist.group.WORLD

    def all_gather(x):
        parts = [torch.zeros_like(x) for _ in range(t)]
        dist.all_gather(parts, x.contiguous(), group=group, async_op=True).wait()
        return torch.stack(parts, dim=1).flatten(1, 2)

    def reduce_scatter(x):
        chunks = [c.contiguous() for c in torch.split(x, x.shape[1] // t, dim=1)]
        out = torch.zeros_like(chunks[0])
        dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group, async_op=True).wait()
        return out

    class GatherSequence(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return all_gather(x)

        @staticmethod
        def backward(ctx, grad):
            return reduce_scatter(grad)

    class ScatterSequence(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            return reduce_scatter(partial)

        @staticmethod
        def backward(ctx, grad):
            return all_gather(grad)

    normed = F.rms_norm(x_shard, (x_shard.shape[-1],))
    hidden = F.gelu(F.linear(GatherSequence.apply(normed), w1_shard))
    return ScatterSequence.apply(F.linear(hidden, w2_shard)) + x_shard
'''),
    (2, "integers, tensor by tensor", '''
def activation_bytes_per_rank(cfg, b, s, t, sp):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a)
    tokens = b * s
    norm = tokens * (4 * h + 4 + 4 * h) // (t if sp else 1)      # fp32 input and x * rstd, rstd
    norm_output = tokens * 4 * h                                  # gathered: whole on every rank
    q, k, v, attn_out = (tokens * 4 * width // t for width in (h, kv, kv, h))
    logsumexp = tokens * 4 * a // t
    mlp = 4 * tokens * 4 * f // t                                 # gate, up, their product's inputs
    return 2 * norm + 2 * norm_output + q + k + v + attn_out + logsumexp + mlp
'''),
    # What one process keeps, less what each rank gives away to the others.
    (2, "the whole block less what the split saves", '''
def activation_bytes_per_rank(cfg, b, s, t, sp):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a)
    norms, norm_outputs, inside = 2 * (8 * h + 4), 8 * h, 4 * (2 * h + 2 * kv) + 4 * a + 16 * f
    whole = norms + norm_outputs + inside
    saved = inside * (1 - 1 / t) + (norms * (1 - 1 / t) if sp else 0)
    return b * s * (whole - saved)
'''),
]
