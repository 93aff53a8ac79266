"""Model shapes: the dataclass, the presets, and the parameter count.

A shape is pure configuration: building a 405B preset here costs nothing, which
is what the planner needs. Only `tiny` and `small` are meant to be instantiated
on a laptop.
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer shape.

    The default family is Llama (RMSNorm, RoPE, GQA, SwiGLU, no biases). The
    `norm`, `mlp` and `bias` switches also express the GPT-style block the
    playbook uses for its parameter formula (LayerNorm, 4h GELU MLP, biases).
    """

    name: str = "custom"
    vocab_size: int = 257
    hidden: int = 64
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    ffn_hidden: int = 128
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    mlp: str = "swiglu"  # swiglu | gelu
    bias: bool = False
    init_std: float = 0.02
    # Mixture of Experts (model/moe.py). experts = 0 is a dense model; otherwise every
    # moe_every-th block (blocks moe_every-1, 2*moe_every-1, ...) replaces its MLP by
    # `experts` SwiGLU experts of width moe_ffn_hidden, of which each token visits top_k.
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    moe_ffn_hidden: int = 0  # 0: ffn_hidden
    shared_expert: int = 0  # width of an expert every token visits (0: none; True: moe_ffn_hidden)
    router_score: str = "softmax"  # softmax | sigmoid
    router_renorm: bool = True  # rescale the top-k scores to sum to 1
    capacity_factor: float = 0.0  # 0: dropless; F: each expert takes ceil(F * tokens * k / E) per micro-batch
    aux_loss_coef: float = 0.0  # Switch Transformer load-balancing loss
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE)
    router_bias_rate: float = 0.0  # aux-loss-free balancing (DeepSeek-V3): bias update per step

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def shared_ffn(self) -> int:
        """Width of the shared expert (0: none); `shared_expert = True` means moe_ffn_hidden."""
        if self.shared_expert is True:
            return self.expert_ffn
        return int(self.shared_expert or 0)

    def is_moe_layer(self, i: int) -> bool:
        return self.experts > 0 and (i + 1) % self.moe_every == 0

    def validate(self) -> None:
        from ultrascale.errors import ConfigError

        for f in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model {f} must be positive, got {getattr(self, f)}")
        if self.hidden % self.heads:
            raise ConfigError(
                f"hidden size {self.hidden} is not divisible by {self.heads} heads: pick heads that divide it"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"{self.heads} query heads are not divisible by {self.kv_heads} key/value heads (GQA groups must be whole)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head dimension {self.head_dim} must be even for RoPE")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ConfigError(f"model norm must be rmsnorm or layernorm, got {self.norm!r}")
        if self.mlp not in ("swiglu", "gelu"):
            raise ConfigError(f"model mlp must be swiglu or gelu, got {self.mlp!r}")
        if self.experts < 0:
            raise ConfigError(f"--experts must be 0 (dense) or positive, got {self.experts}")
        # The routing settings are checked on a dense model too: a wrong value is wrong before it is used.
        if self.top_k < 1 or self.moe_every < 1 or self.moe_ffn_hidden < 0 or self.shared_ffn < 0:
            raise ConfigError(f"--top-k and moe_every must be positive, --moe-ffn-hidden and shared_expert >= 0; got "
                              f"{self.top_k}, {self.moe_every}, {self.moe_ffn_hidden} and {self.shared_ffn}")
        if self.router_score not in ("softmax", "sigmoid"):
            raise ConfigError(f"--router-score must be softmax or sigmoid, got {self.router_score!r}")
        if not math.isfinite(self.capacity_factor) or self.capacity_factor < 0:
            raise ConfigError(f"--capacity-factor must be 0 (dropless) or positive, got {self.capacity_factor}")
        coefs = (self.aux_loss_coef, self.z_loss_coef, self.router_bias_rate)
        if not all(math.isfinite(c) and c >= 0 for c in coefs):
            raise ConfigError(f"--aux-loss-coef, z_loss_coef and --router-bias-rate must be finite and >= 0, "
                              f"got {', '.join(map(str, coefs))}")
        if not self.experts:
            return
        if self.top_k > self.experts:
            raise ConfigError(f"--top-k {self.top_k} must be within 1..{self.experts} (the number of experts)")
        if self.mlp != "swiglu":
            raise ConfigError("experts are SwiGLU MLPs: use mlp = swiglu with --experts")

    def to_dict(self) -> dict:
        return asdict(self)


