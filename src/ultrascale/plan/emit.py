"""plan -> train: one layout written as the TOML `ultrascale train --config` reads.

Sections and field names are the engine's (ultrascale.config: [model] with a
preset and the fields that differ from it, [parallel], [train]), so the file
is checked by the same load_toml / validate as a hand-written one, and it is,
before it is written: a layout the engine refuses is said in one line, and
`plan` writes the best of its ranked layouts that the engine takes.

Mixture-of-Experts shapes emit as the engine's MoE fields (experts, top_k,
moe_ffn_hidden, shared_expert) and the layout's expert parallelism as `ep`;
the routing the planner does not model (scores, balancing) is the preset's.
What the planner models and the engine does not build (ModelShape's fields
beyond the engine's, such as multi-head latent attention or leading dense
blocks) is refused, naming each field.
"""

from __future__ import annotations

import sys
from dataclasses import fields

from ultrascale.errors import ConfigError

# ModelShape field -> ModelConfig field (the engine's name, written to [model]), where one builds the other.
_MODEL_FIELDS = {"vocab": "vocab_size", "hidden": "hidden", "layers": "layers", "heads": "heads",
                 "kv_heads": "kv_heads", "ffn_hidden": "ffn_hidden", "tie_embeddings": "tie_embeddings",
                 "norm": "norm", "mlp": "mlp", "bias": "bias"}
# The same for a Mixture of Experts, read from the engine's config as written (shared_ffn: the width
# `shared_expert = true` stands for) and written as its field.
_MOE_FIELDS = {"experts": ("experts", "experts"), "top_k": ("top_k", "top_k"),
               "expert_ffn_hidden": ("expert_ffn", "moe_ffn_hidden"), "shared_expert_ffn": ("shared_ffn", "shared_expert")}
# What each planner-only field is, said when a shape needs it and the engine cannot build it.
_PLANNER_ONLY = {"dropout": "dropout", "dense_layers": "leading dense blocks", "kv_channels": "heads wider than "
                 "hidden / heads", "qk_norm": "query/key norms", "q_lora_rank": "multi-head latent attention",
                 "kv_lora_rank": "multi-head latent attention", "qk_rope_head_dim": "multi-head latent attention",
                 "v_head_dim": "multi-head latent attention", "expert_groups": "node-limited routing",
                 "topk_groups": "node-limited routing"}


def unbuilt_fields(shape) -> list[str]:
    """The fields of a planned shape the engine cannot build, as `field = value (what it is)`: every
    ModelShape field the engine has no field for, away from the value that means the plain block."""
    from ultrascale.plan.shape import ModelShape

    built = set(_MODEL_FIELDS) | set(_MOE_FIELDS) | {"name"}
    out = []
    for f in fields(ModelShape):
        if f.name in built:
            continue
        value = getattr(shape, f.name)
        plain = f.default if f.name != "kv_channels" or value != shape.hidden // shape.heads else value
        if value != plain:
            out.append(f"{f.name} = {_value(value)} ({_PLANNER_ONLY.get(f.name, 'a planner-only field')})")
    return out


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def engine_dtype(precision: str) -> str:
    # The engine trains in fp32, or in bf16 with fp32 master weights and gradients: every bf16 recipe
    # of the planner runs as the latter (its gradients cost 4 bytes per parameter, not 2).
    if precision == "fp32":
        return "fp32"
    if precision.startswith("bf16"):
        return "bf16"
    raise ConfigError(f"--emit-config: the engine has no {precision!r} recipe; use --precision bf16 or fp32")


