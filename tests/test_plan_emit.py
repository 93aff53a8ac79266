"""plan -> emit -> train: what `plan --emit-config` writes is what `train --config` reads, for every
model the engine builds (dense and Mixture of Experts); what it cannot build is refused by field."""

from dataclasses import asdict, fields

import pytest

from ultrascale.cli import main
from ultrascale.config import build_config, load_toml, validate
from ultrascale.model.config import PRESETS
from ultrascale.plan.shape import MOE_PRESETS, PUBLISHED_PRESETS
from ultrascale.testing.cli import ultrascale


def cli(capsys, *args):
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def read_back(path, world):
    """The file as `train --config` reads it: load_toml, the engine's defaults under it, validate."""
    return validate(build_config(load_toml(str(path)), {}), world)


def _grid(name):
    """8 ranks: tp 2 x dp 4 where tp 2 divides the heads and the MLP (else dp 8), the experts over 2
    of the dp ranks."""
    cfg = PRESETS[name]
    tp = 2 if not (cfg.heads % 2 or cfg.kv_heads % 2 or cfg.ffn_hidden % 2) else 1
    return 8 // tp, tp, 2 if cfg.is_moe else 1


def _layout(name):
    dp, tp, ep = _grid(name)
    return ["--dp", str(dp), "--tp", str(tp), "--ep", str(ep)]


# The planner's own shapes of models the engine builds only approximately, and what each needs that
# the engine lacks (from each model's config.json, as plan/shape.py cites them).
UNBUILT = {"deepseek-v3": ["kv_lora_rank = 512", "q_lora_rank = 1536", "dense_layers = 3", "expert_groups = 8"],
           "qwen3-30b-a3b": ["kv_channels = 128", "qk_norm = true"]}
UNBUILT.update({name: ["dropout = true"] for name in PUBLISHED_PRESETS})  # GPT-3's dropout


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in MOE_PRESETS])
def test_every_engine_preset_round_trips(capsys, tmp_path, name):
    # The model the file builds is the preset, field for field, and the grid is the one planned.
    path = tmp_path / "run.toml"
    code, out, err = cli(capsys, "plan", "memory", "--model", name, "--seq-len", "256", *_layout(name),
                         "--emit-config", str(path))
    assert code == 0, err
    cfg = read_back(path, 8)
    assert asdict(cfg.model) == asdict(PRESETS[name]) | {"max_seq_len": cfg.model.max_seq_len}
    assert cfg.model.max_seq_len >= 256
    p = cfg.parallel
    assert (p.dp, p.tp, p.ep, p.pp, p.cp) == (*_grid(name), 1, 1)
    assert cfg.train.nproc == 8 and cfg.train.seq_len == 256


@pytest.mark.parametrize("name", sorted(UNBUILT))
def test_a_shape_the_engine_cannot_build_is_refused_naming_its_fields(capsys, tmp_path, name):
    path = tmp_path / "run.toml"
    code, out, err = cli(capsys, "plan", "memory", "--model", name, "--emit-config", str(path))
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for needed in UNBUILT[name]:
        assert needed in err, (needed, err)
    assert not path.exists()


def test_the_search_refuses_an_unbuildable_shape_before_it_runs(capsys, tmp_path):
    code, out, err = cli(capsys, "plan", "--model", "deepseek-v3", "--gpus", "2048", "--emit-config",
                         str(tmp_path / "run.toml"))
    assert code == 2 and "multi-head latent attention" in err and out == ""


def test_a_changed_moe_shape_is_written_as_the_engines_fields(capsys, tmp_path):
    path = tmp_path / "run.toml"
    code, _, err = cli(capsys, "plan", "memory", "--model", "tiny-moe", "--experts", "4", "--top-k", "1",
                       "--moe-ffn-hidden", "32", "--layers", "3", "--dp", "2", "--ep", "2", "--seq-len", "128",
                       "--emit-config", str(path))
    assert code == 0, err
    m = read_back(path, 2).model
    assert (m.experts, m.top_k, m.moe_ffn_hidden, m.layers) == (4, 1, 32, 3)
    # What the planner does not model (the router) stays the preset's.
    keep = {f.name for f in fields(m)} - {"experts", "top_k", "moe_ffn_hidden", "layers", "name"}
    assert {k: getattr(m, k) for k in keep} == {k: getattr(PRESETS["tiny-moe"], k) for k in keep}


def test_a_layout_the_engine_refuses_is_one_line_and_no_file(capsys, tmp_path):
    # Megatron's plans gather expert weights under ZeRO-3; the engine does not.
    path = tmp_path / "run.toml"
    code, _, err = cli(capsys, "plan", "memory", "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--zero", "3",
                       "--emit-config", str(path))
    assert code == 2 and err.count("\n") == 1 and "the engine refuses" in err and "--zero 3 with --ep" in err, err
    assert not path.exists()


def test_the_search_writes_the_best_layout_the_engine_takes(capsys, tmp_path):
    # Mixtral on 32 GPUs, experts over 4: the two best layouts of Megatron's ranking keep ZeRO-3 with
    # the experts spread, which the engine refuses; the file holds the third, and says why.
    path = tmp_path / "run.toml"
    code, out, err = cli(capsys, "plan", "--model", "mixtral-8x7b", "--gpus", "32", "--ep", "4", "--emit-config",
                         str(path))
    assert code == 0, err
    cfg = read_back(path, 32)
    assert cfg.parallel.ep == 4 and cfg.parallel.zero != 3 and cfg.model == PRESETS["mixtral-8x7b"]
    text = path.read_text()
    assert "layout 3 of the ranking: the engine refuses the 2 above it" in text and "--zero 3 with --ep" in text
    assert "--emit-config: layout 3 of the ranking" in err


def test_a_search_whose_every_layout_the_engine_refuses_writes_nothing(capsys, tmp_path):
    path = tmp_path / "run.toml"
    code, out, err = cli(capsys, "plan", "--model", "tiny-moe", "--gpus", "4", "--seq-len", "64",
                         "--global-batch-tokens", "2048", "--ep", "2", "--zero", "3", "--emit-config", str(path))
    assert code == 2 and err.count("\n") == 1 and "the engine refuses" in err and "--zero 3 with --ep" in err, err
    assert not path.exists()


def test_a_planned_moe_layout_trains_as_planned(capsys, tmp_path):
    # tiny-moe on 2 ranks, its experts spread over both: one step, the header says what was planned.
    path = tmp_path / "run.toml"
    code, _, err = cli(capsys, "plan", "memory", "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--seq-len", "32",
                       "--micro-batch", "2", "--emit-config", str(path))
    assert code == 0, err
    r = ultrascale("train", "--config", str(path), "--steps", "1", "--device", "cpu", "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "8 experts (top-2, width 64)" in r.stdout and "ep 2" in r.stdout and "done: 1 steps" in r.stdout, r.stdout
