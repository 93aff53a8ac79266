"""Hugging Face interop: transformers' LlamaForCausalLM in, and out, with the same function.

Every model here is built in the test (random weights, saved into tmp_path): nothing is
downloaded. Weights are drawn wider than a fresh initialisation (std 0.1, norms around 1)
so that logits are O(1) and a misplaced tensor moves them by far more than the tolerance.
"""

import dataclasses
import json
import os
import stat

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from ultrascale.cli import main  # noqa: E402
from ultrascale.config import ConfigError, build_config, validate  # noqa: E402
from ultrascale.model import build_model, cross_entropy_loss, get_preset  # noqa: E402
from ultrascale.model.hf import (  # noqa: E402
    from_hf_config,
    hf_name,
    load_hf,
    our_name,
    param_shapes,
    save_hf,
    to_hf_config,
)
from ultrascale.testing.compare import (  # noqa: E402
    RunRecord,
    assert_matches,
    compare,
    single_process_config,
    train_parallel,
    train_single,
)
from ultrascale.train.checkpoint import read_full_state  # noqa: E402
from ultrascale.testing.cli import jsonl_losses as losses  # noqa: E402
from ultrascale.testing.cli import ultrascale  # noqa: E402

TOL = 1e-5  # max |logits difference|, fp32
SHAPE = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=50000.0)
# Odd vocabulary: under --tp 2 the embedding and head are padded to 302 rows, and the padding is exercised.
RUN = ["--seq-len", "32", "--micro-batch", "4", "--no-progress"]


def random_hf(path, tied=False, seed=0, **save_kwargs) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tied, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(path, **save_kwargs)
    return model


def max_diff(ours, hf, tokens) -> float:
    with torch.no_grad():
        return (ours(tokens) - hf(input_ids=tokens).logits).abs().max().item()


def tokens(seed=1):
    return torch.randint(0, SHAPE["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(seed))


def loaded_cleanly(path):
    model, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no errors
    return model.eval()




# -- names and configs ---------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_names_map_both_ways_onto_transformers_parameters(tied):
    cfg = from_hf_config(LlamaConfig(**SHAPE, tie_word_embeddings=tied))
    ours = param_shapes(cfg)
    with torch.device("meta"):
        theirs = LlamaForCausalLM(to_hf_config(cfg)).state_dict()
    # A tied model saves no lm_head (transformers' state_dict still lists the shared tensor).
    theirs = {n: tuple(t.shape) for n, t in theirs.items() if not (tied and n == "lm_head.weight")}
    assert {hf_name(n): s for n, s in ours.items()} == theirs
    assert all(our_name(hf_name(n)) == n for n in ours)
    assert ("head.weight" in ours) == (not tied)


def test_configs_round_trip_and_the_unrepresentable_is_refused():
    cfg = get_preset("smollm-135m")
    assert from_hf_config(to_hf_config(cfg), name=cfg.name) == cfg
    base = to_hf_config(cfg).to_dict()
    bad = [({"model_type": "mistral"}, "not 'llama'"), ({"attention_bias": True}, "no biases"),
           ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope scaling 'llama3'"),
           ({"head_dim": 128}, "head_dim 128"), ({"hidden_act": "gelu"}, "hidden_act 'gelu'")]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message) as e:
            from_hf_config({**base, **change})
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="GPT-style"):
        to_hf_config(get_preset("tiny", norm="layernorm", mlp="gelu", bias=True))


# -- weights in, weights out -----------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_transformers_checkpoint_gives_the_same_logits(tmp_path, tied):
    hf = random_hf(tmp_path / "hf", tied)
    cfg, state = load_hf(str(tmp_path / "hf"))
    assert cfg.tie_embeddings == tied and cfg.rope_theta == SHAPE["rope_theta"] and cfg.norm_eps == 1e-6
    ours = build_model(cfg, seed=0, source=state).eval()
    diff = max_diff(ours, hf, tokens())
    print(f"transformers -> ultrascale ({'tied' if tied else 'untied'}): max |logits diff| {diff:.2e}")
    assert diff < TOL
    # The check can fail: the same weights with the two layers swapped are another function.
    swapped = {n.replace("layers.0.", "layers.X.").replace("layers.1.", "layers.0.").replace("layers.X.", "layers.1."):
               t for n, t in state.items()}
    assert max_diff(build_model(cfg, seed=0, source=swapped).eval(), hf, tokens()) > 100 * TOL


