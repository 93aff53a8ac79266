"""Checks of Part 3: gradient accumulation, and the ring all-reduce on real ranks.

exercise_1(accumulate_gradients)  single process: the accumulated gradient of a batch cut
                                  into micro-batches (equal or not) equals the gradient of
                                  the whole batch in one pass, and it was accumulated: each
                                  micro-batch's forward then its backward, before the next
                                  (hooks on the model see the passes).
exercise_2(ring_all_reduce)       on 4 gloo processes: a sum built from dist.send/recv, equal
                                  to dist.all_reduce. The calls each rank made (series/watch.py)
                                  must be a ring's: no collective, sends to one neighbour only,
                                  2(N-1) of them, each one chunk of 1/N of the tensor, so
                                  2(N-1)/N x the tensor's bytes per rank.
"""

from __future__ import annotations

from ultrascale.series import watch
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


def _watch_passes(model):
    """Events, in order: ("forward", samples) for each forward of the model, ("backward", samples)
    when the gradient of that forward's output comes back: how the learner walked the batch."""
    events = []

    def hook(module, inputs, output):
        n = len(inputs[0])
        events.append(("forward", n))
        if output.requires_grad:
            output.register_hook(lambda grad: events.append(("backward", n)))

    model.register_forward_hook(hook)
    return events


def _how(events, samples, micro, where):
    """The walk through the micro-batches: each one forward, then its own backward, before the next."""
    forwards = [n for kind, n in events if kind == "forward"]
    backwards = [n for kind, n in events if kind == "backward"]
    if micro > 1 and forwards == [samples]:
        raise AssertionError(
            f"with {where} you ran the whole batch of {samples} samples in one forward pass: the gradient is right, "
            f"but that is what accumulation avoids (the activations of the whole batch at once). Run forward and "
            f"backward on each micro-batch of x.tensor_split(num_micro_batches) in turn")
    if len(forwards) < micro:
        raise AssertionError(
            f"with {where} the model ran {len(forwards)} forward pass(es) for {micro} micro-batches: run every "
            f"micro-batch once (the loop over zip(x.tensor_split(n), y.tensor_split(n)) visits each)")
    if len(forwards) > micro or sum(forwards) != samples:
        raise AssertionError(
            f"with {where} the model saw micro-batches of sizes {forwards}: each of the {samples} samples exactly "
            f"once, in {micro} micro-batches")
    if micro > 1 and len(backwards) == len(forwards) and events.index(("backward", backwards[0])) >= micro:
        raise AssertionError(
            f"with {where} every micro-batch ran forward before any ran backward: summing the losses and calling "
            f"backward() once keeps the activations of all {micro} micro-batches alive together, as the big batch "
            f"did. Call backward() on each micro-batch's loss before the next forward; .grad adds them up")


def exercise_1(accumulate_gradients):
    import torch
    import torch.nn as nn

    # The loss is the caller's: MSE, and L1 in one case, so an answer that writes its own loss shows.
    for samples, micro, given in ((8, 4, nn.MSELoss()), (8, 3, nn.MSELoss()), (7, 2, nn.L1Loss()),
                                  (5, 1, nn.MSELoss())):
        calls = []

        def loss_fn(out, target, fn=given, calls=calls):
            calls.append(1)
            return fn(out, target)

        torch.manual_seed(100 * samples + micro)
        x, y = torch.randn(samples, 6), torch.randn(samples, 3)
        sizes = [len(c) for c in x.tensor_split(micro)]
        big = _mlp()
        loss_fn(big(x), y).backward()
        want = _grads(big)

        model = _mlp()
        events = _watch_passes(model)
        calls.clear()
        accumulate_gradients(model, loss_fn, x, y, micro)
        got = _grads(model)
        where = f"{samples} samples in {micro} micro-batches of sizes {sizes}"
        if not calls:
            raise AssertionError(f"with {where} your code never called loss_fn: the loss is the caller's (here "
                                 f"{type(given).__name__}); compute each micro-batch's loss as loss_fn(model(xb), yb)")
        missing = [n for (n, _), g in zip(model.named_parameters(), got) if g is None]
        assert not missing, (f"with {where} the parameters {missing} have no gradient: call backward() on every "
                             f"micro-batch's loss")
        require_finite(got, f"your accumulated gradients ({where})")
        _how(events, samples, micro, where)
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

