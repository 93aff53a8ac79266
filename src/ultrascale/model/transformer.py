"""A Llama-style decoder, written to know nothing of parallelism.

Each technique transforms this module instead of being written into it:
- pipeline parallelism deletes layers (the blocks live in a ModuleDict keyed by
  their global index, so names and initial weights do not change) and sets
  `embed`, `norm` or `head` to None on stages that do not own them;
- tensor parallelism swaps the nn.Linear / nn.Embedding children for sharded ones
  at the same attribute names;
- recomputation wraps blocks, or the `core_attention` of each block;
- context parallelism swaps `core_attention` for ring attention and passes the
  global `positions` of its sequence shard.

Generation (generate.py) passes a `KVCache`: the keys and values of the positions
already seen, so each new token costs one position's forward, not the whole sequence's.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from ultrascale.model.config import ModelConfig
from ultrascale.model.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden, cfg.norm_eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None):
    """cos and sin of the rotary angles, [max_seq_len, head_dim/2], in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [b, s, heads, d] by the angles of each position
    (cos, sin: [s, d/2])."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None], sin[None, :, None]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


def causal_attention(q, k, v, attn_mask=None, is_causal=True):
    """SDPA over q [b, heads, s, d] and k, v [b, kv_heads, t, d]: causal, or under `attn_mask`.

    GQA: each kv head serves heads/kv_heads query heads. On CUDA, FlashAttention takes grouped
    heads but only fp16/bf16, and the memory-efficient kernel takes fp32 but not grouped heads:
    SDPA would fall back to the math kernel, which keeps the s x s scores of every layer for the
    backward (measured on an H100: smollm-135m in fp32 at 4 x 1024 tokens held 13.5 GiB instead of
    9). There the kv heads are repeated first, so the memory-efficient kernel runs; elsewhere SDPA
    groups the heads itself.
    """
    gqa = k.shape[1] != q.shape[1]
    if gqa and q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        group = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal and attn_mask is None,
                                          enable_gqa=gqa)


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V with a causal mask: the part of attention that
    holds no weights, which selective recomputation recomputes and context
    parallelism replaces with ring attention."""

    def forward(self, q, k, v):
        return causal_attention(q, k, v)


class KVCache:
    """The keys and values of the positions a model has already seen, for incremental decoding.

    Per block (by its key in `model.layers`), K and V [b, kv_heads, max_len, head_dim], allocated
    at the block's first write from the tensors it writes: the cache knows no head counts or dtype,
    so grouped-query attention stores its kv_heads only. `length` positions of every block are
    filled. A forward given the cache writes its s new positions at length..length+s-1 in each
    block, attends over all length+s, and then advances `length` by s (Transformer.forward).
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, layer: str, k, v):
        """Write block `layer`'s new k, v [b, kv_heads, s, d] after the filled positions; all of them so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions, this forward needs {end}")
        if layer not in self.kv:
            shape = (*k.shape[:2], self.max_len, k.shape[3])
            self.kv[layer] = (k.new_empty(shape), v.new_empty(shape))
        ck, cv = self.kv[layer]
        ck[:, :, self.length:end] = k
        cv[:, :, self.length:end] = v
        return ck[:, :, :end], cv[:, :, :end]


def cached_attention(q, k, v):
    """Attention of s new queries over the t >= s keys so far, the last s of them the queries' own:
    query i sees keys 0..t-s+i. (SDPA's is_causal aligns the mask to the top-left corner, which
    is right only when s == t.)"""
    s, t = q.shape[2], k.shape[2]
    if s == t:  # the prompt, into an empty cache: the training forward's call
        return causal_attention(q, k, v)
    if s == 1:  # one new query sees every key: no mask at all
        return causal_attention(q, k, v, is_causal=False)
    return causal_attention(q, k, v, attn_mask=torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.core_attention = CoreAttention()

    def forward(self, x, cos, sin, kv=None):
        """kv: when decoding with a cache, a function that appends this block's new keys and values
        [b, kv_heads, s, d] to it and returns all of them so far (KVCache.extend, bound to the block)."""
        b, s, _ = x.shape
        # The head counts come from the projections' widths, so a tensor-parallel
        # shard of the projections gives a shard of the heads with no change here.
        q = apply_rope(self.q_proj(x).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        # Rotate in [b, s, heads, d] and only then view as [b, heads, s, d] for attention: the
        # output comes back in the same [b, s, heads, d] memory order, and o_proj's input is a
        # view of it instead of a copy kept for backward.
        if kv is None:
            out = self.core_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        else:  # the keys are cached after RoPE: each was rotated once, at its own position
            out = cached_attention(q.transpose(1, 2), *kv(k.transpose(1, 2), v.transpose(1, 2)))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, moe: bool = False):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x, cos, sin, kv=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv)
        # The MLP (or MoE) sees each position on its own: the cache changes nothing for it.
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg, cfg.is_moe_layer(i)) for i in range(cfg.layers)})
        self.norm = make_norm(cfg)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        # Filled by init_weights (or now, off the meta device, where arange would run python kernels).
        for name in ("rope_cos", "rope_sin"):
            self.register_buffer(name, torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        if self.rope_cos.device.type != "meta":
            self._fill_rope()

    @torch.no_grad()
    def _fill_rope(self) -> None:
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens, positions=None, cache: KVCache | None = None):
        """tokens [b, s] (or hidden states [b, s, h] on a pipeline stage without the
        embedding) -> logits [b, s, vocab] (or hidden states on a stage without the head).
        positions: the global positions of the s tokens, 0..s-1 by default.
        cache: the positions seen before these s tokens (incremental decoding): they attend to
        them too, at positions cache.length.. by default, and are added to the cache."""
        x = self.embed(tokens) if self.embed is not None else tokens
        s = tokens.shape[1]  # not x's: sequence parallelism may hand back a shard of the sequence
        if positions is None:
            start = 0 if cache is None else cache.length
            cos, sin = self.rope_cos[start:start + s], self.rope_sin[start:start + s]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if cache is None:
            for block in self.layers.values():
                x = block(x, cos, sin)
        else:
            for name, block in self.layers.items():
                x = block(x, cos, sin, functools.partial(cache.extend, name))
            cache.length += s
        if self.norm is None:
            return x
        x = self.norm(x)
        if self.head is not None:
            return self.head(x)
        # Tied embeddings: the head is the embedding matrix read the other way.
        return F.linear(x, self.embed.weight)

    @torch.no_grad()
    def init_weights(self, seed: int, source=None) -> None:
        """Fill every parameter and buffer deterministically from `seed`, or from `source`.

        Each parameter draws from its own generator, seeded by (seed, its name),
        on the CPU in fp32: the values do not depend on the device, the dtype,
        the order of construction, or which parameters this rank holds. A
        parameter that is a shard of a larger one carries `full_shape` and
        `shard_of_full` (set by the parallel wrappers), and takes its slice of
        the full tensor.

        `source`, a mapping {single-device name: full tensor} (trained weights, e.g.
        `model.hf.hf_weights`, and the router biases of a checkpoint), replaces the random draw: each rank still takes its
        slice of each full tensor the same way, whatever the parallel layout.
        """
        self._fill_rope()
        for name, b in self.named_buffers():
            if name.endswith("router_bias"):  # a trained model's biases come with its weights
                b.copy_(source[name] if source is not None and name in source else torch.zeros_like(b))
        for name, p in self.named_parameters():
            shape = getattr(p, "full_shape", p.shape)
            if source is None:
                full = init_tensor(name, shape, self.cfg, seed)
            else:
                full = source[name]
                if full.shape != shape:
                    raise ValueError(f"{name}: the source holds shape {list(full.shape)}, the model {list(shape)}")
            shard = getattr(p, "shard_of_full", None)
            p.copy_(shard(full) if shard is not None else full)


def init_tensor(name: str, shape, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The initial value of parameter `name` (its name in the single-device model)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias" or (leaf == "weight" and "norm" in name):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down")):
        # Projections that write into the residual stream: scaled so the stream's
        # variance does not grow with depth (GPT-2 / Megatron).
        std = std / math.sqrt(2 * cfg.layers)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=g)


# The random fills modules run on themselves when built (nn.Linear, nn.Embedding).
_DEFAULT_INITS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_",
                  "xavier_uniform_", "xavier_normal_")


@contextlib.contextmanager
def on_meta_without_default_init():
    """The meta device, with the modules' own random initialisation skipped: on meta its values
    are thrown away anyway (init_weights sets each parameter from the seed), and the meta kernels
    of the random fills import torch's compiler stack, a second and more of every process's start."""
    saved = {name: getattr(nn.init, name) for name in _DEFAULT_INITS}
    for name in _DEFAULT_INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build_model(cfg: ModelConfig, seed: int, device="cpu", transform=None, source=None) -> Transformer:
    """Construct on the meta device (no memory), let `transform` reshape it (pipeline
    split, tensor-parallel swaps), then allocate on `device` and initialise from `seed`,
    or from `source` ({single-device name: full tensor}) when given."""
    cfg.validate()
    with on_meta_without_default_init():
        model = Transformer(cfg)
        if transform is not None:
            model = transform(model) or model
    # to_empty makes new Parameter objects: carry what the transforms noted on them
    # (shard descriptions, gradient groups) across.
    notes = {n: dict(p.__dict__) for n, p in model.named_parameters() if p.__dict__}
    model.to_empty(device=device)
    for n, p in model.named_parameters():
        p.__dict__.update(notes.get(n, {}))
    model.init_weights(seed, source)
    return model


def cross_entropy_loss(logits, targets):
    """Mean token cross-entropy, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
