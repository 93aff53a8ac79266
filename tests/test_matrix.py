"""Every pair of feature values, against one process or refused (ultrascale/testing/matrix.py).

The cells are generated, not listed: each allowed pair of values of two factors (dtype,
dense or MoE, dp, tp, sp, the cp variant, the pp schedule, ep, the ZeRO stage, offload,
recomputation, compile, resume) is in some cell, and so is every triple of dtype x one
value of a parallel factor x resume. Each cell is a unit on pooled ranks; the refused
pairs are refused by the engine's own validation in one line, and docs/engine.md's
table of them is the generator's output.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from ultrascale.testing import matrix as M
from ultrascale.train.startup import check_run

pytestmark = pytest.mark.long  # the covering set: a hundred-odd cells of 1-35 s

SPACE = M.space()
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "engine.md")


@pytest.mark.parametrize("cell", SPACE.cells, ids=[M.name(c) for c in SPACE.cells])
def test_cell_equals_one_process(cell):
    comparison, problems = M.check_cell(cell)
    assert not problems, (comparison.line() if comparison else M.name(cell)) + "\n  fails: " + "; ".join(problems)


@pytest.mark.parametrize("pair,cell,line", SPACE.refused, ids=[f"{a[0]}={a[1]}+{b[0]}={b[1]}" for (a, b), _, _ in
                                                               SPACE.refused])
def test_refused_pair_is_one_line_before_the_run(pair, cell, line):
    from ultrascale.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        check_run(M.config(cell, tempfile.gettempdir()), M.world(cell))
    assert "\n" not in str(e.value) and str(e.value) == line


def test_every_allowed_pair_and_triple_is_in_a_cell():
    """The generator's own promise, checked from the outside: every pair of values is in a cell
    that runs, or refused by the engine, or needs more than MAX_WORLD ranks; so is every triple."""
    refused = {pair for pair, _, _ in SPACE.refused}
    outside = set(SPACE.outside)
    missing = []
    for tup in list(M._pairs()) + M.required_triples():
        if tup in refused or tup in outside:
            continue
        if not any(all(c[f] == v for f, v in tup) for c in SPACE.cells):
            if len(tup) == 3 and any(p in refused for p in ((tup[0], tup[1]), (tup[1], tup[2]), (tup[0], tup[2]))):
                continue  # holds a refused pair
            missing.append(tup)
    assert not missing, missing[:5]
    # Outside the pool means three axes at 2, not a refusal in disguise.
    assert all(M._minimal(t) is None for t in SPACE.outside)
    for c in SPACE.cells:
        assert M.world(c) <= M.MAX_WORLD and M.verdict(c) is None


def test_the_docs_list_the_refused_pairs_from_the_code():
    text = open(DOCS).read()
    assert M.refused_table() in text, "docs/engine.md is stale: run python -m ultrascale.testing.matrix --docs " \
                                      "docs/engine.md"


@pytest.mark.parametrize("fault", sorted(M.FAULT_CELLS))
def test_the_matrix_catches_each_bug_it_was_built_for(fault):
    """Each of these faults puts back a bug found where two features meet; some cell of the
    covering set must fail with it (the cheapest first; the first that fails ends the search)."""
    cells = sorted((c for c in SPACE.cells if M.FAULT_CELLS[fault](c)), key=M.cost)
    assert cells, f"no cell of the covering set can show {fault}"
    tried = []
    for cell in cells:
        _, problems = M.check_cell(cell, fault=fault)
        if problems:
            return
        tried.append(M.name(cell))
    pytest.fail(f"{fault} passed every cell that could show it: {tried}")
