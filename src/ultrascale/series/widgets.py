"""The playbook's two interactive figures, on the planner and the simulator.

- `memory_explorer`: a model and a layout (dp, tp, pp, ZeRO stage, recomputation, sequence
  length, micro-batch) -> the memory per GPU by owner (parameters, gradients, optimizer
  states, activations, ...), from the planner's memory model (plan/memory.py), the GPU's
  memory as a line.
- `pipeline_explorer`: a schedule, p stages, m micro-batches (v chunks) -> the Gantt chart
  of every rank and its bubble, from the engine's own schedules played in its simulator
  (parallel/pipeline), beside the closed formula the planner uses (plan/bubble.py).

Each first shows its figure for the values it was called with as ordinary output (a table
and a chart), so a notebook saved after a run shows it on GitHub and in Colab, and
anywhere without a widget front-end; then, where ipywidgets runs in a kernel, the
controls, whose callback draws the figure again for their values. The callbacks are
plain methods (`update(**values)`), so they are tested by calling them.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

from ultrascale.plan.calibration import GIB

MODELS = ("llama3-8b", "llama3-70b", "llama3-405b", "smollm-1.7b", "mixtral-8x7b")
SCHEDULES = ("afab", "1f1b", "interleaved", "zero-bubble", "dualpipev")
RECOMPUTE = ("none", "selective", "full")
OWNERS = {"params": "parameters", "grads": "gradients", "optim": "optimizer states", "activations": "activations",
          "logits": "logits (loss)", "transient": "transient buffers", "comm_buffers": "communication buffers",
          "overhead": "CUDA context + allocator"}


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None and hasattr(get_ipython(), "kernel")


def _widgets():
    """ipywidgets, when it is installed and this runs in a kernel that can show it; else None."""
    if not _in_kernel():
        return None
    try:
        import ipywidgets
    except ImportError:
        return None
    return ipywidgets


def _display(*objs) -> None:
    from IPython.display import display

    display(*objs)


def _png(draw) -> str:
    """Draw into a temporary PNG (the engine's chart functions write files); its path."""
    fd, path = tempfile.mkstemp(prefix="ultrascale-", suffix=".png")
    os.close(fd)
    with contextlib.redirect_stderr(io.StringIO()):  # "wrote PATH": not the learner's business
        draw(path)
    return path


# ---- memory ---------------------------------------------------------------------------------------

class MemoryExplorer:
    """The memory per GPU of a model under a layout, by owner (the peak pipeline stage)."""

    def __init__(self, model="llama3-8b", dp=8, tp=1, pp=1, zero=0, recompute="none", seq_len=4096,
                 micro_batch=1, gpu="h100-80gb", framework="playbook"):
        self.values = dict(model=model, dp=dp, tp=tp, pp=pp, zero=zero, recompute=recompute, seq_len=seq_len,
                           micro_batch=micro_batch)
        self.gpu, self.framework = gpu, framework
        self.table: dict[str, float] = {}  # owner -> GiB, after update()
        self.problem: str | None = None  # why the layout cannot run, after update()
        self.controls: dict = {}

    def plan(self, **values):
        from ultrascale.errors import ConfigError
        from ultrascale.plan.calibration import get_framework
        from ultrascale.plan.layout import Layout, check_layout
        from ultrascale.plan.memory import memory_plan
        from ultrascale.plan.shape import get_shape

        v = {**self.values, **values}
        shape = get_shape(v["model"])
        # Micro-batches enough for a pipeline to fill (the planner's memory counts those in flight).
        lay = Layout(dp=v["dp"], tp=v["tp"], pp=v["pp"], zero=v["zero"], recompute=v["recompute"],
                     seq_len=v["seq_len"], micro_batch=v["micro_batch"], grad_accum=max(1, 2 * v["pp"]))
        try:
            check_layout(lay, shape)
        except ConfigError as e:
            return v, None, str(e)
        return v, memory_plan(shape, lay, get_framework(self.framework)), None

    def update(self, **values) -> dict:
        """The callback: plan for these values, keep and show the table and the chart."""
        from ultrascale.plan.chart import draw_memory
        from ultrascale.plan.hardware import playbook_cluster

        v, plan, self.problem = self.plan(**values)
        self.values = v
        layout = (f"{v['model']}: dp {v['dp']} x tp {v['tp']} x pp {v['pp']}, ZeRO-{v['zero']}, recompute "
                  f"{v['recompute']}, {v['micro_batch']} x {v['seq_len']} tokens")
        if plan is None:
            self.table = {}
            print(f"{layout}: {self.problem}")
            return self.table
        gpu = playbook_cluster(self.gpu)  # the card, as the planner's chart takes it
        peak = plan.peak
        self.table = {OWNERS[k]: peak.terms[k] / GIB for k in OWNERS}
        print(layout)
        for owner, g in self.table.items():
            print(f"  {owner:<25} {g:8.2f} GiB")
        verdict = "fits" if peak.total <= gpu.memory_bytes else "does NOT fit"
        print(f"  {'total per GPU':<25} {peak.total / GIB:8.2f} GiB -> {verdict} in {gpu.gpu.name} "
              f"({gpu.memory_gib:.0f} GiB)")
        path = _png(lambda p: draw_memory(plan, gpu, layout, p))
        _display_image(path)
        return self.table

    def show(self):
        """The figure for the current values, then the controls where a kernel can show them."""
        self.update()
        w = _widgets()
        return None if w is None else self.widget(w)

    def widget(self, w):
        """The controls (ipywidgets module `w`) above an output area that update() draws into."""
        from ultrascale.plan.shape import known_models

        models = [m for m in MODELS if m in known_models()]
        self.controls = {
            "model": w.Dropdown(options=models, value=self.values["model"], description="model"),
            "dp": w.IntSlider(value=self.values["dp"], min=1, max=64, description="dp"),
            "tp": w.Dropdown(options=[1, 2, 4, 8], value=self.values["tp"], description="tp"),
            "pp": w.Dropdown(options=[1, 2, 4, 8, 16], value=self.values["pp"], description="pp"),
            "zero": w.Dropdown(options=[0, 1, 2, 3], value=self.values["zero"], description="ZeRO"),
            "recompute": w.Dropdown(options=RECOMPUTE, value=self.values["recompute"], description="recompute"),
            "seq_len": w.Dropdown(options=[1024, 2048, 4096, 8192, 16384, 32768], value=self.values["seq_len"],
                                  description="seq len"),
            "micro_batch": w.IntSlider(value=self.values["micro_batch"], min=1, max=16, description="micro-batch"),
        }
        return _interactive(w, self.controls, self.update)


def memory_explorer(**values) -> MemoryExplorer:
    """The playbook's memory widget: see the module."""
    explorer = MemoryExplorer(**values)
    ui = explorer.show()
    if ui is not None:
        _display(ui)
    return explorer


# ---- pipeline -------------------------------------------------------------------------------------

class PipelineExplorer:
    """A schedule's Gantt chart and bubble, simulated with forward 1, backward 2 (input 1 + weights 1)."""

    def __init__(self, schedule="1f1b", p=4, m=8, v=2):
        self.values = dict(schedule=schedule, p=p, m=m, v=v)
        self.bubble: float | None = None  # simulated (T - busy) / busy, after update()
        self.formula: float | None = None  # the planner's closed form, after update()
        self.problem: str | None = None
        self.controls: dict = {}

    def timeline(self, **values):
        from ultrascale.parallel.pipeline.schedules import chunks_of, schedule
        from ultrascale.parallel.pipeline.partition import v_shaped
        from ultrascale.parallel.pipeline.simulate import simulate

        v = {**self.values, **values}
        chunks = v["v"] if v["schedule"] == "interleaved" else 1
        try:
            actions = schedule(v["schedule"], v["p"], v["m"], chunks)
        except ValueError as e:
            return v, None, str(e)
        # A full backward costs twice a forward: its input half 1, its weight half 1 (zero-bubble
        # schedules run them apart); interleaving cuts each stage into `chunks` smaller chunks.
        tl = simulate(actions, v["p"], chunks_of(v["schedule"], chunks), t_f=1 / chunks, t_b=1 / chunks,
                      t_w=1 / chunks, vshape=v_shaped(v["schedule"]))
        return v, tl, None

    def update(self, **values) -> float | None:
        """The callback: simulate these values, keep and show the bubble and the Gantt chart."""
        from ultrascale.parallel.pipeline import draw
        from ultrascale.plan.bubble import bubble_fraction

        v, tl, self.problem = self.timeline(**values)
        self.values = v
        name = v["schedule"] + (f" (v = {v['v']})" if v["schedule"] == "interleaved" else "")
        if tl is None:
            self.bubble = self.formula = None
            print(f"{name}, p = {v['p']}, m = {v['m']}: {self.problem}")
            return None
        self.bubble = tl.bubble_ratio
        self.formula = bubble_fraction(v["schedule"], v["p"], v["m"], v["v"] if v["schedule"] == "interleaved" else 1)
        print(f"{name}, p = {v['p']}, m = {v['m']}: simulated bubble {self.bubble:.3f} of the busy time "
              f"(the planner's formula: {self.formula:.3f}); at most {max(tl.peak_in_flight)} micro-batch "
              f"{'chunks' if tl.v > 1 else 'activations'} held at once on one rank")
        title = f"{name}, p = {v['p']}, m = {v['m']}: bubble {self.bubble:.3f}"
        _display_image(_png(lambda p: draw.draw(draw.spans_from_timeline(tl), title, p)))
        return self.bubble

    def show(self):
        """The figure for the current values, then the controls where a kernel can show them."""
        self.update()
        w = _widgets()
        return None if w is None else self.widget(w)

    def widget(self, w):
        """The controls (ipywidgets module `w`) above an output area that update() draws into."""
        self.controls = {
            "schedule": w.Dropdown(options=SCHEDULES, value=self.values["schedule"], description="schedule"),
            "p": w.IntSlider(value=self.values["p"], min=2, max=8, description="stages p"),
            "m": w.IntSlider(value=self.values["m"], min=1, max=32, description="micro-batches m"),
            "v": w.IntSlider(value=self.values["v"], min=1, max=4, description="chunks v"),
        }
        return _interactive(w, self.controls, self.update)


def pipeline_explorer(**values) -> PipelineExplorer:
    """The pipeline schedule explorer: see the module."""
    explorer = PipelineExplorer(**values)
    ui = explorer.show()
    if ui is not None:
        _display(ui)
    return explorer


# ---- shared ---------------------------------------------------------------------------------------

def _display_image(path: str) -> None:
    if not _in_kernel():  # a terminal: the chart stays a file
        print(f"  chart: {path}")
        return
    from IPython.display import Image

    _display(Image(filename=path))
    os.remove(path)  # the notebook holds its bytes now


def _interactive(w, controls: dict, update):
    """The controls above an output area; any change calls update(**all values) into it."""
    out = w.Output()

    def redraw(_change=None):
        out.clear_output(wait=True)
        with out:
            update(**{k: c.value for k, c in controls.items()})

    for c in controls.values():
        c.observe(redraw, names="value")
    return w.VBox([w.HBox(list(controls.values())[:4]), w.HBox(list(controls.values())[4:]), out])
