"""`ultrascale plan ... --html OUT.html`: the search's results as one page to look at.

One self-contained file (no network: the charts are SVG drawn by a few lines of
script): the ranked layouts, and for the one selected, its memory per GPU by
owner against the GPU's memory, its step time by cause, and its pipeline
schedule as a Gantt chart. A preset with fields changed is named "custom (from PRESET)" in the title, with
the fields given and those derived under it. The page holds the planner's results (the same
fields as `plan --json`, in a `<script type="application/json">` block a test
reads back) and the schedules simulated for them; the model stays in Python.
"""

from __future__ import annotations

import html
import json
import os
import tempfile

# Owners of the memory, as the playbook names them, from the planner's terms.
OWNERS = {"parameters": ("params",), "gradients": ("grads",), "optimizer": ("optim",),
          "activations": ("activations", "logits"), "buffers": ("transient", "comm_buffers"),
          "overhead": ("overhead",)}
# The Gantt shows at most this many micro-batches per pipeline rank: the schedule's shape (warm-up,
# steady state, cool-down) is all there; thousands of boxes would draw nothing more.
GANTT_MICRO_BATCHES = 4


def gantt(lay: dict, breakdown: dict) -> dict:
    """The selected layout's schedule, simulated with its own forward and backward times."""
    from ultrascale.parallel.pipeline.partition import v_shaped
    from ultrascale.parallel.pipeline.schedules import build, with_communication
    from ultrascale.parallel.pipeline.simulate import simulate

    p, v, m = lay["pp"], lay["chunks"], lay["grad_accum"]
    shown = min(m, GANTT_MICRO_BATCHES * p)
    if lay["schedule"] == "interleaved":
        shown = max(p, shown - shown % p)
    per_mb = (breakdown["compute"] + breakdown["recompute"] + breakdown["kernel_overhead"]
              + breakdown.get("cp_imbalance", 0.0)) / m / v
    t_f = per_mb / 3  # backward is two thirds of the FLOPs (4 of 6 per parameter)
    split = lay["schedule"] == "zero-bubble"  # backward split into input and weight gradients
    t_b, t_w = (per_mb / 3, per_mb / 3) if split else (2 * per_mb / 3, 0.0)
    t_comm = breakdown["pp_comm"] / m / (2 * v) if p > 1 else 0.0
    vshape = v_shaped(lay["schedule"])  # DualPipeV's chunks sit in a V: the turn at the bottom is a hand-off
    tl = simulate(with_communication(build(lay["schedule"], p, shown, v), p, v, vshape), p, v, t_f, t_b, t_w, t_comm,
                  vshape)
    return {"micro_batches": shown, "of": m, "makespan": tl.makespan,
            "ranks": [[[a.kind, a.micro, round(s, 9), round(e, 9)] for a, s, e in rank] for rank in tl.spans]}


def page_data(result: dict) -> dict:
    """What the page draws: `plan --json`'s fields, each candidate with its owners and schedule."""
    def drawn(c):
        return {**c, "owners": {k: sum(c["memory"][t] for t in terms) for k, terms in OWNERS.items()},
                "gantt": gantt(c["layout"], c["time"]["breakdown_s"])}

    return {**result, "candidates": [drawn(c) for c in result["candidates"]]}


def write(path: str, result: dict, title: str, assumes: str, memory_bytes: float) -> None:
    from ultrascale.preflight import publish

    data = page_data(result)
    data.update(title=title, assumes=assumes, memory_bytes=memory_bytes)
    text = TEMPLATE.replace("@TITLE@", html.escape(title)).replace(
        "@DATA@", json.dumps(data).replace("</", "<\\/"))
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")  # whole or not at all
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    publish(tmp, path)  # a page others may open, as a plain open() would have made it


