"""Checks of Part 2 (activation memory and recomputation): the activation formula of one block
of our model, and selective recomputation of the attention core.

Both are checked against measurements: the bytes autograd keeps for backward, counted by the
engine's ActivationMeter (saved-tensor hooks, parameters excluded) on the engine's own model.
Exercise 1 must be a formula: an answer that measures a block itself (the meter, the model) is
named. Exercise 2 also compares gradients with the model run without recomputation, its saved
memory with the engine's own selective recomputation (train/recompute.py) measured the same way,
and counts the runs of the attention core: once in forward and once more, recomputed, in backward.
It must not call the engine's recomputation, which is what it is compared with. The measurements
of the references are cached: they depend only on the shapes.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

from ultrascale.model import ModelConfig, get_preset
from ultrascale.series.checks import require_finite
from ultrascale.series.checks.part1 import uses


# -- measurement ---------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def block_saved_bytes(cfg: ModelConfig, b: int, s: int, dtype_bytes: int, eager: bool = False) -> int:
    """Bytes block 0 of the engine's model keeps for backward, for a [b, s, h] input."""
    import torch

    from ultrascale.model import build_model
    from ultrascale.train.metrics import ActivationMeter

    dtype = {4: torch.float32, 2: torch.bfloat16}[dtype_bytes]
    model = build_model(replace(cfg, layers=1, max_seq_len=max(s, cfg.max_seq_len)), seed=0).to(dtype)
    meter = ActivationMeter(list(model.parameters()) + list(model.buffers()))
    x = torch.randn(b, s, cfg.hidden, dtype=dtype, generator=torch.Generator().manual_seed(0)).requires_grad_()
    with _attention(eager), meter.forward():
        model.layers["0"](x, model.rope_cos[:s], model.rope_sin[:s])
    return meter.take_peak()


def _attention(eager: bool):
    if not eager:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


# -- exercise 1 ----------------------------------------------------------------
def _block_cases():
    tiny = get_preset("tiny")
    other = ModelConfig(name="mha-96", vocab_size=257, hidden=96, layers=1, heads=6, kv_heads=6, ffn_hidden=160,
                        max_seq_len=256)
    gqa = ModelConfig(name="gqa-128", vocab_size=257, hidden=128, layers=1, heads=16, kv_heads=2, ffn_hidden=352,
                      max_seq_len=256)
    # bf16 (2 bytes) cases stay below 64 positions: from 64 on, torch's CPU flash kernel packs K and V
    # for AMX tiles, which it cannot do under a kernel set below AVX512 on a CPU with AMX
    # (parallel/precision.py, cpu_flash_attention_fails): the check must run wherever the notebook does.
    return [(tiny, 2, 32, 4), (tiny, 1, 96, 4), (tiny, 3, 56, 2), (other, 2, 48, 4), (other, 1, 40, 2),
            (gqa, 2, 40, 2), (gqa, 1, 128, 4)]


