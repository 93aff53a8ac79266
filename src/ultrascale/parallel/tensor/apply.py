"""Turn the single-device model into this rank's tensor-parallel part (on the meta device).

Per block, in Megatron's layout:
  attention: q, k, v column-parallel (each rank gets heads/tp query heads and
             kv_heads/tp key/value heads, so GQA groups stay whole on a rank),
             o row-parallel; the attention input enters the region once (one
             f, or one all-gather under SP) for q, k and v together.
  MLP:       gate and up column-parallel, down row-parallel; an MoE layer is replicated.
  norms:     replicated; under SP they run on sequence shards, so their weight
             gradients are summed over the TP group.
Embedding vocabulary-parallel; head column-parallel over the vocabulary (or the
tied embedding), its logits left sharded for the vocabulary-parallel loss.
"""

from __future__ import annotations

from ultrascale.model.moe import MoE
from ultrascale.parallel.tensor.comm import TPRegion
from ultrascale.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TiedVocabParallelHead,
    VocabParallelEmbedding,
    replicated,
)


def _enter_once(module, region):
    """Prepare the module's first input (the activations) once for all its column-parallel linears."""
    module.register_forward_pre_hook(lambda m, args: (region.enter(args[0]), *args[1:]))


def _replicate_norm(norm, world, region):
    for p in norm.parameters():
        replicated(p, world, region.group if region.sp else None)


def apply_tensor_parallel(model, ctx, sequence_parallel: bool = False):
    cfg, world, rank = model.cfg, ctx.size("tp"), ctx.index("tp")
    region = TPRegion(ctx.group("tp"), world, sequence_parallel)
    h, kv, f, bias = cfg.hidden, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden, cfg.bias

    if model.embed is not None:
        model.embed = VocabParallelEmbedding(cfg.vocab_size, h, rank, world, region)
    for block in model.layers.values():
        attn, mlp = block.attn, block.mlp
        attn.q_proj = ColumnParallelLinear(h, h, bias, rank, world)
        attn.k_proj = ColumnParallelLinear(h, kv, bias, rank, world)
        attn.v_proj = ColumnParallelLinear(h, kv, bias, rank, world)
        attn.o_proj = RowParallelLinear(h, h, bias, rank, world, region)
        _enter_once(attn, region)
        _replicate_norm(block.attn_norm, world, region)
        _replicate_norm(block.mlp_norm, world, region)
        if isinstance(mlp, MoE):
            # Experts stay whole and every tp rank runs the MoE on the tokens it holds (all of them,
            # or its sequence shard under SP: then the router's and experts' gradients are summed).
            _replicate_norm(mlp, world, region)
            continue
        if mlp.swiglu:
            mlp.gate_proj = ColumnParallelLinear(h, f, bias, rank, world)
        mlp.up_proj = ColumnParallelLinear(h, f, bias, rank, world)
        mlp.down_proj = RowParallelLinear(f, h, bias, rank, world, region)
        _enter_once(mlp, region)
    if model.norm is not None:
        _replicate_norm(model.norm, world, region)
        padded = -(-cfg.vocab_size // world) * world
        if model.head is not None:
            model.head = ColumnParallelLinear(h, cfg.vocab_size, False, rank, world, region, padded_out=padded)
        else:
            model.head = TiedVocabParallelHead(model.embed, region)
    return model
