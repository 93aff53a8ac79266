"""`ultrascale trace DIR`: what the profiled steps of every rank spent their time on.

Reads DIR/rank{r}.trace.json.gz (written by `ultrascale train ... --profile DIR`)
and reports per rank, within the profiled window (the first `step` span's start
to the last one's end):

- compute: the forward, backward and optimizer spans, less the communication
  spans the same thread ran inside them (a launch, a blocking collective, a wait);
- communication: every `comm:` span, and the backends' own events for the time
  collectives actually run (gloo's `gloo:*` on its worker threads); gloo records a
  point-to-point message on the thread that issued it, from the launch to the return
  of its wait(): that is time in flight, not time blocked (the blocking part is the
  `comm:` span of the receive or the wait), so such a message counts once, on its
  receiver (`gloo:recv`, from the post to the wait: an upper bound of the transfer),
  and a sender's `gloo:send`, in flight until a wait at the end of the step, not at all;
  (a trace with GPU kernels is read on the GPU's timeline instead: NCCL kernels are
  the communication, the other kernels the compute);
- idle: the window less both (data loading, zeroing, the profiler, waiting on nothing);
- hidden: the share of communication time during which compute ran, the comm-comp
  overlap of Holistic Trace Analysis: |comm ∩ compute| / |comm|, both as unions of
  intervals (overlapping communication intervals count once);
- the operators with the most self time (time not spent in their children).

It also draws DIR/timeline.png: one row per rank, compute above, communication below.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections import defaultdict

from ultrascale.errors import ConfigError
from ultrascale.spans import COMPUTE, STEP, is_comm

# gloo's point-to-point events: recorded launch-to-wait on the issuing thread (module docstring).
P2P_RECEIVE, P2P_SEND = "gloo:recv", "gloo:send"

Intervals = list[tuple[float, float]]


# -- interval algebra (in the trace's microseconds) ---------------------------
def merge(intervals) -> Intervals:
    """The union of intervals as sorted, disjoint (start, end) pairs."""
    out: Intervals = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def length(intervals) -> float:
    return sum(e - s for s, e in merge(intervals))


def intersect(a, b) -> Intervals:
    """The intersection of two unions of intervals."""
    a, b = merge(a), merge(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> Intervals:
    """The union `a` less the union `b`."""
    out, b = [], merge(b)
    for s, e in merge(a):
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if s < e:
            out.append((s, e))
    return out


def hidden_share(comm, compute) -> float:
    """Share of communication time overlapped by compute: |comm ∩ compute| / |comm| (0 without comm)."""
    total = length(comm)
    return length(intersect(comm, compute)) / total if total else 0.0


# -- one rank's trace -----------------------------------------------------------
def trace_files(directory: str) -> dict[int, str]:
    """{rank: path} of the traces in `directory`; refuses a missing or empty one in one line."""
    if not os.path.isdir(directory):
        raise ConfigError(f"trace {directory}: no such directory: pass the --profile directory of a "
                          f"`ultrascale train ... --profile DIR` run")
    found = {}
    for path in glob.glob(os.path.join(directory, "rank*.trace.json.gz")):
        m = re.fullmatch(r"rank(\d+)\.trace\.json\.gz", os.path.basename(path))
        if m:
            found[int(m.group(1))] = path
    if not found:
        raise ConfigError(f"trace {directory}: no rank*.trace.json.gz in it: write them with "
                          f"`ultrascale train ... --profile {directory}`")
    return dict(sorted(found.items()))


def load_events(path: str) -> list[dict]:
    """The complete ("X") events of a gzipped Chrome trace."""
    try:
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        events = data["traceEvents"]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"trace {path}: not a gzipped Chrome trace with traceEvents ({type(e).__name__}): "
                          f"profile the run again") from None
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _interval(e) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def self_times(events: list[dict]) -> dict[str, list]:
    """{operator: [self time, calls]} of the cpu_op events: each one's time less its children's, per thread."""
    out = defaultdict(lambda: [0.0, 0])
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack = []  # [end, event, time of its direct children]
        for e in evs:
            s, end = _interval(e)
            while stack and stack[-1][0] <= s:
                _close(stack.pop(), out)
            if stack:
                stack[-1][2] += min(end, stack[-1][0]) - s
            stack.append([end, e, 0.0])
        while stack:
            _close(stack.pop(), out)
    return dict(out)


def _close(item, out) -> None:
    end, e, children = item
    if e.get("cat") == "cpu_op":
        out[e["name"]][0] += float(e["dur"]) - children
        out[e["name"]][1] += 1


def analyse(events: list[dict], top: int = 8) -> dict:
    """The report of one rank's events (times in ms)."""
    steps = [_interval(e) for e in events if e["name"] == STEP]
    window = (min(s for s, _ in steps), max(e for _, e in steps)) if steps else \
        (min(_interval(e)[0] for e in events), max(_interval(e)[1] for e in events))
    clip = [window]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        # A GPU run: the device's timeline is what counts, as in Holistic Trace Analysis. NCCL
        # kernels are the communication, every other kernel the compute; the CPU spans only
        # launch them.
        comm = intersect([_interval(e) for e in kernels if is_comm(e["name"])], clip)
        compute = intersect([_interval(e) for e in kernels if not is_comm(e["name"])], clip)
    else:
        compute_spans = [e for e in events if e["name"] in COMPUTE]
        compute_threads = {e.get("tid") for e in compute_spans}
        comm_events = [e for e in events if is_comm(e["name"]) and e["name"] != P2P_SEND]
        comm = intersect([_interval(e) for e in comm_events], clip)
        # A thread blocked in (or launching) a collective inside a backward span is not computing;
        # a receive merely in flight on it does not block it.
        blocking = [_interval(e) for e in comm_events
                    if e.get("tid") in compute_threads and e["name"] != P2P_RECEIVE]
        compute = intersect(subtract([_interval(e) for e in compute_spans], blocking), clip)
    overlap = length(intersect(comm, compute))
    busy = length(merge(comm + compute))
    span_ms = (window[1] - window[0]) / 1e3
    ops = sorted(self_times(events).items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "window_ms": span_ms, "steps": len(steps),
        "compute_ms": length(compute) / 1e3, "comm_ms": length(comm) / 1e3, "idle_ms": span_ms - busy / 1e3,
        "overlap_ms": overlap / 1e3, "hidden_share": overlap / length(comm) if comm else 0.0,
        "top_ops": [{"name": n, "self_ms": t / 1e3, "calls": c} for n, (t, c) in ops],
        "_window": window, "_compute": compute, "_comm": comm,
    }