def model_section(shape, model_of=None) -> dict:
    """[model] for a planned shape: the engine's preset it came from and the fields that differ; the
    shape refused, naming its fields, where the engine cannot build it (before any search runs)."""
    from ultrascale.model.config import PRESETS

    unbuilt = unbuilt_fields(shape)
    if unbuilt:
        close = (f"; the engine's preset {shape.name} approximates it (`ultrascale train --model {shape.name}`)"
                 if shape.name in PRESETS else "")
        raise ConfigError(f"--emit-config: the engine cannot build {shape.name} as planned: {', '.join(unbuilt)}"
                          f"{close}")
    preset_name = model_of.base if model_of else shape.name
    if preset_name not in PRESETS:
        raise ConfigError(f"--emit-config: {preset_name!r} is not one of the engine's model presets")
    preset = PRESETS[preset_name]
    model = {"preset": preset_name}
    for ours, theirs in _MODEL_FIELDS.items():
        if getattr(shape, ours) != getattr(preset, theirs):
            model[theirs] = getattr(shape, ours)
    if shape.is_moe or preset.is_moe:  # a dense shape's top_k means nothing; the preset's stays
        for ours, (read, theirs) in _MOE_FIELDS.items():
            if getattr(shape, ours if ours != "expert_ffn_hidden" else "expert_ffn") != getattr(preset, read):
                model[theirs] = getattr(shape, ours)
    return model


def run_config(shape, lay, model_of=None) -> dict:
    """{section: {field: value}} for `ultrascale train --config`. `model_of`: the account of a changed
    preset (plan/overrides.py Resolved), whose preset the file names."""
    from ultrascale.model.config import PRESETS

    model = model_section(shape, model_of)
    preset = PRESETS[model["preset"]]
    if lay.seq_len > preset.max_seq_len:
        model["max_seq_len"] = lay.seq_len  # the RoPE table must cover the planned sequence
    parallel = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "sp": lay.sp_on, "zero": lay.zero,
                "pp_schedule": lay.schedule, "pp_chunks": lay.chunks,
                "pp_first_stage_layers": lay.first_stage_layers, "pp_last_stage_layers": lay.last_stage_layers,
                "bucket_mb": lay.bucket_mb}
    if lay.ep > 1:  # carved out of dp, as the planner's
        parallel["ep"] = lay.ep
    if lay.cp > 1:  # the attention variant means something only with context parallelism
        parallel["cp_attention"] = lay.cp_attention
    if lay.offload != "none":  # disk's files: a directory beside the run (any with room will do)
        parallel.update(offload=lay.offload, **({"offload_dir": "offload"} if lay.offload == "disk" else {}))
    train = {"seq_len": lay.seq_len, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
             "recompute": lay.recompute, "dtype": engine_dtype(lay.precision), "nproc": lay.world}
    return {"model": model, "parallel": parallel, "train": train}


def checked(shape, lay, model_of=None) -> dict:
    """run_config, read back as `train --config` reads it and validated by the engine's own rules
    (config.validate at the layout's world size): what the engine refuses is refused here, in its words."""
    from ultrascale.config import build_config, validate

    sections = run_config(shape, lay, model_of)
    try:
        validate(build_config(sections, {}), lay.world)
    except ConfigError as e:
        raise ConfigError(f"--emit-config: the engine refuses {lay.label()}: {e}") from None
    return sections


def best_buildable(shape, ranked, model_of=None):
    """The first of the ranked layouts the engine takes, its rank (1-based) and what the engine said of
    those above it; ConfigError if it takes none (the first one's reason)."""
    if not ranked:
        raise ConfigError("--emit-config: no layout fits, nothing to write")
    engine_dtype(ranked[0].layout.precision)  # the model (checked before the search) and its precision: every row's
    refused = []
    for i, row in enumerate(ranked):
        try:
            checked(shape, row.layout, model_of)
        except ConfigError as e:
            refused.append(str(e).removeprefix("--emit-config: "))
            continue
        return row.layout, i + 1, refused
    raise ConfigError(f"--emit-config: {refused[0]}")


def to_toml(sections: dict, header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()]
    for name, values in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_value(v)}" for k, v in values.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def write(path: str, shape, lay, model_of=None, note: str = "") -> None:
    # A changed preset is said in the header, "custom (from tiny)" with what was given and derived
    # (the engine's [model] takes no name beside its preset).
    sections = checked(shape, lay, model_of)
    notes = "".join(line + "\n" for line in (model_of.lines() if model_of else []) + ([note] if note else []))
    text = to_toml(sections, f"ultrascale plan: {shape.name}, {lay.label()}\n{notes}"
                             f"run with: ultrascale train --config {path}")
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError(f"--emit-config {path}: cannot write ({e.strerror})") from None
    # On stderr: stdout may be the plan's JSON.
    print(f"wrote {path}: run it with ultrascale train --config {path}", file=sys.stderr)
