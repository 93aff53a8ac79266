"""Checks of Part 1 (scaling basics): the parameter count of our Llama-style model, and
model FLOPs per token and MFU from a measured run.

Exercise 1 is checked against the real model: the parameters of `Transformer(cfg)`,
built on the meta device (no memory, so an 8B shape costs nothing), counted one
tensor at a time. Exercise 2 against the FLOPs written out here (6N + 12·L·h·s, N
every parameter) and the engine's own report of a short training run (its model
TFLOP/s), and against the MFU column of the playbook's benchmark runs.
"""

from __future__ import annotations

import csv
import os
from dataclasses import replace

from ultrascale.model import ModelConfig, get_preset
from ultrascale.series.checks import require_finite


def _configs():
    """Shapes that tell the mistakes apart: GQA and MHA, tied and untied, odd widths."""
    tiny = get_preset("tiny")
    return [
        tiny,
        get_preset("small"),
        replace(tiny, name="tiny-tied", tie_embeddings=True),
        replace(tiny, name="tiny-mha", kv_heads=8, ffn_hidden=96, layers=3),
        ModelConfig(name="odd", vocab_size=1000, hidden=96, layers=5, heads=12, kv_heads=2, ffn_hidden=256),
        get_preset("smollm-135m"),
        get_preset("llama3-8b"),
    ]


def model_numel(cfg: ModelConfig) -> int:
    """Parameters of the engine's model for cfg, counted on the real module (meta device)."""
    import torch

    from ultrascale.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


