"""`ultrascale plan`: search, one configuration's memory, and validation against measurements.

  ultrascale plan --model llama3-8b --gpus 64 --gpu h100-80gb --seq-len 4096 --global-batch-tokens 1048576
  ultrascale plan memory --model llama3-8b --dp 8 --zero 1 --micro-batch 1 --seq-len 4096 [--json] [--chart mem.png]
  ultrascale plan validate [--data playbook_benchmarks.csv] [--json] [--cross-validate]

Importing this module costs argparse only; the planner loads when a command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from ultrascale.errors import ConfigError, positive_number

# (flag, ModelShape field, type, help)
MODEL_FLAGS = [
    ("--vocab-size", "vocab", int, "override the vocabulary size"),
    ("--hidden", "hidden", int, "override the hidden size"),
    ("--layers", "layers", int, "override the number of blocks"),
    ("--heads", "heads", int, "override the query heads"),
    ("--kv-heads", "kv_heads", int, "override the key/value heads (GQA)"),
    ("--ffn-hidden", "ffn_hidden", int, "override the MLP width"),
    ("--experts", "experts", int, "Mixture of Experts: experts per block (0: dense)"),
    ("--top-k", "top_k", int, "MoE: experts each token visits"),
    ("--expert-ffn-hidden", "expert_ffn_hidden", int, "MoE: width of one expert's MLP"),
]
def schedule_name(name: str) -> str:
    """--schedule as the engine's --pp-schedule reads it: `dualpipe` names its V form, dualpipev."""
    from ultrascale.config import PP_SCHEDULE_ALIASES

    return PP_SCHEDULE_ALIASES.get(name, name)


def offload_tier(name: str) -> str:
    """--offload, refused at parsing when it names no tier (the search would find nothing to fit)."""
    if name not in ("none", "cpu", "disk"):
        raise argparse.ArgumentTypeError(f"must be none, cpu or disk, got {name!r}")
    return name


LAYOUT_FLAGS = [  # (flag, Layout field, type, help); None default: searched (plan) or the Layout default (memory)
    ("--dp", "dp", int, "data-parallel size"),
    ("--tp", "tp", int, "tensor-parallel size"),
    ("--pp", "pp", int, "pipeline-parallel size"),
    ("--cp", "cp", int, "context-parallel size"),
    ("--cp-attention", "cp_attention", str, "context-parallel attention: allgather, ring, zigzag (the planner's "
                                            "default) or ulysses"),
    ("--ep", "ep", int, "expert-parallel size (carved out of dp)"),
    ("--zero", "zero", int, "ZeRO stage 0-3"),
    ("--recompute", "recompute", str, "activation recomputation: none, selective, full"),
    ("--micro-batch", "micro_batch", int, "sequences per micro-batch per data-parallel rank"),
    ("--schedule", "schedule", schedule_name, "pipeline schedule: afab, 1f1b, interleaved, zero-bubble, dualpipev "
                                              "(dualpipe: its V form)"),
    ("--chunks", "chunks", int, "model chunks per pipeline rank (interleaved)"),
    ("--pp-first-stage-layers", "first_stage_layers", int, "blocks of the first pipeline stage (0: the even split)"),
    ("--pp-last-stage-layers", "last_stage_layers", int, "blocks of the last pipeline stage (0: the even split)"),
    ("--offload", "offload", offload_tier, "ZeRO-Offload: none, cpu or disk (the optimizer shard, and ZeRO-3's parameter "
                                  "shard, off the GPU)"),
]


# `ultrascale train`'s names for the same things, taken here too (and train takes these): one vocabulary.
TRAIN_NAMES = {"--expert-ffn-hidden": "--moe-ffn-hidden", "--precision": "--dtype", "--float8": "--fp8",
               "--schedule": "--pp-schedule", "--chunks": "--pp-chunks", "--gpus": "--nproc"}


def _names(flag: str) -> tuple[str, ...]:
    return (flag, TRAIN_NAMES[flag]) if flag in TRAIN_NAMES else (flag,)


