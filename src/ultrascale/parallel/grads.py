"""Who owns the parameters the optimizer updates and the gradients it reads.

Autograd writes each micro-batch's gradient into `param.grad` (in the compute
dtype); a post-accumulate-grad hook adds it into `param.main_grad` (fp32) and
frees `param.grad`. Accumulating in fp32 keeps bf16 runs from losing small
micro-batch contributions, and gives every data-parallel mode one place to
hook into: the moment a parameter's gradient is ready.

`LocalGrads` is the single-process case. The data-parallel modes subclass it:
they choose where `main_grad` lives (`_allocate`), start reductions from
`on_grad_ready`, suppress them inside `no_sync()` and wait for them in
`finish()`; ZeRO also shards what the optimizer updates (`main`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Protocol

import torch
import torch.distributed as dist

from ultrascale.parallel.precision import MainParams
from ultrascale.spans import comm


class GradientSync(Protocol):
    """The gradient owner (Megatron's DDP role): from the moment autograd writes a parameter's gradient
    to the step, where it is accumulated (fp32 `main_grad`), when it is reduced (`no_sync` for all but the
    last micro-batch, `finish` to wait), which piece of it this rank keeps; and the tensors the optimizer
    updates (`main`, OptimizerTensors). Implemented by LocalGrads and its data-parallel subclasses
    (data_parallel.py), ZeRO-1/2 (zero.py), ZeRO-3 (zero3.py) and the expert-parallel pair (expert_grads.py);
    the trainer, the pipeline and checkpoints call only this."""

    params: list
    main: "OptimizerTensors"

    def no_sync(self) -> contextlib.AbstractContextManager: ...

    def finish(self) -> None: ...

    def zero(self) -> None: ...

    def grads(self) -> list[torch.Tensor]: ...

    def grad_owners(self) -> list[torch.nn.Parameter]: ...

    def norm_shares(self) -> list[float]: ...

    def reduce_norm_sq(self, sq: torch.Tensor) -> torch.Tensor: ...

    def param_tensors(self) -> list[torch.Tensor]: ...

    def main_ranges(self) -> list[tuple[torch.nn.Parameter, int, int]]: ...

    def replica_index(self, p: torch.nn.Parameter) -> int: ...

    def full_params(self) -> list[torch.Tensor]: ...

    def full_grads(self) -> list[torch.Tensor]: ...


class LocalGrads:
    def __init__(self, params: list[torch.nn.Parameter], dtype: str = "fp32"):
        self.params = params
        self._sync = True
        self.main = self._make_main(dtype)
        self._allocate()
        # The hook reaches this object through a weak reference: autograd keeps a parameter's
        # hooks in C++, out of sight of Python's garbage collector, so a hook holding `self`
        # (which holds the parameters) would be a cycle never collected; on an H100 every dropped
        # trainer left its weights, masters and gradients on the card (12.5 GiB for the 1b preset).
        accumulate = weakref.WeakMethod(self._accumulate)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: (fn := accumulate()) is not None and fn(p))

    def _make_main(self, dtype: str):
        """The tensors the optimizer updates (casts the model to the compute dtype)."""
        return MainParams(self.params, dtype)

    def _allocate(self) -> None:
        for p in self.params:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)

    def _accumulate(self, p: torch.nn.Parameter) -> None:
        if p.grad is None:
            return  # a backward that left this weight's gradient for later (zero-bubble's I pass)
        group = getattr(p, "grad_sum_group", None)
        if group is not None:
            # A replicated parameter that each rank of this group saw only part of the
            # activations of (a norm under sequence parallelism): its gradient is the sum.
            with comm("sp.grad_all_reduce"):
                dist.all_reduce(p.grad, group=group)
        self._add_into_main_grad(p)
        p.grad = None
        self.on_grad_ready(p)

    def _add_into_main_grad(self, p: torch.nn.Parameter) -> None:
        p.main_grad.add_(p.grad)

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
        """Wait for every outstanding reduction; afterwards grads() holds the final gradient."""

    def zero(self) -> None:
        for p in self.params:
            p.main_grad.zero_()

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradient of each tensor in `main.main`, in the same order."""
        return [p.main_grad for p in self.params]

    def grad_owners(self) -> list[torch.nn.Parameter]:
        """The parameter each entry of grads() belongs to (a ZeRO piece belongs to one parameter)."""
        return self.params

    def norm_shares(self) -> list[float]:
        """The weight of each entry of grads() in the squared norm reduce_norm_sq sums: 1 where each rank
        adds its own piece, 1/copies where several ranks add the same replica."""
        return [1.0] * len(self.grads())

    def reduce_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        """Sum a squared gradient norm over ranks holding different pieces (ZeRO shards)."""
        return sq

    def replica_index(self, p: torch.nn.Parameter) -> int:
        """This rank's index among the ranks holding the same copy of p's optimizer state (0 writes it
        in a checkpoint); 0 where each rank holds its own piece (one process, ZeRO's shards)."""
        return 0

    def param_tensors(self):
        """The tensors holding this rank's parameters, for memory accounting."""
        return self.params

    # -- where the optimizer's tensors sit, and the full parameters ----------
    def main_ranges(self) -> list[tuple[torch.nn.Parameter, int, int]]:
        """For each tensor of `main.main`: (its parameter, start, end), the flat range of this
        rank's parameter it holds (checkpoints place it in the full tensor: parallel/placement.py)."""
        return [(p, 0, p.numel()) for p in self.params]

    def full_params(self) -> list[torch.Tensor]:
        """Every parameter in full, fp32, on every rank (for comparisons and export)."""
        return self._full(self.main.main)

    def full_grads(self) -> list[torch.Tensor]:
        """Every parameter's reduced fp32 gradient in full, on every rank: valid between
        finish() and the optimizer step (for comparisons with the single-process run)."""
        return self._full(self.grads())

    def _full(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whole tensors, one per parameter, from tensors aligned with `main.main`."""
        return [t.detach().float().clone() for t in pieces]