def report(directory: str, top: int = 8) -> list[dict]:
    out = []
    for rank, path in trace_files(directory).items():
        events = load_events(path)
        if not events:
            raise ConfigError(f"trace {path}: no events in it: profile the run again")
        out.append({"rank": rank, **analyse(events, top)})
    return out


# -- the timeline -----------------------------------------------------------------
def draw_timeline(ranks: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = {"compute": "#4C72B0", "comm": "#DD8452"}
    t0 = min(r["_window"][0] for r in ranks)  # the ranks of one machine share its clock
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.4))
    for i, r in enumerate(ranks):
        for kind, y in (("compute", i - 0.2), ("comm", i + 0.2)):
            bars = [((s - t0) / 1e3, (e - s) / 1e3) for s, e in r["_" + kind]]
            ax.broken_barh(bars, (y - 0.18, 0.36), color=colours[kind])
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}\nhidden {100 * r['hidden_share']:.0f}%" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("profiled steps: compute (above) and communication (below) per rank")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.3 if len(ranks) < 4 else -0.15), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# -- the command ------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="per-rank compute, communication, idle and overlap of a --profile run")
    p.add_argument("directory", help="the --profile directory of `ultrascale train`")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--top", type=int, default=8, help="operators listed by self time (default 8)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="do not write timeline.png")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args) -> int:
    ranks = report(args.directory, args.top)
    timeline = os.path.join(args.directory, "timeline.png") if args.plot else None
    if timeline:
        draw_timeline(ranks, timeline)
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in ranks]
    if args.json:
        print(json.dumps({"ranks": public, "timeline": timeline}, indent=1))
        return 0
    for r in public:
        print(f"rank {r['rank']}: {r['steps']} steps in {r['window_ms']:.1f} ms | compute {r['compute_ms']:.1f} ms | "
              f"comm {r['comm_ms']:.1f} ms | idle {r['idle_ms']:.1f} ms | "
              f"comm hidden behind compute {100 * r['hidden_share']:.1f}%")
        ops = ", ".join(f"{o['name']} {o['self_ms']:.1f} ms ({o['calls']})" for o in r["top_ops"])
        print(f"  top operators by self time: {ops}")
    if timeline:
        print(f"wrote {timeline}")
    return 0
