"""The model as the planner sees it: a shape, its parameters, and who holds which.

`ModelShape` is `ultrascale.model.config.ModelConfig` as the planner needs it,
Mixture-of-Experts fields included (experts, top-k, expert FFN width, shared
expert; every block MoE). A dense shape's parameter list is exactly the list of
`Transformer(cfg).named_parameters()`, in registration order, so the planner can
replay the engine's bucketing and ZeRO padding element for element.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

from ultrascale.errors import ConfigError
from ultrascale.model.config import PRESETS, ModelConfig


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    tie_embeddings: bool = False
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    mlp: str = "swiglu"  # swiglu | gelu
    bias: bool = False
    # Mixture of Experts: experts = 0 is a dense model. Every block's MLP becomes
    # `experts` MLPs of width expert_ffn_hidden and a router (h x experts); each
    # token visits top_k of them.
    experts: int = 0
    top_k: int = 1
    expert_ffn_hidden: int = 0  # 0: ffn_hidden
    shared_expert_ffn: int = 0  # an MLP every token visits, beside the routed experts (DeepSeek)
    # Dropout after attention and the MLP (GPT-3, Megatron's GPT); Llama, Mixtral, Qwen, DeepSeek train without.
    dropout: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden or self.ffn_hidden

    def validate(self) -> None:
        for f in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn_hidden"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model {f} must be a positive integer, got {getattr(self, f)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(f"model {self.name}: hidden {self.hidden}, heads {self.heads} and kv heads "
                              f"{self.kv_heads} must divide each other (hidden % heads, heads % kv_heads)")
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise ConfigError(f"model {self.name}: top_k must be within 1..experts, got {self.top_k} of "
                              f"{self.experts}")

    # -- parameters -------------------------------------------------------
    def _mlp_params(self, prefix: str, f: int, tp: int = 1) -> list[tuple[str, int]]:
        h, bias = self.hidden, self.bias
        out = []
        names = ("gate_proj", "up_proj") if self.mlp == "swiglu" else ("up_proj",)
        for n in names:  # column-parallel: output features sharded
            out.append((f"{prefix}.{n}.weight", f // tp * h))
            if bias:
                out.append((f"{prefix}.{n}.bias", f // tp))
        out.append((f"{prefix}.down_proj.weight", h * (f // tp)))  # row-parallel: input features sharded
        if bias:
            out.append((f"{prefix}.down_proj.bias", h))  # replicated, added once after the reduction
        return out

    def _norm(self, prefix: str) -> list[tuple[str, int]]:
        h = self.hidden
        return [(f"{prefix}.weight", h)] + ([(f"{prefix}.bias", h)] if self.norm == "layernorm" else [])

    def block_params(self, i: int, tp: int = 1) -> list[tuple[str, int]]:
        """(name, numel) of block i on one tensor-parallel rank, in the order the engine registers them."""
        h, kv, p = self.hidden, self.kv_dim, f"layers.{i}"
        out = self._norm(f"{p}.attn_norm")
        for n, width in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            out.append((f"{p}.attn.{n}.weight", width // tp * h))
            if self.bias:
                out.append((f"{p}.attn.{n}.bias", width // tp))
        out.append((f"{p}.attn.o_proj.weight", h * (h // tp)))
        if self.bias:
            out.append((f"{p}.attn.o_proj.bias", h))
        out += self._norm(f"{p}.mlp_norm")
        if self.is_moe:
            out.append((f"{p}.mlp.router.weight", self.experts * h))
            for e in range(self.experts):
                out += self._mlp_params(f"{p}.mlp.experts.{e}", self.expert_ffn, tp)
            if self.shared_expert_ffn:
                out += self._mlp_params(f"{p}.mlp.shared", self.shared_expert_ffn, tp)
        else:
            out += self._mlp_params(f"{p}.mlp", self.ffn_hidden, tp)
        return out

    def named_params(self, tp: int = 1) -> list[tuple[str, int]]:
        """Every parameter of one tensor-parallel rank, in `Transformer.named_parameters()` order.
        The vocabulary is padded to a multiple of tp and split by rows (embedding and head)."""
        rows = -(-self.vocab // tp)
        out = [("embed.weight", rows * self.hidden)]
        for i in range(self.layers):
            out += self.block_params(i, tp)
        out += self._norm("norm")
        if not self.tie_embeddings:
            out.append(("head.weight", rows * self.hidden))
        return out

    def count(self) -> int:
        return _count(self)

    # Per-block pieces, for sharding by tp / ep and for FLOPs.
    def attn_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        return 2 * h * h + 2 * h * kv + (2 * h + 2 * kv if self.bias else 0)

    def expert_params(self) -> int:
        """One MLP (dense) or one expert (MoE)."""
        return _expert_params(self)

    def shared_params(self) -> int:
        """The shared expert of an MoE block (0: none)."""
        return sum(n for _, n in self._mlp_params("x", self.shared_expert_ffn)) if self.shared_expert_ffn else 0

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def active_params(self) -> int:
        """Parameters one token multiplies: all of a dense model, top_k of the experts of an MoE."""
        if not self.is_moe:
            return self.count()
        idle = (self.experts - self.top_k) * self.expert_params() * self.layers
        return self.count() - idle


@functools.lru_cache(maxsize=256)
def _count(shape: ModelShape) -> int:
    block = sum(n for _, n in shape.block_params(0))
    outside = shape.vocab * shape.hidden * (1 if shape.tie_embeddings else 2) + shape.norm_params()
    return outside + shape.layers * block


@functools.lru_cache(maxsize=256)
def _expert_params(shape: ModelShape) -> int:
    return sum(n for _, n in shape._mlp_params("x", shape.expert_ffn if shape.is_moe else shape.ffn_hidden))


def from_model_config(cfg: ModelConfig, **moe) -> ModelShape:
    if cfg.is_moe and cfg.moe_every != 1:
        raise ConfigError(f"model {cfg.name}: the planner models every block as MoE, not every {cfg.moe_every}th")
    if cfg.is_moe and not moe:
        moe = dict(experts=cfg.experts, top_k=cfg.top_k, expert_ffn_hidden=cfg.moe_ffn_hidden,
                   shared_expert_ffn=cfg.shared_ffn)
    return ModelShape(name=cfg.name, vocab=cfg.vocab_size, hidden=cfg.hidden, layers=cfg.layers, heads=cfg.heads,
                      kv_heads=cfg.kv_heads, ffn_hidden=cfg.ffn_hidden, tie_embeddings=cfg.tie_embeddings,
                      norm=cfg.norm, mlp=cfg.mlp, bias=cfg.bias, **moe)


# Planner-only shapes (none left: the MoE presets are the engine's, model/config.py).
MOE_PRESETS: dict[str, ModelShape] = {}


# GPT-3-style models of published runs (LayerNorm, a 4h GELU MLP, biases, tied embeddings), for
# planning those runs (plan/published.py). The engine could build them (GPT block) but has no preset
# for them, so they live here. Korthikanti et al. 2022, Table 3 (vocabulary 51,200 padded):
def _gpt(name, h, heads, layers, vocab=51200):
    return ModelShape(name=name, vocab=vocab, hidden=h, layers=layers, heads=heads, kv_heads=heads, ffn_hidden=4 * h,
                      norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True, dropout=True)


PUBLISHED_PRESETS = {name: _gpt(name, h, a, layers) for name, h, a, layers in (
    ("gpt3-175b", 12288, 96, 96), ("megatron-530b", 20480, 128, 105), ("megatron-1t", 25600, 160, 128))}
# Narayanan et al. 2021, Table 1: the weak-scaling GPTs from 1.7B to 1T (hidden, heads, layers).
PUBLISHED_PRESETS.update({name: _gpt(name, h, a, layers) for name, h, a, layers in (
    ("gpt-1.7b", 2304, 24, 24), ("gpt-3.6b", 3072, 32, 30), ("gpt-7.5b", 4096, 32, 36), ("gpt-18b", 6144, 48, 40),
    ("gpt-39b", 8192, 64, 48), ("gpt-76b", 10240, 80, 60), ("gpt-146b", 12288, 96, 80), ("gpt-310b", 16384, 128, 96))})
# BLOOM-176B (BigScience 2022): ALiBi (no position parameters), a 250,880-token vocabulary.
PUBLISHED_PRESETS["bloom-176b"] = _gpt("bloom-176b", 14336, 112, 70, vocab=250880)


def known_models() -> list[str]:
    return list(PRESETS) + list(MOE_PRESETS) + list(PUBLISHED_PRESETS)


def get_shape(name: str, **overrides) -> ModelShape:
    """A preset by name (the engine's presets, then the planner's), with field overrides and what
    follows from them by the preset's rule (plan/overrides.py)."""
    return resolve_shape(name, **overrides).shape


def resolve_shape(name: str, **overrides):
    """`get_shape`, with the account of it: the preset, the fields given, those derived and why."""
    from ultrascale.plan.overrides import resolve

    if name in PRESETS:
        shape = from_model_config(PRESETS[name])
    elif name in MOE_PRESETS:
        shape = MOE_PRESETS[name]
    elif name in PUBLISHED_PRESETS:
        shape = PUBLISHED_PRESETS[name]
    else:
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join(known_models())}")
    known = {f.name for f in fields(ModelShape)} - {"name"}
    bad = {k for k, v in overrides.items() if v is not None} - known
    if bad:
        raise ConfigError(f"unknown model field(s) {', '.join(sorted(bad))}")
    resolved = resolve(shape, name, overrides)
    resolved.shape.validate()
    return resolved
