"""Checks of Part 4 (data parallelism): overlapped DP with hooks, and gradient buckets.

Both exercises run on 2 real gloo ranks (`on_ranks`). On each rank the check
watches the collectives the learner's code calls (it wraps `dist.all_reduce` and
`dist.reduce` for the duration of the call, and notes whether DDP was built) and
sends back the gradients; here, in the notebook's process, it computes the
single-process gradient of the whole batch itself and names what is wrong:
summed instead of averaged (x N), reduced twice (a hook on top of DDP, or a hook
plus a loop), only rank 0 holding the result, not waited for, not overlapped
with backward; for buckets: the wrong order, DDP's cap rule instead of the
stated one, one bucket per layer or per parameter, the last bucket dropped,
results never written back.
"""

from __future__ import annotations

import contextlib

from ultrascale.series.checks import on_ranks, require_finite

WORLD = 2


# ---- models and data (the same on every rank and in the notebook's process) ----------------------

def overlap_model():
    """Exercise 1's model: 3 Linear layers, 6 parameter tensors."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def bucket_model():
    """Exercise 2's model: parameters of 128, 16, 256, 16, 64 and 4 elements, in registration order."""
    import torch
    import torch.nn as nn

    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(seed: int, n_in: int, n_out: int, samples: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, n_in, generator=g), torch.randn(samples, n_out, generator=g)


def _grads(model) -> dict:
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def _single_process(make, seed, n_in, n_out, samples) -> dict:
    """The reference: one model, the whole batch, a mean loss."""
    import torch.nn as nn

    model = make()
    x, y = _batch(seed, n_in, n_out, samples)
    nn.MSELoss()(model(x), y).backward()
    return _grads(model)


# ---- watching the collectives on a rank ---------------------------------------------------------

