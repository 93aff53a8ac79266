"""The memory breakdown as a stacked bar chart (matplotlib, imported only when drawing)."""

from __future__ import annotations

import sys

from ultrascale.errors import ConfigError
from ultrascale.plan.calibration import GIB
from ultrascale.plan.memory import TERMS


def draw_memory(plan, gpu, title: str, path: str) -> None:
    """One bar per pipeline stage, one segment per owner, the GPU's memory as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--chart needs matplotlib: pip install 'ultrascale[plot]'") from None
    stages = plan.stages
    fig, ax = plt.subplots(figsize=(max(7.0, 3.0 + 0.4 * len(stages)), 4.5))
    x = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    colors = plt.get_cmap("tab10").colors
    for i, term in enumerate(TERMS):
        vals = [s.terms[term] / GIB for s in stages]
        ax.bar(x, vals, bottom=bottom, label=term, color=colors[i % len(colors)], width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(gpu.memory_gib, color="black", linestyle="--", linewidth=1)
    ax.text(len(stages) - 0.5, gpu.memory_gib, f" {gpu.gpu.name} {gpu.memory_gib:.1f} GiB", va="bottom", ha="right")
    ax.set_xticks(x)
    ax.set_xticklabels([str(s.stage) for s in stages] if len(stages) > 1 else ["per GPU"])
    if len(stages) > 1:
        ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ConfigError(f"--chart {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)  # stdout may be the plan's JSON
