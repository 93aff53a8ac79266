"""Model shapes: the dataclass, the presets, and the parameter count.

A shape is pure configuration: building a 405B preset here costs nothing, which
is what the planner needs. Only `tiny` and `small` are meant to be instantiated
on a laptop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace


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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


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
    "1b": _playbook("1b", 2048, 16, 32, 8192, tied=True),
    "3b": _playbook("3b", 3072, 28, 32, 8192, tied=True),
    "8b": _playbook("8b", 4096, 32, 32, 14336, tied=False),
    "80b": _playbook("80b", 8192, 80, 64, 28672, tied=False),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    from ultrascale.errors import ConfigError

    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(cfg, **overrides) if overrides else cfg


def count_params(cfg: ModelConfig) -> int:
    """Number of parameters of the module `Transformer(cfg)` builds, from the shape alone.

    Attention: q and o are h x h; k and v are h x (kv_heads * head_dim).
    MLP: SwiGLU has three h x f matrices (gate, up, down); GELU has two.
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
    return embed + L * (attn + mlp + 2 * norm) + norm


def playbook_param_formula(h: int, v: int, L: int) -> int:
    """The playbook's count for a multi-head, 4h-MLP GPT block with biases and LayerNorm:
    N = h·v + L·(12h² + 13h) + 2h (tied embeddings, no position embeddings)."""
    return h * v + L * (12 * h * h + 13 * h) + 2 * h


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token as the playbook counts them: 6N + 12·L·h·s.

    6N: forward (2N) and backward (4N) of every weight; 12·L·h·s: the attention
    scores and values (QK^T and AV), forward and backward. N is the total count,
    embeddings included, which is what reproduces the MFU column of the
    playbook's own benchmark (8B: 7141 tok/s/GPU -> 43.0%).
    """
    return 6 * count_params(cfg) + 12 * cfg.layers * cfg.hidden * seq_len
