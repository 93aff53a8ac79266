"""Words and tables for the planner's answers (the CLI prints these)."""

from __future__ import annotations

from ultrascale.plan.calibration import GIB
from ultrascale.plan.memory import TERMS, verdict
from ultrascale.plan.precision import get_precision
from ultrascale.plan.search import headroom_key, simplicity_key

FORMULAS = {
    "params": "b·Psi{z3}",
    "grads": "g·Psi{z2}",
    "optim": "k·Psi{z1}",
    "activations": "saved tensors x {flight:g} micro-batch(es) in flight",
    "logits": "fp32 log-softmax + targets, last stage",
    "transient": "loss-time logits + one block's backward",
    "comm_buffers": "gathers, sends, ZeRO buckets",
    "overhead": "CUDA context + allocator fragmentation",
}


def gib(x: float) -> str:
    return f"{x / GIB:8.2f} GiB"


def memory_lines(shape, lay, plan, gpu, fw, model=None) -> list[str]:
    """`model`: the account of a changed preset (plan/overrides.py Resolved), said after the first line."""
    peak = plan.peak
    prec = get_precision(lay.precision)
    n = lay.dp * lay.cp
    shard = {f"z{s}": (f"/{n}" if lay.zero >= s else "") for s in (1, 2, 3)}
    sizes = {"b": prec.param_bytes, "g": prec.grad_bytes, "k": prec.optim_bytes}
    on_gpu = f" ({peak.param_count:,.0f} on this GPU)"
    words = shape.params_words().replace(" parameters", f" parameters{on_gpu}", 1)
    out = [f"{shape.name}: {words}, precision "
           f"{lay.precision} (b={sizes['b']}, g={sizes['g']}, k={sizes['k']} bytes), framework {fw.name}",
           *(model.lines() if model else []),
           f"layout: {lay.label()}, seq {lay.seq_len}",
           f"per GPU, pipeline stage {peak.stage} of {lay.pp} ({peak.layers} blocks):"]
    for term in TERMS:
        v = peak.terms[term]
        note = FORMULAS[term].format(flight=peak.in_flight, **shard)
        out.append(f"  {term:<13}{gib(v)}  {v:>18,.0f} B   {note}")
    out.append(f"  {'total':<13}{gib(peak.total)}  of {gpu.memory_gib:.2f} GiB on a {gpu.gpu.name}: "
               f"{verdict(plan, gpu)}")
    return out


def time_lines(t) -> list[str]:
    parts = ", ".join(f"{k} {v:.3f}s" for k, v in t.breakdown.items() if v > 0)
    return [f"step {t.step_s:.3f} s: {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {100 * t.mfu:.1f}%",
            f"  breakdown: {parts}"]


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def group_lines(result) -> list[str]:
    """What the top group is and why it is ordered as it is."""
    fastest, n, band = result.fastest, len(result.top_group), pct(result.band)
    head = (f"Top group: {n} layouts within ±{band} of the fastest: the time model cannot order these; those with "
            f"enough memory headroom first, all alike, then the tighter ones, roomier first; then simplicity." if n > 1 else
            f"Top group: the fastest alone, no other layout is within ±{band} of it.")
    return [head,
            f"  ±{band}: the time model's largest error on the published runs (`ultrascale plan published`); the "
            f"fastest predicted: {fastest.layout.label()}, {fastest.time.tokens_per_s_per_gpu:,.0f} tokens/s/GPU.",
            f"  Headroom above the memory model's {pct(result.memory_error)} median error (`ultrascale plan validate`) "
            f"counts as enough; simplicity: less model parallelism, fewer parallel axes, less recomputation, a lower "
            f"ZeRO stage, a simpler schedule."]


def table(result, top: int) -> list[str]:
    """The ranking: the top group (no "slower" figure: the model cannot tell), then the layouts below
    the band, each with its predicted shortfall from the fastest."""
    cands, capacity, group = result.ranked, result.capacity, len(result.top_group)
    head = (f"{'#':>5}  {'layout':<62} {'memory':>10} {'free':>9} {'step':>8} {'tok/s/GPU':>10} {'MFU':>6} "
            f"{'slower':>7}")
    out = group_lines(result) + [head, "-" * len(head)]
    for i, c in enumerate(cands[:top], 1):
        if i == group + 1:
            out.append("  below the band, by predicted throughput (slower: than the fastest):")
        slower = "-" if c.top_group else pct(c.slower)
        free = capacity - c.memory.peak.total  # below 0: the allocator's slack does not fit ("fits tightly")
        room = f"{free / GIB:>5.1f} GiB" if free >= 0 else f"{'tight':>9}"
        out.append(f"{i:>5}  {c.layout.label():<62} {c.memory.peak.total / GIB:>6.1f} GiB "
                   f"{room} {c.time.step_s:>7.2f}s "
                   f"{c.time.tokens_per_s_per_gpu:>10,.0f} {100 * c.time.mfu:>5.1f}% {slower:>7}")
    shown = min(top, len(cands))
    hidden = {"in the top group": max(0, group - shown), "below the band": len(cands) - max(shown, group)}
    if shown < len(cands):
        more = " and ".join(f"{n} more {where}" for where, n in hidden.items() if n)
        out.append(f"  ({more}: --top {len(cands)} lists them all)")
    return out


