"""Mixed precision: bf16 compute, fp32 master weights and gradients.

fp32: the optimizer updates the model's own parameters.
bf16: the model's parameters are cast to bf16 (the compute copy, 2 bytes per
parameter); the optimizer updates fp32 master copies (4 bytes, counted with the
optimizer state as the playbook does: k = 4 + 4 + 4 for Adam) and writes them
back to the bf16 parameters after each step. Gradients accumulate in fp32
(`main_grad`, see grads.py) in both cases.
"""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class MainParams:
    """The fp32 tensors the optimizer updates, one per model parameter."""

    def __init__(self, params: list[nn.Parameter], dtype: str):
        self.params = params
        self.mixed = dtype != "fp32"
        # Matrices are decayed, vectors (norms, biases) are not.
        self.decay = [p.ndim >= 2 for p in params]
        if self.mixed:
            # Masters copy the fp32 initial values before the cast, so no rounding is baked in.
            self.main = [nn.Parameter(p.detach().clone().float()) for p in params]
            for p in params:
                p.data = p.data.to(DTYPES[dtype])
        else:
            self.main = params

    def attach_grads(self, grads: list[torch.Tensor]) -> None:
        """Point each main tensor's .grad at its fp32 gradient (no copy) for the optimizer."""
        for m, g in zip(self.main, grads):
            m.grad = g

    def detach_grads(self) -> None:
        for m in self.main:
            m.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if self.mixed:
            for p, m in zip(self.params, self.main):
                p.copy_(m)

    def master_bytes(self) -> int:
        """Bytes of fp32 master copies (none in fp32: the optimizer updates the model in place)."""
        return sum(m.numel() * m.element_size() for m in self.main) if self.mixed else 0
