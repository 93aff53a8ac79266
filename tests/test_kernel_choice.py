"""The attention kernel chosen where a run starts (parallel/precision.py).

torch's CPU flash-attention kernel packs bf16 K and V for AMX tiles when the CPU has AMX, but
the packing routine exists only in the kernel's AVX512 build: under ATEN_CPU_CAPABILITY=default
(or avx2) on such a CPU it raises "pack_vnni2 is only supported when avx512 is supported". The
decision is tested on the flags of three machines; the chosen kernel is run here for real.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ultrascale.errors import ConfigError
from ultrascale.parallel import precision
from ultrascale.parallel.precision import choose_attention_kernel, cpu_flash_attention_fails

# cpuinfo's flags (torch.cpu.get_capabilities()), the ones that matter here.
SAPPHIRE_RAPIDS = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "avx512_fp16": True,
                   "amx_tile": True, "amx_bf16": True, "amx_int8": True, "amx_fp16": False}
GRANITE_RAPIDS = {**SAPPHIRE_RAPIDS, "amx_fp16": True}
EPYC_AVX512 = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "avx512_fp16": False,
               "amx_tile": False, "amx_bf16": False, "amx_int8": False, "amx_fp16": False}
AVX2_ONLY = {"avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_tile": False, "amx_bf16": False}


@pytest.fixture(autouse=True)
def _restore_flash():
    """Each test leaves torch's process-wide flash switch, and the module's note of it, as found."""
    was, switched = torch.backends.cuda.flash_sdp_enabled(), precision._SWITCHED_OFF
    yield
    torch.backends.cuda.enable_flash_sdp(was)
    precision._SWITCHED_OFF = switched


def as_machine(monkeypatch, capability, flags):
    monkeypatch.setattr(precision, "_machine", lambda: (capability, flags))


# -- the decision, on fed flags -------------------------------------------------------------
@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2", "NO AVX"])
def test_amx_below_avx512_avoids_flash_for_bf16(capability):
    assert cpu_flash_attention_fails(capability, SAPPHIRE_RAPIDS, "bf16", "cpu")
    assert cpu_flash_attention_fails(capability, SAPPHIRE_RAPIDS, "bf16", torch.device("cpu"))
    # fp16 packs only with AMX-FP16 (Granite Rapids), which Sapphire Rapids lacks
    assert not cpu_flash_attention_fails(capability, SAPPHIRE_RAPIDS, "fp16", "cpu")
    assert cpu_flash_attention_fails(capability, GRANITE_RAPIDS, "fp16", "cpu")
    # fp32 never packs; a GPU run never calls the CPU kernel
    assert not cpu_flash_attention_fails(capability, SAPPHIRE_RAPIDS, "fp32", "cpu")
    assert not cpu_flash_attention_fails(capability, SAPPHIRE_RAPIDS, "bf16", "cuda")


def test_amx_with_avx512_kernels_keeps_flash():
    for dtype in ("fp32", "bf16", "fp16"):
        assert not cpu_flash_attention_fails("AVX512", GRANITE_RAPIDS, dtype, "cpu")


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2", "AVX512"])
def test_avx512_epyc_keeps_flash(capability):
    # AVX-512 with BF16 but no AMX: oneDNN does not pack, the kernel never calls pack_vnni2
    for dtype in ("fp32", "bf16", "fp16"):
        assert not cpu_flash_attention_fails(capability, EPYC_AVX512, dtype, "cpu")


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2"])
def test_avx2_keeps_flash(capability):
    for dtype in ("fp32", "bf16", "fp16"):
        assert not cpu_flash_attention_fails(capability, AVX2_ONLY, dtype, "cpu")


def test_missing_flags_keep_flash():
    assert not cpu_flash_attention_fails("DEFAULT", {}, "bf16", "cpu")


def test_this_machine_is_read():
    capability, flags = precision._machine()
    assert capability == torch.backends.cpu.get_cpu_capability()
    assert flags and all(isinstance(v, bool) for v in flags.values())
    assert precision.flash_attention_fails_here(torch.bfloat16) == precision.flash_attention_fails_here("bf16")


# -- the choice, applied --------------------------------------------------------------------
def test_choice_switches_flash_off_and_a_later_run_back_on(monkeypatch):
    as_machine(monkeypatch, "DEFAULT", SAPPHIRE_RAPIDS)
    torch.backends.cuda.enable_flash_sdp(True)
    assert choose_attention_kernel("bf16", "cpu") == "math"
    assert not torch.backends.cuda.flash_sdp_enabled()
    assert choose_attention_kernel("bf16", "cpu") == "math"  # again: no change
    assert choose_attention_kernel("fp32", "cpu") == "flash"  # a later fp32 run in the same process
    assert torch.backends.cuda.flash_sdp_enabled()


def test_choice_leaves_a_flash_switch_it_did_not_set(monkeypatch):
    # Not switched off by this module (an earlier run of this process may have, on a machine that needs it).
    monkeypatch.setattr(precision, "_SWITCHED_OFF", False)
    as_machine(monkeypatch, "AVX512", SAPPHIRE_RAPIDS)
    torch.backends.cuda.enable_flash_sdp(False)  # off for another reason
    assert choose_attention_kernel("bf16", "cpu") == "flash"
    assert not torch.backends.cuda.flash_sdp_enabled()


def test_dtype_check_at_trainer_start_applies_the_choice(monkeypatch):
    as_machine(monkeypatch, "DEFAULT", SAPPHIRE_RAPIDS)
    torch.backends.cuda.enable_flash_sdp(True)
    precision.check_dtype_support("bf16", "cpu")
    assert not torch.backends.cuda.flash_sdp_enabled()
    as_machine(monkeypatch, "DEFAULT", EPYC_AVX512)
    # The probe then runs torch's real flash kernel: where this CPU cannot (AMX under a kernel set below
    # avx512), the probe refuses bf16, as it should for a machine it is told can run it; the switch is on.
    real_fails = precision.cpu_flash_attention_fails(torch.backends.cpu.get_cpu_capability(), precision.cpu_flags(),
                                                     "bf16", "cpu")
    with pytest.raises(ConfigError, match="pack_vnni2") if real_fails else contextlib.nullcontext():
        precision.check_dtype_support("bf16", "cpu")
    assert torch.backends.cuda.flash_sdp_enabled()


def _attention_inputs(dtype):
    # Long enough (128 queries and keys, 4 heads of 64) that the CPU flash kernel would pack on AMX.
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 128, 64, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _run(q, k, v):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    return out, grads


@pytest.mark.parametrize("machine", ["here", "amx_default"])
def test_chosen_kernel_matches_the_math_backend_in_bf16(monkeypatch, machine):
    """With the choice applied (this machine's, or the AMX + DEFAULT one fed in), a bf16 causal
    attention forward and backward equals the math backend's within bf16 rounding."""
    if machine == "amx_default":
        as_machine(monkeypatch, "DEFAULT", SAPPHIRE_RAPIDS)
    chosen = choose_attention_kernel("bf16", "cpu")
    assert chosen == ("math" if precision.flash_attention_fails_here("bf16") else "flash")
    q, k, v = _attention_inputs(torch.bfloat16)
    backend = torch._fused_sdp_choice(q, k, v, None, 0.0, True)
    assert backend == (SDPBackend.MATH if chosen == "math" else SDPBackend.FLASH_ATTENTION).value
    out, grads = _run(q, k, v)
    with sdpa_kernel(SDPBackend.MATH):
        want_out, want_grads = _run(q, k, v)
    # bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3): a few roundings apart at most
    torch.testing.assert_close(out, want_out, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
    # and both near the fp32 result
    ref_out, _ = _run(*(t.detach().float().requires_grad_() for t in (q, k, v)))
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(precision.cpu_flash_attention_fails(torch.backends.cpu.get_cpu_capability(), precision.cpu_flags(),
                                                        "bf16", "cpu"),
                    reason="compares with torch's CPU flash kernel, which this CPU cannot run under this kernel set")
def test_context_parallel_blocks_follow_the_choice(monkeypatch):
    """Ring attention calls the CPU flash kernel directly: where it would fail, its blocks take the
    math, which gives the same (O, lse) and gradients within bf16 rounding."""
    from ultrascale.parallel.context import blocks

    q, k, v = (t.detach() for t in _attention_inputs(torch.bfloat16))
    dout = torch.ones_like(q)
    scale = 64 ** -0.5
    kernel_out, kernel_lse = blocks.block_forward(q, k, v, True, scale)
    kernel_grads = blocks.block_backward(q, k, v, dout, kernel_out, kernel_lse, True, scale)

    calls, math_forward = [], blocks._forward_math
    monkeypatch.setattr(blocks, "_forward_math", lambda *a: calls.append("forward") or math_forward(*a))
    as_machine(monkeypatch, "DEFAULT", SAPPHIRE_RAPIDS)
    out, lse = blocks.block_forward(q, k, v, True, scale)
    grads = blocks.block_backward(q, k, v, dout, out, lse, True, scale)
    assert calls == ["forward"]
    torch.testing.assert_close(out.float(), kernel_out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, kernel_lse.float(), rtol=1e-2, atol=1e-2)
    for got, want in zip(grads, kernel_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)

    as_machine(monkeypatch, "AVX512", SAPPHIRE_RAPIDS)  # the AVX512 build packs: the kernel again
    blocks.block_forward(q, k, v, True, scale)
    assert calls == ["forward"]


def test_bf16_training_under_the_math_choice_matches_this_machines(monkeypatch):
    """`train --model tiny --steps 2 --dtype bf16` as on the AMX machine under
    ATEN_CPU_CAPABILITY=default: the Trainer's start switches to the math backend, and the losses
    are those of this machine's own choice within bf16 rounding."""
    from ultrascale.config import RunConfig, TrainConfig
    from ultrascale.model import get_preset
    from ultrascale.testing.compare import BF16, train_single

    # 128 positions: past the length where the CPU flash kernel would pack on AMX
    cfg = RunConfig(model=get_preset("tiny"), train=TrainConfig(steps=2, seq_len=128, micro_batch=4, seed=1,
                                                                 progress=False, dtype="bf16"))
    here = train_single(cfg).losses
    as_machine(monkeypatch, "DEFAULT", SAPPHIRE_RAPIDS)
    amx_default = train_single(cfg).losses
    assert not torch.backends.cuda.flash_sdp_enabled()
    for a, b in zip(amx_default, here):
        assert abs(a - b) <= BF16.loss_rtol * abs(b)
