"""`ultrascale data prepare`: a corpus tokenized once into memory-mapped shards.

  ultrascale data prepare SOURCE OUT_DIR [--tokenizer DIR] [--val-fraction 0.01] [--workers N]
  ultrascale data info OUT_DIR [--verify]
  ultrascale data info CHECKPOINT          what its run trained on, and whether it is still there as it was

SOURCE is what `train --data` reads raw (text files, directories, globs, JSONL,
parquet, hf:DATASET_DIR). It is cut into pieces of about 16 MiB (train/corpus.py),
tokenized on every core, one piece per task, and each piece written as two shards:

  OUT_DIR/train-00000.bin   the piece's training tokens, uint16 (vocabulary <= 65,536) or uint32
  OUT_DIR/train-00000.docs  int64 offsets after each end-of-document token (document boundaries)
  OUT_DIR/val-00000.bin     the held-out sections of the same piece, and .docs
  OUT_DIR/index.json        written last: the tokenizer's identity, the dtype, every shard's token
                            and document counts and SHA-256; `train --data OUT_DIR` reads this

nanoGPT's prepare.py writes one uint16 .bin; Megatron and nanotron write indexed
shards. A piece is finished when its record (pieces/NNNNN.json) exists, written
after its shards: an interrupted run started again with the same arguments
redoes only the pieces without one. The split is a function of the corpus alone
(a hash of each section's place), so any number of workers writes the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time

from ultrascale.errors import ConfigError, no_room, no_room_error

# numpy and the tokenizers are imported where used: every `ultrascale` command builds this parser.

FORMAT = 1
SETTINGS = ".prepare.json"  # what this directory is being prepared from: a run started again must match


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare a corpus once as memory-mapped token shards (any size)")
    verbs = p.add_subparsers(dest="data_command", required=True)
    # The docstring's account of SOURCE and of the shards, laid out as written (its table of files kept).
    q = verbs.add_parser("prepare", help="tokenize SOURCE into OUT_DIR, on every core",
                         description="\n\n".join(__doc__.split("\n\n")[2:4]),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("source", metavar="SOURCE", help="text file, directory, glob, .jsonl, .parquet or hf:DATASET_DIR")
    q.add_argument("out", metavar="OUT_DIR", help="where the shards and index.json go")
    q.add_argument("--tokenizer", default="bytes", help="'bytes' (default) or a local Hugging Face tokenizer directory")
    q.add_argument("--data-column", default="text", help="text field of JSONL lines, parquet or dataset rows")
    q.add_argument("--data-split", default="train", help="split of an hf: dataset")
    q.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of the corpus held out for validation (by sections of about 8K characters)")
    q.add_argument("--workers", type=int, default=0, help="processes (default: every core)")
    q.add_argument("--piece-mb", type=float, default=16.0,
                   help="text per piece and shard, in MiB (a file larger than this is read in blocks cut at lines)")
    q.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it holds something else")
    q.set_defaults(func=cmd_prepare)
    i = verbs.add_parser("info", help="what a prepared directory holds, or what a checkpoint trained on")
    i.add_argument("out", metavar="DIR", help="a prepared corpus, or a checkpoint (its data and tokenizer)")
    i.add_argument("--verify", action="store_true", help="also check every shard's SHA-256")
    i.set_defaults(func=cmd_info)


# ----------------------------------------------------------------------------- one piece (a worker)

_TOKENIZER = None


def _init_worker(spec: str) -> None:
    from ultrascale.train import corpus

    global _TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    _TOKENIZER = corpus.tokenizer_for(spec)


def _write(path: str, array) -> str:
    """Write through a temporary name (a killed worker leaves no half shard under the real one)."""
    tmp = path + ".tmp"
    data = memoryview(array).cast("B")  # the array's own bytes: no copy to write or to hash
    try:
        with open(tmp, "wb") as f:
            f.write(data)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # a full disk leaves no half shard filling it
        raise
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def _prepare_piece(args) -> dict:
    from ultrascale.train import corpus

    number, piece, out, dtype, val_fraction, column, split = args
    try:
        streams = corpus.tokenize_piece(piece, _TOKENIZER, val_fraction, column, split)
        return _write_piece(number, streams, out, dtype)
    except ConfigError as e:
        return {"error": str(e)}
    except OSError as e:
        if not no_room(e):
            raise
        return {"error": str(no_room_error(out, e, "the pieces written so far are kept, and the same command "
                                                  "run again finishes the rest"))}


def _write_piece(number: int, streams: dict, out: str, dtype: str) -> dict:
    record = {"piece": number}
    for name, (tokens, ends) in streams.items():
        base = f"{name}-{number:05d}"
        record[name] = {"file": base + ".bin", "docs_file": base + ".docs", "tokens": int(len(tokens)),
                        "docs": int(len(ends)), "sha256": _write(os.path.join(out, base + ".bin"), tokens.astype(dtype))}
        _write(os.path.join(out, base + ".docs"), ends)
    tmp = os.path.join(out, "pieces", f"{number:05d}.json.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, os.path.join(out, "pieces", f"{number:05d}.json"))
    return record


# ----------------------------------------------------------------------------- the command


def _check_out(out: str, settings: dict, overwrite: bool) -> str:
    """'fresh', 'resume' (the same preparation, interrupted) or 'done'; anything else is refused."""
    if not os.path.exists(out):
        return "fresh"
    if not os.path.isdir(out):
        raise ConfigError(f"{out}: exists and is not a directory: give another OUT_DIR")
    held = os.listdir(out)
    if not held:
        return "fresh"
    mine = os.path.join(out, SETTINGS)
    same = False
    if os.path.isfile(mine):
        try:
            with open(mine) as f:
                same = json.load(f) == settings
        except (OSError, json.JSONDecodeError):
            same = False
    if same:
        return "done" if os.path.isfile(os.path.join(out, "index.json")) else "resume"
    # A preparation that failed before any piece was finished (a wrong --data-column, say): only its own
    # files, no piece record, no index. Run again with the mistake corrected, it starts afresh.
    import re

    pieces = os.path.join(out, "pieces")
    ours = re.compile(r"(\.prepare\.json|pieces|index\.json\.tmp|(train|val)-\d{5}\.(bin|docs)(\.tmp)?)")
    unfinished = os.path.isfile(mine) and all(ours.fullmatch(n) for n in held) and not any(
        n.endswith(".json") for n in (os.listdir(pieces) if os.path.isdir(pieces) else []))
    if overwrite or unfinished:  # unfinished: a preparation that failed before any piece, corrected now

        import shutil

        shutil.rmtree(out)
        return "fresh"
    what = "another preparation (other source or settings)" if os.path.isfile(mine) else "other files"
    raise ConfigError(f"{out}: holds {what}: give an empty or new OUT_DIR, or --overwrite to replace it")


def cmd_prepare(args) -> int:
    import multiprocessing as mp

    from ultrascale.train import corpus

    if not 0 <= args.val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {args.val_fraction:g}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = args.workers or cores
    if args.workers < 0:
        raise ConfigError(f"--workers must be positive (0: every core), got {args.workers}")
    tok = corpus.tokenizer_for(args.tokenizer)  # a bad tokenizer directory, before anything is read
    if not args.piece_mb > 0:
        raise ConfigError(f"--piece-mb must be positive, got {args.piece_mb:g}")
    budget = max(1, int(args.piece_mb * 2**20))
    segs = corpus.segments(args.source, args.data_column, args.data_split, block=budget)
    plan = corpus.pieces(segs, budget)
    if not plan:
        raise ConfigError(f"{args.source}: no documents found")
    total_bytes = sum(s.size for s in segs)
    skipped = corpus.binary_files(args.source) if args.source and not args.source.startswith("hf:") else []
    if skipped:
        print(f"{args.source}: skipped {len(skipped)} binary file{'s' if len(skipped) > 1 else ''} (a NUL byte in "
              f"the first 8,000 bytes), e.g. {os.path.relpath(skipped[0], args.source if os.path.isdir(args.source) else '.')}",
              file=sys.stderr)
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    settings = {"format": FORMAT, "source": args.source, "column": args.data_column, "split": args.data_split,
                "tokenizer": dict(tok.identity), "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "dtype": dtype,
                "val_fraction": args.val_fraction, "pieces": len(plan), "bytes": total_bytes,
                "piece_bytes": budget, "section_chars": corpus.SECTION_CHARS}
    state = _check_out(args.out, settings, args.overwrite)
    if state == "done":
        print(f"{args.out}: already prepared from {args.source} (nothing to do)", file=sys.stderr)
        return 0
    try:
        os.makedirs(os.path.join(args.out, "pieces"), exist_ok=True)
        with open(os.path.join(args.out, SETTINGS), "w") as f:
            json.dump(settings, f, indent=1)
    except OSError as e:
        raise ConfigError(f"cannot write {args.out}: {e.strerror or e}") from None
    done = {}
    for name in os.listdir(os.path.join(args.out, "pieces")):
        if name.endswith(".json"):
            with open(os.path.join(args.out, "pieces", name)) as f:
                record = json.load(f)
            done[record["piece"]] = record
    todo = [n for n in range(len(plan)) if n not in done]
    if done:
        print(f"{args.out}: resuming, {len(done)} of {len(plan)} pieces already prepared", file=sys.stderr)
    start, tokens = time.perf_counter(), 0
    work = [(n, plan[n], args.out, dtype, args.val_fraction, args.data_column, args.data_split) for n in todo]
    bar = _bar(len(plan), len(done))
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with context.Pool(max(1, min(workers, len(work) or 1)), _init_worker, (args.tokenizer,)) as pool:
        for record in pool.imap_unordered(_prepare_piece, work):
            if "error" in record:
                pool.terminate()
                raise ConfigError(record["error"])
            done[record["piece"]] = record
            tokens += record["train"]["tokens"] + record["val"]["tokens"]
            elapsed = time.perf_counter() - start
            bar.update(1, tokens / elapsed if elapsed else 0.0)
    bar.close()
    index = _write_index(args.out, settings, [done[n] for n in range(len(plan))])
    elapsed = time.perf_counter() - start
    train, val = index["splits"]["train"], index["splits"]["val"]
    print(f"wrote {args.out}: {train['tokens']:,} training tokens in {train['docs']:,} documents, "
          f"{val['tokens']:,} held out ({args.val_fraction:g}), {dtype}, {len(plan)} shards; "
          f"{tokens:,} tokens in {elapsed:.1f} s ({tokens / max(elapsed, 1e-9):,.0f} tokens/s on "
          f"{min(workers, max(1, len(work)))} processes)")
    return 0


def _write_index(out: str, settings: dict, records: list[dict]) -> dict:
    index = {"format": FORMAT, "tokenizer": dict(settings["tokenizer"]), "vocab_size": settings["vocab_size"],
             "eos_id": settings["eos_id"], "dtype": settings["dtype"], "source": settings["source"],
             "val_fraction": settings["val_fraction"], "splits": {}}
    index["tokenizer"]["vocab_size"] = settings["vocab_size"]
    for name in ("train", "val"):
        shards = [r[name] for r in records]
        index["splits"][name] = {"tokens": sum(s["tokens"] for s in shards), "docs": sum(s["docs"] for s in shards),
                                 "shards": shards}
    tmp = os.path.join(out, "index.json.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(index, f, indent=1)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if no_room(e):
            raise no_room_error(out, e, "every piece is written: the same command run again writes the index") from None
        raise
    os.replace(tmp, os.path.join(out, "index.json"))
    return index


class _bar:
    """A tqdm bar on a terminal, nothing otherwise (the final line says it all)."""

    def __init__(self, total: int, initial: int):
        self.tqdm = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.tqdm = tqdm(total=total, initial=initial, unit="piece", dynamic_ncols=True, leave=False)

    def update(self, n: int, rate: float) -> None:
        if self.tqdm is not None:
            self.tqdm.update(n)
            self.tqdm.set_postfix_str(f"{rate:,.0f} tokens/s")

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()


def checkpoint_info(path: str) -> None:
    """What a checkpoint's run trained on, from its run record, and whether it is still there as it was."""
    from ultrascale.train.data import data_identity, same_tokenizer
    from ultrascale.train.record import read_record

    record = read_record(path, "checkpoint")
    t = record.config.train
    print(f"checkpoint {path}: step {record.step} of a run of {t.steps} steps, {record.config.model.name} "
          f"({record.config.model.layers} layers), saved by {record.world_size} "
          f"process{'' if record.world_size == 1 else 'es'}")
    if not t.data:
        print("data: Python's standard library (the default source)")
    elif not record.data:
        print(f"data: {t.data} (read raw: no index to compare)")
    now = {d["path"]: d for d in data_identity(t.data)}
    for d in record.data:
        state = ("unchanged" if now.get(d["path"]) == d else "gone" if d["path"] not in now
                 else "prepared again since: other batches")
        print(f"data: {d['path']} (prepared; index sha256 {d['index_sha256'][:12]}: {state})")
    tok = record.tokenizer
    if tok is None:
        print(f"tokenizer: {t.tokenizer} (a record before the tokenizer's files were hashed)")
    elif tok.get("kind") == "hf":
        state = "unchanged" if same_tokenizer(t.tokenizer, tok) else "gone or changed since"
        print(f"tokenizer: {t.tokenizer} (Hugging Face; files sha256 {tok.get('sha256', '')[:12]}: {state})")
    else:
        print("tokenizer: bytes")


