"""FP8 training of the linear layers: torchao's float8 recipe, per-tensor dynamic scaling.

`--fp8` swaps each linear layer of the transformer blocks (q, k, v, o projections,
the MLP's gate, up and down) for torchao's `Float8Linear`
(`torchao.float8.convert_to_float8_training`): at every call, the input and the
weight are cast to float8_e4m3fn and, in backward, the output's gradient to
float8_e5m2, each with its own scale amax-derived per tensor
(scale = max finite of the fp8 type / amax(|x|)), and the matmuls read the fp8 values.
The embedding, the norms, the head (the logits: what the loss is most sensitive to,
and torchtitan too leaves the output layer in high precision) and the MoE router stay
in the compute dtype. Weights, gradients and optimizer state keep their recipe
(fp32 or bf16 + fp32 masters): FP8 is a compute format here, as in torchao.

On a GPU with FP8 tensor cores (compute capability 8.9 and up: L4, H100, H200)
the matmuls run as `torch._scaled_mm`. Elsewhere (the CPU) torchao's emulation is
used: the same casts and scales, the matmul done in high precision on the
quantized-then-dequantized values. The numerics are those of FP8 training; the
speed is not (emulation is slower than no FP8).

`quantize` / `dequantize` below are the per-tensor recipe written out, for tests
and the docs; the engine uses torchao's implementation of it.

Composition: the conversion is the last step of `shard_model`, on the meta
device, so names and initial weights are unchanged. Refused (one line, exit 2):
tensor parallelism (our sharded layers are not `nn.Linear`s: torchao would not
see them and the run would silently stay in high precision; torchao's own answer
is DTensor-based float8 TP, which this engine does not use), and the zero-bubble
pipeline schedule (its deferrable linears would be replaced and lose the split
weight-gradient pass), and context parallelism (each rank would scale by the amax of its
own shard of the sequence). ZeRO-1/2/3, data parallelism and the other pipeline
schedules compose.
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale.errors import ConfigError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(x: torch.Tensor, dtype=E4M3, scaled: bool = True):
    """x -> (fp8 tensor, scale) with x ~= fp8 / scale: per-tensor dynamic scaling from amax.
    scaled=False casts as is (scale 1), the recipe without scaling."""
    if scaled:
        amax = x.detach().abs().max().double().clamp(min=1e-12)
        scale = (torch.finfo(dtype).max / amax).float()
    else:
        scale = torch.ones((), dtype=torch.float32, device=x.device)
    # Saturate: a value beyond the fp8 range (after scaling, only by rounding) becomes the max.
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() / scale).to(dtype)


def _torchao():
    import logging

    # torchao's import warns about each optional compiled kernel library it cannot load (CUDA
    # and MX kernels on a CPU build) and torch about its pytree registrations: none is used by
    # tensorwise float8 training, and a run's stderr should stay for what matters.
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        import torchao.float8 as ao_float8
    except ImportError as e:
        raise ConfigError(f"--fp8 needs torchao ({e}): pip install 'ultrascale[fp8]' (torchao>=0.18), "
                          f"or drop --fp8") from None
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return ao_float8


def check_fp8_support(device) -> bool:
    """Refuse what cannot run FP8; return True when torchao must emulate the FP8 matmuls (CPU)."""
    _torchao()
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ConfigError(f"--fp8 on {name} (compute capability {major}.{minor}): FP8 matmuls need 8.9 or "
                              f"newer (L4, H100, H200); drop --fp8 or use --dtype bf16")
        return False
    if device.type != "cpu":
        raise ConfigError(f"--fp8 on {device.type}: supported on CUDA (compute capability 8.9+) and, emulated, "
                          f"on the CPU; drop --fp8")
    return True


def _is_fp8_linear(module: nn.Module, fqn: str) -> bool:
    return type(module) is nn.Linear and fqn.rsplit(".", 1)[-1] in FP8_LINEARS and fqn.startswith("layers.")


def apply_fp8(model: nn.Module, device) -> nn.Module:
    """Swap the blocks' linear layers for torchao Float8Linear (tensorwise dynamic scaling)."""
    ao = _torchao()
    config = ao.Float8LinearConfig(emulate=check_fp8_support(device))
    ao.convert_to_float8_training(model, config=config, module_filter_fn=_is_fp8_linear)
    return model


def fp8_linears(model: nn.Module) -> list[str]:
    """Names of the modules that compute in FP8."""
    from torchao.float8.float8_linear import Float8Linear

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
