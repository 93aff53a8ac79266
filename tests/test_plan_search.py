"""The planner's ranking: a top group as wide as the time model's own error, then predicted speed.

The time model is off by up to error_band() on the published runs (plan/published.py), so the
layouts predicted within that of the fastest are one group, ordered by memory headroom (as far as
the memory model's error lets it tell) and then simplicity; below the band, strictly by predicted
throughput, and no layout is called slower than one it cannot be told from.
"""

import dataclasses
import json
import re
from types import SimpleNamespace

import pytest

from ultrascale.plan import published
from ultrascale.plan.calibration import GIB, get_framework
from ultrascale.plan.hardware import get_cluster
from ultrascale.plan.layout import Layout, check_layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.search import Candidate, error_band, memory_error, rank, search
from ultrascale.plan.shape import get_shape
from ultrascale.plan.time import step_time
from ultrascale.plan.validate import GOALS, load_rows, validate

from plan_cli import cli


# -- the two errors ----------------------------------------------------------------------------

def test_the_band_is_the_largest_error_on_the_published_runs():
    # Each published run planned with its own framework and cluster, against its published figure.
    errors = {r.name: abs(published.predict(r, r.framework, r.cluster) / r.published - 1) for r in published.RUNS}
    assert error_band() == max(errors.values())
    assert error_band() <= published.TOLERANCE  # what tests/test_plan.py holds every run to
    # The defaults' column (Megatron's switches for a torchtitan run) is not the model's error on a
    # ranking, which compares layouts under one framework: taken, it would exceed the tolerance.
    defaults = max(abs(published.predict(r) / r.published - 1) for r in published.RUNS)
    assert defaults > published.TOLERANCE


def test_the_headroom_margin_is_the_memory_models_median_error():
    figures = validate(load_rows()[0])
    assert memory_error() == figures["median_memory_error"]
    assert 0 < memory_error() <= GOALS["median_memory_error"]


# -- the order, on candidates whose right order is known ------------------------------------------

CAPACITY = 80 * GIB
BAND, MEM_ERROR = 0.20, 0.10  # a layout is tight when its free memory is under 10% of its peak


def _cand(name, peak_gib, tps, **layout):
    c = Candidate(Layout(**layout), SimpleNamespace(peak=SimpleNamespace(total=peak_gib * GIB)),
                  SimpleNamespace(tokens_per_s_per_gpu=tps))
    c.name = name
    return c


def _synthetic():
    return [
        _cand("A", 60, 1000, pp=4, cp=2, zero=1),  # the fastest; model parallelism 8
        _cand("B", 50, 850, dp=8, zero=3, recompute="full"),
        _cand("C", 76, 990, dp=8, zero=1),  # 4 GiB free, under 10% of 76: tight
        _cand("D", 40, 810, dp=4, tp=2, zero=1),  # model parallelism 2
        _cand("E", 70, 805, dp=8, zero=2, recompute="selective"),  # 10 GiB free, over 7: enough
        _cand("F", 30, 790, dp=2, tp=4, zero=1),  # 21% below the fastest: outside the band
        _cand("G", 20, 795, tp=8),  # 20.5% below
        _cand("H", 78, 995, dp=8),  # 2 GiB free: tight, tighter than C
        _cand("I", 50, 860, dp=8, zero=3, recompute="full"),  # B's twin, faster
    ]


# Worked out by hand. In the band (>= 800): enough headroom first - E (model parallelism 1, selective
# recomputation), I and B (1, full; I the faster), D (2), A (8) - then the tight ones, more free memory
# first: C (4 GiB), H (2 GiB). Below the band by predicted speed: G (795), F (790).
EXPECTED = ["E", "I", "B", "D", "A", "C", "H", "G", "F"]


def _names(cands):
    return [c.name for c in cands]