def test_a_sharded_checkpoint_reads_like_one_file(tmp_path):
    random_hf(tmp_path / "one")
    random_hf(tmp_path / "sharded", max_shard_size="100KB")
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) > 1
    cfg_a, a = load_hf(str(tmp_path / "one"))
    cfg_b, b = load_hf(str(tmp_path / "sharded"))
    assert cfg_a == dataclasses.replace(cfg_b, name=cfg_a.name)
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_hf_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    cfg = from_hf_config(LlamaConfig(**SHAPE, tie_word_embeddings=tied))
    ours = build_model(cfg, seed=3).eval()
    with torch.no_grad():  # wider than the initialisation, as above
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    out = tmp_path / "out"
    save_hf(cfg, dict(ours.named_parameters()), str(out))
    diff = max_diff(ours, loaded_cleanly(out), tokens())
    print(f"ultrascale -> transformers ({'tied' if tied else 'untied'}): max |logits diff| {diff:.2e}")
    assert diff < TOL
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert all(stat.S_IMODE(os.stat(out / f).st_mode) == 0o644 for f in os.listdir(out))
    assert os.listdir(tmp_path) == ["out"]  # no temporary directory left behind


def test_save_hf_copies_the_tokenizer_files_only(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # A tokenizer saved into a transformers model directory, as a downloaded model comes.
    hf_dir = tmp_path / "hf"
    random_hf(hf_dir)
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<eos>": 1, "the": 2, "cat": 3}, "<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>").save_pretrained(hf_dir)
    cfg, state = load_hf(str(hf_dir))
    state = {n: t + 1 for n, t in state.items()}  # not the weights of hf_dir
    save_hf(cfg, state, str(tmp_path / "out"), tokenizer_dir=str(hf_dir))
    files = sorted(os.listdir(tmp_path / "out"))
    assert "tokenizer.json" in files and "tokenizer_config.json" in files and "generation_config.json" not in files
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("the cat")["input_ids"] == [2, 3]
    _, back = load_hf(str(tmp_path / "out"))
    assert all(torch.equal(back[n], state[n]) for n in state)  # its own weights and config, not the tokenizer dir's


# -- the command line: --init-from, export, the round trip ------------------------------------
@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """A transformers model, 2 steps of `train --init-from` on it (saved), and a short text as data."""
    root = tmp_path_factory.mktemp("hf_run")
    hf = random_hf(root / "hf")
    (root / "data.txt").write_text(open(json.__file__).read())
    r = ultrascale("train", "--init-from", f"hf:{root / 'hf'}", *RUN, "--data", str(root / "data.txt"),
                   "--steps", "2", "--save", str(root / "ck"), "--log-jsonl", str(root / "one.jsonl"))
    assert r.returncode == 0, r.stderr
    return root, hf


def test_init_from_trains_from_the_transformers_weights(fine_tuned):
    from ultrascale.config import TrainConfig
    from ultrascale.train.data import run_batches

    root, hf = fine_tuned
    # The first step's loss is the transformers model's own loss on the first batch.
    batches = run_batches(TrainConfig(data=str(root / "data.txt"), seq_len=32, seed=0), global_batch=4)[0]
    inputs, targets = batches.micro_batches(0, 0, 1, 1)[0]
    with torch.no_grad():
        expected = cross_entropy_loss(hf(input_ids=inputs).logits, targets).item()
    first = losses(root / "one.jsonl")[0]
    print(f"first loss: ultrascale --init-from {first:.6f}, transformers {expected:.6f}")
    assert abs(first - expected) / expected < 1e-5


def test_export_loads_in_transformers_and_round_trips_exactly(fine_tuned, capsys):
    root, _ = fine_tuned
    out, again = root / "out", root / "again"
    assert main(["export", "--hf", str(out), str(root / "ck")]) == 0
    assert "wrote" in capsys.readouterr().out
    _, trained = read_full_state(str(root / "ck"))
    cfg, exported = load_hf(str(out))
    assert all(torch.equal(exported[n], trained[n]) for n in trained)  # fp32, bit for bit
    loaded = loaded_cleanly(out)
    diff = max_diff(build_model(cfg, seed=0, source=exported).eval(), loaded, tokens())
    print(f"export -> transformers: max |logits diff| {diff:.2e}")
    assert diff < TOL
    # Export -> model built from the export (what --init-from does) -> export again: the same file.
    model = build_model(cfg, seed=0, source=exported)
    save_hf(cfg, dict(model.named_parameters()), str(again))
    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(out / "config.json")) == json.load(open(again / "config.json"))


