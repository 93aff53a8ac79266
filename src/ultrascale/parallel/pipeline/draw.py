"""Draw a pipeline schedule as a Gantt chart: one row per rank, the bubbles left blank.

The same picture for a simulated schedule (unit costs or the ones given) and for
the timeline recorded on a real run (the train command's `--pp-trace FILE`).
"""

from __future__ import annotations

import json
import os
import tempfile

from ultrascale.preflight import publish

# A full backward and its input half apart: DualPipeV runs both, and its legend names both.
COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#A5D6A7", "W": "#C44E52"}
LABELS = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}


def spans_from_timeline(timeline) -> list[list[tuple]]:
    """[(label, kind, start, end)] per rank from a simulate.Timeline."""
    return [[(repr(a), a.kind, s, e) for a, s, e in rank] for rank in timeline.spans]


def measured_bubble_ratio(spans: list[list[tuple]]) -> float:
    """(T - busy) / busy of the busiest rank, T from the first start to the last end."""
    start = min(s for rank in spans for _, _, s, _ in rank)
    end = max(e for rank in spans for _, _, _, e in rank)
    busy = max(sum(e - s for _, kind, s, e in rank if kind in COLOURS) for rank in spans)
    return (end - start - busy) / busy


def read_trace(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def trace_spans(trace: dict, clock: bool = False) -> list[list[tuple]]:
    """[(label, kind, start, end)] per rank of a recorded step: in seconds (wall clock), or on the
    schedule's clock (the runtime's Lamport clock at the simulator's unit costs; runtime.py)."""
    if not clock:
        return [[(x["action"], x["kind"], x["start"], x["end"]) for x in rank] for rank in trace["ranks"]]
    return [[(x["action"], x["kind"], *x["clock"]) for x in rank] for rank in trace["ranks"]]


def write_trace(path: str, schedule: str, p: int, v: int, spans: list[list[tuple]]) -> None:
    """spans: per rank, (action, kind, start, end[, clock start, clock end])."""
    data = {"schedule": schedule, "pp": p, "chunks": v,
            "ranks": [[{"action": x[0], "kind": x[1], "start": x[2], "end": x[3], **({"clock": list(x[4:6])} if len(x) > 4 else {})}
                       for x in rank] for rank in spans]}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    publish(tmp, path)


def draw(spans: list[list[tuple]], title: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    compute = [[x for x in rank if x[1] in COLOURS] for rank in spans]
    t0 = min(s for rank in compute for _, _, s, _ in rank)
    end = max(e for rank in compute for _, _, _, e in rank) - t0
    fig, ax = plt.subplots(figsize=(max(8, min(24, 0.35 * sum(len(r) for r in compute) / len(compute))),
                                    0.6 * len(compute) + 1.4))
    for r, rank in enumerate(compute):
        for label, kind, s, e in rank:
            ax.barh(r, e - s, left=s - t0, color=COLOURS[kind], edgecolor="white", linewidth=0.8)
            if (e - s) / end > 0.012:
                ax.text(s - t0 + (e - s) / 2, r, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(compute)), [f"rank {r}" for r in range(len(compute))])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    ax.set_title(title)
    kinds = sorted({k for rank in compute for _, k, _, _ in rank}, key="FBIW".index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=LABELS[k]) for k in kinds], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(compute) < 4 else -0.15), ncol=len(kinds), frameon=False)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=130)
    plt.close(fig)
    publish(tmp, out)  # an image others may open (mkstemp makes 0600)