def _ring_on_rank(fn, numel, seed):
    """On each rank: the learner's ring on a random tensor, then the same sum by dist.all_reduce (the
    check's own, unwatched)."""
    import torch
    import torch.distributed as dist

    from ultrascale.series import watch

    rank = dist.get_rank()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * seed + rank))
    t = x.clone()
    returned = fn(t)
    with watch.unwatched():
        dist.barrier()
        ref = x.clone()
        dist.all_reduce(ref)
    return {"input": x, "output": t, "reference": ref,
            "returned": returned.detach().clone() if torch.is_tensor(returned) else None}


def _run_ring(fn, numel, seed, world=WORLD):
    """Each rank's results and the torch.distributed calls it made, on `world` ranks."""
    calls = []
    try:
        results = on_ranks(world, _ring_on_rank, fn, numel, seed, timeout=RING_TIMEOUT, calls=calls)
    except AssertionError as e:
        if not str(e).startswith("deadlock"):
            raise
        where = str(e).split(". Every rank")[0]
        if "had returned" in where and "recv" in where:
            # Gloo delivers a message only into a buffer of its size: a receive sized for another chunk
            # waits for ever, after its sender has moved on.
            raise AssertionError(
                f"{where}. Its sender sent a message of another size: with {numel} elements the chunks of "
                f"t.tensor_split({world}) differ in size, so give each receive buffer the shape of the chunk it "
                f"receives (torch.empty_like(chunks[into]))") from None
        raise AssertionError(
            f"{where}. A blocking dist.send (or recv) waits for its partner: when every "
            f"rank sends first, or receives first, none of them can move. Each step, post the send with "
            f"dist.isend, then recv from the left, then wait on the send (the exchange helper)") from None
    except RankError as e:
        first = str(e).splitlines()[0]
        if "did not finish" in first and world != WORLD:
            raise AssertionError(
                f"your ring ran on {WORLD} ranks and did not finish on {world} within {RING_TIMEOUT:.0f} s: take N "
                f"from dist.get_world_size(), and the neighbours, the chunks and the 2(N-1) steps from N") from None
        if "did not finish" in first:
            raise AssertionError(
                f"the ring did not finish within {RING_TIMEOUT:.0f} s on {world} ranks: every send needs the "
                f"matching recv on the neighbour - each step, send to the right and receive from the left "
                f"(isend, then recv, then wait)") from None
        if "index out of range" in first:
            import torch

            pieces = [len(c) for c in torch.arange(numel).chunk(world)]
            raise AssertionError(
                f"with a tensor of {numel} elements on {world} ranks your ring failed: {first}. t.chunk(N) can give "
                f"fewer than N pieces ({numel} elements: {pieces}); t.tensor_split(N) always gives N, their sizes "
                f"differing by one at most") from None
        if "invalid for input of size" in first:
            raise AssertionError(
                f"with a tensor of {numel} elements on {world} ranks your ring failed: {first}. A view of N equal "
                f"rows needs a length that N divides; cut t with t.tensor_split(N), whose chunks may differ in "
                f"size by one") from None
        if world != WORLD:
            raise AssertionError(
                f"your ring ran on {WORLD} ranks and failed on {world} ({first}): take N from "
                f"dist.get_world_size(), and the neighbours, the chunks and the 2(N-1) steps from N") from None
        raise AssertionError(f"with a tensor of {numel} elements on {world} ranks your ring failed: {first}. "
                             f"The chunks of torch.tensor_split may differ in size: give each receive buffer "
                             f"the shape of the chunk it receives (torch.empty_like(chunks[j]))") from None
    for rank, r in enumerate(results):
        require_finite(r["output"], f"rank {rank}'s t after your ring ({numel} elements)")
    return results, calls


def _forbidden(calls):
    """Collectives do the all-reduce (or a phase of it) for the learner: only point-to-point is the lesson."""
    for rank, mine in enumerate(calls):
        used = sorted({k for k in watch.kinds(mine) if k not in watch.POINT_TO_POINT and k != "barrier"})
        if used:
            raise AssertionError(
                f"rank {rank} called dist.{', dist.'.join(used)}: a collective does the communication for you. "
                f"Build the all-reduce from dist.send / dist.recv (or isend / irecv) only: one chunk per step to "
                f"the right-hand neighbour, 2(N-1) steps")


