"""The `ultrascale` command. Thin: it parses, validates, and calls the library.

A configuration mistake is one line on stderr and exit status 2, before any
process starts or any file is written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

from ultrascale.config import ConfigError, build_config, load_toml
from ultrascale.errors import Diverged

# (flag, section, field, type, help). `bool` flags are switches; the TOML file uses the field names.
TRAIN_FLAGS = [
    ("--model", "model", "preset", str, "model preset: tiny, small, smollm-135m, llama3-8b, 1b, 8b, ..."),
    ("--vocab-size", "model", "vocab_size", int, "override the preset's vocabulary size"),
    ("--hidden", "model", "hidden", int, "override the hidden size"),
    ("--layers", "model", "layers", int, "override the number of layers"),
    ("--heads", "model", "heads", int, "override the number of query heads"),
    ("--kv-heads", "model", "kv_heads", int, "override the number of key/value heads (GQA)"),
    ("--ffn-hidden", "model", "ffn_hidden", int, "override the MLP hidden size"),
    ("--max-seq-len", "model", "max_seq_len", int, "override the longest sequence (RoPE table)"),
    ("--tie-embeddings", "model", "tie_embeddings", bool, "share the embedding and output matrices"),
    ("--experts", "model", "experts", int, "Mixture of Experts: experts per MoE block (0: dense)"),
    ("--top-k", "model", "top_k", int, "MoE: experts each token visits"),
    ("--moe-ffn-hidden", "model", "moe_ffn_hidden", int, "MoE: width of each expert (0: --ffn-hidden)"),
    ("--capacity-factor", "model", "capacity_factor", float, "MoE: expert capacity factor (0: dropless)"),
    ("--aux-loss-coef", "model", "aux_loss_coef", float, "MoE: load-balancing loss coefficient"),
    ("--router-score", "model", "router_score", str, "MoE: router scores, softmax or sigmoid"),
    ("--router-bias-rate", "model", "router_bias_rate", float, "MoE: aux-loss-free balancing bias update rate"),
    ("--dp", "parallel", "dp", int, "data-parallel size (default: what the other sizes leave)"),
    ("--tp", "parallel", "tp", int, "tensor-parallel size"),
    ("--pp", "parallel", "pp", int, "pipeline-parallel size"),
    ("--cp", "parallel", "cp", int, "context-parallel size"),
    ("--cp-attention", "parallel", "cp_attention", str, "context-parallel attention: allgather, ring (default), "
                                                         "zigzag or ulysses"),
    ("--ep", "parallel", "ep", int, "expert-parallel size (carved out of dp)"),
    ("--dispatch", "parallel", "dispatch", str, "expert parallelism: alltoall or allgather"),
    ("--pp-schedule", "parallel", "pp_schedule", str, "naive, afab, 1f1b, interleaved, zero-bubble or dualpipev (alias dualpipe)"),
    ("--pp-chunks", "parallel", "pp_chunks", int, "model chunks per pipeline rank (interleaved)"),
    ("--pp-first-stage-layers", "parallel", "pp_first_stage_layers", int, "blocks of the first pipeline stage "
                                                                           "(default: the even split)"),
    ("--pp-last-stage-layers", "parallel", "pp_last_stage_layers", int, "blocks of the last pipeline stage "
                                                                         "(default: the even split)"),
    ("--sp", "parallel", "sp", bool, "sequence parallelism within the tensor-parallel group"),
    ("--zero", "parallel", "zero", int, "ZeRO stage 0-3 (1: optimizer states, 2: + gradients, 3: + parameters)"),
    ("--dp-mode", "parallel", "dp_mode", str, "data parallelism: naive, overlap or bucket"),
    ("--bucket-mb", "parallel", "bucket_mb", float, "gradient bucket size in MB (bucket mode, ZeRO-1/2)"),
    ("--dp-comm-dtype", "parallel", "dp_comm_dtype", str, "fp32, or bf16 to compress the bucket all-reduce"),
    ("--offload", "parallel", "offload", str, "ZeRO-Offload: none, cpu (optimizer states, and ZeRO-3's parameter "
                                               "shards, in host memory; AdamW steps there) or disk (the states in "
                                               "files under --offload-dir)"),
    ("--offload-dir", "parallel", "offload_dir", str, "directory of --offload disk's files"),
    ("--steps", "train", "steps", int, "optimizer steps in all (a resumed run counts the saved ones)"),
    ("--seq-len", "train", "seq_len", int, "tokens per sequence"),
    ("--micro-batch", "train", "micro_batch", int, "sequences per micro-batch per data-parallel rank"),
    ("--grad-accum", "train", "grad_accum", int, "micro-batches per optimizer step"),
    ("--global-batch", "train", "global_batch", int, "sequences per optimizer step (sets --grad-accum: "
                                                     "micro-batch x grad-accum x dp)"),
    ("--lr", "train", "lr", float, "peak learning rate"),
    ("--min-lr-ratio", "train", "min_lr_ratio", float, "final learning rate as a fraction of the peak"),
    ("--warmup-steps", "train", "warmup_steps", int, "linear warmup steps"),
    ("--lr-schedule", "train", "lr_schedule", str, "after warmup: cosine, linear, wsd (warmup-stable-decay) or "
                                                    "constant"),
    ("--lr-decay-steps", "train", "lr_decay_steps", int, "length of the schedule, warmup included (0: --steps; a "
                                                         "checkpoint keeps the number)"),
    ("--lr-decay-fraction", "train", "lr_decay_fraction", float, "wsd: the share of the steps after warmup spent "
                                                                 "decaying"),
    ("--weight-decay", "train", "weight_decay", float, "AdamW weight decay on matrices"),
    ("--grad-clip", "train", "grad_clip", float, "clip the global gradient norm (0: off)"),
    ("--dtype", "train", "dtype", str, "fp32, bf16 or fp16 (16-bit compute, fp32 master weights and gradients; "
                                       "fp16 with dynamic loss scaling)"),
    ("--loss-scale-init", "train", "loss_scale_init", float, "fp16: the initial loss scale (default 65536)"),
    ("--loss-scale-window", "train", "loss_scale_window", int,
     "fp16: finite steps in a row after which the loss scale doubles (default 2000)"),
    ("--recompute", "train", "recompute", str, "activation recomputation: none, selective or full"),
    ("--fp8", "train", "fp8", bool, "FP8 linear layers in the blocks (torchao, per-tensor dynamic scaling; "
                                    "emulated on the CPU)"),
    ("--compile", "train", "compile", bool, "torch.compile each transformer block (regional compilation)"),
    ("--seed", "train", "seed", int, "seed of the initial weights and of the data order"),
    ("--data", "train", "data", str, "text file, directory, glob, .jsonl, .parquet, hf:NAME, a directory of "
                                     "`ultrascale data prepare`, or a blend \"0.7 DIR_A 0.3 DIR_B\" "
                                     "(default: Python's stdlib)"),
    ("--data-column", "train", "data_column", str, "text field of JSONL lines or dataset rows"),
    ("--data-split", "train", "data_split", str, "split of an hf: dataset"),
    ("--tokenizer", "train", "tokenizer", str, "'bytes' or a local Hugging Face tokenizer directory"),
    ("--val-fraction", "train", "val_fraction", float, "share of a raw --data held out for validation "
                                                        "(a prepared corpus keeps the split it was prepared with)"),
    ("--eval-every", "train", "eval_every", int, "the validation loss every N steps and at the last (0: never)"),
    ("--eval-batches", "train", "eval_batches", int, "global batches of the held-out split per evaluation"),
    ("--save", "train", "save", str, "checkpoint directory, written at the end (and every --save-every)"),
    ("--save-every", "train", "save_every", int, "also save every N steps"),
    ("--keep-last", "train", "keep_last", int, "keep the newest N saves, each in --save/step-NNNNNN (0: one "
                                               "checkpoint, replaced); --resume of the directory takes the latest"),
    ("--overwrite", "train", "overwrite", bool, "let --save replace a checkpoint of another run (another model, "
                                                "seed or data); without it that is refused before the run"),
    ("--resume", "train", "resume", str, "checkpoint directory to continue from"),
    ("--override-schedule", "train", "override_schedule", bool,
     "with --resume: this run's --lr, --min-lr-ratio, --warmup-steps and --lr-decay-steps, not the checkpoint's "
     "(back from a divergence with a lower --lr; the run then differs from one never interrupted)"),
    ("--init-from", "train", "init_from", str, "hf:DIR: start from a transformers Llama checkpoint (shape and weights)"),
    ("--log-jsonl", "train", "log_jsonl", str, "write one JSON object per step to this file"),
    ("--log-every", "train", "log_every", int, "print a line every N steps"),
    ("--pp-trace", "train", "pp_trace", str, "write the last step's pipeline timeline (draw it with pp-schedule --trace)"),
    ("--profile", "train", "profile", str, "write a torch.profiler trace per rank into this directory "
                                           "(read it with `ultrascale trace DIR`)"),
    ("--profile-steps", "train", "profile_steps", str, "the steps to profile, A:B (default 2:3, after warm-up)"),
    ("--peak", "train", "peak", str, "the ceiling of MFU: auto (measured once per machine and kept: `ultrascale "
                                     "peak`), datasheet, or TFLOP/s per device (default: datasheet on a known GPU, "
                                     "else auto)"),
    ("--tensorboard", "train", "tensorboard", str, "also write the step metrics as TensorBoard events to this directory"),
    ("--wandb", "train", "wandb", str, "also log the step metrics and the config to this Weights & Biases project "
                                       "(WANDB_MODE=offline: locally)"),
    ("--device", "train", "device", str, "auto, cpu or cuda"),
    ("--nproc", "train", "nproc", int, "spawn this many local processes (or use torchrun)"),
    ("--timeout", "train", "timeout", float,
     "seconds a collective may wait for the other ranks before the run ends (default 300)"),
]


# `ultrascale plan`'s names for the same things, taken here too (and plan takes ours): one vocabulary.
ALIASES = {"--dtype": ("--precision",), "--fp8": ("--float8",), "--pp-schedule": ("--schedule",),
           "--pp-chunks": ("--chunks",), "--moe-ffn-hidden": ("--expert-ffn-hidden",), "--nproc": ("--gpus",)}

# --help in groups: the TOML file's sections ([model], [parallel], [train]), the [train] section's
# settings by what they are about.
HELP_GROUPS = {
    "model": "model: [model] in a --config file",
    "parallel": "parallelism: [parallel]",
    "train": "optimization and precision: [train]",
    "data": "data and validation: [train]",
    "checkpoints": "checkpoints and starting points: [train]",
    "logging": "logging, metrics and profiling: [train]",
    "run": "processes and devices: [train]",
}
_TRAIN_GROUP = {
    **dict.fromkeys(("data", "data_column", "data_split", "tokenizer", "val_fraction", "eval_every",
                     "eval_batches"), "data"),
    **dict.fromkeys(("save", "save_every", "keep_last", "overwrite", "resume", "override_schedule", "init_from"),
                    "checkpoints"),
    **dict.fromkeys(("log_jsonl", "log_every", "pp_trace", "profile", "profile_steps", "peak", "tensorboard",
                     "wandb"), "logging"),
    **dict.fromkeys(("device", "nproc", "timeout"), "run"),
}


def help_group(section: str, dest: str) -> str:
    return _TRAIN_GROUP.get(dest, "train") if section == "train" else section


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line, the problem and where to look for the fix.
        print(f"ultrascale: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def _default(section: str, dest: str):
    """What a flag not given stands for: the dataclass's default (a model field: the preset's)."""
    from dataclasses import fields

    from ultrascale.config import ParallelConfig, TrainConfig

    if section == "model":
        return "tiny" if dest == "preset" else None
    known = {f.name: f.default for f in fields(TrainConfig if section == "train" else ParallelConfig)}
    return known.get(dest)


def _add_train(sub):
    from ultrascale.model.config import presets_table

    p = sub.add_parser("train", help="train a model on one or many processes",
                       usage="ultrascale train [--config FILE] [--model PRESET] [--nproc N] [--dp/--tp/--pp/--cp N] "
                             "[options below]",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="model presets (--model; a shape flag overrides one field of it):\n"
                              + "\n".join("  " + line for line in presets_table().splitlines()))
    p.add_argument("--config", help="TOML file with [model], [parallel], [train] sections; flags override it")
    groups = {name: p.add_argument_group(title) for name, title in HELP_GROUPS.items()}
    for flag, section, dest, typ, help_ in TRAIN_FLAGS:
        group = groups[help_group(section, dest)]
        names = (flag,) + ALIASES.get(flag, ())
        if len(names) > 1:
            help_ = f"{help_} (also {', '.join(names[1:])}, as `plan` says)"
        if typ is bool:
            group.add_argument(*names, dest=dest, action="store_const", const=True, default=None, help=help_)
            if dest == "sp":
                group.add_argument("--no-sp", dest="sp", action="store_const", const=False, default=None,
                                   help="tensor parallelism without sequence parallelism (the default here)")
            continue
        default = _default(section, dest)
        if default not in (None, "") and "default" not in help_:
            help_ = f"{help_} (default: {default:g})" if isinstance(default, float) else f"{help_} (default: {default})"
        group.add_argument(*names, dest=dest, type=typ, default=None, help=help_)
    groups["logging"].add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None,
                                   help="no progress bar")
    p.set_defaults(func=cmd_train)


def parse_train_config(args):
    """The RunConfig of defaults < checkpoint (with --resume) < TOML file < flags; and the
    resumed checkpoint's meta with what was given, or None."""
    flags = {"model": {}, "parallel": {}, "train": {}}
    for _, section, dest, _, _ in TRAIN_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            flags[section][dest] = value
    if args.progress is not None:
        flags["train"]["progress"] = args.progress
    file_values = load_toml(args.config) if args.config else {}
    given = {s: {**file_values.get(s, {}), **flags[s]} for s in flags}
    origin = {}  # "section.field" -> where it came from, the later source winning
    for source, values in (("--config " + str(args.config), file_values), ("the command line", flags)):
        origin.update({("model" if s == "model" and k == "preset" else f"{s}.{k}"): source
                       for s in values for k in values[s]})
    resumed = None
    if given["train"].get("resume") and given["train"].get("init_from"):
        from ultrascale.config import check_start

        check_start(given["train"]["resume"], given["train"]["init_from"])
    if given["train"].get("resume"):
        from ultrascale.train.record import read_record
        from ultrascale.train.resume import latest, resume_layer

        if latest(given["train"]["resume"]) != given["train"]["resume"]:  # a directory of per-step saves
            given["train"]["resume"] = flags["train"]["resume"] = latest(given["train"]["resume"])
            file_values.get("train", {}).pop("resume", None)
        record = read_record(given["train"]["resume"])
        layer = resume_layer(record.settings, given)
        file_values = {s: {**layer[s], **file_values.get(s, {})} for s in flags}
        taken = {("model" if s == "model" else f"{s}.{k}"): f"--resume {given['train']['resume']}"
                 for s in layer for k in layer[s]}
        origin = {**taken, **origin}
        resumed = (record, given)
    model = None
    if given["train"].get("init_from"):
        from ultrascale.model.hf import checkpoint_tokenizer, model_from_checkpoint

        model = model_from_checkpoint(given["train"]["init_from"], {**file_values.get("model", {}), **flags["model"]})
        own = checkpoint_tokenizer(given["train"]["init_from"])
        if own and "tokenizer" not in given["train"]:
            flags["train"]["tokenizer"] = own  # the vocabulary its embedding was trained on, not bytes
            origin["train.tokenizer"] = f"--init-from {given['train']['init_from']}"
        origin["model"] = f"--init-from {given['train']['init_from']}"
    return dataclasses.replace(build_config(file_values, flags, model), origin=origin), resumed


