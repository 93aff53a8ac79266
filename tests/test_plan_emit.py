"""plan -> emit -> train: what `plan --emit-config` writes is what `train --config` reads, for every
model the engine builds (dense and Mixture of Experts); what it cannot build is refused by field."""

from dataclasses import asdict, fields

import pytest

from ultrascale.cli import main
from ultrascale.config import build_config, load_toml, validate
from ultrascale.model.config import PRESETS
from ultrascale.plan.shape import MOE_PRESETS, PUBLISHED_PRESETS, get_shape
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
    code, _, err = cli(capsys, "plan", "memory", "--model", "tiny-moe", "--framework", "megatron", "--dp", "2", "--ep",
                       "2", "--zero", "3", "--emit-config", str(path))
    assert code == 2 and err.count("\n") == 1 and "the engine refuses" in err and "--zero 3 with --ep" in err, err
    assert not path.exists()


def test_the_search_writes_the_best_layout_the_engine_takes(capsys, tmp_path):
    # Mixtral on 32 GPUs, experts over 4: the two best layouts of Megatron's ranking keep ZeRO-3 with
    # the experts spread, which the engine refuses; the file holds the third, and says why.
    path = tmp_path / "run.toml"
    code, out, err = cli(capsys, "plan", "--model", "mixtral-8x7b", "--framework", "megatron", "--gpus", "32", "--ep", "4",
                         "--emit-config",
                         str(path))
    assert code == 0, err
    cfg = read_back(path, 32)
    assert cfg.parallel.ep == 4 and cfg.parallel.zero != 3 and cfg.model == PRESETS["mixtral-8x7b"]
    text = path.read_text()
    assert "layout 3 of the ranking: the engine refuses the 2 above it" in text and "--zero 3 with --ep" in text
    assert "--emit-config: layout 3 of the ranking" in err


def test_a_search_whose_every_layout_the_engine_refuses_writes_nothing(capsys, tmp_path):
    path = tmp_path / "run.toml"
    code, out, err = cli(capsys, "plan", "--model", "tiny-moe", "--framework", "megatron", "--gpus", "4", "--seq-len",
                         "64", "--global-batch-tokens", "2048", "--ep", "2", "--zero", "3", "--emit-config", str(path))
    assert code == 2 and err.count("\n") == 1 and "the engine refuses" in err and "--zero 3 with --ep" in err, err
    assert not path.exists()


def test_a_planned_moe_layout_trains_as_planned(capsys, tmp_path):
    # tiny-moe on 2 ranks, its experts spread over both: one step, the header says what was planned.
    path = tmp_path / "run.toml"
    code, _, err = cli(capsys, "plan", "memory", "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--seq-len", "32",
                       "--micro-batch", "2", "--emit-config", str(path))
    assert code == 0, err
    r = ultrascale("train", "--config", str(path), "--steps", "1", "--device", "cpu", "--no-progress", "--data", "",
                   cwd=tmp_path)  # the data set: the default corpus
    assert r.returncode == 0, r.stderr[-2000:]
    assert "8 experts (top-2, width 64)" in r.stdout and "ep 2" in r.stdout and "done: 1 steps" in r.stdout, r.stdout


