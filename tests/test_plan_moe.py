"""The planner on MoE models as they were trained: DeepSeek-V3 and Qwen3-30B-A3B, field for field; the
H800 and the link bandwidths of any cluster; DualPipe's overlap of the expert all-to-all."""

import dataclasses
import json

import pytest

from ultrascale.model import PRESETS
from ultrascale.parallel.pipeline.schedules import dualpipe_v, overlapped_pairs
from ultrascale.plan import activations as act
from ultrascale.plan.calibration import get_framework
from ultrascale.plan.hardware import get_cluster, with_bandwidths
from ultrascale.plan.layout import Layout
from ultrascale.plan.shape import from_model_config, get_shape
from ultrascale.plan.states import block_counts, stage_blocks, stage_layer_ids, stage_params
from ultrascale.plan.time import _stage_flops, expert_all_to_all, overlapped_share, playbook_flops_per_token, step_time

from plan_cli import cli, memory_json as plan_json

# config.json of huggingface.co/deepseek-ai/DeepSeek-V3: the fields a parameter count reads.
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, n_routed_experts=256, n_shared_experts=1,
                   num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False)
# config.json of huggingface.co/Qwen/Qwen3-30B-A3B.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, tie_word_embeddings=False)


def deepseek_v3_count(c, active=False):
    """Hugging Face's DeepseekV3ForCausalLM, module by module (the e_score_correction_bias of each router,
    256 numbers a block set by a rule, not by the optimizer, left out)."""
    h, n = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    c_q, c_kv = c["q_lora_rank"], c["kv_lora_rank"]
    attn = (h * c_q + c_q + c_q * n * (nope + rope)  # q_a_proj, q_a_layernorm, q_b_proj
            + h * (c_kv + rope) + c_kv + c_kv * n * (nope + v)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
            + n * v * h)  # o_proj
    mlp = lambda f: 3 * h * f  # gate_proj, up_proj, down_proj
    dense = attn + 2 * h + mlp(c["intermediate_size"])
    routed = c["num_experts_per_tok"] if active else c["n_routed_experts"]
    moe = (attn + 2 * h + h * c["n_routed_experts"]
           + (routed + c["n_shared_experts"]) * mlp(c["moe_intermediate_size"]))
    k = c["first_k_dense_replace"]
    embeddings = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
    return embeddings + h + k * dense + (c["num_hidden_layers"] - k) * moe


def qwen3_moe_count(c, active=False):
    """Hugging Face's Qwen3MoeForCausalLM: GQA of head_dim-wide heads with q_norm / k_norm, every block MoE."""
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    attn = h * q + 2 * h * kv + q * h + 2 * d  # q, k, v, o; q_norm and k_norm
    experts = c["num_experts_per_tok"] if active else c["num_experts"]
    block = attn + 2 * h + h * c["num_experts"] + experts * 3 * h * c["moe_intermediate_size"]
    embeddings = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
    return embeddings + h + c["num_hidden_layers"] * block


def within(value, published, rel):
    return abs(value / published - 1) <= rel


# DeepSeek-V3's layout (arXiv 2412.19437, section 3.2; batches of 15,360 sequences of 4K, section 4.2).
DEEPSEEK_RUN = ["--model", "deepseek-v3", "--dp", "128", "--pp", "16", "--ep", "64", "--zero", "1", "--micro-batch",
                "1", "--grad-accum", "120", "--seq-len", "4096", "--precision", "bf16-fp32-grads"]


# -- counts ------------------------------------------------------------------------------------
def test_the_trained_shapes_count_what_their_config_json_says():
    ds, qw = get_shape("deepseek-v3"), get_shape("qwen3-30b-a3b")
    assert ds.count() == deepseek_v3_count(DEEPSEEK_V3)
    assert ds.active_params() == deepseek_v3_count(DEEPSEEK_V3, active=True)
    assert qw.count() == qwen3_moe_count(QWEN3_30B_A3B)
    assert qw.active_params() == qwen3_moe_count(QWEN3_30B_A3B, active=True)
    assert ds.count() == sum(n for _, n in ds.named_params())  # the list and the count agree
    # The q/k norms are in it: without them the count is another one.
    assert dataclasses.replace(qw, qk_norm=False).count() != qwen3_moe_count(QWEN3_30B_A3B)


