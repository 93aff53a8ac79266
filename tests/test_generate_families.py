"""`generate` runs the model training left: for every family of presets (dense, MoE with softmax or
sigmoid routing, a shared expert, aux-loss-free router biases), the checkpoint's model gives the
trained model's logits exactly, and its validation loss is the one training logged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ultrascale.config import RunConfig, TrainConfig, validate
from ultrascale.distributed.context import build_context
from ultrascale.model import get_preset
from ultrascale.model.transformer import build_model
from ultrascale.train.checkpoint import read_full_state, trained_model
from ultrascale.train.trainer import Trainer

MOE = get_preset("tiny-moe", layers=2)
FAMILIES = {
    "dense": get_preset("tiny", layers=2),
    "moe softmax": MOE,
    "moe sigmoid + router bias": dataclasses.replace(MOE, router_score="sigmoid", aux_loss_coef=0.0,
                                                     router_bias_rate=0.05),
    "moe shared expert": dataclasses.replace(MOE, shared_expert=32),
}
TOKENS = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))


def _fit(model, ck):
    t = TrainConfig(steps=4, seq_len=32, micro_batch=2, grad_accum=2, lr=1e-2, warmup_steps=1, seed=5,
                    eval_every=4, eval_batches=1, save=ck, progress=False)
    cfg = validate(RunConfig(model=model, train=t), 1)
    trainer = Trainer(cfg, build_context(cfg.parallel, 0, 1))
    result = trainer.fit()
    return trainer, result


@pytest.mark.parametrize("family", FAMILIES)
def test_the_checkpoints_model_is_the_trained_model(family, tmp_path):
    ck = str(tmp_path / "ck")
    trainer, result = _fit(FAMILIES[family], ck)
    model = trained_model(ck).eval()
    trainer.model.eval()
    with torch.no_grad():
        want, got = trainer.model(TOKENS), model(TOKENS)
    assert torch.equal(want, got), (want - got).abs().max()  # the same tensors, the same kernels: exact
    logged = result.metrics[-1]["val_loss"]
    trainer.model = model  # the trainer's own evaluation, on the checkpoint's model
    assert trainer.evaluate() == logged
    if FAMILIES[family].router_bias_rate:
        # the biases matter here: the same weights without them are another model
        biases = [b for n, b in model.named_buffers() if n.endswith("router_bias")]
        assert all(b.abs().max() > 0 for b in biases)
        _, state = read_full_state(ck)
        plain = build_model(FAMILIES[family], seed=0, source=state).eval()
        with torch.no_grad():
            assert not torch.equal(plain(TOKENS), want)
