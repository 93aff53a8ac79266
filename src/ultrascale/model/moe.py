"""Mixture of Experts: the MLP of a block replaced by many MLPs, each token visiting a few.

A router (a linear layer, h -> E) scores every token against every expert, in
fp32; the token goes to its top_k experts and their outputs are summed, weighted
by the scores (renormalised to sum to 1 if asked). Written to know nothing of
parallelism: `self.dispatch` moves the chosen tokens to the experts and their
outputs back, and `local_dispatch` below does it in one process; expert
parallelism (parallel/expert.py) swaps in a dispatcher that crosses ranks.

Capacity (Switch Transformer, GShard): with capacity_factor F each expert takes at
most ceil(F * tokens * k / E) assignments of the tokens this rank holds in this
micro-batch; over that, the lowest-scoring assignments are dropped (Megatron's
rule) and those tokens keep only the residual (and the shared expert). F = 0 is
dropless.

Balance: the Switch load-balancing loss E * sum_e f_e * P_e (f_e: fraction of the
assignments to e, P_e: mean score of e) and the router z-loss mean(logsumexp^2)
over the micro-batch's tokens are added to the loss by their coefficients (their gradient is injected in
backward, so neither the trainer nor the pipeline schedule carry them); or, with
router_bias_rate, DeepSeek-V3's aux-loss-free balancing: a per-expert bias added
to the scores for the choice only, moved after each optimizer step towards the
mean load (`update_router_bias`).

When other ranks hold the rest of each micro-batch's tokens (context parallelism's
sequence shards, sequence parallelism's), `shard_tokens` gives the layer a sum over
them: the loads f_e are the micro-batch's, and each rank's term of the losses is its
tokens' part of the micro-batch's loss (Megatron reduces the router's statistics
over the tp x cp group the same way). Capacity needs the whole micro-batch's scores
in one place, so a layout that shards the sequence runs dropless (config.py refuses
the rest).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


_grouped_mm = getattr(torch, "_grouped_mm", None)


class Experts(nn.Module):
    """n SwiGLU MLPs with stacked weights: gate and up [n, f, h], down [n, h, f].

    All n at once: the rows arrive sorted by expert, and one grouped matmul per
    projection multiplies each expert's rows by that expert's weights (torch's
    `_grouped_mm`, given where each expert's rows end). One call for the n
    experts instead of n small ones: at the sizes a CPU trains, the per-call cost
    of n matmuls, not their FLOPs, is what a loop over experts pays. Where this
    torch has no grouped matmul for the device (before 2.9; on CUDA it needs bf16
    on recent GPUs), or inside a compiled graph, the experts run one after the other.
    """

    def __init__(self, n: int, h: int, f: int):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n, f, h))
        self.up = nn.Parameter(torch.empty(n, f, h))
        self.down = nn.Parameter(torch.empty(n, h, f))

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        """x [sum(counts), h] in expert-major order: the first counts[0] rows go to expert 0, ...
        counts: rows per expert, a list or an integer tensor."""
        # Under torch.compile, the grouped matmul's meta kernel (what the graph is traced with) takes
        # bf16 only in this torch, although the CPU kernel runs fp32: a traced layer loops.
        if _grouped_mm is not None and x.device.type == "cpu" and not torch.compiler.is_compiling():
            return self._grouped(x, torch.as_tensor(counts, device=x.device))
        return self._one_by_one(x, counts.tolist() if torch.is_tensor(counts) else counts)

    def _grouped(self, x, counts):
        # An expert with no rows is an empty group: its gradient is a zero, not None.
        ends = counts.cumsum(0).to(torch.int32)
        gate = _grouped_mm(x, self.gate.transpose(1, 2), offs=ends)
        up = _grouped_mm(x, self.up.transpose(1, 2), offs=ends)
        return _grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)

    def _one_by_one(self, x, counts: list[int]):
        outs = []
        for e, xe in enumerate(x.split(counts)):
            # An expert with no rows still takes part (an empty matmul): its gradient is a zero, not None.
            outs.append(F.linear(F.silu(F.linear(xe, self.gate[e])) * F.linear(xe, self.up[e]), self.down[e]))
        return torch.cat(outs)


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token visits (DeepSeek), named like the dense MLP."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def sort_by_expert(expert_idx: torch.Tensor, n_experts: int):
    """The permutation that puts assignments in expert-major order, and the count per expert."""
    order = torch.argsort(expert_idx, stable=True)
    return order, torch.bincount(expert_idx, minlength=n_experts)


def local_dispatch(tokens, token_of, expert_idx, weights, experts: Experts) -> torch.Tensor:
    """Every expert in this process. tokens [T, h]; token_of, expert_idx, weights [N]: the kept
    assignments (token, expert, weight). Permute them to expert-major order, run each expert
    on its rows, weight the outputs by the scores and add them back at their tokens."""
    order, counts = sort_by_expert(expert_idx, experts.gate.shape[0])
    y = experts(tokens[token_of[order]], counts)
    out = torch.zeros_like(tokens)
    return out.index_add(0, token_of[order], y * weights[order, None].to(y.dtype))


class _InjectAuxLoss(torch.autograd.Function):
    """Forward: x unchanged. Backward: also d(loss)/d(aux) = scale, so `aux` joins the loss
    without being returned through the model (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.experts, cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, cfg.hidden, cfg.expert_ffn)
        self.shared = SharedExpert(cfg.hidden, cfg.shared_ffn) if cfg.shared_ffn else None
        self.register_buffer("router_bias", torch.zeros(cfg.experts))
        self.dispatch = local_dispatch
        self.aux_scale = 1.0  # d(loss)/d(coef * aux): 1 / micro-batches per step, set by the trainer
        # The other ranks holding this micro-batch's tokens (shard_tokens): a sum over them, how many
        # share the tokens, and what this rank's term of the losses is multiplied by.
        self.shard_reduce, self.token_shards, self.loss_share = None, 1, 1
        self.reset_stats()

    def reset_stats(self) -> None:
        """Per-step statistics, summed over the step's micro-batches where the routing runs (no
        device sync per micro-batch): [assignments per expert (before dropping)..., dropped,
        aux loss, z-loss, micro-batches], float64."""
        self.stats = torch.zeros(self.n_experts + 4, dtype=torch.float64, device="cpu")

    counts = property(lambda self: self.stats[:self.n_experts])
    dropped = property(lambda self: self.stats[-4])
    aux_sum = property(lambda self: float(self.stats[-3]))
    z_sum = property(lambda self: float(self.stats[-2]))

    def route(self, tokens):
        """(top-k expert indices [T, k], their weights [T, k] fp32, keep mask [T, k], scores, logits)."""
        logits = F.linear(tokens.float(), self.router.weight.float())  # fp32 whatever the compute dtype
        scores = logits.softmax(-1) if self.cfg.router_score == "softmax" else logits.sigmoid()
        # The bias steers the choice only; the weights stay the scores (DeepSeek-V3).
        idx = (scores + self.router_bias).topk(self.top_k, dim=-1).indices
        chosen = scores.gather(1, idx)
        weights = chosen / chosen.sum(-1, keepdim=True) if self.cfg.router_renorm else chosen
        keep = self.capacity_mask(idx, chosen.detach())
        return idx, weights, keep, scores, logits

    def capacity_mask(self, idx, chosen):
        """Which assignments each expert takes: all (dropless), or its capacity's highest scores."""
        t = idx.shape[0]
        if not self.cfg.capacity_factor:
            return torch.ones_like(idx, dtype=torch.bool)
        cap = min(t, math.ceil(self.cfg.capacity_factor * t * self.top_k / self.n_experts))
        # Scores on a 2^-14 grid, then a stable sort: the highest-scoring tokens of each expert, ties by
        # position. Equal prefixes in two sequences (indentation) give mathematically equal scores that
        # rounding separates by an ulp or two, differently in each layout; without the grid a parallel
        # run and one process would drop different ones of them (a 2^-20 grid still did: measured).
        key = torch.round(chosen * 2**14)
        by_expert = torch.full((t, self.n_experts), -math.inf, device=idx.device).scatter(1, idx, key)
        best = by_expert.sort(dim=0, descending=True, stable=True).indices[:cap]  # [cap, E]
        taken = torch.zeros_like(by_expert, dtype=torch.bool).scatter(0, best, True) & (by_expert > -math.inf)
        return taken.gather(1, idx)

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        idx, weights, keep, scores, logits = self.route(tokens)
        token_of = torch.arange(tokens.shape[0], device=x.device)[:, None].expand_as(idx)
        if self.cfg.capacity_factor:  # only the kept assignments travel
            out = self.dispatch(tokens, token_of[keep], idx[keep], weights[keep], self.experts)
        else:  # dropless: all of them, in the same (row-major) order, without a mask to apply
            out = self.dispatch(tokens, token_of.flatten(), idx.flatten(), weights.flatten(), self.experts)
        if self.shared is not None:
            out = out + self.shared(tokens)
        trained = bool(self.cfg.aux_loss_coef or self.cfg.z_loss_coef)
        with torch.set_grad_enabled(torch.is_grad_enabled() and trained):  # otherwise only metrics: no graph
            aux = self.balance_loss(idx, keep, scores, logits)
        if aux is not None and self.training and torch.is_grad_enabled():
            out = _InjectAuxLoss.apply(out, aux, self.aux_scale)
        return out.view(shape)

    def balance_loss(self, idx, keep, scores, logits):
        """coef * Switch load-balancing loss + coef * z-loss over this micro-batch's tokens, or None.
        Both are recorded for the metrics, with the loads, even when not trained on.

        With the micro-batch's tokens shared by other ranks (shard_tokens), the loads are summed
        over them first, and this rank's term is its tokens' part of the micro-batch's losses:
        the terms of all of them add up to the losses one process computes."""
        c, e = self.cfg, self.n_experts
        counts = torch.bincount(idx.flatten(), minlength=e).float()
        probs = scores / scores.sum(-1, keepdim=True)  # sigmoid scores normalised per token, as DeepSeek
        lse2 = logits.logsumexp(-1).pow(2)
        if self.shard_reduce is None:  # one process's formula as it always was (its rounding unchanged)
            t = idx.shape[0]
            aux = e * (counts / (t * self.top_k) * probs.mean(0)).sum()
            z = lse2.mean()
            whole_aux, whole_z = aux, z
        else:
            t = idx.shape[0] * self.token_shards  # the micro-batch's tokens, over the ranks that share them
            probs_sum, z_sum = probs.sum(0), lse2.sum()
            with torch.no_grad():  # one collective for the loads and the metrics' sums
                whole = self.shard_reduce(torch.cat([counts, probs_sum.detach(), z_sum.detach()[None]]))
            load = whole[:e] / (t * self.top_k)
            # Ranks whose gradients are averaged (not summed) count their part loss_share times.
            aux = e * (load * probs_sum).sum() / t * self.loss_share
            z = z_sum / t * self.loss_share
            whole_aux, whole_z = e * (load * whole[e:2 * e]).sum() / t, whole[-1] / t
        with torch.no_grad():
            # The loads are this rank's (the trainer sums them over the ranks), the losses the micro-batch's.
            row = torch.cat([counts, torch.stack([(~keep).sum().float(), whole_aux.detach(), whole_z.detach(),
                                                  torch.ones_like(z)])]).double()
            if self.stats.device != row.device:
                self.stats = self.stats.to(row.device)
            self.stats += row
        if not (c.aux_loss_coef or c.z_loss_coef):
            return None
        return c.aux_loss_coef * aux + c.z_loss_coef * z


def moe_layers(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def shard_tokens(model, reduce_sum, ranks: int, averaged: bool) -> None:
    """Every MoE layer's tokens of a micro-batch are also on `ranks` - 1 other ranks (their shards of
    the same sequences): `reduce_sum(t)` sums a tensor over them. averaged: their gradients are
    averaged afterwards (context parallelism, within dp x cp), not summed (sequence parallelism,
    within tp), so each rank's part of the balance losses counts `ranks` times. Composes: two
    calls give the product of both groups."""
    for m in moe_layers(model):
        inner = m.shard_reduce

        def reduce(t, inner=inner):
            t = reduce_sum(t)
            return inner(t) if inner is not None else t

        m.shard_reduce = reduce
        m.token_shards *= ranks
        m.loss_share *= ranks if averaged else 1


@torch.no_grad()
def step_loads(model, reduce_sum=None):
    """This step's assignments per expert, [MoE layers here, E] float64, summed over the ranks that
    saw other tokens (`reduce_sum`, in place), with [dropped, assigned, aux sum, z sum, calls]."""
    layers = moe_layers(model)
    if not layers:
        return None, None
    stats = torch.stack([m.stats for m in layers])  # [layers, E + 4]
    if reduce_sum is not None:
        stats = reduce_sum(stats)
    counts, rest = stats[:, :-4].cpu(), stats[:, -4:].sum(0).cpu()
    dropped, aux, z, calls = rest.tolist()
    return counts, torch.tensor([dropped, float(counts.sum()), aux, z, calls], dtype=torch.float64)


@torch.no_grad()
def update_router_bias(model, counts: torch.Tensor) -> None:
    """After an optimizer step: bias += rate * sign(mean load - load), per layer, from the
    loads of the whole step's tokens (`counts` from step_loads)."""
    for m, c in zip(moe_layers(model), counts):
        if m.cfg.router_bias_rate:
            m.router_bias += m.cfg.router_bias_rate * torch.sign(c.mean() - c).to(m.router_bias)
