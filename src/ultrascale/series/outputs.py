"""A notebook with the outputs of one run, and the record that says which source they came from.

The course is committed with its outputs (a run on a CPU: every printed figure, every chart
as an inline PNG), so GitHub and Colab show the results before anything runs. Outputs go
stale silently when a source changes, so the run is recorded in the notebook's metadata
(`metadata.ultrascale.run`):

source_sha256   sha256 of the notebook as built, without outputs: what was run
outputs_sha256  sha256 of the outputs and execution counts: what it printed, untouched since

`outputs_problem` compares a notebook with a fresh build of its source and says, in one
phrase, what is wrong: never run, run from another version of the source, outputs edited
by hand, or not one run top to bottom. Nothing else is added to the file: no timings, no
kernel versions, so running twice differs only where the outputs themselves differ.
Charts are kept as palette PNGs (256 colours, what a chart of flat colours needs): a
third of the size of the truecolour PNG matplotlib writes, for the same picture.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import io
import json

import nbformat

from ultrascale.series.build import notebook_text

RUN = "run"  # the key under metadata.ultrascale


def without_outputs(nb) -> nbformat.NotebookNode:
    """The notebook as built: no outputs, no execution counts, no record of a run."""
    out = nbformat.from_dict(copy.deepcopy(dict(nb)))
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
    out.metadata.get("ultrascale", {}).pop(RUN, None)
    return out


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def source_fingerprint(nb) -> str:
    """What a run ran: the notebook's text without outputs."""
    return _sha256(notebook_text(without_outputs(nb)))


def _joined(value):
    """Text as one string: the .ipynb file splits multi-line text into a list of lines."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "".join(value)
    if isinstance(value, dict):
        return {k: _joined(v) for k, v in value.items()}
    return value


def outputs_fingerprint(nb) -> str:
    """What a run printed: each code cell's execution count and outputs, the same in memory and on disk."""
    cells = [[c.get("execution_count"), [_joined(dict(o)) for o in c.get("outputs", [])]]
             for c in nb["cells"] if c["cell_type"] == "code"]
    return _sha256(json.dumps(cells, sort_keys=True, ensure_ascii=False))


def smaller_png(encoded: str) -> str:
    """A base64 PNG as a 256-colour palette PNG, if that is smaller (Pillow comes with matplotlib)."""
    try:
        from PIL import Image
    except ImportError:
        return encoded
    raw = base64.b64decode("".join(encoded))
    image = Image.open(io.BytesIO(raw))
    if image.mode in ("RGBA", "LA", "P"):  # transparency onto white, as the notebook page shows it
        image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA"))
    buffer = io.BytesIO()
    image.convert("RGB").quantize(colors=256).save(buffer, "PNG", optimize=True)
    small = buffer.getvalue()
    return base64.b64encode(small).decode("ascii") + "\n" if len(small) < len(raw) else encoded


def _clean(output) -> dict:
    """An output as it is worth keeping: its content, without what only one kernel session says."""
    out = copy.deepcopy(dict(output))
    if out.get("output_type") in ("execute_result", "display_data"):
        out["metadata"] = {}
        out.pop("transient", None)
        if "image/png" in out.get("data", {}):
            out["data"] = {**out["data"], "image/png": smaller_png(out["data"]["image/png"])}
    return out


def _live(output) -> bool:
    """A widget's view: controls that need their kernel, dead in a saved notebook (GitHub shows nothing,
    Jupyter "model not found"); the figure printed before them is what a saved notebook shows."""
    return "application/vnd.jupyter.widget-view+json" in output.get("data", {})


def with_outputs(built, executed) -> nbformat.NotebookNode:
    """`built` (build_notebook's notebook) with the outputs and execution counts of `executed`, the same
    notebook after a run, and the record of that run. Only outputs are taken: the metadata stays the
    builder's (no kernel version, no timings)."""
    out = without_outputs(built)
    for cell, ran in zip(out.cells, executed.cells):
        if cell.cell_type == "code" and cell.source == ran.source:
            cell.outputs = [nbformat.from_dict(_clean(o)) for o in ran.get("outputs", []) if not _live(o)]
            cell.execution_count = ran.get("execution_count")
    out.metadata.setdefault("ultrascale", {})[RUN] = {"source_sha256": source_fingerprint(built),
                                                      "outputs_sha256": outputs_fingerprint(out)}
    return out


def outputs_problem(nb, built) -> str | None:
    """None if `nb` carries the outputs of one run of `built` (a fresh build of its source); else what
    is wrong, in a phrase."""
    nb = nbformat.from_dict(nb)
    record = nb.get("metadata", {}).get("ultrascale", {}).get(RUN)
    if not isinstance(record, dict):
        return "its outputs are missing (it was never run)"
    if record.get("source_sha256") != source_fingerprint(built):
        return "its outputs are stale (they come from another version of its source)"
    if source_fingerprint(nb) != record.get("source_sha256"):
        return "its cells were edited after the run"
    if record.get("outputs_sha256") != outputs_fingerprint(nb):
        return "its outputs were edited after the run"
    counts = [c.get("execution_count") for c in nb.cells if c.cell_type == "code" and "".join(c.source).strip()]
    if counts != list(range(1, len(counts) + 1)):
        return "its outputs are not from one run top to bottom (execution counts " \
               f"{', '.join(map(str, counts))})"
    return None