def _common(p, search: bool) -> None:
    p.add_argument("--model", help="model preset (llama3-8b, llama3-70b, 1b, 8b, mixtral-8x7b, ...)")
    for flag, dest, typ, help_ in MODEL_FLAGS:
        p.add_argument(*_names(flag), dest=f"shape_{dest}", type=typ, default=None, metavar="N", help=help_)
    p.add_argument("--tie-embeddings", dest="shape_tie_embeddings", action="store_const", const=True, default=None,
                   help="share the embedding and output matrices")
    p.add_argument("--gpu", default=None, help="GPU: h100-80gb (default), h200, a100-80gb, a100-40gb: vendor-built "
                                               "nodes of 8 (or the GPU of --cluster)")
    p.add_argument("--cluster", default=None, help="where the GPUs sit (hardware.py): playbook (the playbook's H100 "
                                                   "cluster, its per-node-pair cost), grand-teton, llama3, jean-zay, "
                                                   "or a GPU's generic nodes (default: those of --gpu)")
    # Any cluster's links, set (hardware.with_bandwidths): GB/s per GPU and direction, as a collective achieves them.
    p.add_argument("--nvlink-gbs", type=float, default=None, metavar="GB/s",
                   help="bandwidth inside a node, per GPU and direction (H100 NVLink: 360, H800: 160)")
    p.add_argument("--ib-gbs", type=float, default=None, metavar="GB/s",
                   help="bandwidth between nodes, per GPU and direction (400 Gb/s InfiniBand: 40)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument(*_names("--precision"), dest="precision", default="bf16", help="fp32, bf16 (default), bf16-fp32-grads, bf16-fp32-accum")
    p.add_argument("--framework", default=None, help="megatron (default), torchtitan, playbook (nanotron, "
                                                     "calibrated on the playbook's runs) or ultrascale (our "
                                                     "engine): a bundle of the switches below")
    p.add_argument("--kernels", choices=("eager", "fused"), default=None,
                   help="norms and attention layout: eager (our engine) or fused (default: the framework's)")
    p.add_argument("--attention", choices=("flash", "eager"), default=None,
                   help="flash keeps the attention output and logsumexp; eager keeps the s x s softmax")
    p.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                   help="dropout after attention and MLP (1-byte masks kept for backward)")
    p.add_argument("--fused-swiglu", action=argparse.BooleanOptionalAction, default=None,
                   help="a fused SwiGLU keeps 3 f-wide tensors per token, not 4")
    p.add_argument(*_names("--float8"), dest="float8", action=argparse.BooleanOptionalAction, default=None,
                   help="the blocks' linears in float8 at the GPU's FP8 peak (torchtitan's default)")
    p.add_argument("--tp-overlap", dest="tp_overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="tensor parallelism's collectives beside the matmuls they feed (Megatron's "
                        "--tp-comm-overlap, torchtitan's async TP; needs sequence parallelism)")
    p.add_argument("--block", choices=("llama", "gpt"), default=None,
                   help="gpt: LayerNorm, a 4h GELU MLP and biases in place of the preset's block")
    p.add_argument("--partition", choices=("even", "compute"), default=None,
                   help="how blocks are cut into pipeline stages: even (the engine's and Megatron's, default) or "
                        "compute (nanotron's cost split, what `plan validate` replays for the playbook's runs)")
    p.add_argument("--no-sp", dest="sp", action="store_false", help="tensor parallelism without sequence parallelism")
    p.add_argument("--sp", dest="sp", action="store_true", help="tensor parallelism with sequence parallelism (the "
                                                                "default)")
    p.add_argument("--json", action="store_true", help="print JSON with every field")
    for flag, dest, typ, help_ in LAYOUT_FLAGS:
        p.add_argument(*_names(flag), dest=dest, type=typ, default=None, metavar="N" if typ is int else "NAME",
                       help=help_ + (" (default: searched)" if search and dest != "cp_attention" else ""))


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="find the best configuration; memory of one; validation against measurements")
    _common(p, search=True)
    p.add_argument(*_names("--gpus"), dest="gpus", type=int, help="number of GPUs")
    p.add_argument("--global-batch-tokens", type=int, default=None,
                   help="tokens per optimizer step (default 1,048,576)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step, as `train` takes it (x --seq-len tokens)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--emit-config", metavar="PATH", help="(planned for this engine, --framework ultrascale, unless one is named) write the best layout as a TOML file for "
                                                         "`ultrascale train --config PATH`")
    p.add_argument("--emit-launch", choices=["slurm"], help="with --emit-config: also write an sbatch "
                                                             "script beside it (PATH.sbatch), torchrun on each node")
    p.add_argument("--html", metavar="OUT.html", help="write the ranked layouts as one interactive page: memory "
                                                      "by owner, step time by cause, the pipeline schedule")
    p.set_defaults(func=cmd_search)
    plan_sub = p.add_subparsers(dest="plan_command", metavar="{memory,validate,published}")
    m = plan_sub.add_parser("memory", help="per-GPU memory (and step time) of one configuration")
    _common(m, search=False)
    m.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (the pipeline's m)")
    m.add_argument("--bucket-mb", type=positive_number, default=25.0, help="gradient bucket cap in MB (ZeRO padding, buffers)")
    m.add_argument("--chart", help="draw the breakdown as a stacked bar chart (PNG)")
    m.add_argument("--emit-config", metavar="PATH", help="(planned for this engine, --framework ultrascale, unless one is named) write this layout as a TOML file for "
                                                         "`ultrascale train --config PATH`")
    m.add_argument("--emit-launch", choices=["slurm"], help="with --emit-config: also write an sbatch "
                                                             "script beside it (PATH.sbatch), torchrun on each node")
    m.set_defaults(func=cmd_memory)
    v = plan_sub.add_parser("validate", help="the planner's figures against the playbook's H100 runs")
    v.add_argument("--data", help="the CSV (default: ../shared/data/playbook_benchmarks.csv, else the packaged copy)")
    v.add_argument("--json", action="store_true", help="print the figures as JSON")
    v.add_argument("--cross-validate", action="store_true",
                   help="also calibrate the time model's synchronization constants on two models and report "
                        "the other two")
    v.set_defaults(func=cmd_validate)
    pub = plan_sub.add_parser("published", help="the planner against runs published on other clusters: the "
                                                "defaults and each run's own framework and cluster")
    pub.add_argument("--json", action="store_true", help="print the table as JSON")
    pub.set_defaults(func=cmd_published)


def _model(args):
    """The model asked for: the preset, the fields given and what follows from them (plan/overrides.py)."""
    from ultrascale.errors import ConfigError
    from ultrascale.plan.shape import known_models, resolve_shape

    if not args.model:
        raise ConfigError(f"--model is required: one of {', '.join(known_models())}")
    overrides = {k[len("shape_"):]: v for k, v in vars(args).items() if k.startswith("shape_") and v is not None}
    for k, v in overrides.items():
        if isinstance(v, int) and not isinstance(v, bool) and v <= 0 and k not in ("experts",):
            raise ConfigError(f"--{k.replace('_', '-')} must be a positive integer, got {v}")
    # --block: the GPT-3 block (LayerNorm, GELU, biases; its MLP 4h wide by GPT-3's rule unless given)
    # or the Llama block, in place of the preset's.
    if args.block == "gpt":
        overrides = {"norm": "layernorm", "mlp": "gelu", "bias": True, **overrides}
    elif args.block == "llama":
        overrides = {"norm": "rmsnorm", "mlp": "swiglu", "bias": False, **overrides}
    return resolve_shape(args.model, **overrides)


def _context(args):
    from ultrascale.errors import ConfigError
    from ultrascale.plan.hardware import get_cluster
    from ultrascale.plan.precision import get_precision

    get_precision(args.precision)
    from ultrascale.plan.hardware import with_bandwidths

    cluster, fw = with_bandwidths(get_cluster(args.cluster, args.gpu), args.nvlink_gbs, args.ib_gbs), framework_of(args)
    if fw.float8 and "fp8" not in cluster.peak_flops:
        raise ConfigError(f"framework {fw.name} plans float8 linears, which the {cluster.gpu.name} has no FP8 tensor "
                          f"cores for: add --no-float8")
    if fw.tp_overlap and getattr(args, "sp", None) is False:
        raise ConfigError("--tp-overlap cuts sequence parallelism's all-gathers and reduce-scatters into pieces beside "
                          "the matmuls: drop --no-sp, or --tp-overlap")
    return cluster, fw


def assumptions(cluster, fw) -> str:
    """What the figures assume, said with them: which software on which machines."""
    from ultrascale.plan.calibration import DEFAULT_FRAMEWORK

    return (f"framework {fw.name}{' (default)' if fw.name == DEFAULT_FRAMEWORK else ''}, cluster {cluster.name} "
            f"({cluster.help})")


def framework_of(args):
    """The --framework preset with the switches given on the command line in place of its own.
    The stage split is the even one unless --partition compute asks for nanotron's."""
    from dataclasses import replace

    from ultrascale.plan.calibration import DEFAULT_FRAMEWORK, get_framework

    # A plan to train on this engine is planned with this engine's kernels and memory.
    fw = get_framework(args.framework or ("ultrascale" if getattr(args, "emit_config", None) else DEFAULT_FRAMEWORK))
    switches = {"partition": args.partition or "even"}
    for name in ("kernels", "attention", "dropout", "fused_swiglu", "float8", "tp_overlap"):
        if getattr(args, name) is not None:
            switches[name] = getattr(args, name)
    return replace(fw, **switches)


def cmd_search(args) -> int:
    from ultrascale.errors import ConfigError
    from ultrascale.plan import report
    from ultrascale.plan.layout import check_framework
    from ultrascale.plan.search import batch_sequences, gpus_needed, search

    model = _model(args)
    shape = model.shape
    gpu, fw = _context(args)
    if args.gpus is None:
        raise ConfigError("--gpus is required (or use `ultrascale plan memory` for one configuration)")
    if args.top <= 0:
        raise ConfigError(f"--top must be a positive integer, got {args.top}")
    if args.global_batch is not None and args.global_batch_tokens is not None:
        raise ConfigError("--global-batch (sequences) and --global-batch-tokens say the same thing: give one")
    if args.global_batch is not None:
        if args.global_batch <= 0:
            raise ConfigError(f"--global-batch must be a positive number of sequences, got {args.global_batch}")
        args.global_batch_tokens = args.global_batch * args.seq_len
    elif args.global_batch_tokens is None:
        args.global_batch_tokens = 1048576
    fixed = {dest: getattr(args, dest) for _, dest, _, _ in LAYOUT_FLAGS if getattr(args, dest) is not None}
    if not args.sp:
        fixed["sp"] = False
    may_be_zero = ("zero", "first_stage_layers", "last_stage_layers")
    for k, v in fixed.items():
        if isinstance(v, int) and not isinstance(v, bool) and v < (0 if k in may_be_zero else 1):
            raise ConfigError(f"--{k.replace('_', '-')} must be a positive integer, got {v}")
    from ultrascale.config import CP_ATTENTION
    from ultrascale.plan.bubble import SCHEDULES
    from ultrascale.plan.layout import RECOMPUTE

    for name, allowed in (("recompute", RECOMPUTE), ("schedule", SCHEDULES), ("cp_attention", CP_ATTENTION)):
        if name in fixed and fixed[name] not in allowed:  # the rule, not "no layout reaches the batch"
            raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {fixed[name]!r}")
    tp = fixed.get("tp")
    if tp and (shape.heads % tp or shape.kv_heads % tp or shape.ffn_hidden % tp):
        # Name the rule, not "nothing reaches the batch": no layout with this tp exists at all.
        raise ConfigError(f"--tp {tp} must divide the {shape.heads} query heads, the {shape.kv_heads} key/value "
                          f"heads and the MLP width {shape.ffn_hidden}: pick a tp that divides "
                          f"{math.gcd(shape.heads, shape.kv_heads, shape.ffn_hidden)}")
    check_framework(fw, fixed.get("ep") or 1, fixed.get("zero"))  # the rule, not "nothing reaches the batch"
    if args.html:
        from ultrascale.preflight import check_writable_file

        check_writable_file("--html", args.html)  # before the search, not after it
    check_emit(args, shape, model, gpu)  # --emit-config's path, model and nodes, likewise
    result = search(shape, args.gpus, gpu, fw, args.seq_len, args.global_batch_tokens, args.precision, fixed,
                    tightly=True)
    sequences = batch_sequences(args.global_batch_tokens, args.seq_len)
    if args.emit_config:
        from ultrascale.plan.emit import best_buildable, write

        if not result.ranked:
            raise ConfigError(f"--emit-config {args.emit_config}: no layout fits, nothing to write")
        lay, rank, refused = best_buildable(shape, result.ranked, model)
        note = ""
        if rank > 1:  # the planner's best is not one the engine builds: say which it wrote instead, and why
            note = f"layout {rank} of the ranking: the engine refuses the {rank - 1} above it ({refused[0]})"
            print(f"--emit-config: {note}", file=sys.stderr)
        write(args.emit_config, shape, lay, model, note, fw.name, gpu.node_size, args.emit_launch or "")
    needed = None if result.ranked else gpus_needed(shape, args.gpus, gpu, fw, args.seq_len,
                                                    args.global_batch_tokens, args.precision, fixed)
    out = {"model": shape.name, "shape": model.as_dict(), "param_count": shape.count(),
           "active_param_count": shape.active_params(), "gpus": args.gpus, "gpu": gpu.gpu.name, "cluster": gpu.name,
           "framework": fw.name,
           "enumerated": result.enumerated, "fitting": len(result.ranked),
           "error_band": result.band, "memory_error": result.memory_error, "top_group": len(result.top_group),
           "fastest": result.fastest.as_dict() if result.fastest else None,
           "candidates": [c.as_dict() for c in result.ranked[:args.top]],
           "smallest": result.smallest.as_dict() if result.smallest else None, "gpus_needed": needed}
    if args.html:
        if not result.ranked:
            raise ConfigError(f"--html {args.html}: no layout fits, nothing to draw")
        from ultrascale.plan import page

        page.write(args.html, out,
                   f"{shape.name} on {args.gpus} x {gpu.gpu.name} ({shape.params_words()}): {sequences} sequences x "
                   f"{args.seq_len} tokens",
                   f"precision {args.precision}, {assumptions(gpu, fw)}", gpu.memory_bytes)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{shape.name} on {args.gpus} x {gpu.gpu.name} ({shape.params_words()}): {sequences} sequences x "
          f"{args.seq_len} tokens per step, "
          f"precision {args.precision}, {assumptions(gpu, fw)}")
    for line in model.lines():  # a changed preset: what was given and what followed
        print(line)
    if not result.ranked:
        print("\n".join(report.nothing_fits(shape, result, gpu, args.gpus, needed)))
        return 0
    print("\n".join(report.table(result, args.top)))
    print("\n".join(report.explain(shape, result, gpu, args.gpus, sequences)))
    if args.html:
        print(f"page: {args.html}")
    return 0