def _precheck(cfg) -> None:
    """Refuse, before any process starts, what the workers would refuse."""
    t = cfg.train
    if t.dtype != "fp32":
        import torch

        from ultrascale.parallel.precision import check_dtype_support

        cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
        check_dtype_support(t.dtype, "cuda" if cuda else "cpu")
    if t.fp8:
        import torch

        from ultrascale.parallel.fp8 import check_fp8_support

        cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
        check_fp8_support("cuda" if cuda else "cpu")
    if t.data or t.eval_every:
        from ultrascale.train.data import check_source

        check_source(t, cfg.global_batch)  # the files, the dataset's split and column, a prepared index, a raw source's size
    if t.tokenizer not in ("", "bytes"):
        from ultrascale.train.data import load_tokenizer

        load_tokenizer(t.tokenizer)  # a missing or unreadable directory, before any worker starts
    if t.init_from:
        from ultrascale.model.hf import hf_weights, parse_init_from

        path = parse_init_from(t.init_from)
        try:
            hf_weights(path, cfg.model)  # reads the headers only: every tensor present with its shape
        except ConfigError as e:
            raise ConfigError(f"--init-from hf:{e}") from None


def cmd_train(args) -> int:
    from ultrascale.distributed import failures
    from ultrascale.distributed.launch import is_worker, launch_local, launched_locally
    from ultrascale.preflight import check_offload_dir, check_output_paths
    from ultrascale.train.startup import check_run

    if launched_locally():
        failures.start_worker_supervision()  # heartbeat, and die with the launcher
    cfg, resumed = parse_train_config(args)
    if not launched_locally():
        # Where the run will write, first: cheap, and a bad path costs a whole run otherwise.
        # (Under --nproc the launcher checked; under torchrun every rank checks.)
        check_output_paths(cfg.train)
        check_offload_dir(cfg)
    world = int(os.environ["WORLD_SIZE"]) if is_worker() else cfg.train.nproc
    if is_worker() and cfg.train.nproc not in (1, world):
        raise ConfigError(f"--nproc {cfg.train.nproc} disagrees with WORLD_SIZE={world} set by the launcher")
    if resumed:
        from ultrascale.train.resume import fit_global_batch

        record, given = resumed
        # The accumulation that keeps the checkpoint's global batch, before the checks that depend on
        # it (a pipeline schedule's micro-batch count).
        cfg = fit_global_batch(cfg, record.settings, given, world)
    cfg = check_run(cfg, world)
    if not launched_locally():  # the launcher checked for its workers; under torchrun every rank reads
        from ultrascale.train.resume import check_save_target

        check_save_target(cfg)  # a --save onto another run's checkpoint, before anything runs
    if resumed:
        from ultrascale.train.resume import check_resume

        check_resume(cfg.train.resume, record, cfg)
        _verify_once(cfg.train.resume)
    if not is_worker():
        _precheck(cfg)
        if cfg.train.nproc > 1:
            return launch_local(sys.argv[1:], cfg.train.nproc, timeout_s=cfg.train.timeout,
                                on_failure=lambda: _clean_partial_save(cfg), worker_main=main,
                                preload=_WORKER_IMPORTS if _cpu_only(cfg.train.device) else ())
    return _train_here(cfg)


