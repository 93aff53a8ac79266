"""What a resumed run takes from its checkpoint, and what it must not change.

`ultrascale train --resume CK` alone continues the run: every setting not given
on the command line (or in --config) is the checkpoint's, but for what this
invocation writes and does (THIS_RUN below: its --save, logs, traces). Settings
are of these kinds:

- the math of the continuation: the model's shape, the seed and the data (the
  batches are a function of them and of the step), the tokenizer, the sequence
  length, the global batch, the precision and the optimizer's recipe. Changing
  one gives another run, so a value that differs from the checkpoint's is
  refused, naming the setting, both values and the flag;
- the layout: how many processes, dp/tp/pp/cp sizes, ZeRO stage, dp mode,
  bucket size, schedule, micro-batch split, recomputation. The checkpoint is
  stored layout-free (train/checkpoint.py), so these are free: given none of
  --nproc/--dp/--tp/--pp/--cp/--ep, the checkpoint's layout is used; given any,
  the layout is the one asked for. The micro-batch and accumulation adapt so
  that the global batch stays the checkpoint's.
"""

from __future__ import annotations

import os

from ultrascale.errors import ConfigError
from ultrascale.train.record import RunRecord, put_back_old, read_record
# TrainConfig fields that change what the continuation computes.
SAME_TRAIN = ("seq_len", "seed", "data", "data_column", "data_split", "tokenizer", "val_fraction", "dtype", "lr", "min_lr_ratio",
              "warmup_steps", "lr_schedule", "lr_decay_steps", "lr_decay_fraction", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "fp8",
              "loss_scale_window")
# Of those, the learning-rate schedule: --override-schedule takes this run's (lr_at is a function
# of the step and these alone, so the continuation simply follows the new curve from the saved step).
SCHEDULE = ("lr", "min_lr_ratio", "warmup_steps", "lr_schedule", "lr_decay_steps", "lr_decay_fraction")
GRID = ("dp", "tp", "pp", "cp", "ep")
# Every other TrainConfig field, by what a plain --resume does with it (tests/test_resume_fields.py
# enumerates the fields: one that is in none of these lists fails it).
# Taken with the layout when no --nproc/--dp/--tp/--pp/--cp/--ep is given (else chosen to keep the global batch).
LAYOUT_TRAIN = ("nproc", "micro_batch", "grad_accum", "global_batch")
# The run's own settings, free to change: the checkpoint's unless given.
KEPT = ("steps", "eval_every", "eval_batches", "log_every", "recompute", "compile", "loss_scale_init", "peak",
        "device", "timeout", "progress", "measure_activations")
# How the run saves: the checkpoint's when this run saves too (--save), else there is nothing to keep.
KEPT_WHEN_SAVING = ("save_every", "keep_last")
# What this invocation does and where it writes what it observes: never taken from the checkpoint.
THIS_RUN = {
    "resume": "the checkpoint itself",
    "init_from": "a start from other weights, which a resume is not",
    "override_schedule": "a choice made for this continuation",
    "overwrite": "a permission given for one --save",
    "save": "where this run saves: a resume that names none saves nothing, as its flags say",
    "log_jsonl": "a file this run writes: the saved run's own log would be written over",
    "tensorboard": "a directory this run writes",
    "wandb": "a project this run logs to",
    "profile": "a directory this run writes traces into",
    "profile_steps": "goes with --profile",
    "pp_trace": "a file this run writes",
}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def resume_layer(saved: dict, given: dict) -> dict:
    """The checkpoint's settings to use where `given` (TOML file and flags, by section) says nothing."""
    from ultrascale.model.config import PRESETS

    layer = {"model": {}, "parallel": {}, "train": {}}
    if "preset" not in given["model"]:
        model = dict(saved["model"])
        name = model.pop("name")
        layer["model"] = {"preset": name if name in PRESETS else "tiny", **model}  # every field given: shape exact
    kept = SAME_TRAIN + KEPT + (KEPT_WHEN_SAVING if given["train"].get("save") else ())
    layer["train"] = {k: saved["train"][k] for k in kept if k in saved["train"]}
    if not any(k in given["parallel"] for k in GRID) and "nproc" not in given["train"]:
        layer["parallel"] = dict(saved["parallel"])
        for k in LAYOUT_TRAIN:
            if k in saved["train"]:
                layer["train"][k] = saved["train"][k]
    elif "micro_batch" not in given["train"]:
        layer["train"]["micro_batch"] = saved["train"]["micro_batch"]
    return layer