def _layout(args, shape):
    from ultrascale.plan.layout import Layout, check_layout

    given = {dest: getattr(args, dest) for _, dest, _, _ in LAYOUT_FLAGS if getattr(args, dest) is not None}
    if given.get("schedule") == "dualpipev":
        given.setdefault("chunks", 2)  # its V: two chunks a rank, implied as the engine implies them
    lay = Layout(**given, seq_len=args.seq_len, grad_accum=args.grad_accum, precision=args.precision, sp=args.sp,
                 bucket_mb=args.bucket_mb)
    check_layout(lay, shape)
    return lay


def check_emit(args, shape, model, cluster, world: int | None = None) -> None:
    """--emit-config / --emit-launch, before any work: the model the engine must build, the precision it
    trains in, and nodes the processes fill."""
    if args.emit_launch and not args.emit_config:
        raise ConfigError("--emit-launch writes the launch of an --emit-config file: add --emit-config PATH")
    if not args.emit_config:
        return
    from ultrascale.plan.emit import engine_dtype, model_section
    from ultrascale.plan.launch import nodes_of

    from ultrascale.preflight import check_writable_file

    if getattr(args, "tp_overlap", None):  # a planner switch for other frameworks, not a setting of a run here
        raise ConfigError("--tp-overlap plans tensor-parallel collectives beside their matmuls, which this engine "
                          "does not do: drop --tp-overlap to emit a config it trains")
    model_section(shape, model)  # a model the engine cannot build: said before the search
    engine_dtype(args.precision)
    check_writable_file("--emit-config", args.emit_config)
    if args.emit_launch:
        import os

        nodes_of(world or args.gpus, cluster.node_size)
        check_writable_file("--emit-launch", os.path.splitext(args.emit_config)[0] + ".sbatch")