def read_data(path: str) -> dict:
    """The planner's results a page holds (what the tests compare with `plan --json`)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index('<script id="plan-data" type="application/json">') + len(
        '<script id="plan-data" type="application/json">')
    return json.loads(text[start:text.index("</script>", start)].replace("<\\/", "</"))


TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>@TITLE@</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 20px; margin: 0 0 4px; } .sub { color: #666; margin-bottom: 16px; }
table { border-collapse: collapse; width: 100%; margin-bottom: 20px; }
th, td { padding: 4px 8px; border-bottom: 1px solid #eee; text-align: right; }
th:nth-child(2), td:nth-child(2) { text-align: left; font-family: monospace; }
tr.row { cursor: pointer; } tr.row:hover { background: #f4f7fb; } tr.sel { background: #e3ecf7; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 24px; }
#model { white-space: pre-line; font-family: monospace; }
h2 { font-size: 16px; margin: 12px 0 6px; } svg text { font: 12px system-ui, sans-serif; }
.note { color: #666; font-size: 12px; }
</style></head><body>
<h1 id="title"></h1><div class="sub" id="model"></div><div class="sub" id="assumes"></div>
<table id="ranked"><thead><tr><th>#</th><th>layout</th><th>tokens/s/GPU</th><th>MFU</th>
<th>memory (GiB)</th><th>step (s)</th></tr></thead><tbody></tbody></table>
<div class="grid"><div><h2>Memory per GPU, by owner</h2><svg id="memory" width="560" height="250"></svg></div>
<div><h2>Step time, by cause</h2><svg id="time" width="560" height="250"></svg></div></div>
<h2>Pipeline schedule</h2><div class="note" id="gantt-note"></div><svg id="gantt" width="1150" height="120"></svg>
<script id="plan-data" type="application/json">@DATA@</script>
<script>
const D = JSON.parse(document.getElementById("plan-data").textContent);
const GIB = 2 ** 30, NS = "http://www.w3.org/2000/svg";
const COLOURS = ["#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974", "#64B5CD", "#8C8C8C", "#E17C05",
                 "#937860", "#DA8BC3", "#6F9E4C"];
const KIND = {F: "#4C72B0", B: "#55A868", I: "#55A868", W: "#C44E52"};
function el(svg, name, attrs, text) {
  const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  svg.appendChild(e); return e;
}
function bars(svg, items, unit, limit, limitLabel) {
  svg.innerHTML = "";
  const total = items.reduce((s, [, v]) => s + v, 0), top = Math.max(total, limit || 0) * 1.05 || 1;
  const x0 = 120, w = 340;
  items.forEach(([name, v], i) => {
    const y = 10 + i * 20, len = w * v / top;
    el(svg, "text", {x: x0 - 6, y: y + 12, "text-anchor": "end"}, name);
    el(svg, "rect", {x: x0, y: y, width: Math.max(len, 0.5), height: 14, fill: COLOURS[i % COLOURS.length]});
    el(svg, "text", {x: x0 + len + 4, y: y + 12}, unit(v));
  });
  const y = 14 + items.length * 20;
  el(svg, "text", {x: x0 - 6, y: y + 12, "text-anchor": "end", "font-weight": "bold"}, "total");
  el(svg, "rect", {x: x0, y: y, width: w * total / top, height: 14, fill: "#333"});
  el(svg, "text", {x: x0 + w * total / top + 4, y: y + 12}, unit(total));
  if (limit) {
    const lx = x0 + w * limit / top;
    el(svg, "line", {x1: lx, x2: lx, y1: 4, y2: y + 18, stroke: "#C44E52", "stroke-dasharray": "4 3"});
    el(svg, "text", {x: lx - 4, y: y + 32, "text-anchor": "end", fill: "#C44E52"}, limitLabel);
  }
  svg.setAttribute("height", y + 40);
}
function gantt(svg, g) {
  svg.innerHTML = "";
  const x0 = 70, w = 1060, rowH = 22, scale = w / g.makespan;
  g.ranks.forEach((rank, r) => {
    el(svg, "text", {x: x0 - 6, y: 8 + r * rowH + 14, "text-anchor": "end"}, "rank " + r);
    rank.forEach(([kind, micro, s, e]) => {
      if (!(kind in KIND)) return;
      el(svg, "rect", {x: x0 + s * scale, y: 8 + r * rowH, width: Math.max((e - s) * scale - 1, 0.5),
                       height: rowH - 4, fill: KIND[kind]});
      if ((e - s) * scale > 16) el(svg, "text", {x: x0 + s * scale + 3, y: 8 + r * rowH + 13, fill: "white"},
                                   kind + micro);
    });
  });
  svg.setAttribute("height", 16 + g.ranks.length * rowH);
}
function select(i) {
  const c = D.candidates[i];
  document.querySelectorAll("tr.row").forEach((tr, j) => tr.classList.toggle("sel", j === i));
  bars(document.getElementById("memory"), Object.entries(c.owners), v => (v / GIB).toFixed(1) + " GiB",
       D.memory_bytes, (D.memory_bytes / GIB).toFixed(1) + " GiB on the GPU");
  bars(document.getElementById("time"), Object.entries(c.time.breakdown_s).filter(([, v]) => v > 0),
       v => v.toFixed(3) + " s");
  const g = c.gantt;
  document.getElementById("gantt-note").textContent = c.layout.schedule + ", pp " + c.layout.pp +
    (c.layout.chunks > 1 ? ", " + c.layout.chunks + " chunks per rank" : "") + ": " + g.micro_batches +
    " of the step's " + g.of + " micro-batches drawn (F forward, B backward" +
    (c.layout.schedule === "zero-bubble" ? ", W weight gradients" : "") + ")";
  gantt(document.getElementById("gantt"), g);
}
document.getElementById("title").textContent = D.title;
// A changed preset says which, and what was given and derived (plan/overrides.py); a preset says nothing.
if (D.shape && D.shape.custom) document.getElementById("model").textContent = D.shape.notes.join("\\n");
document.getElementById("assumes").textContent = D.assumes + ". " + D.fitting + " of " + D.enumerated +
  " layouts fit; the first " + D.candidates.length + " of the ranking below (click one): the " + D.top_group +
  " predicted within the time model's error of the fastest first, by memory headroom then simplicity.";
const body = document.querySelector("#ranked tbody");
D.candidates.forEach((c, i) => {
  const tr = document.createElement("tr"); tr.className = "row"; tr.onclick = () => select(i);
  [i + 1, c.label, Math.round(c.time.tokens_per_s_per_gpu).toLocaleString("en"),
   (100 * c.time.mfu).toFixed(1) + "%", (c.memory.total / GIB).toFixed(1), c.time.step_s.toFixed(3)]
    .forEach(v => { const td = document.createElement("td"); td.textContent = v; tr.appendChild(td); });
  body.appendChild(tr);
});
if (D.candidates.length) select(0);
</script></body></html>
"""
