"""A Mixture-of-Experts checkpoint out to transformers as MixtralForCausalLM, equal to ours; a shape
Mixtral does not compute is refused in one line naming what it lacks, before anything is written."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from ultrascale.cli import main  # noqa: E402
from ultrascale.errors import ConfigError  # noqa: E402
from ultrascale.model import get_preset  # noqa: E402
from ultrascale.model.hf import check_mixtral, save_hf  # noqa: E402
from ultrascale.model.transformer import build_model  # noqa: E402
from ultrascale.testing.tolerance import FP32_REORDER  # noqa: E402
from ultrascale.train.checkpoint import trained_model  # noqa: E402

TOKENS = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(3))


def _theirs(path):
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _close(ours, theirs):
    # the same function in another order of operations (per-expert loops against grouped matmuls):
    # fp32 reordering, element by element, relative to the logits' scale
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= FP32_REORDER.element_rtol * scale, \
        (ours - theirs).abs().max().item() / scale


def test_an_moe_model_is_mixtral_to_transformers(tmp_path):
    cfg = get_preset("tiny-moe")
    model = build_model(cfg, seed=7).eval()
    state = {n: p.detach() for n, p in model.named_parameters()}
    save_hf(cfg, state, str(tmp_path / "hf"))
    theirs = _theirs(str(tmp_path / "hf"))
    with torch.no_grad():
        want, got = model(TOKENS), theirs(TOKENS).logits
    _close(want, got)
    # the check sees a mapping mistake: gate and up swapped in every expert
    wrong = dict(state)
    for i in range(cfg.layers):
        wrong[f"layers.{i}.mlp.experts.gate"], wrong[f"layers.{i}.mlp.experts.up"] = (
            state[f"layers.{i}.mlp.experts.up"], state[f"layers.{i}.mlp.experts.gate"])
    save_hf(cfg, wrong, str(tmp_path / "wrong"))
    with torch.no_grad():
        bad = _theirs(str(tmp_path / "wrong"))(TOKENS).logits
    with pytest.raises(AssertionError):
        _close(want, bad)


@pytest.mark.parametrize("change,named", [
    (dict(router_score="sigmoid"), "softmax router scores"),
    (dict(shared_expert=32), "no shared expert"),
    (dict(router_bias_rate=0.05), "no router bias"),
    (dict(moe_every=2, layers=2), "an MoE layer in every block"),
    (dict(router_renorm=False), "renormalised"),
])
def test_a_shape_mixtral_lacks_is_refused_naming_it(change, named):
    with pytest.raises(ConfigError, match=named):
        check_mixtral(dataclasses.replace(get_preset("tiny-moe"), **change))


def _train(tmp_path, *extra):
    r = subprocess.run([sys.executable, "-m", "ultrascale", "train", "--model", "tiny-moe", "--seq-len", "32",
                        "--layers", "2", "--steps", "3", "--micro-batch", "2", "--no-progress", "--seed", "5",
                        "--save", str(tmp_path / "ck"), *extra], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr
    return str(tmp_path / "ck")


def test_a_trained_moe_checkpoint_exports_and_loads(tmp_path, capsys):
    ck = _train(tmp_path)
    assert main(["export", "--hf", str(tmp_path / "out"), ck]) == 0
    with torch.no_grad():
        _close(trained_model(ck).eval()(TOKENS), _theirs(str(tmp_path / "out"))(TOKENS).logits)


def test_exporting_a_router_bias_model_is_one_line_and_writes_nothing(tmp_path, capsys):
    ck = _train(tmp_path, "--router-score", "sigmoid", "--aux-loss-coef", "0", "--router-bias-rate", "0.05")
    capsys.readouterr()
    assert main(["export", "--hf", str(tmp_path / "out"), ck]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MixtralForCausalLM needs softmax router scores" in err[0] and "no router bias" in err[0], err
    assert not (tmp_path / "out").exists()
