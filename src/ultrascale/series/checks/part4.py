"""Checks of Part 4 (data parallelism): overlapped DP with hooks, and gradient buckets.

Both exercises run on 2 real gloo ranks (`on_ranks`) and read back what each rank called
(`calls=`, series/watch.py: the kind of each collective, its group, its bytes, its
reduction). A check first names a collective that is not data parallelism's (an
all-gather summed locally, a reduce then a broadcast, a broadcast of rank 0's gradients,
a point-to-point swap), then the shape of the communication (one all-reduce per gradient
started during backward, asynchronous and waited for; one per bucket of the stated rule),
then the values against the single-process gradient of the whole batch: summed instead of
averaged (x N), reduced twice (a hook on top of DDP, or a hook plus a loop), only rank 0
holding the result, never written back into p.grad; for buckets: the wrong order, DDP's
cap rule, a bucket closed before it is full, bytes counted for elements, one bucket per
layer, per parameter or for everything, the last bucket dropped.

What a Call cannot say, the rank notes itself: whether an all-reduce was asynchronous and
its Work waited for, the buffer it sent (to read a bucket's parameters), when backward ran
(to tell an all-reduce started during backward from one after it), and whether DDP was built.
"""

from __future__ import annotations

import contextlib

from ultrascale.series.checks import RankError, on_ranks, require_finite

WORLD = 2
EVERYONE = tuple(range(WORLD))
FP32 = 4  # bytes per gradient element


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


# ---- what a rank notes beside its watched calls ------------------------------------------------

_IN_BACKWARD = [0]  # backward passes running now (_backward_marks)
_READY = [0]  # gradients accumulated so far (exercise 1's model counts them): where backward has got to


class _Work:
    """An asynchronous all-reduce's Work that notes when it is waited for: whether backward was still
    running, and how many gradients were ready by then."""

    def __init__(self, work, note):
        self._work, self._note = work, note

    def wait(self, *args, **kwargs):
        self._note["waited"] = True
        # An in-place change of the tensor since the start (its version counter moved; the network's own
        # writes do not move it) raced with the reduction.
        tensor = self._note.get("tensor")
        if tensor is not None:
            self._note.setdefault("changed_in_flight", tensor._version != self._note["version"])
        self._note.setdefault("waited_in_backward", _IN_BACKWARD[0] > 0)
        self._note.setdefault("ready_at_wait", _READY[0])
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        """The Work's future: a learner may wait through it (fut.wait(), torch.futures.wait_all)."""
        self._note["future"] = future = self._work.get_future()
        return future

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def _noting(notes: list, keep_buffers: bool = False, namespace: dict | None = None):
    """Wrap dist.all_reduce: each call notes its place among the rank's watched calls (`index`), whether it
    was asynchronous, whether its Work was waited for, whether its tensor was flat, and (for buckets) a copy
    of what it sent. A Call says what was sent; this says how it was waited for. `namespace` is the answer's
    globals: a name bound there to dist.all_reduce (`from torch.distributed import all_reduce`) is wrapped too."""
    import inspect

    import torch.distributed as dist

    from ultrascale.series import watch

    watched = dist.all_reduce
    signature = inspect.signature(getattr(watched, "__watched__", watched))

    def all_reduce(tensor, *args, **kwargs):
        given = signature.bind(tensor, *args, **kwargs).arguments
        asynchronous = bool(given.get("async_op", False))
        note = {"index": len(watch.calls()), "async": asynchronous, "waited": False, "ready_at_start": _READY[0],
                "flat": tensor.dim() == 1 and tensor.is_contiguous(),
                "buffer": tensor.detach().clone() if keep_buffers else None}
        notes.append(note)
        work = watched(tensor, *args, **kwargs)
        if asynchronous:
            note["work"] = work
            if given.get("op", dist.ReduceOp.SUM) != dist.ReduceOp.AVG:
                # (Where the backend has no AVG, torch divides the sum in place when it arrives, itself.)
                note["tensor"], note["version"] = tensor, tensor._version
            return _Work(work, note)
        return work

    bound = [k for k, v in (namespace or {}).items() if v is watched]
    dist.all_reduce = all_reduce
    for k in bound:
        namespace[k] = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = watched
        for k in bound:
            namespace[k] = watched


