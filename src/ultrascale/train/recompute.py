"""Activation recomputation: keep fewer activations, recompute them in backward.

- full: each transformer block keeps only its input; its whole forward runs
  again in backward. Activation memory per layer drops to s·b·h values, at the
  cost of one more forward (compute 8N instead of 6N per token).
- selective: only the attention core (softmax(QK^T)V) is recomputed: it holds the
  activations that grow with s² (the attention matrix where no fused kernel
  avoids it), and it is cheap to redo (Korthikanti et al. 2022).

The wrapped modules keep their names: we replace the instance's `forward`, not the
module, so state dicts and initial weights are unchanged.
"""

from __future__ import annotations

import types

from torch.utils.checkpoint import checkpoint

from ultrascale.train import metrics


def _recomputed(module):
    inner = type(module).forward

    def forward(self, *args):
        # Non-reentrant checkpointing keeps the inputs alive through the closure,
        # not through saved-tensor hooks: tell the activation meter about them.
        metrics.record_activations(args)
        return checkpoint(inner, self, *args, use_reentrant=False)

    module.forward = types.MethodType(forward, module)


def apply_recompute(model, mode: str) -> None:
    if mode == "none":
        return
    for block in model.layers.values():
        if mode == "full":
            _recomputed(block)
        elif mode == "selective":
            _recomputed(block.attn.core_attention)
        else:
            raise ValueError(f"unknown recompute mode {mode!r}")
