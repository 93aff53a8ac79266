"""Training data whose global batch is a pure function of (seed, step).

This is what makes "the parallel run equals the single-process run" testable:
step k draws its `global_batch` windows from the token stream with a generator
seeded by (seed, k). Every layout then cuts the same [global_batch, seq_len + 1]
tensor the same way: contiguous slices per data-parallel rank, then per
micro-batch. Resuming at step k needs nothing but k.

Sources, all read in a fixed (sorted) order:
- "" (the default): the Python standard library's own source files, present on
  every machine with Python, so a first run needs no download;
- a text file, a directory (its files, recursively), or a glob;
- JSON Lines (`.jsonl`): the `--data-column` field of each line;
- `hf:NAME_OR_PATH`: a Hugging Face `datasets` dataset (a directory written by
  `save_to_disk`, a local folder of data files, or a hub name where the network allows).
"""

from __future__ import annotations

import functools
import glob as globlib
import json
import os
import sysconfig
import zlib

import torch

from ultrascale.errors import ConfigError

# A cap on the tokens held in memory: plenty for the short runs this engine makes
# on a laptop; a real pretraining corpus would be pre-tokenised and memory-mapped.
DEFAULT_MAX_TOKENS = 8_000_000


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, and 256 as the end-of-document token."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> torch.Tensor:
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.int32)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)

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
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id if self.tok.eos_token_id is not None else self.vocab_size - 1

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int32)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str):
    return ByteTokenizer() if spec in ("", "bytes") else HFTokenizer(spec)


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "idlelib"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def _text_files(spec: str) -> list[str]:
    if os.path.isdir(spec):
        found = [os.path.join(d, f) for d, _, fs in os.walk(spec) for f in fs]
    elif os.path.isfile(spec):
        found = [spec]
    else:
        found = [p for p in globlib.glob(spec, recursive=True) if os.path.isfile(p)]
        if not found:
            raise ConfigError(f"--data {spec}: no such file, directory or matching glob")
    return sorted(found)


def _read_file(path: str, column: str):
    with open(path, encoding="utf-8", errors="replace") as f:
        if not path.endswith(".jsonl"):
            yield f.read()
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"--data {path}: line {n} is not valid JSON") from None
            if not isinstance(record, dict) or column not in record:
                raise ConfigError(f"--data {path}: line {n} has no {column!r} field; set --data-column")
            yield str(record[column])


def _hf_documents(name: str, column: str, split: str):
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
        raise ConfigError(f"--data hf:{name}: no column {column!r} (columns: {', '.join(ds.column_names)}); set --data-column")
    for record in ds:
        yield str(record[column])


def iter_documents(spec: str, column: str = "text", split: str = "train"):
    if spec.startswith("hf:"):
        yield from _hf_documents(spec[3:], column, split)
        return
    for path in stdlib_files() if spec == "" else _text_files(spec):
        yield from _read_file(path, column)


@functools.lru_cache(maxsize=4)
def load_tokens(spec: str, tokenizer: str = "bytes", column: str = "text", split: str = "train",
                max_tokens: int = DEFAULT_MAX_TOKENS) -> torch.Tensor:
    """All documents as one int32 stream, each followed by the end-of-document token."""
    tok = load_tokenizer(tokenizer)
    chunks, total = [], 0
    for doc in iter_documents(spec, column, split):
        ids = tok.encode(doc)
        chunks += [ids, torch.tensor([tok.eos_id], dtype=torch.int32)]
        total += len(ids) + 1
        if total >= max_tokens:
            break
    if not chunks:
        raise ConfigError(f"--data {spec or 'stdlib'}: no documents found")
    return torch.cat(chunks)[:max_tokens]


class TokenBatches:
    """The global batch of every step, and each rank's micro-batches of it."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int):
        # A window is seq_len + 1 tokens: seq_len inputs and, shifted by one, seq_len targets.
        if len(tokens) < seq_len + 1:
            raise ConfigError(f"the data has {len(tokens)} tokens, fewer than --seq-len + 1 = {seq_len + 1}: "
                              f"give more data or a shorter --seq-len")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed

    def global_batch_at(self, step: int) -> torch.Tensor:
        """[global_batch, seq_len + 1] int64: inputs are [:, :-1], targets [:, 1:]."""
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{step}".encode()))
        # Windows [s, s + seq_len + 1) for every s in 0..len - seq_len - 1 (randint's bound is exclusive).
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (self.global_batch,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        return self.tokens[idx].long()

    def micro_batches(self, step: int, dp_rank: int, dp: int, grad_accum: int, device="cpu"):
        """This data-parallel rank's grad_accum micro-batches of step `step`, as (inputs, targets).

        Rank r owns rows [r * G/dp, (r+1) * G/dp) of the global batch; micro-batch j
        is the j-th consecutive slice of those rows.
        """
        if self.global_batch % (dp * grad_accum):
            raise ValueError(f"global batch {self.global_batch} is not divisible by dp * grad_accum = "
                             f"{dp} * {grad_accum}")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp - 1}")
        batch = self.global_batch_at(step)
        rows = batch.chunk(dp)[dp_rank]
        return [(mb[:, :-1].to(device), mb[:, 1:].to(device)) for mb in rows.chunk(grad_accum)]
