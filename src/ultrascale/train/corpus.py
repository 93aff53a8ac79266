"""A corpus as documents, cut the same way whether it is read into memory or prepared on disk.

A source (`--data`) is enumerated as *segments*, each a piece of one input that
can be read on its own: a byte range of a text or JSONL file (cut at a line end),
the row groups of a parquet file, a range of rows of a Hugging Face dataset.
Segments are grouped into *pieces* of about PIECE_BYTES, the unit of work of
`ultrascale data prepare` (one per worker at a time, one shard per piece).

Every document (a text file, a JSONL line, a row) is cut at line ends into
*sections* of at most SECTION_CHARS characters, and each section goes to the
training or the held-out validation split by a hash of where it lies (its
segment's key and its number in it), never by chance or by the order the
workers finish in: the same corpus gives the same two token streams in memory
and prepared, on one core or on sixteen (Megatron splits by documents, nanoGPT
by the tail of the text; sections keep a corpus of a few long files splittable
too). The end-of-document token follows each document's last section.

This module imports numpy only: `prepare` runs it in worker processes.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

from ultrascale.errors import ConfigError

PIECE_BYTES = 16 * 2**20  # the work of one prepare task; a text file larger than this is read in blocks
SECTION_CHARS = 8 * 1024  # the unit of the train / validation split: a page or two of text
HF_ROWS = 20_000  # rows of a Hugging Face dataset per segment


# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, and 256 as the end-of-document token."""

    vocab_size = 257
    eos_id = 256
    identity = {"kind": "bytes"}

    def encode_np(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (tokenizer.json or what AutoTokenizer reads)."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise ConfigError(f"--tokenizer {path}: not a directory; give 'bytes' or a local tokenizer directory")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("--tokenizer needs the transformers package: pip install 'ultrascale[hf]'") from None
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer {path}: cannot load a tokenizer from it ({str(e).splitlines()[0]})") from None
        self.path = path
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id if self.tok.eos_token_id is not None else self.vocab_size - 1

    @property
    def identity(self) -> dict:
        """What the tokens mean: the directory's files, hashed (a prepared corpus keeps this)."""
        return {"kind": "hf", "path": os.path.abspath(self.path), "sha256": directory_sha256(self.path),
                "vocab_size": self.vocab_size}

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def directory_sha256(path: str) -> str:
    """The SHA-256 of a tokenizer directory's files, names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            h.update(name.encode() + b"\0")
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def tokenizer_for(spec: str):
    return ByteTokenizer() if spec in ("", "bytes") else HFTokenizer(spec)


# ----------------------------------------------------------------------------- sources as segments


@dataclass(frozen=True)
class Segment:
    kind: str  # text | jsonl | parquet | hf
    path: str
    start: int  # bytes (text, jsonl), row group (parquet) or row (hf)
    end: int
    key: str  # where it lies, independent of the machine: the split hashes it
    size: int  # bytes, or an estimate: what groups segments into pieces
    last: bool = True  # text: the segment ends the file (its document ends here)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib_root()):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "idlelib"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def text_files(spec: str) -> list[str]:
    """The files a text source names, binary ones left out (binary_files says which)."""
    return split_binary(spec)[0]


def binary_files(spec: str) -> list[str]:
    """The files of a directory or glob source that are not text (compiled bytecode, images, archives)."""
    return split_binary(spec)[1]


def is_binary(path: str) -> bool:
    """git's rule: a NUL byte in the first 8,000 bytes (text in any encoding of ASCII has none);
    parquet is a source format of its own."""
    if path.endswith(".parquet"):
        return False
    with open(path, "rb") as f:
        return b"\0" in f.read(8000)


def split_binary(spec: str) -> tuple[list[str], list[str]]:
    if os.path.isdir(spec):
        found = [os.path.join(d, f) for d, _, fs in os.walk(spec) for f in fs]
    elif os.path.isfile(spec):
        return [spec], []  # a file named alone is read as asked
    else:
        found = [p for p in globlib.glob(spec, recursive=True) if os.path.isfile(p)]
        if not found:
            raise ConfigError(f"--data {spec}: no such file, directory or matching glob")
    binary = {p for p in found if is_binary(p)}
    return sorted(set(found) - binary), sorted(binary)


def _line_cuts(path: str, size: int, block: int) -> list[int]:
    """Byte offsets that cut a file into blocks of about `block` bytes, each after a newline."""
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + block < size:
            f.seek(cuts[-1] + block)
            rest = f.read(1 << 20)
            nl = rest.find(b"\n")
            cut = cuts[-1] + block + (nl + 1 if nl >= 0 else len(rest))
            if cut >= size:
                break
            cuts.append(cut)
    return cuts + [size]


def _file_segments(path: str, root: str, block: int) -> list[Segment]:
    rel = os.path.relpath(path, root)
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"--data {path}: parquet needs the pyarrow package: pip install pyarrow") from None
        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as e:  # pyarrow raises its own error types for a file it cannot parse
            raise ConfigError(f"--data {path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
        groups = [(g, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
        return [Segment("parquet", path, g, g + 1, f"{rel}:{g}", max(1, b)) for g, b in groups]
    kind = "jsonl" if path.endswith(".jsonl") else "text"
    size = os.path.getsize(path)
    cuts = _line_cuts(path, size, block)
    return [Segment(kind, path, a, b, f"{rel}:{a}", max(1, b - a), last=b == size)
            for a, b in zip(cuts, cuts[1:] or [size])] if size else [Segment(kind, path, 0, 0, f"{rel}:0", 1)]


def _hf_dataset(name: str, column: str, split: str):
    try:
        import datasets
    except ImportError:
        raise ConfigError("--data hf:... needs the datasets package: pip install 'ultrascale[hf]'") from None
    try:
        if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_dict.json")):
            ds = datasets.load_from_disk(name)[split]
        elif os.path.isdir(name) and os.path.exists(os.path.join(name, "state.json")):
            ds = datasets.load_from_disk(name)
        else:
            ds = datasets.load_dataset(name, split=split)
    except (FileNotFoundError, ValueError, KeyError, ConnectionError, OSError) as e:
        raise ConfigError(f"--data hf:{name}: cannot load split {split!r} ({str(e).splitlines()[0]})") from None
    if column not in ds.column_names:
        raise ConfigError(f"--data hf:{name}: no column {column!r} (columns: {', '.join(ds.column_names)}); "
                          f"set --data-column")
    return ds


def segments(spec: str, column: str = "text", split: str = "train", block: int = PIECE_BYTES) -> list[Segment]:
    """The source as segments, in a fixed order (sorted files; rows in order)."""
    if spec.startswith("hf:"):
        ds = _hf_dataset(spec[3:], column, split)
        n = len(ds)
        return [Segment("hf", spec[3:], a, min(a + HF_ROWS, n), f"{split}:{a}", HF_ROWS * 512)
                for a in range(0, n, HF_ROWS)]
    if spec == "":
        files, root = stdlib_files(), stdlib_root()
    else:
        files = text_files(spec)
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files]) if files else ""
    return [s for f in files for s in _file_segments(os.path.abspath(f), root, block)]


def pieces(segs: list[Segment], budget: int = PIECE_BYTES) -> list[list[Segment]]:
    """Consecutive segments grouped into pieces of about `budget` bytes."""
    out, size = [[]], 0
    for s in segs:
        if out[-1] and size + s.size > budget:
            out.append([])
            size = 0
        out[-1].append(s)
        size += s.size
    return [p for p in out if p]


# ----------------------------------------------------------------------------- documents and sections


def documents(seg: Segment, column: str = "text", split: str = "train"):
    """(text, ends_a_document) for each document (or, in a text file read in blocks, part of one)."""
    if seg.kind == "text":
        with open(seg.path, "rb") as f:
            f.seek(seg.start)
            yield f.read(seg.end - seg.start).decode("utf-8", errors="replace"), seg.last
    elif seg.kind == "jsonl":
        with open(seg.path, "rb") as f:
            f.seek(seg.start)
            lines = f.read(seg.end - seg.start).decode("utf-8", errors="replace").split("\n")
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"--data {seg.path}: line {_line_number(seg, n)} is not valid JSON") from None
            if not isinstance(record, dict) or column not in record:
                raise ConfigError(f"--data {seg.path}: line {_line_number(seg, n)} has no {column!r} field; "
                                  f"set --data-column")
            yield str(record[column]), True
    elif seg.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(seg.path).read_row_group(seg.start)
        if column not in table.column_names:
            raise ConfigError(f"--data {seg.path}: no column {column!r} (columns: {', '.join(table.column_names)}); "
                              f"set --data-column")
        for value in table.column(column).to_pylist():
            yield str(value), True
    else:
        ds = _hf_dataset(seg.path, column, split)
        for value in ds.select(range(seg.start, seg.end))[column]:
            yield str(value), True


def _line_number(seg: Segment, n: int) -> int:
    """The 1-based line number in the file of line n of this segment (only for an error message)."""
    with open(seg.path, "rb") as f:
        return f.read(seg.start).count(b"\n") + n + 1


def sections(text: str, size: int = SECTION_CHARS) -> list[str]:
    """`text` cut after a newline into parts of at most `size` characters (a line longer than that is cut
    where it must); joined, they are `text` again."""
    out, start = [], 0
    while len(text) - start > size:
        cut = text.rfind("\n", start, start + size)
        end = cut + 1 if cut >= start else start + size
        out.append(text[start:end])
        start = end
    out.append(text[start:])
    return out


def held_out(key: str, fraction: float) -> bool:
    """Whether the section at `key` belongs to the validation split: a hash, the same on every machine."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return fraction > 0 and int.from_bytes(digest, "little") / 2**64 < fraction


def tokenized_sections(seg: Segment, tokenizer, val_fraction: float, column: str = "text", split: str = "train"):
    """(split name, int32 tokens, ends a document) for each section of a segment, in order: the
    end-of-document token is in the tokens of a document's last section."""
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    number = 0
    for text, doc_ends in documents(seg, column, split):
        cut = sections(text)
        for i, part in enumerate(cut):
            which = "val" if held_out(f"{seg.key}:{number}", val_fraction) else "train"
            number += 1
            ids = tokenizer.encode_np(part)
            last = doc_ends and i == len(cut) - 1
            yield which, np.concatenate([ids, eos]) if last else ids, last


def tokenize_piece(piece: list[Segment], tokenizer, val_fraction: float, column: str = "text",
                   split: str = "train") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train": (tokens, document ends), "val": (...)} of one piece: int32 tokens, int64 offsets after
    each end-of-document token."""
    parts: dict[str, list] = {"train": [], "val": []}
    ends: dict[str, list] = {"train": [], "val": []}
    filled = {"train": 0, "val": 0}
    for seg in piece:
        for which, ids, last in tokenized_sections(seg, tokenizer, val_fraction, column, split):
            parts[which].append(ids)
            filled[which] += len(ids)
            if last:
                ends[which].append(filled[which])
    return {k: (np.concatenate(parts[k]) if parts[k] else np.empty(0, dtype=np.int32),
                np.asarray(ends[k], dtype=np.int64)) for k in parts}
