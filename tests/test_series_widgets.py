"""The course's two interactive figures (series/widgets.py): their callbacks, called as the controls
call them, against the planner and the simulator called directly; and the static figure they show
where no widget front-end runs."""

import ipywidgets
import pytest

from ultrascale.parallel.pipeline.partition import v_shaped
from ultrascale.parallel.pipeline.schedules import chunks_of, schedule
from ultrascale.parallel.pipeline.simulate import simulate
from ultrascale.plan.bubble import bubble_fraction
from ultrascale.plan.calibration import GIB, get_framework
from ultrascale.plan.layout import Layout
from ultrascale.plan.memory import memory_plan
from ultrascale.plan.shape import get_shape
from ultrascale.series.widgets import OWNERS, MemoryExplorer, PipelineExplorer, memory_explorer, pipeline_explorer


@pytest.fixture(autouse=True)
def _charts_in_tmp(tmp_path, monkeypatch):
    # Outside a kernel each figure's chart stays a file: in this test's directory.
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))


def planned(model, **layout):
    peak = memory_plan(get_shape(model), Layout(**layout), get_framework("playbook")).peak
    return {OWNERS[k]: peak.terms[k] / GIB for k in OWNERS}


def test_the_memory_controls_redraw_the_planners_memory_by_owner(capsys):
    explorer = MemoryExplorer()
    explorer.widget(ipywidgets)
    c = explorer.controls
    c["zero"].value = 3
    assert explorer.table == pytest.approx(planned("llama3-8b", dp=8, zero=3, seq_len=4096, grad_accum=2))
    c["model"].value, c["tp"].value, c["recompute"].value = "llama3-70b", 8, "full"
    want = planned("llama3-70b", dp=8, tp=8, zero=3, recompute="full", seq_len=4096, grad_accum=2)
    assert explorer.table == pytest.approx(want)
    # ZeRO-3 over 8 ranks holds an eighth of the optimizer states ZeRO-0 holds: the lesson, on the figure.
    c["zero"].value = 0
    assert explorer.table["optimizer states"] == pytest.approx(8 * want["optimizer states"], rel=1e-6)
    out = capsys.readouterr().out
    assert "llama3-70b: dp 8 x tp 8 x pp 1, ZeRO-0, recompute full, 1 x 4096 tokens" in out
    assert "  optimizer states" in out and "total per GPU" in out


def test_a_layout_the_planner_refuses_is_said_in_one_line(capsys):
    explorer = MemoryExplorer()
    assert explorer.update(tp=3) == {}
    assert explorer.problem and "tp" in explorer.problem
    assert capsys.readouterr().out.startswith("llama3-8b: dp 8 x tp 3")


def test_the_schedule_controls_redraw_the_simulated_bubble(capsys):
    explorer = PipelineExplorer()
    explorer.widget(ipywidgets)
    for name, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1), ("dualpipev", 1)):
        explorer.controls["schedule"].value = name
        chunks = v if name == "interleaved" else 1
        tl = simulate(schedule(name, 4, 8, chunks), 4, chunks_of(name, chunks), t_f=1 / chunks, t_b=1 / chunks,
                      t_w=1 / chunks, vshape=v_shaped(name))
        assert explorer.bubble == pytest.approx(tl.bubble_ratio)
        assert explorer.formula == pytest.approx(bubble_fraction(name, 4, 8, chunks))
    assert explorer.bubble < 0.375 / 2  # DualPipeV's bubble, well under 1F1B's (p-1)/m
    explorer.controls["m"].value = 3  # fewer than the 2p micro-batches DualPipeV needs
    assert explorer.bubble is None and "needs at least 2 x pp = 8 micro-batches" in explorer.problem
    assert "dualpipev, p = 4, m = 3: the dualpipev schedule needs" in capsys.readouterr().out


def test_without_a_widget_front_end_the_figure_is_printed_and_no_controls_are_made(capsys):
    memory = memory_explorer(model="llama3-8b", dp=4, zero=1)
    pipe = pipeline_explorer(schedule="zero-bubble", p=4, m=8)
    assert memory.controls == {} and pipe.controls == {}
    out = capsys.readouterr().out
    assert "llama3-8b: dp 4 x tp 1 x pp 1, ZeRO-1" in out and "total per GPU" in out
    assert "zero-bubble, p = 4, m = 8: simulated bubble 0.125" in out and "chart: " in out
