"""Precision recipes: bytes per parameter held by the parameters, gradients and optimizer.

The playbook's accounting for Adam (section "Memory usage in transformers"):

  fp32                      4 (params) + 4 (grads) + 8 (two moments)             = 16 bytes
  bf16 mixed precision      2 (params) + 2 (grads) + 4 (fp32 master) + 8 (moments) = 16 bytes
  + fp32 grad accumulation  the same + 4 (fp32 gradients)                         = 20 bytes

The optimizer's share k (moments, plus master weights in mixed precision) is 8 in
fp32 and 12 in bf16, which is what ZeRO-1 divides (ZeRO paper, Rajbhandari et
al. 2020, with K = 12). Our engine frees each bf16 gradient as soon as it is
added into its fp32 `main_grad` (parallel/grads.py, as Megatron's main_grad does),
so it holds 2 + 4 + 12 = 18 bytes: a fourth recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

from ultrascale.errors import ConfigError


@dataclass(frozen=True)
class Precision:
    name: str
    param_bytes: int  # b: parameters as the forward reads them (the compute dtype)
    grad_bytes: int  # gradient bytes per parameter that persist through a step
    optim_bytes: int  # k: Adam moments (8) + fp32 master weights (4) when params are not fp32
    act_bytes: int  # activations, in the compute dtype
    fp32_grad_bytes: int  # the part of grad_bytes that is an fp32 accumulation buffer
    help: str


PRECISIONS = {
    "fp32": Precision("fp32", 4, 4, 8, 4, 4, "fp32 everything: 4 + 4 + 8 = 16 bytes/param"),
    "bf16": Precision("bf16", 2, 2, 12, 2, 0,
                      "playbook mixed precision: bf16 params and grads, fp32 master + Adam: 2 + 2 + 12 = 16"),
    "bf16-fp32-grads": Precision("bf16-fp32-grads", 2, 4, 12, 2, 4,
                                 "bf16 params, fp32 main grads (bf16 grad freed at once; our engine's "
                                 "--dtype bf16, Megatron): 2 + 4 + 12 = 18"),
    "bf16-fp32-accum": Precision("bf16-fp32-accum", 2, 6, 12, 2, 4,
                                 "playbook's fp32 gradient accumulation: bf16 grads kept beside an fp32 "
                                 "accumulator (nanotron, the playbook's benchmark runs): 2 + 6 + 12 = 20"),
}

# The engine's --dtype, as a recipe.
ENGINE_PRECISION = {"fp32": "fp32", "bf16": "bf16-fp32-grads"}


def get_precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ConfigError(f"unknown precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]
