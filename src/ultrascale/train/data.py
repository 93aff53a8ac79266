"""Training data whose global batch is a pure function of (seed, step).

This is what makes "the parallel run equals the single-process run" testable:
every layout cuts the same [global_batch, seq_len + 1] tensor the same way
(contiguous rows per data-parallel rank, then per micro-batch), and resuming at
step k needs nothing but k.

A corpus is cut into windows of seq_len + 1 tokens that overlap by one token
(seq_len inputs and, shifted by one, seq_len targets), so each token is a target
once per epoch. Training draws the windows *without replacement*: epoch e visits
all of them in an order that is a keyed permutation (a Feistel network, seeded by
(seed, corpus, e)), evaluated for just the windows a step needs, so neither memory
nor start-up grows with the corpus. Sample c of a corpus is window
perm_e(c mod N) with e = c // N. Several corpora are blended with weights: each
step's rows are apportioned to them (largest remainders), and the rows mixed by a
permutation seeded by (seed, step).

Sources (`--data`), all read in a fixed (sorted) order:
- "" (the default): the Python standard library's own source files, present on
  every machine with Python, so a first run needs no download: the first
  DEFAULT_MAX_TOKENS tokens of them, as the run's header says;
- a text file, a directory (its files, recursively), or a glob, of text, JSON
  Lines (`.jsonl`, the `--data-column` field of each line) or parquet;
- `hf:NAME_OR_PATH`: a Hugging Face `datasets` dataset (a directory written by
  `save_to_disk`, a local folder of data files, or a hub name where the network allows);
- a directory written by `ultrascale data prepare` (memory-mapped token shards, any
  size), or several with weights, Megatron's way: "0.7 DIR_A 0.3 DIR_B".
Raw sources are read into memory up to DEFAULT_MAX_TOKENS; a larger one is refused
with the prepare command to run instead, never cut short.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ultrascale.errors import ConfigError
from ultrascale.train import corpus
from ultrascale.train.corpus import stdlib_files, text_files  # noqa: F401  (the sources' names, for callers)

# The most tokens a raw (unprepared) source may hold: it is tokenized in every process at every start.
DEFAULT_MAX_TOKENS = 8_000_000
VAL_FRACTION = 0.01  # the default held-out share, in memory and prepared alike
INDEX = "index.json"  # what `data prepare` writes last: a directory holding it is a prepared corpus


class ByteTokenizer(corpus.ByteTokenizer):
    def encode(self, text: str) -> torch.Tensor:
        return torch.from_numpy(self.encode_np(text))


class HFTokenizer(corpus.HFTokenizer):
    def encode(self, text: str) -> torch.Tensor:
        return torch.from_numpy(self.encode_np(text))


def load_tokenizer(spec: str):
    return ByteTokenizer() if spec in ("", "bytes") else HFTokenizer(spec)


def iter_documents(spec: str, column: str = "text", split: str = "train"):
    """Every document's text, in order (a text file read in blocks yields the blocks of its one document)."""
    for seg in corpus.segments(spec, column, split):
        for text, _ in corpus.documents(seg, column, split):
            yield text


# ----------------------------------------------------------------------------- token streams


class Stream:
    """A split of a corpus as one token sequence: in memory, or memory-mapped shards."""

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """[len(starts), length] int64: the tokens [s, s + length) for each start s."""
        raise NotImplementedError


class InMemory(Stream):
    def __init__(self, tokens):
        self.tokens = torch.as_tensor(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, starts, length):
        idx = torch.from_numpy(np.asarray(starts, dtype=np.int64))[:, None] + torch.arange(length)
        return self.tokens[idx].long().numpy()