def test_the_top_group_is_ordered_by_headroom_then_simplicity():
    ranked = rank(_synthetic(), CAPACITY, BAND, MEM_ERROR)
    assert _names(ranked) == EXPECTED
    assert [c.top_group for c in ranked] == [True] * 7 + [False] * 2
    slower = {c.name: c.slower for c in ranked}
    assert slower["A"] == 0 and slower["G"] == pytest.approx(0.205) and slower["F"] == pytest.approx(0.21)
    assert min(slower.values()) >= 0


def _by_time_only(cands):
    return sorted(cands, key=lambda c: -c.time.tokens_per_s_per_gpu)


def _most_free_first(cands):
    """Headroom read to the byte: every GiB of free memory outranks simplicity and speed."""
    fastest = max(c.time.tokens_per_s_per_gpu for c in cands)
    inside = [c for c in cands if c.time.tokens_per_s_per_gpu >= fastest * (1 - BAND)]
    return sorted(inside, key=lambda c: c.memory.peak.total) + _by_time_only([c for c in cands if c not in inside])


@pytest.mark.parametrize("wrong", [
    _by_time_only,
    lambda cands: rank(cands, CAPACITY, 0.01, MEM_ERROR),  # the former 1% tie
    lambda cands: rank(cands, CAPACITY, BAND, 0.0),  # no margin: the tight C and H lead on speed
    _most_free_first,
], ids=["time only", "1% band", "no headroom margin", "most free memory first"])
def test_wrong_orders_fail_the_expected_one(wrong):
    assert _names(wrong(_synthetic())) != EXPECTED


# -- real searches -----------------------------------------------------------------------------

def _plan_json(capsys, *args):
    code, out, err = cli(capsys, "plan", *args, "--json", "--top", "1000000")
    assert code == 0, err
    res = json.loads(out)
    assert len(res["candidates"]) == res["fitting"] > 1
    return res


def _ranking_problems(res) -> list[str]:
    """What is wrong with a `plan --json` ranking: the group first and within the band of the fastest,
    the rest beyond it and never faster than a row above, the shortfall never negative."""
    cands, band, n = res["candidates"], res["error_band"], res["top_group"]
    tps = [c["time"]["tokens_per_s_per_gpu"] for c in cands]
    fastest = max(tps)
    problems = []
    if res["fastest"]["time"]["tokens_per_s_per_gpu"] != fastest:
        problems.append("the fastest is not the fastest")
    if [c["rank"]["top_group"] for c in cands] != [True] * n + [False] * (len(cands) - n):
        problems.append("the top group is not the head of the ranking")
    for i, (c, t) in enumerate(zip(cands, tps), 1):
        slower = c["rank"]["slower_than_fastest"]
        if slower < 0 or abs(slower - (1 - t / fastest)) > 1e-12:
            problems.append(f"#{i}: slower {slower} for {t} against {fastest}")
        if (1 - t / fastest <= band) != c["rank"]["top_group"]:
            problems.append(f"#{i}: in the group is not within the band")
    problems += [f"#{n + i + 2} faster than #{n + i + 1}" for i, (a, b) in enumerate(zip(tps[n:], tps[n + 1:]))
                 if b > a]
    return problems


def _former_order(res) -> list[float]:
    """The former ranking (fastest first; runs within 1% of their head, simplest first), as throughputs."""
    cands = sorted(res["candidates"], key=lambda c: -c["time"]["tokens_per_s_per_gpu"])
    out, i = [], 0
    while i < len(cands):
        head, j = cands[i]["time"]["tokens_per_s_per_gpu"], i
        while j < len(cands) and cands[j]["time"]["tokens_per_s_per_gpu"] >= head * 0.99:
            j += 1
        lay = lambda c: c["layout"]  # noqa: E731
        out += sorted(cands[i:j], key=lambda c: (lay(c)["cp"], lay(c)["pp"], lay(c)["tp"], lay(c)["ep"],
                                                 lay(c)["chunks"], lay(c)["zero"],
                                                 ("none", "selective", "full").index(lay(c)["recompute"]),
                                                 -c["time"]["tokens_per_s_per_gpu"]))
        i = j
    return [c["time"]["tokens_per_s_per_gpu"] for c in out]


