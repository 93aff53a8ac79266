"""Training data: tokenizers, sources, and batches that are a pure function of (seed, step).

Everything here runs offline on data the tests write themselves (plus the Python
standard library's own source, the default corpus).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import torch

from ultrascale.config import ConfigError
from ultrascale.train.data import (
    ByteTokenizer,
    HFTokenizer,
    TokenBatches,
    iter_documents,
    load_tokenizer,
    load_tokens,
    stdlib_files,
)

EOS = 256


def byte_stream(docs) -> list[int]:
    """The expected byte-level stream: each document's UTF-8 bytes, then EOS."""
    out: list[int] = []
    for d in docs:
        out += list(d.encode("utf-8")) + [EOS]
    return out


def write(path, text: str, binary: bool = False):
    path.parent.mkdir(parents=True, exist_ok=True)
    if binary:
        path.write_bytes(text)
    else:
        path.write_bytes(text.encode("utf-8"))
    return path


def write_jsonl(path, records):
    return write(path, "".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(autouse=True)
def _fresh_token_cache():
    # load_tokens is memoised on its arguments; files written by one test must not
    # be answered from another test's cache (tmp paths can be reused).
    load_tokens.cache_clear()
    yield
    load_tokens.cache_clear()


@pytest.fixture
def no_network(monkeypatch):
    """Offline mode for the Hugging Face libraries, and any connection attempt fails loudly."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# ----------------------------------------------------------------------------- batches


def stream(n: int) -> torch.Tensor:
    """Token i has value i: every window says where it was cut from."""
    return torch.arange(n, dtype=torch.int32)


def test_global_batch_shape_dtype_and_windows():
    tokens = stream(5000)
    data = TokenBatches(tokens, seq_len=16, global_batch=12, seed=3)
    for step in range(5):
        batch = data.global_batch_at(step)
        assert batch.shape == (12, 17)
        assert batch.dtype == torch.int64
        # each row is a contiguous window of the stream, fully inside it
        starts = batch[:, 0]
        assert torch.all(starts >= 0) and torch.all(batch[:, -1] < len(tokens))
        expected = starts[:, None] + torch.arange(17)
        assert torch.equal(batch, expected)
        # targets are the inputs shifted by one token
        inputs, targets = batch[:, :-1], batch[:, 1:]
        assert torch.equal(targets[:, :-1], inputs[:, 1:])
        assert torch.equal(targets, inputs + 1)


def test_global_batch_is_a_pure_function_of_seed_and_step():
    tokens = stream(100_000)
    a = TokenBatches(tokens, seq_len=32, global_batch=8, seed=1234)
    b = TokenBatches(tokens.clone(), seq_len=32, global_batch=8, seed=1234)

    # b is queried in another order, after the global RNG was reseeded: no hidden state
    torch.manual_seed(0)
    from_a = [a.global_batch_at(k) for k in range(6)]
    torch.manual_seed(999)
    from_b = {k: b.global_batch_at(k) for k in reversed(range(6))}
    for k in range(6):
        assert torch.equal(from_a[k], from_b[k]), k
    # asking again (e.g. after a resume) gives the same batch
    assert torch.equal(a.global_batch_at(4), from_a[4])

    # another step, or another seed, draws other windows
    for k in range(5):
        assert not torch.equal(from_a[k], from_a[k + 1]), k
    other_seed = TokenBatches(tokens, seq_len=32, global_batch=8, seed=1235)
    assert not torch.equal(other_seed.global_batch_at(0), from_a[0])
    assert not torch.equal(other_seed.global_batch_at(3), from_a[3])


def test_global_batch_does_not_touch_the_global_rng():
    data = TokenBatches(stream(1000), seq_len=8, global_batch=4, seed=0)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    data.global_batch_at(0)
    data.micro_batches(1, 0, 2, 2)
    assert torch.equal(torch.get_rng_state(), before)


def test_global_batch_is_the_same_in_another_process():
    """Ranks are separate processes: the batch must not depend on per-process hashing."""
    data = TokenBatches(stream(50_000), seq_len=8, global_batch=6, seed=42)
    here = data.global_batch_at(17).tolist()
    code = (
        "import json, torch\n"
        "from ultrascale.train.data import TokenBatches\n"
        "d = TokenBatches(torch.arange(50_000, dtype=torch.int32), seq_len=8, global_batch=6, seed=42)\n"
        "print(json.dumps(d.global_batch_at(17).tolist()))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == here


@pytest.mark.parametrize("n_tokens,seq_len,G", [(13, 10, 8), (5000, 16, 12), (4097, 8, 7), (1001, 10, 100)])
def test_every_window_once_per_epoch(n_tokens, seq_len, G):
    """Windows are drawn without replacement: over any epoch's span of samples, each of the N
    windows ((n - 1) // seq_len of them, overlapping by the one token a target shifts in) comes
    exactly once, whatever G is (steps straddle epochs when G does not divide N)."""
    data = TokenBatches(stream(n_tokens), seq_len=seq_len, global_batch=G, seed=5)
    n = (n_tokens - 1) // seq_len
    assert data.windows == [n]
    steps = -(-3 * n // G) + 1
    starts = torch.cat([data.global_batch_at(k)[:, 0] for k in range(steps)]).tolist()
    for e in range(3):
        epoch = sorted(starts[e * n:(e + 1) * n])
        assert epoch == [w * seq_len for w in range(n)], e
    assert data.epochs(steps)[0] == pytest.approx(steps * G / n)
    # epochs are ordered differently (a permutation keyed by the epoch), unless there is one window
    if n > 2:
        assert starts[:n] != starts[n:2 * n]


@pytest.mark.parametrize("n", list(range(1, 70)) + [1000, 4097, 65536, 99991])
def test_permutation_is_a_bijection(n):
    from ultrascale.train.data import permute

    out = permute(np.arange(n), n, key=12345)
    assert sorted(out.tolist()) == list(range(n))
    # computed for any subset of positions alone, it agrees (a step needs only its own windows)
    pick = np.arange(0, n, 3)
    assert permute(pick, n, key=12345).tolist() == out[pick].tolist()
    if n >= 8:
        assert out.tolist() != permute(np.arange(n), n, key=54321).tolist()
        assert out.tolist() != list(range(n))


def test_permutation_is_flat_in_memory_and_fast_for_a_billion_windows():
    from ultrascale.train.data import permute

    n = 10**9 + 7
    out = permute(np.arange(512) + 123_456_789, n, key=7)
    assert len(set(out.tolist())) == 512 and out.min() >= 0 and out.max() < n


def test_exactly_one_window_of_data_is_enough():
    tokens = stream(9)
    data = TokenBatches(tokens, seq_len=8, global_batch=3, seed=0)
    batch = data.global_batch_at(5)
    assert torch.equal(batch, tokens.long().expand(3, 9))


@pytest.mark.parametrize("n", [0, 1, 8])
def test_too_little_data_names_seq_len(n):
    with pytest.raises(ConfigError, match="--seq-len") as e:
        TokenBatches(stream(n), seq_len=8, global_batch=2, seed=0)
    assert f"has {n} tokens" in str(e.value)


# ----------------------------------------------------------------------------- splits


FACTORISATIONS = [(1, 1), (1, 12), (12, 1), (2, 3), (3, 2), (2, 6), (6, 2), (4, 3), (3, 4), (2, 2)]


@pytest.mark.parametrize("dp,grad_accum", FACTORISATIONS)
def test_every_split_sees_the_global_batch(dp, grad_accum):
    G, seq_len = 12, 7
    data = TokenBatches(stream(3000), seq_len=seq_len, global_batch=G, seed=11)
    micro = G // (dp * grad_accum)
    for step in (0, 5):
        batch = data.global_batch_at(step)
        inputs, targets = [], []
        for rank in range(dp):
            mbs = data.micro_batches(step, rank, dp, grad_accum)
            assert len(mbs) == grad_accum
            for x, y in mbs:
                assert x.shape == y.shape == (micro, seq_len)
                assert x.dtype == y.dtype == torch.int64
                assert torch.equal(y[:, :-1], x[:, 1:])
                inputs.append(x)
                targets.append(y)
            # rank r owns a contiguous block of G / dp rows
            own = torch.cat([x for x, _ in mbs])
            rows = G // dp
            assert torch.equal(own, batch[rank * rows:(rank + 1) * rows, :-1])
        assert torch.equal(torch.cat(inputs), batch[:, :-1])
        assert torch.equal(torch.cat(targets), batch[:, 1:])


def test_splits_agree_with_each_other():
    data = TokenBatches(stream(3000), seq_len=5, global_batch=12, seed=2)
    layouts = []
    for dp, ga in FACTORISATIONS:
        rows = [x for r in range(dp) for x, _ in data.micro_batches(3, r, dp, ga)]
        layouts.append(torch.cat(rows))
    for other in layouts[1:]:
        assert torch.equal(other, layouts[0])


def test_micro_batches_reject_inconsistent_layouts():
    data = TokenBatches(stream(1000), seq_len=4, global_batch=12, seed=0)
    with pytest.raises(ValueError, match="divisible"):
        data.micro_batches(0, 0, 5, 1)
    with pytest.raises(ValueError, match="divisible"):
        data.micro_batches(0, 0, 2, 4)  # 12 / 2 = 6 rows per rank, not 4 micro-batches
    with pytest.raises(ValueError, match="dp_rank"):
        data.micro_batches(0, 2, 2, 3)
    with pytest.raises(ValueError, match="dp_rank"):
        data.micro_batches(0, -1, 2, 3)


# ----------------------------------------------------------------------------- byte tokenizer


@pytest.mark.parametrize("text", ["", "hello, world\n", "héllo wörld", "日本語のテキスト", "emoji 🎉✓ mixed ∑ ascii", "\x00\x7f"])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.int32
    assert ids.tolist() == list(text.encode("utf-8"))
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


def test_byte_tokenizer_vocab_and_eos():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eos_id == 256
    every_byte = bytes(range(256)).decode("latin-1")
    ids = tok.encode(every_byte)
    assert 0 <= int(ids.min()) and int(ids.max()) < tok.eos_id
    # the end-of-document token is not text
    a, b = tok.encode("first é"), tok.encode("second ✓")
    joined = torch.cat([a, torch.tensor([tok.eos_id], dtype=torch.int32), b])
    assert tok.decode(joined) == "first ésecond ✓"


def test_load_tokenizer_bytes_spellings():
    assert isinstance(load_tokenizer(""), ByteTokenizer)
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


# ----------------------------------------------------------------------------- default corpus


def test_default_corpus_is_the_standard_library():
    files = stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    assert len(files) > 100
    assert all(f.endswith(".py") and f.startswith(root) for f in files)
    parts = {p for f in files for p in os.path.relpath(f, root).split(os.sep)[:-1]}
    assert not parts & {"site-packages", "__pycache__", "test", "idlelib"}
    assert files == stdlib_files()  # a fixed order, not the file system's

    # the stream starts with the alphabetically first top-level module, then EOS
    first = min(glob.glob(os.path.join(root, "*.py")))
    with open(first, encoding="utf-8", errors="replace") as f:
        first_bytes = list(f.read().encode("utf-8"))
    tokens = load_tokens("", max_tokens=300_000)
    assert tokens.dtype == torch.int32
    assert tokens[:len(first_bytes)].tolist() == first_bytes
    assert int(tokens[len(first_bytes)]) == EOS


def test_default_corpus_tokens():
    tokens = load_tokens("", max_tokens=300_000)
    assert len(tokens) == 300_000  # the standard library is far bigger than this cap
    assert int(tokens.min()) >= 0 and int(tokens.max()) <= EOS
    eos_at = (tokens == EOS).nonzero().flatten()
    assert len(eos_at) >= 3  # several documents, separated by EOS
    assert int(eos_at.diff().min()) > 1  # no empty documents among these
    # EOS never appears inside a document: every other token is a byte
    assert int(tokens[tokens != EOS].max()) < 256
    # the cap is a prefix of a longer read
    smaller = load_tokens("", max_tokens=1000)
    assert len(smaller) == 1000
    assert torch.equal(smaller, tokens[:1000])


def test_default_corpus_is_usable_for_batches():
    tokens = load_tokens("", max_tokens=50_000)
    data = TokenBatches(tokens, seq_len=64, global_batch=4, seed=0)
    batch = data.global_batch_at(0)
    assert batch.shape == (4, 65)
    assert int(batch.max()) <= EOS


# ----------------------------------------------------------------------------- --data sources


def test_single_text_file(tmp_path):
    path = write(tmp_path / "corpus.txt", "héllo\nwörld ✓\n")
    assert load_tokens(str(path)).tolist() == byte_stream(["héllo\nwörld ✓\n"])
    assert list(iter_documents(str(path))) == ["héllo\nwörld ✓\n"]


def test_text_file_with_invalid_utf8_is_read_with_replacement(tmp_path):
    path = write(tmp_path / "bad.txt", b"ok\xffok", binary=True)
    assert load_tokens(str(path)).tolist() == byte_stream(["ok\ufffdok"])


def test_max_tokens_caps_the_stream(tmp_path):
    path = write(tmp_path / "corpus.txt", "abcdefghij")
    assert load_tokens(str(path), max_tokens=4).tolist() == list(b"abcd")
    assert load_tokens(str(path), max_tokens=11).tolist() == byte_stream(["abcdefghij"])
    assert load_tokens(str(path), max_tokens=1000).tolist() == byte_stream(["abcdefghij"])


def test_max_tokens_stops_reading(tmp_path):
    # once the cap is reached, later documents are not even parsed
    path = write(tmp_path / "data.jsonl", json.dumps({"text": "x" * 50}) + "\nnot json\n")
    assert load_tokens(str(path), max_tokens=20).tolist() == list(b"x" * 20)
    with pytest.raises(ConfigError):
        load_tokens(str(path), max_tokens=1000)


DIR_FILES = {
    "zeta.txt": "last at top level",
    "alpha.txt": "first ✓",
    "mid/beta.txt": "in a subdirectory",
    "mid/deeper/gamma.txt": "two levels down",
    "b.md": "any extension is text",
}


def make_tree(root, names):
    for name in names:
        write(root / name, DIR_FILES[name])
    return root


def test_directory_is_read_recursively_in_sorted_order(tmp_path):
    root = make_tree(tmp_path / "corpus", list(DIR_FILES))
    order = ["alpha.txt", "b.md", "mid/beta.txt", "mid/deeper/gamma.txt", "zeta.txt"]
    expected = byte_stream([DIR_FILES[n] for n in order])
    assert load_tokens(str(root)).tolist() == expected

    # the same files created in another order give the same stream
    other = make_tree(tmp_path / "other", list(reversed(DIR_FILES)))
    assert load_tokens(str(other)).tolist() == expected


def test_directory_mixes_text_and_jsonl(tmp_path):
    write(tmp_path / "d" / "a.txt", "plain")
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "one"}, {"text": "two"}])
    assert load_tokens(str(tmp_path / "d")).tolist() == byte_stream(["plain", "one", "two"])


def test_empty_directory_has_no_documents(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no documents"):
        load_tokens(str(tmp_path / "empty"))


def test_glob(tmp_path):
    root = make_tree(tmp_path / "corpus", list(DIR_FILES))
    top = load_tokens(str(root / "*.txt")).tolist()
    assert top == byte_stream([DIR_FILES["alpha.txt"], DIR_FILES["zeta.txt"]])
    deep = load_tokens(str(root / "**" / "*.txt")).tolist()
    order = ["alpha.txt", "mid/beta.txt", "mid/deeper/gamma.txt", "zeta.txt"]
    assert deep == byte_stream([DIR_FILES[n] for n in order])


def test_missing_path_and_empty_glob(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ConfigError, match="no such file") as e:
        load_tokens(missing)
    assert missing in str(e.value)

    (tmp_path / "subdir").mkdir()
    pattern = str(tmp_path / "*.parquet")
    with pytest.raises(ConfigError) as e:
        load_tokens(pattern)
    assert pattern in str(e.value)
    # a glob that matches only directories matches no file
    with pytest.raises(ConfigError):
        load_tokens(str(tmp_path / "sub*"))


def test_jsonl_default_column(tmp_path):
    docs = ["first document", "zweites Dokument: ä ö ü", "三番目"]
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    assert load_tokens(str(path)).tolist() == byte_stream(docs)


def test_jsonl_other_column_and_blank_lines(tmp_path):
    lines = [json.dumps({"body": "one", "text": "ignored"}), "", "   ", json.dumps({"body": "two é"}), ""]
    path = write(tmp_path / "data.jsonl", "\n".join(lines) + "\n")
    assert load_tokens(str(path), column="body").tolist() == byte_stream(["one", "two é"])


def test_jsonl_escaped_unicode_is_decoded(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "café ✓"}, ensure_ascii=True) + "\n", encoding="ascii")
    assert "\\u00e9" in path.read_text()
    assert load_tokens(str(path)).tolist() == byte_stream(["café ✓"])


def test_jsonl_invalid_line_names_file_and_line(tmp_path):
    path = write(tmp_path / "broken.jsonl", json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(ConfigError, match="line 2") as e:
        load_tokens(str(path))
    assert str(path) in str(e.value)


@pytest.mark.parametrize("bad", [{"body": "no text field"}, ["a", "list"], "a string"])
def test_jsonl_missing_column_names_file_line_and_column(tmp_path, bad):
    path = write(tmp_path / "data.jsonl", json.dumps({"text": "ok"}) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(ConfigError, match="line 3") as e:
        load_tokens(str(path))
    msg = str(e.value)
    assert str(path) in msg and "'text'" in msg and "--data-column" in msg


def test_empty_jsonl_has_no_documents(tmp_path):
    path = write(tmp_path / "empty.jsonl", "\n\n")
    with pytest.raises(ConfigError, match="no documents"):
        load_tokens(str(path))


# ----------------------------------------------------------------------------- hf: datasets


@pytest.fixture
def hf_datasets(no_network, monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    # the config module read the environment at import: set its view as well
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return datasets


HF_DOCS = ["a first record", "second: ümlaut", "", "日本語 and 🎉"]


def test_hf_dataset_saved_to_disk(hf_datasets, tmp_path):
    path = tmp_path / "saved"
    hf_datasets.Dataset.from_dict({"text": HF_DOCS, "n": list(range(len(HF_DOCS)))}).save_to_disk(str(path))
    assert load_tokens(f"hf:{path}").tolist() == byte_stream(HF_DOCS)
    assert list(iter_documents(f"hf:{path}")) == HF_DOCS


def test_hf_dataset_dict_splits(hf_datasets, tmp_path):
    path = tmp_path / "saved_dict"
    hf_datasets.DatasetDict({
        "train": hf_datasets.Dataset.from_dict({"text": HF_DOCS}),
        "validation": hf_datasets.Dataset.from_dict({"text": ["held out ✓"]}),
    }).save_to_disk(str(path))
    assert load_tokens(f"hf:{path}").tolist() == byte_stream(HF_DOCS)
    assert load_tokens(f"hf:{path}", split="validation").tolist() == byte_stream(["held out ✓"])
    with pytest.raises(ConfigError, match="'test'") as e:
        load_tokens(f"hf:{path}", split="test")
    assert str(path) in str(e.value)


def test_hf_folder_of_jsonl_files(hf_datasets, tmp_path):
    folder = tmp_path / "jsonl_folder"
    write_jsonl(folder / "train.jsonl", [{"content": d, "id": i} for i, d in enumerate(HF_DOCS)])
    assert load_tokens(f"hf:{folder}", column="content").tolist() == byte_stream(HF_DOCS)
    with pytest.raises(ConfigError, match="'text'") as e:
        load_tokens(f"hf:{folder}")
    assert "content" in str(e.value) and "--data-column" in str(e.value)


def test_hf_missing_column(hf_datasets, tmp_path):
    path = tmp_path / "saved"
    hf_datasets.Dataset.from_dict({"body": ["x"], "title": ["y"]}).save_to_disk(str(path))
    with pytest.raises(ConfigError, match="no column 'text'") as e:
        load_tokens(f"hf:{path}")
    msg = str(e.value)
    assert "body" in msg and "title" in msg and str(path) in msg
    assert load_tokens(f"hf:{path}", column="title").tolist() == byte_stream(["y"])


def test_hf_missing_local_path(hf_datasets, tmp_path):
    with pytest.raises(ConfigError, match="hf:"):
        load_tokens(f"hf:{tmp_path / 'does_not_exist'}")


# ----------------------------------------------------------------------------- Hugging Face tokenizer


SENTENCES = ["the cat sat on the mat", "the dog ran", "a cat ran to the dog"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny word-level tokenizer saved the way transformers saves one."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator(SENTENCES, trainer)
    # like many real tokenizers, it appends a special token when asked to add them
    eos = tok.token_to_id("<eos>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", eos)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(str(path))
    return str(path), tok


def test_hf_tokenizer_from_local_directory(no_network, tokenizer_dir):
    path, raw = tokenizer_dir
    words = {w for s in SENTENCES for w in s.split()}
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(words) + 2 == raw.get_vocab_size(with_added_tokens=True)
    assert tok.eos_id == raw.token_to_id("<eos>")

    ids = tok.encode("the cat ran")
    assert ids.dtype == torch.int32
    assert ids.tolist() == [raw.token_to_id(w) for w in ("the", "cat", "ran")]
    # documents get exactly one EOS, from load_tokens, not another from the tokenizer
    assert raw.encode("the cat ran").ids[-1] == tok.eos_id
    assert tok.eos_id not in ids.tolist()
    assert tok.decode(ids) == "the cat ran"
    assert tok.encode("zebra").tolist() == [raw.token_to_id("<unk>")]


def test_load_tokens_with_hf_tokenizer(no_network, tokenizer_dir, tmp_path):
    path, raw = tokenizer_dir
    write(tmp_path / "corpus" / "1.txt", "the cat sat")
    write(tmp_path / "corpus" / "2.txt", "a dog ran")
    eos = raw.token_to_id("<eos>")
    expected = [raw.token_to_id(w) for w in "the cat sat".split()] + [eos]
    expected += [raw.token_to_id(w) for w in "a dog ran".split()] + [eos]
    tokens = load_tokens(str(tmp_path / "corpus"), tokenizer=path)
    assert tokens.dtype == torch.int32
    assert tokens.tolist() == expected
    # the cache keys on the tokenizer too
    assert load_tokens(str(tmp_path / "corpus")).tolist() == byte_stream(["the cat sat", "a dog ran"])


def test_tokenizer_path_errors(no_network, tmp_path):
    a_file = write(tmp_path / "tokenizer.json", "{}")
    with pytest.raises(ConfigError, match="not a directory") as e:
        load_tokenizer(str(a_file))
    assert str(a_file) in str(e.value)
    with pytest.raises(ConfigError, match="not a directory"):
        load_tokenizer(str(tmp_path / "missing_dir"))
    with pytest.raises(ConfigError, match="not a directory"):
        load_tokens(str(a_file), tokenizer=str(a_file))


def test_tokenizer_directory_without_a_tokenizer(no_network, tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))
    write(tmp_path / "broken" / "tokenizer.json", "not json at all")
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "broken"))


def test_a_run_on_a_corpus_prepared_with_a_tokenizer_keeps_that_tokenizer(no_network, tokenizer_dir, tmp_path,
                                                                          capsys):
    """The corpus names its tokenizer; the run records it (its directory and its files' hash), and
    generate and export read it back: words, not bytes, and the tokenizer's files beside the weights."""
    from ultrascale.cli import main

    path, raw = tokenizer_dir
    for i in range(40):
        write(tmp_path / "src" / f"{i}.txt", " ".join(SENTENCES[(i + k) % 3] for k in range(6)))
    assert main(["data", "prepare", str(tmp_path / "src"), str(tmp_path / "bpe"), "--tokenizer", path,
                 "--val-fraction", "0.2"]) == 0
    ck = str(tmp_path / "ck")
    args = ["train", "--data", str(tmp_path / "bpe"), "--layers", "2", "--seq-len", "8", "--micro-batch", "4",
            "--steps", "3", "--no-progress"]
    assert main([*args, "--save", ck]) == 0
    meta = json.load(open(os.path.join(ck, "meta.json")))
    assert meta["config"]["train"]["tokenizer"] == os.path.abspath(path)
    assert meta["tokenizer"]["kind"] == "hf" and meta["tokenizer"]["sha256"] == load_tokenizer(path).identity["sha256"]
    capsys.readouterr()
    assert main(["generate", ck, "--prompt", "the cat", "--max-new-tokens", "4", "--no-stop-at-eos"]) == 0
    text = capsys.readouterr().out
    words = {w for s in SENTENCES for w in s.split()} | {"<unk>", "<eos>"}
    new = text[len("the cat"):].split()  # the continuation, decoded by the corpus's tokenizer: its words
    assert text.startswith("the cat") and "\ufffd" not in text and new and set(new) <= words, text
    assert main(["export", "--hf", str(tmp_path / "out"), ck]) == 0
    assert os.path.isfile(tmp_path / "out" / "tokenizer.json")
    # Started from that folder on raw text, no --tokenizer given: its tokenizer, not bytes, for the vocabulary
    # its embedding was trained on.
    again = str(tmp_path / "again")
    assert main(["train", "--init-from", f"hf:{tmp_path / 'out'}", "--data", str(tmp_path / "src"), "--seq-len", "8",
                 "--micro-batch", "4", "--steps", "1", "--no-progress", "--save", again]) == 0
    recorded = json.load(open(os.path.join(again, "meta.json")))["config"]["train"]["tokenizer"]
    assert os.path.abspath(recorded) == os.path.abspath(tmp_path / "out"), recorded
    # another tokenizer than the corpus's is refused before the run, in one line
    other = tmp_path / "other"
    raw2 = type(raw).from_str(raw.to_str())
    raw2.add_tokens(["zebra"])
    import transformers

    transformers.PreTrainedTokenizerFast(tokenizer_object=raw2, eos_token="<eos>").save_pretrained(str(other))
    capsys.readouterr()
    assert main([*args, "--tokenizer", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the tokenizer --data" in err[0] and "was prepared with" in err[0], err
    # and a tokenizer whose files changed since the run is named, not silently decoded with
    shutil_copy = __import__("shutil").copytree
    moved = tmp_path / "moved-ck"
    shutil_copy(ck, moved)
    meta["tokenizer"]["sha256"] = "0" * 64
    with open(moved / "meta.json", "w") as f:
        json.dump(meta, f)
    assert main(["generate", str(moved), "--prompt", "the cat"]) == 2
    assert "not the one the run trained with" in capsys.readouterr().err


def test_a_resume_on_a_corpus_prepared_again_is_refused_and_data_info_says_why(tmp_path, capsys):
    """The run record keeps each prepared corpus's index hash: the same directory prepared again from other
    text gives other batches, so a resume is refused in one line, and `data info CK` says what changed."""
    from ultrascale.cli import main

    for i in range(20):
        write(tmp_path / "src" / f"{i}.txt", " ".join(SENTENCES[(i + k) % 3] for k in range(6)))
    corpus, ck = str(tmp_path / "corpus"), str(tmp_path / "ck")
    assert main(["data", "prepare", str(tmp_path / "src"), corpus, "--val-fraction", "0.2"]) == 0
    args = ["train", "--data", corpus, "--layers", "2", "--seq-len", "8", "--micro-batch", "4", "--no-progress"]
    assert main([*args, "--steps", "1", "--save", ck]) == 0
    capsys.readouterr()
    assert main(["data", "info", ck]) == 0
    said = capsys.readouterr().out
    assert f"data: {corpus} (prepared; index sha256 " in said and ": unchanged)" in said, said
    write(tmp_path / "src" / "0.txt", "other text entirely " * 40)
    assert main(["data", "prepare", str(tmp_path / "src"), corpus, "--val-fraction", "0.2", "--overwrite"]) == 0
    capsys.readouterr()
    assert main(["data", "info", ck]) == 0
    assert ": prepared again since: other batches)" in capsys.readouterr().out
    assert main(["train", "--resume", ck, "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ultrascale: error: --resume {ck} trained on {corpus}, whose index.json has changed since (it "
                   f"was prepared again): the batches would differ; resume with the corpus as it was, or start a "
                   f"new run"], err


def test_a_text_source_skips_binary_files_and_says_so(tmp_path, capsys):
    from ultrascale.cli import main

    write(tmp_path / "src" / "a.py", "def f():\n    return 1\n" * 50)
    write(tmp_path / "src" / "__pycache__" / "a.cpython-311.pyc", b"\x00\x01binary" * 100, binary=True)
    assert main(["data", "prepare", str(tmp_path / "src"), str(tmp_path / "out"), "--val-fraction", "0"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 binary file" in err and "a.cpython-311.pyc" in err, err
    index = json.load(open(tmp_path / "out" / "index.json"))
    assert index["splits"]["train"]["tokens"] == len("def f():\n    return 1\n" * 50) + 1  # the .py file and its EOS