class Shards(Stream):
    """The shards of one split of a prepared corpus, read window by window: a read touches its bytes only.

    Each window is one positioned read (os.pread) of a file opened once, with the kernel told the
    access is random (POSIX_FADV_RANDOM): no read-ahead around it, and nothing mapped into the
    process. A memory map would do the reading with page faults, and each fault reads ahead
    around it (8 MiB on a common Linux setup): on a 1B-token corpus, 200 steps of 64 windows read
    the whole 2 GB from disk cold and left 0.7-1.9 GB of its pages in the process's resident set
    (docs/benchmarks.md, "Data")."""

    def __init__(self, root: str, entries: list[dict], dtype: str, vocab: int = 0):
        self.root, self.vocab = root, vocab  # vocab: the corpus's; an id at or past it is a damaged shard
        self.files = [os.path.join(root, e["file"]) for e in entries if e["tokens"]]
        sizes = [e["tokens"] for e in entries if e["tokens"]]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.dtype = np.dtype(dtype)
        self.fds: dict[int, int] = {}  # opened on first use

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _fd(self, i: int) -> int:
        if i not in self.fds:
            fd = os.open(self.files[i], os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.fds[i] = fd
        return self.fds[i]

    def _pread(self, i: int, start: int, count: int) -> np.ndarray:
        size = self.dtype.itemsize
        if hasattr(os, "pread"):
            data = os.pread(self._fd(i), count * size, start * size)
        else:  # no positioned read on this platform: seek and read
            with open(self.files[i], "rb") as f:
                f.seek(start * size)
                data = f.read(count * size)
        tokens = np.frombuffer(data, dtype=self.dtype)
        if self.vocab and tokens.size and int(tokens.max()) >= self.vocab:
            # Its size matched the index (read_index): its bytes did not. Cheap against the step it feeds.
            at = start + int(np.argmax(tokens >= self.vocab))
            raise ConfigError(f"--data {self.root}: shard {os.path.basename(self.files[i])} is damaged: token {at:,} "
                              f"is id {int(tokens.max())}, past the corpus's vocabulary of {self.vocab:,} "
                              f"(`ultrascale data info {self.root} --verify` checks every shard): prepare the "
                              f"corpus again")
        return tokens

    def read(self, starts, length):
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, s in enumerate(np.asarray(starts, dtype=np.int64)):
            pos, filled = int(s), 0
            while filled < length:  # a window may run over the end of a shard into the next
                i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
                local = pos - int(self.offsets[i])
                take = min(length - filled, int(self.offsets[i + 1]) - pos)
                out[row, filled:filled + take] = self._pread(i, local, take)
                filled, pos = filled + take, pos + take
        return out

    def __del__(self):
        for fd in getattr(self, "fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


# ----------------------------------------------------------------------------- an epoch's order


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64's finalizer of x ^ key: a well-mixed 64-bit hash (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        z = (x ^ np.uint64(key)) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def permute(positions, n: int, key: int) -> np.ndarray:
    """Where `positions` (in 0..n-1) go under a keyed permutation of 0..n-1, in O(1) memory.

    A 4-round balanced Feistel network permutes 0..4^h - 1 (the smallest power of four >= n);
    values that land at n or above are sent through again ("cycle walking") until they land
    below n, which keeps it a permutation of 0..n-1 (and takes under 4 rounds on average)."""
    x = np.atleast_1d(np.asarray(positions, dtype=np.uint64)).copy()
    if n <= 1:
        return np.zeros(len(x), dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [zlib.crc32(f"{key}:{r}".encode()) for r in range(4)]
    out = np.empty(len(x), dtype=np.uint64)
    todo = np.arange(len(x))
    while len(todo):
        left, right = x[todo] >> np.uint64(half), x[todo] & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        y = (left << np.uint64(half)) | right
        done = y < np.uint64(n)
        out[todo[done]] = y[done]
        x[todo[~done]] = y[~done]
        todo = todo[~done]
    return out.astype(np.int64)


def apportion(total: int, weights: list[float]) -> list[int]:
    """`total` rows shared by `weights` (Hamilton's largest remainders, ties to the first)."""
    quotas = [total * w / sum(weights) for w in weights]
    counts = [int(q) for q in quotas]
    for i in sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))[:total - sum(counts)]:
        counts[i] += 1
    return counts


@dataclass
class Source:
    stream: Stream
    weight: float = 1.0
    name: str = ""


class TokenBatches:
    """The global batch of every step, and each rank's micro-batches of it.

    `tokens` is a token tensor, a Stream, or a list of Sources (a blend). `shuffle=False` reads the
    windows in order (the validation batches: batch b is the windows after batch b - 1's)."""

    def __init__(self, tokens, seq_len: int, global_batch: int, seed: int, shuffle: bool = True):
        if isinstance(tokens, list):
            self.sources = tokens
        else:
            self.sources = [Source(tokens if isinstance(tokens, Stream) else InMemory(tokens))]
        self.seq_len, self.global_batch, self.seed, self.shuffle = seq_len, global_batch, seed, shuffle
        self.windows = []
        for s in self.sources:
            n = len(s.stream)
            if n < seq_len + 1:
                where = f"{s.name}: " if s.name else ""
                raise ConfigError(f"{where}the data has {n} tokens, fewer than --seq-len + 1 = {seq_len + 1}: "
                                  f"give more data or a shorter --seq-len")
            self.windows.append((n - 1) // seq_len)
        self.per_step = apportion(global_batch, [s.weight for s in self.sources])

    def _windows_of(self, d: int, samples: np.ndarray) -> np.ndarray:
        """The window numbers of corpus d's samples (its running count of windows drawn)."""
        n = self.windows[d]
        if not self.shuffle:
            return samples % n
        out = np.empty(len(samples), dtype=np.int64)
        epochs = samples // n
        for e in np.unique(epochs):  # a step may straddle two epochs
            at = epochs == e
            out[at] = permute(samples[at] % n, n, zlib.crc32(f"{self.seed}:{d}:{int(e)}".encode()))
        return out

    def _plan(self, step: int) -> list[tuple[int, int]]:
        """(corpus, window) of each row of step `step`'s global batch."""
        rows = []
        for d, count in enumerate(self.per_step):
            samples = step * count + np.arange(count, dtype=np.int64)
            rows += [(d, int(w)) for w in self._windows_of(d, samples)]
        if len(self.sources) > 1 and self.shuffle:
            g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{step}:mix".encode()))
            rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
        return rows

    def rows(self, step: int, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi-1 of step `step`'s global batch, [hi - lo, seq_len + 1] int64: only these are read."""
        plan = self._plan(step)[lo:hi]
        out = np.empty((len(plan), self.seq_len + 1), dtype=np.int64)
        for d in {d for d, _ in plan}:
            at = [i for i, (c, _) in enumerate(plan) if c == d]
            starts = np.array([plan[i][1] for i in at], dtype=np.int64) * self.seq_len
            out[at] = self.sources[d].stream.read(starts, self.seq_len + 1)
        return torch.from_numpy(out)

    def global_batch_at(self, step: int) -> torch.Tensor:
        """[global_batch, seq_len + 1] int64: inputs are [:, :-1], targets [:, 1:]."""
        return self.rows(step, 0, self.global_batch)

    def batches_in_order(self) -> int:
        """Global batches read in order before any window repeats (the validation batches)."""
        return min(w // c for w, c in zip(self.windows, self.per_step) if c)

    def epochs(self, steps: int) -> list[float]:
        """Epochs of each corpus after `steps` steps (1.0: every window seen once)."""
        return [steps * c / n for c, n in zip(self.per_step, self.windows)]

    def micro_batches(self, step: int, dp_rank: int, dp: int, grad_accum: int, device="cpu"):
        """This data-parallel rank's grad_accum micro-batches of step `step`, as (inputs, targets).

        Rank r owns rows [r * G/dp, (r+1) * G/dp) of the global batch (and reads only those);
        micro-batch j is the j-th consecutive slice of them.
        """
        if self.global_batch % (dp * grad_accum):
            raise ValueError(f"global batch {self.global_batch} is not divisible by dp * grad_accum = "
                             f"{dp} * {grad_accum}")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp - 1}")
        per_rank = self.global_batch // dp
        rows = self.rows(step, dp_rank * per_rank, (dp_rank + 1) * per_rank)
        return [(mb[:, :-1].to(device), mb[:, 1:].to(device)) for mb in rows.chunk(grad_accum)]


# ----------------------------------------------------------------------------- raw sources, in memory


@dataclass
class Corpus:
    train: torch.Tensor
    val: torch.Tensor
    capped: bool = False  # the default corpus, cut at its documented size


@functools.lru_cache(maxsize=4)
def load_corpus(spec: str, tokenizer: str = "bytes", column: str = "text", split: str = "train",
                val_fraction: float = 0.0, max_tokens: int = DEFAULT_MAX_TOKENS, refuse_over: bool = False) -> Corpus:
    """A raw source tokenized in memory: the training and held-out streams (corpus.py cuts both).

    Past `max_tokens` the standard library (the default corpus) stops there, as documented; any other
    source is refused with `refuse_over`, else cut at max_tokens (a caller asking for a prefix)."""
    tok = load_tokenizer(tokenizer)
    parts = {"train": [], "val": []}
    total, capped = 0, False
    for seg in corpus.segments(spec, column, split):
        for which, ids, _ in corpus.tokenized_sections(seg, tok, val_fraction, column, split):
            parts[which].append(ids)
            total += len(ids)
            if total > max_tokens:  # enough: nothing after this is read
                break
        if total > max_tokens:
            break
    if total > max_tokens and spec != "" and refuse_over:
        raise ConfigError(
            f"--data {spec}: more than {max_tokens:,} tokens, the most a raw source is read into memory "
            f"(in every process, at every start): prepare it once with `ultrascale data prepare {spec} DIR`"
            f"{'' if tokenizer in ('', 'bytes') else f' --tokenizer {tokenizer}'} and train with --data DIR")
    capped = total > max_tokens
    streams = {k: np.concatenate(v) if v else np.empty(0, dtype=np.int32) for k, v in parts.items()}
    if not len(streams["train"]) and not len(streams["val"]):
        raise ConfigError(f"--data {spec or 'stdlib'}: no documents found")
    if capped:  # the first max_tokens: the held-out share (about val_fraction of them), the rest training
        streams["val"] = streams["val"][:max_tokens]
        streams["train"] = streams["train"][:max_tokens - len(streams["val"])]
    return Corpus(torch.from_numpy(streams["train"]), torch.from_numpy(streams["val"]), capped)


def load_tokens(spec: str, tokenizer: str = "bytes", column: str = "text", split: str = "train",
                max_tokens: int = DEFAULT_MAX_TOKENS) -> torch.Tensor:
    """Every document of a raw source as one int32 stream, each followed by the end-of-document
    token, cut at `max_tokens` (no held-out split)."""
    return load_corpus(spec, tokenizer, column, split, 0.0, max_tokens).train


load_tokens.cache_clear = load_corpus.cache_clear


# ----------------------------------------------------------------------------- prepared corpora


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX))


def read_index(path: str) -> dict:
    """A prepared corpus's index; a directory that prepare did not finish is one line naming the fix."""
    index_path = os.path.join(path, INDEX)
    if not os.path.isfile(index_path):
        hint = " (prepare was interrupted: run it again to finish)" if os.path.isfile(
            os.path.join(path, ".prepare.json")) else ""
        raise ConfigError(f"--data {path}: not a prepared corpus, it has no {INDEX}{hint}")
    try:
        with open(index_path) as f:
            index = json.load(f)
        for split in ("train", "val"):
            for e in index["splits"][split]["shards"]:
                full = os.path.join(path, e["file"])
                want = e["tokens"] * np.dtype(index["dtype"]).itemsize
                if e["tokens"] and (not os.path.isfile(full) or os.path.getsize(full) != want):
                    raise ConfigError(f"--data {path}: shard {e['file']} is missing or not {want:,} bytes: "
                                      f"prepare the corpus again")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"--data {path}: {INDEX} is damaged ({e}): prepare the corpus again") from None
    return index