def test_the_trained_shapes_are_within_1_percent_of_the_published_counts():
    ds, qw = get_shape("deepseek-v3"), get_shape("qwen3-30b-a3b")
    # DeepSeek-V3 report, abstract: 671B total. The model card's README_WEIGHTS.md: 36.6B activated,
    # "including 0.9B for the output Head", so without the input embedding (a lookup, no multiply).
    assert within(ds.count(), 671e9, 0.01)
    assert within(ds.active_params() - ds.vocab * ds.hidden, 36.6e9, 0.01)
    assert within(ds.active_params(), 37e9, 0.02)  # the abstract's "37B", two figures: 37.55B counted
    # Qwen3-30B-A3B's model card: 30.5B in total, 29.9B without the embeddings, 3.3B activated (two figures:
    # 3.353B counted, as its config.json gives; 2% covers the rounding).
    assert within(qw.count(), 30.5e9, 0.01)
    assert within(qw.count() - 2 * qw.vocab * qw.hidden, 29.9e9, 0.01)
    assert within(qw.active_params(), 3.3e9, 0.02)


def test_plan_says_how_many_parameters_a_token_multiplies(capsys, tmp_path):
    """The active count (checked above against config.json) in every output of `plan` and `plan memory`."""
    ds = get_shape("deepseek-v3")
    words = f"671,026,404,352 parameters, {ds.active_params():,} active per token"
    assert plan_json(capsys, *DEEPSEEK_RUN)["active_param_count"] == ds.active_params() == 37_552_282_624
    code, out, err = cli(capsys, "plan", "memory", *DEEPSEEK_RUN)
    assert code == 0 and out.splitlines()[0].startswith("deepseek-v3: 671,026,404,352 parameters ("), err
    assert f", {ds.active_params():,} active per token, precision " in out.splitlines()[0]
    # tp and pp pinned: the words are the search's header, not its ranking; the whole search takes a minute.
    search = ["plan", "--model", "deepseek-v3", "--gpus", "2048", "--seq-len", "4096", "--top", "1", "--tp", "8",
              "--pp", "16"]
    code, out, err = cli(capsys, *search, "--html", str(tmp_path / "p.html"))
    assert code == 0 and out.startswith(f"deepseek-v3 on 2048 x h100-80gb ({words}): "), err
    assert words in (tmp_path / "p.html").read_text()
    code, out, err = cli(capsys, *search, "--json")
    assert json.loads(out)["active_param_count"] == ds.active_params()
    dense = plan_json(capsys, "--model", "llama3-8b", "--dp", "8", "--seq-len", "4096", "--micro-batch", "1")
    assert dense["active_param_count"] == dense["param_count"]
    code, out, err = cli(capsys, "plan", "memory", "--model", "llama3-8b", "--dp", "8")
    assert "active per token" not in out


def test_the_approximations_miss_the_published_counts():
    ds, qw = get_shape("deepseek-v3"), get_shape("qwen3-30b-a3b")
    # The engine's DeepSeek-V3 (MLA counted as GQA of 128 kv heads, every block MoE): 704.9B.
    assert not within(from_model_config(PRESETS["deepseek-v3"]).count(), 671e9, 0.01)
    # MLA kept, the three dense blocks made MoE: 703.8B.
    assert not within(dataclasses.replace(ds, dense_layers=0).count(), 671e9, 0.01)
    # MLA counted as GQA of 128 heads of 56, the dense blocks kept: 672.1B, within 1% of the total (the two
    # attentions hold about as many weights), but 37.7B active without the input embedding, 3% above the
    # published 36.6B: the active count and the exact one from config.json tell them apart.
    gqa = dataclasses.replace(ds, kv_channels=0, q_lora_rank=0, kv_lora_rank=0, qk_rope_head_dim=0, v_head_dim=0)
    assert not within(gqa.active_params() - ds.vocab * ds.hidden, 36.6e9, 0.01)
    assert gqa.count() != deepseek_v3_count(DEEPSEEK_V3)
    # Qwen3's heads taken as hidden / heads = 64 wide: 30.08B and 2.9B.
    narrow = dataclasses.replace(qw, kv_channels=0)
    assert not within(narrow.count(), 30.5e9, 0.01) and not within(narrow.active_params(), 3.3e9, 0.02)


def test_the_engine_presets_of_the_same_names_stay_what_the_engine_builds():
    for name in ("deepseek-v3", "qwen3-30b-a3b"):
        assert get_shape(name) != from_model_config(PRESETS[name])
    assert "deepseek-v3" in PRESETS and from_model_config(PRESETS["deepseek-v3"]).count() == 704_921_039_872


