"""The files of a checkpoint, their sizes and checksums: what meta.json lists, and a
directory checked against it. No torch here: the command checks a checkpoint before
any process starts.

meta.json's "files" maps each file DCP wrote (its index `.metadata` and every
`__N_0.distcp`) to {"bytes": size, "crc32": 8 hex digits}. CRC-32 because the
damage to find is accidental (a truncated copy, a lost file, a flipped bit), not
deliberate: it catches every error burst up to 32 bits and misses random damage
with probability 2^-32, and zlib computes it at about 2 GB/s on one core, six
times the standard library's sha256 (measured: 2.2 against 0.35 GB/s), which
counts for a checkpoint of hundreds of megabytes or more, read once per start.

Two depths of checking:
- `check_files`: every listed file is there with its size. A stat each, so every
  reader does it (each rank of a resumed run, before DCP opens anything);
- `verify`: that, and every byte against its checksum. Once per start: the
  launcher (or the one process) before any worker starts, and `export`.
"""

from __future__ import annotations

import os
import sys
import zlib

from ultrascale.errors import ConfigError

CHUNK = 1 << 22  # bytes read at a time: the memory used stays small whatever the file's size
ALGORITHM = "crc32"
_FIX = "copy the checkpoint again from where it was written, or use an earlier one"


def checksum(path: str) -> str:
    """CRC-32 of a file's bytes, streamed, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def describe(directory: str, names) -> dict:
    """{name: {"bytes": size, "crc32": checksum}} of files in `directory` (what meta.json lists)."""
    return {n: {"bytes": os.path.getsize(os.path.join(directory, n)),
                ALGORITHM: checksum(os.path.join(directory, n))} for n in names}


def check_files(path: str, record, what: str) -> None:
    """Every file the run record (train/record.py) lists is in `path` with its size; a ConfigError
    names the first that is not."""
    files = record.files
    if not isinstance(files, dict) or not files or not all(_entry(e) for e in files.values()):
        raise ConfigError(f"{what} {path}: meta.json does not list the checkpoint's files with their sizes and "
                          f"checksums, as format {record.format} does: it was edited or damaged; {_FIX}")
    for name, want in sorted(files.items()):
        file = os.path.join(path, name)
        try:
            size = os.path.getsize(file)
        except FileNotFoundError:
            raise ConfigError(f"{what} {path}: {file} is missing (meta.json lists {len(files)} files): "
                              f"the checkpoint is incomplete; {_FIX}") from None
        if size != want["bytes"]:
            raise ConfigError(f"{what} {path}: {file} has {size} bytes, meta.json says {want['bytes']}: "
                              f"the file is {'truncated' if size < want['bytes'] else 'damaged'}; {_FIX}")


def _entry(e) -> bool:
    return isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get(ALGORITHM), str)


def verify(path: str, record, what: str = "--resume"):
    """Every file a checkpoint's run record lists against its checksum; the record. `record` is what
    record.read_record read, which has checked each file's size already (so a missing or truncated
    file fails before any byte is read).

    A checkpoint of format 2 lists no files: it is accepted with a warning on stderr
    (its tensors are stored as in format 3, so it loads as before, unchecked)."""
    if record.format == 2:
        print(f"ultrascale: warning: {what} {path} is a checkpoint of format 2, which lists no checksums: "
              f"it is loaded unverified; a save from it (train --resume {path} --save DIR) writes format 3, "
              f"which is verified", file=sys.stderr, flush=True)
        return record
    for name, want in sorted(record.files.items()):
        file = os.path.join(path, name)
        got = checksum(file)
        if got != want[ALGORITHM]:
            raise ConfigError(f"{what} {path}: {file} is damaged: its {ALGORITHM} is {got}, meta.json says "
                              f"{want[ALGORITHM]} (same size, different bytes); {_FIX}")
    return record