def _variant(cfg, b, s, B, norm_bytes=4, lse=True, kv=None, mlp=4, scores=False, rstd=True, lse_bytes=4,
             h_wide=4):
    """Bytes of one block by our formula, with one part changed (the mistakes a learner makes)."""
    h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
    kv = cfg.kv_heads * (h // a) if kv is None else kv
    norm = 2 * norm_bytes * h + (4 if rstd else 0)  # input and x*rstd in the norm's dtype, rstd in fp32
    per_token = (2 * norm + B * (h_wide * h + 2 * kv + mlp * f) + (lse_bytes * a if lse else 0)
                 + (B * a * s if scores else 0))
    return b * s * per_token


_H_WIDE = ("in the compute dtype each token keeps four h-wide tensors: the two norm outputs (the inputs of "
           "q/k/v_proj and of gate/up_proj), q, and the attention output (the input of o_proj)")


def _variants(B, h):
    """(the part changed, what the learner missed), for dtype_bytes B and hidden size h."""
    return [
        (dict(norm_bytes=B), "each RMSNorm computes in fp32 whatever the model's dtype: it keeps its input "
                             "and x·rstd as fp32 (4h bytes each) and rstd (4 bytes) per token"),
        (dict(lse=False), "the SDPA logsumexp is missing: flash attention keeps one fp32 value per head "
                          "per token (4·a bytes) to recompute the softmax in backward"),
        (dict(lse_bytes=B), "the logsumexp is fp32 whatever the model's dtype: 4 bytes per head per token"),
        (dict(scores=True), "fused (flash) SDPA keeps no s x s score matrix: nothing in the block grows "
                            "with s per token; that term belongs to eager attention"),
        (dict(kv=h), "k and v are kv_heads·head_dim wide, not h (grouped-query attention)"),
        (dict(mlp=3), "SwiGLU keeps four f-wide tensors per token: gate, up, silu(gate) and silu(gate)·up"),
        (dict(mlp=2), "SwiGLU keeps four f-wide tensors per token: gate, up, silu(gate) and silu(gate)·up"),
        (dict(rstd=False), "each RMSNorm also keeps rstd, 1 / sqrt(mean(x²) + eps): one fp32 value (4 bytes) "
                           "per token, for each of the two norms"),
        (dict(h_wide=3), _H_WIDE),
        (dict(h_wide=2), _H_WIDE),
    ]


def _banned_for_formula():
    from ultrascale.model import build_model
    from ultrascale.train.metrics import ActivationMeter

    # saved_tensors_hooks is reached as torch.autograd.graph.saved_tensors_hooks: banned by its name
    return {"ActivationMeter": ActivationMeter, "build_model": build_model, "block_saved_bytes": block_saved_bytes,
            "saved_tensors_hooks": object()}


def exercise_1(block_activation_bytes):
    """block_activation_bytes(cfg, b, s, dtype_bytes) -> bytes one block keeps, for the flash (default) SDPA."""
    shortcut = uses(block_activation_bytes, _banned_for_formula())
    if shortcut:
        raise AssertionError(
            f"block_activation_bytes measures a block ({shortcut}) instead of counting: the check measures, your "
            f"function predicts. Write the bytes per token from cfg's shape - two fp32 norms, the attention side, "
            f"the MLP side - times b·s")
    for cfg, b, s, B in _block_cases():
        got = block_activation_bytes(cfg, b, s, B)
        assert got is not None, "return the number of bytes (an int)"
        require_finite(got, f"your bytes for {cfg.name}, b={b}, s={s}")
        want = block_saved_bytes(cfg, b, s, B)
        if abs(got - want) <= 1e-9 * want:
            continue
        h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
        where = (f"{cfg.name} (h={h}, heads={a}, kv_heads={cfg.kv_heads}, f={f}), b={b}, s={s}, "
                 f"{'fp32' if B == 4 else 'bf16'}: you say {got:,.0f} bytes, the block keeps {want:,} "
                 f"({want / (b * s):,.0f} per token)")
        for change, why in _variants(B, h):
            other = _variant(cfg, b, s, B, **change)
            if other != want and abs(got - other) <= 1e-9 * other:
                raise AssertionError(f"{where}: {why}")
        if abs(got - b * s * h * 34) < 1 or abs(got - b * s * h * (34 + 5 * a * s / h)) < 1:
            raise AssertionError(f"{where}: Korthikanti's sbh(34 + 5as/h) counts a GPT block in 16-bit with "
                                 f"LayerNorm, dropout and eager attention; count our block's saved tensors")
        if got in (want // (b * s), want / (b * s)):
            raise AssertionError(f"{where}: that is the count per token; multiply by b·s tokens")
        if abs(got * 2 - want) < 1 or abs(got - 2 * want) < 1:
            raise AssertionError(f"{where}: off by a factor of 2: bf16 is 2 bytes, fp32 4, and the norms' "
                                 f"tensors and the logsumexp are fp32 in both")
        raise AssertionError(f"{where} ({got - want:+,.0f}); the saved tensors per token: attention side "
                             f"norm (fp32) + norm output + q, k, v + logsumexp + output; MLP side norm (fp32) + "
                             f"norm output + four f-wide tensors")


# -- exercise 2 ----------------------------------------------------------------
def _run(cfg, prepare, b, s):
    """Loss, gradients and saved bytes of one forward + backward with eager (math) attention, and how many
    times the attention core ran, in forward and in backward."""
    import torch

    from ultrascale.model import build_model, cross_entropy_loss, transformer
    from ultrascale.train.metrics import ActivationMeter, record_activations

    model = build_model(cfg, seed=0)
    if prepare is not None:
        prepare(model)
    meter = ActivationMeter(list(model.parameters()) + list(model.buffers()))
    # The core's inputs (q, k, v) stay alive either way: saved by the attention, or held by a
    # checkpoint to recompute it. Count them in both cases (only while the forward is measured).
    for block in model.layers.values():
        block.attn.core_attention.register_forward_pre_hook(lambda mod, args: record_activations(args))
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(3))
    # Every core runs softmax(QK^T)V through transformer.causal_attention, however it is wrapped.
    runs, phase, original = {"forward": 0, "backward": 0, "again": []}, ["forward"], transformer.causal_attention
    # Any other module that runs in backward is recomputed too: more than the attention core.
    for name, module in model.named_modules():
        if name and "core_attention" not in name:
            module.register_forward_hook(
                lambda mod, args, out, name=name: runs["again"].append(name) if phase[0] == "backward" else None)

    def counted(*args, **kwargs):
        runs[phase[0]] += 1
        return original(*args, **kwargs)

    transformer.causal_attention = counted
    try:
        with _attention(True):
            with meter.forward():
                loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
            phase[0] = "backward"
            loss.backward()
    finally:
        transformer.causal_attention = original
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    return loss.item(), grads, meter.take_peak(), runs


@functools.lru_cache(maxsize=None)
def _references(cfg, b, s):
    """(loss, gradients, saved bytes) without recomputation; saved bytes with the engine's selective and full
    recomputation."""
    from ultrascale.train.recompute import apply_recompute

    loss, grads, plain, _ = _run(cfg, None, b, s)
    selective = _run(cfg, lambda m: apply_recompute(m, "selective"), b, s)[2]
    full = _run(cfg, lambda m: apply_recompute(m, "full"), b, s)[2]
    return loss, grads, plain, selective, full


def _banned_for_recompute():
    from ultrascale.train.recompute import apply_recompute

    return {"apply_recompute": apply_recompute}


def exercise_2(recompute_attention_core):
    """recompute_attention_core(model) wraps every block's attention core in torch.utils.checkpoint."""
    shortcut = uses(recompute_attention_core, _banned_for_recompute())
    if shortcut:
        raise AssertionError(
            f"recompute_attention_core calls the engine's own recomputation ({shortcut}): that is what the check "
            f"compares with. Wrap each block's attn.core_attention yourself: keep its forward, and replace it by "
            f"one that runs it through torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")
    cfg = replace(get_preset("tiny"), layers=3)
    b, s = 2, 128
    loss0, grads0, plain, selective, full = _references(cfg, b, s)
    try:
        loss, grads, got, runs = _run(cfg, recompute_attention_core, b, s)
    except RecursionError:
        raise AssertionError(
            "calling the attention core recursed without end: the new forward calls core.forward, which is now "
            "itself. Keep the original first (plain = core.forward) and checkpoint that: "
            "core.forward = lambda q, k, v, plain=plain: checkpoint(plain, q, k, v, use_reentrant=False)") from None
    require_finite(loss, "the loss of the model with your recomputation")
    require_finite(grads, "the gradients of the model with your recomputation")
    assert abs(loss - loss0) <= 1e-6 * abs(loss0), (
        f"the loss changed ({loss:.6f} instead of {loss0:.6f}): recomputation must compute the same forward")
    for name, g0 in grads0.items():
        assert grads[name] is not None, (
            f"{name} gets no gradient: the recomputed attention must stay in the graph (no torch.no_grad, no "
            f".detach() on q, k, v); checkpoint(fn, q, k, v, use_reentrant=False) keeps it differentiable")
    for name, g0 in grads0.items():
        err = (grads[name] - g0).abs().max().item() / (g0.abs().max().item() or 1.0)
        assert err <= 1e-5, (f"the gradient of {name} differs from the model without recomputation by {err:.1e} "
                             f"(relative): recomputing must give the same gradients; pass the core's own inputs "
                             f"to checkpoint and return its output, under no torch.no_grad")
    if runs["again"]:
        named = f"{', '.join(runs['again'][:3])}{' ...' if len(runs['again']) > 3 else ''}"
        parts = {name.split(".")[2] for name in runs["again"] if name.count(".") >= 2}
        if runs["backward"] == 0:
            raise AssertionError(
                f"the attention core ran only in forward: nothing recomputes it in backward, while {named} ran "
                f"again - you checkpointed another part of the block. Selective recomputation checkpoints "
                f"block.attn.core_attention, the part whose s x s scores grow with s")
        whole = " (the whole block: that is full recomputation)" if {"attn", "mlp"} <= parts else ""
        raise AssertionError(
            f"{named} ran again in backward: you recompute more than the attention core{whole}. Selective "
            f"recomputation wraps only block.attn.core_attention, so the projections and the MLP keep their "
            f"activations and run once")
    # Eager attention's saved tensors are counted by storage address; a few temporaries freed during the
    # forward make the count vary by a few KiB from run to run, far less than one block's saving.
    per_block = (plain - selective) / cfg.layers
    slack = per_block / 4
    where = (f"one forward keeps {got:,} bytes; without recomputation {plain:,}, with the attention core of "
             f"each of the {cfg.layers} blocks recomputed {selective:,}")
    if abs(got - selective) <= slack:
        return
    if runs["backward"] == 0 and got < plain - slack:
        raise AssertionError(f"{where}, but the attention core ran only in forward: nothing recomputes it in "
                             f"backward, so the memory was saved elsewhere (the MLP?). Selective recomputation "
                             f"checkpoints block.attn.core_attention, the part whose s x s scores grow with s")
    if abs(got - plain) <= slack or got > plain:
        raise AssertionError(f"{where}: nothing was recomputed. Run each block's attn.core_attention forward "
                             f"under torch.utils.checkpoint so its s x s scores are not kept for backward")
    if got < selective:
        hint = " (the whole block: that is full recomputation)" if got <= (selective + full) / 2 else ""
        raise AssertionError(f"{where}: you recompute more than the attention core{hint}. Selective "
                             f"recomputation wraps only block.attn.core_attention, and keeps the MLP's activations")
    done = runs["backward"] if runs["backward"] < cfg.layers else round((plain - got) / per_block)
    raise AssertionError(f"{where}: {done} of {cfg.layers} blocks recompute their attention core; wrap "
                         f"the core of every block (model.layers.values())")
