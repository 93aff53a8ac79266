"""The model as the planner sees it: a shape, its parameters, and who holds which.

`ModelShape` is `ultrascale.model.config.ModelConfig` as the planner needs it,
with what the models of published MoE runs add to it: Mixture-of-Experts fields
(experts, top-k, expert FFN width, shared expert), leading dense blocks
(DeepSeek-V3's first three), a head width that is not hidden / heads and
per-head q/k norms (Qwen3), multi-head latent attention (DeepSeek-V2/V3) and
node-limited routing. Every new field defaults to the plain block, so a shape
of the engine's presets is what it was: a dense shape's parameter list is
exactly the list of `Transformer(cfg).named_parameters()`, in registration
order, so the planner can replay the engine's bucketing and ZeRO padding
element for element.

Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1; V3,
arXiv 2412.19437, section 2.1.1), per block, with heads n, d = head_dim (the
part of a query / key head without RoPE, config.json's qk_nope_head_dim), r =
qk_rope_head_dim, d_v = v_head_dim, c_q = q_lora_rank, c_kv = kv_lora_rank
(names as config.json and Hugging Face's DeepseekV3Attention spell them):

  q_a_proj      h -> c_q             the query latent (replicated under tp)
  q_a_norm      c_q                  RMSNorm of the query latent
  q_b_proj      c_q -> n·(d + r)     queries, per head a part without and one with RoPE
  kv_a_proj     h -> c_kv + r        the key/value latent, and one RoPE key shared by the heads
  kv_a_norm     c_kv
  kv_b_proj     c_kv -> n·(d + d_v)  per head its key part without RoPE and its value
  o_proj        n·d_v -> h

(c_q = 0: one q_proj h -> n·(d + r), as DeepSeek-V2-Lite.) Training runs the
projections as written (no weight absorption, which serves inference), so the
attention core sees n heads of d + r for scores and d_v for values.
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
    # Mixture of Experts: experts = 0 is a dense model. An MoE block's MLP becomes `experts` MLPs of
    # width expert_ffn_hidden and a router (h x experts); each token visits top_k of them.
    experts: int = 0
    top_k: int = 1
    expert_ffn_hidden: int = 0  # 0: ffn_hidden
    shared_expert_ffn: int = 0  # an MLP every token visits, beside the routed experts (DeepSeek)
    # Dropout after attention and the MLP (GPT-3, Megatron's GPT); Llama, Mixtral, Qwen, DeepSeek train without.
    dropout: bool = False
    # Blocks 0 .. dense_layers - 1 keep a dense MLP of width ffn_hidden, the others are MoE
    # (DeepSeek-V3's first_k_dense_replace = 3). 0: every block MoE (or every block dense: experts = 0).
    dense_layers: int = 0
    # Width of an attention head where it is not hidden / heads (config.json's head_dim, Megatron's
    # --kv-channels: Qwen3-30B-A3B's heads are 128 wide on hidden 2048 with 32 heads). With MLA, the
    # part of a query / key head without RoPE (qk_nope_head_dim). 0: hidden / heads.
    kv_channels: int = 0
    qk_norm: bool = False  # an RMSNorm of head_dim on every query and key head before RoPE (Qwen3)
    # Multi-head latent attention when kv_lora_rank > 0 (the module's docstring).
    q_lora_rank: int = 0  # 0: queries projected from the hidden state directly
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0  # 0: head_dim
    # Node-limited routing (DeepSeek-V3, section 2.1.2: n_group = 8, topk_group = 4): the experts form
    # expert_groups groups, and a token's top_k experts lie in at most topk_groups of them. With the
    # groups laid out on the nodes of the expert-parallel group, a token crosses to at most that many
    # nodes (plan/time.py, the expert all-to-all). 0: no limit.
    expert_groups: int = 0
    topk_groups: int = 0

    # -- attention widths (cached: the search reads them millions of times) ---
    @functools.cached_property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @functools.cached_property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @functools.cached_property
    def qk_head_dim(self) -> int:
        """Width of a query / key head as the scores see it (MLA: its part without RoPE and its RoPE part)."""
        return self.head_dim + (self.qk_rope_head_dim if self.is_mla else 0)

    @functools.cached_property
    def v_dim_per_head(self) -> int:
        return self.v_head_dim or self.head_dim

    @functools.cached_property
    def q_dim(self) -> int:
        return self.heads * self.qk_head_dim

    @functools.cached_property
    def k_dim(self) -> int:
        """Width of the keys attention reads per token (MLA decompresses one key per query head)."""
        return (self.heads if self.is_mla else self.kv_heads) * self.qk_head_dim

    @functools.cached_property
    def v_dim(self) -> int:
        return (self.heads if self.is_mla else self.kv_heads) * self.v_dim_per_head

    @functools.cached_property
    def kv_dim(self) -> int:
        """The mean of the key and value widths: K and V together are 2·kv_dim per token."""
        return (self.k_dim + self.v_dim) // 2

    @functools.cached_property
    def attn_out_dim(self) -> int:
        """Width of the attention core's output, o_proj's input."""
        return self.heads * self.v_dim_per_head

    def attn_core_flops(self, seq_len: int) -> float:
        """Training FLOPs per token per block of the attention core: every query against seq_len keys,
        scores (2·s·n·d_qk) and values (2·s·n·d_v) forward, twice that backward. The playbook's
        12·h·s where d_qk = d_v = h / heads."""
        return 6 * seq_len * self.heads * (self.qk_head_dim + self.v_dim_per_head)

    # -- blocks ---------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden or self.ffn_hidden

    def is_moe_block(self, i: int) -> bool:
        return self.is_moe and i >= self.dense_layers

    @property
    def moe_layers(self) -> int:
        return max(0, self.layers - self.dense_layers) if self.is_moe else 0

    def validate(self) -> None:
        for f in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn_hidden"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model {f} must be a positive integer, got {getattr(self, f)}")
        for f in ("dense_layers", "kv_channels", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                  "expert_groups", "topk_groups", "expert_ffn_hidden", "shared_expert_ffn"):
            if getattr(self, f) < 0:
                raise ConfigError(f"model {self.name}: {f} must be 0 or positive, got {getattr(self, f)}")
        if (not self.kv_channels and self.hidden % self.heads) or self.heads % self.kv_heads:
            raise ConfigError(f"model {self.name}: hidden {self.hidden}, heads {self.heads} and kv heads "
                              f"{self.kv_heads} must divide each other (hidden % heads, heads % kv_heads)")
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise ConfigError(f"model {self.name}: top_k must be within 1..experts, got {self.top_k} of "
                              f"{self.experts}")
        if self.dense_layers > self.layers:
            raise ConfigError(f"model {self.name}: {self.dense_layers} dense blocks of {self.layers}: "
                              f"dense_layers must be at most the layers")
        if self.is_mla and self.bias:
            raise ConfigError(f"model {self.name}: multi-head latent attention is planned without biases")
        if self.expert_groups and (self.experts % self.expert_groups
                                   or not 1 <= self.topk_groups <= self.expert_groups):
            raise ConfigError(f"model {self.name}: expert_groups {self.expert_groups} must divide the "
                              f"{self.experts} experts and topk_groups {self.topk_groups} lie within 1..groups")

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

    def _attn_params(self, p: str, tp: int = 1) -> list[tuple[str, int]]:
        """(name, numel) of one block's attention on one tensor-parallel rank: heads are split, the
        latents of MLA (small, and read by every head) are replicated, as Megatron-Core's MLA runs them."""
        h = self.hidden
        if self.is_mla:
            heads, rope, c_q, c_kv = self.heads // tp, self.qk_rope_head_dim, self.q_lora_rank, self.kv_lora_rank
            out = []
            if c_q:
                out += [(f"{p}.q_a_proj.weight", c_q * h), (f"{p}.q_a_norm.weight", c_q),
                        (f"{p}.q_b_proj.weight", heads * self.qk_head_dim * c_q)]
            else:
                out.append((f"{p}.q_proj.weight", heads * self.qk_head_dim * h))
            return out + [(f"{p}.kv_a_proj.weight", (c_kv + rope) * h), (f"{p}.kv_a_norm.weight", c_kv),
                          (f"{p}.kv_b_proj.weight", heads * (self.head_dim + self.v_dim_per_head) * c_kv),
                          (f"{p}.o_proj.weight", h * heads * self.v_dim_per_head)]
        out = []
        for n, width in (("q_proj", self.q_dim), ("k_proj", self.k_dim), ("v_proj", self.v_dim)):
            out.append((f"{p}.{n}.weight", width // tp * h))
            if self.bias:
                out.append((f"{p}.{n}.bias", width // tp))
        out.append((f"{p}.o_proj.weight", h * (self.attn_out_dim // tp)))
        if self.bias:
            out.append((f"{p}.o_proj.bias", h))
        if self.qk_norm:  # one weight of head_dim shared by the heads, replicated
            out += [(f"{p}.q_norm.weight", self.head_dim), (f"{p}.k_norm.weight", self.head_dim)]
        return out

    def _moe_params(self, p: str, tp: int = 1) -> list[tuple[str, int]]:
        out = [(f"{p}.router.weight", self.experts * self.hidden)]
        for e in range(self.experts):
            out += self._mlp_params(f"{p}.experts.{e}", self.expert_ffn, tp)
        if self.shared_expert_ffn:
            out += self._mlp_params(f"{p}.shared", self.shared_expert_ffn, tp)
        return out

    def block_params(self, i: int, tp: int = 1) -> list[tuple[str, int]]:
        """(name, numel) of block i on one tensor-parallel rank, in the order the engine registers them."""
        p = f"layers.{i}"
        out = self._norm(f"{p}.attn_norm") + self._attn_params(f"{p}.attn", tp) + self._norm(f"{p}.mlp_norm")
        if self.is_moe_block(i):
            return out + self._moe_params(f"{p}.mlp", tp)
        return out + self._mlp_params(f"{p}.mlp", self.ffn_hidden, tp)

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
    def attn_params(self, tp: int = 1) -> int:
        """One block's attention on one tensor-parallel rank (tp = 1: the whole of it)."""
        return _attn_count(self, tp)

    def mlp_params(self, tp: int = 1) -> int:
        """The dense MLP of width ffn_hidden (a dense model's, or an MoE model's leading dense blocks)."""
        return _mlp_count(self, self.ffn_hidden, tp)

    def expert_params(self, tp: int = 1) -> int:
        """One MLP (dense) or one expert (MoE)."""
        return _expert_params(self, tp)

    def shared_params(self, tp: int = 1) -> int:
        """The shared expert of an MoE block (0: none)."""
        return _mlp_count(self, self.shared_expert_ffn, tp) if self.shared_expert_ffn else 0

    def router_params(self) -> int:
        return self.experts * self.hidden

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def embedding_params(self) -> int:
        """The embedding, and the head unless tied."""
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def block_active_params(self, moe: bool) -> int:
        """Parameters one token multiplies in one block: a dense block's, or an MoE block's with top_k
        experts (the router and the shared expert too)."""
        return _block_active(self, moe)

    def _block_active(self, moe: bool) -> int:
        common = self.attn_params() + 2 * self.norm_params()
        if not moe:
            return common + self.mlp_params()
        return common + self.router_params() + self.shared_params() + self.top_k * self.expert_params()

    def active_params(self) -> int:
        """Parameters one token multiplies: all of a dense model, top_k of the experts of an MoE."""
        if not self.is_moe:
            return self.count()
        idle = (self.experts - self.top_k) * self.expert_params() * self.moe_layers
        return self.count() - idle

    def params_words(self) -> str:
        """'8,030,261,248 parameters', and for a Mixture of Experts how many of them one token multiplies."""
        words = f"{self.count():,} parameters"
        return words + (f", {self.active_params():,} active per token" if self.is_moe else "")


@functools.lru_cache(maxsize=256)
def _count(shape: ModelShape) -> int:
    dense = sum(n for _, n in shape.block_params(0)) if shape.moe_layers < shape.layers else 0
    moe = sum(n for _, n in shape.block_params(shape.layers - 1)) if shape.moe_layers else 0
    blocks = (shape.layers - shape.moe_layers) * dense + shape.moe_layers * moe
    return shape.embedding_params() + shape.norm_params() + blocks


@functools.lru_cache(maxsize=1024)
def _mlp_count(shape: ModelShape, f: int, tp: int) -> int:
    return sum(n for _, n in shape._mlp_params("x", f, tp))


@functools.lru_cache(maxsize=512)
def _block_active(shape: ModelShape, moe: bool) -> int:
    return shape._block_active(moe)


@functools.lru_cache(maxsize=256)
def _attn_count(shape: ModelShape, tp: int) -> int:
    return sum(n for _, n in shape._attn_params("x", tp))


@functools.lru_cache(maxsize=256)
def _expert_params(shape: ModelShape, tp: int = 1) -> int:
    return sum(n for _, n in shape._mlp_params("x", shape.expert_ffn if shape.is_moe else shape.ffn_hidden, tp))


def from_model_config(cfg: ModelConfig, **moe) -> ModelShape:
    if cfg.is_moe and cfg.moe_every != 1:
        raise ConfigError(f"model {cfg.name}: the planner models every block as MoE, not every {cfg.moe_every}th")
    if cfg.is_moe and not moe:
        moe = dict(experts=cfg.experts, top_k=cfg.top_k, expert_ffn_hidden=cfg.moe_ffn_hidden,
                   shared_expert_ffn=cfg.shared_ffn)
    return ModelShape(name=cfg.name, vocab=cfg.vocab_size, hidden=cfg.hidden, layers=cfg.layers, heads=cfg.heads,
                      kv_heads=cfg.kv_heads, ffn_hidden=cfg.ffn_hidden, tie_embeddings=cfg.tie_embeddings,
                      norm=cfg.norm, mlp=cfg.mlp, bias=cfg.bias, **moe)


# Planner-only shapes: MoE models as they were trained, field for field from their config.json. They take
# the names of the engine's presets of the same models (model/config.py), which approximate them in what the
# engine builds (GQA for MLA, every block MoE, heads of hidden / heads): `ultrascale plan --model deepseek-v3`
# plans DeepSeek-V3 itself, `ultrascale train --model deepseek-v3` builds the engine's approximation.
MOE_PRESETS: dict[str, ModelShape] = {
    # DeepSeek-V3 (arXiv 2412.19437, section 2; huggingface.co/deepseek-ai/DeepSeek-V3, config.json):
    # MLA with q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128,
    # 128 heads; first_k_dense_replace 3 dense blocks of intermediate_size 18432; then 256 routed experts of
    # moe_intermediate_size 2048, top-8, one shared expert of 2048; n_group 8, topk_group 4; untied.
    # 671B parameters, 37B active per token (the report's abstract; 36.6B without the input embedding, the
    # model card's README_WEIGHTS.md). The multi-token-prediction module (14B with its shared embedding and
    # head, outside the 671B) is not planned.
    "deepseek-v3": ModelShape(
        name="deepseek-v3", vocab=129280, hidden=7168, layers=61, heads=128, kv_heads=128, ffn_hidden=18432,
        experts=256, top_k=8, expert_ffn_hidden=2048, shared_expert_ffn=2048, dense_layers=3,
        kv_channels=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
        expert_groups=8, topk_groups=4),
    # Qwen3-30B-A3B (huggingface.co/Qwen/Qwen3-30B-A3B, config.json): 48 blocks, hidden 2048, 32 query heads
    # and 4 key/value heads of head_dim 128 with q/k RMSNorms, 128 experts of moe_intermediate_size 768, top-8,
    # every block MoE (mlp_only_layers []), no shared expert, untied. 30.5B parameters, 3.3B active (its
    # model card).
    "qwen3-30b-a3b": ModelShape(
        name="qwen3-30b-a3b", vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, ffn_hidden=6144,
        experts=128, top_k=8, expert_ffn_hidden=768, kv_channels=128, qk_norm=True),
}


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
    return list(dict.fromkeys(list(PRESETS) + list(MOE_PRESETS) + list(PUBLISHED_PRESETS)))


def get_shape(name: str, **overrides) -> ModelShape:
    """A preset by name (the planner's MoE shapes first: they are the trained models the engine's presets
    of the same names approximate; then the engine's, then the published GPTs), with field overrides and
    what follows from them by the preset's rule (plan/overrides.py)."""
    return resolve_shape(name, **overrides).shape


def resolve_shape(name: str, **overrides):
    """`get_shape`, with the account of it: the preset, the fields given, those derived and why."""
    from ultrascale.plan.overrides import resolve

    if name in MOE_PRESETS:
        shape = MOE_PRESETS[name]
    elif name in PRESETS:
        shape = from_model_config(PRESETS[name])
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
