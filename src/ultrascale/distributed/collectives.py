"""The collective operations, built from point-to-point sends and receives.

Every technique in this project is a pattern of collectives: data parallelism
all-reduces gradients, ZeRO reduce-scatters them and all-gathers parameters,
tensor parallelism all-reduces activations, expert parallelism all-to-alls
tokens. NCCL and gloo implement them in C++; here each is written again from
`send`/`recv` so the movement of data can be read step by step. They are tested
against torch.distributed, but they are for reading: the libraries also pipeline
chunks, overlap steps and pick an algorithm by message size and topology.

Conventions, as in torch.distributed: `group=None` is the default group; `src`
and `dst` are *global* ranks (send/recv take global ranks, so each function maps
group positions to global ranks with `_members`); tensors must be contiguous; a
single process (no process group, or a group of one) is a no-op.

Costs: N is the group size, B the bytes of the full buffer. A "step" is a round
in which each rank sends and receives at most one message; it costs a latency
plus message size / link bandwidth.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist


# -- plumbing ---------------------------------------------------------------
def _members(group, *tensors: torch.Tensor) -> tuple[list[int], int]:
    """The group's global ranks (in group-rank order) and our group rank; checks `tensors`."""
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("collectives need contiguous tensors; call .contiguous() first")
    if not dist.is_initialized():
        return [0], 0
    ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of the group {ranks}")
    return ranks, ranks.index(me)


def _is_avg(op) -> bool:
    if op in ("sum", dist.ReduceOp.SUM, "avg", dist.ReduceOp.AVG):
        return op in ("avg", dist.ReduceOp.AVG)
    raise ValueError(f"op must be 'sum', 'avg', ReduceOp.SUM or ReduceOp.AVG, not {op!r}")


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> None:
    """Send to dst while receiving from src, and wait for both.

    Posting both before waiting is what makes a ring work: if every rank did a
    blocking send first, each would wait for a neighbour that is also sending.
    `batch_isend_irecv` issues the pair together (one NCCL group call on GPUs).
    """
    _post_and_wait([dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)])


def _post_and_wait(ops: list) -> None:
    # batch_isend_irecv refuses an empty list (a root alone in its group has nothing to post).
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _bounds(sizes) -> list[int]:
    """Offsets of consecutive chunks of the given sizes in a flat buffer: [0, s0, s0+s1, ...]."""
    return [0, *itertools.accumulate(sizes)]


def _even(numel: int, n: int) -> list[int]:
    # As torch.tensor_split: the first numel % n chunks one larger. Uneven chunks rather
    # than padding: no copy, and a buffer smaller than the group leaves some chunks empty.
    base, extra = divmod(numel, n)
    return [base + (i < extra) for i in range(n)]


def _chunk(flat: torch.Tensor, bounds: list[int], i: int) -> torch.Tensor:
    return flat[bounds[i]:bounds[i + 1]]


# -- the ring: bandwidth-optimal reduce-scatter, all-gather, all-reduce -------
def _ring_reduce_scatter_(flat, bounds, ranks, me, group) -> None:
    """In place: chunk `me` of `flat` becomes the sum of every rank's chunk `me` (others: scratch)."""
    n = len(ranks)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for step in range(n - 1):
        # Pass on the chunk received (and added to) in the previous step; chunk c
        # starts at rank c+1, collects one contribution per hop and, after N-1
        # hops, arrives complete at rank c.
        send_c, recv_c = (me - step - 1) % n, (me - step - 2) % n
        incoming = torch.empty_like(_chunk(flat, bounds, recv_c))
        _exchange(_chunk(flat, bounds, send_c), right, incoming, left, group)
        _chunk(flat, bounds, recv_c).add_(incoming)


def _ring_all_gather_(flat, bounds, ranks, me, group) -> None:
    """In place: rank i's chunk i of `flat` is copied into chunk i of every rank's `flat`."""
    n = len(ranks)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for step in range(n - 1):
        # Forward what arrived last step: every chunk travels N-1 hops around the ring.
        send_c, recv_c = (me - step) % n, (me - step - 1) % n
        _exchange(_chunk(flat, bounds, send_c), right, _chunk(flat, bounds, recv_c), left, group)


def ring_reduce_scatter(tensor: torch.Tensor, group=None, *, op="sum") -> torch.Tensor:
    """Every rank holds a full buffer; afterwards rank i holds chunk i of their sum (or mean).

    Before: rank r holds x_r.  After: rank i gets a new 1-D tensor, chunk i of
    (x_0 + ... + x_{N-1}).flatten() as torch.tensor_split cuts it; x_r is untouched.
    Cost: N-1 steps; each rank sends (N-1)/N * B (one chunk per step).
    """
    avg = _is_avg(op)
    ranks, me = _members(group, tensor)
    flat = tensor.flatten().clone()  # the ring uses the buffer as scratch
    bounds = _bounds(_even(flat.numel(), len(ranks)))
    _ring_reduce_scatter_(flat, bounds, ranks, me, group)
    mine = _chunk(flat, bounds, me)
    return mine / len(ranks) if avg else mine.clone()  # a copy: not a view pinning the whole buffer


