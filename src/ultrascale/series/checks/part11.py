"""Part 11, pipeline parallelism: the 1F1B schedule of one stage, and the step time of a schedule.

Exercise 1 is checked by playing every stage's list together in the engine's pipeline
simulator (ultrascale.parallel.pipeline.simulate), which raises if the stages would wait
on each other forever, and against the definition of 1F1B (warm-up, steady state,
cool-down). Exercise 2 is checked against the same simulator where every stage costs the
same, and against a longest-path computation of the check's own where stages differ; a
wrong answer is recognised by the one rule it breaks, replayed by that computation.
Both exercises ask for what the engine already has: an answer that calls the engine's
schedule or simulator is told to write it.
"""

from __future__ import annotations

import sys

from ultrascale.series.checks import require_finite

CASES_1 = [(4, 8), (4, 4), (4, 3), (2, 5), (3, 1), (1, 3)]


def engine_calls(module: str, fn, *args):
    """fn(*args), and the names of the public functions of `module` it called (directly or not):
    an answer that hands the exercise to the engine shows here, under any name it imported it by."""
    called = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__") == module \
                and not frame.f_code.co_name.startswith(("_", "<")):
            called.add(frame.f_code.co_name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(previous)
    return result, called


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
    where = f"p = {p}, m = {m}, stage {stage}"
    warmup = min(p - stage - 1, m)
    for kind in ("F", "B"):
        ks = [a.micro for a in acts if a.kind == kind]
        if sorted(ks) == list(range(1, m + 1)):
            raise AssertionError(f"{where}: the {kind} passes run micro-batches 1..{m}; the micro-batches are "
                                 f"numbered from 0, as Python counts: 0..{m - 1}")
        extra = sorted(k for k in ks if not 0 <= k < m)
        if extra:
            raise AssertionError(f"{where}: a {kind} of micro-batch {extra[0]}, but there are only m = {m} "
                                 f"(0..{m - 1}): cap the warm-up at m, min(p - stage - 1, m)")
        if sorted(ks) != list(range(m)):
            missing = sorted(set(range(m)) - set(ks))
            if kind == "B" and missing == list(range(m - warmup, m)) and len(ks) == len(set(ks)):
                raise AssertionError(f"{where}: the backwards of micro-batches {missing} never run: after the "
                                     f"steady state comes the cool-down, the backwards of the {warmup} "
                                     f"micro-batches still in flight, range(m - warm-up, m)")
            twice = sorted({k for k in ks if ks.count(k) > 1})
            what = f"misses micro-batches {missing}" if missing else f"repeats micro-batches {twice}"
            raise AssertionError(f"{where}: the {kind} passes {what}; every micro-batch has exactly one "
                                 f"forward and one backward on every stage")
    seen = set()
    for a in acts:
        if a.kind == "F":
            seen.add(a.micro)
        elif a.micro not in seen:
            raise AssertionError(f"{where}: the backward of micro-batch {a.micro} comes before its forward; in "
                                 f"the steady state run the forward first: ('F', k + warm-up), then ('B', k)")


def _warmup(acts) -> int:
    """Forwards before the first backward."""
    n = 0
    while n < len(acts) and acts[n].kind == "F":
        n += 1
    return n


def _warmup_mistake(p, m, warmups):
    """The message for a known wrong warm-up, or None."""
    want = [min(p - s, m) for s in range(p)]  # the warm-up, and the steady state's first forward
    if warmups == want:
        return None
    where = f"p = {p}, m = {m}: forwards before the first backward, stage by stage, {warmups}"
    if all(w == m for w in warmups):
        return (f"{where}: that is all forwards, then all backwards (AFAB): every stage holds all m = {m} "
                f"micro-batches; 1F1B warms up with p - stage - 1 forwards, then alternates: {want} forwards "
                f"before the first backward")
    if warmups == [min(p - s + 1, m) for s in range(p)]:
        return (f"{where}: one warm-up forward too many on each stage (p - stage); 1F1B warms up with "
                f"p - stage - 1, so {want} forwards come before the first backward: the last stage goes "
                f"backward right after its first forward")
    if warmups == [min(p, m)] * p:
        return (f"{where}: every stage warms up with p - 1 forwards; stage s needs only p - s - 1 (its gradient "
                f"comes back sooner): {want} forwards before the first backward, so later stages hold fewer "
                f"micro-batches")
    if warmups == [min(s + 1, m) for s in range(p)]:
        return (f"{where}: the warm-up is counted from the wrong end: stage s warmed up with s forwards, so "
                f"stage 0 waits for a gradient before the others have a micro-batch. The last stage needs no "
                f"warm-up (its forward ends in the loss), stage 0 the longest: min(p - stage - 1, m)")
    return f"{where}; 1F1B warms up with min(p - stage - 1, m) forwards, then alternates forward first: {want}"


def exercise_1(one_f_one_b_stage):
    """one_f_one_b_stage(p, stage, m) -> [('F', k) / ('B', k), ...]: 1F1B on one stage."""
    from ultrascale.parallel.pipeline.schedules import one_f_one_b, with_communication
    from ultrascale.parallel.pipeline.simulate import simulate

    _, called = engine_calls("ultrascale.parallel.pipeline.schedules", one_f_one_b_stage, 4, 0, 8)
    if called:
        raise AssertionError(f"one_f_one_b_stage calls the engine's schedule ({', '.join(sorted(called))}): "
                             f"the exercise is to write it: min(p - stage - 1, m) warm-up forwards, then "
                             f"('F', k + warm-up), ('B', k) in turn, then the cool-down backwards")
    for p, m in CASES_1:
        lists = [_as_actions(p, s, m, one_f_one_b_stage(p, s, m)) for s in range(p)]
        for s, acts in enumerate(lists):
            _valid_order(p, s, m, acts)
        warmups = [_warmup(acts) for acts in lists]
        try:
            tl = simulate(with_communication(lists, p, 1), p)
        except RuntimeError as e:
            known = _warmup_mistake(p, m, warmups)
            raise AssertionError((known + ". " if known else "")
                                 + f"p = {p}, m = {m}: the stages deadlock, each waiting for another "
                                   f"({str(e).split(': ', 1)[-1]}): a stage can run a backward only after the "
                                   f"next stage has run it, and a forward only after the previous one") from None
        known = _warmup_mistake(p, m, warmups)
        if known:
            raise AssertionError(known)
        for s, acts in enumerate(lists):
            ref = one_f_one_b(p, m, s)
            if list(acts) == ref:
                continue
            i = next(i for i, (a, b) in enumerate(zip(acts, ref)) if a != b)
            if all(a.kind == "B" for a in ref[i:]) and sorted(acts[i:]) == sorted(ref[i:]):
                raise AssertionError(
                    f"p = {p}, m = {m}, stage {s}: the cool-down runs {[a.micro for a in acts[i:]]}; the cool-down "
                    f"runs the remaining backwards oldest first, {[a.micro for a in ref[i:]]}: the gradients come "
                    f"back from the next stage in the order the forwards went")
            raise AssertionError(
                f"p = {p}, m = {m}, stage {s}: action {i} is {tuple(acts[i])[:2]}, 1F1B runs "
                f"{tuple(ref[i])[:2]}: after the warm-up, alternate ('F', k + warm-up), ('B', k) for "
                f"k = 0, 1, ... while forwards remain, then the cool-down backwards in order")
        peak = tl.peak_in_flight
        assert peak == [min(p - s, m) for s in range(p)], f"p = {p}, m = {m}: micro-batches in flight {peak}"
    print(f"1F1B is right on every stage for (p, m) in {CASES_1}: no deadlock, warm-up p - stage - 1, "
          f"at most p - stage micro-batches in flight")


# -- exercise 2 ---------------------------------------------------------------------------------

def _reference(lists, t_f, t_b, waits=("F", "B"), start="max", ends="end", durations="own", T="max",
               busy="max", over="busy", order="list"):
    """(step time, bubble ratio): each action starts when its stage is free and its input has
    arrived (F k after F k on the stage before; B k after B k on the stage after). The keywords
    replay one mistake each: which inputs are waited for, how the start combines the stage's clock
    with the input (max; their sum; the input alone), whether a stage waits for the end of the action
    it depends on or its start, stage 0's durations everywhere, the last stage's clock as T, the
    average or total compute as busy, the idle time over T, and (order="ready") a stage that runs the first
    action further down its list whose input is in when the next one's is not."""
    p = len(lists)
    t_f, t_b = ([x[0]] * p for x in (t_f, t_b)) if durations == "stage 0" else (t_f, t_b)
    began, end = {}, {}
    left, clock = [list(acts) for acts in lists], [0.0] * p

    def dep_of(s, kind, k):
        other = s - 1 if kind == "F" else s + 1
        return (kind, k, other) if kind in waits and 0 <= other < p else None

    while any(left):
        moved = False
        for s in range(p):
            while left[s]:
                looked = left[s] if order == "ready" else left[s][:1]
                i = next((i for i, (kind, k) in enumerate(looked) if dep_of(s, kind, k) in end or
                          dep_of(s, kind, k) is None), None)
                if i is None:
                    break
                kind, k = left[s].pop(i)
                dep = dep_of(s, kind, k)
                ready = 0.0 if dep is None else (end if ends == "end" else began)[dep]
                began[(kind, k, s)] = {"max": max(clock[s], ready), "sum": clock[s] + ready,
                                       "input": ready if dep is not None else clock[s]}[start]
                clock[s] = began[(kind, k, s)] + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                moved = True
        if not moved:
            raise RuntimeError("deadlock")
    per_stage = [sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in lists[s]) for s in range(p)]
    compute = {"max": max(per_stage), "mean": sum(per_stage) / p, "sum": sum(per_stage)}[busy]
    makespan = clock[-1] if T == "last stage" else max(clock)
    return makespan, (makespan - compute) / (compute if over == "busy" else makespan)


