"""What a step costs: throughput, MFU, and per-rank memory by owner.

Memory is measured on the tensors themselves, not predicted:
- params, grads, optim: bytes of the distinct storages held by the model's
  parameters, the gradient buffers, and the optimizer (its state plus fp32
  master weights);
- activations: bytes of the distinct tensors autograd saves for backward during
  one micro-batch's forward (saved-tensor hooks, so it works on CPU too),
  parameters excluded. That is what stays alive between forward and backward.
- allocator peak: torch.cuda.max_memory_allocated on GPU, None on CPU;
- peak_rss: the process's peak resident memory (host RAM), from the OS;
- offloaded: under --offload, the bytes moved off the device (to host memory or
  files), by owner; params and optim then count only what stays on the device.
"""

from __future__ import annotations

import contextlib
import sys

import torch

# Peak dense throughput per device, TFLOP/s, by compute dtype (vendor data sheets, dense, no sparsity).
PEAK_TFLOPS = {
    "H100": {"bf16": 989.5, "fp32": 494.7},  # fp32 as TF32 tensor cores
    "H200": {"bf16": 989.5, "fp32": 494.7},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "L4": {"bf16": 121.0, "fp32": 60.0},
}


def peak_tflops(device: torch.device, dtype: str) -> float | None:
    """The device's peak for this dtype, or None when unknown (every CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(dtype, peaks["bf16"] if dtype == "fp16" else None)
    return None


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def peak_resident_bytes() -> int | None:
    """This process's peak resident set size so far (what the OS held in RAM for it), or None
    where the platform does not say. Host memory: on a GPU the tensors above live elsewhere."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def optimizer_state_tensors(opt: torch.optim.Optimizer):
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.numel() > 1:  # the step counter is bookkeeping, not memory
                yield v


class ActivationMeter:
    """Counts the bytes autograd keeps for backward, while active."""

    def __init__(self, model_tensors):
        # Parameters and buffers are not activations, even when an op saves them. Keyed by
        # the storage object, not its address: ZeRO-3 frees and re-allocates parameter storage.
        self.param_storages = {t.untyped_storage()._cdata for t in model_tensors}
        self.saved: dict[int, int] = {}
        self.peak = 0
        self._disabled_pack = None  # _packer's, made on first use under --compile

    def _pack(self, t):
        self.record(t)
        return t

    def _packer(self):
        """The pack hook, kept out of dynamo where dynamo is loaded (--compile): bookkeeping, not model code,
        it would otherwise be traced as a frame of its own, once for every shape and dtype autograd saves,
        and recompiled until its limit. Where nothing compiles, the plain method: torch.compiler.disable
        would import dynamo (over a second) into every process that trains."""
        if "torch._dynamo" not in sys.modules:
            return self._pack
        if self._disabled_pack is None:
            self._disabled_pack = torch.compiler.disable(self._pack)
        return self._disabled_pack

    def record(self, t) -> None:
        if not torch.is_tensor(t) or t.device.type == "meta":
            return
        s = t.untyped_storage()
        if s._cdata not in self.param_storages:
            self.saved[s.data_ptr()] = s.nbytes()

    @contextlib.contextmanager
    def forward(self):
        """Measure one forward: the total of what it saved becomes a candidate for the peak."""
        global _ACTIVE
        self.saved = {}
        prev, _ACTIVE = _ACTIVE, self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._packer(), lambda t: t):
                yield
        finally:
            _ACTIVE = prev
            self.peak = max(self.peak, sum(self.saved.values()))

    def take_peak(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


_ACTIVE: ActivationMeter | None = None


def record_activations(tensors) -> None:
    """Let code that keeps tensors for backward outside autograd's saved tensors
    (checkpointed inputs) count them on the active meter."""
    if _ACTIVE is not None:
        for t in tensors:
            _ACTIVE.record(t)
