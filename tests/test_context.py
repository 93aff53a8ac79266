"""The named grid: which ranks share which group, on real processes."""

import pytest
import torch
import torch.distributed as dist

from ultrascale.config import ConfigError, ParallelConfig
from ultrascale.distributed.context import all_layouts, grid_groups
from ultrascale.testing.harness import run_distributed, worker_context


def test_tp_is_innermost_and_dp_outermost():
    g = grid_groups(ParallelConfig(dp=2, pp=2, cp=1, tp=2), 8)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["cp"] == [[r] for r in range(8)]


def test_every_dimension_partitions_the_world():
    for layout in all_layouts(12):
        groups = grid_groups(layout, 12)
        for name in ("dp", "pp", "cp", "tp", "dp_cp"):
            flat = sorted(r for grp in groups[name] for r in grp)
            assert flat == list(range(12)), (layout, name)
            size = {"dp": layout.dp, "pp": layout.pp, "cp": layout.cp, "tp": layout.tp,
                    "dp_cp": layout.dp * layout.cp}[name]
            assert all(len(grp) == size for grp in groups[name])


def test_dp_cp_combines_both():
    g = grid_groups(ParallelConfig(dp=2, cp=2, tp=2), 8)
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_expert_groups_are_carved_from_dp():
    g = grid_groups(ParallelConfig(dp=4, ep=2), 4)
    assert g["ep"] == [[0, 1], [2, 3]]
    assert g["edp"] == [[0, 2], [1, 3]]


@pytest.mark.parametrize("layout,error", [
    (ParallelConfig(dp=3, tp=2), "make the product equal"),
    (ParallelConfig(tp=3), "not divisible"),
    (ParallelConfig(dp=4, ep=3), "must divide dp"),
    (ParallelConfig(tp=0), "positive"),
])
def test_sizes_that_do_not_fit_the_world(layout, error):
    with pytest.raises(ConfigError, match=error):
        layout.resolve(4)


def _describe(layout):
    ctx = worker_context(layout)
    out = {"coords": ctx.coords, "neighbours": ctx.pp_neighbours()}
    for name in ("dp", "tp", "pp"):
        # Sum the global ranks over each group: proves the communicator holds exactly those ranks.
        t = torch.tensor([float(dist.get_rank())])
        if ctx.group(name) is not None:
            dist.all_reduce(t, group=ctx.group(name))
        out[name] = (ctx.group_ranks[name], t.item())
    return out


def test_context_groups_on_four_processes():
    per_rank = run_distributed(4, _describe, ParallelConfig(dp=2, tp=2))
    for rank, d in enumerate(per_rank):
        assert d["coords"] == {"dp": rank // 2, "pp": 0, "cp": 0, "tp": rank % 2}
        tp_ranks, tp_sum = d["tp"]
        assert tp_ranks == [rank - rank % 2, rank - rank % 2 + 1] and tp_sum == sum(tp_ranks)
        dp_ranks, dp_sum = d["dp"]
        assert dp_ranks == [rank % 2, rank % 2 + 2] and dp_sum == sum(dp_ranks)
        assert d["neighbours"] == (None, None)


def test_pipeline_neighbours():
    per_rank = run_distributed(4, _describe, ParallelConfig(pp=4))
    assert [d["neighbours"] for d in per_rank] == [(None, 1), (0, 2), (1, 3), (2, None)]