def _sends(mine):
    return [c for c in mine if c.kind in ("send", "isend")]


def _recvs(mine):
    return [c for c in mine if c.kind in ("recv", "irecv")]


def _peers(calls, nbytes, ring):
    """Every rank sends to one neighbour and receives from the other, the same way round the ring for all
    (rightwards, or all leftwards: a ring turning the other way is a ring too)."""
    n = len(calls)
    sent = [watch.sent(mine) for mine in calls]
    to = [sorted({c.peer for c in _sends(mine)}) for mine in calls]
    # Each phase a ring of its own: the reduce-scatter's N - 1 sends one way round, the all-gather's
    # the same way or the other (the same chunks and bytes, the sum unchanged). First: on 3 ranks the two
    # ways round reach every other rank, which is no hub.
    phases = [[_sends(mine)[:n - 1] for mine in calls], [_sends(mine)[n - 1:] for mine in calls]]
    if n > 2 and all(len(_sends(mine)) == 2 * (n - 1) for mine in calls) and all(
            any(all({c.peer for c in phase[r]} == {(r + way) % n} for r in range(n)) for way in (1, -1))
            for phase in phases):
        for r in range(n):
            frm = {c.peer for c in _recvs(calls[r]) if c.peer is not None}
            if not frm <= {(r + 1) % n, (r - 1) % n}:
                raise AssertionError(f"rank {r} receives from rank(s) {sorted(frm)}: in a ring a rank receives only "
                                     f"from its neighbours, (rank - 1) % N and (rank + 1) % N")
        return
    hubs = [r for r in range(n) if to[r] == [p for p in range(n) if p != r]]
    if len(hubs) == 1 and all(to[r] == hubs for r in range(n) if r != hubs[0]):
        hub = hubs[0]
        raise AssertionError(
            f"every rank sends its whole tensor to rank {hub}, which adds and sends the sum back to each: rank "
            f"{hub} sent {sent[hub]:,} bytes for a {nbytes:,}-byte tensor where a ring sends 2(N-1)/N x "
            f"{nbytes:,} = {ring:,}, and its link carries all the traffic. In a ring every rank sends one chunk "
            f"(1/N) per step to its right-hand neighbour only")
    if len(hubs) > 1 and n > 2:
        raise AssertionError(
            f"ranks {hubs} each sent to every other rank ({', '.join(f'{sent[r]:,}' for r in hubs)} bytes) where "
            f"a ring sends 2(N-1)/N x {nbytes:,} = {ring:,}: in a ring every rank sends only to its right-hand "
            f"neighbour, one chunk (1/N of the tensor) per step, and the partial sums travel around")
    for r in range(n):
        if not to[r]:
            raise AssertionError(f"rank {r} sent nothing while others did: in a ring every rank sends one chunk "
                                 f"to its right-hand neighbour in each of the 2(N-1) steps")
    for way, name in ((1, "right-hand"), (-1, "left-hand")):
        if all(to[r] == [(r + way) % n] for r in range(n)):
            frm = [sorted({c.peer for c in _recvs(mine) if c.peer is not None}) for mine in calls]
            for r in range(n):
                if frm[r] and frm[r] != [(r - way) % n]:
                    raise AssertionError(
                        f"rank {r} receives from rank(s) {frm[r]}, but it is rank {(r - way) % n} that sends to "
                        f"it: each rank sends to its {name} neighbour and receives from the other side")
            return
    for r in range(n):
        others = [p for p in to[r] if p not in ((r + 1) % n, (r - 1) % n)]
        if others or len(to[r]) > 1:
            raise AssertionError(
                f"rank {r} sent to ranks {to[r]}: in a ring each rank sends only to its right-hand neighbour "
                f"(rank + 1) % N = {(r + 1) % n} and receives only from its left-hand one, (rank - 1) % N")
    raise AssertionError(f"the ranks send to {to}: some to the right, some to the left. Send every chunk the "
                         f"same way round the ring: to (rank + 1) % N, receiving from (rank - 1) % N")