# Each mistake: the rule it breaks (keywords of _reference), and what to say.
MISTAKES_2 = [
    (dict(waits=()), "is one stage's compute alone: a forward waits for the previous stage's forward of the same "
                     "micro-batch, a backward for the next stage's backward"),
    (dict(waits=("F",)), "lets a backward start before the gradient from the next stage has arrived: B k on "
                         "stage s waits for B k on stage s + 1"),
    (dict(start="sum"), "adds the time the input arrived to the stage's clock: an action starts at the later "
                        "of the two, max(stage free, input arrived), not their sum"),
    (dict(start="input"), "starts an action as soon as its input has arrived, even while the stage is still "
                          "busy: a stage runs one action at a time, so it starts at max(stage free, input "
                          "arrived)"),
    (dict(ends="start"), "starts an action when the stage it waits for starts the same micro-batch: it can go "
                         "only once that stage has finished it, so keep when each action ends"),
    (dict(durations="stage 0"), "uses stage 0's durations on every stage: stage s takes t_f[s] and t_b[s]"),
    (dict(T="last stage"), "is when stage p - 1 finishes; the step ends when every stage has, the latest of "
                           "their clocks (stage 0 runs the step's last backward)"),
    (dict(busy="mean"), "divides by the average compute of the stages: the ratio is over the busiest stage's "
                        "compute, not the average"),
    (dict(busy="sum"), "divides by the compute of all stages together: the ratio is over the busiest stage's "
                       "compute, one stage's work"),
    (dict(order="ready"), "runs, when the next action's input has not arrived, an action further down the "
                          "stage's list whose input has: the schedule is the order of the list; a stage waits "
                          "for its next action's input, and that wait is the bubble it measures"),
    (dict(over="T"), "divides the idle time by the step time; the bubble ratio divides it by the compute time "
                     "of the busiest stage: (T - busy) / busy"),
]


