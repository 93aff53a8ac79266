"""`ultrascale export`: a checkpoint written by `train --save` as a transformers model.

  ultrascale export --hf OUT_DIR CHECKPOINT_DIR [--dtype fp32|bf16] [--tokenizer DIR] [--force]

OUT_DIR then loads with `LlamaForCausalLM.from_pretrained(OUT_DIR)` (a Mixture-of-Experts
model: `MixtralForCausalLM`, where its shape is one Mixtral computes; another is refused in one
line naming what Mixtral lacks): config.json,
model.safetensors, and the tokenizer files of the run's `--tokenizer` directory
(a run on bytes has none to copy). Everything is checked before anything is
written, the checkpoint's files against meta.json's sizes and checksums too;
OUT_DIR appears whole or not at all.

Importing this module costs argparse only.
"""

from __future__ import annotations

import os


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face transformers model")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="directory to write the transformers model into")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a directory written by `ultrascale train --save`")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the written weights")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer directory to copy files from (default: the run's --tokenizer; 'bytes': none)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from ultrascale.errors import ConfigError
    from ultrascale.model.hf import check_out_dir, save_hf
    from ultrascale.train.checkpoint import read_full_state
    from ultrascale.parallel.precision import DTYPES

    check_out_dir(args.hf, args.force)
    from ultrascale.train.record import read_record
    from ultrascale.train.resume import latest

    cfg = read_record(latest(args.checkpoint.rstrip("/") or "/"), what="checkpoint").config.model  # the shape
    if cfg.is_moe:
        from ultrascale.model.hf import check_mixtral

        check_mixtral(cfg)  # before any tensor is read
    record, state = read_full_state(args.checkpoint)
    tokenizer = args.tokenizer if args.tokenizer is not None else record.config.train.tokenizer
    tokenizer_dir = None if tokenizer in ("", "bytes") else tokenizer
    if tokenizer_dir and not os.path.isdir(tokenizer_dir):
        raise ConfigError(f"tokenizer directory {tokenizer_dir} (the run's --tokenizer) is gone: pass "
                          f"--tokenizer DIR, or --tokenizer bytes to export without tokenizer files")
    if tokenizer_dir and args.tokenizer is None:
        from ultrascale.train.data import check_run_tokenizer

        check_run_tokenizer(tokenizer_dir, record.tokenizer, f"checkpoint {args.checkpoint}")
    try:
        save_hf(cfg, state, args.hf, tokenizer_dir=tokenizer_dir, dtype=DTYPES[args.dtype], force=args.force)
    except OSError as e:
        raise ConfigError(f"cannot write {args.hf}: {e.strerror or e}") from None
    n = sum(t.numel() for t in state.values())
    print(f"wrote {args.hf}: {cfg.layers} layers, {n:,} parameters ({args.dtype})"
          + (f", tokenizer from {tokenizer_dir}" if tokenizer_dir else ""))
    return 0
