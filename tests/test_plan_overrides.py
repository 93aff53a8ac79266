"""`ultrascale plan --model PRESET --hidden ...`: what follows from an override follows by the preset's
rule, or the override is refused in one line naming what else to give; a changed preset is called
"custom (from PRESET)" wherever the plan is said (text, --json, the HTML page, the emitted config)."""

import json

import pytest

from ultrascale.model.config import PRESETS, count_params, playbook_param_formula
from ultrascale.plan.overrides import gpt_ffn, llama3_ffn, rules_of
from ultrascale.plan.shape import PUBLISHED_PRESETS, get_shape

from plan_cli import cli, memory_json as plan_json

# Meta's published shapes (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3; the models'
# params.json): hidden, layers, heads, kv heads, MLP width. Vocabulary 128,256, untied embeddings.
LLAMA3_70B = dict(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672)
LLAMA3_VOCAB = 128256


def llama_count(hidden, layers, heads, kv_heads, ffn, vocab=LLAMA3_VOCAB):
    """Parameters of a Llama block stack by hand: embedding and head, q/o (h x h), k/v (h x kv_heads *
    head_dim), a SwiGLU MLP (3 h x f), two RMSNorm weights per block and the final one."""
    kv_dim = kv_heads * hidden // heads
    block = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * ffn + 2 * hidden
    return 2 * vocab * hidden + layers * block + hidden


# -- the three defects, through the command line -------------------------------------------------
def test_llama3_8b_made_70b_sized_is_llama3_70b_and_says_custom(capsys):
    # Was: ffn 14336 and 42.4B parameters, called "llama3-8b".
    got = plan_json(capsys, "--model", "llama3-8b", "--hidden", "8192", "--layers", "80", "--heads", "64")
    want = llama_count(**LLAMA3_70B)
    assert abs(got["param_count"] - want) <= 1e-3 * want, (got["param_count"], want)
    assert got["param_count"] == count_params(PRESETS["llama3-70b"])  # the engine's own count of the preset
    derived = got["shape"]["derived"]
    assert derived["ffn_hidden"]["value"] == LLAMA3_70B["ffn"] and "Llama 3" in derived["ffn_hidden"]["rule"]
    assert derived["kv_heads"]["value"] == LLAMA3_70B["kv_heads"]
    assert got["model"] == "custom (from llama3-8b)"
    assert got["shape"]["base"] == "llama3-8b" and got["shape"]["custom"] is True
    assert got["shape"]["given"] == {"hidden": 8192, "layers": 80, "heads": 64}


def test_llama3_heads_follow_a_new_hidden_size_128_wide():
    # Without --heads: Llama 3's heads are 128 wide at every size, so 70B's hidden gives 70B's 64 heads.
    shape = get_shape("llama3-8b", hidden=LLAMA3_70B["hidden"], layers=LLAMA3_70B["layers"])
    assert (shape.heads, shape.kv_heads, shape.ffn_hidden) == (64, 8, 28672)


def test_gpt3_hidden_override_takes_gpt3s_4h_mlp(capsys):
    # Was: ffn 49152 kept. GPT-3's rule d_ff = 4 d_model (Brown et al. 2020): 24576 at 6144.
    got = plan_json(capsys, "--model", "gpt3-175b", "--hidden", "6144")
    assert got["shape"]["derived"]["ffn_hidden"]["value"] == 24576
    # The playbook's count of a 4h GELU block with biases, tied embeddings: h v + L (12 h^2 + 13 h) + 2h.
    assert got["param_count"] == playbook_param_formula(6144, 51200, 96)
    assert got["model"] == "custom (from gpt3-175b)"


def test_gpt3_heads_override_keeps_multi_head_attention(capsys):
    # Was: "kv heads 96" refused, a value never given. GPT-3 is multi-head: kv heads follow the heads.
    got = plan_json(capsys, "--model", "gpt3-175b", "--heads", "64")
    assert got["shape"]["derived"]["kv_heads"]["value"] == 64
    assert got["shape"]["derived"]["head_dim"]["value"] == 12288 // 64


# -- the rules against the published shapes -------------------------------------------------------
@pytest.mark.parametrize("name,hidden,ffn", [
    ("llama3-8b", 4096, 14336), ("llama3-70b", 8192, 28672), ("llama3-405b", 16384, 53248),  # Meta, Table 3
    # The playbook's shapes share the MLPs of Llama 3.2 1B and 3B (hidden 2048 and 3072, MLP 8192 both,
    # meta-llama/Llama-3.2-1B and -3B config.json) and of Llama 3 8B and 70B.
    ("1b", 2048, 8192), ("3b", 3072, 8192), ("8b", 4096, 14336), ("80b", 8192, 28672)])
def test_each_llama_rule_gives_its_own_published_width(name, hidden, ffn):
    assert PRESETS[name].hidden == hidden
    assert rules_of(name).ffn(hidden) == ffn


def test_the_llama3_rule_of_one_size_gives_the_published_width_of_another():
    # 8B's constants (1.3, 1024) at 70B's hidden size give 70B's width; 405B's (1.2, 4096) at 70B's also.
    assert llama3_ffn(8192, 1.3, 1024) == 28672
    assert llama3_ffn(8192, 1.2, 4096) == 28672


def test_the_gpt_rule_gives_the_published_gpt_widths():
    # GPT-3 175B: d_model 12288, d_ff 49152 (Brown et al. 2020, Table 2.1 and section 2.1).
    assert gpt_ffn(12288) == 49152
    for name, shape in PUBLISHED_PRESETS.items():
        assert rules_of(name, shape).ffn(shape.hidden) == shape.ffn_hidden, name


