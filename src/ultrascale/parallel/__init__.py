"""Where each technique plugs into the trainer, in torchtitan's composition order.

1. `shard_model(ctx, cfg)`: a transform applied to the model on the meta device,
   before any memory is allocated: pipeline split, then tensor parallelism, then
   context parallelism (each block's core attention swapped for a variant that
   attends across the cp ranks' shards of the sequence), then, with --fp8, the
   blocks' linear layers swapped for FP8 ones (parallel/fp8.py).
   `shard_sequences(micro_batches, ctx, cfg)`: under context parallelism, each
   micro-batch cut to this rank's shard of every sequence, with the shard's
   global positions for RoPE (the trainer passes them to the model).
2. recomputation (train/recompute.py) wraps what is left (selective: the core
   attention, context-parallel or not, communication included).
2b. `compile_model(model, cfg)`: with --compile, each transformer block's forward
   compiled (parallel/compile.py), before data parallelism hooks into the model.
3. `build_grads(model, params, ctx, cfg)`: who owns the gradients and how they are
   reduced across data-parallel ranks (plain, overlapped, bucketed, ZeRO).
4. `loss_function(ctx, cfg)`: the loss over this rank's logits (vocabulary-sharded under TP).
5. `grad_norm_reducer(ctx)`: sums the squared gradient norm over the ranks that
   hold different pieces of the model (tensor and pipeline parallel).
6. `pipeline_runtime(...)`: under pipeline parallelism, the schedule replaces the
   trainer's loop over micro-batches.
7. `full_state(...)`: the full parameters again, for comparisons and export;
   `optimizer_chunks(...)`: where this rank's optimizer tensors sit in the full
   parameters, for checkpoints any layout can resume.

A technique that is not implemented is refused by `ultrascale.config.IMPLEMENTED`,
never silently skipped.
"""

from __future__ import annotations

# Imports stay inside the functions: the CLI reads this package (pp-schedule) without paying for torch.


def shard_model(ctx, cfg):
    """The transform that turns the single-device model into this rank's part of it:
    first the pipeline split (keep this rank's layers), then tensor parallelism, then
    context parallelism (and the MoE loads summed over the shards of a sequence), then
    expert parallelism (keep this rank's experts)."""
    steps = []
    if ctx.size("pp") > 1:
        from ultrascale.parallel.pipeline.stage import keep_stages, make_linears_deferrable, v_shaped

        p, v = ctx.size("pp"), cfg.parallel.pp_chunks
        pc = cfg.parallel
        steps.append(lambda model: keep_stages(model, ctx.index("pp"), p, v, pc.pp_first_stage_layers,
                                               pc.pp_last_stage_layers, v_shaped(pc.pp_schedule)))
        if cfg.parallel.pp_schedule in ("zero-bubble", "dualpipev"):  # both split backwards into I and W
            steps.append(make_linears_deferrable)
    if ctx.size("tp") > 1:
        from ultrascale.parallel.tensor import apply_tensor_parallel

        steps.append(lambda model: apply_tensor_parallel(model, ctx, sequence_parallel=cfg.parallel.sp))
    if ctx.size("cp") > 1:
        from ultrascale.parallel.context import apply_context_parallel

        steps.append(lambda model: apply_context_parallel(model, ctx, cfg.parallel.cp_attention))
    if cfg.model.is_moe and (ctx.size("cp") > 1 or cfg.parallel.sp):
        from ultrascale.parallel.expert import share_token_loads

        steps.append(lambda model: share_token_loads(model, ctx, cfg.parallel.sp))
    if ctx.size("ep") > 1:
        from ultrascale.parallel.expert import apply_expert_parallel

        steps.append(lambda model: apply_expert_parallel(model, ctx, cfg.parallel.dispatch))
    if cfg.train.fp8:
        from ultrascale.parallel.fp8 import apply_fp8

        steps.append(lambda model: apply_fp8(model, ctx.device))
    if not steps:
        return None

    def transform(model):
        for step in steps:
            model = step(model) or model
        return model

    return transform


