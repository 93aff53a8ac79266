"""The memory-bound passes the time model adds (plan/passes.py), and the switches that move them.

The bytes an eager kernel moves are counted here from the kernels themselves: the reference code is
run under a dispatch mode that adds up, for every aten op, the bytes of the activation-sized tensors
it reads and writes (views move nothing). The planner's table must equal that count, op by op.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ultrascale.plan import passes, published
from ultrascale.plan.calibration import get_framework
from ultrascale.plan.hardware import get_cluster
from ultrascale.plan.layout import Layout
from ultrascale.plan.shape import get_shape
from ultrascale.plan.time import step_time

VIEWS = {"view", "_unsafe_view", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice", "select", "alias",
         "detach", "reshape", "permute", "as_strided", "split", "chunk", "unbind", "narrow", "view_as_complex",
         "view_as_real", "_conj"}


class _Traffic(TorchDispatchMode):
    """Bytes read and written by every op that is not a view, of tensors of at least `floor` elements."""

    def __init__(self, floor):
        super().__init__()
        self.floor, self.bytes = floor, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] not in VIEWS:
            tensors = [t for t in tree_flatten((args, kwargs))[0] + tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors if t.numel() >= self.floor)
        return out


def _per_element(fn, *xs):
    """(forward, backward) bytes per element of the first input, eager."""
    xs = [x.detach().requires_grad_(x.dtype.is_floating_point) for x in xs]
    n = xs[0].numel()
    with _Traffic(n // 2) as fwd:
        y = fn(*xs)
    grad = torch.ones_like(y)
    with _Traffic(n // 2) as bwd:
        y.backward(grad)
    return fwd.bytes / n, bwd.bytes / n


# The eager code the planner's table describes: torchtitan's Llama as it is written (2024).
def _rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * w


def _rope(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[None, :, None]).flatten(3).type_as(x)


TOKENS, H = 64, 512


def _reference(op, dtype):
    x = torch.randn(TOKENS, H, dtype=dtype)
    if op == "rmsnorm":
        return _rmsnorm, (x, torch.ones(H, dtype=dtype))
    if op == "rope":
        heads = torch.randn(1, TOKENS, 8, H // 8, dtype=dtype)
        return _rope, (heads, torch.polar(torch.ones(TOKENS, H // 16), torch.randn(TOKENS, H // 16)))
    if op == "swiglu":
        return (lambda g, u: F.silu(g) * u), (x, x.clone())
    if op == "gelu":
        return (lambda a, bias: F.gelu(a + bias)), (x, torch.zeros(H, dtype=dtype))
    assert op == "cross_entropy"
    return (lambda logits: F.cross_entropy(logits.float(), torch.zeros(TOKENS, dtype=torch.long))), (x,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", sorted(passes.EAGER))
def test_the_eager_table_is_what_the_kernels_move(op, dtype):
    fn, args = _reference(op, dtype)
    assert _per_element(fn, *args) == pytest.approx(passes.EAGER[op][dtype.itemsize], abs=0.05)


def test_the_count_sees_a_kernel_more():
    # The count is not blind: one more fp32 round trip in the norm is 8 bytes more per element each way.
    x, w = torch.randn(TOKENS, H, dtype=torch.bfloat16), torch.ones(H, dtype=torch.bfloat16)
    fwd, _ = _per_element(lambda x, w: _rmsnorm(x, w).float().type_as(x), x, w)
    assert fwd == pytest.approx(passes.EAGER["rmsnorm"][2][0] + 12, abs=0.05)


def test_float8_casts_every_linear_input_gradient_and_weight():
    # Llama 3 8B: q, k, v, o and the SwiGLU MLP, counted by hand from the shape.
    shape = get_shape("llama3-8b")
    h, kv, f = 4096, 1024, 14336
    per_token, weights = passes.cast_elements(shape)
    assert per_token == (3 * h + h + kv + kv) + (h + h) + 2 * (h + f) + (f + h)
    assert weights == shape.attn_params() + shape.mlp_params()  # every linear of the block, once


def _titan(name):
    return next(r for r in published.RUNS + published.HELD_OUT if r.name == name)


def _predict(run, **switches):
    return published.predict(dataclasses.replace(run, switches={**run.switches, **switches}), run.framework,
                             run.cluster)


def test_eager_kernels_cost_time_where_the_constants_were_set_on_fused_ones():
    eager = _titan("torchtitan Llama 3.1 8B FSDP eager on 8 H100")
    compiled, slower = _predict(eager, kernels="fused"), _predict(eager)
    assert slower < compiled  # the same run, eager: slower by the passes' bytes
    # What the passes add, at the HBM's rate: fewer tokens/s, and no more than what they move.
    shape, lay = get_shape("llama3-8b"), Layout(**eager.layout)
    fwd, bwd = passes.eager_bytes(shape, lay, 2)
    moved = shape.layers * (fwd + bwd) + passes.eager_head_bytes(shape, lay, 2)
    assert 1 / slower - 1 / compiled == pytest.approx(moved / get_cluster("grand-teton").hbm_bandwidth, rel=1e-6)
    # A framework timed on eager kernels (our engine) pays nothing more for them.
    fw = get_framework("ultrascale")
    assert fw.kernels == fw.kernels_timed == "eager"


def test_float8_is_bounded_by_its_casts():
    run = _titan("torchtitan Llama 3.1 8B FSDP on 8 H100")
    bf16, fp8 = _predict(run), _predict(run, float8=True)
    # Faster, but less than the matmuls' 2x: the attention core stays in bf16 and the casts cost HBM time.
    assert bf16 < fp8 < 2 * bf16
    shape, lay = get_shape("llama3-8b"), Layout(**run.layout)
    cluster = get_cluster("grand-teton")
    tokens = lay.micro_batch * lay.seq_len
    casts = passes.cast_bytes(shape, lay, 2, shape.layers, tokens) / cluster.hbm_bandwidth
    fw = dataclasses.replace(get_framework("torchtitan"), float8=True)
    t = step_time(shape, lay, cluster, fw)
    assert t.breakdown["kernel_overhead"] == pytest.approx(
        fw.layer_overhead_s * shape.layers + fw.microbatch_overhead_s + casts, rel=1e-9)


def test_tp_overlap_shows_the_first_piece_and_what_the_matmul_cannot_hide():
    run = _titan("torchtitan Llama 3.1 70B FSDP+TP float8 on 256 H100")
    plain, overlapped = _predict(run), _predict(run, tp_overlap=True)
    assert plain < overlapped
    fw = dataclasses.replace(get_framework("torchtitan"), tp_overlap=True)
    shape, lay, cluster = get_shape("llama3-70b"), Layout(**run.layout), get_cluster("grand-teton")
    t = step_time(shape, lay, cluster, fw)
    no_comm = step_time(shape, lay, dataclasses.replace(cluster, intra=dataclasses.replace(
        cluster.intra, bandwidth=1e30, latency=0.0)), fw)
    # Never better than communication for free, and at least the first of tp pieces of every collective.
    assert t.step_s > no_comm.step_s
    plain_t = step_time(shape, lay, cluster, get_framework("torchtitan"))
    assert t.breakdown["tp_comm"] >= plain_t.breakdown["tp_comm"] / lay.tp * 0.999
    # Without sequence parallelism there is nothing to cut into pieces: nothing changes.
    no_sp = dataclasses.replace(lay, sp=False)
    assert step_time(shape, no_sp, cluster, fw).step_s == step_time(shape, no_sp, cluster,
                                                                    get_framework("torchtitan")).step_s


def test_every_held_out_run_has_a_source_and_is_not_a_run_the_constants_were_set_on():
    chosen = {(r.model, r.gpu, tuple(sorted(r.layout.items())), tuple(sorted(r.switches.items())))
              for r in published.RUNS}
    for r in published.HELD_OUT:
        assert r.source and r.published > 0
        assert (r.model, r.gpu, tuple(sorted(r.layout.items())), tuple(sorted(r.switches.items()))) not in chosen
    assert {r["set"] for r in published.table()} == {"chosen on", "held out"}


def test_an_emitted_config_does_not_take_tp_overlap(tmp_path, capsys):
    from plan_cli import cli

    out = tmp_path / "plan.toml"
    code, _, err = cli(capsys, "plan", "--model", "tiny", "--gpus", "2", "--tp-overlap", "--emit-config", str(out))
    assert code == 2 and "--tp-overlap" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