def _settled(notes: list) -> list:
    """Wait for the all-reduces the learner left in flight (so the gradients read next are final and
    nothing crosses into the next check), and keep what pickles."""
    for note in notes:
        work, future = note.pop("work", None), note.pop("future", None)
        note.pop("tensor", None)
        if future is not None and not note["waited"] and future.done():
            # Waited through its future (torch.futures.wait_all takes no Python hook): done by the return.
            note["waited"] = True
        if work is not None and not note["waited"]:
            work.wait()
    return notes


@contextlib.contextmanager
def _backward_marks(marks: list):
    """Note, for each backward pass, the span of the rank's watched calls made while it ran."""
    import torch

    from ultrascale.series import watch

    real = torch.autograd.backward  # what Tensor.backward calls

    def backward(*args, **kwargs):
        start = len(watch.calls())
        _IN_BACKWARD[0] += 1
        try:
            return real(*args, **kwargs)
        finally:
            _IN_BACKWARD[0] -= 1
            marks.append((start, len(watch.calls())))

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = real


@contextlib.contextmanager
def _ddp_noted(built: list):
    """DDP reduces in C++, out of sight of the watch: note that it was built."""
    from torch.nn.parallel import DistributedDataParallel

    real = DistributedDataParallel.__init__

    def init(self, *args, **kwargs):
        built.append(True)
        return real(self, *args, **kwargs)

    DistributedDataParallel.__init__ = init
    try:
        yield
    finally:
        DistributedDataParallel.__init__ = real


# ---- what every rank must have called ----------------------------------------------------------

_GATHERS = {"all_gather", "all_gather_single", "all_gather_object", "gather", "gather_object"}
_POINT_TO_POINT = {"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"}


def _only_all_reduce(calls: list, what: str) -> None:
    """Data parallelism's collective is the all-reduce: name any other the learner's code called."""
    from ultrascale.series import watch

    for rank, cs in enumerate(calls):
        kinds = set(watch.kinds(cs)) - {"barrier"}
        if {"reduce", "broadcast"} <= kinds:
            raise AssertionError(
                f"rank {rank} called reduce to rank 0 then broadcast: two collectives for {what}, where one "
                f"all-reduce does both (it sums and leaves the result on every rank, in about the time of either "
                f"half alone). Call dist.all_reduce instead")
        if "reduce" in kinds:
            raise AssertionError(
                "only rank 0 holds the reduced gradients: dist.reduce sends the result to one rank. Use "
                "dist.all_reduce, so every rank steps with the same average and the replicas stay identical")
        if "broadcast" in kinds:
            raise AssertionError(
                f"rank {rank} called broadcast: broadcast copies rank 0's gradient to every rank, and the other "
                f"ranks' micro-batches are thrown away. Every rank's gradient counts: dist.all_reduce sums them "
                f"all, then divide by the world size")
        if kinds & _GATHERS:
            raise AssertionError(
                f"you all-gathered {what} and summed the copies on each rank ({', '.join(sorted(kinds & _GATHERS))}): "
                f"every rank receives all {WORLD} gradients, {WORLD}x the memory, to keep only their sum. "
                f"dist.all_reduce sums in the collective and leaves just the sum: all-reduce, then divide by the "
                f"world size")
        if kinds & _POINT_TO_POINT:
            raise AssertionError(
                f"rank {rank} swapped gradients point to point ({', '.join(sorted(kinds & _POINT_TO_POINT))}): "
                f"a swap with one peer is an all-reduce by hand that works for 2 ranks only; dist.all_reduce "
                f"sums over every rank, however many (as a ring or a tree)")
        other = kinds - {"all_reduce"}
        if other:
            raise AssertionError(
                f"rank {rank} called {', '.join(sorted(other))}: not data parallelism's collective. Every rank "
                f"needs the sum of all ranks' gradients, which is dist.all_reduce (then divide by the world size)")


def _all_reduces(cs: list) -> list:
    return [c for c in cs if c.kind == "all_reduce"]


def _over_everyone(calls: list) -> None:
    """Every all-reduce spans all the data-parallel ranks and adds (or averages) the gradients."""
    for rank, cs in enumerate(calls):
        for c in _all_reduces(cs):
            if c.group != EVERYONE:
                raise AssertionError(
                    f"rank {rank} all-reduced over ranks {list(c.group)} only: the average is over every "
                    f"data-parallel rank, {list(EVERYONE)}; all-reduce over the default group (no group=)")
            if c.op not in ("SUM", "AVG"):
                raise AssertionError(
                    f"rank {rank} all-reduced with ReduceOp.{c.op}: the ranks' gradients add up, so reduce with "
                    f"SUM (the default) and divide by the world size, or with AVG where the backend has it")


