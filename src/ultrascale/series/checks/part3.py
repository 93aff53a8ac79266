"""Checks of Part 3: gradient accumulation, and the ring all-reduce on real ranks.

exercise_1(accumulate_gradients)  single process: the accumulated gradient of a batch cut
                                  into micro-batches (equal or not) equals the gradient of
                                  the whole batch in one pass.
exercise_2(ring_all_reduce)       on 4 gloo processes: a sum built from dist.send/recv, equal
                                  to dist.all_reduce, sending 2(N-1)/N x the tensor's bytes
                                  per rank (counted by wrapping dist.send and dist.isend).
"""

from __future__ import annotations

from ultrascale.series.checks import max_rel_diff, on_ranks, require_finite
from ultrascale.series.ranks import RankError

WORLD = 4
RING_TIMEOUT = 30.0  # seconds; a ring whose sends and receives do not pair up would hang


# ---- exercise 1 ---------------------------------------------------------------------------------

def _mlp():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _err(got, want) -> float:
    """Largest |got - want| over the largest |want|, across all parameters (inf for a NaN)."""
    import torch

    return max_rel_diff(torch.cat([g.reshape(-1) for g in got]), torch.cat([w.reshape(-1) for w in want]))


def _scaled(got, want):
    """c if got == c * want (c fitted by least squares, residual small), else None."""
    import torch

    g = torch.cat([x.reshape(-1) for x in got]).double()
    w = torch.cat([x.reshape(-1) for x in want]).double()
    c = (g @ w / (w @ w)).item()
    return c if (g - c * w).norm() <= 1e-4 * g.norm() + 1e-12 else None


def exercise_1(accumulate_gradients):
    import torch
    import torch.nn as nn

    loss_fn = nn.MSELoss()
    for samples, micro in ((8, 4), (8, 3), (7, 2), (5, 1)):
        torch.manual_seed(100 * samples + micro)
        x, y = torch.randn(samples, 6), torch.randn(samples, 3)
        sizes = [len(c) for c in x.tensor_split(micro)]
        big = _mlp()
        loss_fn(big(x), y).backward()
        want = _grads(big)

        model = _mlp()
        accumulate_gradients(model, loss_fn, x, y, micro)
        got = _grads(model)
        where = f"{samples} samples in {micro} micro-batches of sizes {sizes}"
        missing = [n for (n, _), g in zip(model.named_parameters(), got) if g is None]
        assert not missing, (f"with {where} the parameters {missing} have no gradient: call backward() on every "
                             f"micro-batch's loss")
        require_finite(got, f"your accumulated gradients ({where})")
        if _err(got, want) <= 1e-5:
            continue
        c = _scaled(got, want)
        if c is not None and abs(c - micro) < 1e-3 and micro > 1:
            raise AssertionError(
                f"with {where} your gradients are {c:.3f}x the whole batch's: .grad adds the micro-batch "
                f"gradients up, and each micro-batch loss is already a mean - scale each micro-batch loss so "
                f"that the accumulated gradient is an average, not a sum")
        # Each micro-batch given the same weight 1/micro: right only when the micro-batches are equal.
        equal_weights = _mlp()
        for xb, yb in zip(x.tensor_split(micro), y.tensor_split(micro)):
            (loss_fn(equal_weights(xb), yb) / micro).backward()
        if _err(got, _grads(equal_weights)) <= 1e-5:
            raise AssertionError(
                f"with {where} your gradients are off by {_err(got, want):.1%} from the whole batch's: dividing "
                f"every micro-batch loss by the number of micro-batches gives each *micro-batch* the same weight, "
                f"so the samples of the small ones count more; weight each micro-batch loss by its share of the "
                f"samples, len(xb) / len(x)")
        last = _mlp()
        xb, yb = x.tensor_split(micro)[-1], y.tensor_split(micro)[-1]
        loss_fn(last(xb), yb).backward()
        if micro > 1 and _scaled(got, _grads(last)) is not None:
            raise AssertionError(
                f"with {where} your gradients are those of the last micro-batch alone: the earlier ones were "
                f"zeroed (or overwritten) - do not call zero_grad() between micro-batches, let .grad accumulate")
        if c is not None:
            raise AssertionError(
                f"with {where} your gradients are {c:.3f}x the whole batch's: the micro-batch losses must be "
                f"scaled so that their weights (len(xb) / len(x)) add up to 1")
        raise AssertionError(
            f"with {where} your gradients are off by up to {_err(got, want):.2e} (relative) from the gradient of "
            f"the whole batch in one pass: run forward and backward on every micro-batch exactly once, each loss "
            f"weighted by len(xb) / len(x)")


