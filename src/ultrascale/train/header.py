"""What a run says before its first step: the model, the layout, the batch, the precision, where it
writes, and what it loaded. A few lines of the logging rank's stdout (Trainer.fit prints them
before the data, validation and peak lines), each readable alone:

    model: tiny, 2 layers, hidden 64, 8 heads (4 key/value), vocab 257: 106,944 parameters
    layout: dp 2 x pp 1 x cp 1 x tp 1 = 2 ranks (cpu, gloo); data parallel: bucket (25 MB buckets)
    batch: 8 sequences x 32 tokens = 256 tokens per step (micro-batch 4 x grad-accum 1 x dp 2), steps 1-3
    precision: fp32, eager, recompute none
    writes: JSONL run.jsonl, TensorBoard tb, no W&B; checkpoint ck every 2 steps and at the end
    settings: from the command line: --steps 6 --save ck --resume ck; from --resume ck: the model (tiny,
        2 layers, hidden 64) --seed 5 --eval-every 2 --keep-last 2 and 40 more, as saved, at their defaults;
        10 others at their defaults

and after the peak line, what the run loaded (`initialized from hf:DIR`, `resumed DIR at step N`, a
warning when a resumed run will not save) and what its first step compiles.
"""

from __future__ import annotations


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _steps(first: int, last: int) -> str:
    if first > last:
        return f"no step left (--steps {last})"
    return f"step {last}" if first == last else f"steps {first}-{last}"


def model_line(cfg) -> str:
    from ultrascale.model.config import count_active_params, count_params

    m = cfg.model
    shape = (f"{_plural(m.layers, 'layer')}, hidden {m.hidden}, {m.heads} heads"
             + (f" ({m.kv_heads} key/value)" if m.kv_heads != m.heads else "") + f", vocab {m.vocab_size:,}")
    n = count_params(m)
    params = f"{n:,} parameters"
    if m.is_moe:
        shape += f", {m.experts} experts (top-{m.top_k}, width {m.expert_ffn})"
        params += f" ({count_active_params(m):,} active per token)"
    return f"model: {m.name}, {shape}: {params}"


def layout_line(cfg, ctx) -> str:
    p = cfg.parallel
    grid = f"dp {p.dp} x pp {p.pp} x cp {p.cp} x tp {p.tp}"
    where = ctx.device.type + (f", {ctx.backend}" if ctx.backend else "")
    extras = []
    if p.sp:
        extras.append("sequence parallel")
    if p.ep > 1:
        extras.append(f"ep {p.ep} ({p.dispatch})")
    if p.dp * p.cp > 1:
        extras.append(f"data parallel: {p.dp_mode}" + (f" ({p.bucket_mb:g} MB buckets"
                                                       + (f", {p.dp_comm_dtype} all-reduce" if p.dp_comm_dtype != "fp32" else "")
                                                       + ")" if p.dp_mode == "bucket" else ""))
    if p.zero:
        extras.append(f"ZeRO-{p.zero}" + (f", offload {p.offload}" if p.offload != "none" else ""))
    if p.pp > 1:
        extras.append(f"pipeline: {p.pp_schedule}" + (f", {p.pp_chunks} chunks per rank" if p.pp_chunks > 1 else ""))
    if p.cp > 1:
        extras.append(f"context parallel: {p.cp_attention}")
    return (f"layout: {grid} = {_plural(ctx.world_size, 'rank')} ({where})"
            + "".join(f"; {e}" for e in extras))


def batch_line(cfg, first_step: int) -> str:
    t, p = cfg.train, cfg.parallel
    seqs = cfg.global_batch
    steps = _steps(first_step + 1, t.steps)
    return (f"batch: {_plural(seqs, 'sequence')} x {t.seq_len} tokens = {seqs * t.seq_len:,} tokens per step "
            f"(micro-batch {t.micro_batch} x grad-accum {t.grad_accum} x dp {p.dp}), {steps}")


def precision_line(cfg) -> str:
    t = cfg.train
    if t.dtype == "fp32":
        dtype = "fp32"
    else:
        dtype = f"{t.dtype} compute, fp32 master weights and gradients"
        if t.dtype == "fp16":
            dtype += f", dynamic loss scale from {t.loss_scale_init:g}"
    parts = [dtype]
    if t.fp8:
        parts.append("fp8 linear layers")
    parts.append("compiled blocks (--compile)" if t.compile else "eager")
    parts.append(f"recompute {t.recompute}")
    return "precision: " + ", ".join(parts)