def global_batch(d: dict) -> int:
    return d["train"]["micro_batch"] * d["train"]["grad_accum"] * d["parallel"]["dp"]


def fit_global_batch(cfg, saved: dict, given: dict, world_size: int):
    """Choose grad_accum (unless given) so the global batch is the saved one, in the layout `cfg`
    asks for on `world_size` processes. Called before `config.validate`, whose checks depend on
    the accumulation (a pipeline schedule's micro-batches): a layout or micro-batch it would
    refuse is left to it, the config unchanged."""
    import dataclasses

    want, t = global_batch(saved), cfg.train
    if "grad_accum" in given["train"] or t.micro_batch <= 0:
        return cfg
    try:
        dp = cfg.parallel.resolve(world_size).dp
    except ConfigError:
        return cfg  # validate says why, in its own order
    per_step = t.micro_batch * dp
    if want % per_step:
        raise ConfigError(f"--resume {t.resume}: the checkpoint's global batch is {want} sequences, which "
                          f"--micro-batch {t.micro_batch} x dp {dp} does not divide: pick a "
                          f"--micro-batch that does")
    return dataclasses.replace(cfg, train=dataclasses.replace(t, grad_accum=want // per_step))


def check_resume(path: str, record: RunRecord, cfg) -> None:
    """Refuse, naming the setting, a run that would not continue the checkpoint's."""
    saved, here = record.settings, cfg.to_dict()
    for k, v in saved["model"].items():
        if k != "name" and here["model"].get(k) != v:
            raise ConfigError(f"--resume {path} holds a model with {k} = {v}, this run asks for {here['model'].get(k)}"
                              f": resume with the checkpoint's model (drop --model and {_flag(k)})")
    for k in SAME_TRAIN:
        if cfg.train.override_schedule and k in SCHEDULE:
            continue
        if k == "lr_decay_steps" and not here["train"][k]:
            continue  # not given: the checkpoint's (Trainer._resume takes it)
        if k == "tokenizer" and saved["train"].get("data") == here["train"]["data"] and _prepared(here["train"]["data"]):
            continue  # a prepared corpus names its own (a checkpoint before the run recorded it says "bytes")
        if here["train"][k] != saved["train"][k]:
            other = (f", or add --override-schedule to continue it with this {_flag(k)}" if k in SCHEDULE
                     else " (or start a new one)")
            raise ConfigError(f"--resume {path} was trained with {_flag(k)} {saved['train'][k]}, this run asks for "
                              f"{here['train'][k]}: drop {_flag(k)} to continue the run{other}")
    if global_batch(saved) != cfg.global_batch:
        raise ConfigError(f"--resume {path} was trained on {global_batch(saved)} sequences per step, this run on "
                          f"{cfg.global_batch} (micro-batch x grad-accum x dp): keep the global batch, e.g. drop "
                          f"--grad-accum and it is chosen for you")
    if record.step >= cfg.train.steps:
        raise ConfigError(f"--resume {path} is already at step {record.step} and --steps {cfg.train.steps} "
                          f"counts all steps: pass a larger --steps")
    check_same_data(path, record, cfg.train.data)


def check_same_data(path: str, record: RunRecord, data: str) -> None:
    """The prepared corpora the record names still hold the tokens the run trained on: a corpus
    prepared again in the same directory (other files, another tokenizer) gives other batches."""
    from ultrascale.train.data import data_identity

    if not record.data or data != record.config.train.data:
        return
    for saved, now in zip(record.data, data_identity(data)):
        if saved != now:
            raise ConfigError(f"--resume {path} trained on {saved['path']}, whose index.json has changed since "
                              f"(it was prepared again): the batches would differ; resume with the corpus as it "
                              f"was, or start a new run")


# What makes a checkpoint another run's, besides the model's shape: what its batches are drawn from.
RUN_IDENTITY = ("seed", "data", "data_column", "data_split", "tokenizer", "val_fraction", "seq_len")


def check_save_target(cfg) -> None:
    """--save DIR that holds a checkpoint of another run (another model shape, seed or data) is
    refused before the run, unless --overwrite: a run that trained for hours must not replace
    another's work without a word. Saving into the checkpoint this run resumes from continues it,
    and a checkpoint of this same run (the same model and data: a run started again) is replaced."""
    t = cfg.train
    if not t.save or t.overwrite:
        return
    path = t.save.rstrip("/")
    if t.resume and os.path.realpath(t.resume.rstrip("/")) in (
            os.path.realpath(path), os.path.realpath(latest(path))):
        return
    if t.keep_last and step_dirs(path):
        path = latest(path)  # a directory of per-step checkpoints: the run they belong to is the latest's
    elif t.keep_last and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "meta.json")):
        return  # the per-step checkpoints go into subdirectories: other files beside them are left alone
    put_back_old(path)
    if not os.path.isfile(os.path.join(path, "meta.json")):
        if os.path.isdir(path) and os.listdir(path):
            raise ConfigError(f"--save {t.save} is a directory of other files, not a checkpoint: --save another "
                              f"directory, or add --overwrite to replace it")
        return
    try:
        saved = read_record(path, "--save").settings
        here = cfg.to_dict()
        differ = [(k, v, here["model"].get(k)) for k, v in saved["model"].items()
                  if k != "name" and here["model"].get(k) != v]
        if differ and saved["model"].get("name") != here["model"].get("name"):
            differ.insert(0, ("model", saved["model"].get("name"), here["model"].get("name")))
        differ += [(k, saved["train"][k], here["train"][k]) for k in RUN_IDENTITY
                   if k in saved["train"] and _same(k, saved["train"][k]) != _same(k, here["train"][k])
                   and not (k == "tokenizer" and _prepared(here["train"]["data"]))]
    except (ConfigError, OSError):
        differ = [("meta.json", "unreadable", None)]
    if differ:
        k, theirs, ours = differ[0]
        what = ("a damaged checkpoint" if k == "meta.json" else
                f"the checkpoint of another run ({k} {theirs!r}, this run {ours!r})")
        raise ConfigError(f"--save {t.save} holds {what}: add --overwrite to replace it, --save another directory, "
                          f"or --resume {t.save} to continue it")


def _prepared(data: str) -> bool:
    from ultrascale.train.data import is_prepared_spec

    return is_prepared_spec(data)


def _same(key: str, value):
    """A path-valued setting as a comparable path (./corpus and corpus are one corpus)."""
    if key in ("data", "tokenizer") and isinstance(value, str) and value and not value.startswith("hf:") \
            and value != "bytes":
        return os.path.normpath(os.path.abspath(value))
    return value


STEP_DIR = "step-{:06d}"  # --keep-last: each save in its own directory under --save


def step_dirs(path: str) -> list[tuple[int, str]]:
    """(step, directory) of the finished per-step checkpoints under `path` (--keep-last), oldest first."""
    if not os.path.isdir(path):
        return []
    found = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.startswith("step-") and name[5:].isdigit() and os.path.isfile(os.path.join(full, "meta.json")):
            found.append((int(name[5:]), full))
    return sorted(found)


def latest(path: str) -> str:
    """The checkpoint `path` names: itself, or, for a directory of per-step checkpoints (--keep-last),
    the one of the latest step (torchtitan's `checkpoint/step-N`, read the same way)."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    steps = step_dirs(path)
    return steps[-1][1] if steps else path