def parse_blend(spec: str) -> list[tuple[float, str]] | None:
    """Megatron's blend, "0.7 DIR_A 0.3 DIR_B", as [(0.7, DIR_A), (0.3, DIR_B)]; None for one source."""
    words = spec.split()
    if len(words) < 2 or len(words) % 2:
        return None
    try:
        weights = [float(w) for w in words[::2]]
    except ValueError:
        return None
    if any(not w > 0 for w in weights):
        raise ConfigError(f"--data {spec!r}: blend weights must be positive numbers")
    return list(zip(weights, words[1::2]))


def open_prepared(spec: str, split: str) -> list[Source]:
    """The Sources of a prepared corpus or a blend of them (one split: train or val)."""
    blend = parse_blend(spec) or [(1.0, spec)]
    sources, tokenizers = [], set()
    for weight, path in blend:
        index = read_index(path)
        tokenizers.add(json.dumps(index["tokenizer"], sort_keys=True))
        sources.append(Source(Shards(path, index["splits"][split]["shards"], index["dtype"], index.get("vocab_size", 0)),
                              weight, path))
    if len(tokenizers) > 1:
        raise ConfigError(f"--data {spec!r}: the blended corpora were prepared with different tokenizers")
    return sources


def prepared_tokenizer(spec: str) -> dict:
    """The tokenizer identity a prepared --data (or the first corpus of a blend) was made with."""
    return read_index((parse_blend(spec) or [(1.0, spec)])[0][1])["tokenizer"]


