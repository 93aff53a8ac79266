"""Model states per rank: parameters, gradients, optimizer (the three owners ZeRO shards).

Formulas (ZeRO paper, Rajbhandari et al. 2020; the playbook's ZeRO section),
with Psi the parameters a rank's model slice holds, N_d the ZeRO group (dp x cp
ranks, the engine's dp_cp group), b / g / k the recipe's bytes (precision.py):

  ZeRO-0  b·Psi + g·Psi + k·Psi
  ZeRO-1  b·Psi + g·Psi + k·Psi/N_d
  ZeRO-2  b·Psi + (g + k)·Psi/N_d
  ZeRO-3  (b + g + k)·Psi/N_d

The model slice: tp divides every attention and MLP matrix and the (padded)
vocabulary; norms (and row-parallel biases) are replicated; pp gives stage i its
layers, the embedding to the first stage and the final norm and head to the last
(with tied embeddings the last stage holds its own copy of the matrix); ep gives
each rank experts/ep experts, sharded over the dp x cp / ep ranks that hold
the same experts.

Exact for the engine: with cp = ep = 1 (any dp, tp, pp, ZeRO stage) the engine's
per-rank parameter list, buckets and ZeRO-3 units are replayed element for
element (`engine_states`): padding to a multiple of N_d, the shards each rank
owns, and the optimizer's one-element pieces that the memory meter does not count.
"""

from __future__ import annotations

import functools

from ultrascale.errors import ConfigError
from ultrascale.parallel.pipeline.partition import (
    PartitionError,
    holds_embedding,
    holds_head,
    rank_chunks,
    split,
)
from ultrascale.plan.activations import padded_vocab
from ultrascale.plan.precision import Precision


def _split(shape, pp: int, partition: str, chunks: int, first: int, last: int):
    """Block ids of each virtual stage, by the engine's own rule (parallel/pipeline/partition.py)."""
    block_cost = 4 * shape.heads * shape.head_dim * shape.hidden + 3 * shape.ffn_hidden * shape.hidden
    try:
        return split(shape.layers, pp, chunks, first, last, partition, block_cost, shape.vocab * shape.hidden)
    except PartitionError as e:
        raise ConfigError(str(e)) from None


@functools.lru_cache(maxsize=1024)
def stage_layer_ids(shape, pp: int, partition: str = "even", chunks: int = 1, first: int = 0, last: int = 0,
                    vshape: bool = False):
    """(block ids, holds the embedding, holds the head) for each pipeline rank: its chunks' blocks,
    chunk 0 first, under partition.split (the even split, the first/last stage pinned to `first` /
    `last` blocks, or nanotron's compute split), the same rule the engine cuts its model with.
    vshape: DualPipeV's placement (rank 0 holds both ends)."""
    stages = _split(shape, pp, partition, chunks, first, last)
    return tuple((tuple(i for ids in rank_chunks(stages, r, pp, chunks, vshape) for i in ids), holds_embedding(r),
                  holds_head(r, pp, vshape)) for r in range(pp))


@functools.lru_cache(maxsize=4096)
def chunk_layers(shape, pp: int, chunks: int, rank: int, partition: str = "even", first: int = 0,
                 last: int = 0, vshape: bool = False) -> tuple[int, ...]:
    """Blocks in each of rank's chunks (virtual stages c·pp + rank, or the V's), from the same split as its states."""
    stages = _split(shape, pp, partition, chunks, first, last)
    return tuple(len(ids) for ids in rank_chunks(stages, rank, pp, chunks, vshape))


@functools.lru_cache(maxsize=4096)
def block_counts(shape, stage) -> tuple[int, bool, bool, int]:
    """(blocks, holds the embedding, holds the head, how many of the blocks are dense) of a
    stage_layer_ids entry: an MoE model's leading dense blocks sit on the first stage."""
    ids, embed, head = stage
    if not shape.is_moe or not shape.dense_layers:
        return len(ids), embed, head, 0 if shape.is_moe else len(ids)
    return len(ids), embed, head, sum(i < shape.dense_layers for i in ids)


@functools.lru_cache(maxsize=4096)
def chunk_dense_layers(shape, pp: int, chunks: int, rank: int, partition: str = "even", first: int = 0,
                       last: int = 0, vshape: bool = False) -> tuple[int, ...]:
    """Dense blocks in each of rank's chunks (an MoE model's leading dense blocks; all of a dense model's)."""
    stages = _split(shape, pp, partition, chunks, first, last)
    return tuple(block_counts(shape, (ids, False, False))[3] for ids in rank_chunks(stages, rank, pp, chunks, vshape))


@functools.lru_cache(maxsize=1024)
def stage_blocks(shape, pp: int, partition: str = "even", chunks: int = 1, first: int = 0,
                 last: int = 0, vshape: bool = False) -> tuple[tuple[int, bool, bool, int], ...]:
    """(number of blocks, holds the embedding, holds the head, dense blocks) for each pipeline rank."""
    return tuple(block_counts(shape, s) for s in stage_layer_ids(shape, pp, partition, chunks, first, last, vshape))