def _costliest(t) -> str:
    waits = {k: v for k, v in t.breakdown.items() if k not in ("compute", "recompute")}
    k = max(waits, key=waits.get)
    return f"{k.replace('_', ' ')} ({100 * waits[k] / t.step_s:.0f}% of the step)"


def _tightly(result) -> str:
    """How many of the fitting layouts fit only tightly (memory.verdict): their live tensors and context fit,
    the allocator's planned slack does not."""
    tight = sum(c.memory.peak.total > result.capacity for c in result.ranked)
    return f" ({tight} of them tightly: without room for all of the allocator's planned cache)" if tight else ""


def _trades(c, gpu) -> str:
    """The three things a layout trades: memory headroom, the pipeline bubble, exposed communication."""
    t = c.time
    comm = sum(v for k, v in t.breakdown.items() if k.endswith("_comm") or k == "sync")
    free = gpu.memory_bytes - c.memory.peak.total
    room = (f"{free / GIB:.1f} GiB of memory headroom" if free >= 0 else
            f"no memory headroom (it fits tightly: the allocator's planned slack is {-free / GIB:.1f} GiB short)")
    return (f"{room}, a bubble of "
            f"{100 * t.breakdown.get('bubble', 0.0) / t.step_s:.0f}% and exposed communication of "
            f"{100 * comm / t.step_s:.0f}% of the step")


def _schedule(lay) -> str:
    return lay.schedule + (f" v{lay.chunks}" if lay.chunks > 1 else "") if lay.pp > 1 else "no pipeline"


# search.simplicity_key's fields, in its order: what each means, and how to show one layout's value.
SIMPLICITY = (("less model parallelism, tp x pp x cp x ep", lambda lay, v: str(v)),
              ("fewer parallel axes above 1", lambda lay, v: str(v)),
              ("less recomputation", lambda lay, v: lay.recompute),
              ("a lower ZeRO stage", lambda lay, v: f"ZeRO-{v}"),
              ("a simpler pipeline schedule", lambda lay, v: _schedule(lay)),
              ("fewer chunks per pipeline rank", lambda lay, v: str(v)),
              ("the even stage split", lambda lay, v: "uneven" if v else "even"))


def _before(a, b, result) -> str:
    """Why the ranking puts `a` before `b`, both of the top group."""
    ha = headroom_key(a, result.capacity, result.memory_error)
    hb = headroom_key(b, result.capacity, result.memory_error)
    free_a, free_b = (result.capacity - c.memory.peak.total for c in (a, b))
    if ha != hb:
        if ha[0] < hb[0]:
            return (f"more free memory than the memory model's {pct(result.memory_error)} error of its peak "
                    f"({free_a / GIB:.1f} GiB free, against {free_b / GIB:.1f} GiB that is within it)")
        return (f"more free memory, both within the memory model's error ({free_a / GIB:.1f} against "
                f"{free_b / GIB:.1f} GiB)")
    for (words, show), x, y in zip(SIMPLICITY, simplicity_key(a), simplicity_key(b)):
        if x != y:
            return f"{words} ({show(a.layout, x)} against {show(b.layout, y)})"
    if a.time.tokens_per_s_per_gpu != b.time.tokens_per_s_per_gpu:
        return "as much headroom, as simple, and the higher prediction"
    return "the same headroom, simplicity and prediction (the label decides)"


def _why_first(result) -> list[str]:
    best, fastest, n = result.ranked[0], result.fastest, len(result.top_group)
    band = pct(result.band)
    if n == 1:
        out = [f"   Why it is first: the fastest predicted, and no other layout is within the time model's "
               f"±{band} error of it."]
        if len(result.ranked) > 1:
            nxt = result.ranked[1]
            out.append(f"   Next: {nxt.layout.label()}, {pct(nxt.slower)} slower by the model (its largest other "
                       f"cost: {_costliest(nxt.time)}).")
        return out
    nxt = result.ranked[1]
    out = [f"   Why it is first: the time model cannot order the {n} layouts within ±{band} of the fastest; "
           f"against the next, {nxt.layout.label()} (predicted {nxt.time.tokens_per_s_per_gpu:,.0f} tokens/s/GPU), "
           f"it comes first for {_before(best, nxt, result)}."]
    if fastest is not best:
        out.append(f"   The fastest predicted is {fastest.layout.label()} ({fastest.time.tokens_per_s_per_gpu:,.0f} "
                   f"tokens/s/GPU): a difference within the model's error.")
    return out


