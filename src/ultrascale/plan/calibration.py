"""Frameworks: how an implementation spends memory and time beyond the model's formulas.

Two kinds of fields. Implementation facts say what the code does (which
kernels, what a sequence-parallel linear keeps); they are read off the code.
Calibration constants are the few numbers a model of a real cluster cannot
derive; each one is named, documented, and set once for a framework, never per
configuration (docs/planner.md gives the figures they produce).

- `ultrascale`: our engine as written (eager RMSNorm, SDPA, fp32 loss), whose
  memory the planner matches exactly on CPU (tests/test_plan_engine.py), and
  whose time constants are fitted on its own CPU runs (`--cluster cpu`,
  benchmarks/bench_plan_cpu.py, plan/data/cpu_runs.json).
- `playbook`: the framework of the playbook's published H100 runs
  (../shared/data/playbook_benchmarks.csv: nanotron, FlashAttention, fused
  norms), calibrated against those runs (`ultrascale plan validate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ultrascale.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class Framework:
    name: str
    # -- implementation facts ------------------------------------------------
    kernels: str  # "eager" (our engine) | "fused" (fused norms, attention in [b, s, heads, d])
    sp_keeps_gathered_input: bool  # column-parallel linears under SP save the all-gathered input
    partition: str  # how layers are cut into pipeline stages: "even" | "compute" (parallel/pipeline/partition.py)
    # -- calibration constants -----------------------------------------------
    context_bytes: float  # CUDA context, cuBLAS/NCCL workspaces: outside the allocator, always there
    fragmentation: float  # caching-allocator overhead on the memory that comes and goes (activations...)
    mfu: float  # fraction of the device peak the model's matmuls reach when nothing else interferes
    layer_overhead_s: float  # fixed cost per layer per micro-batch (kernel launches, small kernels)
    microbatch_overhead_s: float = 0.0  # fixed cost per micro-batch and stage (scheduling, host work)
    # What a collective on the critical path costs beyond its bytes, per ring step: the launch, and the
    # wait for the group's slowest member (time.py, "Synchronization"). Added to the link's latency.
    collective_step_s: float = 0.0
    # How much more that costs inside a pipeline: a framework whose pipeline receive reads the tensor's
    # shape on the host (nanotron's metadata handshake) synchronizes the CPU with the GPU every
    # micro-batch, so the collectives of the blocks after it are paid as the CPU launches them.
    pipeline_sync_factor: float = 1.0
    help: str = ""
    # The kernels the time constants above were set on: a run on other kernels (--kernels) adds or saves
    # only what the difference moves through HBM (plan/passes.py).
    kernels_timed: str = "fused"
    # -- more implementation facts (activations.ActivationSpec) ----------------
    attention: str = "flash"  # flash | eager (keeps the s x s softmax) | math (SDPA's math backend, fp32)
    # Context parallelism's block attention (ring, zig-zag, all-gather): "eager" where each block's
    # scores are built and softmaxed in memory, then merged; "flash" where a fused kernel returns each
    # block's log-sum-exp (our engine on the CPU: parallel/context/blocks.py).
    cp_block_attention: str = "flash"
    dropout: bool = False  # the framework runs the model's dropout (1-byte masks), where the model has any
    fused_swiglu: bool = False  # SwiGLU keeps 3f per token, not 4f
    zero3_with_ep: bool = True  # ZeRO-3 gathers expert weights per unit too (FSDP2 + EP; our engine does not)
    float8: bool = False  # the blocks' linears run in float8 (torchao's Float8Linear, tensorwise scaling)
    # ZeRO-3 inside a pipeline: gather and reduce-scatter every micro-batch (True), or keep the stage's
    # parameters gathered from the first forward to the last backward and reduce once (torchtitan
    # under PP: no reshard after forward, gradient sync on the last micro-batch).
    zero3_reshards_in_pipeline: bool = True
    # What --recompute selective keeps: "attention" (Megatron: all but the attention core) or "op"
    # (torchtitan's op-level policy; activations.op_policy_terms).
    selective: str = "attention"
    # Expert-parallel groups take consecutive ranks and fill nodes (Megatron-Core's rank order
    # tp-cp-ep-dp-pp, torchtitan's pp-outermost mesh, DeepSeek-V3's EP64 over 8 nodes); False: our
    # engine's grid, where an expert group's dp ranks lie pp·cp·tp apart (plan/time.py, expert_ranks).
    ep_fills_nodes: bool = True
    # Tensor parallelism's collectives cut into tp pieces that run beside the matmuls they feed (Megatron's
    # --tp-comm-overlap, torchtitan's async TP: all-gather-matmul and matmul-reduce-scatter), with sequence
    # parallelism: only the first piece and what exceeds the matmuls show (plan/time.py, _exposed_tp).
    tp_overlap: bool = False
    # DeepSeek-V3's activation storage (plan/activations.py, _deepseek_terms): linears' inputs kept in FP8,
    # and RMSNorm outputs and MLA's up-projections recomputed in backward.
    fp8_cache: bool = False
    recompute_norms: bool = False


FRAMEWORKS = {
    "ultrascale": Framework(
        "ultrascale", kernels="eager", sp_keeps_gathered_input=True, partition="even",
        context_bytes=1.0 * GIB, fragmentation=0.20,
        # Fitted on this engine's runs on a CPU (--cluster cpu; benchmarks/bench_plan_cpu.py writes
        # plan/data/cpu_runs.json): a collective's ring step costs milliseconds on gloo, as its
        # all-gather and reduce-scatter run. Not yet measured on a GPU.
        mfu=0.734, layer_overhead_s=0.00297, microbatch_overhead_s=0.0,
        collective_step_s=0.00238, zero3_with_ep=False, ep_fills_nodes=False, kernels_timed="eager",
        help="our engine: eager kernels; memory exact on CPU, time fitted on its CPU runs"),
    "playbook": Framework(
        "playbook", kernels="fused", sp_keeps_gathered_input=False, partition="compute",
        context_bytes=1.0 * GIB, fragmentation=0.20, mfu=0.50, layer_overhead_s=1e-3, microbatch_overhead_s=0.0,
        collective_step_s=20e-6, pipeline_sync_factor=8.0,
        help="the playbook's benchmark framework (nanotron on H100), calibrated on its runs"),
    # Megatron-LM as Korthikanti et al. (2022) and Llama 3's stack describe it: fused kernels, the
    # sequence-parallel linear keeps its shard, even stages (first/last may be pinned), dropout in the
    # GPT block, fused SwiGLU. Its constants are the playbook's but two: the matmul efficiency of large
    # GEMMs (cuBLAS reaches about 0.7-0.8 of the dense peak at h >= 12k), and no host synchronization in
    # its pipeline (the shapes are known) nor the playbook cluster's per-node-pair cost.
    "megatron": Framework(
        "megatron", kernels="fused", sp_keeps_gathered_input=False, partition="even",
        context_bytes=1.0 * GIB, fragmentation=0.20, mfu=0.70, layer_overhead_s=1e-3, microbatch_overhead_s=0.01,
        collective_step_s=20e-6, help="Megatron-LM: fused kernels, even stages, dropout masks, fused SwiGLU",
        dropout=True, fused_swiglu=True),
    # torchtitan as it publishes its numbers (docs/performance.md): FSDP2 + DTensor TP/SP + PP, regional
    # torch.compile, float8 linears. Its matmul efficiency is set on one run of that table (Llama 3.1 8B,
    # FSDP + compile on 8 GPUs, bf16) and checked on the others (plan/published.py).
    "torchtitan": Framework(
        "torchtitan", kernels="fused", sp_keeps_gathered_input=True, partition="even",
        context_bytes=1.0 * GIB, fragmentation=0.20, mfu=0.43, layer_overhead_s=1e-3, microbatch_overhead_s=0.01,
        collective_step_s=20e-6, help="torchtitan: FSDP2 + TP + PP, compiled blocks, float8 linears",
        float8=True, zero3_reshards_in_pipeline=False, selective="op"),
    # DeepSeek's HAI-LLM as the DeepSeek-V3 report describes it (arXiv 2412.19437, section 3): FP8 linears
    # (3.3), activations kept in FP8 and norms / MLA up-projections recomputed (3.2.3, 3.3.3), no dropout, expert
    # groups filling nodes (3.2). Its time constants are Megatron's: none is fitted on DeepSeek's runs.
    "deepseek": Framework(
        "deepseek", kernels="fused", sp_keeps_gathered_input=False, partition="even",
        context_bytes=1.0 * GIB, fragmentation=0.20, mfu=0.70, layer_overhead_s=1e-3, microbatch_overhead_s=0.01,
        collective_step_s=20e-6, help="DeepSeek-V3's training: FP8 linears and activations, norms and MLA "
                                      "up-projections recomputed (Megatron's time constants)",
        float8=True, fp8_cache=True, recompute_norms=True),
}


# What `ultrascale plan` assumes when no --framework is given: Megatron-LM's kernels and pipeline,
# no constant fitted on one cluster alone (checked against published runs: plan/published.py).
DEFAULT_FRAMEWORK = "megatron"


def engine_here(dtype: str) -> Framework:
    """Our engine's framework as it runs on this machine in `dtype`: SDPA's math backend where torch's CPU
    flash kernel cannot run the dtype (parallel/precision.choose_attention_kernel makes the same choice)."""
    import dataclasses

    from ultrascale.parallel.precision import flash_attention_fails_here

    fw = FRAMEWORKS["ultrascale"]
    return dataclasses.replace(fw, attention="math") if flash_attention_fails_here(dtype) else fw


def get_framework(name: str) -> Framework:
    if name not in FRAMEWORKS:
        raise ConfigError(f"unknown framework {name!r}: choose one of {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]