def _lists(name, p, m):
    from ultrascale.parallel.pipeline.schedules import build

    return [[(a.kind, a.micro) for a in acts] for acts in build(name, p, m)]


# The naive schedule too: there a stage that ran ahead to an action further down its list would
# shorten the step (8 units for the list's 12 at p = 3, m = 2, running the first ready one), where 1F1B's and AFAB's orders leave
# nothing to gain.
EQUAL_2 = [("1f1b", 4, 8, 1.0, 2.0), ("afab", 4, 8, 1.0, 2.0), ("1f1b", 2, 3, 0.5, 1.0),
           ("1f1b", 4, 16, 1.0, 2.0), ("afab", 3, 5, 2.0, 3.0), ("naive", 3, 2, 1.0, 1.0), ("naive", 4, 3, 1.0, 2.0)]
# Unequal stages (the last one carries the head and the loss; a slow first stage makes the others
# wait for its forwards): against the definition.
UNEQUAL_2 = [("1f1b", 4, 8, [1.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 3.0]),
             ("afab", 3, 4, [1.5, 1.0, 1.0], [3.0, 2.0, 2.5]),
             ("1f1b", 3, 4, [3.0, 1.0, 3.0], [1.0, 3.0, 1.0])]


def _same(a, b) -> bool:
    return abs(a[0] - b[0]) <= 1e-9 and abs(a[1] - b[1]) <= 1e-9


