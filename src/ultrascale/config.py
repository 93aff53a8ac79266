"""Run configuration: model shape, parallel layout, training recipe.

One dataclass per concern; a TOML file with the sections [model], [parallel] and
[train] holds the same fields as the command-line flags, and flags given on the
command line win over the file. `validate` turns every wrong combination into a
ConfigError whose message names the problem and the fix: the CLI prints it on
one line and exits with status 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ultrascale.errors import ConfigError
from ultrascale.model.config import ModelConfig, get_preset

__all__ = ["ConfigError", "ModelConfig", "ParallelConfig", "RunConfig", "TrainConfig", "build_config", "validate"]


CP_ATTENTION = ("allgather", "ring", "zigzag", "ulysses")
# The pipeline schedules parallel/pipeline/schedules.py builds, by name.
LR_SCHEDULES = ("cosine", "linear", "wsd", "constant")
PP_SCHEDULES = ("naive", "afab", "1f1b", "interleaved", "zero-bubble", "dualpipev")
# DualPipe is run in its single-copy, cut-in-half form (DualPipeV): `dualpipe` names it too.
PP_SCHEDULE_ALIASES = {"dualpipe": "dualpipev"}


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the named grid dp x pp x cp x tp (tp innermost), and the expert size.

    dp = 0 means "whatever is left": world / (pp * cp * tp).
    """

    dp: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False  # sequence parallelism: shard norms and residuals along the sequence in the TP group
    # Context parallelism's attention: allgather | ring | zigzag | ulysses (parallel/context/).
    cp_attention: str = "ring"
    pp_schedule: str = "1f1b"  # naive | afab | 1f1b | interleaved | zero-bubble | dualpipev (alias dualpipe)
    pp_chunks: int = 1  # model chunks per pipeline rank (interleaved; dualpipev: always 2, in a V)
    # Blocks of the first / last pipeline stage (0: the even split). Fewer there leave room for the
    # embedding and for the head and its logits (Megatron's --decoder-first/last-pipeline-num-layers).
    pp_first_stage_layers: int = 0
    pp_last_stage_layers: int = 0
    # Data parallelism, in the playbook's steps: naive | overlap | bucket.
    dp_mode: str = "bucket"
    bucket_mb: float = 25.0  # PyTorch DDP's default bucket_cap_mb
    dp_comm_dtype: str = "fp32"  # fp32 | bf16 (compress the bucket all-reduce; changes numerics)
    dispatch: str = "alltoall"  # expert parallelism: alltoall | allgather (parallel/expert.py)
    # ZeRO-Offload (parallel/offload.py): none | cpu | disk; disk keeps the states in files under offload_dir.
    offload: str = "none"
    offload_dir: str = ""

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Fill in dp from the world size and check the grid covers it exactly."""
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be a positive integer, got {getattr(self, name)}")
        if self.dp < 0:
            raise ConfigError(f"--dp must be a positive integer, got {self.dp}")
        inner = self.tp * self.pp * self.cp
        dp = self.dp
        if dp == 0:
            if world_size % inner:
                raise ConfigError(
                    f"world size {world_size} is not divisible by tp*pp*cp = {inner}: {_world_of(inner, 'add ')} (or a "
                    f"multiple of {inner}), or lower the sizes"
                )
            dp = world_size // inner
        if dp * inner != world_size:
            raise ConfigError(
                f"dp*pp*cp*tp = {dp}*{self.pp}*{self.cp}*{self.tp} = {dp * inner} but the world has "
                f"{world_size} processes: make the product equal the world size ({_world_of(dp * inner)}), "
                f"or change --dp"
            )
        if dp % self.ep:
            raise ConfigError(f"--ep {self.ep} must divide dp = {dp}: expert groups are carved out of data parallelism")
        if self.dispatch not in ("alltoall", "allgather"):
            raise ConfigError(f"--dispatch must be alltoall or allgather, got {self.dispatch!r}"
                              + synonym("dispatch", self.dispatch))
        if self.sp and self.tp == 1:
            raise ConfigError("--sp shards activations across the tensor-parallel group: it needs --tp > 1")
        if self.cp_attention not in CP_ATTENTION:
            raise ConfigError(f"--cp-attention must be {', '.join(CP_ATTENTION[:-1])} or {CP_ATTENTION[-1]}, "
                              f"got {self.cp_attention!r}" + synonym("cp_attention", self.cp_attention))
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.dp_mode not in ("naive", "overlap", "bucket"):
            raise ConfigError(f"--dp-mode must be naive, overlap or bucket, got {self.dp_mode!r}")
        if not 0 < self.bucket_mb < math.inf:
            raise ConfigError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        if self.dp_comm_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--dp-comm-dtype must be fp32 or bf16, got {self.dp_comm_dtype!r}")
        if self.zero and dp * self.cp == 1:
            raise ConfigError(f"--zero {self.zero} with dp = 1: there is nothing to shard across; "
                              f"drop --zero or raise --dp")
        if self.zero and self.dp_mode != "bucket":
            raise ConfigError(f"--zero {self.zero} is built on bucketed data parallelism: drop --dp-mode {self.dp_mode}")
        check_offload(self)
        if self.dp_comm_dtype != "fp32" and (self.dp_mode != "bucket" or self.zero):
            raise ConfigError("--dp-comm-dtype bf16 compresses the bucket all-reduce: use it with "
                              "--dp-mode bucket and --zero 0")
        schedule = PP_SCHEDULE_ALIASES.get(self.pp_schedule, self.pp_schedule)
        if schedule == "dualpipev" and self.pp_chunks in (1, 2):
            return replace(self, dp=dp, pp_schedule=schedule, pp_chunks=2)  # its two chunks per rank are implied
        return replace(self, dp=dp, pp_schedule=schedule)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    seq_len: int = 64
    micro_batch: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    # The schedule after warmup (train/optim.py): cosine, linear, wsd (warmup-stable-decay: constant,
    # then a linear decay over the last lr_decay_fraction of the steps) or constant.
    lr_schedule: str = "cosine"
    # The schedule's length, warmup included; 0: the run's --steps. validate() writes the number in, so
    # a checkpoint keeps it and a resume to more steps follows the same learning rates as the run
    # that was interrupted (--override-schedule takes a new one).
    lr_decay_steps: int = 0
    lr_decay_fraction: float = 0.2  # wsd: the share of the steps after warmup spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (16-bit compute, fp32 master weights and gradients)
    # fp16's dynamic loss scale (train/loss_scale.py): its start, and the finite steps in a row
    # after which it doubles.
    loss_scale_init: float = 65536.0
    loss_scale_window: int = 2000
    recompute: str = "none"  # none | selective | full
    compile: bool = False  # torch.compile each transformer block (parallel/compile.py)
    fp8: bool = False  # FP8 linear layers in the blocks, per-tensor dynamic scaling (parallel/fp8.py)
    seed: int = 0
    data: str = ""  # empty: the Python standard library's source files
    data_column: str = "text"
    data_split: str = "train"
    tokenizer: str = "bytes"  # "bytes" or a local Hugging Face tokenizer directory
    # The held-out share of a raw source (train/corpus.py: sections by hash); a prepared corpus keeps its own.
    val_fraction: float = 0.01
    eval_every: int = 0  # the validation loss every N steps (0: never), and at the last step
    eval_batches: int = 8  # global batches of the held-out split per evaluation
    save: str = ""
    save_every: int = 0
    # Keep the newest N saves, each in --save/step-NNNNNN (0: one checkpoint, replaced at each save).
    keep_last: int = 0
    overwrite: bool = False  # --save may replace a checkpoint of another run (train/resume.py check_save_target)
    resume: str = ""
    # With resume: the learning-rate schedule (SCHEDULE of train/resume.py) is this run's, not the
    # checkpoint's: back from a divergence with a lower lr (Megatron's --override-opt_param-scheduler).
    override_schedule: bool = False
    init_from: str = ""  # hf:DIR: start from a transformers checkpoint (its shape and weights)
    log_jsonl: str = ""
    pp_trace: str = ""  # write the last step's pipeline timeline here (JSON)
    profile: str = ""  # a directory: torch.profiler traces of the --profile-steps window, one per rank
    profile_steps: str = "2:3"  # A:B, 1-based and inclusive (train/profile.py)
    # The ceiling MFU divides by: "auto" (measured once per machine and kept, train/peak.py), "datasheet",
    # or TFLOP/s per device.
    # Empty: the datasheet on a GPU that has a figure, "auto" otherwise (train/peak.py).
    peak: str = ""
    tensorboard: str = ""  # write TensorBoard event files of the step metrics to this directory
    wandb: str = ""  # a Weights & Biases project: log the step metrics and the config there (train/loggers.py)
    log_every: int = 1
    device: str = "auto"  # auto | cpu | cuda
    nproc: int = 1
    # Sequences per optimizer step (Megatron's --global-batch-size, torchtitan's global_batch_size); 0:
    # micro_batch x grad_accum x dp. Given, it sets grad_accum (validate).
    global_batch: int = 0
    # Seconds any collective, on any process group, may wait for the other ranks before
    # the run is ended (a hung or dead rank otherwise blocks the rest forever).
    timeout: float = 300.0
    progress: bool = True
    measure_activations: bool = True


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: get_preset("tiny"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Where each setting came from, by "section.field" (the model's shape: "model"): "the command line",
    # "--config FILE" or "--resume CK"; a setting not here is the default. Not part of the run
    # (compare=False): the header says it (train/header.py).
    origin: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro_batch x grad_accum x dp."""
        return self.train.micro_batch * self.train.grad_accum * self.parallel.dp

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "parallel": asdict(self.parallel), "train": asdict(self.train)}