def init_from_config(root, **layout):
    """The run of the fine_tuned fixture, assembled as the CLI does (the model from config.json)."""
    flags = {"train": {"init_from": f"hf:{root / 'hf'}", "data": str(root / "data.txt"), "seq_len": 32,
                       "micro_batch": 4, "steps": 2, "progress": False}, "parallel": layout}
    from ultrascale.model.hf import model_from_checkpoint

    return validate(build_config({}, flags, model_from_checkpoint(flags["train"]["init_from"], {})), 2)


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_init_from_in_a_parallel_layout_matches_one_process(fine_tuned, layout):
    # Each rank takes its slice (tp) or its layers (pp) of the transformers tensors: the run is the
    # one-process run, by the engine's criterion (first-step gradients, losses, final parameters).
    root, _ = fine_tuned
    cfg = init_from_config(root, **layout)
    ref = RunRecord.of(train_single(single_process_config(cfg)))
    got = train_parallel(cfg, 2)[0]
    label = f"--init-from hf: with --{' --'.join(f'{k} {v}' for k, v in layout.items())}"
    assert_matches(compare(label, ref, got))
    # The same global batch as the CLI's one-process run: the same first loss.
    one = losses(root / "one.jsonl")[0]
    print(f"first loss: 1 process (CLI) {one:.7f}, {label} {got.losses[0]:.7f}, "
          f"relative difference {abs(got.losses[0] - one) / one:.1e}")
    assert abs(got.losses[0] - one) / one < 1e-5


# -- bad input: one line, exit 2, nothing written ----------------------------------------------
def run_main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    return code, err.strip().splitlines()


def test_bad_init_from_is_one_line_and_exit_2(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    random_hf(hf_dir)
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text((hf_dir / "config.json").read_text())
    (tmp_path / "run.toml").write_text(f'[model]\nhidden = 32\n[train]\ninit_from = "hf:{hf_dir}"\n')
    (tmp_path / "ck").mkdir()
    ck = tmp_path / "saved"
    capsys.readouterr()  # save_pretrained's progress bar
    cases = [
        (["--init-from", "hf:/nonexistent"], "--init-from hf:/nonexistent: no such directory"),
        (["--init-from", f"hf:{tmp_path / 'empty'}"], "no config.json"),
        (["--init-from", f"hf:{tmp_path / 'no_weights'}"], "no model.safetensors"),
        (["--init-from", str(hf_dir)], "give hf:DIR"),
        (["--init-from", f"hf:{hf_dir}", "--hidden", "32"],
         f"--hidden 32 contradicts --init-from hf:{hf_dir}, whose config.json has hidden_size = 64"),
        (["--config", str(tmp_path / "run.toml")], "--hidden 32 contradicts"),
        (["--init-from", f"hf:{hf_dir}", "--model", "tiny"], "drop --model"),
        (["--init-from", f"hf:{hf_dir}", "--resume", str(tmp_path / "ck")], "pass one of them"),
    ]
    for args, message in cases:
        code, lines = run_main(["train", *RUN, "--steps", "1", *args, "--save", str(ck)], capsys)
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, lines)
        assert not ck.exists()


def test_bad_export_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    ck = tmp_path / "ck"
    assert main(["train", "--model", "tiny", "--layers", "1", "--steps", "1", *RUN, "--data", __file__,
                 "--save", str(ck)]) == 0
    capsys.readouterr()
    cases = [
        ([str(tmp_path / "out"), str(tmp_path / "nothing")], "no such checkpoint directory"),
        ([str(tmp_path / "out"), str(tmp_path / "full")], "no meta.json"),
        ([str(tmp_path / "a_file" / "out"), str(ck)], "cannot write there"),
        ([str(tmp_path / "full"), str(ck)], "not empty: pass --force"),
    ]
    for (out, src), message in cases:
        code, lines = run_main(["export", "--hf", out, src], capsys)
        assert code == 2 and len(lines) == 1 and message in lines[0], (out, src, lines)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "ck", "full"] and os.listdir(tmp_path / "full") == ["keep.txt"]
    # --force replaces the directory, whole.
    assert main(["export", "--hf", str(tmp_path / "full"), str(ck), "--force"]) == 0
    assert sorted(os.listdir(tmp_path / "full")) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["a_file", "ck", "full"]
