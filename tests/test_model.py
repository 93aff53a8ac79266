"""The model: shapes, parameter counts, and initial weights that depend on the seed alone."""

import dataclasses

import pytest
import torch

from ultrascale.config import ConfigError
from ultrascale.model import PRESETS, Transformer, build_model, count_params, get_preset, playbook_param_formula
from ultrascale.model.transformer import apply_rope, rope_tables


def _real_count(cfg):
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_count_params_equals_the_module(name):
    # Built on the meta device: a 405B shape costs no memory.
    assert count_params(PRESETS[name]) == _real_count(PRESETS[name])


@pytest.mark.parametrize("h,v,L", [(64, 257, 2), (128, 1000, 3), (48, 50, 1)])
def test_playbook_formula_for_the_multi_head_4h_gelu_shape(h, v, L):
    cfg = dataclasses.replace(get_preset("tiny"), hidden=h, vocab_size=v, layers=L, heads=4, kv_heads=4,
                              ffn_hidden=4 * h, mlp="gelu", norm="layernorm", bias=True, tie_embeddings=True)
    assert _real_count(cfg) == playbook_param_formula(h, v, L) == count_params(cfg)


def test_known_sizes_of_real_presets():
    # Published sizes: Llama 3 8B/70B/405B, SmolLM, and the playbook benchmark shapes.
    expect = {"llama3-8b": 8.03e9, "llama3-70b": 70.55e9, "llama3-405b": 405.85e9, "smollm-135m": 134.5e6,
              "smollm-1.7b": 1.711e9, "1b": 1.34e9, "3b": 3.57e9, "8b": 8.86e9, "80b": 80.0e9}
    for name, n in expect.items():
        assert abs(count_params(PRESETS[name]) - n) / n < 0.003, name


def test_initial_weights_depend_on_the_seed_alone():
    cfg = get_preset("tiny")
    a, b, c = build_model(cfg, 3), build_model(cfg, 3), build_model(cfg, 4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), n


def test_a_parameter_does_not_depend_on_the_others():
    # A pipeline stage builds only its layers: they must get the values they have in the whole model.
    cfg = get_preset("tiny", layers=4)
    whole = build_model(cfg, 0).state_dict()

    def last_stage(model):
        del model.layers["0"], model.layers["1"]
        model.embed = None

    stage = build_model(cfg, 0, transform=last_stage).state_dict()
    assert len(stage) < len(whole)
    for name, p in stage.items():
        assert torch.equal(p, whole[name]), name


def test_a_shard_takes_its_slice_of_the_full_tensor():
    cfg = get_preset("tiny")
    full = build_model(cfg, 0).layers["0"].mlp.up_proj.weight.detach().clone()

    def halve(model):
        w = model.layers["0"].mlp.up_proj.weight
        shard = torch.nn.Parameter(torch.empty(w.shape[0] // 2, w.shape[1], device="meta"))
        shard.full_shape = w.shape
        shard.shard_of_full = lambda t: t.chunk(2, dim=0)[1]
        model.layers["0"].mlp.up_proj.weight = shard

    model = build_model(cfg, 0, transform=halve)
    assert torch.equal(model.layers["0"].mlp.up_proj.weight, full.chunk(2, dim=0)[1])


def test_forward_shapes_and_causality():
    model = build_model(get_preset("tiny"), 0)
    x = torch.randint(0, 257, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 257)
    # Changing a later token must not change earlier logits.
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 257
    torch.testing.assert_close(model(y)[:, :10], logits[:, :10])
    assert not torch.allclose(model(y)[:, 10:], logits[:, 10:])


def test_gqa_equals_multi_head_with_repeated_kv():
    cfg = get_preset("tiny")
    model = build_model(cfg, 0)
    attn = model.layers["0"].attn
    x = torch.randn(2, 8, cfg.hidden)
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    out = attn(x, cos, sin)
    # Reference: repeat each kv head for its group of query heads, plain attention.
    q = apply_rope(attn.q_proj(x).view(2, 8, cfg.heads, -1), cos, sin).transpose(1, 2)
    k = apply_rope(attn.k_proj(x).view(2, 8, cfg.kv_heads, -1), cos, sin).transpose(1, 2)
    v = attn.v_proj(x).view(2, 8, cfg.kv_heads, -1).transpose(1, 2)
    rep = cfg.heads // cfg.kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / cfg.head_dim ** 0.5
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    ref = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 8, -1))
    torch.testing.assert_close(out, ref)


def test_rope_is_a_rotation_that_depends_on_relative_position():
    cos, sin = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    def dot(i, j):
        return (apply_rope(q, cos[i:i + 1], sin[i:i + 1]) * apply_rope(k, cos[j:j + 1], sin[j:j + 1])).sum()
    torch.testing.assert_close(dot(5, 3), dot(12, 10))
    torch.testing.assert_close(apply_rope(q, cos[7:8], sin[7:8]).norm(), q.norm())


def test_tied_embeddings_share_one_matrix():
    model = build_model(get_preset("tiny", tie_embeddings=True), 0)
    assert model.head is None
    x = torch.randint(0, 257, (1, 4))
    model(x).sum().backward()
    assert model.embed.weight.grad is not None


def test_bad_shapes_are_config_errors():
    with pytest.raises(ConfigError, match="not divisible"):
        get_preset("tiny", heads=6).validate()
    with pytest.raises(ConfigError, match="key/value heads"):
        get_preset("tiny", kv_heads=3).validate()
    with pytest.raises(ConfigError, match="unknown model preset"):
        get_preset("nope")
