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

import functools
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_flash_attention_fails(capability: str, cpu_flags: Mapping[str, bool], dtype: str, device) -> bool:
    """Whether torch's CPU flash-attention kernel would stop with "pack_vnni2 is only supported
    when avx512 is supported" on these inputs: a pure function of ATen's CPU capability
    (`torch.backends.cpu.get_cpu_capability()`), the CPU's flags (`cpu_flags()`), the compute
    dtype ("fp32", "bf16", "fp16") and the device.

    Why: for bf16 (fp16) inputs the kernel decides to pack K and V for AMX tiles from the
    hardware alone, through oneDNN (`cpublas::could_pack`: the effective ISA is at least
    avx512_core_amx, or avx512_core_amx_fp16), once the sequence is long enough (64 queries
    and keys for bf16, 16 for fp16). The packing routine it then calls, `at::vec::pack_vnni2`,
    is compiled into each of the kernel's per-capability copies but has a body only in the
    AVX512 one: the DEFAULT and AVX2 copies, which ATen dispatches to under
    ATEN_CPU_CAPABILITY=default or avx2, raise instead. So: a CPU with AMX for this dtype,
    and ATen's kernels below AVX512."""
    if torch.device(device).type != "cpu" or dtype not in ("bf16", "fp16"):
        return False
    if capability.upper().replace(" ", "").startswith("AVX512"):
        return False
    amx = "amx_bf16" if dtype == "bf16" else "amx_fp16"
    return bool(cpu_flags.get("amx_tile")) and bool(cpu_flags.get(amx))


def cpu_flags() -> dict[str, bool]:
    """The CPU features torch's cpuinfo reports (amx_tile, amx_bf16, amx_fp16, avx512_bf16, ...)."""
    get = getattr(torch.cpu, "get_capabilities", None) or getattr(torch._C._cpu, "_get_cpu_capability", None)
    if get is not None:
        return {k: v for k, v in dict(get()).items() if isinstance(v, bool)}
    # Older torch: only the AMX tile query; every CPU with AMX tiles has AMX-BF16.
    tile = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    fp16 = bool(getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)())
    return {"amx_tile": tile, "amx_bf16": tile, "amx_fp16": fp16}


@functools.cache
def _machine() -> tuple[str, dict[str, bool]]:
    # Both are fixed for the life of the process (ATen reads ATEN_CPU_CAPABILITY once).
    return torch.backends.cpu.get_cpu_capability(), cpu_flags()


def flash_attention_fails_here(dtype, device="cpu") -> bool:
    """cpu_flash_attention_fails for this machine and process; dtype a name or a torch.dtype."""
    name = next((k for k, v in DTYPES.items() if v == dtype), dtype)
    return cpu_flash_attention_fails(*_machine(), name, device)


_SWITCHED_OFF = False  # whether choose_attention_kernel turned torch's flash attention off


def choose_attention_kernel(dtype: str, device) -> str:
    """Where a run starts, one kernel choice for the process: "math" where torch's CPU flash
    kernel would fail for this dtype (cpu_flash_attention_fails), else "flash" (torch's own
    choice, as without this function).

    The switch is torch's process-wide one (torch.backends.cuda.enable_flash_sdp sets it; the
    CPU backend selection reads it too): every scaled_dot_product_attention call then takes the
    math backend, which computes bf16/fp16 attention in fp32 on the CPU. A later run of the
    same process that does not need it switches flash attention back on (only if this function
    had switched it off). Context parallelism calls the CPU flash kernel directly and asks
    flash_attention_fails_here itself (parallel/context/blocks.py)."""
    global _SWITCHED_OFF
    if flash_attention_fails_here(dtype, device):
        if torch.backends.cuda.flash_sdp_enabled():
            torch.backends.cuda.enable_flash_sdp(False)
            _SWITCHED_OFF = True
        return "math"
    if _SWITCHED_OFF:
        torch.backends.cuda.enable_flash_sdp(True)
        _SWITCHED_OFF = False
    return "flash"


def check_dtype_support(dtype: str, device) -> None:
    """Refuse, before training, a compute dtype this device and torch build cannot run: one
    forward and backward of the kernels the model uses (matmul, RMSNorm, RoPE's trigonometry
    table lookup, causal attention, cross-entropy) on tiny tensors. First, the attention kernel
    the process uses is chosen (choose_attention_kernel)."""
    choose_attention_kernel(dtype, device)  # first: the probe below runs the kernel the run will use
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
        # And 64 positions: from there on the CPU flash kernel may take its packed (AMX) path.
        s = torch.randn(1, 1, 64, 16, device=device).to(dt).requires_grad_()
        long = F.scaled_dot_product_attention(s, s, s, is_causal=True)
        loss = F.cross_entropy(logits.float().flatten(0, 1), torch.zeros(8, dtype=torch.long, device=device))
        (loss + long.float().square().mean()).backward()
        if not (torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all() and torch.isfinite(s.grad).all()):
            raise RuntimeError("non-finite gradients on a tiny problem")
    except (RuntimeError, NotImplementedError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--dtype {dtype}: this {torch.device(device).type} and torch {torch.__version__} "
                          f"cannot run the {dtype} kernels the model needs ({why}): use --dtype fp32 or bf16, "
                          f"or a device with {dtype} support") from None


class OptimizerTensors(Protocol):
    """What the optimizer updates (Megatron's DistributedOptimizer role): `main`, one fp32 tensor per
    parameter or per piece of one (ZeRO's shards), each with its `decay` flag; the gradients pointed at
    them for a step, the updated values copied back into the model. `where` is None on the device, or
    "cpu" / "disk" where --offload keeps them (and the optimizer's step with them). Implemented by
    MainParams (here), ShardedMainParams (zero.py), OffloadedMain (offload.py) and the expert-parallel
    join of two owners' (expert_grads.py)."""

    main: list
    decay: list[bool]
    where: str | None

    def attach_grads(self, grads: list[torch.Tensor]) -> None: ...

    def detach_grads(self) -> None: ...

    def copy_to_model(self) -> None: ...

    def master_bytes(self) -> int: ...

    def offloaded_bytes(self) -> int: ...


class MainParams:
    """The fp32 tensors the optimizer updates, one per model parameter (OptimizerTensors)."""

    where = None  # on the device

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

    def offloaded_bytes(self) -> int:
        return 0
