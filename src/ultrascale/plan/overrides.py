"""A preset with some of its fields changed: what else changes with them, by the preset's own rule.

`--model llama3-8b --hidden 8192 --layers 80 --heads 64` asks for a model of another size, not for
llama3-8b with a wider residual stream: the MLP width and the key/value heads follow from the hidden
size and the heads by the rule Llama 3's own sizes follow. Each preset family's rule is written once
below, with its source; a field that has no published rule for its preset is not kept silently at the
preset's value, the override is refused in one line that names the flag to give. Every value
derived is said (`Resolved.lines`), and a changed preset is no longer called by the preset's name:
it is "custom (from llama3-8b)".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ultrascale.errors import ConfigError

# ModelShape field -> the flag that sets it (what a refusal tells the user to give).
FLAGS = {"vocab": "--vocab-size", "hidden": "--hidden", "layers": "--layers", "heads": "--heads",
         "kv_heads": "--kv-heads", "ffn_hidden": "--ffn-hidden", "experts": "--experts", "top_k": "--top-k",
         "expert_ffn_hidden": "--expert-ffn-hidden", "tie_embeddings": "--tie-embeddings", "norm": "--block",
         "mlp": "--block", "bias": "--block"}
WORDS = {"vocab": "vocab", "hidden": "hidden", "layers": "layers", "heads": "heads", "kv_heads": "kv heads",
         "ffn_hidden": "ffn", "experts": "experts", "top_k": "top-k", "expert_ffn_hidden": "expert ffn",
         "shared_expert_ffn": "shared expert ffn", "tie_embeddings": "tied embeddings", "norm": "norm",
         "mlp": "mlp", "bias": "bias", "head_dim": "head dim"}


# -- the families' rules ------------------------------------------------------------------------
def gpt_ffn(hidden: int) -> int:
    """GPT-3's MLP is four times the hidden size at every size, d_ff = 4 d_model (Brown et al. 2020,
    "Language Models are Few-Shot Learners", section 2.1); Megatron's GPTs (Narayanan et al. 2021,
    Korthikanti et al. 2022) and BLOOM keep it."""
    return 4 * hidden


def llama3_ffn(hidden: int, multiplier: float, multiple_of: int) -> int:
    """Llama 3's SwiGLU width, as Meta's FeedForward computes it from the model's params.json
    (github.com/meta-llama/llama-models, models/llama3/model.py): two thirds of 4h, times
    ffn_dim_multiplier, rounded up to a multiple of multiple_of."""
    f = int(multiplier * int(2 * (4 * hidden) / 3))
    return multiple_of * -(-f // multiple_of)


@dataclass(frozen=True)
class Rules:
    """How one preset's dependent fields follow the ones a user changes.

    ffn: the MLP width from the hidden size (None: the preset publishes its width, no rule).
    kv_heads: a count of key/value heads its family keeps at every size (0: keep the preset's query
    heads per key/value head). head_dim: a head width its family keeps at every size (0: keep the
    preset's heads when the hidden size changes)."""
    family: str = ""
    ffn: Callable[[int], int] | None = None
    ffn_rule: str = ""
    kv_heads: int = 0
    head_dim: int = 0


GPT3 = Rules("GPT-3", gpt_ffn, "4 x hidden")


def _llama3(model: str, multiplier: float, multiple_of: int, **attention) -> Rules:
    """Llama 3's rule with one model's constants."""
    return Rules("Llama 3", lambda h: llama3_ffn(h, multiplier, multiple_of),
                 f"8h/3 x {multiplier:g} rounded up to a multiple of {multiple_of}, {model}'s constants",
                 **attention)


# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3): 8 key/value heads and heads
# 128 wide at 8B, 70B and 405B alike; ffn_dim_multiplier and multiple_of from each model's arch_args
# (meta-llama/llama-models, models/sku_list.py): 8B 1.3 and 1024, 70B 1.3 and 4096, 405B 1.2 and 4096.
LLAMA3 = dict(kv_heads=8, head_dim=128)
RULES: dict[str, Rules] = {
    "llama3-8b": _llama3("Llama 3 8B", 1.3, 1024, **LLAMA3),
    "llama3-70b": _llama3("Llama 3 70B", 1.3, 4096, **LLAMA3),
    "llama3-405b": _llama3("Llama 3 405B", 1.2, 4096, **LLAMA3),
    # The playbook's benchmark shapes: multi-head attention (kv heads follow the heads) over the MLPs
    # of Llama 3.2 1B and 3B (sku_list.py at llama-models commit 8d29d93: 1.5 and 256, 1.0 and 256;
    # the same hidden size, blocks, MLP width and tied embeddings) and of Llama 3 8B and 70B.
    "1b": _llama3("Llama 3.2 1B", 1.5, 256),
    "3b": _llama3("Llama 3.2 3B", 1.0, 256),
    "8b": _llama3("Llama 3 8B", 1.3, 1024),
    "80b": _llama3("Llama 3 70B", 1.3, 4096),
}


def rules_of(name: str, shape=None) -> Rules:
    """The rules of preset `name`; `shape` (its ModelShape) tells a GPT-3-style block (LayerNorm, a GELU
    MLP, one kv head per head) by itself, so the planner's published GPTs need no list here."""
    if shape is not None and shape.mlp == "gelu" and shape.norm == "layernorm" and shape.kv_heads == shape.heads:
        return GPT3
    return RULES.get(name, Rules())


# -- a preset with overrides ---------------------------------------------------------------------
@dataclass(frozen=True)
class Resolved:
    """The shape planned, the preset it came from, what the user changed and what followed."""
    shape: object  # ModelShape
    base: str
    given: dict = field(default_factory=dict)  # field -> value, those that differ from the preset
    derived: dict = field(default_factory=dict)  # field -> (value, why)
    preset_params: int = 0

    @property
    def custom(self) -> bool:
        return bool(self.given)

    def lines(self) -> list[str]:
        """What the text report says of the model: nothing for a preset as published."""
        if not self.custom:
            return []
        given = ", ".join(f"{WORDS[k]} {_say(v)}" for k, v in self.given.items())
        out = [f"model {self.shape.name}: {self.base} ({self.preset_params:,} parameters) with {given}"
               + (", and what follows:" if self.derived else "")]
        return out + [f"  {WORDS[k]} {_say(v)} ({why})" for k, (v, why) in self.derived.items()]

    def as_dict(self) -> dict:
        """`--json`'s account of the model: the preset, the fields given, those derived and why."""
        return {"name": self.shape.name, "base": self.base, "custom": self.custom, "given": dict(self.given),
                "derived": {k: {"value": v, "rule": why} for k, (v, why) in self.derived.items()},
                "notes": self.lines()}


def _say(v) -> str:
    return ("yes" if v else "no") if isinstance(v, bool) else str(v)


def custom_name(base: str) -> str:
    return f"custom (from {base})"


def resolve(base_shape, base: str, overrides: dict) -> Resolved:
    """`base_shape` (the preset `base`) with `overrides` (ModelShape fields; None: not given) and every
    field that follows from them, or a ConfigError naming the flag a missing rule needs. Overrides equal
    to the preset's values change nothing: the preset keeps its name."""
    given = {k: v for k, v in overrides.items() if v is not None and getattr(base_shape, k) != v}
    count = base_shape.count()
    if not given:
        return Resolved(base_shape, base, preset_params=count)
    rules, derived = rules_of(base, base_shape), {}
    _derive_heads(base, rules, given, derived)
    _derive_kv_heads(base_shape, base, rules, given, derived)
    missing = _derive_widths(base_shape, base, rules, given, derived)
    if missing:
        raise ConfigError(f"{_trigger(given)} on {base}: {base} has no rule for "
                          f"{' or '.join(w for w, _ in missing)} {_cause(given)}: give "
                          f"{' and '.join(f for _, f in missing)} too")
    shape = replace(base_shape, name=custom_name(base), **given, **{k: v for k, (v, _) in derived.items()})
    _check_divides(shape, base, given, derived)
    shape.validate()
    if shape.head_dim != base_shape.head_dim:  # said, though no field: it moves the attention's cost
        derived["head_dim"] = (shape.head_dim, f"hidden {shape.hidden} / {shape.heads} heads")
    return Resolved(shape, base, given, derived, count)


def _trigger(given: dict) -> str:
    if "hidden" in given:
        return f"--hidden {given['hidden']}"
    return f"--block {'gpt' if given['mlp'] == 'gelu' else 'llama'}"


def _cause(given: dict) -> str:
    return "at another hidden size" if "hidden" in given else f"of a {given['mlp']} MLP"


def _derive_heads(base, rules, given, derived) -> None:
    """A family with one head width at every size (Llama 3: 128) gives a new hidden size its heads."""
    if "hidden" not in given or "heads" in given or not rules.head_dim:
        return
    h = given["hidden"]
    if h % rules.head_dim:
        raise ConfigError(f"--hidden {h} on {base}: {rules.family}'s heads are {rules.head_dim} wide, which does "
                          f"not divide {h}: give --heads (a divisor of {h}) or a multiple of {rules.head_dim}")
    derived["heads"] = (h // rules.head_dim, f"from hidden {h}: {rules.family}'s heads are {rules.head_dim} "
                                             f"wide at every size")


def _derive_kv_heads(base_shape, base, rules, given, derived) -> None:
    """New query heads keep the family's key/value heads (Llama 3: 8), else the preset's group size."""
    heads = given.get("heads") or derived.get("heads", (base_shape.heads,))[0]
    if heads == base_shape.heads or "kv_heads" in given:
        return
    if rules.kv_heads:
        kv, keep = rules.kv_heads, f"{rules.family} keeps {rules.kv_heads} key/value heads at every size"
        fits, why = heads % kv == 0, keep
    else:
        group = base_shape.heads // base_shape.kv_heads
        kv, keep = heads // group, f"{base} has {group} query heads per key/value head"
        fits = heads % group == 0
        why = (f"follows heads {heads}: multi-head attention, as {base}" if group == 1 else
               f"from heads {heads}, keeping {base}'s {group} query heads per key/value head")
    if not fits:
        said = f"--heads {heads}" if "heads" in given else f"heads {heads} (derived)"
        raise ConfigError(f"{said} on {base}: {keep}, which does not divide {heads} query heads: give "
                          f"--kv-heads (a divisor of {heads})")
    derived["kv_heads"] = (kv, why)


def _derive_widths(base_shape, base, rules, given, derived) -> list[tuple[str, str]]:
    """The MLP, expert and shared-expert widths a new hidden size (or another MLP) needs: by the family's
    rule, or the (what, flag) pairs a refusal names."""
    missing = []
    new_mlp = given.get("mlp")
    if ("hidden" in given or new_mlp) and "ffn_hidden" not in given:
        h = given.get("hidden", base_shape.hidden)
        # A GELU block is GPT's, whose MLP is 4h; a SwiGLU block in place of a GELU preset's has no rule.
        rule = GPT3 if new_mlp == "gelu" else Rules() if new_mlp else rules
        if rule.ffn:
            derived["ffn_hidden"] = (rule.ffn(h), f"from hidden {h} by {rule.family}'s rule: {rule.ffn_rule}")
        else:
            missing.append(("the MLP width", "--ffn-hidden"))
    routed = base_shape.expert_ffn_hidden  # 0: the experts are ffn_hidden wide, the MLP width's rule
    if routed and given.get("experts", base_shape.experts) and "hidden" in given \
            and "expert_ffn_hidden" not in given:
        missing.append(("the experts' width", "--expert-ffn-hidden"))
    shared = base_shape.shared_expert_ffn
    if shared and not missing:
        # DeepSeek-V3's shared expert is one more expert of the routed width (its config.json:
        # n_shared_experts 1, moe_intermediate_size 2048): it follows the routed width.
        if shared != base_shape.expert_ffn:
            if "hidden" in given:
                raise ConfigError(f"--hidden {given['hidden']} on {base}: its shared expert ({shared} wide) has "
                                  f"no rule and no flag; plan it at its own hidden size")
            return missing
        width = given.get("expert_ffn_hidden", routed) or given.get(
            "ffn_hidden", derived.get("ffn_hidden", (base_shape.ffn_hidden,))[0])
        if width != shared:
            derived["shared_expert_ffn"] = (width, f"one shared expert of the routed width, as {base}")
    return missing


def _check_divides(shape, base, given, derived) -> None:
    """hidden / heads / kv heads must divide: said with where each value came from."""
    def said(k):
        v = getattr(shape, k)
        if k in given:
            return f"{FLAGS[k]} {v}"
        origin = "derived" if k in derived else f"{base}'s"
        return f"{WORDS[k]} {v} ({origin})"

    if shape.heads <= 0 or shape.kv_heads <= 0:
        return  # validate() names it
    if shape.hidden % shape.heads:
        raise ConfigError(f"{said('heads')} must divide {said('hidden')}: give --heads that divides "
                          f"{shape.hidden}{'' if 'hidden' in given else ' or another --hidden'}")
    if shape.heads % shape.kv_heads:
        raise ConfigError(f"{said('kv_heads')} must divide {said('heads')}: give --kv-heads that divides "
                          f"{shape.heads}")
