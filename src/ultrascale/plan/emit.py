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
from ultrascale.plan.launch import launch_lines, nodes_of, write_sbatch

# ModelShape field -> ModelConfig field (the engine's name, written to [model]), where one builds the other.
_MODEL_FIELDS = {"vocab": "vocab_size", "hidden": "hidden", "layers": "layers", "heads": "heads",
                 "kv_heads": "kv_heads", "ffn_hidden": "ffn_hidden", "tie_embeddings": "tie_embeddings",
                 "norm": "norm", "mlp": "mlp", "bias": "bias"}
# The same for a Mixture of Experts: (ModelShape field, the ModelConfig field written; the width each side
# means, read as a property where 0 or `shared_expert = true` stands for another).
_MOE_FIELDS = [("experts", "experts", "experts", "experts"), ("top_k", "top_k", "top_k", "top_k"),
               ("expert_ffn_hidden", "moe_ffn_hidden", "expert_ffn", "expert_ffn"),
               ("shared_expert_ffn", "shared_expert", "shared_expert_ffn", "shared_ffn")]
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

    built = set(_MODEL_FIELDS) | {ours for ours, *_ in _MOE_FIELDS} | {"name"}
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
        for ours, theirs, shape_width, preset_width in _MOE_FIELDS:
            if getattr(shape, shape_width) != getattr(preset, preset_width):
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
             "recompute": lay.recompute, "dtype": engine_dtype(lay.precision), "nproc": lay.world,
             **run_settings(shape, lay)}
    return {"model": model, "parallel": parallel, "train": train}


# Peak learning rates of GPT-3's models by parameter count (Brown et al. 2020, "Language Models are
# Few-Shot Learners", Table 2.1: 125M to 175B, batch 0.5M to 3.2M tokens, Adam with beta2 0.95).
GPT3_LR = [(125e6, 6.0e-4), (350e6, 3.0e-4), (760e6, 2.5e-4), (1.3e9, 2.0e-4), (2.7e9, 1.6e-4), (6.7e9, 1.2e-4),
           (13e9, 1.0e-4), (175e9, 0.6e-4)]
# The same paper: the learning rate warms up linearly over the first 375 million tokens, then follows a
# cosine down to 10% of its peak (the engine's --min-lr-ratio 0.1).
GPT3_WARMUP_TOKENS = 375e6
# Chinchilla's compute-optimal budget (Hoffmann et al. 2022, "Training Compute-Optimal Large Language
# Models"): about 20 training tokens per parameter.
TOKENS_PER_PARAMETER = 20
# Checkpoints and validation: 20 in a run (every 5% of the steps), the newest 3 kept.
SAVES_PER_RUN = 20
# Where the emitted run reads its data: not a corpus, so the run refuses it in one line until it is set.
DATA_PLACEHOLDER = "SET-ME: a corpus made by `ultrascale data prepare` on a filesystem every node reads"


def peak_lr(params: float) -> float:
    """GPT-3's peak learning rate at this many parameters: log-log interpolation of Table 2.1 (held at
    its ends outside 125M..175B)."""
    import math

    if params <= GPT3_LR[0][0]:
        return GPT3_LR[0][1]
    for (n0, lr0), (n1, lr1) in zip(GPT3_LR, GPT3_LR[1:]):
        if params <= n1:
            t = (math.log(params) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return math.exp(math.log(lr0) + t * (math.log(lr1) - math.log(lr0)))
    return GPT3_LR[-1][1]


def run_settings(shape, lay) -> dict:
    """The rest of a run of this model and batch: steps for a compute-optimal budget, the learning rate
    and its schedule, data, checkpoints, validation and the log (the rules and sources above). An MoE
    model is scaled by its active parameters, what each token's compute sees."""
    import math

    params = shape.active_params() if shape.is_moe else shape.count()
    tokens = lay.tokens_per_step
    steps = max(1, math.ceil(TOKENS_PER_PARAMETER * params / tokens))
    every = max(1, steps // SAVES_PER_RUN)
    return {"steps": steps, "lr": float(f"{peak_lr(params):.3g}"), "lr_schedule": "cosine", "min_lr_ratio": 0.1,
            "warmup_steps": min(steps // 10, math.ceil(GPT3_WARMUP_TOKENS / tokens)),
            "data": DATA_PLACEHOLDER, "save": "checkpoints", "save_every": every, "keep_last": 3,
            "eval_every": every, "log_jsonl": "train.jsonl"}


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


def write(path: str, shape, lay, model_of=None, note: str = "", framework: str = "ultrascale", node_size: int = 8,
          launch: str = "") -> None:
    # A changed preset is said in the header, "custom (from tiny)" with what was given and derived
    # (the engine's [model] takes no name beside its preset).
    sections = checked(shape, lay, model_of)
    t = sections["train"]
    lines = [f"ultrascale plan: {shape.name}, {lay.label()}", *(model_of.lines() if model_of else []),
             *([note] if note else []),
             f"planned for framework {framework}" + ("" if framework == "ultrascale" else
                                                     f": the memory and times are {framework}'s kernels', not this "
                                                     f"engine's (plan with --framework ultrascale for this engine)"),
             f"steps: {TOKENS_PER_PARAMETER} tokens per parameter (Chinchilla); lr: GPT-3's Table 2.1 at this size, "
             f"{GPT3_WARMUP_TOKENS / 1e6:.0f}M tokens of warmup, cosine to 10%",
             f"set [train] data = a prepared corpus: the run refuses the placeholder",
             *launch_lines(path, t["nproc"], node_size)]
    text = to_toml(sections, "\n".join(lines))
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError(f"--emit-config {path}: cannot write ({e.strerror})") from None
    # On stderr: stdout may be the plan's JSON.
    print(f"wrote {path}: set its data, then run it with ultrascale train --config {path}", file=sys.stderr)
    if launch == "slurm":
        script = write_sbatch(path, t["nproc"], node_size, f"ultrascale-{shape.name}")
        print(f"wrote {script}: sbatch {script} starts it on {nodes_of(t['nproc'], node_size)[0]} node(s)",
              file=sys.stderr)