class _Work:
    """A Work handle that notes when it is waited for."""

    def __init__(self, work, record):
        self._work, self._record = work, record

    def wait(self, *args, **kwargs):
        self._record["waited"] = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def _watch(calls: list, keep_buffers: bool = False):
    """Wrap dist.all_reduce / dist.reduce and DDP's constructor; each call is noted in `calls`."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    real_all_reduce, real_reduce, real_ddp_init = dist.all_reduce, dist.reduce, DistributedDataParallel.__init__

    def note(kind, tensor, op, async_op):
        if op == dist.ReduceOp.AVG and dist.get_backend() == "gloo":
            raise AssertionError("gloo has no ReduceOp.AVG (NCCL has): all-reduce with the default SUM and "
                                 "divide by the world size")
        rec = {"kind": kind, "numel": tensor.numel(), "async": bool(async_op), "waited": False,
               "in_backward": torch._C._current_graph_task_id() != -1,
               "dim": tensor.dim(), "contiguous": tensor.is_contiguous(),
               "op": "SUM" if op == dist.ReduceOp.SUM else str(op)}
        if keep_buffers:
            rec["buffer"] = tensor.detach().clone()
        calls.append(rec)
        return rec

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        rec = note("all_reduce", tensor, op, async_op)
        work = real_all_reduce(tensor, op=op, group=group, async_op=async_op)
        return _Work(work, rec) if async_op else work

    def reduce(tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, **kwargs):
        rec = note("reduce", tensor, op, async_op)
        if dst is None:
            dst = kwargs.pop("group_dst", 0)
        work = real_reduce(tensor, dst, op=op, group=group, async_op=async_op, **kwargs)
        return _Work(work, rec) if async_op else work

    def ddp_init(self, *args, **kwargs):
        calls.append({"kind": "ddp"})
        return real_ddp_init(self, *args, **kwargs)

    dist.all_reduce, dist.reduce, DistributedDataParallel.__init__ = all_reduce, reduce, ddp_init
    try:
        yield
    finally:
        dist.all_reduce, dist.reduce, DistributedDataParallel.__init__ = real_all_reduce, real_reduce, real_ddp_init


# ---- Exercise 1: overlapped data parallelism with hooks ----------------------------------------

def _ex1_on_rank(fn, seed: int, samples: int):
    import torch.distributed as dist
    import torch.nn as nn

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _batch(seed, 16, 4, samples)
    xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
    local = overlap_model()
    nn.MSELoss()(local(xb), yb).backward()
    model = overlap_model()
    calls = []
    with _watch(calls):
        fn(model, xb, yb, nn.MSELoss())
    dist.barrier()  # nothing of this call still in flight when the next one starts
    return {"grads": _grads(model), "local": _grads(local), "calls": calls}


def _flat(grads: dict):
    import torch

    return torch.cat([g.reshape(-1) for g in grads.values()])


def _near(a: float, b: float, tol: float = 0.01) -> bool:
    return abs(a - b) <= tol * abs(b)


def exercise_1(fn, seeds=(1, 2)):
    """fn(model, x, y, loss_fn) on 2 ranks: afterwards every p.grad is the average over the ranks, reduced
    by asynchronous all-reduces started from per-parameter hooks during backward and waited for."""
    from ultrascale.series.checks import max_rel_diff, ratio

    for seed in seeds:
        samples = 8 * WORLD
        want = _single_process(overlap_model, seed, 16, 4, samples)
        results = on_ranks(WORLD, _ex1_on_rank, fn, seed, samples)
        names = list(want)
        n = WORLD
        for rank, res in enumerate(results):
            missing = [k for k, g in res["grads"].items() if g is None]
            assert not missing, (f"rank {rank} has no gradient for {missing}: run the forward and "
                                 f"loss.backward() on this rank's micro-batch")
            require_finite(res["grads"], f"rank {rank}'s gradients after overlapped_data_parallel")
        calls = [r["calls"] for r in results]
        used_ddp = any(c["kind"] == "ddp" for c in calls[0])
        mine = [[c for c in cs if c["kind"] != "ddp"] for cs in calls]
        if used_ddp and not mine[0]:
            raise AssertionError("DDP did all the communication: this exercise is to write what DDP does "
                                 "yourself, with a post-accumulate-grad hook per parameter; drop DDP")
        if used_ddp:
            k = ratio(_flat(results[0]["grads"]), _flat(want))
            twice = ("reduced twice: DDP already averages every gradient across the ranks, and your hook "
                     "all-reduces it again")
            if any(c["async"] for c in mine[0]):
                raise AssertionError(
                    f"{twice}; asynchronously, so your all-reduce races with DDP's copy of the gradient into its "
                    f"bucket and the result depends on which wins (here {k:.3f}x the single-process gradient). "
                    f"Use DDP or your own hooks, never both: here, drop DDP")
            if max_rel_diff(_flat(results[0]["grads"]), _flat(want)) < 1e-4:
                raise AssertionError(
                    f"{twice}: averaged twice. The values are right only because averaging an average changes "
                    f"nothing; every gradient crosses the network twice. Drop DDP: your hooks are the data "
                    f"parallelism")
            raise AssertionError(
                f"{twice}, so the gradients come out {k:.3f}x the single-process ones: your SUM hook runs "
                f"before DDP reads the gradient, so DDP averages {n} sums ({n}x). Use DDP or your own hooks, "
                f"never both: here, drop DDP")
        assert mine[0], ("no collective was called: each gradient must be all-reduced across the ranks "
                         "(dist.all_reduce in the hook), or every rank keeps its own micro-batch's gradient")
        unwaited = [c for c in mine[0] if c["async"] and not c["waited"]]
        if unwaited:
            raise AssertionError(
                f"{len(unwaited)} of your asynchronous all-reduces were never waited for: keep each Work that "
                f"dist.all_reduce(..., async_op=True) returns and call work.wait() on all of them after "
                f"backward, before the optimizer step; until then a gradient may still be in flight")
        grads = [_flat(r["grads"]) for r in results]
        ref = _flat(want)
        locals_ = [_flat(r["local"]) for r in results]
        used_reduce = any(c["kind"] == "reduce" for c in mine[0])
        for rank in range(1, n):
            if max_rel_diff(grads[rank], grads[0]) > 1e-5:
                r0, rr = ratio(grads[0], ref), ratio(grads[rank], ref)
                if used_reduce:
                    raise AssertionError(
                        f"only rank 0 holds the reduced gradients; rank {rank}'s differ: dist.reduce sends "
                        f"the result to one rank. Use dist.all_reduce, so every rank steps with the same "
                        f"average and the replicas stay identical")
                if max_rel_diff(grads[0], ref) < 1e-4:
                    own = max_rel_diff(grads[rank], locals_[rank]) < 1e-4
                    what = ("still its own micro-batch's gradient" if own
                            else f"{rr:.3f}x the single-process gradient")
                    raise AssertionError(
                        f"only rank 0 ended with the average; rank {rank}'s gradients are {what}: every rank "
                        f"must run the same code (no `if rank == 0` around the averaging or the reduction)")
                raise AssertionError(
                    f"rank {rank}'s gradients differ from rank 0's ({rr:.3f}x vs {r0:.3f}x the single-process "
                    f"gradient): every rank must all-reduce the same gradients and end with the same average")
        per_param = len(mine[0]) / len(names)
        k = ratio(grads[0], ref)
        close = max_rel_diff(grads[0], ref) < 1e-4
        if not close:
            if per_param <= 1 and _near(k, n * n):
                raise AssertionError(
                    f"your gradients are {k:.3f}x = {n}x{n} the single-process ones: summed over the {n} ranks "
                    f"and scaled up by the world size once more (multiplied where you should divide?); divide "
                    f"each gradient by the world size")
            if per_param > 1:
                raise AssertionError(
                    f"your gradients are {k:.3f}x the single-process ones: reduced twice ({len(mine[0])} "
                    f"all-reduces for {len(names)} gradients: a hook and a loop after backward, or two hooks). "
                    f"All-reduce each gradient exactly once, from its hook, and divide by the world size once")
            if _near(k, n):
                raise AssertionError(
                    f"your gradients are {k:.3f}x the single-process ones: summed, not averaged. "
                    f"dist.all_reduce sums over the {n} ranks; divide each gradient by the world size "
                    f"(before the all-reduce or after waiting for it)")
            if _near(k, 1 / n):
                raise AssertionError(
                    f"your gradients are {k:.3f}x the single-process ones: divided by the world size twice "
                    f"(or the loss divided too); divide once")
            if max_rel_diff(grads[0], locals_[0]) < 1e-5:
                raise AssertionError("every rank still holds its own micro-batch's gradient: the all-reduces "
                                     "did not reach p.grad (all-reduce p.grad itself, in place)")
            worst = max(names, key=lambda m: max_rel_diff(results[0]["grads"][m], want[m]))
            raise AssertionError(
                f"the gradient of {worst} is off by {max_rel_diff(results[0]['grads'][worst], want[worst]):.1e} "
                f"(relative) from the single-process gradient of the whole batch: average each gradient over "
                f"the ranks exactly once")
        if per_param > 1:
            raise AssertionError(
                f"reduced twice: {len(mine[0])} all-reduces for {len(names)} gradients. The values are right "
                f"(averaging an average changes nothing) but every gradient crossed the network "
                f"{per_param:g} times: once, from the hook, is enough")
        if not all(c["in_backward"] for c in mine[0]):
            raise AssertionError(
                "your all-reduces start after backward has finished: that is the naive version, the network "
                "idles during backward and backward idles during the network. Start each one from a "
                "post-accumulate-grad hook, the moment its gradient is ready")
        if not all(c["async"] for c in mine[0]):
            raise AssertionError(
                "each all-reduce blocks: with async_op=False the hook waits for the network and backward "
                "stops until it is done, so nothing overlaps. Pass async_op=True, keep the Work, wait for all "
                "of them after backward")
        if len(mine[0]) != len(names):
            raise AssertionError(f"{len(mine[0])} all-reduces for {len(names)} gradients: one per parameter, "
                                 f"from its hook")


# ---- Exercise 2: buckets -------------------------------------------------------------------------

def rule_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """The exercise's rule, as indices into `sizes` (registration order)."""
    out, cur, total = [], [], 0
    for i in reversed(range(len(sizes))):
        if cur and total + sizes[i] > cap:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += sizes[i]
    if cur:
        out.append(cur)
    return out


