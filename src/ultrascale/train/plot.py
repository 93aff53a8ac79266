"""`ultrascale plot`: loss, throughput and memory of several runs' `--log-jsonl` files, in one figure.

The typical use: a parallel run over its single-process control. Memory is per rank, as the
JSONL records it: parameters + gradients + optimizer state + activations (MiB), or the
allocator's peak on a GPU when recorded.
"""

from __future__ import annotations

import json
import os
import sys

from ultrascale.errors import ConfigError

FIGSIZE, DPI = (15.0, 4.5), 100  # the PNG is FIGSIZE x DPI pixels: 1500 x 450


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="draw loss, tokens/s and memory of several --log-jsonl runs in one figure")
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="files written by `ultrascale train --log-jsonl`")
    p.add_argument("-o", "--out", required=True, help="the PNG to write")
    p.add_argument("--labels", nargs="+", help="one label per run (default: the file names)")
    p.set_defaults(func=cmd_plot)


def read_steps(path: str) -> list[dict]:
    """The step records of a --log-jsonl file, or a one-line ConfigError saying what is wrong."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file; write one with `ultrascale train --log-jsonl FILE`")
    rows = []
    with open(path) as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # no newline after it: the last line, cut by a run that was killed
                print(f"warning: {path}:{i}: the last line is cut short (a run killed while writing it): "
                      f"read without it", file=sys.stderr)
                continue
            raise ConfigError(f"{path}:{i}: not a JSON line; give a file written by "
                              f"`ultrascale train --log-jsonl FILE`") from None
        if isinstance(row, dict) and {"step", "loss", "tokens_per_s", "memory"} <= row.keys():
            rows.append(row)
    # A run resumed from an earlier checkpoint than its last step, logging into the same file: each
    # step's latest row (a resumed run's log is straightened when it starts; older files may repeat).
    rows = list({row["step"]: row for row in rows}.values())
    rows.sort(key=lambda row: row["step"])
    if not rows:
        raise ConfigError(f"{path}: no step records; give a file written by `ultrascale train --log-jsonl FILE`")
    return rows


def memory_mib(row: dict) -> float:
    mem = row["memory"]
    if mem.get("allocator_peak") is not None:
        return mem["allocator_peak"] / 2**20
    return sum(v for k, v in mem.items() if k != "allocator_peak" and v is not None) / 2**20


def cmd_plot(args) -> int:
    from ultrascale.preflight import check_writable_file

    if args.labels and len(args.labels) != len(args.runs):
        raise ConfigError(f"--labels gives {len(args.labels)} labels for {len(args.runs)} runs: give one per run")
    if not args.out.lower().endswith(".png"):
        raise ConfigError(f"-o {args.out}: the figure is a PNG: give a file name ending in .png")
    check_writable_file("-o", args.out)
    runs = [read_steps(p) for p in args.runs]
    labels = args.labels or [os.path.basename(p) for p in args.runs]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=FIGSIZE, dpi=DPI)
    panels = [("loss", lambda r: r["loss"]), ("tokens/s (all ranks)", lambda r: r["tokens_per_s"]),
              ("memory per rank (MiB)", memory_mib)]
    for ax, (title, value) in zip(axes, panels):
        for rows, label in zip(runs, labels):
            line, = ax.plot([r["step"] for r in rows], [value(r) for r in rows],
                            marker="." if len(rows) < 50 else None, label=label)
            evals = [r for r in rows if r.get("val_loss") is not None]
            if title == "loss" and evals:  # the validation loss beside the training loss, same colour
                ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], linestyle="--", marker="o",
                        markersize=3, color=line.get_color(), label=f"{label} (validation)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if title != "loss":  # throughput and memory from zero: a ratio reads as a ratio
            top = max(value(r) for rows in runs for r in rows)
            ax.set_ylim(0, 1.1 * top if top > 0 else 1)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        fig.savefig(args.out, dpi=DPI)
    except OSError as e:
        raise ConfigError(f"-o {args.out}: cannot write it ({e.strerror}): choose another file") from None
    finally:
        plt.close(fig)
    print(f"wrote {args.out}: {len(runs)} run{'s' if len(runs) > 1 else ''}")
    return 0
