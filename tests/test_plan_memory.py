"""The memory model against published per-GPU memory (plan/published_memory.py, each row with its
source): every figure within TOLERANCE with the run's own framework, no trained layout refused; and
each framework fact the model reads shown to matter (without it, the rows it explains fall out)."""

import dataclasses

import pytest

from ultrascale.plan import published_memory as pm
from ultrascale.plan.calibration import FRAMEWORKS

MEASURED = [r for r in pm.RUNS if r.kind != "fits"]


@pytest.mark.parametrize("run", MEASURED, ids=[r.name for r in MEASURED])
def test_each_published_memory_figure_is_planned_within_tolerance(run):
    got, card = pm.plan_gib(run)
    ratio = got / run.published_gib
    if run.name in pm.OUTSIDE:  # known and explained: still outside, else the list is stale
        assert abs(ratio - 1) > pm.TOLERANCE, f"{run.name} is now within the band: take it off OUTSIDE"
    else:
        assert abs(ratio - 1) <= pm.TOLERANCE, (run.name, round(got, 1), run.published_gib, run.source)
    assert run.published_gib <= card  # the figure was read on that card


@pytest.mark.parametrize("run", [r for r in pm.RUNS if r.kind == "fits"], ids=lambda r: r.name)
def test_a_layout_that_trained_is_not_refused(run):
    needed, card = pm.plan_gib(run)
    assert needed <= card, (run.name, round(needed, 1), card, run.source)


def test_the_fit_is_not_a_generous_model():
    # Llama 3 405B's layout with ZeRO-1 (fp32 gradients unsharded on every rank) is refused.
    run = next(r for r in pm.RUNS if r.model == "llama3-405b" and r.kind == "fits")
    needed, card = pm.plan_gib(dataclasses.replace(run, layout={**run.layout, "zero": 1}))
    assert needed > card


def _ratios(monkeypatch, framework, **facts):
    monkeypatch.setitem(FRAMEWORKS, framework, dataclasses.replace(FRAMEWORKS[framework], **facts))
    return {r.name: pm.plan_gib(r)[0] / (r.published_gib or pm.plan_gib(r)[1]) for r in pm.RUNS}


def test_the_framework_facts_are_what_brings_the_rows_in(monkeypatch):
    # torchtitan's op-level selective checkpointing, read as Megatron's (all but the attention core):
    # the 8B FSDP rows come out 60-120% over.
    op_as_megatron = _ratios(monkeypatch, "torchtitan", selective="attention")
    assert all(op_as_megatron[r.name] > 1.5 for r in MEASURED if r.layout.get("recompute") == "selective")
    monkeypatch.undo()
    # FSDP resharding inside the pipeline as it does outside: the 405B 3D rows come out 25-50% under.
    resharded = _ratios(monkeypatch, "torchtitan", zero3_reshards_in_pipeline=True)
    assert all(resharded[r.name] < 1 - pm.TOLERANCE for r in MEASURED if r.model == "llama3-405b")
    monkeypatch.undo()


def test_dropout_is_the_models_not_the_frameworks():
    # Megatron's framework runs dropout where the model has it: GPT-3's block keeps its 1-byte masks,
    # Llama's block (no dropout) keeps none; the Llama 3 405B layer was 6% heavier when it did.
    from ultrascale.plan import activations as act
    from ultrascale.plan.layout import Layout
    from ultrascale.plan.memory import activation_spec
    from ultrascale.plan.shape import get_shape

    lay, megatron = Layout(tp=8, seq_len=8192), FRAMEWORKS["megatron"]
    masks = {name: [t for t, _, _ in act.layer_terms(get_shape(name), activation_spec(lay, megatron, get_shape(name)))
                    if "dropout" in t] for name in ("gpt3-175b", "llama3-405b")}
    assert masks["gpt3-175b"] and not masks["llama3-405b"], masks
    llama = get_shape("llama3-405b")
    with_masks = act.layer_bytes(llama, dataclasses.replace(activation_spec(lay, megatron, llama), dropout=True), 8192)
    without = act.layer_bytes(llama, activation_spec(lay, megatron, llama), 8192)
    assert 1.05 < with_masks / without < 1.08


def test_the_memory_table_cites_every_row():
    rows = pm.table()
    assert len(rows) == len(pm.RUNS) and all(r["source"] for r in rows)
    assert {r["kind"] for r in rows} == {"reserved", "allocated", "fits"}


def test_zero_bubble_holds_the_output_gradients_of_its_deferred_weight_passes():
    # ZB-H1 defers each W (weight gradients) into the cool-down: stage i holds p - 1 - i of them, each
    # needing the gradient of every linear's output for every token of its micro-batch:
    # q (h), k and v (kv each), o (h), gate and up (f each), down (h). The last stage defers none.
    from ultrascale.plan.calibration import get_framework
    from ultrascale.plan.layout import Layout, check_layout
    from ultrascale.plan.memory import memory_plan
    from ultrascale.plan.shape import get_shape

    shape, fw, p, m, seq = get_shape("llama3-8b"), get_framework("megatron"), 4, 8, 4096
    plans = {}
    for schedule in ("1f1b", "zero-bubble"):
        lay = Layout(pp=p, grad_accum=m, seq_len=seq, schedule=schedule)
        check_layout(lay, shape)
        plans[schedule] = memory_plan(shape, lay, fw)
    h, kv, f = shape.hidden, shape.kv_heads * shape.hidden // shape.heads, shape.ffn_hidden
    per_token = 2 * (h + kv + kv + h + f + f + h)  # bf16
    for stage in range(p):
        extra = (plans["zero-bubble"].stages[stage].terms["transient"]
                 - plans["1f1b"].stages[stage].terms["transient"])
        layers = plans["1f1b"].stages[stage].layers
        assert extra == pytest.approx((p - 1 - stage) * layers * seq * per_token, rel=1e-9), stage