def ring_all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank contributes a tensor of the same shape; all get them concatenated along dim 0.

    Before: rank r holds x_r of shape (d0, ...).  After: every rank gets
    cat([x_0, ..., x_{N-1}]) of shape (N*d0, ...) (a 0-dim x gives shape (N,)).
    Cost: N-1 steps; each rank sends (N-1) * bytes(x) = (N-1)/N of the output.
    """
    ranks, me = _members(group, tensor)
    n, size = len(ranks), tensor.numel()
    flat = tensor.new_empty(n * size)
    flat[me * size:(me + 1) * size] = tensor.flatten()
    _ring_all_gather_(flat, _bounds([size] * n), ranks, me, group)
    return flat.view(-1, *tensor.shape[1:])


def ring_all_reduce(tensor: torch.Tensor, group=None, *, op="sum") -> torch.Tensor:
    """In place, every rank's tensor becomes the sum (or mean) over the group; returns it.

    Before: rank r holds x_r.  After: every rank holds x_0 + ... + x_{N-1}.
    It is a ring reduce-scatter (rank i ends with chunk i of the sum) followed by
    a ring all-gather of those chunks, on the same buffer.
    Cost: 2(N-1) steps; each rank sends 2(N-1)/N * B, under 2B however large N
    is, with every link busy at every step: bandwidth-optimal. (The latency term,
    2(N-1) steps, is what trees and hierarchical rings cut on large clusters.)
    """
    avg = _is_avg(op)
    ranks, me = _members(group, tensor)
    if len(ranks) == 1:
        return tensor
    flat = tensor.view(-1)
    bounds = _bounds(_even(flat.numel(), len(ranks)))
    _ring_reduce_scatter_(flat, bounds, ranks, me, group)
    if avg:  # between the phases, each rank divides only its own chunk
        _chunk(flat, bounds, me).div_(len(ranks))
    _ring_all_gather_(flat, bounds, ranks, me, group)
    return tensor


def naive_all_reduce(tensor: torch.Tensor, group=None, *, op="sum") -> torch.Tensor:
    """The same result as `ring_all_reduce`, by reducing to group rank 0 and broadcasting back.

    Cost: 2(N-1) steps of B, all through group rank 0, which receives and sends
    (N-1) * B while the other links idle: time grows with N, where the ring's
    stays near 2B / bandwidth.
    """
    avg = _is_avg(op)
    ranks, me = _members(group, tensor)
    n = len(ranks)
    if me == 0:
        incoming = torch.empty_like(tensor)
        for r in ranks[1:]:
            dist.recv(incoming, r, group)
            tensor.add_(incoming)
        if avg:
            tensor.div_(n)
        for r in ranks[1:]:
            dist.send(tensor, r, group)
    else:
        dist.send(tensor, ranks[0], group)
        dist.recv(tensor, ranks[0], group)
    return tensor


# -- one-to-all and all-to-one: binomial trees and linear fans -------------
def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In place, every rank's tensor becomes a copy of rank `src`'s (a global rank); returns it.

    A binomial tree: in round k every rank that has the data sends it to the rank
    2^k positions further (counted from src), so the number of holders doubles.
    Cost: ceil(log2 N) steps of B; each rank receives B once, src sends ceil(log2 N) * B.
    Linear (src sends N-1 times) takes N-1 steps. For large B, libraries instead
    pipeline chunks along a chain, which approaches B / bandwidth.
    """
    ranks, me = _members(group, tensor)
    n, root = len(ranks), ranks.index(src)
    rel = (me - root) % n  # position counted from the root
    mask = 1
    while mask < n:
        if rel < mask and rel + mask < n:
            dist.send(tensor, ranks[(root + rel + mask) % n], group)
        elif mask <= rel < 2 * mask:
            dist.recv(tensor, ranks[(root + rel - mask) % n], group)
        mask *= 2
    return tensor


