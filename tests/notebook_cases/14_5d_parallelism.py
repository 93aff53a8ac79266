"""Cases for Part 14: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

from printed import Close

from ultrascale.testing.compare import FP32

MISTAKES = [
    ("1", "dp innermost", "as if dp were innermost", '''
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
    ("1", "dp group of consecutive ranks", "your dp group [0, 1] is made of consecutive ranks", '''
    def grid_position(rank, dp, pp, cp, tp):
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        coords, rem = {}, rank
        for name in ("tp", "cp", "pp", "dp"):
            coords[name] = rem % sizes[name]
            rem //= sizes[name]
        groups = {"tp": [rank - coords["tp"] + i for i in range(tp)],
                  "dp": [rank // dp * dp + i for i in range(dp)],
                  "pp": [rank - coords["pp"] * cp * tp + i * cp * tp for i in range(pp)]}
        return coords, groups
    '''),
    ("1", "pp stride forgets cp", "pp neighbours are cp x tp = 4 ranks apart", '''
    def grid_position(rank, dp, pp, cp, tp):
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        coords, rem = {}, rank
        for name in ("tp", "cp", "pp", "dp"):
            coords[name] = rem % sizes[name]
            rem //= sizes[name]
        strides = {"tp": 1, "pp": tp, "dp": pp * cp * tp}
        groups = {n: [rank - coords[n] * strides[n] + i * strides[n] for i in range(sizes[n])]
                  for n in ("tp", "dp", "pp")}
        return coords, groups
    '''),
    ("1", "own rank first", "right ranks in another order", '''
    def grid_position(rank, dp, pp, cp, tp):
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        coords, rem = {}, rank
        for name in ("tp", "cp", "pp", "dp"):
            coords[name] = rem % sizes[name]
            rem //= sizes[name]
        strides = {"tp": 1, "cp": tp, "pp": cp * tp, "dp": pp * cp * tp}
        groups = {}
        for n in ("tp", "dp", "pp"):
            first = rank - coords[n] * strides[n]
            groups[n] = [first + (coords[n] + i) % sizes[n] * strides[n] for i in range(sizes[n])]
        return coords, groups
    '''),
    ("2", "tp across nodes", "spans more than one 8-GPU node", '''
    def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
        fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, gpus + 1) for pp in range(1, gpus + 1)
                if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
                and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
        if not fits:
            return None
        best = max(tokens_per_s(*lay) for lay in fits)
        return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
    '''),
    ("2", "tp ignores the heads", "does not divide the 12 attention heads", '''
    def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
        fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
                if gpus % (tp * pp) == 0 and layers % pp == 0
                and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
        if not fits:
            return None
        best = max(tokens_per_s(*lay) for lay in fits)
        return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
    '''),
    ("2", "never checks memory", "above the limit", '''
    def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
        fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
                if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
                and sequences % (gpus // (tp * pp)) == 0]
        best = max(tokens_per_s(*lay) for lay in fits)
        return min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
    '''),
    ("2", "least memory wins", "you chose a layout that needs the least memory", '''
    def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
        fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
                if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
                and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
        return min(fits, key=lambda lay: memory_per_gpu(*lay)) if fits else None
    '''),
    ("2", "returns (dp, tp, pp)", "in the order (dp, tp, pp); return (dp, pp, tp)", '''
    def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
        fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
                if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
                and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
        if not fits:
            return None
        best = max(tokens_per_s(*lay) for lay in fits)
        dp, pp, tp = min((lay for lay in fits if tokens_per_s(*lay) >= 0.99 * best), key=lambda lay: (lay[1], lay[2]))
        return dp, tp, pp
    '''),
    ("2", "no tie rule", "a tie the time model cannot tell apart", '''
    def best_layout(gpus, heads, layers, sequences, memory_per_gpu, tokens_per_s, limit):
        fits = [(gpus // (tp * pp), pp, tp) for tp in range(1, 9) for pp in range(1, gpus + 1)
                if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0
                and sequences % (gpus // (tp * pp)) == 0 and memory_per_gpu(gpus // (tp * pp), pp, tp) <= limit]
        return max(fits, key=lambda lay: tokens_per_s(*lay)) if fits else None
    '''),
    # Coordinates marked NaN until computed, and the size-1 dimensions skipped: int(nan) crashed the check.
    ("1", "size-1 dimensions left NaN", "a NaN or an infinity in what grid_position(", '''
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
    # NaNs for "no layout": the check asks for None (a NaN is no int, so it cannot pass as a layout either).
    ("2", "NaN when nothing fits", "no layout fits in memory, return None", '''
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

PRINTED = [
    "llama3-70b: 70.6B parameters, 80 layers, 64 heads; h100-80gb: 79.2 GiB, 8 GPUs per node",
    "pp    groups: [[0, 2], [1, 3], [4, 6], [5, 7]]",
    "dp    groups: [[0, 4], [1, 5], [2, 6], [3, 7]]",
    "  rank 3: dp=1 pp=0 tp=1  tp [2, 3]  pp [3]  dp [1, 3]",
    "  rank 3: dp=1 pp=1 tp=0  tp [3]  pp [2, 3]  dp [1, 3]",
    Close('one process          : losses 5.582918 5.467266 5.239688', rel=FP32.loss_rtol),
    "dp64 tp1 pp1 zero3: states   16.4 GiB + activations 101.5 GiB ->  150.5 GiB per GPU, does not fit",
    "dp8  tp4 pp2 zero1: states   45.2 GiB + activations  25.3 GiB ->   77.1 GiB per GPU, fits",
    "mbs 1 x ga 32 x dp 8 = 256 sequences:  77.1 GiB (fits)",
    "mbs 2 x ga 16 x dp 8 = 256 sequences: 108.1 GiB (does not fit)",
    "  dp8 tp8+sp pp1 zero1 rc:none mbs2 ga16                   78.8 GiB    707 tok/s/GPU",
    "  tp8 pp1 dp8    707 tok/s/GPU: compute 14.88  tp comm 4.57",
    "3,287 runs, 1,758 finished",
    "mean Spearman (tokens/s/GPU, per group) 0.813",
    "  64 nodes:  1.07  (281 runs, median measured MFU 0.9%)",
    "   1 nodes:  0.98  (69 runs, median measured MFU 37.8%)",
    "planner's choice for the tiny model: dp4 tp1 pp1 zero0 rc:none mbs2 ga1",
    "with --tp 2:                         dp2 tp2+sp pp1 zero0 rc:none mbs4 ga1",
    "[parallel]\ndp = 2\ntp = 2",
]
