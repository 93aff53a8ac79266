"""Part 11, pipeline parallelism: the 1F1B schedule of one stage, and the step time of a schedule.

Exercise 1 is checked by playing every stage's list together in the engine's pipeline
simulator (ultrascale.parallel.pipeline.simulate), which raises if the stages would wait
on each other forever, and against the definition of 1F1B (warm-up, steady state,
cool-down). Exercise 2 is checked against the same simulator where every stage costs the
same, and against a longest-path computation of the check's own where stages differ.
"""

from __future__ import annotations

from ultrascale.series.checks import require_finite

CASES_1 = [(4, 8), (4, 4), (4, 3), (2, 5), (3, 1), (1, 3)]


def _as_actions(p, stage, m, got):
    from ultrascale.parallel.pipeline.schedules import Action

    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"return a list of ('F', micro_batch) / ('B', micro_batch), got {type(got).__name__}")
    out = []
    for item in got:
        if (not isinstance(item, (list, tuple)) or len(item) != 2 or item[0] not in ("F", "B")
                or not isinstance(item[1], int)):
            raise AssertionError(f"stage {stage}: {item!r} is not an action: write ('F', k) or ('B', k), "
                                 f"k the micro-batch number")
        out.append(Action(item[0], item[1]))
    return out


def _valid_order(p, stage, m, acts):
    for kind in ("F", "B"):
        ks = [a.micro for a in acts if a.kind == kind]
        extra = sorted(k for k in ks if not 0 <= k < m)
        if extra:
            raise AssertionError(f"p = {p}, m = {m}, stage {stage}: a {kind} of micro-batch {extra[0]}, but there "
                                 f"are only m = {m} (0..{m - 1}): cap the warm-up at m, min(p - stage - 1, m)")
        if sorted(ks) != list(range(m)):
            missing = sorted(set(range(m)) - set(ks))
            twice = sorted({k for k in ks if ks.count(k) > 1})
            what = f"misses micro-batches {missing}" if missing else f"repeats micro-batches {twice}"
            raise AssertionError(f"p = {p}, m = {m}, stage {stage}: the {kind} passes {what}; every micro-batch "
                                 f"has exactly one forward and one backward on every stage")
    seen = set()
    for a in acts:
        if a.kind == "F":
            seen.add(a.micro)
        elif a.micro not in seen:
            raise AssertionError(f"p = {p}, m = {m}, stage {stage}: the backward of micro-batch {a.micro} comes "
                                 f"before its forward; in the steady state run the forward first: "
                                 f"('F', k + warm-up), then ('B', k)")


def exercise_1(one_f_one_b_stage):
    """one_f_one_b_stage(p, stage, m) -> [('F', k) / ('B', k), ...]: 1F1B on one stage."""
    from ultrascale.parallel.pipeline.schedules import one_f_one_b, with_communication
    from ultrascale.parallel.pipeline.simulate import simulate

    for p, m in CASES_1:
        lists = [_as_actions(p, s, m, one_f_one_b_stage(p, s, m)) for s in range(p)]
        for s, acts in enumerate(lists):
            _valid_order(p, s, m, acts)
        try:
            tl = simulate(with_communication(lists, p, 1), p)
        except RuntimeError as e:
            raise AssertionError(f"p = {p}, m = {m}: the stages deadlock, each waiting for another "
                                 f"({str(e).split(': ', 1)[-1]}): a stage can run a backward only after the "
                                 f"next stage has run it, and a forward only after the previous one") from None
        warmups = []
        for acts in lists:
            n = 0
            while n < len(acts) and acts[n].kind == "F":
                n += 1
            warmups.append(n)
        want = [min(p - s, m) for s in range(p)]  # the warm-up, and the steady state's first forward
        if warmups != want:
            where = f"p = {p}, m = {m}: forwards before the first backward, stage by stage, {warmups}"
            if all(w == m for w in warmups):
                raise AssertionError(f"{where}: that is all forwards, then all backwards (AFAB): every stage "
                                     f"holds all m = {m} micro-batches; 1F1B warms up with p - stage - 1 "
                                     f"forwards, then alternates: {want} forwards before the first backward")
            if warmups == [min(p - s + 1, m) for s in range(p)]:
                raise AssertionError(f"{where}: one warm-up forward too many on each stage (p - stage); 1F1B "
                                     f"warms up with p - stage - 1, so {want} forwards come before the first "
                                     f"backward: the last stage "
                                     f"goes backward right after its first forward")
            if warmups == [min(p, m)] * p:
                raise AssertionError(f"{where}: every stage warms up with p - 1 forwards; stage s needs only "
                                     f"p - s - 1 (its gradient comes back sooner): {want} forwards before the first "
                                     f"backward, so later stages hold fewer micro-batches")
            raise AssertionError(f"{where}; 1F1B warms up with min(p - stage - 1, m) forwards, then "
                                 f"alternates forward first: {want}")
        for s, acts in enumerate(lists):
            ref = one_f_one_b(p, m, s)
            if list(acts) != ref:
                i = next(i for i, (a, b) in enumerate(zip(acts, ref)) if a != b)
                raise AssertionError(
                    f"p = {p}, m = {m}, stage {s}: action {i} is {tuple(acts[i])[:2]}, 1F1B runs "
                    f"{tuple(ref[i])[:2]}: after the warm-up, alternate ('F', k + warm-up), ('B', k) for "
                    f"k = 0, 1, ... while forwards remain, then the cool-down backwards in order")
        peak = tl.peak_in_flight
        assert peak == [min(p - s, m) for s in range(p)], f"p = {p}, m = {m}: micro-batches in flight {peak}"
    print(f"1F1B is right on every stage for (p, m) in {CASES_1}: no deadlock, warm-up p - stage - 1, "
          f"at most p - stage micro-batches in flight")