def tokenizer_spec(identity: dict) -> str:
    """The --tokenizer that names a tokenizer identity: 'bytes', or its directory."""
    return "bytes" if identity.get("kind", "bytes") == "bytes" else identity["path"]


@functools.lru_cache(maxsize=8)
def tokenizer_identity(spec: str) -> dict:
    """What the run's tokens mean, as a checkpoint records it: bytes, or a directory and its files' hash."""
    return dict(corpus.tokenizer_for(spec).identity)


def check_run_tokenizer(spec: str, identity: dict | None, what: str) -> None:
    """A checkpoint's tokenizer, read back (generate, export): its directory there with the same files."""
    if identity is None or identity.get("kind") != "hf":
        return
    if not os.path.isdir(spec):
        raise ConfigError(f"tokenizer directory {spec} (the run's) is gone: pass --tokenizer DIR with the same files")
    if not same_tokenizer(spec, identity):
        raise ConfigError(f"{what}: the tokenizer in {spec} is not the one the run trained with (its files changed): "
                          f"pass --tokenizer DIR with the run's files")


def same_tokenizer(spec: str, identity: dict) -> bool:
    """Whether the tokenizer `spec` names is the one of `identity` (a directory: by its files' hash)."""
    if identity.get("kind", "bytes") == "bytes" or spec in ("", "bytes"):
        return spec in ("", "bytes") and identity.get("kind", "bytes") == "bytes"
    return os.path.isdir(spec) and corpus.directory_sha256(spec) == identity.get("sha256")  # the files, unloaded


