"""Cut the model into pipeline stages, and run one chunk of them.

`split_layers` is partition.split, the rule the planner counts with: L layers
over p*v virtual stages, in order, the first stages taking one more when it does
not divide, or the first / last stage given fewer (--pp-first-stage-layers,
--pp-last-stage-layers); the last one also carries the final norm, the head and
the loss. `keep_stages` is the
meta-device transform: this rank keeps the layers of its chunks, the embedding
if it holds the first virtual stage, the norm and head if it holds the last.
Names do not change (layers live in a ModuleDict keyed by global index), so
initial weights and checkpoints match the single-device model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ultrascale.parallel.pipeline.partition import split, v_shaped, virtual_stages  # noqa: F401 (re-exported)


def split_layers(n_layers: int, p: int, v: int = 1, first: int = 0, last: int = 0) -> list[list[int]]:
    """Block ids of each virtual stage (partition.split's even rule)."""
    return [list(ids) for ids in split(n_layers, p, v, first, last)]


def keep_stages(model, rank: int, p: int, v: int, first: int = 0, last: int = 0, vshape: bool = False):
    layers = split_layers(len(model.layers), p, v, first, last)
    mine = virtual_stages(rank, p, v, vshape)
    keep = {str(i) for s in mine for i in layers[s]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if 0 not in mine:
        model.embed = None
    if p * v - 1 not in mine:
        model.norm = None
        model.head = None
    return model


class StageChunk:
    """One virtual stage: some of the rank's layers, plus the embedding or the head if it has them.
    Not a module: the parameters stay registered once, in the rank's model."""

    def __init__(self, model, layer_ids, first: bool, last: bool):
        self.model, self.first, self.last = model, first, last
        self.blocks = [model.layers[str(i)] for i in layer_ids]

    def __call__(self, x, seq_len: int, positions=None):
        """positions: the global positions of the tokens (context parallelism's shard), or None for 0..seq_len-1."""
        m = self.model
        if self.first:
            x = m.embed(x)
        if positions is None:
            cos, sin = m.rope_cos[:seq_len], m.rope_sin[:seq_len]
        else:
            cos, sin = m.rope_cos[positions], m.rope_sin[positions]
        for block in self.blocks:
            x = block(x, cos, sin)
        if self.last:
            x = m.norm(x)
            x = m.head(x) if m.head is not None else F.linear(x, m.embed.weight)
        return x


class WeightGradStore:
    """Zero-bubble's split of a backward pass: while `deferring`, linear layers compute
    the gradient of their input only and leave (input, output gradient) here; W later
    turns them into weight gradients."""

    deferring = False
    pending: list = []

    @classmethod
    def flush(cls) -> list:
        items, cls.pending = cls.pending, []
        return items


class _DeferrableLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias  # leaf parameters: held, not saved activations
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        grad_x = grad_out @ ctx.weight
        if WeightGradStore.deferring:
            WeightGradStore.pending.append((ctx.weight, ctx.bias, x, grad_out))
            return grad_x, None, None
        return (grad_x, *_weight_grads(x, grad_out, ctx.bias is not None))


def _weight_grads(x, grad_out, has_bias):
    g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    return g2.t() @ x2, (g2.sum(0) if has_bias else None)


class DeferrableLinear(nn.Linear):
    def forward(self, x):
        return _DeferrableLinearFn.apply(x, self.weight, self.bias)


def apply_weight_grads(items) -> None:
    """Accumulate the deferred weight gradients through autograd (so gradient hooks fire)."""
    tensors, grads = [], []
    for weight, bias, x, grad_out in items:
        gw, gb = _weight_grads(x, grad_out, bias is not None)
        tensors.append(weight)
        grads.append(gw)
        if bias is not None:
            tensors.append(bias)
            grads.append(gb)
    if tensors:
        torch.autograd.backward(tensors, grads)


def make_linears_deferrable(model) -> None:
    """Swap every nn.Linear for a DeferrableLinear with the same parameters (same names)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                new = DeferrableLinear.__new__(DeferrableLinear)
                new.__dict__ = child.__dict__
                setattr(module, name, new)
