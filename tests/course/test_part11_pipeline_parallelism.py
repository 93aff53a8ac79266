"""Part 11's answers: the 1F1B schedule of one stage, and the step time and bubble of a schedule."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 11

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "AFAB instead", "that is all forwards, then all backwards (AFAB)", '''
def one_f_one_b_stage(p, stage, m):
    return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
'''),
    (1, "one warm-up too many", "one warm-up forward too many", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    (1, "same warm-up everywhere", "every stage warms up with p - 1 forwards", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - 1, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    (1, "warm-up not capped at m", "cap the warm-up at m", '''
def one_f_one_b_stage(p, stage, m):
    warmup = p - stage - 1
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    (1, "backward first in steady state", "comes before its forward", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage - 1, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("B", k), ("F", warmup + k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    # A NaN micro-batch number is not an int: the action check names it.
    (1, "idle slots as NaN", "is not an action", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage - 1, m)
    actions = [("F", float("nan"))] * stage  # idle until the first micro-batch arrives
    actions += [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    (1, "micro-batches counted from 1", "micro-batches are numbered from 0", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage - 1, m)
    actions = [("F", k) for k in range(1, warmup + 1)]
    for k in range(1, m - warmup + 1):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup + 1, m + 1)]
'''),
    (1, "warm-up counted from the wrong end", "counted from the wrong end", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(stage, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    (1, "cool-down newest first", "the cool-down runs the remaining backwards oldest first", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage - 1, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in reversed(range(m - warmup, m))]
'''),
    (1, "cool-down forgotten", "the cool-down", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage - 1, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions
'''),
    (1, "the engine's schedule copied", "calls the engine's schedule", '''
def one_f_one_b_stage(p, stage, m):
    return [(a.kind, a.micro) for a in build("1f1b", p, m)[stage]]
'''),
    (2, "no dependencies", "is one stage's compute alone", '''
def step_time(stages, t_f, t_b):
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in acts) for s, acts in enumerate(stages))
    return busy, 0.0
'''),
    (2, "backward does not wait", "lets a backward start before the gradient", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    end, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                dep = ("F", k, s - 1) if kind == "F" and s > 0 else None
                if dep is not None and dep not in end:
                    break
                clock[s] = max(clock[s], end.get(dep, 0.0)) + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    return max(clock), (max(clock) - busy) / busy
'''),
    # A stage that runs ahead to whatever action is ready: no schedule's order of the list, so the naive
    # schedule's step is shorter than the list makes it.
    (2, "runs the first ready action", "an action further down the stage's list", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    left = [list(acts) for acts in stages]
    end, clock = {}, [0.0] * p

    def dep(s, kind, k):
        other = s - 1 if kind == "F" else s + 1
        return (kind, k, other) if 0 <= other < p else None

    while any(left):
        for s in range(p):
            while True:
                ready = [a for a in left[s] if dep(s, *a) is None or dep(s, *a) in end]
                if not ready:
                    break
                kind, k = ready[0]
                left[s].remove((kind, k))
                clock[s] = max(clock[s], end.get(dep(s, kind, k), 0.0)) + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    return max(clock), (max(clock) - busy) / busy
'''),
    (2, "bubble over step time", "divides the idle time by the step time", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    end, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 else None
                if dep is not None and dep not in end:
                    break
                clock[s] = max(clock[s], end.get(dep, 0.0)) + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    return max(clock), (max(clock) - busy) / max(clock)
'''),
    # Clocks started at NaN: Python's max(nan, x) is nan, so every time is NaN, and NaN > tol is False.
    (2, "clocks start at NaN", "a NaN or an infinity in your (step time, bubble ratio)", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    end, pos, clock = {}, [0] * p, [float("nan")] * p  # not started yet
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 else None
                if dep is not None and dep not in end:
                    break
                clock[s] = max(clock[s], end.get(dep, 0.0)) + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    return max(clock), (max(clock) - busy) / busy
'''),
    (2, "waiting added instead of max", "not their sum", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    end, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 else None
                if dep is not None and dep not in end:
                    break
                clock[s] = clock[s] + end.get(dep, 0.0) + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    return max(clock), (max(clock) - busy) / busy
'''),
    (2, "a stage runs two actions at once", "a stage runs one action at a time", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    end, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 else None
                if dep is not None and dep not in end:
                    break
                start = end[dep] if dep is not None else clock[s]  # the input is there: go
                clock[s] = start + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    T = max(clock)
    return T, (T - busy) / busy
'''),
    (2, "waits for the start, not the end", "has finished it", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    began, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 else None
                if dep is not None and dep not in began:
                    break
                start = max(clock[s], began.get(dep, 0.0))
                began[(kind, k, s)] = start
                clock[s] = start + (t_f[s] if kind == "F" else t_b[s])
                pos[s] += 1
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    return max(clock), (max(clock) - busy) / busy
'''),
    (2, "stage 0's durations everywhere", "stage 0's durations on every stage", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    tf, tb = t_f[0], t_b[0]  # every stage runs the same layers
    end, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 else None
                if dep is not None and dep not in end:
                    break
                clock[s] = max(clock[s], end.get(dep, 0.0)) + (tf if kind == "F" else tb)
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
    busy = max(sum(tf if kind == "F" else tb for kind, _ in stages[s]) for s in range(p))
    return max(clock), (max(clock) - busy) / busy
'''),
    (2, "busy averaged over stages", "the busiest stage's compute, not the average", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    end, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 else None
                if dep is not None and dep not in end:
                    break
                clock[s] = max(clock[s], end.get(dep, 0.0)) + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
    busy = sum(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p)) / p
    return max(clock), (max(clock) - busy) / busy
'''),
    (2, "the last stage's clock", "when stage p - 1 finishes", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    end, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(stages[s]):
                kind, k = stages[s][pos[s]]
                if kind == "F":
                    dep = ("F", k, s - 1) if s > 0 else None
                else:
                    dep = ("B", k, s + 1) if s < p - 1 else None
                if dep is not None and dep not in end:
                    break
                clock[s] = max(clock[s], end.get(dep, 0.0)) + (t_f[s] if kind == "F" else t_b[s])
                end[(kind, k, s)] = clock[s]
                pos[s] += 1
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    T = clock[p - 1]  # the last stage
    return T, (T - busy) / busy
'''),
    (2, "the engine's simulator called", "calls the engine's simulator", '''
from ultrascale.parallel.pipeline.schedules import Action, with_communication


def step_time(stages, t_f, t_b):
    p = len(stages)
    lists = [[Action(kind, k) for kind, k in acts] for acts in stages]
    tl = simulate(with_communication(lists, p, 1), p, t_f=t_f[0], t_b=t_b[0], t_w=0.0)
    return tl.makespan, tl.bubble_ratio
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "two counters in one loop", '''
def one_f_one_b_stage(p, stage, m):
    actions, f, b = [], 0, 0
    while f < min(p - stage - 1, m):
        actions.append(("F", f))
        f += 1
    while b < m:
        if f < m:
            actions.append(("F", f))
            f += 1
        actions.append(("B", b))
        b += 1
    return actions
'''),
    (1, "lists, zipped steady state", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage - 1, m)
    steady = [x for f, b in zip(range(warmup, m), range(m)) for x in (["F", f], ["B", b])]
    return [["F", k] for k in range(warmup)] + steady + [["B", k] for k in range(m - warmup, m)]
'''),
    (1, "a tuple of tuples", '''
def one_f_one_b_stage(p, stage, m):
    in_flight = min(p - stage - 1, m)
    order = tuple(("F", k) for k in range(in_flight))
    for k in range(m):
        if k + in_flight < m:
            order += (("F", k + in_flight),)
        order += (("B", k),)
    return order
'''),
    (2, "longest path, recursive", '''
import functools


def step_time(stages, t_f, t_b):
    p = len(stages)
    index = {(s, a[0], a[1]): i for s in range(p) for i, a in enumerate(stages[s])}

    @functools.lru_cache(maxsize=None)
    def finish(s, i):
        kind, k = stages[s][i]
        ready = finish(s, i - 1) if i > 0 else 0.0
        other = s - 1 if kind == "F" else s + 1
        if 0 <= other < p:
            ready = max(ready, finish(other, index[(other, kind, k)]))
        return ready + (t_f[s] if kind == "F" else t_b[s])

    T = max(finish(s, len(stages[s]) - 1) for s in range(p))
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    return T, (T - busy) / busy
'''),
    (2, "stage 0 finishes last", '''
def step_time(stages, t_f, t_b):
    p = len(stages)
    done, nxt, free = {}, [0] * p, [0.0] * p
    progress = True
    while progress:
        progress = False
        for s in reversed(range(p)):
            if nxt[s] == len(stages[s]):
                continue
            kind, k = stages[s][nxt[s]]
            src = s - 1 if kind == "F" else s + 1
            if 0 <= src < p and (kind, k, src) not in done:
                continue
            start = max(free[s], done.get((kind, k, src), 0.0))
            free[s] = start + (t_f[s] if kind == "F" else t_b[s])
            done[(kind, k, s)] = free[s]
            nxt[s] += 1
            progress = True
    T = free[0]  # stage 0 runs the step's last backward
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in stages[s]) for s in range(p))
    return T, T / busy - 1
'''),
]
