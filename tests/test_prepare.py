"""Prepared corpora (`ultrascale data prepare`, train/prepare.py) and what trains on them.

A prepared corpus must hold exactly the token streams the raw source gives in memory
(training and held-out alike), whatever the number of workers or an interruption;
training on it must equal training on the raw source; a rank reads only its rows;
blends share every step by their weights; nothing is cut short without a word.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from ultrascale.errors import ConfigError
from ultrascale.testing.cli import ultrascale as forked_ultrascale
from ultrascale.train.data import (
    InMemory,
    Source,
    TokenBatches,
    load_corpus,
    open_prepared,
    parse_blend,
    read_index,
)


def ultrascale(*args, timeout=120):
    # a process of its own, forked from a server that imported torch once (testing/cli.py)
    return forked_ultrascale(*args, timeout=timeout)


def one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def make_corpus(root, big_lines=3000):
    """Text files (one larger than a small piece), JSONL and parquet, with non-ASCII text."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text("".join(f"line {i}: héllo wörld ✓ {i * i}\n" for i in range(big_lines)))
    (root / "b.md").write_text("a short document\n")
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "c.jsonl").write_text("".join(json.dumps({"text": f"record {i} " + "x" * (i % 700)}) + "\n"
                                                  for i in range(400)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": [f"row {i} 日本語 " * (1 + i % 40) for i in range(300)], "n": list(range(300))})
    pq.write_table(table, str(root / "sub" / "d.parquet"), row_group_size=100)
    return root


def shard_stream(out, split):
    """The split's tokens as one array, read straight from the files the index names."""
    index = read_index(str(out))
    dtype = np.dtype(index["dtype"])
    parts = [np.fromfile(os.path.join(out, s["file"]), dtype=dtype) for s in index["splits"][split]["shards"]
             if s["tokens"]]
    return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("raw") / "corpus")


@pytest.fixture(scope="module")
def prepared(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "p"
    r = ultrascale("data", "prepare", str(corpus_dir), str(out), "--val-fraction", "0.2")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and f"wrote {out}" in r.stdout
    return out


def test_prepared_streams_equal_the_raw_source_in_memory(corpus_dir, prepared):
    raw = load_corpus(str(corpus_dir), val_fraction=0.2)
    assert len(raw.val) > 1000 and len(raw.train) > 10 * 1000  # both splits are real
    assert np.array_equal(shard_stream(prepared, "train"), raw.train.numpy())
    assert np.array_equal(shard_stream(prepared, "val"), raw.val.numpy())
    index = read_index(str(prepared))
    assert index["dtype"] == "uint16" and index["vocab_size"] == 257 and index["tokenizer"]["kind"] == "bytes"
    # the document boundaries: offsets after each end-of-document token, per shard
    for split in ("train", "val"):
        for s in index["splits"][split]["shards"]:
            ends = np.fromfile(os.path.join(prepared, s["docs_file"]), dtype=np.int64)
            tokens = np.fromfile(os.path.join(prepared, s["file"]), dtype=np.uint16)
            assert len(ends) == s["docs"] and (len(ends) == 0 or ends[-1] <= len(tokens))
            assert all(tokens[e - 1] == 256 for e in ends)
    # every document is in one of the splits: text files, JSONL lines, parquet rows
    assert sum(index["splits"][k]["docs"] for k in ("train", "val")) == 2 + 400 + 300


def test_held_out_split_is_a_fraction_of_sections_not_a_tail(corpus_dir):
    raw = load_corpus(str(corpus_dir), val_fraction=0.2)
    share = len(raw.val) / (len(raw.val) + len(raw.train))
    assert 0.05 < share < 0.4
    none = load_corpus(str(corpus_dir), val_fraction=0.0)
    assert len(none.val) == 0 and len(none.train) == len(raw.train) + len(raw.val)


def test_workers_and_pieces_write_the_same_bytes(corpus_dir, tmp_path):
    runs = {}
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}"
        r = ultrascale("data", "prepare", str(corpus_dir), str(out), "--val-fraction", "0.2", "--workers", workers,
                       "--piece-mb", "0.02")
        assert r.returncode == 0, r.stderr
        runs[workers] = read_index(str(out))
    assert len(runs["1"]["splits"]["train"]["shards"]) > 4  # several pieces: a worker each
    assert runs["1"] == runs["2"]


def test_an_interrupted_prepare_resumes_where_it_stopped(corpus_dir, tmp_path):
    out = tmp_path / "p"
    args = ("data", "prepare", str(corpus_dir), str(out), "--val-fraction", "0.2", "--piece-mb", "0.02")
    assert ultrascale(*args).returncode == 0
    whole = read_index(str(out))
    # What a kill leaves: no index, some pieces without a record, a half-written shard.
    os.remove(out / "index.json")
    records = sorted((out / "pieces").iterdir())
    for rec in records[1::2]:
        os.remove(rec)
    (out / "train-00001.bin.tmp").write_bytes(b"half")
    with pytest.raises(ConfigError, match="run it again to finish"):
        read_index(str(out))
    r = ultrascale(*args)
    assert r.returncode == 0, r.stderr
    assert f"resuming, {len(records) - len(records[1::2])} of {len(records)} pieces" in r.stderr
    assert read_index(str(out)) == whole
    again = ultrascale(*args)
    assert again.returncode == 0 and "nothing to do" in again.stderr


def test_training_on_prepared_data_equals_training_on_the_raw_source(corpus_dir, prepared, tmp_path):
    common = ("train", "--steps", "3", "--seq-len", "32", "--micro-batch", "4", "--eval-every", "3",
              "--eval-batches", "2", "--val-fraction", "0.2", "--peak", "1")
    logs = {}
    for name, data in (("raw", str(corpus_dir)), ("prepared", str(prepared))):
        log = tmp_path / f"{name}.jsonl"
        r = ultrascale(*common, "--data", data, "--log-jsonl", str(log))
        assert r.returncode == 0, r.stderr
        logs[name] = [json.loads(line) for line in log.read_text().splitlines()]
        assert "held out" in r.stdout and "validation: every 3 steps, 2 global batches" in r.stdout
    for a, b in zip(logs["raw"], logs["prepared"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["epoch"] == pytest.approx(b["epoch"])
    assert "val_loss" in logs["raw"][-1] and "val_loss" not in logs["raw"][0]
    assert logs["raw"][-1]["val_loss"] == pytest.approx(logs["prepared"][-1]["val_loss"], rel=1e-6)


def test_tensorboard_gets_the_validation_loss(prepared, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = ultrascale("train", "--steps", "2", "--seq-len", "32", "--micro-batch", "4", "--eval-every", "1",
                   "--eval-batches", "1", "--data", str(prepared), "--tensorboard", str(tmp_path / "tb"),
                   "--peak", "1")
    assert r.returncode == 0, r.stderr
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("val/loss")] == [1, 2]
    assert "train/epoch" in acc.Tags()["scalars"]


# ----------------------------------------------------------------------------- what a rank reads


class CountingStream(InMemory):
    def __init__(self, tokens):
        super().__init__(tokens)
        self.reads = []

    def read(self, starts, length):
        self.reads.append(len(starts))
        return super().read(starts, length)


@pytest.mark.parametrize("dp,grad_accum", [(1, 1), (2, 3), (4, 1), (12, 1)])
def test_a_rank_reads_only_its_own_rows(dp, grad_accum):
    stream = CountingStream(torch.arange(10_000, dtype=torch.int32))
    data = TokenBatches(stream, seq_len=9, global_batch=12, seed=0)
    full = data.global_batch_at(4)
    stream.reads.clear()
    mine = torch.cat([x for x, _ in data.micro_batches(4, dp - 1, dp, grad_accum)])
    assert stream.reads == [12 // dp]
    assert torch.equal(mine, full[(dp - 1) * 12 // dp:, :-1])


def test_memory_mapped_shards_read_across_shard_ends(tmp_path):
    from ultrascale.train.data import Shards

    sizes = [5, 1, 7, 20]
    entries, start = [], 0
    for i, n in enumerate(sizes):
        np.arange(start, start + n, dtype=np.uint16).tofile(tmp_path / f"s{i}.bin")
        entries.append({"file": f"s{i}.bin", "tokens": n})
        start += n
    entries.insert(2, {"file": "empty.bin", "tokens": 0})  # an empty shard is skipped
    shards = Shards(str(tmp_path), entries, "uint16")
    assert len(shards) == sum(sizes)
    starts = np.array([0, 3, 4, 5, 6, 12, 25])
    assert np.array_equal(shards.read(starts, 8), starts[:, None] + np.arange(8))


# ----------------------------------------------------------------------------- blends


def test_blend_shares_every_step_by_weight_and_keeps_epochs_per_corpus():
    a = InMemory(torch.arange(0, 2001, dtype=torch.int32))  # 200 windows of 10
    b = InMemory(torch.arange(100_000, 100_301, dtype=torch.int32))  # 30 windows
    data = TokenBatches([Source(a, 0.7, "a"), Source(b, 0.3, "b")], seq_len=10, global_batch=10, seed=3)
    assert data.per_step == [7, 3]
    seen_a, seen_b = [], []
    for step in range(10):
        batch = data.global_batch_at(step)
        from_b = batch[:, 0] >= 100_000
        assert int(from_b.sum()) == 3
        seen_a += batch[~from_b, 0].tolist()
        seen_b += batch[from_b, 0].tolist()
        assert torch.equal(batch, data.global_batch_at(step))  # a pure function of the step
    assert sorted(seen_b[:30]) == [100_000 + 10 * w for w in range(30)]  # b's first epoch: each window once
    assert len(set(seen_a)) == 70  # a: no window twice within its first epoch
    assert data.epochs(10) == pytest.approx([70 / 200, 30 / 30])
    # the rows are mixed: rank 0 of dp 2 gets both corpora somewhere along the way
    firsts = [data.micro_batches(s, 0, 2, 1)[0][0][:, 0] for s in range(10)]
    assert any(bool((f >= 100_000).any()) and bool((f < 100_000).any()) for f in firsts)


def test_apportion_is_exact_and_fair():
    from ultrascale.train.data import apportion

    for total in (1, 7, 10, 64, 513):
        for weights in ([1.0], [0.7, 0.3], [1, 1, 1], [5, 0.01, 2], [0.5, 0.25, 0.25]):
            counts = apportion(total, weights)
            assert sum(counts) == total
            for c, w in zip(counts, weights):
                assert abs(c - total * w / sum(weights)) < 1


def test_blend_syntax():
    assert parse_blend("0.7 a 0.3 b") == [(0.7, "a"), (0.3, "b")]
    assert parse_blend("a") is None and parse_blend("my corpus") is None
    with pytest.raises(ConfigError, match="positive"):
        parse_blend("0 a 1 b")


def test_training_on_a_blend(prepared, tmp_path):
    r = ultrascale("train", "--steps", "2", "--seq-len", "32", "--micro-batch", "4", "--peak", "1",
                   "--data", f"3 {prepared} 1 {prepared}")
    assert r.returncode == 0, r.stderr
    assert "epochs " in r.stdout  # one figure per corpus
    sources = open_prepared(f"3 {prepared} 1 {prepared}", "train")
    assert [s.weight for s in sources] == [3.0, 1.0]


# ----------------------------------------------------------------------------- tokenizers


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path, corpus_dir):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab.update({"<unk>": 70_000, "<eos>": 70_001, "line": 70_002, "héllo": 70_003})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / "p"
    r = ultrascale("data", "prepare", str(corpus_dir / "a.txt"), str(out), "--tokenizer", str(tmp_path / "tok"),
                   "--val-fraction", "0")
    assert r.returncode == 0, r.stderr
    index = read_index(str(out))
    assert index["dtype"] == "uint32" and index["tokenizer"]["kind"] == "hf" and len(index["tokenizer"]["sha256"]) == 64
    raw = load_corpus(str(corpus_dir / "a.txt"), str(tmp_path / "tok"), val_fraction=0.0)
    assert np.array_equal(shard_stream(out, "train"), raw.train.numpy())
    assert int(raw.train.max()) == 70_003 or int(raw.train.max()) == 70_001
    # the model must hold the vocabulary: refused in one line, with the fix
    one_line_error(ultrascale("train", "--steps", "1", "--data", str(out)), "--vocab-size 70004")


# ----------------------------------------------------------------------------- nothing cut short, one line each


def test_a_raw_source_over_the_limit_is_refused_with_the_prepare_command(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(8_000_001)  # a byte more than the in-memory limit (sparse: costs no disk)
    line = one_line_error(ultrascale("train", "--steps", "1", "--data", str(big)), "8,000,001 bytes")
    assert f"ultrascale data prepare {big} DIR" in line and "--data DIR" in line


def test_the_default_corpus_says_where_it_is_cut():
    r = ultrascale("train", "--steps", "1", "--peak", "1")
    assert r.returncode == 0, r.stderr
    assert "data: Python's standard library, its first 8,000,000 tokens" in r.stdout


@pytest.mark.parametrize("case", ["unrelated-out", "bad-fraction", "missing-source", "bad-workers", "bad-piece"])
def test_prepare_bad_input_is_one_line(case, tmp_path, corpus_dir):
    out = tmp_path / "out"
    if case == "unrelated-out":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        one_line_error(ultrascale("data", "prepare", str(corpus_dir), str(out)), "--overwrite")
        assert (out / "keep.txt").read_text() == "mine"
    elif case == "bad-fraction":
        one_line_error(ultrascale("data", "prepare", str(corpus_dir), str(out), "--val-fraction", "1.5"),
                       "--val-fraction")
    elif case == "missing-source":
        one_line_error(ultrascale("data", "prepare", str(tmp_path / "nope"), str(out)), "no such file")
    elif case == "bad-workers":
        one_line_error(ultrascale("data", "prepare", str(corpus_dir), str(out), "--workers", "-1"), "--workers")
    else:
        one_line_error(ultrascale("data", "prepare", str(corpus_dir), str(out), "--piece-mb", "0"), "--piece-mb")
    assert not out.exists() or case == "unrelated-out"


@pytest.mark.parametrize("case", ["interrupted", "damaged-index", "short-shard", "damaged-shard", "tiny-held-out"])
def test_training_on_a_bad_prepared_directory_is_one_line(case, prepared, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    args = ["train", "--steps", "1", "--data", str(copy)]
    if case == "interrupted":
        os.remove(copy / "index.json")
        one_line_error(ultrascale(*args), "run it again to finish")
    elif case == "damaged-index":
        (copy / "index.json").write_text("{not json")
        one_line_error(ultrascale(*args), "index.json is damaged")
    elif case == "short-shard":
        with open(copy / "train-00000.bin", "r+b") as f:
            f.truncate(10)
        one_line_error(ultrascale(*args), "train-00000.bin", "prepare the corpus again")
    elif case == "damaged-shard":  # its size as the index says, its bytes not token ids of the corpus
        size = (copy / "train-00000.bin").stat().st_size
        (copy / "train-00000.bin").write_bytes(b"\xff" * size)
        one_line_error(ultrascale(*args, "--nproc", "2"), "train-00000.bin is damaged", "--verify",
                       "prepare the corpus again")
    else:
        one_line_error(ultrascale(*args, "--eval-every", "1", "--micro-batch", "32", "--grad-accum", "16", "--seq-len", "256"),
                       "--eval-every", "prepare it again with a larger --val-fraction")


def test_info_and_verify(prepared, tmp_path):
    import shutil

    r = ultrascale("data", "info", str(prepared), "--verify")
    assert r.returncode == 0 and "verified" in r.stdout and "uint16" in r.stdout
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    with open(copy / "train-00000.bin", "r+b") as f:
        f.seek(3)
        f.write(b"\x01\x01")
    one_line_error(ultrascale("data", "info", str(copy), "--verify"), "checksums")


def test_a_hugging_face_dataset_directory_prepares_like_it_reads(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = [f"record {i}: " + "ü" * (i % 50) for i in range(50_000)]  # more rows than one segment holds
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "ds"))
    out = tmp_path / "p"
    r = ultrascale("data", "prepare", f"hf:{tmp_path / 'ds'}", str(out), "--data-column", "body",
                   "--val-fraction", "0.05")
    assert r.returncode == 0, r.stderr
    raw = load_corpus(f"hf:{tmp_path / 'ds'}", column="body", val_fraction=0.05)
    assert np.array_equal(shard_stream(out, "train"), raw.train.numpy())
    assert np.array_equal(shard_stream(out, "val"), raw.val.numpy())
    index = read_index(str(out))
    assert index["splits"]["train"]["docs"] + index["splits"]["val"]["docs"] == 50_000
    assert len(index["splits"]["train"]["shards"]) == 3  # 20,000 rows a segment: three pieces, on two workers


def test_a_prepare_that_failed_before_any_piece_is_redone_when_corrected(tmp_path):
    # A wrong --data-column fails on the first piece, leaving only prepare's own files: the corrected
    # command starts afresh instead of calling the folder "another preparation".
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"txt": f"row {i} of the corpus"}) + "\n" for i in range(40)))
    out = tmp_path / "out"
    one_line_error(ultrascale("data", "prepare", str(source), str(out)), "no 'text' field", "--data-column")
    assert out.exists()
    r = ultrascale("data", "prepare", str(source), str(out), "--data-column", "txt")
    assert r.returncode == 0 and (out / "index.json").is_file(), r.stderr
    # A folder holding anything else is still refused (the user's files are never removed).
    other = tmp_path / "other"
    other.mkdir()
    (other / ".prepare.json").write_text("{}")
    (other / "notes.txt").write_text("mine")
    one_line_error(ultrascale("data", "prepare", str(source), str(other), "--data-column", "txt"), "holds")
    assert (other / "notes.txt").read_text() == "mine"