# ---- exercise 2 ---------------------------------------------------------------------------------

_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single")


def _ring_on_rank(fn, numel, seed):
    """On each rank: run the learner's ring on a random tensor, counting what dist.send and
    dist.isend carry and noting any collective it calls; then the same sum by dist.all_reduce."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * seed + rank))
    t = x.clone()
    sent, used, originals = [0], [], {}

    def counting(orig):
        def send(tensor, *args, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return orig(tensor, *args, **kwargs)
        return send

    def noting(name, orig):
        def collective(*args, **kwargs):
            used.append(name)
            return orig(*args, **kwargs)
        return collective

    for name in ("send", "isend"):
        originals[name] = getattr(dist, name)
        setattr(dist, name, counting(originals[name]))
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)
            setattr(dist, name, noting(name, originals[name]))
    try:
        returned = fn(t)
    finally:
        for name, orig in originals.items():
            setattr(dist, name, orig)
    dist.barrier()
    ref = x.clone()
    dist.all_reduce(ref)
    return {"input": x, "output": t, "returned": returned, "reference": ref, "sent": sent[0],
            "used": sorted(set(used))}


def _run_ring(fn, numel, seed):
    try:
        results = on_ranks(WORLD, _ring_on_rank, fn, numel, seed, timeout=RING_TIMEOUT)
    except RankError as e:
        first = str(e).splitlines()[0]
        if "did not finish" in first:
            raise AssertionError(
                f"the ring did not finish within {RING_TIMEOUT:.0f} s on {WORLD} ranks: every send needs the "
                f"matching recv on the neighbour - each step, send to the right and receive from the left "
                f"(isend, then recv, then wait)") from None
        raise AssertionError(f"with a tensor of {numel} elements on {WORLD} ranks your ring failed: {first}. "
                             f"The chunks of torch.tensor_split may differ in size: give each receive buffer "
                             f"the shape of the chunk it receives (torch.empty_like(chunks[j]))") from None
    for rank, r in enumerate(results):
        require_finite(r["output"], f"rank {rank}'s t after your ring ({numel} elements)")
    return results


def _coefficients(results, rank, chunk):
    """c with output chunk = sum_k c_k * input_k chunk (least squares), and the relative residual."""
    import torch

    inputs = torch.stack([r["input"].tensor_split(WORLD)[chunk] for r in results], dim=1).double()
    out = results[rank]["output"].tensor_split(WORLD)[chunk].double()
    c = torch.linalg.lstsq(inputs, out.unsqueeze(1)).solution.squeeze(1)
    resid = (inputs @ c - out).norm().item() / (out.norm().item() or 1.0)
    return [round(v, 3) for v in c.tolist()], resid


def _diagnose(results):
    n = WORLD
    for rank, r in enumerate(results):
        if r["used"]:
            raise AssertionError(f"rank {rank} called dist.{', dist.'.join(r['used'])}: build the all-reduce from "
                                 f"dist.send / dist.recv (or isend / irecv) only")
    table = {(rank, j): _coefficients(results, rank, j) for rank in range(n) for j in range(n)}
    if all(abs(c - 1) < 1e-3 for cs, _ in table.values() for c in cs):
        return
    if all(abs(c - 1 / n) < 1e-3 for cs, _ in table.values() for c in cs):
        raise AssertionError(f"every element is the average over the {n} ranks, but an all-reduce with the default "
                             f"op (SUM) adds: do not divide by the world size")
    summed = [sum(all(abs(c - 1) < 1e-3 for c in table[rank, j][0]) for j in range(n)) for rank in range(n)]
    partial = all(resid < 1e-4 and all(-1e-3 < c < 1 + 1e-3 for c in cs) for cs, resid in table.values())
    if all(s == 1 for s in summed) and partial:
        raise AssertionError("each rank ends with one summed chunk and partial sums in the others: that is the "
                             "reduce-scatter phase alone - add the all-gather phase, which passes the summed chunks "
                             "around the ring (N - 1 more steps) so that every rank gets all of them")
    for (rank, j), (cs, resid) in sorted(table.items()):
        if not resid <= 1e-4:  # `not <=`: a NaN residual is no sum either
            raise AssertionError(f"chunk {j} on rank {rank} is not a sum of the ranks' chunks: check which chunk "
                                 f"each step sends and which it receives (rank r sends chunk (r - step) % N and "
                                 f"receives chunk (r - step - 1) % N in the reduce-scatter phase)")
        if any(c > 1 + 1e-3 for c in cs):
            twice = [k for k, c in enumerate(cs) if c > 1 + 1e-3]
            raise AssertionError(f"chunk {j} on rank {rank} counts the contribution of rank(s) {twice} "
                                 f"{max(cs):g} times: in the all-gather phase the received chunk is already the full "
                                 f"sum - copy it into yours, do not add it")
        if any(abs(c) < 1e-3 for c in cs):
            missing = [k for k, c in enumerate(cs) if abs(c) < 1e-3]
            raise AssertionError(f"chunk {j} on rank {rank} is missing the contributions of rank(s) {missing}: in "
                                 f"the reduce-scatter phase add each received chunk to yours (+=) instead of "
                                 f"replacing it, for N - 1 steps, and pass on the running sum")
    raise AssertionError("the result differs from dist.all_reduce: in the reduce-scatter phase add each received "
                         "chunk to yours, in the all-gather phase copy it")


def exercise_2(ring_all_reduce):
    import torch

    n, numel = WORLD, 4096
    results = _run_ring(ring_all_reduce, numel, seed=1)
    _diagnose(results)
    for rank, r in enumerate(results):
        err = (r["output"] - r["reference"]).abs().max().item()
        assert err < 1e-5, (f"rank {rank}'s result differs from dist.all_reduce by up to {err:.2e}: sum in place "
                            f"into t")
    nbytes = numel * results[0]["input"].element_size()
    ring = 2 * (n - 1) * nbytes // n
    sent = [r["sent"] for r in results]
    if any(s == 0 for s in sent):
        raise AssertionError(f"bytes counted per rank: {sent}. The count sees dist.send and dist.isend: send with "
                             f"those (dist.batch_isend_irecv is not counted)")
    if max(sent) > ring:
        raise AssertionError(
            f"the sum is right, but rank {sent.index(max(sent))} sent {max(sent):,} bytes for a {nbytes:,}-byte "
            f"tensor where a ring sends 2(N-1)/N x {nbytes:,} = {ring:,}: send one chunk (1/N of the tensor) per "
            f"step, 2(N-1) steps in all, each to the right-hand neighbour")
    assert min(sent) >= ring, (f"rank {sent.index(min(sent))} sent only {min(sent):,} bytes; a ring all-reduce "
                               f"sends {ring:,}: every rank sends one chunk in each of the 2(N-1) steps")
    # A size that does not divide by N: the chunks of tensor_split differ (257 elements: 65, 64, 64, 64).
    for rank, r in enumerate(_run_ring(ring_all_reduce, 257, seed=2)):
        err = (r["output"] - r["reference"]).abs().max().item()
        assert err < 1e-5, (f"with 257 elements (chunks of 65, 64, 64, 64) rank {rank}'s result differs from "
                            f"dist.all_reduce by up to {err:.2e}: take every chunk from t.tensor_split(N) and size "
                            f"each receive buffer like the chunk it receives")
    print(f"Your ring: each of the {n} ranks sent {sent[0]:,} bytes to all-reduce a {nbytes:,}-byte tensor; "
          f"2(N-1)/N x {nbytes:,} = {ring:,} bytes. Same result as dist.all_reduce on every rank.")
    torch.testing.assert_close(results[0]["output"], results[0]["reference"], rtol=1e-5, atol=1e-5)
