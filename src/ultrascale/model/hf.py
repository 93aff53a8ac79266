"""Hugging Face interop: our Llama-style model <-> transformers' `LlamaForCausalLM`.

The two models compute the same function: RMSNorm, RoPE in the rotate-half
convention, GQA, SwiGLU, no biases. So a checkpoint crosses over by renaming
its tensors, with no permutation:

    ours                             transformers
    embed.weight                     model.embed_tokens.weight
    layers.{i}.attn_norm.weight      model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.q_proj.weight    model.layers.{i}.self_attn.q_proj.weight   (k, v, o alike)
    layers.{i}.mlp_norm.weight       model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.up_proj.weight    model.layers.{i}.mlp.up_proj.weight        (gate, down alike)
    norm.weight                      model.norm.weight
    head.weight                      lm_head.weight       (absent with tied embeddings)

The weights are read and written as safetensors directly (one file, or the shards
of `model.safetensors.index.json`), never by instantiating the transformers model:
a reader takes one tensor at a time. Nothing here knows about parallelism; a
tensor-parallel rank gets its slice of each full tensor from `build_model(...,
source=...)` as it would from the random initialisation.

Importing this module costs nothing: torch, safetensors and transformers load
when a function needs them (the CLI reads config.json before any of them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import replace

from ultrascale.errors import ConfigError, no_room, no_room_error
from ultrascale.model.config import ModelConfig

# (our name, transformers' name); {i} is the layer index.
NAMES = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
]
_TO_HF = dict(NAMES)
_TO_OURS = {hf: ours for ours, hf in NAMES}

# Our ModelConfig field -> the config.json key that holds it (for messages, and the mapping below).
HF_KEYS = {
    "vocab_size": "vocab_size", "hidden": "hidden_size", "layers": "num_hidden_layers",
    "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size",
    "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings", "init_std": "initializer_range",
}

# LlamaConfig's own defaults: a config.json may leave out a value equal to them.
LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
}

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
# Files of a tokenizer directory that travel with an export (not its config.json or weights).
TOKENIZER_FILES = re.compile(r"(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|"
                             r"merges\.txt|chat_template\.(jinja|json)|.*\.model)")


def _translate(name: str, table: dict, layer_prefix: str) -> str:
    m = re.fullmatch(rf"({re.escape(layer_prefix)})(\d+)(\..+)", name)
    key, i = (m.group(1) + "{i}" + m.group(3), m.group(2)) if m else (name, None)
    if key not in table:
        raise KeyError(name)
    return table[key].format(i=i)


def hf_name(name: str) -> str:
    """Our parameter name -> the LlamaForCausalLM one (KeyError for a name with no counterpart)."""
    return _translate(name, _TO_HF, "layers.")


def our_name(name: str) -> str:
    """A LlamaForCausalLM parameter name -> ours (KeyError for a name with no counterpart).
    `lm_head.weight` maps to `head.weight`; a tied model has neither (see `from_hf_state`)."""
    return _translate(name, _TO_OURS, "model.layers.")


# -- configs -------------------------------------------------------------------------------
def _transformers_dtype_key() -> str:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def to_hf_config(cfg: ModelConfig, dtype=None, **extra):
    """The `transformers.LlamaConfig` of a model of this shape; `extra` goes to LlamaConfig as is
    (attn_implementation, use_cache, ...). GPT-style switches have no Llama counterpart: refused."""
    from transformers import LlamaConfig

    gpt = [f"{k}={v}" for k, v, llama in (("norm", cfg.norm, "rmsnorm"), ("mlp", cfg.mlp, "swiglu"),
                                          ("bias", cfg.bias, False)) if v != llama]
    if gpt:
        raise ConfigError(f"model {cfg.name} has {', '.join(gpt)}: the GPT-style block has no LlamaForCausalLM "
                          f"counterpart; only the Llama block (rmsnorm, swiglu, no bias) converts")
    cfg.validate()
    if dtype is not None:
        extra.setdefault(_transformers_dtype_key(), dtype)
    if cfg.is_moe:
        return _mixtral_config(cfg, **extra)
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, initializer_range=cfg.init_std,
        # Token ids belong to the tokenizer, which travels as its own files.
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        architectures=["LlamaForCausalLM"], **extra,
    )


def check_mixtral(cfg: ModelConfig) -> None:
    """A Mixture-of-Experts shape transformers' MixtralForCausalLM computes exactly, or one line naming
    what it lacks: experts in every block, softmax scores over all experts with the top k renormalised,
    no shared expert, no router bias (a capacity factor is a training-time limit: Mixtral is dropless,
    and so is our model on the few tokens it is asked for in a forward without one)."""
    missing = [what for what, bad in (
        (f"an MoE layer in every block (this model has one every {cfg.moe_every})", cfg.moe_every != 1),
        (f"softmax router scores (this model: {cfg.router_score})", cfg.router_score != "softmax"),
        ("the top-k scores renormalised to sum to 1 (this model: not)", not cfg.router_renorm),
        (f"no shared expert (this model: one of width {cfg.shared_ffn})", bool(cfg.shared_ffn)),
        ("no router bias (this model balances with --router-bias-rate, which changes the choice)",
         bool(cfg.router_bias_rate)),
    ) if bad]
    if missing:
        raise ConfigError(f"model {cfg.name}: transformers' MixtralForCausalLM needs {'; '.join(missing)}: it has "
                          f"no class for this Mixture-of-Experts shape, so it is not exported")


def _mixtral_config(cfg: ModelConfig, **extra):
    from transformers import MixtralConfig

    check_mixtral(cfg)
    return MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.expert_ffn,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k, router_aux_loss_coef=cfg.aux_loss_coef,
        output_router_logits=False, router_jitter_noise=0.0, sliding_window=None, attention_dropout=0.0,
        initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        architectures=["MixtralForCausalLM"], **extra,
    )


# Our MoE layer's tensors -> Mixtral's published layout (what transformers reads, and converts in 5.x):
# the router as block_sparse_moe.gate, each expert's SwiGLU as w1 (gate), w3 (up), w2 (down).
_MOE_TO_MIXTRAL = {"router.weight": "gate.weight", "experts.gate": "w1", "experts.up": "w3", "experts.down": "w2"}


def _moe_to_hf(name: str, tensor) -> dict:
    """{Mixtral name: tensor} of one of our MoE tensors (`layers.{i}.mlp.<part>`); stacked experts split."""
    m = re.fullmatch(r"layers\.(\d+)\.mlp\.(.+)", name)
    if m is None or m.group(2) not in _MOE_TO_MIXTRAL:
        raise KeyError(name)
    where = f"model.layers.{m.group(1)}.block_sparse_moe"
    part = _MOE_TO_MIXTRAL[m.group(2)]
    if part == "gate.weight":
        return {f"{where}.gate.weight": tensor}
    return {f"{where}.experts.{j}.{part}.weight": tensor[j] for j in range(tensor.shape[0])}


def from_hf_config(hf_config, name: str = "hf", where: str = "config.json") -> ModelConfig:
    """Our ModelConfig of a Llama config (a `LlamaConfig` or the dict of a config.json).

    Refused, one line each, with what to do: another model_type, biases, an activation
    other than SiLU, attention dropout, a head_dim that is not hidden/heads, and rope
    scaling (Llama 3.1's "llama3", linear, dynamic, yarn, ...): our RoPE is the plain one.
    """
    c = {**LLAMA_DEFAULTS, **(hf_config if isinstance(hf_config, dict) else hf_config.to_dict())}

    def refuse(what: str, fix: str):
        raise ConfigError(f"{where}: {what}: {fix}")

    if c.get("model_type") != "llama":
        refuse(f"model_type {c.get('model_type')!r} is not 'llama'", "only LlamaForCausalLM checkpoints convert")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            refuse(f"{key} is true", "this model has no biases; use a Llama checkpoint without them")
    if c["hidden_act"] != "silu":
        refuse(f"hidden_act {c['hidden_act']!r}", "the MLP here is SwiGLU (silu)")
    if c["attention_dropout"]:
        refuse(f"attention_dropout {c['attention_dropout']}", "this model has no dropout; set it to 0.0")
    # transformers >= 5 keeps RoPE settings in rope_parameters; before, rope_theta and rope_scaling.
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        refuse(f"rope scaling {rope_type!r}", "only plain RoPE (rope_type 'default') is implemented here")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    if c["head_dim"] and heads > 0 and c["head_dim"] * heads != hidden:
        refuse(f"head_dim {c['head_dim']} is not hidden_size/num_attention_heads = {hidden}/{heads}",
               "the head size here is hidden/heads")
    return ModelConfig(
        name=name, vocab_size=c["vocab_size"], hidden=hidden, layers=c["num_hidden_layers"], heads=heads,
        kv_heads=c["num_key_value_heads"] or heads, ffn_hidden=c["intermediate_size"],
        max_seq_len=c["max_position_embeddings"], rope_theta=float(rope.get("rope_theta", c["rope_theta"])),
        norm_eps=float(c["rms_norm_eps"]), tie_embeddings=bool(c["tie_word_embeddings"]),
        init_std=float(c["initializer_range"]),
    )


def read_hf_config(path: str) -> ModelConfig:
    """The ModelConfig of the transformers checkpoint directory `path` (its config.json only)."""
    if not os.path.isdir(path):
        raise ConfigError(f"{path}: no such directory")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"{path}: no config.json, not a transformers model directory (save_pretrained writes one)")
    try:
        with open(config_file) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{config_file}: cannot read it ({str(e).splitlines()[0]})") from None
    if not isinstance(c, dict):
        raise ConfigError(f"{config_file}: not a JSON object")
    return from_hf_config(c, name=f"hf:{os.path.basename(os.path.abspath(path))}", where=config_file)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """{our name: shape} of every parameter of the single-device model, in its order (no memory: meta device)."""
    from ultrascale.model.transformer import Transformer, on_meta_without_default_init

    with on_meta_without_default_init():
        return {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}


# -- weights ---------------------------------------------------------------------------------
def _skipped(hf: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that are not parameters of ours: old rotary buffers, and
    lm_head next to tied embeddings (some writers store the shared matrix twice)."""
    return hf.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and hf == "lm_head.weight")


