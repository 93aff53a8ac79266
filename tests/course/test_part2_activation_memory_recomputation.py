"""Part 2's answers: the bytes one block of our model keeps for backward, from its shape, and selective
recomputation of the attention core with torch.utils.checkpoint (both measured on the engine's model)."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 2

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "norms in the compute dtype", "computes in fp32 whatever the model's dtype", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    norm = dtype_bytes * 2 * h + 4
    return b * s * (2 * norm + dtype_bytes * (4 * h + 2 * kv + 4 * f) + 4 * a)
'''),
    (1, "no logsumexp", "the SDPA logsumexp is missing", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    return b * s * (2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 4 * f))
'''),
    (1, "the logsumexp in the compute dtype", "the logsumexp is fp32 whatever the model's dtype", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    return b * s * (2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 4 * f + a))
'''),
    (1, "the s x s scores counted", "keeps no s x s score matrix", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    return b * s * (2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 4 * f + a * s) + 4 * a)
'''),
    (1, "k and v as wide as q", "not h (grouped-query attention)", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    return b * s * (2 * (8 * h + 4) + dtype_bytes * (6 * h + 4 * f) + 4 * a)
'''),
    (1, "three SwiGLU tensors", "SwiGLU keeps four f-wide tensors", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    return b * s * (2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 3 * f) + 4 * a)
'''),
    (1, "the norms' rstd forgotten", "each RMSNorm also keeps rstd", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    norm = 4 * h + 4 * h                                  # fp32 input and x*rstd
    return b * s * (2 * norm + dtype_bytes * (4 * h + 2 * kv + 4 * f) + 4 * a)
'''),
    (1, "the attention output forgotten", "the attention output (the input of o_proj)", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    attention = dtype_bytes * (h + h + 2 * kv) + 4 * a   # norm output, q, k, v; fp32 logsumexp
    mlp = dtype_bytes * (h + 4 * f)
    return b * s * (2 * (8 * h + 4) + attention + mlp)
'''),
    (1, "per token, not times b·s", "that is the count per token", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    return 2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 4 * f) + 4 * a
'''),
    (1, "Korthikanti's formula", "Korthikanti's sbh(34 + 5as/h)", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    return s * b * cfg.hidden * 34    # flash attention: the 5as/h term is gone
'''),
    (1, "measures the block", "measures a block (", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    dtype = torch.float32 if dtype_bytes == 4 else torch.bfloat16
    model = build_model(cfg, seed=0).to(dtype)
    meter = ActivationMeter(list(model.parameters()) + list(model.buffers()))
    x = torch.randn(b, s, cfg.hidden, dtype=dtype, requires_grad=True)
    with meter.forward():
        model.layers["0"](x, model.rope_cos[:s], model.rope_sin[:s])
    return meter.take_peak()
'''),
    (1, "the logsumexp left as NaN", "a NaN or an infinity in your bytes for tiny", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    lse = float("nan")  # TODO: what does flash attention keep per head?
    return b * s * (2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 4 * f) + lse)
'''),

    (2, "the whole block checkpointed", "that is full recomputation", '''
def recompute_attention_core(model):
    for block in model.layers.values():
        plain = block.forward
        block.forward = lambda x, cos, sin, plain=plain: checkpoint(plain, x, cos, sin, use_reentrant=False)
'''),
    (2, "the whole attention checkpointed", "you recompute more than the attention core.", '''
def recompute_attention_core(model):
    for block in model.layers.values():
        attn = block.attn
        plain = attn.forward   # projections, RoPE and the core together
        attn.forward = lambda x, cos, sin, kv=None, plain=plain: checkpoint(plain, x, cos, sin, use_reentrant=False)
'''),
    (2, "the MLP checkpointed instead", "the attention core ran only in forward", '''
def recompute_attention_core(model):
    for block in model.layers.values():
        plain = block.mlp.forward
        block.mlp.forward = lambda x, plain=plain: checkpoint(plain, x, use_reentrant=False)
'''),
    (2, "only the first block", "1 of 3 blocks recompute their attention core", '''
def recompute_attention_core(model):
    core = model.layers["0"].attn.core_attention
    plain = core.forward
    core.forward = lambda q, k, v, plain=plain: checkpoint(plain, q, k, v, use_reentrant=False)
'''),
    (2, "forward under no_grad", "gets no gradient", '''
def recompute_attention_core(model):
    for block in model.layers.values():
        core = block.attn.core_attention
        plain = core.forward

        def forward(q, k, v, plain=plain):
            with torch.no_grad():
                return plain(q, k, v)
        core.forward = forward
'''),
    (2, "the wrapper built but never installed", "nothing was recomputed", '''
def recompute_attention_core(model):
    for block in model.layers.values():
        core = block.attn.core_attention
        wrapped = lambda q, k, v, plain=core.forward: checkpoint(plain, q, k, v, use_reentrant=False)
'''),
    (2, "inputs detached", "gets no gradient", '''
def recompute_attention_core(model):
    for block in model.layers.values():
        core = block.attn.core_attention
        plain = core.forward
        core.forward = lambda q, k, v, plain=plain: checkpoint(plain, q.detach(), k.detach(), v.detach(),
                                                               use_reentrant=False)
'''),
    (2, "the new forward checkpoints itself", "recursed without end", '''
def recompute_attention_core(model):
    for block in model.layers.values():
        core = block.attn.core_attention
        core.forward = lambda q, k, v, core=core: checkpoint(core.forward, q, k, v, use_reentrant=False)
'''),
    (2, "the engine's own recomputation", "calls the engine's own recomputation (apply_recompute)", '''
from ultrascale.train.recompute import apply_recompute

def recompute_attention_core(model):
    apply_recompute(model, "selective")
'''),
    (2, "causal mask multiplied by -inf", "a NaN or an infinity in the loss of the model with your recomputation", '''
def recompute_attention_core(model):
    def attention(q, k, v):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        causal = torch.ones(q.shape[2], q.shape[2]).tril()
        scores = scores * causal + (1 - causal) * float("-inf")  # 0 * -inf is NaN
        return scores.softmax(-1) @ v

    for block in model.layers.values():
        block.attn.core_attention.forward = lambda q, k, v: checkpoint(attention, q, k, v, use_reentrant=False)
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "tensor by tensor, from the listing", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * cfg.head_dim
    fp32 = {"norm input": h, "rstd": 1, "x*rstd": h}          # per norm, per token
    compute = {"attn norm out": h, "q": h, "k": kv, "v": kv, "attn out": h,
               "mlp norm out": h, "gate": f, "up": f, "silu(gate)": f, "silu(gate)*up": f}
    per_token = 2 * 4 * sum(fp32.values()) + dtype_bytes * sum(compute.values()) + 4 * a   # + fp32 logsumexp
    return per_token * b * s
'''),
    (1, "in floats, bf16 as half of fp32", '''
def block_activation_bytes(cfg, b, s, dtype_bytes):
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden / cfg.heads)
    tokens = float(b * s)
    fp32_part = 4.0 * (2 * (2 * h + 1) + a)                    # norms and logsumexp: fp32 always
    model_part = 4.0 * (4 * h + 2 * kv + 4 * f) * (dtype_bytes / 4)
    return tokens * (fp32_part + model_part)
'''),

    (2, "use_reentrant=True", '''
def recompute_attention_core(model):
    for block in model.layers.values():
        core = block.attn.core_attention
        plain = core.forward
        core.forward = lambda q, k, v, plain=plain: checkpoint(plain, q, k, v, use_reentrant=True)
'''),
    (2, "a wrapping module put in the core's place", '''
class Recomputed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, q, k, v):
        return checkpoint(self.inner, q, k, v, use_reentrant=False)


def recompute_attention_core(model):
    for block in model.layers.values():
        block.attn.core_attention = Recomputed(block.attn.core_attention)
'''),
    (2, "functools.partial, the class's forward", '''
import functools

def recompute_attention_core(model):
    for block in model.layers.values():
        core = block.attn.core_attention
        unbound = type(core).forward
        core.forward = functools.partial(checkpoint, functools.partial(unbound, core), use_reentrant=False)
'''),
]
