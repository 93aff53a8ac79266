"""The Mixture-of-Experts layer in one process: against computations written out by hand."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from ultrascale.config import ConfigError, ParallelConfig, RunConfig, TrainConfig
from ultrascale.model import build_model, count_active_params, count_params, get_preset
from ultrascale.model.moe import MoE, update_router_bias
from ultrascale.testing.tolerance import FP32_REORDER

FP32_ELEMENT = FP32_REORDER.element_rtol  # one op against its reference, reordered (docs/engine.md)


def moe_layer(seed=0, **overrides):
    cfg = get_preset("tiny-moe", **overrides)
    torch.manual_seed(seed)
    m = MoE(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def test_all_experts_with_renorm_is_the_dense_mixture():
    # top_k = E and renormalised softmax: every token gets sum_e softmax(xW)_e * expert_e(x).
    m = moe_layer(experts=4, top_k=4, router_renorm=True, aux_loss_coef=0.0)
    x = torch.randn(3, 5, 64)
    t = x.reshape(-1, 64)
    p = (t @ m.router.weight.T).softmax(-1)
    want = sum(p[:, e:e + 1] * swiglu(t, m.experts.gate[e], m.experts.up[e], m.experts.down[e]) for e in range(4))
    torch.testing.assert_close(m(x), want.view(3, 5, 64), rtol=FP32_ELEMENT, atol=1e-6)


def _experts_against_each_by_hand(experts):
    """Rows sorted by expert (expert 1 gets none) through the grouped experts, against each expert's
    SwiGLU written out on its own rows: outputs and every gradient, relative max error."""
    from ultrascale.model.moe import Experts

    torch.manual_seed(4)
    e = Experts(4, 16, 8)
    for p in e.parameters():
        torch.nn.init.normal_(p, 0, 0.5)
    counts = [5, 0, 9, 3]
    x = torch.randn(sum(counts), 16, requires_grad=True)
    g = torch.randn(sum(counts), 16)
    y = experts(e, x, torch.tensor(counts))
    y.backward(g)
    got = [y.detach(), x.grad, e.gate.grad, e.up.grad, e.down.grad]
    hand = [t.detach().clone().requires_grad_() for t in (x, e.gate, e.up, e.down)]
    hx, hg, hu, hd = hand
    rows = hx.split(counts)
    want_y = torch.cat([swiglu(rows[i], hg[i], hu[i], hd[i]) for i in range(4)])
    want_y.backward(g)
    want = [want_y.detach()] + [t.grad for t in hand]
    empty = [float(p.grad[1].abs().sum()) for p in (e.gate, e.up, e.down)]  # expert 1: no rows
    # A NaN anywhere counts as the largest error (Python's max would pass over it).
    errors = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]
    return max(math.inf if math.isnan(err) else err for err in errors), empty


def test_grouped_experts_equal_each_expert_on_its_rows(monkeypatch):
    from ultrascale.model import moe

    for run in (lambda e, x, counts: e(x, counts), lambda e, x, counts: e._one_by_one(x, counts.tolist())):
        error, empty = _experts_against_each_by_hand(run)
        assert error <= 1e-6 and empty == [0.0, 0.0, 0.0]  # an expert without rows: a zero gradient, not None
    if moe._grouped_mm is None:  # this torch has no grouped matmul: the experts run one by one, checked above
        return
    # A wrong grouping fails: each expert's group ends one row early, so its last row goes to the
    # next expert (the last group still ends at the last row: every output row is written).
    grouped = moe._grouped_mm
    monkeypatch.setattr(moe, "_grouped_mm", lambda x, w, offs: grouped(x, w, offs=offs - (offs < offs[-1]).int()))
    assert _experts_against_each_by_hand(lambda e, x, counts: e(x, counts))[0] > 1e-2


def test_top1_without_renorm_weights_by_the_score():
    m = moe_layer(experts=4, top_k=1, router_renorm=False, aux_loss_coef=0.0)
    t = torch.randn(7, 64)
    p = (t @ m.router.weight.T).softmax(-1)
    rows = []
    for i in range(7):
        e = int(p[i].argmax())
        rows.append(p[i, e] * swiglu(t[i:i + 1], m.experts.gate[e], m.experts.up[e], m.experts.down[e])[0])
    want = torch.stack(rows).detach()
    # Entries near zero are differences of terms as large as the largest output: their float32 error
    # scales with that (one kernel set's summation order rounds them otherwise), hence atol relative to it.
    torch.testing.assert_close(m(t[None])[0], want, rtol=FP32_ELEMENT, atol=1e-6 * want.abs().max().item())


def test_capacity_drops_exactly_the_lowest_scoring_assignments():
    m = moe_layer(seed=1, experts=4, top_k=2, capacity_factor=0.5, aux_loss_coef=0.0)
    t = torch.randn(24, 64)
    with torch.no_grad():
        idx, weights, keep, scores, _ = m.route(t)
    cap = math.ceil(0.5 * 24 * 2 / 4)  # 6 of the 12 assignments an expert gets on average
    want = torch.zeros_like(keep)
    for e in range(4):
        mine = [(float(scores[i, e]), i, j) for i in range(24) for j in range(2) if idx[i, j] == e]
        for _, i, j in sorted(mine, reverse=True)[:cap]:
            want[i, j] = True
    assert torch.equal(keep, want)
    assert 0 < int((~keep).sum()) < 48
    # A dropped assignment contributes nothing: the output is the dropless one without it.
    dropless = moe_layer(seed=1, experts=4, top_k=2, aux_loss_coef=0.0)
    hand = torch.zeros(24, 64)
    for i in range(24):
        for j in range(2):
            if keep[i, j]:
                e = int(idx[i, j])
                y = swiglu(t[i:i + 1], m.experts.gate[e], m.experts.up[e], m.experts.down[e])[0]
                hand[i] += weights[i, j] * y
    torch.testing.assert_close(m(t[None])[0], hand, rtol=1e-4, atol=2e-5)  # outputs ~0.1-1
    assert not torch.allclose(dropless(t[None])[0], hand, atol=1e-3)


def test_balance_losses_match_the_formulas_and_join_the_loss():
    coef, zc = 0.1, 0.01
    m = moe_layer(experts=4, top_k=2, aux_loss_coef=coef, z_loss_coef=zc)
    ref = moe_layer(experts=4, top_k=2, aux_loss_coef=0.0, z_loss_coef=0.0)
    t = torch.randn(10, 64)
    g = torch.randn(10, 64)
    # By hand: f_e = assignments to e / (T k), P_e = mean softmax score, aux = E sum f_e P_e.
    logits = t @ ref.router.weight.T
    p = logits.softmax(-1)
    chosen = p.topk(2, dim=-1).indices
    f = torch.stack([(chosen == e).sum() for e in range(4)]).float() / 20
    aux = 4 * (f * p.mean(0)).sum()
    z = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    (m(t[None])[0] * g).sum().backward()
    (((ref(t[None])[0] * g).sum()) + coef * aux + zc * z).backward()
    assert m.aux_sum == pytest.approx(aux.item(), rel=1e-6)
    assert m.z_sum == pytest.approx(z.item(), rel=1e-6)
    torch.testing.assert_close(m.router.weight.grad, ref.router.weight.grad, rtol=1e-4, atol=1e-5)
    plain = moe_layer(experts=4, top_k=2, aux_loss_coef=0.0)
    (plain(t[None])[0] * g).sum().backward()
    assert not torch.allclose(m.router.weight.grad, plain.router.weight.grad, rtol=1e-3)  # the losses count


def test_router_bias_moves_towards_the_mean_load_and_only_steers_the_choice():
    m = moe_layer(experts=4, top_k=1, router_bias_rate=0.5, router_renorm=False, aux_loss_coef=0.0)
    update_router_bias(torch.nn.ModuleList([m]), torch.tensor([[10.0, 2.0, 4.0, 0.0]]))  # mean 4
    assert m.router_bias.tolist() == [-0.5, 0.5, 0.0, 0.5]
    m.router_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))  # every token now picks expert 3
    t = torch.randn(6, 64)
    idx, weights, *_ = m.route(t)
    assert idx.flatten().tolist() == [3] * 6
    # ... but is weighted by its unbiased score.
    torch.testing.assert_close(weights.flatten(), (t @ m.router.weight.T).softmax(-1)[:, 3])


def test_parameter_counts_equal_the_module_and_a_hand_count():
    cfg = get_preset("tiny-moe")
    model = build_model(cfg, 0)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    # embed + head 2*257*64; per block: q, o 2*64*64, k, v 2*64*32, two norms 2*64,
    # router 64*8, 8 experts of 3*64*64; final norm 64. Active: 2 of the 8 experts.
    block = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 + 64 * 8
    assert count_params(cfg) == 2 * 257 * 64 + 2 * (block + 8 * 3 * 64 * 64) + 64 == 255424
    assert count_active_params(cfg) == 2 * 257 * 64 + 2 * (block + 2 * 3 * 64 * 64) + 64
    shared = get_preset("tiny-moe", shared_expert=32, moe_every=2)
    model = build_model(shared, 0)
    assert count_params(shared) == sum(p.numel() for p in model.parameters())
    assert count_params(get_preset("mixtral-8x7b")) == pytest.approx(46.7e9, rel=1e-3)
    assert count_active_params(get_preset("mixtral-8x7b")) == pytest.approx(12.9e9, rel=1e-2)


@pytest.mark.parametrize("overrides,msg", [
    ({"top_k": 9}, "--top-k 9 must be within 1..8"),
    ({"capacity_factor": -1.0}, "--capacity-factor must be 0"),
    ({"router_score": "relu"}, "--router-score must be softmax or sigmoid"),
])
def test_bad_moe_shapes_are_one_line_errors(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        get_preset("tiny-moe", **overrides).validate()


def test_the_loss_falls_on_tiny_moe():
    from ultrascale.testing.compare import train_single

    t = TrainConfig(steps=15, seq_len=32, micro_batch=4, seed=0, progress=False, measure_activations=False)
    cfg = RunConfig(model=get_preset("tiny-moe", router_bias_rate=1e-3), parallel=ParallelConfig(), train=t)
    losses = train_single(cfg).losses
    assert losses[-1] < losses[0] - 1.0, losses
    assert dataclasses.replace(cfg.model).is_moe


def test_the_step_metrics_count_assignments_and_drops(tmp_path):
    import json

    from ultrascale.testing.compare import train_single
    from ultrascale.train.trainer import format_step

    log = tmp_path / "m.jsonl"
    t = TrainConfig(steps=2, seq_len=16, micro_batch=4, seed=0, progress=False, measure_activations=False,
                    log_jsonl=str(log))
    cfg = RunConfig(model=get_preset("tiny-moe", capacity_factor=0.5), parallel=ParallelConfig(), train=t)
    metrics = train_single(cfg).metrics
    assert [json.loads(line)["moe"] for line in log.read_text().splitlines()] == [m["moe"] for m in metrics]
    for m in metrics:
        e = m["moe"]
        # 64 tokens x top-2 over 8 experts: 16 assignments per expert on average.
        assert e["tokens_per_expert_min"] <= 16 <= e["tokens_per_expert_max"]
        # Each expert keeps at most ceil(0.5 * 64 * 2 / 8) = 8 of a micro-batch's: at least half drop.
        assert 0.5 <= e["dropped_fraction"] < 1
        assert e["aux_loss"] > 0 and e["z_loss"] > 0
        assert f"drop {100 * e['dropped_fraction']:.1f}%" in format_step(m)


def test_the_bias_rule_spreads_a_collapsed_router():
    # Every token starts on expert 0 (a bias of 1 outweighs any sigmoid score difference); the
    # sign rule, fed each round's loads, must bring the loads towards their mean.
    m = moe_layer(experts=4, top_k=1, router_score="sigmoid", router_bias_rate=0.05, aux_loss_coef=0.0)
    m.router_bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    t = torch.randn(1, 64, 64)
    cvs = []
    with torch.no_grad():
        for _ in range(40):
            m.reset_stats()
            m(t)
            loads = m.counts.clone()
            cvs.append(float(loads.std(unbiased=False) / loads.mean()))
            update_router_bias(torch.nn.ModuleList([m]), loads[None])
    assert cvs[0] == pytest.approx(math.sqrt(3))  # 64 tokens on one expert of four
    assert max(cvs[-10:]) < 0.5, cvs