class HFWeights(Mapping):
    """The tensors of a transformers checkpoint directory under our names, read one at a time
    from its safetensors file(s) when asked for, as fp32.

    Opening checks the files' headers (no tensor data) against the model shape: every
    parameter present with its shape, nothing unknown.
    """

    def __init__(self, path: str, cfg: ModelConfig):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(path, WEIGHTS)):
            files = [WEIGHTS]
        elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
            raise ConfigError(f"{path}: only safetensors weights are read, it has pytorch_model.bin: "
                              f"re-save it with save_pretrained (safetensors is its default)")
        else:
            raise ConfigError(f"{path}: no {WEIGHTS} or {INDEX}")
        self._where: dict[str, tuple[str, str]] = {}  # our name -> (file, transformers' name)
        shapes = {}
        for file in files:
            full = os.path.join(path, file)
            if not os.path.isfile(full):
                raise ConfigError(f"{path}: {INDEX} names {file}, which is missing")
            with safe_open(full, "pt") as f:
                for hf in f.keys():
                    if _skipped(hf, cfg):
                        continue
                    try:
                        ours = our_name(hf)
                    except KeyError:
                        raise ConfigError(f"{full}: unexpected tensor {hf}, not a LlamaForCausalLM parameter") from None
                    self._where[ours] = (full, hf)
                    shapes[ours] = tuple(f.get_slice(hf).get_shape())
        expected = param_shapes(cfg)
        missing = [hf_name(n) for n in expected if n not in shapes]
        if missing:
            raise ConfigError(f"{path}: missing {len(missing)} tensor(s) of the config's model, e.g. {missing[0]}")
        extra = [self._where[n][1] for n in shapes if n not in expected]
        if extra:
            raise ConfigError(f"{path}: tensor {extra[0]} does not belong to the model config.json describes")
        for n, shape in expected.items():
            if shapes[n] != shape:
                raise ConfigError(f"{path}: {hf_name(n)} has shape {list(shapes[n])}, config.json implies {list(shape)}")
        self._order = list(expected)

    def __getitem__(self, name: str):
        from safetensors import safe_open

        file, hf = self._where[name]
        with safe_open(file, "pt") as f:
            return f.get_tensor(hf).float()

    def __iter__(self):
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