def validate(cfg: RunConfig, world_size: int) -> RunConfig:
    """Check everything that can be checked before any process starts; return the
    config with dp resolved."""
    cfg.model.validate()
    t = cfg.train
    for name in ("steps", "seq_len", "micro_batch", "grad_accum", "nproc", "log_every"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(t, name)}")
    if not 0 < t.timeout < math.inf:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {t.timeout:g}")
    for name in ("lr", "weight_decay", "grad_clip", "loss_scale_init", "beta1", "beta2", "eps", "min_lr_ratio"):
        if not math.isfinite(getattr(t, name)):  # nan passes every comparison below; inf is no setting
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(t, name)}")
    if t.seed < 0 or t.weight_decay < 0:
        raise ConfigError(f"--seed and --weight-decay must be >= 0, got {t.seed} and {t.weight_decay:g}")
    if t.save_every < 0:
        raise ConfigError(f"--save-every must be 0 (off) or positive, got {t.save_every}")
    if t.save_every and not t.save:
        raise ConfigError(f"--save-every {t.save_every} without --save: there is nowhere to save; add --save DIR "
                          f"or drop --save-every")
    if t.keep_last < 0 or (t.keep_last and not t.save):
        raise ConfigError(f"--keep-last {t.keep_last}: give a positive number of checkpoints with --save DIR "
                          f"(each save goes into DIR/step-NNNNNN)")
    if t.eval_every < 0 or t.eval_batches <= 0:
        raise ConfigError(f"--eval-every must be 0 (off) or positive and --eval-batches positive, got "
                          f"{t.eval_every} and {t.eval_batches}")
    if not 0 <= t.val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {t.val_fraction:g}")
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"--seq-len {t.seq_len} exceeds the model's limit of {cfg.model.max_seq_len} positions: "
            f"lower --seq-len or raise --max-seq-len"
        )
    if t.dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"--dtype must be fp32, bf16 or fp16, got {t.dtype!r}" + synonym("dtype", t.dtype))
    if not t.loss_scale_init >= 1 or t.loss_scale_window <= 0:
        raise ConfigError(f"--loss-scale-init must be >= 1 and --loss-scale-window positive, got "
                          f"{t.loss_scale_init:g} and {t.loss_scale_window}")
    if t.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"--recompute must be none, selective or full, got {t.recompute!r}"
                          + synonym("recompute", t.recompute))
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {t.device!r}")
    if t.lr <= 0 or not 0 <= t.min_lr_ratio <= 1 or t.warmup_steps < 0 or t.lr_decay_steps < 0:
        raise ConfigError("--lr must be positive, --min-lr-ratio within [0, 1], --warmup-steps >= 0, "
                          "--lr-decay-steps >= 0 (0: --steps)")
    if t.lr_schedule not in LR_SCHEDULES:
        hint = {"cos": "cosine", "wsd-linear": "wsd", "warmup-stable-decay": "wsd", "const": "constant",
                "none": "constant"}.get(t.lr_schedule)
        raise ConfigError(f"--lr-schedule must be {', '.join(LR_SCHEDULES)}, got {t.lr_schedule!r}"
                          + (f" (that is {hint!r} here)" if hint else ""))
    if not 0 < t.lr_decay_fraction <= 1:
        raise ConfigError(f"--lr-decay-fraction must be in (0, 1], got {t.lr_decay_fraction:g}")
    if not t.lr_decay_steps and not t.resume:  # the schedule follows --steps, and says so in the checkpoint
        # (a resumed run without one takes the checkpoint's: the CLI layers it in, the trainer too)
        t = replace(t, lr_decay_steps=t.steps)
        cfg = replace(cfg, train=t)
    if t.grad_clip < 0:
        raise ConfigError(f"--grad-clip must be >= 0 (0 turns clipping off), got {t.grad_clip}")
    if t.profile:
        check_profile_steps(t)
    elif t.profile_steps != TrainConfig.profile_steps:
        raise ConfigError(f"--profile-steps {t.profile_steps} without --profile: nothing would be recorded; add "
                          f"--profile DIR or drop --profile-steps")
    if t.fp8 and cfg.parallel.tp > 1:
        raise ConfigError(f"--fp8 with --tp {cfg.parallel.tp}: the tensor-parallel layers are not nn.Linear, so "
                          f"torchao's FP8 would not reach them; run --fp8 with --tp 1 (dp, ZeRO, pp, cp compose)")
    if t.fp8 and cfg.parallel.cp > 1:
        raise ConfigError(f"--fp8 with --cp {cfg.parallel.cp}: each context-parallel rank would scale its casts by the "
                          f"amax of its own shard of the sequence, not the micro-batch's, so the run would not be "
                          f"one process's; run --fp8 with --cp 1 (dp, ZeRO, pp compose)")
    if t.fp8 and cfg.parallel.pp > 1 and cfg.parallel.pp_schedule in ("zero-bubble", "dualpipev", "dualpipe"):
        raise ConfigError(f"--fp8 with --pp-schedule {cfg.parallel.pp_schedule}: FP8 layers would replace the deferrable linears "
                          "that split the weight gradients; use another --pp-schedule")
    if (t.compile and t.recompute == "full" and cfg.model.is_moe and cfg.parallel.pp > 1
            and PP_SCHEDULE_ALIASES.get(cfg.parallel.pp_schedule, cfg.parallel.pp_schedule) in ("zero-bubble",
                                                                                               "dualpipev")):
        # Found by the feature matrix (zero-bubble): the replayed forward of an MoE block, whose compiled
        # parts sit around an eager MoE layer, picks another compiled graph than the forward did, and
        # torch's checkpoint stops on tensors of other shapes (torch issue 166926).
        raise ConfigError(f"--compile with --recompute full, an MoE model and --pp-schedule "
                          f"{cfg.parallel.pp_schedule}: the recomputed forward does not replay the compiled one; "
                          f"use --recompute selective, or another --pp-schedule, or drop --compile")
    if t.resume and t.init_from:
        check_start(t.resume, t.init_from)
    if t.override_schedule and not t.resume:
        raise ConfigError("--override-schedule changes the schedule a checkpoint was trained with: use it with "
                          "--resume DIR (a new run takes --lr and the rest as given)")
    try:
        parallel = cfg.parallel.resolve(world_size)
        cfg = _fit_accumulation(cfg, parallel)
    except ConfigError:
        # The sizes may not fit the world (a forgotten --nproc) and also not fit the model: name the
        # model's mistake first, found with the sizes asked for, since fixing --nproc alone would not do.
        asked = _asked(cfg.parallel)
        if asked is not None:
            check_shapes(cfg, asked)
        raise
    check_shapes(cfg, parallel)
    check_experts(cfg.model, parallel)
    check_implemented(parallel)
    return replace(cfg, parallel=parallel)


