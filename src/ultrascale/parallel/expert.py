"""Expert parallelism: each rank of an expert group holds E/ep of the experts.

The playbook's picture: attention and the rest of the model are data-parallel,
but the experts of an MoE layer are spread over the ep ranks of an expert group
(carved out of data parallelism, distributed/context.py). A token routed to an
expert another rank holds has to travel there and its output has to come back:
that is the dispatch, and the combine. Two ways, `--dispatch`:

allgather  the naive one: every rank of the group gathers every rank's tokens and
           routing, runs its own experts on the tokens routed to them, and a
           reduce-scatter sums the partial outputs back to the ranks the tokens
           came from. Simple; moves ep x the tokens to every rank.
alltoall   the one used at scale (GShard, Megatron, DeepSpeed): each rank sends
           each other rank only the tokens routed to its experts. The counts per
           expert go first (the receiver must know how many rows to expect),
           then one variable-split all-to-all of the tokens, the local experts in
           expert-major order, and the reverse all-to-all of the outputs.

Both are autograd functions whose backward is the reverse communication, so the
router, the tokens and the experts get their gradients as in one process. An
expert's weight gradient is then a sum over the tokens of the whole expert group
(ep ranks' worth of data); parallel/expert_grads.py turns it into the average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ultrascale.distributed.flat import all_gather as _all_gather
from ultrascale.distributed.flat import reduce_scatter as _reduce_scatter
from ultrascale.model.moe import MoE, Experts
from ultrascale.spans import comm


class _AllToAll(torch.autograd.Function):
    """Rows x[sum(send)] out, rows [sum(recv)] in: send[r] rows go to rank r, recv[r] come from it.
    Backward: the gradients travel the same way back (send and recv swapped)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        with comm("ep.all_to_all"):
            dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        with comm("ep.all_to_all"):
            dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's x along dim 0; backward: each rank gets the sum of the gradients of its rows."""

    @staticmethod
    def forward(ctx, x, group, world: int):
        ctx.group, ctx.world = group, world
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        with comm("ep.all_gather"):
            _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, ctx.group, ctx.world), None, None


class _ReduceScatter(torch.autograd.Function):
    """Sum over ranks, then rank r keeps rows r*n .. (r+1)*n; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group, world: int):
        ctx.group, ctx.world = group, world
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        with comm("ep.reduce_scatter"):
            _reduce_scatter(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad, ctx.group, ctx.world), None, None


class AllToAllDispatch:
    """Send each assignment to the rank holding its expert; the reverse path brings the outputs home."""

    def __init__(self, group, world: int, n_experts: int):
        self.group, self.world, self.local = group, world, n_experts // world

    def __call__(self, tokens, token_of, expert_idx, weights, experts: Experts):
        # Expert-major order is also destination-rank-major: expert e lives on rank e // local.
        order = torch.argsort(expert_idx, stable=True)
        counts = torch.bincount(expert_idx, minlength=self.world * self.local)
        # 1. How many rows each rank will receive, per local expert: [source rank, local expert].
        got = torch.empty_like(counts)
        with comm("ep.all_to_all"):
            dist.all_to_all_single(got, counts, group=self.group)
        got = got.view(self.world, self.local)
        send = counts.view(self.world, self.local).sum(1).tolist()
        recv = got.sum(1).tolist()
        # 2. The tokens travel; they arrive grouped by source rank, each group in local-expert order.
        x = _AllToAll.apply(tokens[token_of[order]], send, recv, self.group)
        # 3. Regroup by local expert (all sources' rows of expert 0 first, ...), run, and undo the regrouping.
        expert_of_row = torch.repeat_interleave(torch.arange(self.local, device=x.device).repeat(self.world),
                                                got.flatten())
        perm = torch.argsort(expert_of_row, stable=True)
        y = experts(x[perm], got.sum(0))
        y = y[torch.argsort(perm)]
        # 4. The outputs travel back, in the order they left; weight them and add them at their tokens.
        y = _AllToAll.apply(y, recv, send, self.group)
        out = torch.zeros_like(tokens)
        return out.index_add(0, token_of[order], y * weights[order, None].to(y.dtype))


class AllGatherDispatch:
    """Every rank sees every token of the group; each computes its experts' share; a reduce-scatter adds them."""

    def __init__(self, group, world: int, n_experts: int, rank: int):
        self.group, self.world, self.n = group, world, n_experts
        self.local = n_experts // world
        self.first = rank * self.local

    def __call__(self, tokens, token_of, expert_idx, weights, experts: Experts):
        t = tokens.shape[0]
        # The routing as dense [tokens, experts] tables: the weights (differentiable) and which are taken.
        dense = weights.new_zeros(t, self.n).index_put((token_of, expert_idx), weights)
        taken = torch.zeros(t, self.n, device=tokens.device).index_put((token_of, expert_idx),
                                                                       torch.ones_like(weights))
        all_tokens = _AllGather.apply(tokens, self.group, self.world)
        all_weights = _AllGather.apply(dense, self.group, self.world)
        all_taken = taken.new_empty(self.world * t, self.n)
        _all_gather(all_taken, taken, group=self.group)
        mine = slice(self.first, self.first + self.local)
        # Expert-major: nonzero of the transposed table lists expert 0's tokens first.
        e, tok = all_taken[:, mine].T.nonzero(as_tuple=True)
        y = experts(all_tokens[tok], torch.bincount(e, minlength=self.local))
        w = all_weights[:, mine].T[e, tok]
        partial = torch.zeros_like(all_tokens).index_add(0, tok, y * w[:, None].to(y.dtype))
        return _ReduceScatter.apply(partial, self.group, self.world)