def shard_sequences(micro_batches, ctx, cfg) -> list:
    """[(inputs, targets)] -> [(inputs, targets, positions)]: without context parallelism the whole
    sequences and positions None (0..s-1); with it, this rank's shard of each sequence (contiguous,
    or zig-zag) and the global positions of its tokens. Under sequence parallelism the cp shard is
    what the tensor-parallel ranks then cut further: cp first, tp inside it."""
    if ctx.size("cp") == 1:
        return [(inputs, targets, None) for inputs, targets in micro_batches]
    from ultrascale.parallel.context import shard_micro_batches

    return shard_micro_batches(micro_batches, ctx.index("cp"), ctx.size("cp"), cfg.parallel.cp_attention)


def pipeline_runtime(model, ctx, cfg, grads, loss_fn, meter):
    """The executor of this rank's pipeline schedule, or None without pipeline parallelism."""
    if ctx.size("pp") == 1:
        return None
    from ultrascale.parallel.pipeline.runtime import PipelineRuntime

    return PipelineRuntime(model, ctx, cfg, grads, loss_fn, meter)


def compile_model(model, cfg) -> None:
    """--compile: torch.compile each transformer block in place (regional compilation)."""
    if cfg.train.compile:
        from ultrascale.parallel.compile import compile_blocks

        compile_blocks(model)


def build_grads(model, params, ctx, cfg):
    """The gradient owner for this layout: plain, or a data-parallel mode, or ZeRO; under expert
    parallelism, one for the dense weights and one for the experts (parallel/expert_grads.py)."""
    if ctx.size("ep") > 1:
        from ultrascale.parallel.expert_grads import ExpertParallelGrads

        return ExpertParallelGrads(model, params, ctx, cfg)
    if ctx.size("dp_cp") == 1:
        from ultrascale.parallel.grads import LocalGrads

        return LocalGrads(params, cfg.train.dtype)
    from ultrascale.parallel.data_parallel import build_data_parallel

    return build_data_parallel(model, params, ctx, cfg)


def loss_function(ctx, cfg):
    if ctx.size("tp") == 1:
        from ultrascale.model import cross_entropy_loss

        return cross_entropy_loss
    from ultrascale.parallel.tensor import vocab_parallel_loss

    return vocab_parallel_loss(ctx, cfg.model.vocab_size)


def grad_norm_reducer(ctx):
    """Sum of squared norms over the ranks whose gradients are different pieces
    (tensor shards, pipeline stages); None when this rank has them all."""
    import torch.distributed as dist

    from ultrascale.spans import comm

    groups = [ctx.group(name) for name in ("tp", "pp") if ctx.size(name) > 1]
    if not groups:
        return None

    def reduce(sq):
        for g in groups:
            with comm("grad_norm.all_reduce"):
                dist.all_reduce(sq, group=g)
        return sq

    return reduce


def full_state(names, params, tensors, ctx) -> dict:
    """{single-device name: full fp32 tensor} from this rank's `tensors` of `params`:
    tensor-parallel shards gathered, experts gathered over ep, pipeline stages merged."""
    if ctx.size("ep") > 1:
        from ultrascale.parallel.expert import gather_experts

        tensors = [gather_experts(p, t, ctx) for p, t in zip(params, tensors)]
    if ctx.size("tp") > 1:
        from ultrascale.parallel.tensor import gather_tensor_parallel

        tensors = [gather_tensor_parallel(p, t, ctx) for p, t in zip(params, tensors)]
    state = {n: t.cpu() for n, t in zip(names, tensors)}
    if ctx.size("pp") > 1:
        import torch.distributed as dist

        stages = [None] * ctx.size("pp")
        dist.all_gather_object(stages, state, group=ctx.group("pp"))
        state = {n: t for stage in stages for n, t in stage.items()}
    return state


def optimizer_chunks(grads, names, ctx, writing: bool = False):
    """This rank's optimizer tensors as chunks of the full parameters (parallel/placement.py).

    writing=True keeps only the chunks this rank is the one to write: a replica of
    data parallelism (without ZeRO) or a norm replicated over tp is written by the
    first rank of its group (an expert replicated over edp: edp index 0); every
    rank reads all of its own.
    """
    from ultrascale.parallel.placement import chunks_of

    name_of = {id(p): n for p, n in zip(grads.params, names)}
    tp_rank = ctx.index("tp") if ctx.size("tp") > 1 else 0
    out = []
    for i, (p, start, end) in enumerate(grads.main_ranges()):
        if writing and ((not hasattr(p, "tp_dim") and tp_rank) or grads.replica_index(p)):
            continue
        out += chunks_of(i, name_of[id(p)], p, tp_rank, start, end)
    return out
