"""The series on disk: N_topic.ipynb names, writes that are never half done, earlier episodes.

A notebook is written to a temporary file in the target directory and moved
over the final name with os.replace, so a reader (or a crash) never sees half
a notebook, and a good notebook is only ever replaced by a complete file.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile

from ultrascale.errors import ConfigError

EPISODE_FILE = re.compile(r"^(\d+)_(.+?)\.ipynb$")


def episode_number(arg) -> int:
    """--episode N: a positive integer, or a ConfigError."""
    try:
        n = int(str(arg).strip())
    except ValueError:
        n = None
    if n is None or n <= 0:
        raise ConfigError(f"--episode must be a positive integer, got {arg!r}")
    return n


def rejected_name(filename: str) -> str:
    return filename[:-len(".ipynb")] + ".rejected.ipynb"


def episode_files(directory: str, number: int | None = None) -> list[str]:
    """Good notebooks of the series in `directory` (rejected ones excluded), by episode number."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "*.ipynb")):
        m = EPISODE_FILE.match(os.path.basename(path))
        if m and not path.endswith(".rejected.ipynb") and (number is None or int(m.group(1)) == number):
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def check_writable(directory: str, flag: str = "--out") -> None:
    """Refuse a directory that cannot be written, without leaving anything behind.

    A missing directory is fine if its nearest existing parent is writable: it
    is created when the first file is saved. Probing with a real temporary file
    (rather than os.access) also holds when running as root or on read-only mounts.
    """
    path = os.path.abspath(directory)
    probe_dir = path
    while not os.path.exists(probe_dir):
        parent = os.path.dirname(probe_dir)
        if parent == probe_dir:
            break
        probe_dir = parent
    if not os.path.isdir(probe_dir):
        raise ConfigError(f"{flag} {directory} is not writable: {probe_dir} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(dir=probe_dir, prefix=".ultrascale-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ConfigError(f"{flag} {directory} is not writable ({e.strerror}); choose another directory") from e


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file and os.replace."""
    from ultrascale.preflight import publish

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)  # readable as every other file (mkstemp makes 0600)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
