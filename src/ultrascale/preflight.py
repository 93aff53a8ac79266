"""Can the run write where it was told to? Checked before any process starts.

A run that trains for hours and then cannot write its checkpoint has lost those
hours. Each output path is checked up front: the path itself must be of the right
kind (a directory for --save, a file for the others), and the place it will be
created in must be writable. The directories a run would create do not exist
yet: what is checked is the nearest existing ancestor, by creating and removing a
probe file there (permission bits alone say nothing for root, read-only mounts
or /proc). Nothing is left behind, whether the check passes or fails.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

from ultrascale.errors import ConfigError


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _probe(flag: str, given: str, where: str) -> None:
    """Create and remove a file in the existing directory `where`, or refuse the flag."""
    if not os.path.isdir(where):
        raise ConfigError(f"{flag} {given}: {where} is a file, not a directory: choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".ultrascale-probe-", dir=where)
    except OSError as e:
        why = "it takes no new files" if e.errno == errno.ENOENT else e.strerror  # /proc says ENOENT
        raise ConfigError(f"{flag} {given}: cannot write in {where} ({why}): "
                          f"choose a path in a directory you can write to") from None
    os.close(fd)
    os.remove(probe)


def publish(tmp: str, path: str) -> None:
    """Rename a finished temporary file (written whole, from tempfile.mkstemp) to `path`, with the
    permissions a plain open() would have given it: mkstemp makes 0600, and an image, a page or a
    notebook is an ordinary file others may read (0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def check_writable_dir(flag: str, path: str) -> None:
    """A directory the run creates or replaces (a checkpoint): its parent must take new entries."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ConfigError(f"{flag} {path}: exists and is not a directory: choose a directory path")
    # The checkpoint is written next to it (DIR.tmp) and renamed: the parent is what must be writable.
    _probe(flag, path, _nearest_existing(os.path.dirname(full)))


def check_writable_file(flag: str, path: str) -> None:
    """A file the run creates or overwrites (a log, a trace)."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ConfigError(f"{flag} {path}: is a directory: give a file name")
    if os.path.exists(full):
        try:
            with open(full, "a"):  # opens for writing, changes nothing
                pass
        except OSError as e:
            raise ConfigError(f"{flag} {path}: cannot write it ({e.strerror}): "
                              f"fix its permissions or choose another file") from None
        return
    _probe(flag, path, _nearest_existing(os.path.dirname(full)))


def check_output_dir(flag: str, path: str) -> None:
    """A directory the run writes files into (profiler traces, TensorBoard events): it, or the
    ancestor it is created in, must take them."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ConfigError(f"{flag} {path}: exists and is not a directory: choose a directory path")
    _probe(flag, path, _nearest_existing(full))


def check_output_paths(train_cfg) -> None:
    """Every path a training run will write: --save, --log-jsonl, --pp-trace, --profile, --tensorboard."""
    if train_cfg.save:
        check_writable_dir("--save", train_cfg.save)
    if train_cfg.log_jsonl:
        check_writable_file("--log-jsonl", train_cfg.log_jsonl)
    if train_cfg.pp_trace:
        check_writable_file("--pp-trace", train_cfg.pp_trace)
    if getattr(train_cfg, "profile", ""):
        check_output_dir("--profile", train_cfg.profile)
    if getattr(train_cfg, "tensorboard", ""):
        check_output_dir("--tensorboard", train_cfg.tensorboard)


def offload_bytes(model) -> int:
    """What --offload disk writes, all ranks together: fp32 master weights and AdamW's two
    moments of every parameter (each element on the one rank that owns its shard)."""
    from ultrascale.model.config import count_params

    return 12 * count_params(model)


def check_offload_dir(cfg) -> None:
    """--offload disk: the directory must take files, and have room for the states of every rank."""
    p = cfg.parallel
    if p.offload != "disk":
        return
    check_output_dir("--offload-dir", p.offload_dir)
    where = _nearest_existing(os.path.abspath(p.offload_dir))
    need, free = offload_bytes(cfg.model), shutil.disk_usage(where).free
    if need > free:
        raise ConfigError(f"--offload-dir {p.offload_dir}: the optimizer states need {_size(need)} and {where} "
                          f"has {_size(free)} free: free space there or choose another directory")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
