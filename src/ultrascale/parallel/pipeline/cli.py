"""`ultrascale pp-schedule`: print and draw a pipeline schedule, simulated or recorded."""

from __future__ import annotations

import os

from ultrascale.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("pp-schedule", help="simulate and draw a pipeline schedule (or a recorded one)")
    p.add_argument("--schedule", default="1f1b", help="naive, afab, 1f1b, interleaved, zero-bubble or dualpipev "
                                                        "(dualpipe: its cut-in-half V form)")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved; dualpipev: 2)")
    p.add_argument("--t-f", type=float, default=1.0, help="forward time of one chunk")
    p.add_argument("--t-b", type=float, default=1.0, help="input-gradient time of one chunk")
    p.add_argument("--t-w", type=float, default=1.0, help="weight-gradient time of one chunk")
    p.add_argument("--t-comm", type=float, default=0.0, help="time of one point-to-point message")
    p.add_argument("--trace", help="draw a timeline recorded by a training run's --pp-trace FILE instead")
    p.add_argument("--actions", action="store_true", help="print every rank's action list")
    p.add_argument("--out", help="write the Gantt chart to this PNG file")
    p.set_defaults(func=cmd_pp_schedule)


def _check_times(args) -> None:
    """Times the simulator can take: forward and backward last some time, the others may be zero."""
    import math

    for flag, value, least in (("--t-f", args.t_f, "positive"), ("--t-b", args.t_b, "positive"),
                               ("--t-w", args.t_w, "zero or more"), ("--t-comm", args.t_comm, "zero or more")):
        if not math.isfinite(value) or value < 0 or (value == 0 and least == "positive"):
            raise ConfigError(f"{flag} must be a finite number, {least}; got {value:g}")


def cmd_pp_schedule(args) -> int:
    from ultrascale.parallel.pipeline import draw
    from ultrascale.preflight import check_writable_file

    _check_times(args)
    if args.out:
        check_writable_file("--out", args.out)  # before the simulation, not after it
    if args.trace:
        if not os.path.isfile(args.trace):
            raise ConfigError(f"--trace {args.trace}: no such file; write one with the train command's --pp-trace FILE")
        trace = draw.read_trace(args.trace)
        spans = draw.trace_spans(trace)
        ratio = draw.measured_bubble_ratio(spans)
        name, p, v = trace["schedule"], trace["pp"], trace["chunks"]
        print(f"recorded {name}: pp {p}, chunks {v}: measured bubble ratio {ratio:.4f}")
        if all("clock" in x for rank in trace["ranks"] for x in rank):
            # What the runtime's order and its messages alone make of the step, whatever the load.
            clocked = draw.measured_bubble_ratio(draw.trace_spans(trace, clock=True))
            print(f"on the schedule's clock (each action its unit cost, each message its sender's clock): "
                  f"bubble ratio {clocked:.4f}")
        title = f"{name}, pp={p}" + (f", v={v}" if v > 1 else "") + f": measured bubble {ratio:.3f}"
    else:
        from ultrascale.config import PP_SCHEDULE_ALIASES
        from ultrascale.parallel.pipeline.partition import v_shaped
        from ultrascale.parallel.pipeline.schedules import build, chunks_of, with_communication
        from ultrascale.parallel.pipeline.simulate import simulate

        p, m = args.pp, args.micro_batches
        name = PP_SCHEDULE_ALIASES.get(args.schedule, args.schedule)
        v, vshape = chunks_of(name, args.chunks), v_shaped(name)
        try:
            actions = with_communication(build(name, p, m, v), p, v, vshape)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        tl = simulate(actions, p, v, args.t_f, args.t_b, args.t_w, args.t_comm, vshape)
        print(f"{name}: pp {p}, micro-batches {m}, chunks {v}" + (" (in a V)" if vshape else ""))
        print(f"bubble ratio {tl.bubble_ratio:.4f} (bubble time {tl.bubble_time:g}, step time {tl.makespan:g})")
        print(f"peak in-flight micro-batches per rank: {tl.peak_in_flight}"
              + (" (chunk activations: each 1/v of a stage's)" if v > 1 else ""))
        # Every schedule here keeps one copy of the weights; full DualPipe would keep two per rank.
        print(f"parameters per rank: {v} of {p * v} virtual stages, one copy")
        if args.actions:
            for r, acts in enumerate(actions):
                print(f"rank {r}: " + " ".join(map(repr, acts)))
        spans = draw.spans_from_timeline(tl)
        title = (f"{name}, pp={p}, m={m}" + (f", v={v}" if v > 1 else "")
                 + f": bubble {tl.bubble_ratio:.3f}")
    if args.out:
        draw.draw(spans, title, args.out)
        print(f"wrote {args.out}")
    return 0