def _count(cfg, kv=None, mlp_mats=3, embeds=None, block_norms=True, final_norm=True):
    """Our count with one part changed (the mistakes a learner makes)."""
    h, f, L, v = cfg.hidden, cfg.ffn_hidden, cfg.layers, cfg.vocab_size
    kv = cfg.kv_heads * (h // cfg.heads) if kv is None else kv
    embeds = (1 if cfg.tie_embeddings else 2) if embeds is None else embeds
    block = 2 * h * h + 2 * h * kv + mlp_mats * h * f + (2 * h if block_norms else 0)
    return embeds * v * h + L * block + (h if final_norm else 0)


def _parts(cfg) -> str:
    h, f, L, v = cfg.hidden, cfg.ffn_hidden, cfg.layers, cfg.vocab_size
    kv = cfg.kv_heads * (h // cfg.heads)
    embeds = 1 if cfg.tie_embeddings else 2
    return (f"the model holds: embedding{'s' if embeds == 2 else ''} {embeds * v * h:,}; per block attention "
            f"{2 * h * h + 2 * h * kv:,}, MLP {3 * h * f:,}, norms {2 * h:,} (x{L} blocks); final norm {h:,}")


def exercise_1(count_params_llama):
    """count_params_llama(cfg) -> int, the parameters of Transformer(cfg), for several shapes."""
    for cfg in _configs():
        got = count_params_llama(cfg)
        require_finite(got, f"your count for {cfg.name}")
        want = model_numel(cfg)
        assert isinstance(got, int) or (hasattr(got, "is_integer") and float(got).is_integer()), (
            f"return a whole number of parameters (an int), got {got!r} for {cfg.name}")
        got = int(got)
        if got == want:
            continue
        h, L, v = cfg.hidden, cfg.layers, cfg.vocab_size
        where = f"for {cfg.name} (h={h}, L={L}, heads={cfg.heads}, kv_heads={cfg.kv_heads}, f={cfg.ffn_hidden}, " \
                f"v={v}, tied={cfg.tie_embeddings}) you count {got:,}, the model has {want:,}"
        if cfg.kv_heads != cfg.heads and got == _count(cfg, kv=h):
            raise AssertionError(
                f"{where}: you counted k_proj and v_proj as h x h. With grouped-query attention they are "
                f"h x (kv_heads * head_dim) = {h} x {cfg.kv_heads * (h // cfg.heads)}: "
                f"kv_heads of head_dim = hidden / heads each")
        if got == _count(cfg, mlp_mats=2):
            raise AssertionError(
                f"{where}: you counted 2 MLP matrices. SwiGLU has three h x f matrices: gate_proj, up_proj "
                f"and down_proj (down(silu(gate(x)) * up(x)))")
        if got == _count(cfg, embeds=2 if cfg.tie_embeddings else 1):
            fix = ("with tied embeddings the output head is the embedding matrix itself: count v x h once"
                   if cfg.tie_embeddings else
                   "this model has its own output head (tie_embeddings=False): v x h for the embedding and "
                   "v x h again for the head")
            raise AssertionError(f"{where}: {fix}")
        if got == _count(cfg, block_norms=False, final_norm=False):
            raise AssertionError(
                f"{where}: the RMSNorm weights are missing: two norms per block (attn_norm, mlp_norm), h "
                f"each, and the final norm, h")
        if got == _count(cfg, final_norm=False):
            raise AssertionError(f"{where}: the final norm (h = {h} weights, before the head) is missing")
        if got == _count(cfg, block_norms=False):
            raise AssertionError(f"{where}: the two norms of each block (attn_norm and mlp_norm, h each) "
                                 f"are missing")
        if got in (h * v + L * (12 * h * h + 13 * h) + 2 * h, 2 * h * v + L * (12 * h * h + 13 * h) + 2 * h):
            raise AssertionError(
                f"{where}: that is the playbook's GPT formula (12h² + 13h per layer: 4h MLP, biases, "
                f"LayerNorm). Our block is Llama-style: GQA k/v, a SwiGLU MLP of width f, no biases, RMSNorm")
        raise AssertionError(f"{where} ({got - want:+,}); {_parts(cfg)}")


# -- exercise 2 --------------------------------------------------------------
def _flops(cfg, s, n=None, attn=12, fb=6):
    from ultrascale.model import count_params

    n = count_params(cfg) if n is None else n
    return fb * n + attn * cfg.layers * cfg.hidden * s


_RUN = {}


def measured_run():
    """A 3-step fp32 training run of the tiny model on this CPU (once per process): its last
    step's metrics (tokens_per_s, and the model TFLOP/s the trainer itself reports)."""
    if "m" not in _RUN:
        from ultrascale.config import RunConfig, TrainConfig
        from ultrascale.testing.compare import train_single

        cfg = RunConfig(model=get_preset("tiny"), train=TrainConfig(steps=3, seq_len=64, micro_batch=8,
                                                                    progress=False, measure_activations=False))
        _RUN["cfg"], _RUN["m"] = cfg, train_single(cfg).metrics[-1]
    return _RUN["cfg"], _RUN["m"]


def playbook_runs():
    """The playbook's best 8B benchmark runs (MFU of 43% and more): (tokens/s/GPU, MFU %)."""
    import ultrascale.plan

    path = os.path.join(os.path.dirname(ultrascale.plan.__file__), "data", "playbook_benchmarks.csv")
    with open(path, newline="") as f:
        return [(float(r["tokens_per_s_per_gpu"]), float(r["mfu_pct"])) for r in csv.DictReader(f)
                if r["model"] == "8B" and r["status"] == "ok" and float(r["mfu_pct"]) >= 43]


def _pair(out, what):
    assert isinstance(out, tuple) and len(out) == 2, (
        f"return a pair (flops_per_token, mfu), got {type(out).__name__} for {what}")
    pair = float(out[0]), float(out[1])
    require_finite(pair, f"(flops_per_token, mfu) for {what}")
    return pair


def exercise_2(model_flops_and_mfu):
    """model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops) -> (training FLOPs per token, MFU)."""
    from ultrascale.model import count_params

    for cfg, s in ((get_preset("tiny"), 64), (get_preset("tiny"), 256), (get_preset("llama3-8b"), 4096),
                   (get_preset("8b"), 4096), (get_preset("smollm-135m"), 2048)):
        got, _ = _pair(model_flops_and_mfu(cfg, s, 1000.0, 1e12), cfg.name)
        want = _flops(cfg, s)
        if abs(got - want) <= 1e-6 * want:
            continue
        n, L, h = count_params(cfg), cfg.layers, cfg.hidden
        where = f"{cfg.name} at seq_len {s}: you say {got:,.0f} FLOPs per token, the model does {want:,.0f}"
        if abs(got - _flops(cfg, s, fb=2, attn=4)) <= 1e-6 * want or abs(got - _flops(cfg, s, fb=2, attn=0)) < 1:
            raise AssertionError(f"{where}: that is the forward pass only (2N). Training also runs backward, "
                                 f"twice the forward's FLOPs (gradients of inputs and of weights): 2N + 4N = 6N, "
                                 f"and 3x the attention's forward term")
        if abs(got - _flops(cfg, s, attn=0)) < 1:
            raise AssertionError(f"{where}: 6N counts the weights' matmuls only; add the attention term "
                                 f"12·L·h·s (QK^T and AV, forward and backward), {12 * L * h * s:,} here")
        emb = cfg.vocab_size * h
        if any(abs(got - _flops(cfg, s, n=n - k * emb)) < 1 for k in (1, 2)):
            raise AssertionError(f"{where}: N is every parameter, embeddings included, as the playbook and the "
                                 f"engine count it (N = {n:,} here)")
        attn = got - 6 * n
        if L * h * s and attn > 0:
            raise AssertionError(
                f"{where}: 6N = {6 * n:,} is right but your attention term is {attn / (L * h * s):.3g}·L·h·s, "
                f"not 12·L·h·s: per token and layer QK^T and AV cost 2·s·h FLOPs each in forward (4·s·h), "
                f"and backward twice that")
        raise AssertionError(f"{where}: training FLOPs per token are 6N + 12·L·h·s with N = {n:,} parameters")

    cfg, m = measured_run()
    peak = 1e11  # a given peak: 100 GFLOP/s
    fpt, got = _pair(model_flops_and_mfu(cfg.model, cfg.train.seq_len, m["tokens_per_s"], peak), "the measured run")
    want = m["tflops"] * 1e12 / peak  # the trainer's own figure of model FLOP/s, over the peak
    where = (f"for the measured run ({m['tokens_per_s']:,.0f} tokens/s, peak {peak:.0e} FLOP/s) your MFU is "
             f"{got:.4g}, it is {want:.4g}")
    if not abs(got - want) <= 1e-6 * want:  # `not <=`: a NaN is off too
        if abs(got - 100 * want) <= 1e-4 * want:
            raise AssertionError(f"{where}: return MFU as a fraction (0.43), not a percentage (43)")
        if abs(got - want / 1e12) <= 1e-6 * want / 1e12 or abs(got - want * 1e12) <= 1e-6 * want * 1e12:
            raise AssertionError(f"{where}: peak_flops is in FLOP/s, as tokens/s x FLOPs/token is: no TFLOP "
                                 f"conversion is needed")
        if abs(got - 1 / want) <= 1e-6 / want:
            raise AssertionError(f"{where}: MFU is achieved over peak: tokens/s x FLOPs per token / peak_flops")
        raise AssertionError(f"{where}: MFU = tokens_per_s x flops_per_token / peak_flops")
    for tps, pct in playbook_runs():
        _, got = _pair(model_flops_and_mfu(get_preset("8b"), 4096, tps, 989.5e12), "the playbook's 8B run")
        assert abs(100 * got - pct) <= 0.06, (
            f"the playbook's 8B run at {tps:,.0f} tokens/s/GPU on an H100 (989.5 dense bf16 TFLOP/s) "
            f"reports MFU {pct}%; yours gives {100 * got:.2f}%")