# What every rank imports: under --nproc the launcher imports it once and forks the ranks from itself.
# (torch._dynamo: the optimizer's first add_param_group imports it, compiling or not.)
_WORKER_IMPORTS = ("torch", "torch._dynamo", "torch.distributed", "ultrascale.distributed.context",
                   "ultrascale.train.trainer")


def _cpu_only(device: str) -> bool:
    """The run cannot touch CUDA, so its ranks may be forked: a child forked after its parent queried
    CUDA (even `torch.cuda.is_available()`) cannot use CUDA itself."""
    if device == "cpu":
        return True
    import torch

    return device == "auto" and torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def _verify_once(path: str) -> None:
    """Every byte of the checkpoint against meta.json's checksums, once and before any worker
    loads it: here in the launcher (or the one process); under torchrun on rank 0, before it
    joins the others (they wait for it, and its exit ends the run before anything is loaded)."""
    from ultrascale.distributed.launch import launched_locally
    from ultrascale.train.record import verified

    if not launched_locally() and os.environ.get("RANK", "0") == "0":
        verified(path)


def _clean_partial_save(cfg) -> None:
    if cfg.train.save:
        from ultrascale.train.checkpoint import clean_partial_saves

        clean_partial_saves(cfg.train.save, bool(cfg.train.keep_last))


