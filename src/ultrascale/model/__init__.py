"""The model: a Llama-style decoder that knows nothing of parallelism.

Shapes and counts (`model.config`) need no torch; the module itself
(`model.transformer`) is imported on first use, so the CLI can refuse a bad
configuration without paying for `import torch`.
"""

from ultrascale.model.config import (
    PRESETS,
    ModelConfig,
    count_active_params,
    count_params,
    flops_per_token,
    get_preset,
    playbook_param_formula,
)

_LAZY = ("Transformer", "build_model", "cross_entropy_loss", "init_tensor")


def __getattr__(name):
    if name in _LAZY:
        from ultrascale.model import transformer

        return getattr(transformer, name)
    raise AttributeError(name)


__all__ = ["PRESETS", "ModelConfig", "count_active_params", "count_params", "flops_per_token", "get_preset",
           "playbook_param_formula", *_LAZY]