def hf_weights(path: str, cfg: ModelConfig | None = None) -> HFWeights:
    """The weights of a transformers checkpoint directory by our names (lazy); cfg from its config.json if not given."""
    return HFWeights(path, cfg or read_hf_config(path))


def load_hf(path: str):
    """(ModelConfig, {our name: fp32 tensor}) of a transformers Llama checkpoint directory."""
    cfg = read_hf_config(path)
    weights = hf_weights(path, cfg)
    return cfg, {n: weights[n] for n in weights}


def to_hf_state(cfg: ModelConfig, state: Mapping) -> dict:
    """{transformers name: tensor} of our {name: tensor}, checked against the model shape
    (a tied model has no head: its lm_head is the embedding); an MoE model's in Mixtral's layout."""
    expected = param_shapes(cfg)
    if set(state) != set(expected):
        wrong = sorted(set(state) ^ set(expected))
        raise ValueError(f"the state does not match model {cfg.name}: {wrong[:3]} missing or unexpected")
    for n, shape in expected.items():
        if tuple(state[n].shape) != shape:
            raise ValueError(f"{n} has shape {list(state[n].shape)}, model {cfg.name} needs {list(shape)}")
    out = {}
    for n in expected:
        if cfg.is_moe and ".mlp." in n:
            out.update(_moe_to_hf(n, state[n]))
        else:
            out[hf_name(n)] = state[n]
    return out


