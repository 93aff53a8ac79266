"""One training configuration: how the model is cut and how the batch is made.

Sizes follow the engine's grid (ultrascale.config.ParallelConfig): the world is
dp x pp x cp x tp (tp innermost, so tp ranks share a node first), and expert
parallelism is carved out of data parallelism (ep divides dp), as in Megatron.
A dense model has ep = 1, where this reads dp·tp·pp·cp·ep = gpus.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ultrascale.config import CP_ATTENTION, ConfigError
from ultrascale.plan.bubble import SCHEDULES
from ultrascale.plan.precision import PRECISIONS

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = True  # sequence parallelism alongside tp (no effect at tp = 1)
    zero: int = 0
    schedule: str = "1f1b"  # pipeline schedule: afab | 1f1b | interleaved | zero-bubble
    chunks: int = 1  # v: model chunks per pipeline rank (interleaved schedule)
    # Blocks of the first / last pipeline stage; 0: the even split (parallel/pipeline/partition.py).
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    recompute: str = "none"
    # Context parallelism's attention (the engine's --cp-attention). The planner's default is the
    # zig-zag ring, whose causal work is balanced over the cp ranks (as all-gather's and Ulysses'
    # are); the ring on contiguous shards pays its last rank's extra work (time.py, cp_imbalance).
    cp_attention: str = "zigzag"
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    grad_accum: int = 1  # micro-batches per optimizer step (the pipeline's m)
    seq_len: int = 4096
    precision: str = "bf16"
    bucket_mb: float = 25.0  # gradient bucket cap (the engine's and DDP's default)
    # ZeRO-Offload: none | cpu | disk (the engine's --offload): the optimizer shard, and ZeRO-3's
    # parameter shard, leave the GPU; the step pays the PCIe copies and a host optimizer step.
    offload: str = "none"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro_batch x grad_accum x dp."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def sp_on(self) -> bool:
        return self.sp and self.tp > 1

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}{'+sp' if self.sp_on else ''}", f"pp{self.pp}"]
        if self.pp > 1:
            ends = (f" ends {self.first_stage_layers or '='}/{self.last_stage_layers or '='}"
                    if self.first_stage_layers or self.last_stage_layers else "")
            parts[-1] += f"({self.schedule}{f' v{self.chunks}' if self.chunks > 1 else ''}{ends})"
        if self.cp > 1:
            parts.append(f"cp{self.cp}({self.cp_attention})")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        offload = f" offload:{self.offload}" if self.offload != "none" else ""
        return (" ".join(parts) + f" zero{self.zero}{offload} rc:{self.recompute} mbs{self.micro_batch} "
                f"ga{self.grad_accum}")

    def to_dict(self) -> dict:
        return asdict(self)


def check_layout(lay: Layout, shape) -> None:
    """Every rule a configuration must obey, as one-line ConfigErrors."""
    for name in ("dp", "tp", "pp", "cp", "ep", "chunks", "micro_batch", "grad_accum", "seq_len"):
        if getattr(lay, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(lay, name)}")
    if not lay.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be positive, got {lay.bucket_mb}")
    if lay.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {lay.zero}")
    if lay.recompute not in RECOMPUTE:
        raise ConfigError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {lay.recompute!r}")
    if lay.precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {lay.precision!r}")
    if lay.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {lay.schedule!r}")
    if shape.heads % lay.tp or shape.kv_heads % lay.tp:
        raise ConfigError(f"--tp {lay.tp} must divide the {shape.heads} query heads and the {shape.kv_heads} "
                          f"key/value heads")
    widths = {"--ffn-hidden": shape.ffn_hidden, "the expert MLP width": shape.expert_ffn if shape.is_moe else 0,
              "the shared expert width": shape.shared_expert_ffn}
    for what, width in widths.items():
        if width and width % lay.tp:
            raise ConfigError(f"--tp {lay.tp} must divide {what} {width}: tensor parallelism splits the MLP's "
                              f"columns evenly (pick a width or tp that divides)")
    for flag, n in (("--pp-first-stage-layers", lay.first_stage_layers),
                    ("--pp-last-stage-layers", lay.last_stage_layers)):
        if n < 0:
            raise ConfigError(f"{flag} must be 0 (the even split) or positive, got {n}")
    if (lay.first_stage_layers or lay.last_stage_layers) and lay.pp == 1:
        raise ConfigError("--pp-first-stage-layers / --pp-last-stage-layers need --pp > 1")
    if lay.pp * lay.chunks > shape.layers:
        raise ConfigError(f"--pp {lay.pp} x --chunks {lay.chunks} exceeds the model's {shape.layers} layers")
    if lay.first_stage_layers or lay.last_stage_layers:
        from ultrascale.parallel.pipeline.partition import PartitionError, split

        try:
            split(shape.layers, lay.pp, lay.chunks, lay.first_stage_layers, lay.last_stage_layers)
        except PartitionError as e:
            raise ConfigError(str(e)) from None
    if lay.schedule == "dualpipev" and lay.pp > 1:
        if lay.chunks != 2:
            raise ConfigError(f"--schedule dualpipev holds exactly 2 chunks per rank, got --chunks {lay.chunks}")
        if lay.grad_accum < 2 * lay.pp:
            raise ConfigError(f"--schedule dualpipev needs at least 2 x pp = {2 * lay.pp} micro-batches, "
                              f"got {lay.grad_accum}")
    elif lay.chunks > 1 and lay.schedule != "interleaved":
        raise ConfigError(f"--chunks {lay.chunks} needs --schedule interleaved")
    if lay.schedule == "interleaved" and lay.pp > 1 and lay.grad_accum % lay.pp:
        raise ConfigError(f"the interleaved schedule needs micro-batches ({lay.grad_accum}) to be a multiple of "
                          f"--pp {lay.pp}")
    if lay.sp_on and lay.seq_len % (lay.tp * lay.cp):
        raise ConfigError(f"sequence parallelism splits the sequence over tp = {lay.tp} ranks: --seq-len "
                          f"{lay.seq_len} must divide by tp x cp = {lay.tp * lay.cp} (or pass --no-sp)")
    if lay.cp_attention not in CP_ATTENTION:
        raise ConfigError(f"--cp-attention must be one of {', '.join(CP_ATTENTION)}, got {lay.cp_attention!r}")
    chunks = 2 * lay.cp if lay.cp_attention in ("zigzag", "allgather") else lay.cp  # zig-zag shards
    if lay.cp > 1 and lay.seq_len % chunks:
        raise ConfigError(f"--seq-len {lay.seq_len} must divide into {chunks} chunks ({lay.cp_attention} over cp = "
                          f"{lay.cp})")
    if lay.cp > 1 and lay.cp_attention == "ulysses" and (shape.heads % (lay.tp * lay.cp)
                                                          or shape.kv_heads % (lay.tp * lay.cp)):
        raise ConfigError(f"--cp-attention ulysses needs tp x cp = {lay.tp * lay.cp} to divide the {shape.heads} "
                          f"query heads and the {shape.kv_heads} key/value heads")
    if lay.dp % lay.ep:
        raise ConfigError(f"--ep {lay.ep} must divide dp = {lay.dp}: expert groups are carved out of data "
                          f"parallelism")
    if lay.ep > 1 and (not shape.is_moe or shape.experts % lay.ep):
        raise ConfigError(f"--ep {lay.ep} needs an MoE model whose experts ({shape.experts}) it divides")
    if lay.zero and lay.dp * lay.cp == 1:
        raise ConfigError(f"--zero {lay.zero} with dp = 1: there is nothing to shard across; drop --zero")
    if lay.offload not in ("none", "cpu", "disk"):
        raise ConfigError(f"--offload must be none, cpu or disk, got {lay.offload!r}")
    if lay.offload != "none" and not lay.zero:
        raise ConfigError(f"--offload {lay.offload} moves ZeRO's optimizer shard: it needs --zero 1, 2 or 3")


def check_framework(fw, ep: int, zero: int) -> None:
    """What the planned framework cannot run, though another could."""
    if ep > 1 and zero == 3 and not fw.zero3_with_ep:
        raise ConfigError(f"--zero 3 with --ep under --framework {fw.name}: it does not gather expert weights "
                          f"per unit; use --zero 1 or 2 (or plan for another framework)")
