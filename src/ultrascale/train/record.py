"""The run record: what a checkpoint holds beside its tensors, the whole resolved run in one typed structure.

A checkpoint directory's `meta.json` is the run record of the run that wrote it. Every reader of a
checkpoint (`train --resume`, `generate`, `export`, `data info`, the integrity checks) reads it with one
function, `read_record`, and the save writes it with one, `write_record`:

    format           this structure's version: FORMAT is written, READABLE are read
    step             the training step reached (the data position: the batches are a function of it)
    optimizer_steps  AdamW's count of updates, fewer than `step` when fp16 skipped some
    world_size       how many processes wrote it (the layout itself is config.parallel)
    config           the resolved run: the model's shape, the layout, every training setting (RunConfig)
    tokenizer        what the token ids mean: {"kind": "bytes"}, or a Hugging Face directory and its files' hash
    data             what the batches were drawn from: each prepared corpus with its index's SHA-256
    router_bias      every MoE router bias (aux-loss-free balancing), by buffer name: the forward reads them
    loss_scale       fp16's dynamic loss scale (its value and the finite steps since it last changed)
    files            every other file of the directory with its size and CRC-32 (train/integrity.py)

A field a reader does not know (a record of a newer version, or an edited one) is refused in one line
naming it, never skipped: a model read without one of its fields is another model. A field an older
record lacks takes the value that version ran with (the dataclass default).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from ultrascale.config import ParallelConfig, RunConfig, TrainConfig
from ultrascale.errors import ConfigError
from ultrascale.model.config import ModelConfig

FORMAT = 3  # 3: the record lists every file with its checksum
READABLE = (2, 3)  # 2 is 3 without the file list: its tensors load the same, unverified
RECORD = "meta.json"
_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}


@dataclass(frozen=True)
class RunRecord:
    step: int
    config: RunConfig
    optimizer_steps: int
    world_size: int = 1
    tokenizer: dict | None = None  # None: written before the record kept it
    data: list = field(default_factory=list)
    router_bias: dict = field(default_factory=dict)
    loss_scale: dict | None = None
    files: dict | None = None  # None: format 2
    format: int = FORMAT

    @property
    def settings(self) -> dict:
        """The configuration as {section: {field: value}}: what a resume layers under the flags."""
        return self.config.to_dict()

    def to_json(self) -> dict:
        """Every field as it is, the configuration as its sections: what meta.json holds."""
        return {**{name: getattr(self, name) for name in _FIELDS}, "config": self.settings}


_FIELDS = tuple(f.name for f in dataclasses.fields(RunRecord))


def write_record(directory: str, record: RunRecord) -> None:
    """meta.json in `directory`, on disk before it returns (the rename that publishes a save follows)."""
    with open(os.path.join(directory, RECORD), "w") as f:
        json.dump(record.to_json(), f, indent=2)
        f.flush()
        os.fsync(f.fileno())  # as DCP does for its files: the rename must not publish an empty file


def read_record(path: str, what: str = "--resume") -> RunRecord:
    """The run record of the checkpoint in `path`, without importing torch: the CLI reads it before any
    process starts. `what` names the argument in messages.

    Every file the record lists must be there with its size (a stat each: the checksums are
    `verified`'s, once per start). A save stopped between its two renames is put back first."""
    from ultrascale.train.integrity import check_files

    put_back_old(path)
    if not os.path.isdir(path):
        raise ConfigError(f"{what} {path}: no such checkpoint directory")
    file = os.path.join(path, RECORD)
    if not os.path.isfile(file):
        raise ConfigError(f"{what} {path}: no meta.json: not a checkpoint written by `ultrascale train --save`, "
                          f"or one whose meta.json was lost (a save writes it before the directory appears): "
                          f"use another checkpoint")
    record = parse_record(_load(file, what, path), f"{what} {path}")
    if record.format >= 3:
        check_files(path, record, what)
    return record


def verified(path: str, what: str = "--resume") -> RunRecord:
    """read_record, then every file it lists against its checksum (integrity.verify)."""
    from ultrascale.train.integrity import verify

    return verify(path, read_record(path, what), what)


def _load(file: str, what: str, path: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: {file} is not valid JSON ({str(e).splitlines()[0][:80]}): "
                          f"the checkpoint is damaged; use another checkpoint") from None
    if not isinstance(d, dict) or not {"format", "step", "config"} <= d.keys():
        raise ConfigError(f"{what} {path}: {file} does not describe a checkpoint (it needs format, step "
                          f"and config): the checkpoint is damaged; use another checkpoint")
    return d


def parse_record(d: dict, where: str) -> RunRecord:
    """A RunRecord from meta.json's contents; `where` ("--resume CK") begins every refusal."""
    if d.get("format") not in READABLE:
        raise ConfigError(f"{where} was written in checkpoint format {d.get('format')}, this version reads "
                          f"formats {' and '.join(map(str, READABLE))}: use the version that wrote it")
    _refuse_unknown(where, "", d, _FIELDS)
    saved = d["config"]
    if not isinstance(saved, dict) or not all(isinstance(saved.get(s, {}), dict) for s in _SECTIONS):
        raise ConfigError(f"{where}: its meta.json's config is not {{model, parallel, train}}: the checkpoint is "
                          f"damaged; use another checkpoint")
    _refuse_unknown(where, "config.", saved, _SECTIONS)
    sections = {}
    for name, cls in _SECTIONS.items():
        values = saved.get(name, {})
        _refuse_unknown(where, f"config.{name}.", values, [f.name for f in dataclasses.fields(cls)])
        sections[name] = cls(**values)
    values = {k: d[k] for k in _FIELDS if k in d and k != "config"}
    for k in ("data", "router_bias"):  # absent or null in a record before it was kept
        if values.get(k) is None:
            values.pop(k, None)
    values.setdefault("optimizer_steps", d["step"])  # a record before it was kept counted every step as one
    return RunRecord(config=RunConfig(**sections), **values)


def _refuse_unknown(where: str, prefix: str, values: dict, known) -> None:
    for key in values:
        if key not in known:
            raise ConfigError(f"{where}: its run record holds {prefix}{key} = {json.dumps(values[key])[:60]}, which "
                              f"this version does not know: read it with the version that wrote it")


def put_back_old(path: str) -> None:
    """A save stopped between its two renames (DIR -> DIR.old, DIR.tmp -> DIR) leaves no DIR and
    the previous checkpoint as DIR.old: rename it back, as the run's next save would. Safe when
    several processes try at once (torchrun's ranks): the rename is atomic, one of them does it."""
    path = path.rstrip("/")
    old = path + ".old"
    if not os.path.exists(path) and os.path.isdir(old):
        try:
            os.replace(old, path)
        except FileNotFoundError:
            pass  # another process put it back first
        except OSError as e:
            raise ConfigError(f"{path} is missing and {old} holds the checkpoint before a save that stopped "
                              f"half-way, but it cannot be renamed back ({e.strerror}): rename it to {path}") from None