def apply_expert_parallel(model, ctx, dispatch: str):
    """Keep this rank's E/ep experts of every MoE layer (on the meta device) and swap in the dispatcher.

    Each expert weight remembers the full shape and where its rows start, so init takes
    its slice of the full tensor and checkpoints place it (parallel/placement.py)."""
    ep, rank, group = ctx.size("ep"), ctx.index("ep"), ctx.group("ep")
    for m in model.modules():
        if not isinstance(m, MoE):
            continue
        n = m.n_experts // ep
        old = dict(m.experts.named_parameters())
        m.experts = Experts(n, m.cfg.hidden, m.cfg.expert_ffn)
        for name, p in m.experts.named_parameters():
            p.__dict__.update(old[name].__dict__)  # what tensor parallelism noted (replicated over tp)
            p.full_shape, p.ep_offset = tuple(old[name].shape), rank * n
            p.shard_of_full = lambda t, start=rank * n, n=n: t.narrow(0, start, n)
        m.dispatch = (AllToAllDispatch(group, ep, m.n_experts) if dispatch == "alltoall"
                      else AllGatherDispatch(group, ep, m.n_experts, rank))
    return model


def gather_experts(param, tensor, ctx):
    """The full tensor of an expert-parallel weight (all ranks' experts, in order); others as they are."""
    if getattr(param, "ep_offset", None) is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(ctx.size("ep"))]
    dist.all_gather(parts, tensor.contiguous(), group=ctx.group("ep"))
    return torch.cat(parts)


def share_token_loads(model, ctx, sequence_parallel: bool):
    """The MoE layers' balance losses over the whole micro-batch when its tokens are sharded:
    context parallelism cuts every sequence over cp (gradients averaged over dp x cp), sequence
    parallelism each cp shard over tp (the router's gradients summed over tp, like the norms'). The
    loads are summed over both (Megatron reduces the router's statistics over tp x cp)."""
    from ultrascale.model.moe import shard_tokens

    if ctx.size("cp") > 1:
        shard_tokens(model, _summed_over(ctx.group("cp")), ctx.size("cp"), averaged=True)
    if sequence_parallel and ctx.size("tp") > 1:
        shard_tokens(model, _summed_over(ctx.group("tp")), ctx.size("tp"), averaged=False)
    return model


def _summed_over(group):
    def reduce(t):
        with comm("moe.loads_all_reduce"):
            dist.all_reduce(t, group=group)
        return t

    return reduce