def _waited(notes: list) -> None:
    unwaited = [n for n in notes if n["async"] and not n["waited"]]
    if unwaited:
        raise AssertionError(
            f"{len(unwaited)} of your asynchronous all-reduces were never waited for: keep each Work that "
            f"dist.all_reduce(..., async_op=True) returns and call work.wait() on all of them (after backward, "
            f"before the optimizer step, or before reading a bucket back); until then a gradient may still be "
            f"in flight")
    changed = [n for n in notes if n.get("changed_in_flight")]
    if changed:
        raise AssertionError(
            f"{len(changed)} of your gradients were changed in place (div_, mul_, ...) while their asynchronous "
            f"all-reduce was in flight: the network reads and writes that tensor until the Work is waited for, so "
            f"whether your change lands before or after the reduction is up to the timing. Divide before starting "
            f"the all-reduce, or after waiting for it")


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
    _READY[0] = 0
    for p in model.parameters():  # registered first, so it runs before the learner's hook on the same p
        p.register_post_accumulate_grad_hook(lambda p: _READY.__setitem__(0, _READY[0] + 1))
    notes, marks, ddp = [], [], []
    with _noting(notes, namespace=getattr(fn, "__globals__", None)), _backward_marks(marks), _ddp_noted(ddp):
        fn(model, xb, yb, nn.MSELoss())
    # Hooks still registered after the step (beyond the counter above): the next backward would average
    # and all-reduce every gradient again.
    left = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) - 1 for p in model.parameters())
    return {"grads": _grads(model), "local": _grads(local), "notes": _settled(notes), "backward": marks,
            "ddp": bool(ddp), "hooks_left": left}


def _flat(grads: dict):
    import torch

    return torch.cat([g.reshape(-1) for g in grads.values()])


def _near(a: float, b: float, tol: float = 0.01) -> bool:
    return abs(a - b) <= tol * abs(b)


def _ddp_and_hooks(results, mine: list, want: dict) -> None:
    """The model was wrapped in DDP: it already averages every gradient, so anything more is twice."""
    from ultrascale.series.checks import max_rel_diff, ratio

    n = WORLD
    if not mine:
        raise AssertionError("DDP did all the communication: this exercise is to write what DDP does "
                             "yourself, with a post-accumulate-grad hook per parameter; drop DDP")
    k = ratio(_flat(results[0]["grads"]), _flat(want))
    twice = "reduced twice: DDP already averages every gradient across the ranks, and your hook all-reduces it again"
    if any(note["async"] for note in results[0]["notes"]):
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


def _one_message_per_gradient(mine: list, sizes: dict) -> None:
    """Each all-reduce carries one fp32 gradient: not all of them in one message, nor a lower precision."""
    total = sum(sizes.values())
    sent = sorted(c.bytes for c in mine)
    if len(mine) == 1 and len(sizes) > 1 and sent[0] == FP32 * total:
        raise AssertionError(
            f"one all-reduce for {len(sizes)} gradients, all {total} elements in one message after backward: "
            f"that is a single bucket, and it can only start once the last gradient exists, so nothing "
            f"overlaps. All-reduce each gradient from its own post-accumulate-grad hook, as soon as it is ready")
    if len(mine) == len(sizes) and sent != sorted(FP32 * s for s in sizes.values()):
        if sent == sorted(2 * s for s in sizes.values()):
            raise AssertionError(
                "your all-reduces carry 2 bytes per element where p.grad holds 4: the gradients crossed the "
                "network in bfloat16 (or float16), and their average lost precision on the way. All-reduce "
                "p.grad itself, in fp32")
        raise AssertionError(
            f"your all-reduces carry {sent} bytes; the gradients hold {sorted(FP32 * s for s in sizes.values())} "
            f"(fp32): all-reduce each p.grad itself, whole")