def _llama3(name, hidden, layers, heads, ffn, kv_heads=8):
    return ModelConfig(
        name=name, vocab_size=128256, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        ffn_hidden=ffn, max_seq_len=8192, rope_theta=500000.0,
    )


def _playbook(name, hidden, layers, heads, ffn, tied):
    # The shapes of the playbook's benchmark runs (../data/playbook_benchmarks.csv): multi-head attention.
    return ModelConfig(
        name=name, vocab_size=131072, hidden=hidden, layers=layers, heads=heads, kv_heads=heads,
        ffn_hidden=ffn, max_seq_len=4096, rope_theta=500000.0, tie_embeddings=tied,
    )


PRESETS: dict[str, ModelConfig] = {
    # Tests: GQA (8 query heads over 4 kv heads), a vocabulary of 256 bytes + EOS that
    # does not divide by 2 or 4, so vocabulary padding is always exercised.
    "tiny": ModelConfig(name="tiny", vocab_size=257, hidden=64, layers=2, heads=8, kv_heads=4,
                        ffn_hidden=128, max_seq_len=256),
    # The CPU demo: a few million parameters, loss visibly falls in a minute.
    "small": ModelConfig(name="small", vocab_size=257, hidden=256, layers=4, heads=8, kv_heads=4,
                         ffn_hidden=704, max_seq_len=512),
    "smollm-135m": ModelConfig(name="smollm-135m", vocab_size=49152, hidden=576, layers=30, heads=9,
                               kv_heads=3, ffn_hidden=1536, max_seq_len=2048, tie_embeddings=True),
    "smollm-1.7b": ModelConfig(name="smollm-1.7b", vocab_size=49152, hidden=2048, layers=24, heads=32,
                               kv_heads=32, ffn_hidden=8192, max_seq_len=2048, tie_embeddings=True),
    "llama3-8b": _llama3("llama3-8b", 4096, 32, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 8192, 80, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 16384, 126, 128, 53248),
    # Tests and the demo: `tiny` with 8 SwiGLU experts of width 64 in every block, top-2.
    "tiny-moe": ModelConfig(name="tiny-moe", vocab_size=257, hidden=64, layers=2, heads=8, kv_heads=4,
                            ffn_hidden=128, max_seq_len=256, experts=8, top_k=2, moe_ffn_hidden=64,
                            aux_loss_coef=0.01),
    # Configuration only (the planner, counts). Mixtral 8x7B: 8 experts, top-2, every block.
    "mixtral-8x7b": ModelConfig(name="mixtral-8x7b", vocab_size=32000, hidden=4096, layers=32, heads=32,
                                kv_heads=8, ffn_hidden=14336, max_seq_len=32768, rope_theta=1e6,
                                experts=8, top_k=2, aux_loss_coef=0.02),
    # Qwen3-30B-A3B: 128 experts of width 768, top-8, every block, no shared expert
    # (its attention's 128-wide heads with q/k norms are approximated by hidden / heads).
    "qwen3-30b-a3b": ModelConfig(name="qwen3-30b-a3b", vocab_size=151936, hidden=2048, layers=48, heads=32,
                                 kv_heads=4, ffn_hidden=6144, max_seq_len=32768, rope_theta=1e6,
                                 experts=128, top_k=8, moe_ffn_hidden=768, aux_loss_coef=0.001),
    # DeepSeek-V3, its MoE part: 256 routed experts of width 2048, top-8, one shared expert,
    # sigmoid scores renormalised, aux-loss-free bias balancing. Approximations: MLA is
    # replaced by GQA with 128 query and 128 kv heads of hidden / heads, and the first
    # three dense blocks by moe_every = 1 (every block MoE); no multi-token prediction.
    "deepseek-v3": ModelConfig(name="deepseek-v3", vocab_size=129280, hidden=7168, layers=61, heads=128,
                               kv_heads=128, ffn_hidden=18432, max_seq_len=4096, experts=256, top_k=8,
                               moe_ffn_hidden=2048, shared_expert=2048, router_score="sigmoid",
                               router_bias_rate=0.001, aux_loss_coef=0.0001),
    "1b": _playbook("1b", 2048, 16, 32, 8192, tied=True),
    "3b": _playbook("3b", 3072, 28, 32, 8192, tied=True),
    "8b": _playbook("8b", 4096, 32, 32, 14336, tied=False),
    "80b": _playbook("80b", 8192, 80, 64, 28672, tied=False),
}


