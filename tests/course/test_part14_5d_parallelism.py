"""Part 14's answers: a rank's place on the dp x pp x cp x tp grid (its coordinates and its tp, dp and pp
groups), and the small configuration search that ranks what fits by throughput."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 14

_COORDS = '''
def grid_position(rank, dp, pp, cp, tp):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    coords, rem = {}, rank
    for name in ("tp", "cp", "pp", "dp"):
        coords[name] = rem % sizes[name]
        rem //= sizes[name]
'''

_FITS = '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = []
    for tp in range(1, 9):
        for pp in range(1, gpus + 1):
            if gpus % (tp * pp) or heads % tp or layers % pp:
                continue
            dp = gpus // (tp * pp)
            if sequences % dp == 0 and memory_per_gpu(dp, pp, tp) <= limit:
                fits.append((dp, pp, tp))
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
'''

WRONG = [  # (exercise, label, what the check must say, answer source)
    (2, 'memory strictly below the limit', 'needs exactly the limit', '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = []
    for tp in range(1, 9):
        for pp in range(1, gpus + 1):
            if gpus % (tp * pp) or heads % tp or layers % pp:
                continue
            dp = gpus // (tp * pp)
            if sequences % dp == 0 and memory_per_gpu(dp, pp, tp) < limit:
                fits.append((dp, pp, tp))
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    ties = [lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best]
    return min(ties, key=lambda lay: (lay[1], lay[2]))
'''),
    (2, 'a tie strictly above 0.99', 'that is a tie (>= 0.99 x the best)', '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = []
    for tp in range(1, 9):
        for pp in range(1, gpus + 1):
            if gpus % (tp * pp) or heads % tp or layers % pp:
                continue
            dp = gpus // (tp * pp)
            if sequences % dp == 0 and memory_per_gpu(dp, pp, tp) <= limit:
                fits.append((dp, pp, tp))
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    ties = [lay for lay in fits if tokens_per_s(*lay) > 0.99 * best]
    return min(ties, key=lambda lay: (lay[1], lay[2]))
'''),
    (1, "dp innermost", "as if dp were innermost", '''
def grid_position(rank, dp, pp, cp, tp):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    coords, rem = {}, rank
    for name in ("dp", "pp", "cp", "tp"):
        coords[name] = rem % sizes[name]
        rem //= sizes[name]
    strides = {"dp": 1, "pp": dp, "cp": dp * pp, "tp": dp * pp * cp}
    groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(sizes[n])]
              for n in ("tp", "dp", "pp")}
    return coords, groups
'''),
    (1, "tp outermost", "as if tp were outermost", '''
def grid_position(rank, dp, pp, cp, tp):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    coords, rem = {}, rank
    for name in ("cp", "pp", "dp", "tp"):
        coords[name] = rem % sizes[name]
        rem //= sizes[name]
    strides = {"cp": 1, "pp": cp, "dp": cp * pp, "tp": cp * pp * dp}
    groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(sizes[n])]
              for n in ("tp", "dp", "pp")}
    return coords, groups
'''),
    (1, "pp and cp swapped", "reshape(dp, cp, pp, tp)", '''
def grid_position(rank, dp, pp, cp, tp):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    coords, rem = {}, rank
    for name in ("tp", "pp", "cp", "dp"):
        coords[name] = rem % sizes[name]
        rem //= sizes[name]
    strides = {"tp": 1, "pp": tp, "cp": pp * tp, "dp": pp * cp * tp}
    groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(sizes[n])]
              for n in ("tp", "dp", "pp")}
    return coords, groups
'''),
    (1, "dp group of consecutive ranks", "your dp group [0, 1] is made of consecutive ranks", _COORDS + '''
    groups = {"tp": [rank - coords["tp"] + i for i in range(tp)],
              "dp": [rank // dp * dp + i for i in range(dp)],
              "pp": [rank - coords["pp"] * cp * tp + i * cp * tp for i in range(pp)]}
    return coords, groups
'''),
    (1, "pp stride forgets cp", "pp neighbours are cp x tp = 4 ranks apart", _COORDS + '''
    strides = {"tp": 1, "pp": tp, "dp": pp * cp * tp}
    groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(sizes[n])]
              for n in ("tp", "dp", "pp")}
    return coords, groups
'''),
    (1, "own rank first", "right ranks in another order", _COORDS + '''
    strides = {"tp": 1, "cp": tp, "pp": cp * tp, "dp": pp * cp * tp}
    groups = {}
    for n in ("tp", "dp", "pp"):
        first = rank - coords[n] * strides[n]
        groups[n] = [first + (coords[n] + i) % sizes[n] * strides[n] for i in range(sizes[n])]
    return coords, groups
'''),
    (1, "groups start at index 1", "off by one stride", _COORDS + '''
    strides = {"tp": 1, "cp": tp, "pp": cp * tp, "dp": pp * cp * tp}
    groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(1, sizes[n] + 1)]
              for n in ("tp", "dp", "pp")}
    return coords, groups
'''),
    (1, "tp group spans the cp block", "your tp group has 4 ranks", _COORDS + '''
    strides = {"tp": 1, "cp": tp, "pp": cp * tp, "dp": pp * cp * tp}
    groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(sizes[n])] for n in ("dp", "pp")}
    block = rank // (cp * tp) * (cp * tp)
    groups["tp"] = list(range(block, block + cp * tp))
    return coords, groups
'''),
    (1, "cp left out of the coordinates", "every size counts, cp included", '''
def grid_position(rank, dp, pp, cp, tp):
    coords = {"tp": rank % tp, "cp": 0, "pp": rank // tp % pp, "dp": rank // (tp * pp)}
    strides = {"tp": 1, "pp": cp * tp, "dp": pp * cp * tp}
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(sizes[n])]
              for n in ("tp", "dp", "pp")}
    return coords, groups
'''),
    (1, "asks the engine for the groups", "asks the engine", _COORDS + '''
    config = ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp)
    every = grid_groups(config, dp * pp * cp * tp)
    groups = {n: next(g for g in every[n] if rank in g) for n in ("tp", "dp", "pp")}
    return coords, groups
'''),
    (1, "its own rank from torch.distributed", "use the `rank` argument", '''
def grid_position(rank, dp, pp, cp, tp):
    rank = dist.get_rank()
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    coords, rem = {}, rank
    for name in ("tp", "cp", "pp", "dp"):
        coords[name] = rem % sizes[name]
        rem //= sizes[name]
    strides = {"tp": 1, "cp": tp, "pp": cp * tp, "dp": pp * cp * tp}
    groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(sizes[n])]
              for n in ("tp", "dp", "pp")}
    return coords, groups
'''),
    # Coordinates marked NaN until computed, and the size-1 dimensions skipped: int(nan) crashed the check.
    (1, "size-1 dimensions left NaN", "a NaN or an infinity in what grid_position(", '''
def grid_position(rank, dp, pp, cp, tp):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    coords, rem = dict.fromkeys(sizes, float("nan")), rank
    for name in ("tp", "cp", "pp", "dp"):
        if sizes[name] > 1:
            coords[name] = rem % sizes[name]
            rem //= sizes[name]
    strides = {"tp": 1, "cp": tp, "pp": cp * tp, "dp": pp * cp * tp}
    groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(sizes[n])]
              for n in ("tp", "dp", "pp")}
    return coords, groups
'''),
    (2, "tp across nodes", "spans more than one 8-GPU node", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, gpus + 1) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
            and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
'''),
    (2, "powers of two only", "your search never looked at (1, 2, 6)", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    twos = [1, 2, 4, 8, 16, 32, 64, 128]
    fits = [(gpus // (tp * pp), pp, tp) for tp in twos if tp <= 8 for pp in twos if pp <= gpus
            if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
            and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
'''),
    (2, "tp stops at 7", "never looked at", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 8) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
            and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
'''),
    (2, "tp ignores the heads", "does not divide the 12 attention heads", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and layers % pp == 0
            and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
'''),
    (2, "pp ignores the layers", "does not divide the 6 layers", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and heads % tp == 0
            and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
'''),
    (2, "batch split ignored", "does not divide the 4 sequences", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
            and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
'''),
    (2, "dp as a float", "return a tuple of three ints", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus / (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
            and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    if not fits:
        return None
    best = max(tokens_per_s(*lay) for lay in fits)
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
'''),
    (2, "never checks memory", "above the limit", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
            and sequences % (gpus // (tp * pp)) == 0]
    best = max(tokens_per_s(*lay) for lay in fits)
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
'''),
    (2, "least memory wins", "you chose a layout that needs the least memory", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
            and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    return min(fits, key=lambda lay: memory_per_gpu(*lay)) if fits else None
'''),
    (2, "returns (dp, tp, pp)", "in the order (dp, tp, pp); return (dp, pp, tp)", _FITS + '''
    dp, pp, tp = min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
    return dp, tp, pp
'''),
    (2, "no tie rule", "a tie the time model cannot tell apart", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
            and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    return max(fits, key=lambda lay: tokens_per_s(*lay)) if fits else None
'''),
    (2, "ties broken by tp first", "fewest pipeline stages first", _FITS + '''
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[2], lay[1]))
'''),
    (2, "the planner's quarter as the tie band", "a tie is within 1%", _FITS + '''
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.75 * best), key=lambda lay: (lay[1], lay[2]))
'''),
    # NaNs for "no layout": the check asks for None (a NaN is no int, so it cannot pass as a layout either).
    (2, "NaN when nothing fits", "no layout fits in memory, return None", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
            if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
            and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
    if not fits:
        return (float("nan"),) * 3
    best = max(tokens_per_s(*lay) for lay in fits)
    return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "indexes torch's grid", '''
def grid_position(rank, dp, pp, cp, tp):
    grid = torch.arange(dp * pp * cp * tp).reshape(dp, pp, cp, tp)
    d, p, c, t = (int(i) for i in (grid == rank).nonzero()[0])
    coords = {"dp": d, "pp": p, "cp": c, "tp": t}
    groups = {"tp": grid[d, p, c, :].tolist(), "dp": grid[:, p, c, t].tolist(), "pp": grid[d, :, c, t].tolist()}
    return coords, groups
'''),
    (1, "divmod outermost first", '''
def grid_position(rank, dp, pp, cp, tp):
    d, rest = divmod(rank, pp * cp * tp)
    p, rest = divmod(rest, cp * tp)
    c, t = divmod(rest, tp)
    coords = dict(dp=d, pp=p, cp=c, tp=t)

    def rank_of(d, p, c, t):
        return ((d * pp + p) * cp + c) * tp + t

    groups = {"tp": [rank_of(d, p, c, i) for i in range(tp)],
              "dp": [rank_of(i, p, c, t) for i in range(dp)],
              "pp": [rank_of(d, i, c, t) for i in range(pp)]}
    return coords, groups
'''),
    (1, "numpy's unravel_index", '''
import numpy as np


def grid_position(rank, dp, pp, cp, tp):
    shape = (dp, pp, cp, tp)
    index = np.unravel_index(rank, shape)
    coords = dict(zip(("dp", "pp", "cp", "tp"), (int(i) for i in index)))
    groups = {}
    for axis, name in ((3, "tp"), (0, "dp"), (1, "pp")):
        members = []
        for i in range(shape[axis]):
            moved = list(index)
            moved[axis] = i
            members.append(int(np.ravel_multi_index(moved, shape)))
        groups[name] = members
    return coords, groups
'''),
    (2, "one comprehension, ties by a sort", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    layouts = [(gpus // (tp * pp), pp, tp) for tp in (1, 2, 4, 8, 3, 5, 6, 7) for pp in range(gpus, 0, -1)
               if gpus % (tp * pp) == 0]
    fits = [(dp, pp, tp) for dp, pp, tp in layouts
            if heads % tp == 0 and layers % pp == 0 and sequences % dp == 0 and memory_per_gpu(dp, pp, tp) <= limit]
    if not fits:
        return None
    speed = {lay: tokens_per_s(*lay) for lay in fits}
    top = max(speed.values())
    return sorted((lay for lay in fits if speed[lay] / top >= 0.99), key=lambda lay: lay[1:])[0]
'''),
    (2, "divisors, memory last", '''
def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
    divisors = [n for n in range(1, gpus + 1) if gpus % n == 0]
    candidates = [(gpus // (tp * pp), pp, tp) for tp in divisors if tp <= 8 and heads % tp == 0
                  for pp in divisors if (gpus // tp) % pp == 0 and layers % pp == 0]
    candidates = [lay for lay in candidates if sequences % lay[0] == 0]
    fits = [lay for lay in candidates if memory_per_gpu(*lay) <= limit]
    if not fits:
        return None
    best = max(map(lambda lay: tokens_per_s(*lay), fits))
    for pp in sorted({lay[1] for lay in fits}):
        for tp in sorted({lay[2] for lay in fits}):
            for lay in fits:
                if lay[1:] == (pp, tp) and tokens_per_s(*lay) >= best - 0.01 * best:
                    return lay
'''),
]