def _every_gradient_reduced(results) -> None:
    """Some gradients averaged and others still each rank's own: those were never all-reduced."""
    from ultrascale.series.checks import max_rel_diff

    own = [name for name in results[0]["grads"]
           if max_rel_diff(results[0]["local"][name], results[1]["local"][name]) > 1e-5  # the ranks' differ
           and all(max_rel_diff(r["grads"][name], r["local"][name]) < 1e-6 for r in results)]
    if own and len(own) < len(results[0]["grads"]):
        raise AssertionError(
            f"{', '.join(own)} were never all-reduced: every rank still holds its own micro-batch's gradient "
            f"there, while the others are averaged. Register the hook on every parameter of the model "
            f"(model.parameters(), the biases included)")


def _same_on_every_rank(grads, locals_, ref) -> None:
    from ultrascale.series.checks import max_rel_diff, ratio

    for rank in range(1, WORLD):
        if max_rel_diff(grads[rank], grads[0]) <= 1e-5:
            continue
        if all(max_rel_diff(g, lo) < 1e-5 for g, lo in zip(grads, locals_)):
            raise AssertionError(
                "every rank still holds its own micro-batch's gradient: the all-reduces did not reach p.grad "
                "(a copy was reduced: p.grad / world makes a new tensor). All-reduce p.grad itself, in place, "
                "or copy the result back into it")
        r0, rr = ratio(grads[0], ref), ratio(grads[rank], ref)
        if max_rel_diff(grads[0], ref) < 1e-4:
            own = max_rel_diff(grads[rank], locals_[rank]) < 1e-4
            what = "still its own micro-batch's gradient" if own else f"{rr:.3f}x the single-process gradient"
            raise AssertionError(
                f"only rank 0 ended with the average; rank {rank}'s gradients are {what}: every rank "
                f"must run the same code (no `if rank == 0` around the averaging or the reduction)")
        raise AssertionError(
            f"rank {rank}'s gradients differ from rank 0's ({rr:.3f}x vs {r0:.3f}x the single-process "
            f"gradient): every rank must all-reduce the same gradients and end with the same average")


def _the_average(results, want, mine: list, grads, locals_, avg: bool) -> None:
    from ultrascale.series.checks import max_rel_diff, ratio

    n, names, ref = WORLD, list(want), _flat(want)
    per_param = len(mine) / len(names)
    k = ratio(grads[0], ref)
    if max_rel_diff(grads[0], ref) < 1e-4:
        return
    if per_param <= 1 and _near(k, n * n):
        raise AssertionError(
            f"your gradients are {k:.3f}x = {n}x{n} the single-process ones: summed over the {n} ranks "
            f"and scaled up by the world size once more (multiplied where you should divide?); divide "
            f"each gradient by the world size")
    if per_param > 1:
        raise AssertionError(
            f"your gradients are {k:.3f}x the single-process ones: reduced twice ({len(mine)} "
            f"all-reduces for {len(names)} gradients: a hook and a loop after backward, or two hooks). "
            f"All-reduce each gradient exactly once, from its hook, and divide by the world size once")
    if _near(k, n):
        raise AssertionError(
            f"your gradients are {k:.3f}x the single-process ones: summed, not averaged. "
            f"dist.all_reduce sums over the {n} ranks; divide each gradient by the world size "
            f"(before the all-reduce or after waiting for it)")
    if _near(k, 1 / n):
        if avg:
            raise AssertionError(
                f"your gradients are {k:.3f}x the single-process ones: ReduceOp.AVG already divides by the "
                f"world size, and you divided again; with AVG, do not divide")
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


def _overlapped(results, calls, names: list) -> None:
    """Each gradient's all-reduce starts during backward, from its hook, and lets backward go on."""
    for rank, (res, cs) in enumerate(zip(results, calls)):
        mine = [i for i, c in enumerate(cs) if c.kind == "all_reduce"]
        if len(mine) > len(names):
            raise AssertionError(
                f"reduced twice: {len(mine)} all-reduces for {len(names)} gradients. The values are right "
                f"(averaging an average changes nothing) but every gradient crossed the network "
                f"{len(mine) / len(names):g} times: once, from the hook, is enough")
        during = [i for i in mine if any(start <= i < end for start, end in res["backward"])]
        if len(during) < len(mine):
            raise AssertionError(
                f"{len(mine) - len(during)} of rank {rank}'s all-reduces start after backward has finished: "
                f"that is the naive version, the network idles during backward and backward idles during the "
                f"network. Start each one from a post-accumulate-grad hook, the moment its gradient is ready")
        blocking = [note for note in res["notes"] if not note["async"]]
        if blocking:
            raise AssertionError(
                "each all-reduce blocks: with async_op=False the hook waits for the network and backward "
                "stops until it is done, so nothing overlaps. Pass async_op=True, keep the Work, wait for all "
                "of them after backward")
        started = [note for note in res["notes"] if note["async"]]
        if started and all(note.get("waited_in_backward") and note.get("ready_at_wait") == note["ready_at_start"]
                           for note in started):
            raise AssertionError(
                "each all-reduce is waited for in the hook that started it, before backward computes the next "
                "gradient: async_op=True then .wait() at once blocks backward as async_op=False does, so nothing "
                "overlaps. Keep the Works and wait for all of them after backward")
        if len(mine) != len(names):
            raise AssertionError(f"{len(mine)} all-reduces for {len(names)} gradients on rank {rank}: one per "
                                 f"parameter, from its hook")


