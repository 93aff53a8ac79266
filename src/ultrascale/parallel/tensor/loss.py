"""Cross-entropy from vocabulary-sharded logits, without gathering them.

Each rank holds logits [b, s, V/tp] for its slice of the vocabulary. The loss
log(sum_j exp z_j) - z_target needs three scalars per token from the whole
vocabulary; each is a local reduction followed by an all-reduce of [b, s]
numbers instead of the [b, s, V] logits:
  max_j z_j (for stability)  -> all-reduce MAX
  sum_j exp(z_j - max)       -> all-reduce SUM
  z_target                   -> the owning rank has it, the others add 0: SUM
Backward is local: softmax - onehot(target), on this rank's columns.
Columns past the real vocabulary (padding so V divides by tp) are masked out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ultrascale.spans import comm


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, start, vocab_size):
        z = logits.float()
        local_v = z.shape[-1]
        if start + local_v > vocab_size:  # this shard holds padding columns
            z = z.clone()
            z[..., vocab_size - start:] = float("-inf")
        zmax = z.max(dim=-1).values
        with comm("tp.all_reduce"):
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        z = z - zmax.unsqueeze(-1)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        with comm("tp.all_reduce"):
            dist.all_reduce(sum_exp, group=group)

        local_t = targets - start
        mine = (local_t >= 0) & (local_t < local_v)
        idx = local_t.clamp(0, local_v - 1).unsqueeze(-1)
        z_target = z.gather(-1, idx).squeeze(-1).masked_fill(~mine, 0.0)
        with comm("tp.all_reduce"):
            dist.all_reduce(z_target, group=group)

        loss = (sum_exp.log() - z_target).mean()
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, idx, mine)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx, -mine.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss / mine.numel())
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, group, rank: int, vocab_size: int):
    """Mean token cross-entropy; logits [b, s, V_padded/tp] hold columns [rank*V_padded/tp, ...)."""
    start = rank * logits.shape[-1]
    return VocabParallelCrossEntropy.apply(logits, targets, group, start, vocab_size)