def stage_params(shape, lay, blocks: tuple[int, bool, bool, int]) -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of a pipeline stage holding `blocks` (block_counts):
    expert parameters are what expert parallelism shards (experts / ep on each rank, then ZeRO over the
    dp·cp / ep ranks holding the same experts); everything else is dense, sharded by tp where its
    matrices are (norms, row-parallel biases, MLA's latents and the router are replicated)."""
    return _stage_params(shape, lay.tp, lay.ep, blocks)


@functools.lru_cache(maxsize=65536)  # by the two sizes it reads: a search repeats them across its layouts
def _stage_params(shape, tp: int, ep: int, blocks: tuple[int, bool, bool, int]) -> tuple[float, float]:
    h = shape.hidden
    n_layers, has_embed, has_head, n_dense = blocks
    common = shape.attn_params(tp) + 2 * shape.norm_params()
    dense = n_dense * (common + shape.mlp_params(tp))
    n_moe = n_layers - n_dense
    dense += n_moe * (common + shape.router_params() + shape.shared_params(tp))
    expert = n_moe * (shape.experts // ep) * shape.expert_params(tp) if n_moe else 0
    vocab_rows = padded_vocab(shape, tp) // tp
    if has_embed:
        dense += vocab_rows * h
    if has_head:
        dense += shape.norm_params()
        if not shape.tie_embeddings or not has_embed:
            dense += vocab_rows * h
    return dense, expert


def model_states(shape, lay, prec: Precision, blocks=None) -> dict:
    """{"params", "grads", "optim"} bytes of one rank of a stage holding `blocks` (the closed forms above)."""
    blocks = blocks or (shape.layers, True, True, shape.layers - shape.moe_layers)
    return dict(_model_states(shape, lay.tp, lay.ep, lay.dp * lay.cp, lay.zero, prec, blocks))


@functools.lru_cache(maxsize=65536)  # by the sizes it reads (a fresh dict each call: callers may add to it)
def _model_states(shape, tp: int, ep: int, n_dense: int, z: int, prec: Precision, blocks) -> tuple:
    dense, expert = _stage_params(shape, tp, ep, blocks)
    n_expert = max(1, n_dense // ep)

    def sharded(count, stage_needed, n):
        return count / n if z >= stage_needed else count

    def owner(bytes_per_param, stage_needed):
        return bytes_per_param * (sharded(dense, stage_needed, n_dense) + sharded(expert, stage_needed, n_expert))

    return (("params", owner(prec.param_bytes, 3)), ("grads", owner(prec.grad_bytes, 2)),
            ("optim", owner(prec.optim_bytes, 1)), ("param_count", dense + expert))


# -- the engine, element for element -----------------------------------------
def _buckets(named, cap_bytes: float, pad_to: int) -> list[tuple[list[int], int]]:
    """ultrascale.parallel.buckets.make_buckets on (name, numel) pairs: [(sizes, padded numel)]."""
    buckets, current, size = [], [], 0
    for _, n in reversed(named):
        if current and size + 4 * n > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(n)
        size += 4 * n
    if current:
        buckets.append(current)
    return [(b, -(-sum(b) // pad_to) * pad_to) for b in buckets]


def rank_params(shape, tp: int, stage=None) -> list[tuple[str, int]]:
    """(name, numel) of one rank in the engine's registration order; `stage` = (block ids,
    embedding, head) of its pipeline rank (None: the whole model)."""
    if stage is None:
        return shape.named_params(tp)
    ids, embed, head = stage
    full = shape.named_params(tp)
    out = [full[0]] if embed else []
    for i in ids:
        out += shape.block_params(i, tp)
    if head:
        out += [(n, k) for n, k in full if n.startswith("norm.") or n == "head.weight"]
    return out


def _zero3_units(shape, tp: int, world: int, stage) -> list[tuple[list[int], int]]:
    """ultrascale.parallel.zero3._units: one unit per block (last first), then the rest."""
    named = rank_params(shape, tp, stage)
    ids = stage[0] if stage is not None else range(shape.layers)
    units = [[n for _, n in shape.block_params(i, tp)] for i in reversed(ids)]
    in_blocks = {name for i in ids for name, _ in shape.block_params(i, tp)}
    rest = [n for name, n in named if name not in in_blocks]
    if rest:
        units.append(rest)
    return [(u, -(-sum(u) // world) * world) for u in units]


def _pieces(sizes: list[int], padded: int, rank: int, world: int) -> list[int]:
    """Sizes of the parameter pieces inside rank's shard [rank·padded/world, (rank+1)·padded/world)."""
    lo, hi = rank * padded // world, (rank + 1) * padded // world
    out, off = [], 0
    for n in sizes:
        start, end = max(lo, off), min(hi, off + n)
        if start < end:
            out.append(end - start)
        off += n
    return out


@functools.lru_cache(maxsize=4096)
def engine_states(shape, prec: Precision, dp: int, zero: int, bucket_mb: float, rank: int, tp: int = 1,
                  stage=None) -> dict:
    """What the engine's memory meter reports for data-parallel rank `rank` of a tensor-parallel rank
    holding pipeline `stage` (stage_layer_ids' entry; None: the whole model)."""
    named = rank_params(shape, tp, stage)
    psi = sum(n for _, n in named)
    b, mixed = prec.param_bytes, prec.param_bytes != 4
    if zero == 0:
        moments = 8 * sum(n for _, n in named if n > 1)  # AdamW's step counter (1 element) is bookkeeping
        return {"params": b * psi, "grads": 4 * psi, "optim": moments + (4 * psi if mixed else 0)}
    units = _zero3_units(shape, tp, dp, stage) if zero == 3 else _buckets(named, bucket_mb * 2**20, dp)
    params = grads = optim = 0
    for sizes, padded in units:
        pieces = _pieces(sizes, padded, rank, dp)
        params += b * (padded // dp if zero == 3 else padded)
        if pieces:  # a shard of pure padding holds no gradient view
            grads += 4 * (padded if zero == 1 else padded // dp)
        optim += sum(8 * n for n in pieces if n > 1) + (4 * sum(pieces) if mixed else 0)
    return {"params": params, "grads": grads, "optim": optim}