def _train_here(cfg) -> int:
    from ultrascale.distributed.context import init_parallel
    from ultrascale.train.trainer import run_training

    # One process has no process group: nothing to tear down, and its errors are its own.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    with _fail_fast(cfg) if distributed else contextlib.nullcontext():
        ctx = init_parallel(cfg.parallel, cfg.train.device, cfg.train.timeout)
        result = run_training(cfg, ctx, log_to_stdout=True)
    ctx.destroy()
    if ctx.is_logging_rank and result.metrics:
        first, last = result.metrics[0], result.metrics[-1]
        rate = sum(m["tokens"] for m in result.metrics) / sum(m["step_time_s"] for m in result.metrics)
        print(f"done: {len(result.metrics)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
              f"{rate:,.0f} tokens/s", flush=True)
    return 0


@contextlib.contextmanager
def _fail_fast(cfg):
    """In a rank of a multi-process run: on an error, say what and where in one line, and exit now.

    Tearing down a process group that lost a peer can block, and the launcher (or
    torchrun's agent) is about to stop this process anyway.
    """
    try:
        yield
    except (ConfigError, Diverged):
        raise  # one line from main() (exit 2, or 1 for a diverged run), as in a single process
    except BrokenPipeError:
        if not _stdout_closed():
            _report_and_exit(cfg)
        # `| head` stopped reading. Exit now with the shell's status for a writer its reader left,
        # skipping the teardown of a process group whose peers still wait (it can block): the
        # launcher ends the run quietly on it, torchrun's agent tears the others down at once.
        from ultrascale.distributed.failures import EXIT_PIPE

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.stderr.flush()
        os._exit(EXIT_PIPE)
    except Exception:  # noqa: BLE001 - reported, then the process ends
        _report_and_exit(cfg)