def test_a_real_ranking_is_monotone_below_the_band(capsys):
    res = _plan_json(capsys, "--model", "llama3-70b", "--gpus", "64", "--seq-len", "8192", "--tp", "4")
    assert 1 < res["top_group"] < res["fitting"], "a group and rows below it"
    assert _ranking_problems(res) == []
    # The former order put below #1 a layout predicted faster than #1 (zero bubble at 1,095 tokens/s/GPU,
    # then interleaved v5 at 1,096): its "slower" figure was negative.
    former = _former_order(res)
    assert any(t > former[0] for t in former[1:])
    # Put into this file's checker (as if all were below the band), it is flagged.
    assert _ranking_problems({**res, "top_group": 0, "candidates": sorted(
        res["candidates"], key=lambda c: former.index(c["time"]["tokens_per_s_per_gpu"]))})


ROW = re.compile(r"^\s*(\d+)  (.+?)\s+([\d.]+) GiB\s+(-?[\d.]+) GiB\s+([\d.]+)s\s+([\d,]+)\s+([\d.]+)%\s+(\S+)$")
SEARCHES = [  # several models and GPU counts; pinned where a full search would take seconds
    ("llama3-8b", "--gpus", "8"),
    ("llama3-8b", "--gpus", "16", "--global-batch-tokens", "524288"),
    ("llama3-70b", "--gpus", "64", "--seq-len", "8192", "--pp", "8", "--cp", "1"),
    ("llama3-70b", "--gpus", "256", "--seq-len", "8192", "--global-batch", "512", "--tp", "8", "--zero", "1"),
    ("gpt3-175b", "--gpus", "992", "--gpu", "a100-80gb", "--seq-len", "2048", "--global-batch", "1024", "--tp", "8"),
    ("tiny", "--gpus", "1", "--seq-len", "32", "--global-batch-tokens", "256", "--recompute", "none", "--zero", "0"),
]


@pytest.mark.parametrize("args", SEARCHES, ids=[" ".join(a[:3]) for a in SEARCHES])
def test_no_layout_is_called_slower_than_one_it_cannot_be_told_from(capsys, args):
    code, out, err = cli(capsys, "plan", "--model", *args, "--top", "1000000")
    assert code == 0, err
    band = 100 * error_band()
    head = re.search(r"Top group: (\d+) layouts within ±([\d.]+)% of the fastest: the time model cannot order "
                     r"these; those with enough memory headroom first, all alike, then the tighter ones, roomier first; then simplicity", out)
    alone = re.search(r"Top group: the fastest alone, no other layout is within ±([\d.]+)%", out)
    assert head or alone, out[:2000]
    group = int(head.group(1)) if head else 1
    assert float((head or alone).groups()[-1]) == round(band, 1)
    rows = [m for m in map(ROW.match, out.splitlines()) if m]
    assert len(rows) > group, "rows below the band too"
    for m in rows:
        slower = m.group(8)
        if int(m.group(1)) <= group:
            assert slower == "-", m.group(0)
        else:
            assert slower.endswith("%") and float(slower[:-1]) >= round(band, 1), m.group(0)
    assert not re.search(r"-\d+(\.\d+)?% slower", out)
    for line in out.splitlines():  # the explanation: "slower" only beyond the band
        for figure in re.findall(r"([\d.]+)% slower", line):
            assert float(figure) >= round(band, 1), line
        if "within the time model's error" in line:
            assert "slower" not in line, line
    if group == 1:
        assert "   Next: " in out and "Why it is first: the fastest predicted" in out
    else:
        assert "   Why it is first: the time model cannot order the" in out and "   Next: " not in out


# -- the layouts of published runs ---------------------------------------------------------------

def _run(name):
    return next(r for r in published.RUNS if r.name == name)


def _scaled(run, **layout):
    return dataclasses.replace(run, name=run.name + " (scaled)", layout={**run.layout, **layout})


