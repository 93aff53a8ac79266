"""Cases for Part 9: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

from printed import Close

from ultrascale.testing.compare import FP32

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

_ACT = '''
def activation_bytes_per_rank(cfg, b, s, t, sp):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a)
    norms = 2 * (8 * h + 4) / %s
    norm_outputs = 2 * 4 * h / %s
    inside = (4 * (2 * h + 2 * kv) + 4 * a + 16 * f) / %s
    return b * s * (norms + norm_outputs + inside)
'''

# g's forward writes this rank's slice into the gathered buffer and never receives the others'
# (torch.empty in a learner's code: NaN here, the same every run).
_OWN_SLICE_ONLY = (_BLOCK % ("reduce_scatter", "reduce_scatter", "all_gather")).replace(
    "def forward(ctx, x):\n            return all_gather(x)",
    "def forward(ctx, x):\n"
    "            full = torch.full((x.shape[0], t * x.shape[1], x.shape[2]), float('nan'))\n"
    "            mine = slice(dist.get_rank() * x.shape[1], (dist.get_rank() + 1) * x.shape[1])\n"
    "            full[:, mine] = x\n"
    "            return full")

MISTAKES = [
    ("1", "g backward slices", "only holds the part through its own", _BLOCK % ("my_slice", "reduce_scatter",
                                                                             "all_gather")),
    ("1", "g-bar forward slices", "only has its own partial sum", _BLOCK % ("reduce_scatter", "my_slice",
                                                                          "all_gather")),
    ("1", "g-bar backward pads", "not pad it with zeros", _BLOCK % ("reduce_scatter", "reduce_scatter", "zero_pad")),
    ("1", "all-reduce and slice", "called dist.all_reduce", _BLOCK % ("reduce_scatter", "all_reduce_slice",
                                                                    "all_gather")),
    ("1", "no scatter at all", "returned the whole sequence", _BLOCK.replace(
        "return x_shard + ScatterSequence.apply(hidden @ w2_shard.t())",
        "out = hidden @ w2_shard.t(); dist.all_reduce(out); return out") % ("reduce_scatter", "reduce_scatter",
                                                                             "all_gather")),
    ("2", "Megatron's shard-only inputs", "our engine keeps the gathered", _ACT % ("(t if sp else 1)",
                                                                                  "(t if sp else 1)", "t")),
    ("2", "SP forgotten", "Under SP the norms run on the rank's s/t positions", _ACT % ("1", "1", "t")),
    ("2", "everything over t", "leaves the norms and their outputs whole", _ACT % ("t", "t", "t")),
    ("1", "gathers its own slice only", "a NaN or an infinity in rank 0's output", _OWN_SLICE_ONLY),
    # `t * sp` is 0 without SP, not 1: a division by zero, inf in a float tensor.
    ("2", "divided by t * sp", "a NaN or an infinity in your byte count", '''
def activation_bytes_per_rank(cfg, b, s, t, sp):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a)
    per_token = torch.tensor([2 * (8 * h + 4), 2 * 4 * h, 4 * (2 * h + 2 * kv) + 4 * a + 16 * f], dtype=torch.float64)
    split = torch.tensor([t * sp, 1, t])
    return b * s * (per_token / split).sum().item()
'''),
]

PRINTED = [
    "tp = 2 + sp: rank 0 keeps 71,136 bytes for block 0 (b=1, s=24)",
    "    4 x (1, 12, 64)    float32",
    "reduce-scatter + all-gather vs all-reduce: max |difference|",
    Close('one process : losses 5.552306 5.491920, activations 678,420 B', rel=FP32.loss_rtol),
    Close('tp = 2 + sp: losses 5.552305 5.491920, activations 380,928 B per rank', rel=FP32.loss_rtol),
    "b=2, s=32: one block keeps 189,952 B per rank with tp = 2, 156,928 B with tp = 2 + sp: 2968 and 2452 per token",
]
