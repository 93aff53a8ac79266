"""Words and tables for the planner's answers (the CLI prints these)."""

from __future__ import annotations

from ultrascale.plan.calibration import GIB
from ultrascale.plan.memory import TERMS, verdict
from ultrascale.plan.precision import get_precision

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
    out = [f"{shape.name}: {shape.count():,} parameters ({peak.param_count:,.0f} on this GPU), precision "
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


def table(cands, top: int) -> list[str]:
    head = f"{'#':>3}  {'layout':<62} {'memory':>10} {'step':>8} {'tok/s/GPU':>10} {'MFU':>6}"
    out = [head, "-" * len(head)]
    for i, c in enumerate(cands[:top], 1):
        out.append(f"{i:>3}  {c.layout.label():<62} {c.memory.peak.total / GIB:>6.1f} GiB {c.time.step_s:>7.2f}s "
                   f"{c.time.tokens_per_s_per_gpu:>10,.0f} {100 * c.time.mfu:>5.1f}%")
    return out


def _costliest(t) -> str:
    waits = {k: v for k, v in t.breakdown.items() if k not in ("compute", "recompute")}
    k = max(waits, key=waits.get)
    return f"{k.replace('_', ' ')} ({100 * waits[k] / t.step_s:.0f}% of the step)"


def _why(c, gpu) -> str:
    """The three things a layout trades: memory headroom, the pipeline bubble, exposed communication."""
    t = c.time
    comm = sum(v for k, v in t.breakdown.items() if k.endswith("_comm") or k == "sync")
    return (f"{(gpu.memory_bytes - c.memory.peak.total) / GIB:.1f} GiB of memory headroom, a bubble of "
            f"{100 * t.breakdown.get('bubble', 0.0) / t.step_s:.0f}% and exposed communication of "
            f"{100 * comm / t.step_s:.0f}% of the step")


def explain(shape, result, gpu, gpus, sequences) -> list[str]:
    """The winner in the playbook's three steps."""
    best = result.ranked[0]
    lay, mem, t = best.layout, best.memory.peak, best.time
    states = sum(mem.terms[k] for k in ("params", "grads", "optim"))
    plain = shape.count() * (lambda p: p.param_bytes + p.grad_bytes + p.optim_bytes)(get_precision(lay.precision))
    out = ["Why this one, in the playbook's three steps:",
           f"1. Fit memory: {len(result.ranked)} of {result.enumerated} configurations fit in "
           f"{gpu.memory_gib:.1f} GiB. Unsharded, the model states alone would take {plain / GIB:,.1f} GiB per GPU; "
           f"this layout holds {states / GIB:.1f} GiB of states and {mem.terms['activations'] / GIB:.1f} GiB of "
           f"activations ({mem.in_flight:g} micro-batch(es) in flight), {mem.total / GIB:.1f} GiB in all.",
           f"2. Reach the batch: {lay.micro_batch} (micro-batch) x {lay.grad_accum} (accumulation) x {lay.dp} (dp) = "
           f"{sequences} sequences of {lay.seq_len} tokens = {lay.tokens_per_step:,} tokens per step.",
           f"3. Maximise throughput: {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU (MFU {100 * t.mfu:.1f}%); "
           f"compute is {100 * (t.breakdown['compute'] + t.breakdown['recompute']) / t.step_s:.0f}% of the "
           f"{t.step_s:.2f} s step, the largest other cost is {_costliest(t)}.",
           f"   Why it wins: {_why(best, gpu)}."]
    if len(result.ranked) > 1:
        nxt = result.ranked[1]
        gap = 100 * (1 - nxt.time.tokens_per_s_per_gpu / t.tokens_per_s_per_gpu)
        if gap < 0.05:
            out.append(f"   Runner-up: {nxt.layout.label()}, as fast by this model; the simpler layout is "
                       f"listed first.")
        else:
            out.append(f"   Runner-up: {nxt.layout.label()}, {gap:.1f}% slower (its largest other cost: "
                       f"{_costliest(nxt.time)}).")
    out += _other_schedules(result)
    return out


def _other_schedules(result) -> list[str]:
    """Why the winner's pipeline schedule: the best layout of the same sizes under each other
    (schedule, chunks), and the cost where it loses most."""
    best = result.ranked[0]
    lay = best.layout
    if lay.pp == 1:
        return []
    same = [c for c in result.ranked[1:] if (c.layout.dp, c.layout.tp, c.layout.pp, c.layout.cp)
            == (lay.dp, lay.tp, lay.pp, lay.cp) and (c.layout.schedule, c.layout.chunks) != (lay.schedule, lay.chunks)]
    seen, out = set(), []
    for c in same:  # ranked: the first of each schedule is its best
        key = (c.layout.schedule, c.layout.chunks)
        if key in seen:
            continue
        seen.add(key)
        gap = 100 * (1 - c.time.tokens_per_s_per_gpu / best.time.tokens_per_s_per_gpu)
        diffs = {k: c.time.breakdown[k] - best.time.breakdown.get(k, 0.0) for k in c.time.breakdown}
        worse = max(diffs, key=diffs.get)
        name = c.layout.schedule + (f" v{c.layout.chunks}" if c.layout.chunks > 1 else "")
        out.append(f"   vs {name}: {gap:.1f}% slower ({worse.replace('_', ' ')} +{diffs[worse]:.3f} s per step)")
    if out:
        sched = lay.schedule + (f" v{lay.chunks}" if lay.chunks > 1 else "")
        out.insert(0, f"   Pipeline schedule {sched}, against the best of each other schedule at these sizes:")
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
