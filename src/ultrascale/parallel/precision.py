"""Mixed precision: bf16 or fp16 compute, fp32 master weights and gradients.

fp32: the optimizer updates the model's own parameters.
bf16: the model's parameters are cast to bf16 (the compute copy, 2 bytes per
parameter); the optimizer updates fp32 master copies (4 bytes, counted with the
optimizer state as the playbook does: k = 4 + 4 + 4 for Adam) and writes them
back to the bf16 parameters after each step. Gradients accumulate in fp32
(`main_grad`, see grads.py) in both cases.
fp16: as bf16, with 2-byte fp16 compute copies; its narrow range (5 exponent bits)
needs the dynamic loss scale of train/loss_scale.py.
"""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_dtype_support(dtype: str, device) -> None:
    """Refuse, before training, a compute dtype this device and torch build cannot run: one
    forward and backward of the kernels the model uses (matmul, RMSNorm, RoPE's trigonometry
    table lookup, causal attention, cross-entropy) on tiny tensors."""
    if dtype == "fp32":
        return
    from ultrascale.errors import ConfigError

    import torch.nn.functional as F

    dt = DTYPES[dtype]
    try:
        x = torch.randn(2, 4, 8, device=device).to(dt).requires_grad_()
        w = torch.randn(8, 8, device=device).to(dt).requires_grad_()
        h = F.rms_norm(F.linear(x, w), (8,), torch.ones(8, device=device, dtype=dt))
        q = h.view(2, 4, 2, 4).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        logits = F.silu(a.transpose(1, 2).reshape(2, 4, 8)) @ w
        F.cross_entropy(logits.float().flatten(0, 1), torch.zeros(8, dtype=torch.long, device=device)).backward()
        if not (torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()):
            raise RuntimeError("non-finite gradients on a tiny problem")
    except (RuntimeError, NotImplementedError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--dtype {dtype}: this {torch.device(device).type} and torch {torch.__version__} "
                          f"cannot run the {dtype} kernels the model needs ({why}): use --dtype fp32 or bf16, "
                          f"or a device with {dtype} support") from None


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