# (run, pins of the search, what may keep its layout out of the top group)
# - Llama 3.1 8B, FSDP on 8 H100, seq 8192, local batch 2, selective AC (torchtitan Table 1, 77.0 GiB
#   measured): in the top group (torchtitan's op-level selective checkpointing: 82 GiB of 93.6).
# - Llama 3.1 70B, FSDP + TP 8, local batch 16, full AC, float8 (torchtitan Table 4 on 256 H100; and
#   the same per-replica layout on 64 H100, dp 8): full recomputation costs a forward pass more (a
#   third more compute), 24% below the fastest at 256 (beyond the band); without it 5% below. At 64,
#   also 2 GiB over the memory model's 93.6 GiB. Searched with the runs' ZeRO-3 (FSDP) pinned.
# - Llama 3 405B on 16,384 H100, tp 8 pp 16 dp 128, interleaved (Llama 3 paper, Table 4), as
#   plan/published.py reads it (ZeRO-1): 98 GiB of 79.2; by time alone 14% below the fastest, inside
#   the band. The search is pinned to ZeRO-1, no recomputation and micro-batch 1 (a full search takes
#   half a minute: docs/planner.md).
PUBLISHED = [
    (_run("torchtitan Llama 3.1 8B FSDP on 8 H100"), {}, set()),
    (_scaled(_run("torchtitan Llama 3.1 70B FSDP+TP float8 on 256 H100"), dp=8), {"zero": 3},
     {"memory", "recomputation"}),
    (_run("torchtitan Llama 3.1 70B FSDP+TP float8 on 256 H100"), {"zero": 3}, {"memory", "recomputation"}),
    (_run("Llama 3 405B on 16,384 H100"), {"zero": 1, "recompute": "none", "micro_batch": 1}, {"memory"}),
]


def published_verdict(run, fixed) -> tuple[set, str]:
    """Where the search puts a published run's layout: {"top group"}, or why it is not there -
    "memory" (the memory model says it does not fit), "recomputation" (below the band by its
    recomputation alone), "time" (below the band otherwise) - and the figures."""
    shape, gpu = get_shape(run.model), get_cluster(run.cluster)
    fw = dataclasses.replace(get_framework(run.framework), partition="even", **run.switches)  # as `plan` does
    lay = Layout(**run.layout)
    check_layout(lay, shape)
    gpus = lay.dp * lay.tp * lay.pp * lay.cp
    result = search(shape, gpus, gpu, fw, lay.seq_len, lay.global_batch * lay.seq_len, lay.precision, fixed)
    fastest = result.fastest.time.tokens_per_s_per_gpu
    found = next((c for c in result.ranked if c.layout == lay), None)
    if found is not None and found.top_group:
        return {"top group"}, f"{run.name}: in the top group ({len(result.top_group)} layouts)"
    why, peak = set(), memory_plan(shape, lay, fw).peak.total
    if found is None:
        assert peak > gpu.memory_bytes, "a valid layout that fits is ranked"
        why.add("memory")
    below = 1 - step_time(shape, lay, gpu, fw).tokens_per_s_per_gpu / fastest
    plain = 1 - step_time(shape, dataclasses.replace(lay, recompute="none"), gpu, fw).tokens_per_s_per_gpu / fastest
    if below > result.band:
        why.add("recomputation" if lay.recompute != "none" and plain <= result.band else "time")
    return why, (f"{run.name}: {peak / GIB:.1f} GiB of {gpu.memory_bytes / GIB:.1f}; {100 * below:.1f}% below the "
                 f"fastest ({100 * plain:.1f}% without recomputation), band ±{100 * result.band:.1f}%")


@pytest.mark.parametrize("run,fixed,allowed", PUBLISHED, ids=[r.name for r, _, _ in PUBLISHED])
def test_a_published_layout_is_in_the_top_group_or_loses_for_a_stated_reason(run, fixed, allowed):
    why, figures = published_verdict(run, fixed)
    assert why == {"top group"} or (why and why <= allowed), (why, figures)
