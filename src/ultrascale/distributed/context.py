"""The named grid every technique is placed on: dp x pp x cp x tp, plus experts.

Ranks are laid out as `arange(world).reshape(dp, pp, cp, tp)`: tp is innermost,
so a tensor-parallel group is made of consecutive ranks (on one node, on NVLink,
where its per-layer collectives need the bandwidth); dp is outermost, since its
one reduction per step tolerates the slowest links.

Expert parallelism is carved out of data parallelism (as in Megatron): the dp
ranks of one (pp, cp, tp) coordinate form dp/ep expert groups of ep consecutive
dp indices; ranks holding the same experts form the expert-data-parallel group.

Every process builds every group, in the same order, as torch.distributed requires;
a technique asks the context for its group and never reads the environment.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ultrascale.config import ParallelConfig
from ultrascale.errors import ConfigError

DIMS = ("dp", "pp", "cp", "tp")
# Groups made of several dims, named by joining them: gradients are averaged over
# dp and cp together (both see different tokens of the same weights).
COMBINED = ("dp_cp",)


@dataclass
class ParallelContext:
    layout: ParallelConfig
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    coords: dict = field(default_factory=dict)
    group_ranks: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)

    # -- the grid -----------------------------------------------------------
    def size(self, name: str) -> int:
        return len(self.group_ranks[name])

    def index(self, name: str) -> int:
        """This rank's position within its `name` group."""
        return self.group_ranks[name].index(self.rank)

    def group(self, name: str):
        """The process group for `name`, or None when it holds this rank alone."""
        return self.groups.get(name)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints: the last pipeline stage (it has the loss) of the first dp/cp/tp rank."""
        return all(self.coords[d] == 0 for d in ("dp", "cp", "tp")) and self.coords["pp"] == self.layout.pp - 1

    def pp_neighbours(self) -> tuple[int | None, int | None]:
        """Global ranks of the previous and next pipeline stage (None at the ends)."""
        ranks, i = self.group_ranks["pp"], self.index("pp")
        return (ranks[i - 1] if i > 0 else None, ranks[i + 1] if i + 1 < len(ranks) else None)

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def all_reduce_mean(self, value: float, name: str = "dp_cp") -> float:
        """Average a Python scalar over a group (for logging, not for gradients)."""
        g = self.group(name)
        if g is None:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device if self.backend == "nccl" else "cpu")
        dist.all_reduce(t, group=g)
        return t.item() / self.size(name)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def grid_groups(layout: ParallelConfig, world_size: int) -> dict[str, list[list[int]]]:
    """Every group of every named dimension, as lists of global ranks.

    >>> grid_groups(ParallelConfig(dp=2, tp=2), 4)["tp"]
    [[0, 1], [2, 3]]
    """
    sizes = [layout.dp, layout.pp, layout.cp, layout.tp]
    grid = torch.arange(world_size).reshape(sizes)
    out = {}
    for name in DIMS + COMBINED:
        dims = [DIMS.index(d) for d in name.split("_")]
        rest = [i for i in range(4) if i not in dims]
        # Move the group's dims last, then every row of the flattened rest is one group.
        rows = grid.permute(rest + dims).reshape(-1, int(torch.tensor([sizes[d] for d in dims]).prod()))
        out[name] = [r.tolist() for r in rows]
    # Experts: blocks of ep consecutive dp indices (for one pp, cp, tp), and across blocks.
    ep = layout.ep
    out["ep"] = [g[i:i + ep] for g in out["dp"] for i in range(0, len(g), ep)]
    out["edp"] = [g[i::ep] for g in out["dp"] for i in range(ep)]
    return out


def _coords(layout: ParallelConfig, rank: int) -> dict:
    sizes = [layout.dp, layout.pp, layout.cp, layout.tp]
    coords, rem = {}, rank
    for name, size in reversed(list(zip(DIMS, sizes))):
        coords[name] = rem % size
        rem //= size
    return coords


def device_of(pref: str, local_rank: int = 0) -> torch.device:
    """The device `--device pref` names for this local rank (auto: CUDA where it is visible)."""
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_device(pref: str, local_rank: int) -> torch.device:
    """device_of, made current: refused when CUDA is asked for and none is visible."""
    dev = device_of(pref, local_rank)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
        torch.cuda.set_device(local_rank)
    return dev


def init_parallel(layout: ParallelConfig, device: str = "auto", timeout_s: float = 300) -> ParallelContext:
    """Join (or start) the process group from torchrun's environment and build the grid.

    Without WORLD_SIZE in the environment this is a single process and no process
    group is created. With it (torchrun, or `ultrascale train --nproc N`), the
    backend is NCCL on CUDA and gloo on the CPU. `timeout_s` bounds every
    collective of every group (the world and each grid group): past it, a rank
    waiting on one that hung raises instead of waiting forever.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    layout = layout.resolve(world)
    dev = resolve_device(device, local_rank)
    backend = None
    if world > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                    device_id=dev if dev.type == "cuda" else None)
    return build_context(layout, rank, world, local_rank, dev, backend, timeout_s=timeout_s)


def build_context(layout, rank, world, local_rank=0, device=torch.device("cpu"), backend=None,
                  timeout_s: float | None = None) -> ParallelContext:
    """The context over an already initialised default process group (or a single process).

    Each group is created with the given timeout (None: torch's default, 30 minutes)
    and its grid name as description (in error reports and NCCL's flight recorder).
    """
    layout = layout.resolve(world)
    all_groups = grid_groups(layout, world)
    ctx = ParallelContext(layout=layout, rank=rank, world_size=world, local_rank=local_rank,
                          device=device, backend=backend, coords=_coords(layout, rank))
    options = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    for name, groups in all_groups.items():
        for ranks in groups:
            # Every rank takes part in creating every group (a torch.distributed rule),
            # but only groups of more than one rank are worth a communicator.
            pg = dist.new_group(ranks, **options, group_desc=name) if world > 1 and len(ranks) > 1 else None
            if rank in ranks:
                ctx.group_ranks[name] = ranks
                if pg is not None:
                    ctx.groups[name] = pg
    return ctx


def all_layouts(world_size: int):
    """Every (dp, pp, cp, tp) whose product is world_size: handy for parametrised tests."""
    for tp, pp, cp in itertools.product(range(1, world_size + 1), repeat=3):
        if world_size % (tp * pp * cp) == 0:
            yield ParallelConfig(dp=world_size // (tp * pp * cp), tp=tp, pp=pp, cp=cp)