def cmd_memory(args) -> int:
    from ultrascale.plan import report
    from ultrascale.plan.layout import check_framework
    from ultrascale.plan.memory import fits, memory_plan, verdict
    from ultrascale.plan.time import step_time

    model = _model(args)
    shape = model.shape
    gpu, fw = _context(args)
    lay = _layout(args, shape)
    check_framework(fw, lay.ep, lay.zero)
    check_emit(args, shape, model, gpu, lay.world)
    plan = memory_plan(shape, lay, fw)
    timing = step_time(shape, lay, gpu, fw)
    if args.emit_config:
        from ultrascale.plan.emit import write

        write(args.emit_config, shape, lay, model, framework=fw.name, node_size=gpu.node_size,
              launch=args.emit_launch or "")
    if args.chart:
        from ultrascale.plan.chart import draw_memory

        draw_memory(plan, gpu, f"{shape.name}: {lay.label()}", args.chart)
    if args.json:
        mem = {k: (round(v) if k not in ("in_flight_micro_batches",) else v) for k, v in plan.as_dict().items()
               if not isinstance(v, list)}
        mem["stages"] = [{k: round(v) for k, v in s.items()} for s in plan.as_dict()["stages"]]
        out = {"model": shape.name, "shape": model.as_dict(), "param_count": shape.count(),
               "active_param_count": shape.active_params(), "gpu": gpu.gpu.name,
               "cluster": gpu.name, "gpu_memory_bytes": round(gpu.memory_bytes),
               "framework": fw.name, "layout": lay.to_dict(), "memory": mem,
               "fits": fits(plan, gpu), "verdict": verdict(plan, gpu), "time": timing.as_dict()}
        print(json.dumps(out, indent=1))
        return 0
    print("\n".join(report.memory_lines(shape, lay, plan, gpu, fw, model)))
    print("\n".join(report.time_lines(timing)))
    print(f"assumes {assumptions(gpu, fw)}")
    if args.chart:
        print(f"chart: {args.chart}")
    return 0


