"""Dynamic loss scaling for fp16 compute (Micikevicius et al. 2018, "Mixed Precision Training").

fp16 keeps 5 exponent bits: gradients below 6e-8 flush to zero and activations'
gradients above 65504 overflow. The loss is multiplied by a scale S before
backward, so small gradients land in fp16's range; the fp32 gradients are divided
by S before clipping and the optimizer. S starts at 2^16, doubles after `window`
steps in a row with finite gradients, and halves whenever a gradient holds an inf
or a NaN: that step is skipped (no optimizer update, the parameters unchanged).

Whether a step is skipped must be one decision for the whole run: each rank sees
only its own gradients (a ZeRO shard, a tensor-parallel slice, a pipeline stage),
so the "found an inf" flag is all-reduced (max) over every rank before anyone
steps. A rank that stepped alone would leave the replicas apart for good.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, window: int = 2000, growth: float = 2.0,
                 backoff: float = 0.5, min_scale: float = 1.0):
        self.scale, self.window, self.growth, self.backoff = float(init_scale), window, growth, backoff
        self.min_scale = min_scale
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_and_check(self, grads: list[torch.Tensor], world: bool, applied: float | None = None) -> bool:
        """Divide this rank's fp32 gradients by the scale; True when every rank's are finite.

        world: all-reduce the verdict over the default process group (every rank of the run).
        applied: what backward was scaled by, when not the scale itself (the trainer divides it by
        the data-parallel ranks that average the gradients, so one process's overflows are theirs)."""
        inv = 1.0 / (self.scale if applied is None else applied)
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(inv)
            # sum() of a tensor holding inf or NaN is not finite; one reduction per tensor.
            found = torch.maximum(found, (~torch.isfinite(g.sum())).float())
        if world and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item() == 0)

    def update(self, finite: bool) -> None:
        """After the step: back off on overflow, grow after `window` good steps in a row."""
        if not finite:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