def reduce(tensor: torch.Tensor, dst: int, group=None, *, op="sum") -> torch.Tensor:
    """Rank `dst` (global) ends with the sum (or mean) of every rank's tensor; returns tensor.

    Only dst's tensor changes. The tree of `broadcast` run backwards: in round k
    the ranks at odd multiples of 2^k (counted from dst) send their partial sum
    2^k back and drop out; after ceil(log2 N) rounds only dst is left.
    Cost: ceil(log2 N) steps of B; each rank sends B once, dst receives ceil(log2 N) * B.
    """
    avg = _is_avg(op)
    ranks, me = _members(group, tensor)
    n, root = len(ranks), ranks.index(dst)
    rel = (me - root) % n
    acc = tensor if me == root else tensor.clone()  # partial sums must not leak into inputs
    incoming = torch.empty_like(tensor)
    mask = 1
    while mask < n:
        if rel & mask:
            dist.send(acc, ranks[(root + rel - mask) % n], group)
            break
        if rel + mask < n:
            dist.recv(incoming, ranks[(root + rel + mask) % n], group)
            acc.add_(incoming)
        mask *= 2
    if avg and me == root:
        tensor.div_(n)
    return tensor


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, group=None):
    """Rank `dst` (global) collects every rank's tensor: gather_list[i] = rank i's tensor.

    Linear: each rank sends straight to dst, which posts all its receives at once.
    A tree would not help: dst's link must take in (N-1) * bytes(tensor) whatever
    the route, and it is the bottleneck. Returns gather_list (None off dst).
    Cost: each rank sends bytes(tensor) once; dst receives (N-1) * bytes(tensor).
    """
    ranks, me = _members(group, tensor, *(gather_list or []))
    root = ranks.index(dst)
    # Every rank goes through batch_isend_irecv: NCCL needs all ranks of a group
    # in its first batched call, and gather may be that call.
    if me != root:
        _post_and_wait([dist.P2POp(dist.isend, tensor, dst, group)])
        return gather_list
    gather_list[me].copy_(tensor)
    _post_and_wait([dist.P2POp(dist.irecv, gather_list[i], r, group) for i, r in enumerate(ranks) if i != me])
    return gather_list


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, group=None) -> torch.Tensor:
    """Rank i's tensor becomes rank `src`'s scatter_list[i] (src a global rank); returns it.

    Linear, the mirror of `gather` and for the same reason: src's link must send
    out (N-1) * bytes(tensor) whatever the route.
    Cost: src sends (N-1) * bytes(tensor); each other rank receives bytes(tensor) once.
    """
    ranks, me = _members(group, tensor, *(scatter_list or []))
    root = ranks.index(src)
    if me != root:  # batched on every rank, as in gather
        _post_and_wait([dist.P2POp(dist.irecv, tensor, src, group)])
        return tensor
    tensor.copy_(scatter_list[me])
    _post_and_wait([dist.P2POp(dist.isend, scatter_list[i], r, group) for i, r in enumerate(ranks) if i != me])
    return tensor


# -- all-to-all shapes, in torch.distributed's list form -------------------
def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """tensor_list[i] becomes rank i's tensor, on every rank; returns tensor_list.

    The ring all-gather on a buffer made of the list's tensors (sizes may differ).
    Cost: N-1 steps; each rank sends (N-1) * bytes(tensor).
    """
    ranks, me = _members(group, tensor)
    bounds = _bounds(t.numel() for t in tensor_list)
    flat = tensor.new_empty(bounds[-1])
    _chunk(flat, bounds, me).copy_(tensor.flatten())
    _ring_all_gather_(flat, bounds, ranks, me, group)
    for i, t in enumerate(tensor_list):
        t.copy_(_chunk(flat, bounds, i).view_as(t))
    return tensor_list


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], group=None, *, op="sum") -> torch.Tensor:
    """Rank i's output becomes the sum (or mean) over ranks of their input_list[i]; returns output.

    The ring reduce-scatter on a buffer made of the list's tensors.
    Cost: N-1 steps; each rank sends (N-1) * bytes(output).
    """
    avg = _is_avg(op)
    ranks, me = _members(group, output)
    flat = torch.cat([t.flatten() for t in input_list])  # a copy: the ring uses it as scratch
    bounds = _bounds(t.numel() for t in input_list)
    _ring_reduce_scatter_(flat, bounds, ranks, me, group)
    output.copy_(_chunk(flat, bounds, me).view_as(output))
    return output.div_(len(ranks)) if avg else output


def all_to_all(output_list: list[torch.Tensor], input_list: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Rank j's output_list[i] becomes rank i's input_list[j]: a transpose across ranks.

    Pairwise exchange: in step s every rank sends to the rank s ahead and receives
    from the rank s behind, so each step is a permutation and no rank is sent to
    by two others at once. Cost: N-1 steps; each rank sends (N-1)/N of its input.
    """
    ranks, me = _members(group, *output_list, *input_list)
    n = len(ranks)
    output_list[me].copy_(input_list[me])
    for s in range(1, n):
        to, frm = (me + s) % n, (me - s) % n
        _exchange(input_list[to], ranks[to], output_list[frm], ranks[frm], group)
    return output_list


def barrier(group=None, device="cpu") -> None:
    """Return only once every rank of the group has entered the barrier.

    Dissemination: in round k each rank signals the rank 2^k ahead and waits for
    the one 2^k behind. Signals travel transitively, so after round k a rank has
    heard from the 2^(k+1) ranks behind it; after ceil(log2 N) rounds, from all.
    Cost: ceil(log2 N) steps of one element; no rank is a hub. `device` is where
    the token lives: the accelerator for NCCL.
    """
    ranks, me = _members(group)
    n = len(ranks)
    token, heard = torch.zeros(1, device=device), torch.empty(1, device=device)
    d = 1
    while d < n:
        _exchange(token, ranks[(me + d) % n], heard, ranks[(me - d) % n], group)
        d *= 2