# -- exercise 2 ---------------------------------------------------------------------------------

def _reference(lists, t_f, t_b, backward_waits=True):
    """(step time, bubble ratio): each action starts when its stage is free and its input has
    arrived (F k after F k on the stage before; B k after B k on the stage after)."""
    p = len(lists)
    end = {}
    pos, clock = [0] * p, [0.0] * p
    while any(pos[s] < len(lists[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(lists[s]):
                kind, k = lists[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 and backward_waits else None
                if dep is not None and dep not in end:
                    break
                start = max(clock[s], end[dep] if dep is not None else 0.0)
                clock[s] = start + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("deadlock")
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in lists[s]) for s in range(p))
    makespan = max(clock)
    return makespan, (makespan - busy) / busy


def _lists(name, p, m):
    from ultrascale.parallel.pipeline.schedules import build

    return [[(a.kind, a.micro) for a in acts] for acts in build(name, p, m)]


def exercise_2(step_time):
    """step_time(stages, t_f, t_b) -> (step time, bubble ratio) of per-stage action lists."""
    from ultrascale.parallel.pipeline.schedules import schedule
    from ultrascale.parallel.pipeline.simulate import simulate

    cases = [("1f1b", 4, 8, 1.0, 2.0), ("afab", 4, 8, 1.0, 2.0), ("1f1b", 2, 3, 0.5, 1.0),
             ("1f1b", 4, 16, 1.0, 2.0), ("afab", 3, 5, 2.0, 3.0)]
    for name, p, m, tf, tb in cases:
        lists = _lists(name, p, m)
        got = step_time([list(x) for x in lists], [tf] * p, [tb] * p)
        if not isinstance(got, tuple) or len(got) != 2:
            raise AssertionError("return a tuple (step time, bubble ratio)")
        T, bubble = float(got[0]), float(got[1])
        tl = simulate(schedule(name, p, m), p, 1, t_f=tf, t_b=tb, t_w=0.0)
        busy = max(tl.busy)
        where = f"{name}, p = {p}, m = {m}, F = {tf:g}, B = {tb:g} on every stage"
        require_finite([T, bubble], f"your (step time, bubble ratio) for {where}")
        if not abs(T - tl.makespan) <= 1e-9:
            if abs(T - busy) < 1e-9:
                raise AssertionError(f"{where}: your step time {T:g} is one stage's compute alone; a forward "
                                     f"waits for the previous stage's forward of the same micro-batch, a "
                                     f"backward for the next stage's backward: the engine's simulator gives "
                                     f"{tl.makespan:g}")
            no_b = _reference(lists, [tf] * p, [tb] * p, backward_waits=False)[0]
            if abs(T - no_b) < 1e-9:
                raise AssertionError(f"{where}: your step time {T:g} lets a backward start before the "
                                     f"gradient from the next stage has arrived: B k on stage s waits for "
                                     f"B k on stage s + 1 (the simulator gives {tl.makespan:g})")
            raise AssertionError(f"{where}: step time {T:g}, the engine's simulator gives {tl.makespan:g}")
        if not abs(bubble - tl.bubble_ratio) <= 1e-9:
            if abs(bubble - (T - busy) / T) < 1e-9:
                raise AssertionError(f"{where}: your bubble {bubble:.4f} divides the idle time by the step time; "
                                     f"the bubble ratio divides it by the compute time of the busiest stage: "
                                     f"(T - busy) / busy = {tl.bubble_ratio:.4f}")
            raise AssertionError(f"{where}: bubble {bubble:.4f}, the engine's simulator gives "
                                 f"{tl.bubble_ratio:.4f} = (T - busy) / busy")
    # Unequal stages (the last one carries the head and the loss): against the definition.
    for name, p, m, tf, tb in [("1f1b", 4, 8, [1.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 3.0]),
                               ("afab", 3, 4, [1.5, 1.0, 1.0], [3.0, 2.0, 2.5])]:
        lists = _lists(name, p, m)
        T, bubble = (float(x) for x in step_time([list(x) for x in lists], list(tf), list(tb)))
        want_T, want_bubble = _reference(lists, tf, tb)
        where = f"{name}, p = {p}, m = {m}, F per stage {tf}, B per stage {tb}"
        require_finite([T, bubble], f"your (step time, bubble ratio) for {where}")
        if not (abs(T - want_T) <= 1e-9 and abs(bubble - want_bubble) <= 1e-9):
            raise AssertionError(f"{where}: got ({T:g}, {bubble:.4f}), want ({want_T:g}, {want_bubble:.4f}): "
                                 f"use each stage's own durations, and the busiest stage's compute for the ratio")
    print(f"step time and bubble equal the engine's simulator for {len(cases)} schedules, and the definition "
          f"with unequal stages")
