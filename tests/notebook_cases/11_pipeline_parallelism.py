"""Cases for Part 11: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

MISTAKES = [
    ("1", "AFAB instead", "that is all forwards, then all backwards (AFAB)", '''
def one_f_one_b_stage(p, stage, m):
    return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
'''),
    ("1", "one warm-up too many", "one warm-up forward too many", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    ("1", "same warm-up everywhere", "every stage warms up with p - 1 forwards", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - 1, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    ("1", "warm-up not capped at m", "cap the warm-up at m", '''
def one_f_one_b_stage(p, stage, m):
    warmup = p - stage - 1
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    ("1", "backward first in steady state", "comes before its forward", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage - 1, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("B", k), ("F", warmup + k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    ("2", "no dependencies", "is one stage's compute alone", '''
def step_time(stages, t_f, t_b):
    busy = max(sum(t_f[s] if kind == "F" else t_b[s] for kind, _ in acts) for s, acts in enumerate(stages))
    return busy, 0.0
'''),
    ("2", "backward does not wait", "lets a backward start before the gradient", '''
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
    ("2", "bubble over step time", "divides the idle time by the step time", '''
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
    # A NaN micro-batch number is not an int: the action check names it (a NaN cannot pass as an action).
    ("1", "idle slots as NaN", "is not an action", '''
def one_f_one_b_stage(p, stage, m):
    warmup = min(p - stage - 1, m)
    actions = [("F", float("nan"))] * stage  # idle until the first micro-batch arrives
    actions += [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]
'''),
    # Clocks started at NaN: Python's max(nan, x) is nan, so every time is NaN, and NaN > tol is False.
    ("2", "clocks start at NaN", "a NaN or an infinity in your (step time, bubble ratio)", '''
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
]

PRINTED = [
    "stage 0: blocks [0, 1] + embedding",
    "stage 3: blocks [6, 7] + final norm, head, loss",
    "naive, p = 4, 8 micro-batches: step time 96, each stage computes 24, bubble ratio 3.00",
    "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    "(worst relative difference",
    "p = 4, m = 64: bubble ratio 0.0469  (p - 1)/m = 0.0469",
    "1f1b: peak activations per rank",
    ", 8.0, 8.0, 8.0]; simulator [8, 8, 8, 8]",
    ", 3.0, 2.0, 1.0]; simulator [4, 3, 2, 1]",
]
