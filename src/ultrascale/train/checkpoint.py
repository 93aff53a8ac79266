"""Save and resume a run: model, optimizer, RNG and data position, written atomically.

Layout of a checkpoint directory:
    meta.json        step, the run's configuration, world size
    rank00000.pt     each rank's model and optimizer state (its shards, if sharded)

Every rank writes into `DIR.tmp`; when all have finished, rank 0 moves the old
checkpoint aside and renames `DIR.tmp` to `DIR`, so an interrupted save leaves
the previous checkpoint intact and never a half-written one. The data position
is the step: the batches are a pure function of (seed, step).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from ultrascale.config import ConfigError

FORMAT = 1


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:05d}.pt")


def save(path: str, ctx, step: int, run_config: dict, state: dict) -> None:
    path = path.rstrip("/")
    tmp, old = path + ".tmp", path + ".old"
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    ctx.barrier()
    state = dict(state, rng_cpu=torch.get_rng_state(),
                 rng_cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    part = _rank_file(tmp, ctx.rank)
    torch.save(state, part + ".part")
    os.replace(part + ".part", part)
    ctx.barrier()
    if ctx.rank == 0:
        meta = {"format": FORMAT, "step": step, "world_size": ctx.world_size, "config": run_config}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    ctx.barrier()


def read_meta(path: str) -> dict:
    meta_file = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_file):
        raise ConfigError(f"--resume {path}: no meta.json, not a checkpoint written by --save")
    with open(meta_file) as f:
        return json.load(f)


def check_compatible(path: str, meta: dict, run_config: dict, world_size: int) -> None:
    """Refuse, with the reason, a checkpoint that this run cannot continue."""
    saved_model, model = meta["config"]["model"], run_config["model"]
    diffs = [f"{k} {saved_model.get(k)} vs {model[k]}" for k in model
             if k not in ("name",) and saved_model.get(k) != model[k]]
    if diffs:
        raise ConfigError(f"--resume {path} holds a model of another shape ({'; '.join(diffs[:3])}): "
                          f"resume with the same model flags or start a new run")
    if meta["world_size"] != world_size or meta["config"]["parallel"] != run_config["parallel"]:
        raise ConfigError(f"--resume {path} was written by another parallel layout "
                          f"({meta['config']['parallel']}): resume with the same layout")


def check_resume(path: str, run_config: dict, world_size: int, steps: int) -> dict:
    """Everything that makes `path` unusable for this run, refused before any work; returns its meta."""
    meta = read_meta(path)
    check_compatible(path, meta, run_config, world_size)
    if meta["step"] >= steps:
        raise ConfigError(f"--resume {path} is already at step {meta['step']} and --steps {steps} "
                          f"counts all steps: pass a larger --steps")
    return meta


def load(path: str, rank: int) -> dict:
    state = torch.load(_rank_file(path, rank), map_location="cpu", weights_only=False)
    torch.set_rng_state(state["rng_cpu"])
    if state.get("rng_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    return state


def clean_partial(path: str) -> None:
    """Remove what an interrupted or failed `save` left: `DIR.tmp`, and put back `DIR.old`.

    `save` writes into DIR.tmp and only then swaps it in (DIR -> DIR.old, DIR.tmp -> DIR),
    so DIR.tmp is never a finished checkpoint anyone relies on; DIR.old is the last good
    one only if the swap stopped half-way (DIR missing). Call it from one process.
    """
    path = path.rstrip("/")
    tmp, old = path + ".tmp", path + ".old"
    if not os.path.exists(path) and os.path.isdir(old):
        os.replace(old, path)
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