def exercise_1(fn, seeds=(1, 2)):
    """fn(model, x, y, loss_fn) on 2 ranks: afterwards every p.grad is the average over the ranks, reduced
    by asynchronous all-reduces started from per-parameter hooks during backward and waited for."""
    sizes = {name: p.numel() for name, p in overlap_model().named_parameters()}
    for seed in seeds:
        samples = 8 * WORLD
        want = _single_process(overlap_model, seed, 16, 4, samples)
        calls = []
        results = on_ranks(WORLD, _ex1_on_rank, fn, seed, samples, calls=calls)
        for rank, res in enumerate(results):
            missing = [k for k, g in res["grads"].items() if g is None]
            assert not missing, (f"rank {rank} has no gradient for {missing}: run the forward and "
                                 f"loss.backward() on this rank's micro-batch")
            require_finite(res["grads"], f"rank {rank}'s gradients after overlapped_data_parallel")
        mine = _all_reduces(calls[0])
        if results[0]["ddp"]:
            _ddp_and_hooks(results, mine, want)
        _only_all_reduce(calls, "each gradient")
        assert mine, ("no collective was called: each gradient must be all-reduced across the ranks "
                      "(dist.all_reduce in the hook), or every rank keeps its own micro-batch's gradient")
        _over_everyone(calls)
        for r in results:
            _waited(r["notes"])
        _one_message_per_gradient(mine, sizes)
        grads = [_flat(r["grads"]) for r in results]
        locals_ = [_flat(r["local"]) for r in results]
        avg = any(c.op == "AVG" for c in mine)
        _every_gradient_reduced(results)
        _same_on_every_rank(grads, locals_, _flat(want))
        _the_average(results, want, mine, grads, locals_, avg)
        _overlapped(results, calls, list(sizes))
        left = results[0]["hooks_left"]
        if left > 0 and not results[0]["ddp"]:
            raise AssertionError(f"the gradients are right, but {left} of your hooks stay registered after the step: "
                                 f"the next backward would average and all-reduce every gradient again; keep each "
                                 f"handle register_post_accumulate_grad_hook returns and call handle.remove() at "
                                 f"the end")
    _on_three_ranks(fn)


def _on_three_ranks(fn, world=3, seed=4):
    """The same answer on 3 ranks, 8 samples each, against one process on all 24: a world size written in
    as 2 (a division by 2, a hook that expects one peer) shows here, where the 2-rank checks named the rest."""
    from ultrascale.testing.tolerance import FP32_REORDER

    samples = 8 * world
    want = _flat(_single_process(overlap_model, seed, 16, 4, samples))
    said = f"your data parallelism is right on {WORLD} ranks, but on {world} ranks ({samples} samples) {{}}"
    try:
        results = on_ranks(world, _ex1_on_rank, fn, seed, samples)
    except RankError as e:
        raise AssertionError(said.format(f"it failed ({str(e).splitlines()[0][:160]})")) from None
    for rank, res in enumerate(results):
        grads = _flat(res["grads"])
        require_finite(grads, f"rank {rank}'s gradients on {world} ranks")
        # The same fp32 sums in another order (3 ranks' partial batches): the fp32-reordering class's bound.
        if ((grads - want).norm() / want.norm()).item() <= FP32_REORDER.tolerance.grad_rtol:
            continue
        ratio = (grads @ want / (want @ want)).item()
        how = (f"rank {rank}'s gradients are {ratio:.3f}x the whole batch's: divide the sum by "
               f"dist.get_world_size(), not by a number (or all-reduce with ReduceOp.AVG)")
        if abs(ratio - 1) < 1e-3:
            how = f"rank {rank}'s gradients differ from the whole batch's: take every size from the group"
        raise AssertionError(said.format(how))