def cmd_info(args) -> int:
    from ultrascale.train.data import read_index
    from ultrascale.train.resume import latest

    if os.path.isfile(os.path.join(latest(args.out), "meta.json")):
        checkpoint_info(latest(args.out))
        return 0
    index = read_index(args.out)
    for name in ("train", "val"):
        s = index["splits"][name]
        print(f"{name}: {s['tokens']:,} tokens, {s['docs']:,} documents, {len(s['shards'])} shards")
    tok = index["tokenizer"]
    print(f"tokenizer: {tok['kind']}{' ' + tok.get('path', '') if tok['kind'] == 'hf' else ''} "
          f"(vocabulary {index['vocab_size']:,}, {index['dtype']}); source {index['source']}")
    if args.verify:
        bad = []
        for name in ("train", "val"):
            for s in index["splits"][name]["shards"]:
                with open(os.path.join(args.out, s["file"]), "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest() if hasattr(hashlib, "file_digest") \
                        else hashlib.sha256(f.read()).hexdigest()
                if digest != s["sha256"]:
                    bad.append(s["file"])
        if bad:
            raise ConfigError(f"{args.out}: {len(bad)} shards differ from their checksums ({', '.join(bad[:3])}): "
                              f"prepare the corpus again")
        print("verified: every shard matches its SHA-256")
    return 0
