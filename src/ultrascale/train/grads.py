"""Where gradients accumulate: one fp32 `main_grad` per parameter.

Autograd writes each micro-batch's gradient into `param.grad` (in the compute
dtype); a post-accumulate-grad hook adds it into `param.main_grad` (fp32) and
frees `param.grad`. Accumulating in fp32 keeps bf16 runs from losing small
micro-batch contributions, and gives every data-parallel mode one place to
hook into: the moment a parameter's gradient is ready.

`LocalGrads` is the single-process case; the data-parallel modes subclass it and
start their reductions from `on_grad_ready`, suppress them inside `no_sync()`,
and wait for them in `finish()`.
"""

from __future__ import annotations

import contextlib

import torch


class LocalGrads:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self._sync = True
        for p in params:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, p: torch.nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None
        self.on_grad_ready(p)

    def on_grad_ready(self, p: torch.nn.Parameter) -> None:
        """Called once per parameter per backward, after its gradient is in main_grad."""

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate without communicating (all but the last micro-batch)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def finish(self) -> None:
        """Wait for every outstanding reduction; afterwards main_grad holds the final gradient."""

    def zero(self) -> None:
        for p in self.params:
            p.main_grad.zero_()

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradient of each parameter (or of this rank's shard), in parameter order."""
        return [p.main_grad for p in self.params]