# -- FLOPs -------------------------------------------------------------------------------------
def test_attention_flops_use_the_real_head_widths():
    s = 4096
    ds, qw, llama = get_shape("deepseek-v3"), get_shape("qwen3-30b-a3b"), get_shape("llama3-8b")
    # Scores over (nope + rope)-wide heads, values over v_head_dim-wide ones: 2·s·n·d each forward, x 3.
    assert ds.attn_core_flops(s) == 6 * s * 128 * ((128 + 64) + 128)
    assert qw.attn_core_flops(s) == 6 * s * 32 * (128 + 128)
    assert llama.attn_core_flops(s) == 12 * 4096 * s  # the playbook's 12·h·s where heads are h / heads wide
    assert playbook_flops_per_token(ds, s) == 6 * deepseek_v3_count(DEEPSEEK_V3, active=True) + 61 * 6 * s * 128 * 320


def test_a_stage_multiplies_its_dense_and_moe_blocks_active_parameters():
    ds = get_shape("deepseek-v3")
    whole = block_counts(ds, (tuple(range(61)), True, True))
    flops = _stage_flops(ds, Layout(seq_len=4096), whole, 1)[0]
    # Every active parameter but the input embedding's lookup and the final norm, and the attention core.
    embedding, final_norm = 129280 * 7168, 7168
    active = deepseek_v3_count(DEEPSEEK_V3, active=True)
    assert flops == 6 * (active - embedding - final_norm) + 61 * ds.attn_core_flops(4096)


# -- who holds which parameters -----------------------------------------------------------------
@pytest.mark.parametrize("pp,schedule", [(16, "dualpipev"), (4, "1f1b"), (1, "1f1b")])
def test_the_stages_hold_every_parameter_once(pp, schedule):
    ds = get_shape("deepseek-v3")
    lay = Layout(pp=pp, schedule=schedule, chunks=2 if schedule == "dualpipev" else 1)
    held = sum(sum(stage_params(ds, lay, b)) for b in stage_blocks(ds, pp, "even", lay.chunks, 0, 0,
                                                                    schedule == "dualpipev"))
    assert held == deepseek_v3_count(DEEPSEEK_V3)