# -- a complete run, and its launch -------------------------------------------------------
def test_the_llama3_8b_plan_on_32_gpus_is_a_whole_run_for_this_engine(capsys, tmp_path):
    # Planned with the engine's own kernels and memory; steps, learning rate, data, saves and the
    # launch on 4 nodes written with it; the layout fits by the engine's memory model.
    import tomllib

    from ultrascale.plan.emit import GPT3_LR, TOKENS_PER_PARAMETER

    path = tmp_path / "run.toml"
    code, out, err = cli(capsys, "plan", "--model", "llama3-8b", "--gpus", "32", "--seq-len", "8192",
                         "--global-batch-tokens", str(2 ** 20), "--emit-config", str(path), "--emit-launch", "slurm")
    assert code == 0, err
    text = path.read_text()
    t = tomllib.loads(text)["train"]
    p = tomllib.loads(text)["parallel"]
    assert "planned for framework ultrascale" in text and "--nnodes 4 --nproc-per-node 8" in text
    tokens = t["micro_batch"] * t["grad_accum"] * p["dp"] * t["seq_len"]
    assert tokens == 2 ** 20
    n = get_shape("llama3-8b").count()
    assert abs(t["steps"] * tokens / (TOKENS_PER_PARAMETER * n) - 1) < 0.01
    assert GPT3_LR[-2][1] < t["lr"] < GPT3_LR[-3][1]  # between GPT-3's 13B and 6.7B rates
    assert t["data"].startswith("SET-ME") and t["save"] and t["eval_every"] and t["log_jsonl"]
    layout = ["--dp", str(p["dp"]), "--tp", str(p["tp"]), "--pp", str(p["pp"]), "--zero", str(p["zero"]),
              "--micro-batch", str(t["micro_batch"]), "--grad-accum", str(t["grad_accum"]), "--recompute", t["recompute"]]
    code, out, err = cli(capsys, "plan", "memory", "--model", "llama3-8b", "--framework", "ultrascale", "--seq-len",
                         "8192", *layout)
    assert code == 0 and "does not fit" not in out, out
    script = (tmp_path / "run.sbatch").read_text()
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script and "srun torchrun" in script


def test_an_emitted_run_refuses_its_data_placeholder_before_it_starts(capsys, tmp_path):
    path = tmp_path / "run.toml"
    code, _, err = cli(capsys, "plan", "--model", "tiny", "--gpus", "2", "--seq-len", "32", "--global-batch-tokens",
                       "256", "--emit-config", str(path))
    assert code == 0, err
    r = ultrascale("train", "--config", str(path), cwd=tmp_path)
    assert r.returncode == 2 and "--data SET-ME" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "train.jsonl").exists()


def test_emit_launch_needs_emit_config_and_whole_nodes(capsys, tmp_path):
    code, _, err = cli(capsys, "plan", "--model", "tiny", "--gpus", "2", "--emit-launch", "slurm")
    assert code == 2 and "add --emit-config" in err
    code, _, err = cli(capsys, "plan", "--model", "llama3-8b", "--gpus", "12", "--emit-config",
                       str(tmp_path / "r.toml"), "--emit-launch", "slurm")
    assert code == 2 and "multiple of 8" in err and not (tmp_path / "r.toml").exists(), err


def test_the_emitted_torchrun_line_on_two_loopback_nodes_trains_as_nproc(capsys, tmp_path):
    # Two torchrun agents on this machine, one process each, meeting at a c10d rendezvous: the same
    # losses, bit for bit, as the same file under --nproc 2.
    import json
    import os
    import shlex
    import socket
    import subprocess
    import sys

    from ultrascale.plan.launch import torchrun_line

    path = tmp_path / "run.toml"
    code, _, err = cli(capsys, "plan", "--model", "tiny", "--gpus", "2", "--seq-len", "32", "--global-batch-tokens",
                       "256", "--emit-config", str(path))
    assert code == 0, err
    import re

    path.write_text(re.sub(r'^data = .*$', 'data = ""', path.read_text(), flags=re.M))  # the data set: the default
    flags = ["--steps", "3", "--device", "cpu", "--no-progress", "--log-jsonl", "log.jsonl",
             "--save", "", "--save-every", "0", "--keep-last", "0"]  # one machine: no shared checkpoint folder
    here = tmp_path / "nproc"
    here.mkdir()
    r = ultrascale("train", "--config", str(path), *flags, cwd=here)
    assert r.returncode == 0, r.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = shlex.split(torchrun_line(str(path), 2, 1, endpoint=f"127.0.0.1:{port}", run_id="loopback"))
    assert line[0] == "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = []
    for k in range(2):
        cwd = tmp_path / f"node{k}"
        cwd.mkdir()
        nodes.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *line[1:], *flags], cwd=cwd,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-2000:]

    def losses(directory):
        return [row["loss"] for row in map(json.loads, (directory / "log.jsonl").read_text().splitlines())
                if "loss" in row]

    logged = [losses(tmp_path / f"node{k}") for k in range(2) if (tmp_path / f"node{k}" / "log.jsonl").exists()]
    assert len(logged) == 1 and len(logged[0]) == 3  # rank 0's node writes the log
    assert logged[0] == losses(here)