def cmd_validate(args) -> int:
    from ultrascale.plan.validate import cross_validate, cross_validation_lines, load_rows, report_lines, validate

    rows, source = load_rows(args.data)
    try:
        figures = validate(rows)
        folds = cross_validate(rows) if args.cross_validate else None
    except (KeyError, ValueError) as e:
        from ultrascale.errors import ConfigError

        raise ConfigError(f"{source}: not the playbook benchmark format ({e})") from None
    if args.json:
        print(json.dumps({"source": source, **figures, **({"cross_validation": folds} if folds else {})}, indent=1))
    else:
        print("\n".join(report_lines(figures, source) + (cross_validation_lines(folds) if folds else [])))
    sys.stdout.flush()
    return 0 if figures["goals_met"] else 1


def cmd_published(args) -> int:
    from ultrascale.plan.calibration import DEFAULT_FRAMEWORK
    from ultrascale.plan.published import TOLERANCE, misses, table

    rows = table()
    sets = {name: [r for r in rows if r["set"] == name] for name in ("chosen on", "held out")}
    errors = {name: misses(some) for name, some in sets.items()}
    if args.json:
        print(json.dumps({"default_framework": DEFAULT_FRAMEWORK, "tolerance": TOLERANCE, "runs": rows,
                          "errors": errors}, indent=1))
        return 0
    print(f"published runs: predicted / published (defaults: framework {DEFAULT_FRAMEWORK}, the generic nodes of "
          f"each run's GPU; own: the run's framework and cluster)")
    for name, some in sets.items():
        print(f"\n{'the constants were chosen on these' if name == 'chosen on' else 'held out: no constant was chosen on these'}")
        print(f"{'run':<66}{'measure':>22}{'published':>12}{'default':>9}{'own':>7}  framework, cluster")
        for r in some:
            pub = f"{r['published']:.3g}" if r["measure"] != "tflops_megatron" else f"{r['published'] / 1e12:.0f}T"
            print(f"{r['run']:<66}{r['measure']:>22}{pub:>12}{r['default_ratio']:>9.2f}{r['own_ratio']:>7.2f}  "
                  f"{r['framework']}, {r['cluster']}")
        e = errors[name]
        print(f"{name}: {e['rows']} runs, own presets' median miss {100 * e['median']:.1f}%, largest "
              f"{100 * e['largest']:.1f}%, {e['beyond']} beyond ±{100 * TOLERANCE:.0f}%")
    return 0