def outputs_line(cfg) -> str:
    t = cfg.train
    logs = [f"JSONL {t.log_jsonl}" if t.log_jsonl else "no JSONL",
            f"TensorBoard {t.tensorboard}" if t.tensorboard else "no TensorBoard",
            f"W&B project {t.wandb}" if t.wandb else "no W&B"]
    if t.save:
        every = ("every step" if t.save_every == 1 else f"every {t.save_every} steps and at the end"
                 if t.save_every else "at the end")
        keep = getattr(t, "keep_last", 0)
        save = f"checkpoint {t.save} {every}" + (f", the newest {keep} kept" if keep else "")
    else:
        save = "no checkpoint (--save DIR saves one)"
    return "writes: " + ", ".join(logs) + "; " + save


def _setting(cfg, key: str) -> str:
    section, name = key.split(".")
    value = getattr(getattr(cfg, section), name)
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else ("--no-progress" if name == "progress" else f"{flag} false")
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def settings_line(cfg) -> str | None:
    """Where the settings came from, when some came from elsewhere than the command line (a resumed
    checkpoint, a --config file, --init-from): each source with what it set, a checkpoint's settings
    shown where they are not the default (the rest counted). None for a run of flags and defaults."""
    from dataclasses import fields

    by: dict[str, list[str]] = {}
    for key, source in cfg.origin.items():
        by.setdefault(source, []).append(key)
    if set(by) <= {"the command line"}:
        return None
    default = {s: {f.name: f.default for f in fields(getattr(cfg, s))} for s in ("parallel", "train")}
    parts = []
    for source, keys in sorted(by.items(), key=lambda kv: kv[0] != "the command line"):
        shown, same = [], 0
        for key in keys:
            if key == "model":
                shown.insert(0, f"the model ({cfg.model.name}, {_plural(cfg.model.layers, 'layer')}, hidden "
                                f"{cfg.model.hidden})")
                continue
            section, name = key.split(".")
            if (source.startswith("--resume") and section in default
                    and getattr(getattr(cfg, section), name) == default[section].get(name)):
                same += 1
            else:
                shown.append(_setting(cfg, key))
        rest = f"{' and ' if shown else ''}{same} more, as saved, at their defaults" if same else ""
        parts.append(f"from {source}: {' '.join(shown)}{rest}")
    unset = sum(f"{s}.{name}" not in cfg.origin for s in default for name in default[s])
    return "settings: " + "; ".join(parts) + (f"; {unset} others at their defaults" if unset else "")


def header_lines(trainer) -> list[str]:
    """The lines above the data, validation and peak lines, for the logging rank to print."""
    cfg, ctx = trainer.cfg, trainer.ctx
    lines = [model_line(cfg), layout_line(cfg, ctx), batch_line(cfg, trainer.step), precision_line(cfg),
             outputs_line(cfg)]
    settings = settings_line(cfg)
    return lines + ([settings] if settings else [])


def start_lines(trainer) -> list[str]:
    """After the peak: what the run loaded, what it will not do, and what the first step pays."""
    t = trainer.cfg.train
    lines = []
    if t.init_from:
        lines.append(f"initialized from {t.init_from}")
    if t.resume:
        lines.append(f"resumed {t.resume} at step {trainer.step}")
        if not t.save:
            lines.append(f"warning: resumed without --save: {_steps(trainer.step + 1, t.steps)} will not be "
                         f"saved (add --save DIR, e.g. --save {t.resume})")
    if t.compile:
        n = len(trainer.model.layers)
        on = " on this pipeline stage" if trainer.cfg.parallel.pp > 1 else ""
        lines.append(f"compiling {_plural(n, 'transformer block')}{on} with torch.compile: "
                     f"the first step includes the compile")
    return lines


def tokenizer_words(spec: str, vocab: int) -> str:
    """The run's tokenizer as the data line says it: what its ids mean (a checkpoint records the same)."""
    if spec in ("", "bytes"):
        return f"bytes (256 byte values and end-of-document; the model's vocabulary {vocab})"
    return f"{spec} (Hugging Face; the model's vocabulary {vocab})"