# What each preset is for, said where a user looks (`ultrascale train --help`, the README).
PRESET_USES = {
    "tiny": "tests and the course: trains in seconds on a CPU",
    "small": "the CPU demo (make demo): the loss falls visibly in a minute",
    "tiny-moe": "tests and the course: tiny with 8 experts, top-2",
    "smollm-135m": "SmolLM's shape: a real small model (loads with --init-from)",
    "smollm-1.7b": "SmolLM's shape, for a GPU",
    "qwen3-30b-a3b": "Qwen3-30B-A3B's MoE, heads of hidden/heads (`plan` takes its exact shape: 30.5B)",
    "deepseek-v3": "DeepSeek-V3's MoE, MLA as GQA, every block MoE (`plan` takes its exact shape: 671B)",
    "1b": "the playbook's benchmark shape (the planner)",
    "3b": "the playbook's benchmark shape (the planner)",
    "8b": "the playbook's benchmark shape (the planner)",
    "80b": "the playbook's benchmark shape (the planner)",
}


def presets_table() -> str:
    """The presets as a plain-text table: shape, parameters, what each is for."""
    rows = [("preset", "layers", "hidden", "heads/kv", "experts", "params", "for")]
    for name, c in PRESETS.items():
        n = count_params(c)
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
        use = PRESET_USES.get(name, "the planner (ultrascale plan); trains on GPUs")
        rows.append((name, str(c.layers), str(c.hidden), f"{c.heads}/{c.kv_heads}",
                     f"{c.experts} top-{c.top_k}" if c.experts else "-", size, use))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def get_preset(name: str, **overrides) -> ModelConfig:
    from ultrascale.errors import ConfigError

    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(cfg, **overrides) if overrides else cfg


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Number of parameters of the module `Transformer(cfg)` builds, from the shape alone.

    Attention: q and o are h x h; k and v are h x (kv_heads * head_dim).
    MLP: SwiGLU has three h x f matrices (gate, up, down); GELU has two.
    MoE block: a router (h x E), E experts of three h x f_e matrices, a shared
    expert of three h x f_s; active=True counts only top_k of the E experts
    (what one token's forward uses).
    Norms: RMSNorm has a weight, LayerNorm a weight and a bias.
    """
    h, f, L, v = cfg.hidden, cfg.ffn_hidden, cfg.layers, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    b = 1 if cfg.bias else 0
    attn = 2 * h * h + 2 * h * kv + b * (h + 2 * kv + h)
    if cfg.mlp == "swiglu":
        mlp = 3 * h * f + b * (2 * f + h)
    else:
        mlp = 2 * h * f + b * (f + h)
    norm = 2 * h if cfg.norm == "layernorm" else h
    embed = v * h * (1 if cfg.tie_embeddings else 2)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    moe = 0
    if n_moe:
        used = cfg.top_k if active else cfg.experts
        moe = h * cfg.experts + used * 3 * h * cfg.expert_ffn + 3 * h * cfg.shared_ffn
    return embed + L * (attn + 2 * norm) + (L - n_moe) * mlp + n_moe * moe + norm


def count_active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses: all of them, less the experts it does not visit."""
    return count_params(cfg, active=True)


def playbook_param_formula(h: int, v: int, L: int) -> int:
    """The playbook's count for a multi-head, 4h-MLP GPT block with biases and LayerNorm:
    N = h·v + L·(12h² + 13h) + 2h (tied embeddings, no position embeddings)."""
    return h * v + L * (12 * h * h + 13 * h) + 2 * h


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token as the playbook counts them: 6N + 12·L·h·s.

    6N: forward (2N) and backward (4N) of every weight; 12·L·h·s: the attention
    scores and values (QK^T and AV), forward and backward. N is the total count,
    embeddings included, which is what reproduces the MFU column of the
    playbook's own benchmark (8B: 7141 tok/s/GPU -> 43.0%). For an MoE model N is
    the active count: a token's FLOPs go through top_k experts, not all of them.
    """
    return 6 * count_active_params(cfg) + 12 * cfg.layers * cfg.hidden * seq_len