def explain(shape, result, gpu, gpus, sequences) -> list[str]:
    """The first layout in the playbook's three steps."""
    best = result.ranked[0]
    lay, mem, t = best.layout, best.memory.peak, best.time
    states = sum(mem.terms[k] for k in ("params", "grads", "optim"))
    plain = shape.count() * (lambda p: p.param_bytes + p.grad_bytes + p.optim_bytes)(get_precision(lay.precision))
    out = ["Why this one, in the playbook's three steps:",
           f"1. Fit memory: {len(result.ranked)} of {result.enumerated} configurations fit in "
           f"{gpu.memory_gib:.1f} GiB{_tightly(result)}. Unsharded, the model states alone would take {plain / GIB:,.1f} GiB per GPU; "
           f"this layout holds {states / GIB:.1f} GiB of states and {mem.terms['activations'] / GIB:.1f} GiB of "
           f"activations ({mem.in_flight:g} micro-batch(es) in flight), {mem.total / GIB:.1f} GiB in all.",
           f"2. Reach the batch: {lay.micro_batch} (micro-batch) x {lay.grad_accum} (accumulation) x {lay.dp} (dp) = "
           f"{sequences} sequences of {lay.seq_len} tokens = {lay.tokens_per_step:,} tokens per step.",
           f"3. Maximise throughput: {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU (MFU {100 * t.mfu:.1f}%); "
           f"compute is {100 * (t.breakdown['compute'] + t.breakdown['recompute']) / t.step_s:.0f}% of the "
           f"{t.step_s:.2f} s step, the largest other cost is {_costliest(t)}.",
           f"   What it trades: {_trades(best, gpu)}."]
    out += _why_first(result)
    out += _other_schedules(result)
    return out


def _other_schedules(result) -> list[str]:
    """The first layout's pipeline schedule against the fastest layout of the same sizes under each
    other (schedule, chunks), and the cost that grows most. One in the top group too is not called
    slower: the time model cannot tell."""
    best = result.ranked[0]
    lay = best.layout
    if lay.pp == 1:
        return []
    same = [c for c in result.by_time if (c.layout.dp, c.layout.tp, c.layout.pp, c.layout.cp)
            == (lay.dp, lay.tp, lay.pp, lay.cp) and (c.layout.schedule, c.layout.chunks) != (lay.schedule, lay.chunks)]
    seen, out = set(), []
    for c in same:  # fastest first: the first of each schedule is its best
        key = (c.layout.schedule, c.layout.chunks)
        if key in seen:
            continue
        seen.add(key)
        diffs = {k: c.time.breakdown[k] - best.time.breakdown.get(k, 0.0) for k in c.time.breakdown}
        worse = max(diffs, key=diffs.get)
        cost = f"{worse.replace('_', ' ')} +{diffs[worse]:.3f} s per step"
        if c.top_group:
            verdict = (f"within the time model's error of it (predicted {c.time.tokens_per_s_per_gpu:,.0f} against "
                       f"{best.time.tokens_per_s_per_gpu:,.0f} tokens/s/GPU; {cost})")
        else:
            verdict = f"{pct(c.slower)} slower than the fastest, beyond the model's error ({cost})"
        out.append(f"   vs {_schedule(c.layout)}: {verdict}")
    if out:
        out.insert(0, f"   Pipeline schedule {_schedule(lay)}, against the fastest of each other schedule at these "
                      f"sizes:")
    return out


def nothing_fits(shape, result, gpu, gpus, needed) -> list[str]:
    s = result.smallest
    mem = s.memory.peak
    states = sum(mem.terms[k] for k in ("params", "grads", "optim"))
    out = [f"Nothing fits: none of the {result.enumerated} configurations of {gpus} x {gpu.gpu.name} stays within "
           f"{gpu.memory_gib:.1f} GiB per GPU.",
           f"The smallest per-GPU footprint is {mem.total / GIB:.1f} GiB ({s.layout.label()}): "
           f"{states / GIB:.1f} GiB of model states, {mem.terms['activations'] / GIB:.1f} GiB of activations, "
           f"{(mem.total - mem.terms['activations'] - states) / GIB:.1f} GiB else; it needs "
           f"{(mem.total - gpu.memory_bytes) / GIB:.1f} GiB more per GPU."]
    if needed:
        out.append(f"More sharding needs more GPUs: the first count that fits is {needed} x {gpu.gpu.name} "
                   f"(or a GPU with more memory).")
    else:
        out.append("No count up to 64x as many GPUs fits: shorten the sequence or pick a larger GPU.")
    return out
