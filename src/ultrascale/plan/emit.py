"""plan -> train: one layout written as the TOML `ultrascale train --config` reads.

Sections and field names are the engine's (ultrascale.config: [model] with a
preset and the fields that differ from it, [parallel], [train]), so the file
is checked by the same load_toml / validate as a hand-written one.
"""

from __future__ import annotations

import sys

from ultrascale.errors import ConfigError

# ModelShape field -> ModelConfig field, where they differ in name.
_MODEL_FIELDS = {"vocab": "vocab_size", "hidden": "hidden", "layers": "layers", "heads": "heads",
                 "kv_heads": "kv_heads", "ffn_hidden": "ffn_hidden", "tie_embeddings": "tie_embeddings",
                 "norm": "norm", "mlp": "mlp", "bias": "bias"}


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def _dtype(precision: str) -> str:
    # The engine trains in fp32, or in bf16 with fp32 master weights and gradients: every bf16 recipe
    # of the planner runs as the latter (its gradients cost 4 bytes per parameter, not 2).
    if precision == "fp32":
        return "fp32"
    if precision.startswith("bf16"):
        return "bf16"
    raise ConfigError(f"--emit-config: the engine has no {precision!r} recipe; use --precision bf16 or fp32")


def run_config(shape, lay, model_of=None) -> dict:
    """{section: {field: value}} for `ultrascale train --config`. `model_of`: the account of a changed
    preset (plan/overrides.py Resolved), whose preset the file names."""
    from ultrascale.model.config import PRESETS

    if shape.is_moe or lay.ep > 1:
        raise ConfigError("--emit-config: the engine has no Mixture-of-Experts layers yet; plan a dense model")
    preset_name = model_of.base if model_of else shape.name
    if preset_name not in PRESETS:
        raise ConfigError(f"--emit-config: {preset_name!r} is not one of the engine's model presets")
    preset = PRESETS[preset_name]
    model = {"preset": preset_name}  # a custom shape: the preset it came from and the fields that differ
    for ours, theirs in _MODEL_FIELDS.items():
        if getattr(shape, ours) != getattr(preset, theirs):
            model[theirs] = getattr(shape, ours)
    if lay.seq_len > preset.max_seq_len:
        model["max_seq_len"] = lay.seq_len  # the RoPE table must cover the planned sequence
    parallel = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "sp": lay.sp_on, "zero": lay.zero,
                "pp_schedule": lay.schedule, "pp_chunks": lay.chunks,
                "pp_first_stage_layers": lay.first_stage_layers, "pp_last_stage_layers": lay.last_stage_layers,
                "bucket_mb": lay.bucket_mb}
    if lay.cp > 1:  # the attention variant means something only with context parallelism
        parallel["cp_attention"] = lay.cp_attention
    if lay.offload != "none":  # disk's files: a directory beside the run (any with room will do)
        parallel.update(offload=lay.offload, **({"offload_dir": "offload"} if lay.offload == "disk" else {}))
    train = {"seq_len": lay.seq_len, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
             "recompute": lay.recompute, "dtype": _dtype(lay.precision), "nproc": lay.world}
    return {"model": model, "parallel": parallel, "train": train}


def to_toml(sections: dict, header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()]
    for name, values in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_value(v)}" for k, v in values.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def write(path: str, shape, lay, model_of=None) -> None:
    # A changed preset is said in the header, "custom (from tiny)" with what was given and derived
    # (the engine's [model] takes no name beside its preset).
    notes = "".join(line + "\n" for line in (model_of.lines() if model_of else []))
    text = to_toml(run_config(shape, lay, model_of), f"ultrascale plan: {shape.name}, {lay.label()}\n{notes}"
                                                     f"run with: ultrascale train --config {path}")
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError(f"--emit-config {path}: cannot write ({e.strerror})") from None
    # On stderr: stdout may be the plan's JSON.
    print(f"wrote {path}: run it with ultrascale train --config {path}", file=sys.stderr)
