"""Which blocks each pipeline rank and chunk holds: the one rule the engine and the planner share.

Torch-free on purpose: the planner (ultrascale.plan) imports it to count the
states and activations of each stage, and the engine (stage.keep_stages and the
pipeline runtime) uses it to cut the model, so the planner's per-stage figures
are the engine's by construction.

The model's L blocks are cut, in order, into p·v virtual stages; pipeline rank
r holds virtual stages c·p + r (chunk c = 0..v-1). The embedding rides with
virtual stage 0, the final norm, head and loss with virtual stage p·v - 1.
DualPipeV places its two chunks in a V instead: rank r holds stages r and
2p - 1 - r, so activations run down the ranks and back up, the turn at the
bottom is a hand-off inside rank p - 1, and rank 0 holds both the embedding and
the head.

  even (default)  L over p·v virtual stages, the first L mod (p·v) taking one
                  block more. With `first` / `last` given (Megatron's
                  --decoder-first/last-pipeline-num-layers), virtual stage 0
                  holds `first` blocks, the last one `last` blocks, and the
                  rest are spread evenly over the stages between, as above.
                  Fewer blocks there make room for the embedding, and for the
                  head and the loss's logits, which are large at big vocabularies.
  compute         nanotron's rule, for its runs (the playbook's benchmarks):
                  the embedding (cost 0), the blocks (4·a·d·h + 3·f·h each)
                  and the head (V·h) in order, each virtual stage taking items
                  until the running cost exceeds (stage + 1)/(p·v) of the
                  total, so the stage that crosses a boundary keeps the block.
"""

from __future__ import annotations

import functools

PARTITIONS = ("even", "compute")


class PartitionError(ValueError):
    """A split that cannot be made; its message is one line, for the user."""


def _spread(n: int, stages: int) -> list[int]:
    base, extra = divmod(n, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def even_sizes(n_layers: int, stages: int, first: int = 0, last: int = 0) -> list[int]:
    """Blocks per virtual stage. first / last: blocks of the first / last virtual stage (0: even split)."""
    if not first and not last:
        return _spread(n_layers, stages)
    if stages == 1:
        raise PartitionError("--pp-first-stage-layers / --pp-last-stage-layers need more than one pipeline stage")
    middle = stages - 2
    head = first if first else None
    tail = last if last else None
    # A stage left unpinned shares the rest with the middle stages.
    free = middle + (head is None) + (tail is None)
    rest = n_layers - (head or 0) - (tail or 0)
    if rest < free or (free == 0 and rest != 0):
        raise PartitionError(f"{n_layers} layers cannot give the first stage {first or 'its share'} and the last "
                             f"{last or 'its share'} with at least one block on each of the other {free} stages")
    spread = _spread(rest, free) if free else []
    out = ([head] if head is not None else [spread.pop(0)])
    tail_size = tail if tail is not None else spread.pop()
    return out + spread + [tail_size]


def compute_sizes(n_layers: int, stages: int, block_cost: float, head_cost: float) -> list[int]:
    """nanotron's cumulative-cost split (module docstring): blocks per virtual stage."""
    costs = [0.0] + [block_cost] * n_layers + [head_cost]
    total = sum(costs)
    sizes = [0] * stages
    stage, cumulative = 0, 0.0
    for i, c in enumerate(costs):
        cumulative += c
        stage = min(stage, stages - 1)
        if 0 < i < len(costs) - 1:
            sizes[stage] += 1
        if cumulative > total * (stage + 1) / stages:
            stage += 1
    return sizes


@functools.lru_cache(maxsize=1024)
def split(n_layers: int, p: int, v: int = 1, first: int = 0, last: int = 0, rule: str = "even",
          block_cost: float = 1.0, head_cost: float = 0.0) -> tuple[tuple[int, ...], ...]:
    """Block ids of each virtual stage 0..p·v-1, in order."""
    stages = p * v
    if rule == "even":
        sizes = even_sizes(n_layers, stages, first, last)
    elif rule == "compute":
        if first or last:
            raise PartitionError("--pp-first-stage-layers / --pp-last-stage-layers apply to the even split")
        sizes = compute_sizes(n_layers, stages, block_cost, head_cost)
    else:
        raise PartitionError(f"--partition must be one of {', '.join(PARTITIONS)}, got {rule!r}")
    out, start = [], 0
    for size in sizes:
        out.append(tuple(range(start, start + size)))
        start += size
    return tuple(out)


def v_shaped(schedule: str) -> bool:
    """Whether the schedule places its two chunks per rank in a V (DualPipeV) rather than in a loop."""
    return schedule == "dualpipev"


def virtual_stages(rank: int, p: int, v: int, vshape: bool = False) -> list[int]:
    """Virtual stages held by pipeline rank `rank`: chunk c is stage c·p + rank (a loop),
    or, in a V, stage rank (going down) and 2p - 1 - rank (coming back up)."""
    if vshape:
        return [rank, 2 * p - 1 - rank]
    return [c * p + rank for c in range(v)]


def rank_of_stage(stage: int, p: int, vshape: bool = False) -> int:
    """The pipeline rank that holds a virtual stage (inverse of virtual_stages)."""
    return 2 * p - 1 - stage if vshape and stage >= p else stage % p


def rank_chunks(stages, rank: int, p: int, v: int, vshape: bool = False) -> list[tuple[int, ...]]:
    """Block ids of each of rank's chunks, chunk 0 first."""
    return [stages[s] for s in virtual_stages(rank, p, v, vshape)]


def holds_embedding(rank: int) -> bool:
    return rank == 0


def holds_head(rank: int, p: int, vshape: bool = False) -> bool:
    return rank == (0 if vshape else p - 1)