def _fit_accumulation(cfg: RunConfig, parallel: ParallelConfig) -> RunConfig:
    """--global-batch G: the accumulation that makes micro_batch x grad_accum x dp = G sequences."""
    t = cfg.train
    if t.global_batch < 0:
        raise ConfigError(f"--global-batch must be a positive number of sequences, got {t.global_batch}")
    if not t.global_batch:
        return cfg
    per = t.micro_batch * parallel.dp
    if t.global_batch % per:
        raise ConfigError(f"--global-batch {t.global_batch} is not a multiple of --micro-batch x dp = "
                          f"{t.micro_batch} x {parallel.dp} = {per}: pick a multiple of {per}, or another "
                          f"--micro-batch")
    if t.grad_accum not in (1, t.global_batch // per):
        raise ConfigError(f"--global-batch {t.global_batch} and --grad-accum {t.grad_accum} disagree (micro-batch "
                          f"{t.micro_batch} x dp {parallel.dp} x {t.grad_accum} = {per * t.grad_accum}): give one "
                          f"of them")
    return replace(cfg, train=replace(t, grad_accum=t.global_batch // per))


# Names the ecosystem gives our values (DeepSpeed, Megatron, torchtitan, papers): a refused value
# that is one of them is answered with ours.
SYNONYMS = {
    "dtype": {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
              "fp8": "bf16 with --fp8"},
    "pp_schedule": {"gpipe": "afab", "all-forward-all-backward": "afab", "interleaved-1f1b": "interleaved",
                    "interleaved1f1b": "interleaved", "zb": "zero-bubble", "zbh1": "zero-bubble",
                    "zb-h1": "zero-bubble", "zero_bubble": "zero-bubble", "zerobubble": "zero-bubble",
                    "1F1B": "1f1b", "one-f-one-b": "1f1b", "dualpipe-v": "dualpipev"},
    "cp_attention": {"ring-attention": "ring", "ring_attention": "ring", "zig-zag": "zigzag",
                     "all-gather": "allgather", "all_gather": "allgather", "deepspeed-ulysses": "ulysses"},
    "recompute": {"sac": "selective", "selective-ac": "selective", "off": "none", "no": "none",
                  "all": "full", "activation-checkpointing": "full"},
    "dispatch": {"all-to-all": "alltoall", "all_to_all": "alltoall", "a2a": "alltoall", "all-gather": "allgather"},
}


def synonym(field_name: str, value) -> str:
    """' (that is X here)' when `value` is another name for one of ours, else ''."""
    ours = SYNONYMS.get(field_name, {}).get(value) or SYNONYMS.get(field_name, {}).get(str(value).lower())
    return f": that is {ours} here" if ours else ""


def _world_of(n: int, verb: str = "") -> str:
    """How to ask for a world of n processes: --nproc here, the launcher's settings under torchrun."""
    import os

    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun: the world is --nnodes x --nproc-per-node
        return f"start torchrun with a world size of {n} (--nnodes x --nproc-per-node)"
    return f"{verb}--nproc {n}"


def _asked(p: ParallelConfig) -> ParallelConfig | None:
    """The layout resolved on the world its sizes ask for (dp, or 1, x tp x pp x cp), if it resolves."""
    try:
        return p.resolve(max(p.dp, 1) * p.tp * p.pp * p.cp)
    except ConfigError:
        return None


def check_shapes(cfg: RunConfig, parallel: ParallelConfig) -> None:
    """What the sizes need of the model and the sequence: heads, widths, layers, length."""
    t = cfg.train
    tp = parallel.tp
    if cfg.model.heads % tp or cfg.model.kv_heads % tp:
        raise ConfigError(
            f"--tp {tp} must divide both the {cfg.model.heads} query heads and the {cfg.model.kv_heads} "
            f"key/value heads: pick a tp that divides {cfg.model.kv_heads}"
        )
    if cfg.model.ffn_hidden % tp:
        raise ConfigError(f"--tp {tp} must divide the MLP width --ffn-hidden {cfg.model.ffn_hidden}: pick a tp "
                          f"that divides it, or an --ffn-hidden that divides by {tp}")
    if parallel.sp and t.seq_len % tp:
        raise ConfigError(f"--sp splits the sequence over tp = {tp} ranks: --seq-len {t.seq_len} must divide by it")
    check_context(cfg, parallel)
    check_pipeline(cfg, parallel)


def check_context(cfg: RunConfig, parallel: ParallelConfig) -> None:
    """What each context-parallel attention variant needs of the sequence and the heads."""
    cp, tp, s, variant = parallel.cp, parallel.tp, cfg.train.seq_len, parallel.cp_attention
    if cp > 1 and cfg.train.dtype == "fp16":
        # Measured (testing/matrix.py): at the scale one process skips a step with, cp 2 ran it. Each cp
        # rank's fp16 weight gradients sum over its shard's tokens only, so they overflow at another scale.
        raise ConfigError(f"--dtype fp16 with --cp {cp}: whether a step overflows depends on fp16 sums over the "
                          f"whole sequence, which context parallelism splits over ranks, so steps would be skipped "
                          f"unlike one process's; use --dtype bf16 (no loss scale) with --cp")
    if cp == 1:
        if variant != ParallelConfig.cp_attention:
            raise ConfigError(f"--cp-attention {variant} with --cp 1: there is no context parallelism to run it; "
                              f"add --cp N (N > 1) or drop --cp-attention")
        return
    if variant in ("zigzag", "allgather") and s % (2 * cp):  # zig-zag shards (parallel/context/sharding.py)
        raise ConfigError(f"--cp-attention {variant} cuts each sequence into 2 x cp = {2 * cp} equal chunks: "
                          f"--seq-len {s} must divide by {2 * cp} (or use --cp-attention ring)")
    if s % cp:
        raise ConfigError(f"--cp {cp} cuts each sequence into {cp} equal shards: --seq-len {s} must divide by {cp}")
    if parallel.sp and s % (cp * tp):
        raise ConfigError(f"--sp splits each context-parallel shard of the sequence over tp = {tp} ranks: "
                          f"--seq-len {s} must divide by cp x tp = {cp * tp}")
    heads, kv = cfg.model.heads, cfg.model.kv_heads
    if variant == "ulysses" and (heads % (cp * tp) or kv % (cp * tp)):
        raise ConfigError(f"--cp-attention ulysses gives each of cp x tp = {cp * tp} ranks whole heads: it must "
                          f"divide the {heads} query heads and the {kv} key/value heads; use a cp x tp that "
                          f"divides {kv}, or --cp-attention ring")


def parse_steps(text: str) -> tuple[int, int]:
    """--profile-steps 'A:B' -> (A, B), 1-based and inclusive; 'A' alone is A:A. Raises ValueError."""
    first, sep, last = text.partition(":")
    a = int(first)
    b = int(last) if sep else a
    if a < 1 or b < a:
        raise ValueError(text)
    return a, b


def check_profile_steps(t: TrainConfig) -> None:
    try:
        first, _ = parse_steps(t.profile_steps)
    except ValueError:
        raise ConfigError(f"--profile-steps {t.profile_steps}: give A:B, the first and last step to record "
                          f"(1-based, A <= B), e.g. 2:3") from None
    if first > t.steps:
        raise ConfigError(f"--profile-steps {t.profile_steps} starts after the last step (--steps {t.steps}): "
                          f"pick steps within 1:{t.steps} or raise --steps")


def check_start(resume: str, init_from: str) -> None:
    """A run starts from its seed, from --init-from weights, or continues a checkpoint: one of them."""
    raise ConfigError(f"--init-from {init_from} starts a new run from its weights and --resume {resume} "
                      f"continues a saved one: pass one of them")


def check_pipeline(cfg: RunConfig, parallel: ParallelConfig) -> None:
    pp, v, m = parallel.pp, parallel.pp_chunks, cfg.train.grad_accum
    if parallel.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {parallel.pp_schedule!r}"
                          + synonym("pp_schedule", parallel.pp_schedule))
    if v < 1:
        raise ConfigError(f"--pp-chunks must be positive, got {v}")
    if parallel.pp_schedule == "dualpipev" and v != 2:
        raise ConfigError(f"--pp-chunks {v} with --pp-schedule dualpipev: each rank holds exactly two chunks "
                          f"(a V); drop --pp-chunks")
    if v > 1 and parallel.pp_schedule not in ("interleaved", "dualpipev"):
        raise ConfigError(f"--pp-chunks {v} needs --pp-schedule interleaved")
    if pp * v > cfg.model.layers:
        layers = cfg.model.layers
        raise ConfigError(f"--pp {pp} x --pp-chunks {v} = {pp * v} stages but the model has {layers} "
                          f"layer{'s' if layers != 1 else ''}: lower --pp or --pp-chunks, or add --layers")
    first, last = parallel.pp_first_stage_layers, parallel.pp_last_stage_layers
    for flag, n in (("--pp-first-stage-layers", first), ("--pp-last-stage-layers", last)):
        if n < 0:
            raise ConfigError(f"{flag} must be 0 (the even split) or positive, got {n}")
    if (first or last) and pp == 1:
        raise ConfigError("--pp-first-stage-layers / --pp-last-stage-layers need --pp > 1")
    if pp == 1:
        return
    if parallel.pp_schedule == "interleaved" and m % pp:
        raise ConfigError(f"the interleaved schedule takes micro-batches in groups of pp = {pp}: "
                          f"make --grad-accum (the micro-batches) a multiple of {pp}")
    if parallel.pp_schedule == "dualpipev" and m < 2 * pp:
        raise ConfigError(f"the dualpipev schedule needs at least 2 x pp = {2 * pp} micro-batches to fill its V, "
                          f"got --grad-accum {m}: raise --grad-accum")
    if parallel.zero >= 2:
        raise ConfigError(f"--zero {parallel.zero} with --pp: stage {parallel.zero} would re-shard every "
                          f"micro-batch; pipeline parallelism composes with --zero 1")
    if cfg.model.tie_embeddings:
        raise ConfigError("tied embeddings with --pp: the first and last stages would share one matrix; "
                          "use an untied model")


def check_offload(p: ParallelConfig) -> None:
    """--offload moves ZeRO's shards off the device: it needs ZeRO, and disk needs a directory."""
    if p.offload not in ("none", "cpu", "disk"):
        raise ConfigError(f"--offload must be none, cpu or disk, got {p.offload!r}")
    if p.offload != "none" and not p.zero:
        raise ConfigError(f"--offload {p.offload} moves ZeRO's optimizer shards off the device: add --zero 1, 2 or 3")
    if p.offload != "none" and p.ep > 1:
        raise ConfigError(f"--offload {p.offload} with --ep {p.ep}: the expert weights' optimizer is not offloaded "
                          f"yet; drop --offload or --ep")
    if p.offload == "disk" and not p.offload_dir:
        raise ConfigError("--offload disk keeps the optimizer states in files: add --offload-dir DIR")
    if p.offload_dir and p.offload != "disk":
        raise ConfigError(f"--offload-dir {p.offload_dir} is where --offload disk writes: add --offload disk "
                          f"or drop --offload-dir")


def check_experts(model: ModelConfig, parallel: ParallelConfig) -> None:
    if model.is_moe and model.capacity_factor and (parallel.cp > 1 or parallel.sp):
        # Which assignments an expert drops is decided over the whole micro-batch's scores (ties by
        # position); a rank holding a shard of each sequence sees only its own.
        how = f"--cp {parallel.cp}" if parallel.cp > 1 else "--sp"
        raise ConfigError(f"--capacity-factor {model.capacity_factor:g} with {how}: each rank holds a shard of "
                          f"every sequence, and the tokens an expert drops are chosen over the whole "
                          f"micro-batch; run dropless (--capacity-factor 0) or without sharding the sequence")
    ep = parallel.ep
    if ep == 1:
        return
    if not model.is_moe:
        raise ConfigError(f"--ep {ep} spreads experts over ranks, but model {model.name} is dense: "
                          f"pick an MoE model (--model tiny-moe) or pass --experts")
    if model.experts % ep:
        raise ConfigError(f"--ep {ep} must divide the {model.experts} experts: each rank holds experts / ep of them")
    if parallel.zero == 3:
        raise ConfigError("--zero 3 with --ep: expert weights are not gathered per unit; use --zero 1 or 2")
    if parallel.cp > 1:
        # Expert gradients are summed over the expert-data-parallel group, which is carved out of dp
        # alone: the context-parallel ranks' parts of the same sequences would never be combined.
        raise ConfigError(f"--ep {ep} with --cp {parallel.cp}: expert parallelism is built over data "
                          f"parallelism only; run --ep with --cp 1, or --cp without --ep")


# Which parallel sizes the engine runs today. A technique lands by adding itself
# here and in ultrascale.parallel; until then a size above 1 is refused, never ignored.
IMPLEMENTED = {"dp": True, "tp": True, "pp": True, "cp": True, "ep": True, "zero": True}


def check_implemented(p: ParallelConfig) -> None:
    for name, done in IMPLEMENTED.items():
        size = getattr(p, name)
        if not done and size > (0 if name == "zero" else 1):
            raise ConfigError(f"--{name} {size}: this parallelism is not implemented yet; run with --{name} "
                              f"{0 if name == 'zero' else 1}")


def load_toml(path: str) -> dict:
    """Read a config file into {section: {field: value}}; unknown keys are errors."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    known = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}
    for section, values in data.items():
        if section not in known or not isinstance(values, dict):
            raise ConfigError(f"--config {path}: unknown section [{section}]; use [model], [parallel], [train]")
        types = {f.name: f.type for f in fields(known[section])}
        if section == "model":
            types["preset"] = "str"
        for key, value in values.items():
            if key not in types:
                raise ConfigError(f"--config {path}: unknown key {key!r} in [{section}]")
            check_type(f"--config {path}: [{section}] {key}", value, types[key])
    return data


# What a TOML value of each field type may be, and how to say it. TOML has integers, floats,
# strings and booleans apart; an integer is a fine float, and a boolean is no number (Python
# would take True for 1).
_ACCEPTS = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_SAYS = {"int": "an integer, e.g. 4", "float": "a number, e.g. 0.5", "str": 'a string in quotes, e.g. "x"',
         "bool": "true or false"}


def _kind(value) -> str:
    for word, kinds in (("true or false", bool), ("an integer", int), ("a number", float), ("a string", str),
                        ("a list", list), ("a table", dict)):
        if isinstance(value, kinds):
            return word
    return f"a {type(value).__name__}"


def check_type(where: str, value, annotation: str) -> None:
    """One line naming the key, its value and the type its field takes, before anything runs."""
    accepts = _ACCEPTS[annotation]
    if isinstance(value, bool) and bool not in accepts or not isinstance(value, accepts):
        try:
            shown = json.dumps(value)  # as TOML writes it: true, "ten", ["tiny"]
        except TypeError:  # a TOML date or time
            shown = str(value)
        raise ConfigError(f"{where} = {shown} is {_kind(value)}; it takes {_SAYS[annotation]}")


def build_config(file_values: dict, flag_values: dict, model: ModelConfig | None = None) -> RunConfig:
    """Merge defaults < TOML file < command-line flags into a RunConfig.

    flag_values maps section -> {field: value} holding only the flags the user gave. `model`:
    the shape read from --init-from's config.json (model.hf.model_from_checkpoint), which
    the [model] fields given must agree with; without it the shape is the preset's.
    """
    merged = {s: {**file_values.get(s, {}), **flag_values.get(s, {})} for s in ("model", "parallel", "train")}
    model_fields = dict(merged["model"])
    if model is None:
        if merged["train"].get("init_from"):
            raise ConfigError("--init-from: read the model with model.hf.model_from_checkpoint and pass it")
        preset = model_fields.pop("preset", "tiny")
        model = get_preset(preset, **model_fields)
    try:
        parallel = ParallelConfig(**merged["parallel"])
        train = TrainConfig(**merged["train"])
    except TypeError as e:
        raise ConfigError(f"bad configuration field: {e}") from None
    return RunConfig(model=model, parallel=parallel, train=train)
