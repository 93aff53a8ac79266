"""What a run checks where it starts, before any process trains.

`config.validate` judges the settings by their values alone (sizes, ranges, combinations).
What needs more is checked here, at the start of a run: the files a setting names (a
checkpoint to resume), the software and hardware it asks for (TensorBoard, W&B, the ceiling
MFU divides by), and a technique's own rules (how a pipeline cuts the model into stages).
The command line and the test harness start runs through `check_run`.
"""

from __future__ import annotations

import importlib.util
import os

from ultrascale.config import RunConfig, validate
from ultrascale.errors import ConfigError
from ultrascale.parallel.pipeline.partition import PartitionError, split
from ultrascale.train.peak import check_peak


def check_run(cfg: RunConfig, world_size: int) -> RunConfig:
    """Everything that can be found wrong before any process starts; the config with dp resolved."""
    from dataclasses import replace

    from ultrascale.train.data import resolve_tokenizer

    cfg = replace(cfg, train=resolve_tokenizer(cfg.train))  # a prepared corpus's own, recorded with the run
    t = cfg.train
    cfg = validate(cfg, world_size)
    check_peak(t.peak, t.device, t.dtype)
    if t.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'ultrascale[tensorboard]'")
    if t.wandb:
        from ultrascale.train.loggers import check_wandb

        check_wandb()
    if t.resume and not os.path.isdir(t.resume):
        raise ConfigError(f"--resume {t.resume}: no such checkpoint directory")
    check_stages(cfg)
    return cfg


def check_stages(cfg: RunConfig) -> None:
    """Lighter first or last pipeline stages must leave every stage at least one block."""
    p = cfg.parallel
    if p.pp > 1 and (p.pp_first_stage_layers or p.pp_last_stage_layers):
        try:
            split(cfg.model.layers, p.pp, p.pp_chunks, p.pp_first_stage_layers, p.pp_last_stage_layers)
        except PartitionError as e:
            raise ConfigError(str(e)) from None