# ---- Exercise 2: buckets -------------------------------------------------------------------------

def rule_buckets(sizes: list[int], cap: float) -> list[list[int]]:
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


def _closed_when_full(sizes, cap):
    """The rule with >= for >: a bucket is closed before it would hold exactly cap elements."""
    out, cur, total = [], [], 0
    for i in reversed(range(len(sizes))):
        if cur and total + sizes[i] >= cap:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += sizes[i]
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
    notes = []
    with _noting(notes, keep_buffers=True, namespace=getattr(fn, "__globals__", None)):
        fn(list(model.parameters()), cap)
    return {"grads": _grads(model), "local": local, "notes": _settled(notes)}


def _decompose(buf, local: dict, world: int) -> list[str] | None:
    """The parameters whose flattened gradients (as they are, or already divided by the world size), one
    after the other, make up `buf`; None if it is not so."""
    import torch

    if buf.dtype != torch.float32:
        return None
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


def _buckets_sent(res, mine, names, cap) -> list[list[int]] | None:
    """The buckets the all-reduces carried, as indices into the parameters, read from their buffers; None
    when the learner's all_reduce was bound before the check could note its buffers (then only the bytes
    are known)."""
    notes = res["notes"]
    if len(notes) != len(mine):
        return None
    bad = [note for note in notes if not note["flat"]]
    assert not bad, ("all_reduce was given a tensor that is not flat and contiguous: a bucket is one 1-D "
                     "buffer, the flattened gradients one after the other (torch.cat of p.grad.reshape(-1))")
    index = {k: i for i, k in enumerate(names)}
    got = []
    for k, note in enumerate(notes):
        parts = _decompose(note["buffer"], res["local"], WORLD)
        assert parts is not None, (
            f"all-reduce call {k + 1} ({note['buffer'].numel()} elements, with cap_numel = {cap}) is not a "
            f"bucket of whole fp32 gradients: flatten each p.grad and concatenate them, each complete")
        got.append([index[p] for p in parts])
    return got


def _by_the_rule(got, names, sizes, cap) -> None:
    """The buckets are those of the stated rule; else name the rule that was followed instead."""
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
    if [sorted(b) for b in got] == [sorted(b) for b in expected]:
        # The rule's buckets in the rule's order; where each gradient sits inside its flat buffer is the
        # answer's to choose, as long as it copies each back from where it put it (checked after).
        return
    sizes_of = [sum(sizes[i] for i in b) for b in got]
    if len(got) == len(names):
        raise AssertionError(
            f"{len(got)} all-reduces for {len(names)} gradients: one per parameter is no bucketing. "
            f"Pack parameters into a bucket until the next one would exceed cap_numel = {cap}")
    if len(got) == 1:
        raise AssertionError(
            f"one bucket of all {sizes_of[0]} elements: cap_numel = {cap} was never applied, so the one "
            f"all-reduce waits for the last gradient and nothing overlaps. Close the bucket when the next "
            f"parameter would take it over the cap")
    if got == _ddp_rule(sizes, cap):
        over = next(k for k, s in enumerate(sizes_of) if s > cap)
        raise AssertionError(
            f"bucket {over} holds {sizes_of[over]} elements, over cap_numel = {cap}: that is PyTorch "
            f"DDP's rule (add the parameter, close the bucket once it reaches the cap). This exercise's "
            f"rule: start a new bucket *before* a parameter would take it over the cap (a parameter "
            f"larger than the cap alone gets a bucket of its own)")
    if got == _closed_when_full(sizes, cap):
        full = next(b for b in expected if sum(sizes[i] for i in b) == cap)
        raise AssertionError(
            f"with cap_numel = {cap}, your buckets are {_describe(got, names)}: you closed a bucket that the "
            f"next parameter would have filled to exactly the cap ({_describe([full], names)[1:-1]} = {cap} "
            f"elements). A bucket may hold exactly cap_numel elements; start a new one only when the next "
            f"parameter would take it *over* the cap (>, not >=)")
    if got == rule_buckets(sizes, cap / FP32):
        raise AssertionError(
            f"with cap_numel = {cap}, your buckets are {_describe(got, names)} ({sizes_of} elements): you "
            f"counted bytes (numel x element_size), so each bucket holds a quarter of the cap. cap_numel is "
            f"a number of elements: add p.numel()")
    if got == _forward_rule(sizes, cap):
        raise AssertionError(
            f"your buckets are filled in registration (forward) order, {_describe(got, names)}: walk "
            f"the parameters last to first, the order backward produces their gradients, so the "
            f"first bucket is complete first")
    if all(len({names[i].split('.')[0] for i in b}) == 1 for b in got) and len(got) == len(names) // 2:
        raise AssertionError(
            f"one bucket per layer, {_describe(got, names)}: buckets are filled by size, up to "
            f"cap_numel = {cap} elements, whatever the layers")
    raise AssertionError(
        f"with cap_numel = {cap}, your buckets are {_describe(got, names)} ({sizes_of} elements); the "
        f"rule gives {_describe(expected, names)}: last parameter first, a new bucket when the next "
        f"parameter would take the current one over the cap")


