"""Validation names the user's mistake first: a layout that does not fit the model gives the same
line whether or not --nproc was given (issue: `--tp 3` without `--nproc` used to blame the world
size, and the heads were named only once --nproc was right)."""

from __future__ import annotations

import itertools

import pytest

from ultrascale.config import ConfigError, ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.model import get_preset

# Sizes x model shapes, drawn as a product: each case breaks the model, the sequence or the schedule.
SIZES = [dict(tp=3), dict(tp=8), dict(pp=2), dict(pp=3), dict(cp=2), dict(cp=4, cp_attention="zigzag"),
         dict(tp=2, sp=True), dict(pp=2, pp_schedule="interleaved", pp_chunks=2)]
SHAPES = [dict(layers=1), dict(layers=3), dict(seq_len=33), dict(seq_len=6), dict(heads=6, kv_heads=3)]


def cases():
    for sizes, shape in itertools.product(SIZES, SHAPES):
        model = {k: v for k, v in shape.items() if k != "seq_len"}
        cfg = RunConfig(model=get_preset("tiny", **model), parallel=ParallelConfig(**sizes),
                        train=TrainConfig(seq_len=shape.get("seq_len", 64), grad_accum=4))
        need = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
        try:
            validate(cfg, need)
        except ConfigError as e:
            yield pytest.param(cfg, need, str(e), id=f"{sizes}-{shape}")


CASES = list(cases())


def test_the_cases_are_many():
    assert len(CASES) >= 15


@pytest.mark.parametrize("cfg,need,line", CASES)
def test_a_model_mistake_is_named_before_the_world_size(cfg, need, line):
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)  # --nproc forgotten
    assert str(e.value) == line


def test_the_world_size_line_names_the_flag_to_add():
    cfg = RunConfig(model=get_preset("tiny"), parallel=ParallelConfig(tp=2), train=TrainConfig())
    with pytest.raises(ConfigError, match=r"add --nproc 2 \(or a multiple of 2\)"):
        validate(cfg, 1)
    cfg = RunConfig(model=get_preset("tiny"), parallel=ParallelConfig(dp=3), train=TrainConfig())
    with pytest.raises(ConfigError, match=r"make the product equal the world size \(--nproc 3\)"):
        validate(cfg, 4)