def _steps(calls, numel, elem):
    """2(N-1) sends per rank, each one chunk of about 1/N of the tensor."""
    n = len(calls)
    chunk = -(-numel // n) * elem  # the largest chunk of tensor_split
    for rank, mine in enumerate(calls):
        sends = _sends(mine)
        big = max((c.bytes for c in sends), default=0)
        if big > chunk:
            raise AssertionError(
                f"rank {rank} sent a message of {big:,} bytes, more than one chunk ({chunk:,} bytes, 1/N of the "
                f"{numel * elem:,}-byte tensor): passing the whole tensor around the ring sends (N-1) x the tensor. "
                f"Cut t into N chunks (t.tensor_split(N)) and send one chunk per step")
        if len(sends) > 2 * (n - 1):
            raise AssertionError(
                f"rank {rank} sent {len(sends)} chunks; a ring all-reduce sends 2(N-1) = {2 * (n - 1)}: N-1 steps "
                f"of reduce-scatter, then N-1 of all-gather (range(world - 1) in each phase)")


def _unchanged(results):
    """t left as it was on every rank: the sum went elsewhere."""
    import torch

    if not all(torch.equal(r["output"], r["input"]) for r in results):
        return
    returned = results[0]["returned"]
    if returned is not None and returned.shape == results[0]["reference"].shape and \
            (returned - results[0]["reference"]).abs().max() < 1e-5:
        raise AssertionError("your function returns the sum but leaves t as it was: the all-reduce is in place - "
                             "write the sums into t's own chunks (views from t.tensor_split, += and copy_)")
    raise AssertionError("t is unchanged on every rank: the chunks must be views into t (t.tensor_split(N), no "
                         ".clone()), written in place (chunks[j] += buf, chunks[j].copy_(buf)), not rebound")


def _coefficients(results, rank, chunk):
    """c with output chunk = sum_k c_k * input_k chunk (least squares), and the relative residual."""
    import torch

    n = len(results)
    inputs = torch.stack([r["input"].tensor_split(n)[chunk] for r in results], dim=1).double()
    out = results[rank]["output"].tensor_split(n)[chunk].double()
    c = torch.linalg.lstsq(inputs, out.unsqueeze(1)).solution.squeeze(1)
    resid = (inputs @ c - out).norm().item() / (out.norm().item() or 1.0)
    return [round(v, 3) for v in c.tolist()], resid


def _diagnose(results, calls=None):
    """What each rank's t holds, chunk by chunk, as a combination of the ranks' inputs: names the phase
    that went wrong."""
    n = len(results)
    _unchanged(results)
    table = {(rank, j): _coefficients(results, rank, j) for rank in range(n) for j in range(n)}
    if all(abs(c - 1) < 1e-3 for cs, _ in table.values() for c in cs):
        return
    if all(abs(c - 1 / n) < 1e-3 for cs, _ in table.values() for c in cs):
        raise AssertionError(f"every element is the average over the {n} ranks, but an all-reduce with the default "
                             f"op (SUM) adds: do not divide by the world size")
    summed = [sum(all(abs(c - 1) < 1e-3 for c in table[rank, j][0]) for j in range(n)) for rank in range(n)]
    partial = all(resid < 1e-4 and all(-1e-3 < c < 1 + 1e-3 for c in cs) for cs, resid in table.values())
    if all(s == 1 for s in summed) and partial and calls and all(len(_sends(m)) == 2 * (n - 1) for m in calls):
        raise AssertionError(f"each rank ends with one summed chunk and partial sums in the others, though every "
                             f"rank sent 2(N-1) = {2 * (n - 1)} chunks: what the steps computed did not reach t. A "
                             f"chunk rebound (chunks[j] = chunks[j] + buf) is a new tensor, no longer a view of t, "
                             f"and what is sent or copied from then on misses t; write in place: chunks[j] += buf, "
                             f"chunks[j].copy_(buf)")
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


def _tail(results, numel):
    """Elements past N x (numel // N) left out of every chunk: the off-by-one of equal-sized slicing."""
    n = len(results)
    covered = n * (numel // n)
    for r in results:
        wrong = ((r["output"] - r["reference"]).abs() > 1e-5).nonzero().flatten().tolist()
        if wrong and min(wrong) >= covered:
            raise AssertionError(
                f"with {numel} elements the last {numel - covered} element(s) were never summed: chunks of "
                f"numel // N = {numel // n} elements cover only {covered}. Cut t with t.tensor_split(N), whose "
                f"chunks cover every element ({', '.join(str(len(c)) for c in r['input'].tensor_split(n))})")


def _fewer_pieces(calls, numel):
    """A ring over the pieces of t.chunk(N), which are fewer than N for a short tensor: 2(M-1) steps for M
    pieces, so the ranks past the last piece never take part in the sum."""
    import torch

    n = len(calls)
    pieces = [len(c) for c in torch.arange(numel).chunk(n)]
    if len(pieces) < n and all(len(_sends(mine)) == 2 * (len(pieces) - 1) for mine in calls):
        raise AssertionError(
            f"with {numel} elements on {n} ranks your ring went round {len(pieces)} chunks in "
            f"{2 * (len(pieces) - 1)} steps: t.chunk(N) can give fewer than N pieces ({pieces}), so some ranks' "
            f"contributions are never summed. t.tensor_split(N) always gives N, their sizes differing by one at "
            f"most; the ring has N - 1 steps in each phase whatever the sizes")


def _judge(results, calls, numel):
    """How the ring communicated, then what it computed."""
    n = len(results)
    elem = results[0]["input"].element_size()
    nbytes = numel * elem
    ring = 2 * (n - 1) * nbytes // n
    _forbidden(calls)
    if all(not _sends(mine) for mine in calls):
        _unchanged(results)
        raise AssertionError("no rank sent anything: each rank holds only its own tensor, so the sum needs "
                             "messages - 2(N-1) steps of dist.send / dist.recv around the ring")
    _peers(calls, nbytes, ring)
    _steps(calls, numel, elem)
    _tail(results, numel)
    if any((r["output"] - r["reference"]).abs().max().item() >= 1e-5 for r in results):
        _fewer_pieces(calls, numel)
        _diagnose(results, calls)
    for rank, r in enumerate(results):
        err = (r["output"] - r["reference"]).abs().max().item()
        assert err < 1e-5, (f"with {numel} elements rank {rank}'s result differs from dist.all_reduce by up to "
                            f"{err:.2e}: in the reduce-scatter phase add each received chunk to yours, in the "
                            f"all-gather phase copy it, taking every chunk from t.tensor_split(N)")
    for rank, mine in enumerate(calls):
        sends = _sends(mine)
        assert len(sends) == 2 * (n - 1), (
            f"rank {rank} sent {len(sends)} chunks; a ring all-reduce sends 2(N-1) = {2 * (n - 1)}: one in each "
            f"step of the reduce-scatter and of the all-gather")


def exercise_2(ring_all_reduce):
    n, numel = WORLD, 4096
    results, calls = _run_ring(ring_all_reduce, numel, seed=1)
    _judge(results, calls, numel)
    nbytes = numel * results[0]["input"].element_size()
    ring = 2 * (n - 1) * nbytes // n
    sent = [watch.sent(mine) for mine in calls]
    assert sent == [ring] * n, (f"the ranks sent {sent} bytes; a ring all-reduce of a {nbytes:,}-byte tensor sends "
                                f"2(N-1)/N x {nbytes:,} = {ring:,} from each rank")
    # A size that does not divide by N: the chunks of tensor_split differ (257 elements: 65, 64, 64, 64);
    # and a short one, where t.chunk(N) makes fewer than N pieces (6 elements: 2, 2, 2).
    _judge(*_run_ring(ring_all_reduce, 257, seed=2), 257)
    _judge(*_run_ring(ring_all_reduce, 6, seed=3), 6)
    # An odd ring, 3 ranks: a world size, a neighbour or a step count written for 4 shows.
    _judge(*_run_ring(ring_all_reduce, 1000, seed=4, world=3), 1000)
    print(f"Your ring: each of the {n} ranks sent {sent[0]:,} bytes to all-reduce a {nbytes:,}-byte tensor, "
          f"one chunk to its neighbour in each of the 2(N-1) = {2 * (n - 1)} steps; 2(N-1)/N x {nbytes:,} = "
          f"{ring:,} bytes. Same result as dist.all_reduce on every rank.")
