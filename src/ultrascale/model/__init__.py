"""The model: a Llama-style decoder that knows nothing of parallelism."""

from ultrascale.model.config import (
    PRESETS,
    ModelConfig,
    count_params,
    flops_per_token,
    get_preset,
    playbook_param_formula,
)
from ultrascale.model.transformer import Transformer, build_model, cross_entropy_loss, init_tensor

__all__ = [
    "PRESETS", "ModelConfig", "Transformer", "build_model", "count_params", "cross_entropy_loss",
    "flops_per_token", "get_preset", "init_tensor", "playbook_param_formula",
]