def resolve_tokenizer(t):
    """The run's tokenizer: a prepared corpus's own (it was tokenized with it), which a --tokenizer
    given must be; a raw source's --tokenizer as given. Refused in one line: another tokenizer than
    the corpus's, or the corpus's directory gone with none given that holds the same files."""
    from dataclasses import replace

    if not t.data or not is_prepared_spec(t.data) or not all(is_prepared(p) for _, p in
                                                              (parse_blend(t.data) or [(1.0, t.data)])):
        return t
    identity = prepared_tokenizer(t.data)
    corpus_spec = tokenizer_spec(identity)
    if t.tokenizer not in ("", "bytes", corpus_spec):
        if not same_tokenizer(t.tokenizer, identity):
            raise ConfigError(f"--tokenizer {t.tokenizer} is not the tokenizer --data {t.data} was prepared with "
                              f"({identity['kind']}{' ' + identity.get('path', '') if identity['kind'] == 'hf' else ''}"
                              f"): drop --tokenizer, the corpus names its own")
        return t  # the same files in another directory
    if corpus_spec != "bytes" and not os.path.isdir(corpus_spec):
        raise ConfigError(f"--data {t.data} was prepared with the tokenizer in {corpus_spec}, which is gone: pass "
                          f"--tokenizer DIR with the same files")
    return replace(t, tokenizer=corpus_spec)