def _stdout_closed() -> bool:
    """Our stdout is a pipe whose reader has gone (poll says so), not a socket of a lost peer."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _report_and_exit(cfg):
    """The exception being handled, said in one line (and its traceback for the rank's log); exit."""
    from ultrascale.distributed import failures

    import traceback

    traceback.print_exc()
    rank = int(os.environ.get("RANK", "0"))
    line = failures.describe(sys.exc_info()[1], rank, cfg.train.timeout, failures.current_step())
    print(f"ultrascale: {line}", file=sys.stderr)
    with contextlib.suppress(BrokenPipeError):  # a closed stdout must not hide the line
        sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ultrascale", description="The Ultra-Scale Playbook, as software that runs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train(sub)
    # Each further command registers itself here with its module's add_parser(sub).
    from ultrascale.parallel.pipeline.cli import add_parser as add_pp_schedule; add_pp_schedule(sub)  # noqa: E702
    from ultrascale.export import add_parser as add_export; add_export(sub)  # noqa: E702
    from ultrascale.generate import add_parser as add_generate; add_generate(sub)  # noqa: E702
    from ultrascale.plan.cli import add_parser as add_plan; add_plan(sub)  # noqa: E702
    from ultrascale.train.prepare import add_parser as add_data; add_data(sub)  # noqa: E702
    from ultrascale.train.trace_report import add_parser as add_trace; add_trace(sub)  # noqa: E702
    from ultrascale.series.cli import add_parser as add_notebook; add_notebook(sub)  # noqa: E702
    from ultrascale.train.peak import add_parser as add_peak; add_peak(sub)  # noqa: E702
    from ultrascale.train.plot import add_parser as add_plot; add_plot(sub)  # noqa: E702
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command they were given to: its --help lists what it takes
        sub = getattr(args, "command", None)
        prog = f"ultrascale {sub}" if sub else "ultrascale"
        verb = next((getattr(args, d) for d in ("plan_command", "notebook_command", "data_command")
                     if getattr(args, d, None)), None)  # `plan memory`: its own flags, not plan's
        prog += f" {verb}" if verb else ""
        hint = _close_flag(extra[0], parser, sub, verb)
        print(f"ultrascale: error: unrecognized arguments: {' '.join(extra)}{hint} (see `{prog} --help`)",
              file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ConfigError, Diverged) as e:
        # In a multi-process run every rank finds the same mistake: say it once (under
        # `--nproc`, the launcher picks one rank's line; under torchrun, rank 0 says it).
        from ultrascale.distributed.launch import launched_locally

        if int(os.environ.get("RANK", "0")) == 0 or launched_locally():
            print(f"ultrascale: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, Diverged) else 2  # a run that started and failed; a mistake found first
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ultrascale plan ... | head`: the reader has what it wanted. Point stdout at
        # /dev/null so the interpreter's final flush does not fail a second time. (A rank of a
        # multi-process run exits in _fail_fast instead, with failures.EXIT_PIPE.)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _subparser(parser, name):
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices.get(name) if actions and name else None


def _close_flag(word: str, parser, command, verb=None) -> str:
    """'; did you mean --X?' for a flag close to one the command (and its verb: `plan memory`) takes; for
    a flag the command takes without its verb, which of the two takes it."""
    import difflib

    if not word.startswith("--") or command is None:
        return ""
    sub = _subparser(parser, command)
    inner = _subparser(sub, verb) if sub is not None else None
    flags = [o for a in (inner or sub)._actions for o in a.option_strings if o.startswith("--")] if sub else []
    flag = word.split("=")[0]
    if inner is not None and flag in {o for a in sub._actions for o in a.option_strings}:
        return f"; {flag} is `ultrascale {command}`'s, not `ultrascale {command} {verb}`'s"
    near = difflib.get_close_matches(flag, flags, n=1, cutoff=0.75)
    return f"; did you mean {near[0]}?" if near else ""


if __name__ == "__main__":
    sys.exit(main())