def save_hf(cfg: ModelConfig, state: Mapping, out_dir: str, tokenizer_dir: str | None = None,
            dtype=None, force: bool = False) -> None:
    """Write `out_dir` as a transformers checkpoint: config.json, model.safetensors (in `dtype`,
    fp32 by default), and the tokenizer's files when `tokenizer_dir` is given.

    Atomic: everything goes into a temporary directory next to `out_dir`, which is renamed
    into place at the end (files 0644). An existing non-empty `out_dir` is refused unless `force`.
    """
    import torch
    from safetensors.torch import save_file

    dtype = dtype or torch.float32
    check_out_dir(out_dir, force)
    hf_config = to_hf_config(cfg, dtype=dtype)
    tensors = {n: t.detach().to("cpu", dtype).contiguous() for n, t in to_hf_state(cfg, state).items()}
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", suffix=".tmp", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        hf_config.save_pretrained(tmp)
        if tokenizer_dir:
            for f in sorted(os.listdir(tokenizer_dir)):
                if TOKENIZER_FILES.fullmatch(f) and os.path.isfile(os.path.join(tokenizer_dir, f)):
                    shutil.copyfile(os.path.join(tokenizer_dir, f), os.path.join(tmp, f))
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o644)
        os.chmod(tmp, 0o755)
        _swap_in(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if no_room(e):  # safetensors' writer carries the OS error in its own exception
            raise no_room_error(out_dir, e, "nothing was written") from None
        raise


def _swap_in(tmp: str, out_dir: str) -> None:
    """Rename tmp to out_dir; an existing out_dir is moved aside first and removed last."""
    if not os.path.exists(out_dir):
        os.replace(tmp, out_dir)
        return
    old = tmp[:-len(".tmp")] + ".old"
    os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def check_out_dir(out_dir: str, force: bool = False) -> None:
    """Refuse an output directory that cannot be written, or that holds files (unless force)."""
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ConfigError(f"{out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not force:
            raise ConfigError(f"{out_dir} exists and is not empty: pass --force to replace it")
    # The nearest existing ancestor must be a writable directory (the rest is created).
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{out_dir}: cannot write there ({parent} is not a writable directory)")


def parse_init_from(spec: str) -> str:
    """The directory of an --init-from value, `hf:DIR`."""
    if not spec.startswith("hf:") or not spec[3:]:
        raise ConfigError(f"--init-from {spec}: give hf:DIR, a local directory written by transformers' "
                          f"save_pretrained")
    return spec[3:]


def checkpoint_tokenizer(init_from: str) -> str:
    """The tokenizer directory a transformers checkpoint carries (its tokenizer.json or
    tokenizer_config.json beside the weights), or "" when it has none."""
    path = parse_init_from(init_from)
    return path if any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")) else ""


def model_from_checkpoint(init_from: str, given: dict) -> ModelConfig:
    """The model shape of --init-from hf:DIR: its config.json, a layer under the flags and the
    file. A model field given there must agree with it; one that contradicts it is refused."""
    if "preset" in given:
        raise ConfigError(f"--model {given['preset']} and --init-from {init_from} both give the model: drop --model")
    path = parse_init_from(init_from)
    try:
        model = read_hf_config(path)
    except ConfigError as e:  # its messages start with the directory
        raise ConfigError(f"--init-from hf:{e}") from None
    for name, value in given.items():
        if name == "name":
            model = replace(model, name=value)
        elif getattr(model, name) != value:
            key = HF_KEYS.get(name, name)
            raise ConfigError(f"--{name.replace('_', '-')} {value} contradicts --init-from {init_from}, whose "
                              f"config.json has {key} = {getattr(model, name)}: drop the flag")
    return model