def data_identity(spec: str) -> list[dict]:
    """What a run's batches are drawn from, as its run record keeps it: each prepared corpus of `spec`
    with the SHA-256 of its index (which holds every shard's); nothing for a raw source, read anew
    each run (hashing a raw corpus would cost a pass over it)."""
    import hashlib

    if not spec or not is_prepared_spec(spec):
        return []
    out = []
    for _, path in parse_blend(spec) or [(1.0, spec)]:
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index, "rb") as f:
                out.append({"path": path, "index_sha256": hashlib.sha256(f.read()).hexdigest()})
    return out


def is_prepared_spec(spec: str) -> bool:
    return bool(spec) and (parse_blend(spec) is not None or is_prepared(spec) or os.path.isfile(
        os.path.join(spec, ".prepare.json")))


def check_source(t, global_batch: int) -> None:
    """What can be known of --data before any process starts: a prepared corpus's index (every
    shard's size), else the raw files, the dataset's split and column, and, on bytes, a raw source too
    large for memory (its size in bytes is its size in tokens); with --eval-every, a held-out split
    of at least one global batch."""
    if t.data and not is_prepared_spec(t.data) and not t.data.startswith("hf:"):
        size = sum(os.path.getsize(f) for f in text_files(t.data))
        if t.tokenizer in ("", "bytes") and size > DEFAULT_MAX_TOKENS:
            raise ConfigError(
                f"--data {t.data}: {size:,} bytes, more than the {DEFAULT_MAX_TOKENS:,} tokens a raw source is "
                f"read into memory (in every process, at every start): prepare it once with `ultrascale data "
                f"prepare {t.data} DIR` and train with --data DIR")
    if t.data.startswith("hf:") and not t.eval_every:
        next(iter_documents(t.data, t.data_column, t.data_split), None)
    if is_prepared_spec(t.data) and not t.eval_every:
        open_prepared(t.data, "train")
    if t.eval_every:
        check_eval(t, run_batches(t, global_batch)[1], global_batch)


def check_eval(t, val, global_batch: int) -> None:
    """--eval-every needs a held-out split of at least one global batch of windows."""
    if not t.eval_every or val is not None:
        return
    prepared = is_prepared_spec(t.data)
    held = sum(len(s.stream) for s in open_prepared(t.data, "val")) if prepared else len(
        load_corpus(t.data, t.tokenizer, t.data_column, t.data_split, t.val_fraction, DEFAULT_MAX_TOKENS, True).val)
    fix = ("prepare it again with a larger --val-fraction" if prepared
           else f"raise --val-fraction (now {t.val_fraction:g})")
    raise ConfigError(f"--eval-every: the held-out split holds {held:,} tokens, less than one global batch of "
                      f"windows ({global_batch} x {t.seq_len + 1}): {fix}, give more data, or train without "
                      f"--eval-every")


def run_batches(t, global_batch: int) -> tuple[TokenBatches, TokenBatches | None, str]:
    """The run's training batches, its validation batches (None when the held-out split is too small
    for one global batch) and a line saying what the data is."""
    if is_prepared_spec(t.data):
        train_sources, val_sources = open_prepared(t.data, "train"), open_prepared(t.data, "val")
        tokens = sum(len(s.stream) for s in train_sources)
        held = sum(len(s.stream) for s in val_sources)
        what = f"{t.data} (prepared: {tokens:,} training tokens, {held:,} held out)"
        train = TokenBatches(train_sources, t.seq_len, global_batch, t.seed)
    else:
        c = load_corpus(t.data, t.tokenizer, t.data_column, t.data_split, t.val_fraction, DEFAULT_MAX_TOKENS, True)
        name = t.data or "Python's standard library"
        cap = f", its first {DEFAULT_MAX_TOKENS:,} tokens" if c.capped else ""
        what = f"{name}{cap} ({len(c.train):,} training tokens, {len(c.val):,} held out)"
        train = TokenBatches(c.train, t.seq_len, global_batch, t.seed)
        val_sources = [Source(InMemory(c.val))]
    try:
        val = TokenBatches(val_sources, t.seq_len, global_batch, t.seed, shuffle=False)
    except ConfigError:
        val = None
    if val is not None and not val.batches_in_order():
        val = None
    return train, val, what