def _sizes_by_the_rule(mine, sizes, cap) -> None:
    """Only the bytes are known: they must be the rule's buckets, in its order."""
    sent = [c.bytes // FP32 for c in mine]
    want = [sum(sizes[i] for i in b) for b in rule_buckets(sizes, cap)]
    assert sent == want, (f"with cap_numel = {cap}, your all-reduces carry {sent} elements; the rule's buckets "
                          f"hold {want}: last parameter first, a new bucket when the next parameter would take "
                          f"the current one over the cap")


def _written_back(results, names, want) -> None:
    import torch

    from ultrascale.series.checks import max_rel_diff, ratio

    n = WORLD
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
            if _near(k, 1 / n):
                raise AssertionError(
                    f"your gradients are {k:.3f}x the single-process ones: divided by the world size twice "
                    f"(or with ReduceOp.AVG, which divides already); divide once")
            worst = max(names, key=lambda m: max_rel_diff(r["grads"][m], want[m]))
            raise AssertionError(
                f"rank {rank}'s gradient of {worst} is off by "
                f"{max_rel_diff(r['grads'][worst], want[worst]):.1e} from the single-process gradient: "
                f"write each parameter's own slice back (offsets in bucket order)")


_EMPTY_BUCKET = ("the first gradient backward produces is already larger than the cap, and the still-empty "
                 "bucket was closed before it; start a new bucket only when the current one holds something")


def _no_empty_bucket(got, mine, cap) -> None:
    empty = [k + 1 for k, c in enumerate(mine) if c.bytes == 0] if got is None else [
        k + 1 for k, b in enumerate(got) if not b]
    assert not empty, (f"all-reduce call {empty[0]} carries no elements (cap_numel = {cap}): an empty bucket. "
                       f"The {_EMPTY_BUCKET}")


def exercise_2(fn, caps=(300, 272, 100, 2), seed=3):
    """fn(params, cap_numel) on 2 ranks: one averaging all-reduce per bucket of the stated rule, results back
    in every p.grad. Cap 272 is one a bucket fills exactly (256 + 16 elements); cap 2 is smaller than every
    parameter, the first one backward produces included (a bucket each, none empty)."""
    model = bucket_model()
    names = [k for k, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    samples = 8 * WORLD
    want = _single_process(bucket_model, seed, 8, 4, samples)
    for cap in caps:
        calls = []
        try:
            results = on_ranks(WORLD, _ex2_on_rank, fn, cap, seed, samples, calls=calls)
        except RankError as e:
            if "non-empty list of Tensors" in str(e):  # torch.cat of an empty bucket
                raise AssertionError(f"torch.cat was given an empty bucket (cap_numel = {cap}): "
                                     f"{_EMPTY_BUCKET}") from None
            raise
        for rank, r in enumerate(results):
            require_finite(r["grads"], f"rank {rank}'s gradients after bucketed_all_reduce (cap_numel = {cap})")
        _only_all_reduce(calls, "each bucket")
        mine = _all_reduces(calls[0])
        assert mine, "dist.all_reduce was never called: each bucket needs one all-reduce"
        _over_everyone(calls)
        for r in results:
            _waited(r["notes"])
        got = _buckets_sent(results[0], mine, names, cap)
        _no_empty_bucket(got, mine, cap)
        if got is None:
            _sizes_by_the_rule(mine, sizes, cap)
        else:
            _by_the_rule(got, names, sizes, cap)
        _written_back(results, names, want)