def test_deepseek_shared_expert_follows_the_routed_width():
    # DeepSeek-V3's config.json: n_shared_experts 1 of moe_intermediate_size; so 1024 routed, 1024 shared.
    shape = get_shape("deepseek-v3", expert_ffn_hidden=1024)
    assert (shape.expert_ffn_hidden, shape.shared_expert_ffn) == (1024, 1024)


# -- refusals: one line, exit 2, naming the flag to give ------------------------------------------
@pytest.mark.parametrize("args,names", [
    (["--model", "llama3-8b", "--heads", "12"], "give --kv-heads"),  # 8 kv heads do not divide 12
    (["--model", "llama3-8b", "--hidden", "6000"], "give --heads"),  # 128-wide heads do not divide 6000
    (["--model", "mixtral-8x7b", "--hidden", "8192"], "give --ffn-hidden too"),  # no published rule
    (["--model", "qwen3-30b-a3b", "--hidden", "4096"], "give --ffn-hidden and --expert-ffn-hidden too"),
    (["--model", "deepseek-v3", "--hidden", "4096", "--ffn-hidden", "12288"], "give --expert-ffn-hidden too"),
    (["--model", "tiny", "--hidden", "128"], "give --ffn-hidden too"),
    (["--model", "gpt3-175b", "--block", "llama"], "give --ffn-hidden too"),  # SwiGLU: no width rule for GPT-3
    (["--model", "tiny", "--heads", "6"], "give --heads that divides 64"),
    (["--model", "llama3-8b", "--kv-heads", "3"], "--kv-heads 3 must divide heads 32 (llama3-8b's)"),
])
def test_an_override_without_a_rule_is_refused_in_one_line(capsys, args, names):
    for command in (["plan", "memory"], ["plan", "--gpus", "8"]):
        code, out, err = cli(capsys, *command, *args)
        assert code == 2 and out == "", (code, out, err)
        assert err.count("\n") == 1 and err.startswith("ultrascale: error: ") and "Traceback" not in err, err
        assert names in err, err


def test_the_refusals_name_no_value_the_user_did_not_give(capsys):
    code, _, err = cli(capsys, "plan", "memory", "--model", "llama3-8b", "--heads", "12")
    assert code == 2 and "--heads 12" in err and "Llama 3 keeps 8 key/value heads" in err, err


# -- the name: custom when changed, the preset's when not -----------------------------------------
def test_overrides_equal_to_the_preset_keep_its_name(capsys):
    got = plan_json(capsys, "--model", "llama3-8b", "--hidden", "4096", "--layers", "32", "--kv-heads", "8")
    assert got["model"] == "llama3-8b" and got["shape"] == {
        "name": "llama3-8b", "base": "llama3-8b", "custom": False, "given": {}, "derived": {}, "notes": []}
    code, out, _ = cli(capsys, "plan", "memory", "--model", "smollm-135m", "--tie-embeddings")  # tied already
    assert code == 0 and out.startswith("smollm-135m: ") and "custom" not in out


TINY_PLAN = ["plan", "--model", "tiny", "--layers", "4", "--heads", "4", "--gpus", "2", "--pp", "2",
             "--seq-len", "32", "--global-batch-tokens", "128"]


def test_the_custom_name_in_text_json_page_and_emitted_config(capsys, tmp_path):
    from ultrascale.plan import page

    code, text, err = cli(capsys, *TINY_PLAN)
    assert code == 0, err
    lines = text.splitlines()
    assert lines[0].startswith("custom (from tiny) on 2 x ")
    assert lines[1] == "model custom (from tiny): tiny (106,944 parameters) with layers 4, heads 4, and what follows:"
    # tiny groups 2 query heads per kv head: 4 heads keep 2 kv heads; the heads become 16 wide.
    assert lines[2].startswith("  kv heads 2 (from heads 4, keeping tiny's 2 query heads")
    assert lines[3] == "  head dim 16 (hidden 64 / 4 heads)"
    code, out, err = cli(capsys, *TINY_PLAN, "--json")
    got = json.loads(out)
    assert got["model"] == "custom (from tiny)" and got["shape"]["base"] == "tiny"
    assert got["shape"]["derived"]["kv_heads"]["value"] == 2 and got["shape"]["notes"] == lines[1:4]
    html, toml = tmp_path / "plan.html", tmp_path / "run.toml"
    code, out, err = cli(capsys, *TINY_PLAN, "--html", str(html), "--emit-config", str(toml))
    assert code == 0, err
    data = page.read_data(str(html))
    assert data["model"] == "custom (from tiny)" and data["title"].startswith("custom (from tiny) on 2 x ")
    assert data["shape"] == got["shape"]
    assert "<title>custom (from tiny) on 2 x " in html.read_text()
    emitted = toml.read_text()
    assert emitted.startswith("# ultrascale plan: custom (from tiny), ")
    for line in ('preset = "tiny"', "layers = 4", "heads = 4", "kv_heads = 2",
                 "# model custom (from tiny): tiny (106,944 parameters) with layers 4, heads 4"):
        assert line in emitted, (line, emitted)
    from ultrascale.config import build_config, load_toml

    model = build_config(load_toml(str(toml)), {}).model  # the engine reads it as written
    assert (model.layers, model.heads, model.kv_heads) == (4, 4, 2)


def test_the_pages_script_parses(tmp_path, capsys):
    # The model's notes are joined in the page's script: a newline written into its string would break it.
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip("no node to parse the page's script with")
    html = tmp_path / "plan.html"
    code, _, err = cli(capsys, *TINY_PLAN, "--html", str(html))
    assert code == 0, err
    text = html.read_text()
    start = text.index("<script>\n") + len("<script>\n")
    script = tmp_path / "page.js"
    script.write_text(text[start:text.index("</script>", start)])
    check = subprocess.run([node, "--check", str(script)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