def exercise_2(step_time):
    """step_time(stages, t_f, t_b) -> (step time, bubble ratio) of per-stage action lists."""
    from ultrascale.parallel.pipeline.schedules import schedule
    from ultrascale.parallel.pipeline.simulate import simulate

    lists = _lists("1f1b", 4, 8)
    _, called = engine_calls("ultrascale.parallel.pipeline.simulate", step_time, [list(x) for x in lists],
                             [1.0] * 4, [2.0] * 4)
    if called:
        raise AssertionError(f"step_time calls the engine's simulator ({', '.join(sorted(called))}): the exercise "
                             f"is to write it: advance each stage through its list while the input of its next "
                             f"action has arrived, keeping when each action ends")
    cases = [(name, p, m, [tf] * p, [tb] * p) for name, p, m, tf, tb in EQUAL_2] + UNEQUAL_2
    runs = []
    for name, p, m, tf, tb in cases:
        lists = _lists(name, p, m)
        got = step_time([list(x) for x in lists], list(tf), list(tb))
        if not isinstance(got, tuple) or len(got) != 2:
            raise AssertionError("return a tuple (step time, bubble ratio)")
        equal = len(set(tf)) == 1 and len(set(tb)) == 1
        where = (f"{name}, p = {p}, m = {m}, " + (f"F = {tf[0]:g}, B = {tb[0]:g} on every stage" if equal
                                                  else f"F per stage {tf}, B per stage {tb}"))
        require_finite(list(got), f"your (step time, bubble ratio) for {where}")
        got = (float(got[0]), float(got[1]))
        if equal:
            tl = simulate(schedule(name, p, m), p, 1, t_f=tf[0], t_b=tb[0], t_w=0.0)
            want = (tl.makespan, tl.bubble_ratio)
            assert _same(want, _reference(lists, tf, tb)), "the check's reference disagrees with the simulator"
        else:
            want = _reference(lists, tf, tb)
        runs.append((where, lists, tf, tb, got, want))
    wrong = [run for run in runs if not _same(run[4], run[5])]
    if not wrong:
        print(f"step time and bubble equal the engine's simulator for {len(EQUAL_2)} schedules, and the "
              f"definition with unequal stages")
        return
    for rule, says in MISTAKES_2:
        replayed = [_reference(lists, tf, tb, **rule) for _, lists, tf, tb, _, _ in runs]
        if all(_same(run[4], r) for run, r in zip(runs, replayed)):
            where, _, _, _, got, want = next(run for run, r in zip(runs, replayed) if not _same(run[5], r))
            raise AssertionError(f"{where}: your (step time, bubble) ({got[0]:g}, {got[1]:.4f}) {says}; the "
                                 f"definition gives ({want[0]:g}, {want[1]:.4f})")
    where, _, _, _, got, want = wrong[0]
    what = "step time" if abs(got[0] - want[0]) > 1e-9 else "bubble ratio"
    raise AssertionError(f"{where}: got ({got[0]:g}, {got[1]:.4f}), want ({want[0]:g}, {want[1]:.4f}) (the engine's "
                         f"simulator, or the definition where stages differ): your {what} differs. An action "
                         f"starts at max(stage free, input arrived) and takes its own stage's time; "
                         f"bubble = (T - busy) / busy, busy the busiest stage's compute")