def _ddp_rule(sizes, cap):
    """PyTorch DDP's: add the parameter, then close the bucket once it holds cap or more."""
    out, cur, total = [], [], 0
    for i in reversed(range(len(sizes))):
        cur.append(i)
        total += sizes[i]
        if total >= cap:
            out.append(cur)
            cur, total = [], 0
    if cur:
        out.append(cur)
    return out


def _forward_rule(sizes, cap):
    out, cur, total = [], [], 0
    for i in range(len(sizes)):
        if cur and total + sizes[i] > cap:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += sizes[i]
    if cur:
        out.append(cur)
    return out


def _ex2_on_rank(fn, cap: int, seed: int, samples: int):
    import torch.distributed as dist
    import torch.nn as nn

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _batch(seed, 8, 4, samples)
    model = bucket_model()
    nn.MSELoss()(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    local = _grads(model)
    calls = []
    with _watch(calls, keep_buffers=True):
        fn(list(model.parameters()), cap)
    dist.barrier()
    return {"grads": _grads(model), "local": local, "calls": calls}


def _decompose(buf, local: dict, world: int) -> list[str] | None:
    """The parameters whose flattened gradients (as they are, or already divided by the world size), one
    after the other, make up `buf`; None if it is not so."""
    import torch

    for scale in (1.0, 1.0 / world):
        names, off, flat = [], 0, buf.reshape(-1)
        while off < flat.numel():
            for name, g in local.items():
                n = g.numel()
                if name in names or off + n > flat.numel():
                    continue
                if torch.allclose(flat[off:off + n], g.reshape(-1) * scale, rtol=1e-6, atol=1e-9):
                    names.append(name)
                    off += n
                    break
            else:
                break
        if off == flat.numel():
            return names
    return None


def _describe(buckets, names):
    return "[" + ", ".join("[" + ", ".join(names[i] for i in b) + "]" for b in buckets) + "]"


def exercise_2(fn, caps=(300, 100), seed=3):
    """fn(params, cap_numel) on 2 ranks: one averaging all-reduce per bucket of the stated rule, results back
    in every p.grad."""
    import torch

    from ultrascale.series.checks import max_rel_diff, ratio

    n = WORLD
    model = bucket_model()
    names = [k for k, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    index = {k: i for i, k in enumerate(names)}
    samples = 8 * n
    want = _single_process(bucket_model, seed, 8, 4, samples)
    for cap in caps:
        results = on_ranks(n, _ex2_on_rank, fn, cap, seed, samples)
        for rank, r in enumerate(results):
            require_finite(r["grads"], f"rank {rank}'s gradients after bucketed_all_reduce (cap_numel = {cap})")
        res = results[0]
        calls = [c for c in res["calls"] if c["kind"] != "ddp"]
        assert calls, "dist.all_reduce was never called: each bucket needs one all-reduce"
        bad = [c for c in calls if c["dim"] != 1 or not c["contiguous"]]
        assert not bad, ("all_reduce was given a tensor that is not flat and contiguous: a bucket is one 1-D "
                         "buffer, the flattened gradients one after the other (torch.cat of p.grad.reshape(-1))")
        unwaited = [c for c in calls if c["async"] and not c["waited"]]
        assert not unwaited, ("an asynchronous all-reduce was never waited for: call work.wait() before "
                              "reading the bucket back")
        got = []
        for k, c in enumerate(calls):
            parts = _decompose(c["buffer"], res["local"], n)
            assert parts is not None, (
                f"all-reduce call {k + 1} ({c['numel']} elements) is not a bucket of whole gradients: "
                f"flatten each p.grad and concatenate them, each complete")
            got.append([index[p] for p in parts])
        expected = rule_buckets(sizes, cap)
        seen = [i for b in got for i in b]
        twice = sorted({names[i] for i in seen if seen.count(i) > 1})
        assert not twice, f"{twice} were all-reduced twice: each gradient belongs to exactly one bucket"
        missing = [i for i in range(len(names)) if i not in seen]
        if missing:
            if sorted(missing) == sorted(expected[-1]):
                raise AssertionError(
                    f"{[names[i] for i in missing]} were never all-reduced: you dropped the last, partial "
                    f"bucket. After the loop, the bucket being filled still holds parameters: reduce it too")
            raise AssertionError(f"{[names[i] for i in missing]} were never all-reduced: every gradient "
                                 f"must go into a bucket")
        if got != expected:
            sizes_of = [sum(sizes[i] for i in b) for b in got]
            if len(got) == len(names):
                raise AssertionError(
                    f"{len(got)} all-reduces for {len(names)} gradients: one per parameter is no bucketing. "
                    f"Pack parameters into a bucket until the next one would exceed cap_numel = {cap}")
            if got == _ddp_rule(sizes, cap):
                over = next(k for k, s in enumerate(sizes_of) if s > cap)
                raise AssertionError(
                    f"bucket {over} holds {sizes_of[over]} elements, over cap_numel = {cap}: that is PyTorch "
                    f"DDP's rule (add the parameter, close the bucket once it reaches the cap). This exercise's "
                    f"rule: start a new bucket *before* a parameter would take it over the cap (a parameter "
                    f"larger than the cap alone gets a bucket of its own)")
            if got == _forward_rule(sizes, cap):
                raise AssertionError(
                    f"your buckets are filled in registration (forward) order, {_describe(got, names)}: walk "
                    f"the parameters last to first, the order backward produces their gradients, so the "
                    f"first bucket is complete first")
            layer = [[i for i in b] for b in got]
            if all(len({names[i].split('.')[0] for i in b}) == 1 for b in layer) and len(got) == len(names) // 2:
                raise AssertionError(
                    f"one bucket per layer, {_describe(got, names)}: buckets are filled by size, up to "
                    f"cap_numel = {cap} elements, whatever the layers")
            raise AssertionError(
                f"with cap_numel = {cap}, your buckets are {_describe(got, names)} ({sizes_of} elements); the "
                f"rule gives {_describe(expected, names)}: last parameter first, a new bucket when the next "
                f"parameter would take the current one over the cap")
        for rank, r in enumerate(results):
            unchanged = [k for k in names if max_rel_diff(r["grads"][k], r["local"][k]) < 1e-7]
            if len(unchanged) == len(names):
                raise AssertionError(
                    f"the buckets were all-reduced but no p.grad changed on rank {rank}: torch.cat makes a copy, "
                    f"so copy each slice of the reduced buffer back into its p.grad (p.grad.copy_(...view_as))")
            if unchanged:
                raise AssertionError(f"{unchanged} were all-reduced but their p.grad never received the result "
                                     f"on rank {rank}: copy every slice of the reduced buffer back")
            flat = torch.cat([r["grads"][k].reshape(-1) for k in names])
            ref = torch.cat([want[k].reshape(-1) for k in names])
            k = ratio(flat, ref)
            if max_rel_diff(flat, ref) > 1e-4:
                if _near(k, n):
                    raise AssertionError(
                        f"your gradients are {k:.3f}x the single-process ones: summed, not averaged. "
                        f"dist.all_reduce sums over the {n} ranks: divide each bucket by the world size")
                worst = max(names, key=lambda m: max_rel_diff(r["grads"][m], want[m]))
                raise AssertionError(
                    f"rank {rank}'s gradient of {worst} is off by "
                    f"{max_rel_diff(r['grads'][worst], want[worst]):.1e} from the single-process gradient: "
                    f"write each parameter's own slice back (offsets in bucket order)")
