"""Per-GPU memory of one configuration, by owner, for every pipeline stage.

Terms (bytes per GPU):
  params, grads, optim  model states, sharded by tp / pp / ep and ZeRO (states.py)
  activations           what autograd keeps for backward (activations.py), times the
                        micro-batches the stage holds in flight under its schedule
                        (bubble.py); the final norm on the last stage
  logits                what the loss keeps: fp32 log-softmax and targets, per in-flight
                        micro-batch on the last stage
  transient             memory that lives only during part of the step and is at its
                        largest at the peak: the logits in the compute dtype (and their
                        fp32 copy) while the loss runs; the backward working set of one
                        block (its activation gradients, about its saved activations),
                        twice under full recomputation (the block recomputed, then its
                        gradients); under zero-bubble schedules, the output gradients
                        that deferred weight-gradient passes hold
  comm_buffers          the all-gathered input of a sequence-parallel linear and the
                        full output before its reduce-scatter; pipeline send/receive
                        buffers; ring-attention K/V blocks (double-buffered), the
                        all-gathered K/V or the Ulysses all-to-all buffers; expert
                        all-to-all buffers; ZeRO-2/3 full gradient buckets in flight
                        and ZeRO-3's gathered parameters (the unit in use and the
                        prefetched one)
  overhead              CUDA context and library workspaces, plus the caching
                        allocator's fragmentation of what comes and goes (calibration.py)

The binding stage is the one with the largest total: the first stage under 1F1B
(it holds p micro-batches), the last one when the logits dominate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ultrascale.plan import activations as act
from ultrascale.plan.bubble import held_per_chunk, in_flight
from ultrascale.plan.calibration import GIB, Framework
from ultrascale.plan.precision import ENGINE_PRECISION, get_precision
from ultrascale.parallel.pipeline.partition import v_shaped
from ultrascale.plan.states import (block_counts, chunk_dense_layers, chunk_layers, engine_states, model_states,
                                    rank_params, stage_layer_ids)

TERMS = ("params", "grads", "optim", "activations", "logits", "transient", "comm_buffers", "overhead")
DYNAMIC = ("activations", "logits", "transient", "comm_buffers")


@dataclass
class StageMemory:
    stage: int
    terms: dict
    in_flight: float
    layers: int
    param_count: float
    offloaded: float = 0.0  # bytes of model states in host memory or on disk (--offload), not in `terms`
    slack: float = 0.0  # the fragmentation part of terms["overhead"]

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def allocated(self) -> float:
        """What the allocator hands out at the peak (no context, no fragmentation)."""
        return self.total - self.terms["overhead"]

    @property
    def needed(self) -> float:
        """What must fit on the card: the live tensors and the CUDA context. The fragmentation
        term is the caching allocator's slack, which it gives back (empties its cache and retries)
        before it runs out of memory: a plan over the card by that term alone is tight, not refused."""
        return self.total - self.slack


@dataclass
class MemoryPlan:
    stages: list = field(default_factory=list)

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    def as_dict(self) -> dict:
        p = self.peak
        return {"total": p.total, "needed": max(s.needed for s in self.stages), "stage": p.stage, "in_flight_micro_batches": p.in_flight, "layers": p.layers,
                "param_count": p.param_count, "offloaded": p.offloaded, **{k: p.terms[k] for k in TERMS},
                "stages": [{"stage": s.stage, "total": s.total, **s.terms} for s in self.stages]}


def activation_spec(lay, fw: Framework, shape=None) -> act.ActivationSpec:
    # Dropout is the model's (GPT-3 has it, Llama has none) as the framework runs it.
    dropout = fw.dropout and (shape is None or shape.dropout)
    return act.ActivationSpec(act_bytes=get_precision(lay.precision).act_bytes, tp=lay.tp, sp=lay.sp_on, cp=lay.cp,
                              ep=lay.ep, recompute=lay.recompute, cp_attention=lay.cp_attention, kernels=fw.kernels,
                              sp_keeps_gathered_input=fw.sp_keeps_gathered_input, attention=fw.attention,
                              dropout=dropout, fused_swiglu=fw.fused_swiglu, seq_len=lay.seq_len,
                              selective=fw.selective, fp8_cache=fw.fp8_cache, recompute_norms=fw.recompute_norms)


def _engine_exact(shape, lay, fw) -> bool:
    """Configurations our engine runs today, planned with its own framework: replayed exactly."""
    return (fw.kernels == "eager" and fw.partition == "even" and fw.attention in ("flash", "math") and not fw.dropout
            and not fw.fused_swiglu and lay.ep == 1 and not shape.is_moe
            and lay.precision in ENGINE_PRECISION.values())


def _states(shape, lay, fw, stage):
    """Model states on the GPU; under offload, what left it is under "offloaded" (host or disk)."""
    states = _device_states(shape, lay, fw, stage)
    if lay.offload == "none":
        return {**states, "offloaded": 0.0}
    # The fp32 masters and both moments leave (12 bytes a parameter of the shard, whatever the recipe:
    # on the GPU fp32 parameters no longer double as masters), and ZeRO-3's parameter shard.
    shard = states["param_count"] / (lay.dp * lay.cp)
    moved = 12 * shard + (states["params"] if lay.zero == 3 else 0.0)
    return {**states, "optim": 0.0, "params": 0.0 if lay.zero == 3 else states["params"], "offloaded": moved}


def _device_states(shape, lay, fw, stage):
    prec = get_precision(lay.precision)
    blocks = block_counts(shape, stage)
    if _engine_exact(shape, lay, fw):
        # Our engine: replay its parameter shards, buckets and padding; every rank, keep the largest.
        # Gradients and ZeRO shards live on the dp x cp ranks (the dp_cp group).
        whole, n = (None if lay.pp == 1 else stage), lay.dp * lay.cp
        ranks = range(n) if n <= 64 else (0, n - 1)
        per_rank = [engine_states(shape, prec, n, lay.zero, lay.bucket_mb, r, lay.tp, whole) for r in ranks]
        best = max(per_rank, key=lambda s: sum(s.values()))
        return {**best, "param_count": sum(n for _, n in rank_params(shape, lay.tp, whole))}
    return model_states(shape, lay, prec, blocks)


def _unit_params(shape, lay) -> float:
    """Parameters of one ZeRO-3 unit (a block) on this rank: what one all-gather brings."""
    dense = shape.attn_params() / lay.tp + 2 * shape.norm_params()
    if shape.is_moe:
        return (dense + shape.experts * shape.hidden + shape.shared_params() / lay.tp
                + shape.experts // lay.ep * shape.expert_params() / lay.tp)
    return dense + shape.expert_params() / lay.tp


def _comm_buffers(shape, lay, spec, tokens, states) -> float:
    b, h = spec.act_bytes, shape.hidden
    out = 0.0
    full_seq = tokens * b * h / lay.cp
    if lay.tp > 1 and lay.sp_on:
        out += 2 * full_seq  # gathered input of a column-parallel linear; row-parallel output before reduce-scatter
    if lay.pp > 1:
        out += 2 * full_seq / (lay.tp if lay.sp_on else 1)  # one send and one receive buffer
    if lay.cp > 1 and lay.cp_attention in ("ring", "zigzag"):
        out += 2 * 2 * tokens * b * shape.kv_dim / lay.cp / lay.tp  # K and V blocks, current and next
    elif lay.cp > 1 and lay.cp_attention == "allgather" and lay.recompute != "none":
        out += 2 * tokens * b * shape.kv_dim / lay.tp  # the gathered K and V of the layer in use
    elif lay.cp > 1 and lay.cp_attention == "ulysses":
        out += 2 * tokens * b * (2 * shape.hidden + 2 * shape.kv_dim) / lay.cp / lay.tp  # all-to-all send + receive
    if lay.ep > 1:
        out += 2 * shape.top_k * full_seq  # all-to-all send and receive
    prec = get_precision(lay.precision)
    if lay.zero >= 2:
        full_grads = states["param_count"] * 4
        out += min(3 * lay.bucket_mb * 2**20, full_grads)  # full fp32 buckets awaiting their reduce-scatter
    if lay.zero == 3:
        unit = _unit_params(shape, lay)
        out += 2 * prec.param_bytes * unit  # the unit in use and the prefetched one
    return out


def _deferred_w_bytes(shape, lay, spec, tokens, n_layers, stage) -> float:
    """ZB-H1 splits each backward into B (input gradients) and W (weight gradients) and defers W to
    fill the bubble. A deferred W needs the gradient of every linear's output, held from B to W (its
    inputs are the saved activations, counted already): per token of a micro-batch, the gradients of
    q, k, v, o, and the MLP's outputs. Stage i ends its warm-up with min(p - 1 - i, m) of them
    pending (ZB-H1's cool-down fills its p - 1 - i idle slots with W passes; Qi et al. 2023,
    figure 3). DualPipeV defers W only in its last phase, within the p + 1 micro-batches of
    activations its in-flight count already holds (DeepSeek-V3 report, Table 2): nothing is added."""
    if lay.pp == 1 or lay.schedule != "zero-bubble" or not n_layers:
        return 0.0
    h, kv, b = shape.hidden, shape.kv_dim, spec.act_bytes
    f = shape.expert_ffn * shape.top_k if shape.is_moe else shape.ffn_hidden
    mlp_out = (2 * f if shape.mlp == "swiglu" else f) + h
    per_token = b * (2 * h + 2 * kv + mlp_out) / (lay.tp * lay.cp)
    pending = min(lay.pp - 1 - stage, lay.grad_accum)
    return pending * n_layers * tokens * per_token


def memory_plan(shape, lay, fw: Framework) -> MemoryPlan:
    """The memory of every pipeline stage of `lay` (check_layout first)."""
    spec = activation_spec(lay, fw, shape)
    tokens = lay.micro_batch * lay.seq_len
    layer = act.layer_bytes(shape, spec, tokens)
    layer_none = act.layer_bytes(shape, spec, tokens, recompute="none")
    # An MoE model's leading dense blocks (a dense model's blocks are all "dense": the same figure).
    layer_dense = act.layer_bytes(shape, spec, tokens, moe=False) if shape.is_moe and shape.dense_layers else layer
    plan = MemoryPlan()
    cache = {}  # stages holding as many blocks share their states and buffers (by formula)
    exact = _engine_exact(shape, lay, fw)
    split = (fw.partition, lay.chunks, lay.first_stage_layers, lay.last_stage_layers)
    vshape = v_shaped(lay.schedule)  # DualPipeV: rank 0 holds the first and the last chunk
    for stage, ids in enumerate(stage_layer_ids(shape, lay.pp, *split, vshape)):
        blocks = block_counts(shape, ids)
        n_layers, first, last, _ = blocks
        key = ids if exact else blocks
        if key not in cache:
            states = _states(shape, lay, fw, ids)
            cache[key] = (states, _comm_buffers(shape, lay, spec, tokens, states))
        states, comm = cache[key]
        flight = in_flight(lay.schedule, lay.pp, lay.grad_accum, lay.chunks, stage)
        # Each chunk's activations times the micro-batches it holds; the embedding rides with the
        # first chunk of the first stage, the final norm and the loss with the last chunk of the last.
        held = held_per_chunk(lay.schedule, lay.pp, lay.grad_accum, lay.chunks, stage)
        # The chunks' block counts come from the same split as the states (no second rule to drift).
        sizes = chunk_layers(shape, lay.pp, lay.chunks, stage, fw.partition, lay.first_stage_layers,
                             lay.last_stage_layers, vshape)
        dense = chunk_dense_layers(shape, lay.pp, lay.chunks, stage, fw.partition, lay.first_stage_layers,
                                   lay.last_stage_layers, vshape)
        per_chunk = [(n - d) * layer + d * layer_dense + act.rope_bytes(shape, spec, lay.seq_len)
                     for n, d in zip(sizes, dense)]
        if first:
            per_chunk[0] += act.embedding_bytes(tokens, spec)
        if last:
            per_chunk[-1] += act.final_norm_bytes(shape, spec, tokens)
        terms = {k: states[k] for k in ("params", "grads", "optim")}
        if lay.zero == 3 and lay.pp > 1 and not fw.zero3_reshards_in_pipeline:
            # FSDP inside a pipeline, as torchtitan runs it: the stage's parameters stay gathered
            # from the first forward to the last backward (reshard_after_forward=False) and the
            # gradients are reduced once, after the last micro-batch, so the whole stage's
            # parameters (compute dtype) and its unsharded gradients (fp32, FSDP's reduce dtype)
            # live through the step beside the shards.
            terms["params"] += states["param_count"] * get_precision(lay.precision).param_bytes
            terms["grads"] += states["param_count"] * 4
        terms["activations"] = sum(h * a for h, a in zip(held, per_chunk))
        terms["logits"] = held[-1] * act.loss_saved_bytes(shape, spec, tokens) if last else 0.0
        working = layer_none * (2 if lay.recompute == "full" else 1) if n_layers else 0.0
        terms["transient"] = (working + (act.loss_transient_bytes(shape, spec, tokens) if last else 0.0)
                              + _deferred_w_bytes(shape, lay, spec, tokens, n_layers, stage))
        terms["comm_buffers"] = comm
        dynamic = sum(terms[k] for k in DYNAMIC)
        terms["overhead"] = fw.context_bytes + fw.fragmentation * dynamic
        plan.stages.append(StageMemory(stage, terms, flight, n_layers, states["param_count"], states["offloaded"],
                                       slack=fw.fragmentation * dynamic))
    return plan


def fits(plan: MemoryPlan, gpu) -> bool:
    """The live tensors and the context of every stage fit the card (StageMemory.needed)."""
    return max(s.needed for s in plan.stages) <= gpu.memory_bytes


def verdict(plan: MemoryPlan, gpu) -> str:
    if plan.peak.total <= gpu.memory_bytes:
        return "fits"
    if fits(plan, gpu):
        # The total counts the caching allocator's slack, which it gives back before it runs out of memory:
        # over the card by that alone, the run fits with less cache than planned.
        tight = max(plan.stages, key=lambda s: s.needed)
        needed, slack = tight.needed, tight.slack
        return (f"fits tightly: the live tensors and the context need {needed / GIB:.1f} GiB of the card's "
                f"{gpu.memory_bytes / GIB:.1f}; the total counts {slack / GIB:.1f} GiB of allocator cache, of "
                f"which {(gpu.memory_bytes - needed) / GIB:.1f} GiB fit (the cache is emptied before memory "
                f"runs out: slower, not refused)")
    return "does NOT fit"


def gib(x: float) -> float:
    return x / GIB