def test_expert_parallelism_shards_only_the_routed_experts():
    ds = get_shape("deepseek-v3")
    lay = Layout(dp=8, ep=8, pp=16)
    first = stage_blocks(ds, 16)[0]  # 61 blocks over 16 stages: the first 13 hold 4, the first 3 of them dense
    assert first == (4, True, False, 3)
    dense, expert = stage_params(ds, lay, first)
    h, mlp = 7168, 3 * 7168 * 2048
    assert expert == 1 * (256 // 8) * mlp
    c = DEEPSEEK_V3
    attn = (h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h)
    assert dense == 129280 * h + 4 * (attn + 2 * h) + 3 * 3 * h * c["intermediate_size"] + (256 * h + mlp)


def test_tensor_parallelism_splits_mlas_heads_and_replicates_its_latents():
    ds, h = get_shape("deepseek-v3"), 7168
    latents = h * 1536 + 1536 + h * (512 + 64) + 512  # q_a_proj, q_a_norm, kv_a_proj, kv_a_norm
    heads = 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * h  # q_b_proj, kv_b_proj, o_proj
    assert ds.attn_params(8) == latents + heads // 8


# -- activations ---------------------------------------------------------------------------------
def test_an_mla_block_keeps_its_latents_and_its_decompressed_heads():
    ds = get_shape("deepseek-v3")
    spec = act.ActivationSpec(act_bytes=2, kernels="fused")
    h, b = 7168, 2
    attention = (b * h + 4 + b * h  # attn_norm: input and rstd; its output (q_a and kv_a's input)
                 + b * 1536 + 4 + b * 1536  # the query latent, its norm's statistic, the normed latent
                 + b * 512 + 4 + b * 512  # the key/value latent likewise
                 + b * 128 * 192 * 2 + b * 128 * 128  # q and k (d + r wide heads), v
                 + 4 * 128 + b * 128 * 128)  # logsumexp, the attention output (128 heads of v_head_dim)
    dense_mlp = b * h + 4 + b * h + 4 * b * 18432  # mlp_norm, its output; gate, up, silu(gate), product
    assert act.layer_bytes(ds, spec, 1, moe=False) == attention + dense_mlp


def test_qwen3_keeps_its_wide_heads_and_their_norms():
    qw = get_shape("qwen3-30b-a3b")
    spec = act.ActivationSpec(act_bytes=2, kernels="fused")
    terms = {n: v for n, v, _ in act.layer_terms(qw, spec)}
    assert terms["q after RoPE"] == 2 * 32 * 128 and terms["k after RoPE"] == 2 * 4 * 128
    assert terms["SDPA output"] == 2 * 32 * 128
    assert terms["q_norm norm input"] == 2 * 32 * 128 and terms["q_norm norm rstd"] == 4 * 32


def test_deepseeks_storage_of_an_moe_block():
    """The DeepSeek-V3 report's rules (sections 3.2.3, 3.3.3), counted by hand for one MoE block."""
    ds = get_shape("deepseek-v3")
    fw = get_framework("deepseek")
    spec = act.ActivationSpec(act_bytes=2, kernels="fused", fp8_cache=fw.fp8_cache, recompute_norms=fw.recompute_norms)
    h, b, fp8 = 7168, 2, 1 + 4 / 128
    kept = (b * h  # the block's input (attn_norm recomputed from it)
            + b * 1536 + b * (512 + 64)  # the latents, q, k and v rebuilt from them
            + 4 * 128 + 1.5 * 128 * 128  # logsumexp; the attention output in E5M6
            + b * h  # mlp_norm's input
            + 4 * 256 + 8 * 8  # router probabilities, top-k
            + 8 * fp8 * h  # the 8 dispatched copies in FP8
            + 8 * 2 * fp8 * 2048 + 2 * fp8 * 2048)  # the routed and shared experts' SwiGLU inputs in FP8
    assert act.layer_bytes(ds, spec, 1) == pytest.approx(kept, rel=1e-12)
    assert act.layer_bytes(ds, dataclasses.replace(spec, fp8_cache=False, recompute_norms=False), 1) > 2.5 * kept


def test_the_leading_dense_blocks_reach_the_first_stages_activations():
    from ultrascale.plan.memory import memory_plan

    fw, lay = get_framework("deepseek"), Layout(pp=16, grad_accum=16)
    ds = get_shape("deepseek-v3")
    real, all_moe = (memory_plan(s, lay, fw).stages for s in (ds, dataclasses.replace(ds, dense_layers=0)))
    assert real[0].terms["activations"] < 0.9 * all_moe[0].terms["activations"]  # 3 of its 4 blocks dense
    assert real[5].terms["activations"] == all_moe[5].terms["activations"]  # no dense block there


# -- DeepSeek-V3's published layout ------------------------------------------------------------------
def test_deepseek_v3s_layout_fits_its_80_gb_with_its_storage(capsys):
    """DeepSeek-V3 trained this layout on 80 GB H800s (arXiv 2412.19437, section 3): the planner with
    the report's activation storage fits it; with the standard one it would not."""
    own = plan_json(capsys, *DEEPSEEK_RUN, "--schedule", "dualpipev", "--framework", "deepseek",
                    "--cluster", "deepseek")
    assert own["fits"] and own["gpu"] == "h800"
    standard = plan_json(capsys, *DEEPSEEK_RUN, "--schedule", "dualpipev", "--framework", "megatron",
                         "--cluster", "deepseek")
    assert not standard["fits"]


# -- the H800 and the links of any cluster ------------------------------------------------------------
def test_nvlink_bandwidth_sets_a_tp8_layouts_communication(capsys):
    args = ["--model", "llama3-70b", "--tp", "8", "--dp", "2", "--zero", "1"]
    tp = {name: plan_json(capsys, *args, *extra)["time"]["breakdown_s"]["tp_comm"]
          for name, extra in (("h100", []), ("half", ["--nvlink-gbs", "180"]), ("h800", ["--cluster", "h800"]))}
    # The bandwidth term goes as 1 / bandwidth, the latency term stays: halving 360 GB/s adds one bandwidth
    # term, the H800's 160 GB/s (DeepSeek-V3 report, 3.2.2) adds 360/160 - 1 = 1.25 of one.
    assert tp["half"] > tp["h100"]
    assert (tp["h800"] - tp["h100"]) / (tp["half"] - tp["h100"]) == pytest.approx(360 / 160 - 1, rel=1e-9)
    same = plan_json(capsys, *args, "--cluster", "h800")["time"]["breakdown_s"]["compute"]
    assert same == plan_json(capsys, *args)["time"]["breakdown_s"]["compute"]  # the H100's chip


def test_infiniband_bandwidth_sets_the_expert_all_to_all_across_nodes():
    ds, fw = get_shape("deepseek-v3"), get_framework("deepseek")
    lay = Layout(dp=128, pp=16, ep=64, zero=1, grad_accum=120)
    cluster = get_cluster("deepseek")
    act_full = 4096 * 7168 * 2
    full, half = (expert_all_to_all(ds, lay, c, fw, act_full) for c in (cluster, with_bandwidths(cluster, ib_gbs=20)))
    # Each token crosses to at most 4 of the 8 nodes (node-limited routing), 7/8 of them remote, over its NIC.
    ib = 4 * 7 / 8 * act_full
    latency = 12 * 10e-6  # 2·log2(64) steps of the inter-node latency
    assert full == pytest.approx(ib / 40e9 + latency, rel=1e-9)
    assert half == pytest.approx(ib / 20e9 + latency, rel=1e-9)
    # Without the routing limit every copy crosses: 8 x 56/64 of the tokens, twice the bytes.
    unlimited = expert_all_to_all(dataclasses.replace(ds, topk_groups=0, expert_groups=0), lay, cluster, fw, act_full)
    assert unlimited == pytest.approx(8 * 56 / 64 * act_full / 40e9 + latency, rel=1e-9)
    # Our engine's grid puts the expert group's ranks 16 apart: one per node, every copy through the NIC.
    strided = expert_all_to_all(ds, lay, cluster, get_framework("ultrascale"), act_full)
    assert strided > full


@pytest.mark.parametrize("value", ["0", "-40", "nan", "inf"])
@pytest.mark.parametrize("flag", ["--nvlink-gbs", "--ib-gbs"])
def test_a_bad_bandwidth_is_one_line(capsys, flag, value):
    code, out, err = cli(capsys, "plan", "memory", "--model", "llama3-8b", flag, value)
    assert code == 2 and flag in err and "GB/s" in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_bandwidth_that_is_no_number_is_one_line(capsys):
    code, out, err = cli(capsys, "plan", "--model", "llama3-8b", "--gpus", "8", "--ib-gbs", "fast")
    assert code == 2 and "--ib-gbs" in err and err.count("\n") == 1


def test_the_figures_say_the_bandwidth_they_assume(capsys):
    code, out, err = cli(capsys, "plan", "memory", "--model", "llama3-8b", "--cluster", "h800", "--ib-gbs", "25")
    assert code == 0, err
    assert "cluster h800" in out and "--ib-gbs 25" in out


# -- DualPipe's overlap of the expert all-to-all ---------------------------------------------------------
@pytest.mark.parametrize("p,m", [(4, 8), (4, 13), (8, 40), (16, 120)])
def test_the_overlapped_share_is_the_engines_dualpipev(p, m):
    # The engine's DualPipeV (parallel/pipeline/schedules.py): forward/backward pairs on each rank.
    fewest = min(len(overlapped_pairs(dualpipe_v(p, m, r))) for r in range(p))
    assert overlapped_share(Layout(pp=p, grad_accum=m, schedule="dualpipev", chunks=2)) == fewest / (2 * m)
    for schedule in ("1f1b", "interleaved", "zero-bubble"):
        assert overlapped_share(Layout(pp=p, grad_accum=m, schedule=schedule)) == 0


def test_dualpipe_hides_the_expert_all_to_all_that_1f1b_shows():
    ds, fw, cluster = get_shape("deepseek-v3"), get_framework("deepseek"), get_cluster("deepseek")
    base = dict(dp=128, pp=16, ep=64, zero=1, grad_accum=120, precision="bf16-fp32-grads")
    dual = step_time(ds, Layout(**base, schedule="dualpipev", chunks=2), cluster, fw).breakdown
    one = step_time(ds, Layout(**base, schedule="1f1b"), cluster, fw).breakdown
    # 1F1B: every all-to-all on the path. The slowest stage holds 4 MoE blocks: 4 all-to-alls each, 120 times.
    a2a = expert_all_to_all(ds, Layout(**base), cluster, fw, 4096 * 7168 * 2)
    assert one["ep_comm"] == pytest.approx(120 * 4 * 4 * a2a, rel=1e-9)
    assert one["sync"] == pytest.approx(120 * 4 * 4 * 63 * fw.collective_step_s, rel=1e-9)  # their steps' waits
    # DualPipe: the same all-to-alls and waits, off the path where a pair overlaps them: only what exceeds
    # the compute beside them shows, so less than 1F1B's, and no more hidden than that compute.
    whole = one["ep_comm"] + one["sync"]
    assert dual.get("sync", 0) == 0
    assert whole - dual["compute"] - dual["recompute"] <= dual["ep_comm"] < whole


def test_deepseek_v3s_planned_throughput_is_near_its_published_one():
    """180K H800 GPU hours per trillion tokens (DeepSeek-V3 report, abstract): 1e12 / (180e3 x 3600)
    tokens/s per GPU; the planner within the 25% it keeps for every published run (docs/planner.md)."""
    from ultrascale.plan import published

    run = next(r for r in published.RUNS if r.model == "deepseek-v3")
    assert run.published == pytest.approx(1543.2, abs=0.1)
    assert published.predict(run, run.framework, run.cluster) == pytest.approx(run.published, rel=0.25)
