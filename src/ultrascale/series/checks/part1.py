"""Checks of Part 1 (scaling basics): the parameter count of our Llama-style model, and
model FLOPs per token and MFU from a measured run.

Exercise 1 is checked against the real model: the parameters of `Transformer(cfg)`,
built on the meta device (no memory, so an 8B shape costs nothing), counted one
tensor at a time. The count must come from the shape: an answer that asks the engine
(count_params, or the model itself) is named, since that is what it is compared with.
Exercise 2 against the FLOPs written out here (6N + 12·L·h·s, N every parameter) and
the engine's own report of a short training run (its model TFLOP/s), and against the
MFU column of the playbook's benchmark runs.
"""

from __future__ import annotations

import csv
import functools
import os
import types
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


def uses(fn, banned: dict) -> str | None:
    """The first of `banned` ({name: object}) that fn reaches: a global it reads that is one of the
    objects, or a name it imports in its body; followed into the notebook's own functions it calls
    (a helper of the notebook that measures the model is the same shortcut)."""
    from ultrascale.series.ranks import _names_used

    objects = {id(obj): name for name, obj in banned.items()}
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code is None or f in seen:
            continue
        seen.add(f)
        for name in sorted(_names_used(code)):
            if name not in f.__globals__:
                continue
            value = f.__globals__[name]
            if id(value) in objects:
                return objects[id(value)]
            if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
                todo.append(value)
        codes = [code]
        while codes:  # names imported inside the body: `from ultrascale.model import count_params`
            c = codes.pop()
            hit = next((n for n in c.co_names if n in banned), None)
            if hit:
                return hit
            codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return None


@functools.lru_cache(maxsize=None)
def model_numel(cfg: ModelConfig) -> int:
    """Parameters of the engine's model for cfg, counted on the real module (meta device)."""
    import torch

    from ultrascale.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


def _count(cfg, kv=None, mlp_mats=3, embeds=None, block_norms=2, final_norm=True, f=None, layers=None,
           biases=False):
    """Our count with one part changed (the mistakes a learner makes)."""
    h, v = cfg.hidden, cfg.vocab_size
    f = cfg.ffn_hidden if f is None else f
    L = cfg.layers if layers is None else layers
    kv = cfg.kv_heads * (h // cfg.heads) if kv is None else kv
    embeds = (1 if cfg.tie_embeddings else 2) if embeds is None else embeds
    block = 2 * h * h + 2 * h * kv + mlp_mats * h * f + block_norms * h
    if biases:  # one per output of q, k, v, o, gate, up and down
        block += 2 * h + 2 * kv + 2 * f + h
    return embeds * v * h + L * block + (h if final_norm else 0)


def _banned_for_count():
    from ultrascale.model import build_model, count_params
    from ultrascale.model.transformer import Transformer

    return {"count_params": count_params, "Transformer": Transformer, "build_model": build_model,
            "model_numel": model_numel}


def _parts(cfg) -> str:
    h, f, L, v = cfg.hidden, cfg.ffn_hidden, cfg.layers, cfg.vocab_size
    kv = cfg.kv_heads * (h // cfg.heads)
    embeds = 1 if cfg.tie_embeddings else 2
    return (f"the model holds: embedding{'s' if embeds == 2 else ''} {embeds * v * h:,}; per block attention "
            f"{2 * h * h + 2 * h * kv:,}, MLP {3 * h * f:,}, norms {2 * h:,} (x{L} blocks); final norm {h:,}")


def exercise_1(count_params_llama):
    """count_params_llama(cfg) -> int, the parameters of Transformer(cfg), for several shapes."""
    shortcut = uses(count_params_llama, _banned_for_count())
    if shortcut:
        raise AssertionError(
            f"count_params_llama asks the engine for the answer ({shortcut}): that is the count the check compares "
            f"with, not a count from the shape. Add up the matrices of one block (attention, MLP, norms), times L, "
            f"then the embedding, the head and the final norm, from cfg's fields alone")
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
        head_dim = h // cfg.heads
        if cfg.kv_heads * head_dim != cfg.kv_heads and got == _count(cfg, kv=cfg.kv_heads):
            raise AssertionError(
                f"{where}: you took k_proj and v_proj as h x kv_heads. Each of the kv_heads has head_dim = "
                f"hidden / heads = {head_dim} columns: they are h x (kv_heads * head_dim) = {h} x "
                f"{cfg.kv_heads * head_dim}")
        if cfg.ffn_hidden != 4 * h and got == _count(cfg, f=4 * h):
            raise AssertionError(
                f"{where}: you took the MLP as 4h wide (GPT's). Our SwiGLU's width is cfg.ffn_hidden = "
                f"{cfg.ffn_hidden}: three h x f matrices")
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
        if got == _count(cfg, block_norms=1):
            raise AssertionError(f"{where}: each block has two RMSNorms, attn_norm before attention and mlp_norm "
                                 f"before the MLP, h weights each: 2h per block")
        if got == _count(cfg, biases=True):
            raise AssertionError(f"{where}: you counted biases. The Llama-style block has none: every Linear is "
                                 f"bias=False, so each matrix is its weights alone")
        if got in (_count(cfg, layers=L - 1), _count(cfg, layers=L + 1)):
            raise AssertionError(f"{where}: that is {'one block too few' if got < want else 'one block too many'}: "
                                 f"the model has cfg.layers = {L} blocks")
        if got == _count(cfg, block_norms=0, final_norm=False):
            raise AssertionError(
                f"{where}: the RMSNorm weights are missing: two norms per block (attn_norm, mlp_norm), h "
                f"each, and the final norm, h")
        if got == _count(cfg, final_norm=False):
            raise AssertionError(f"{where}: the final norm (h = {h} weights, before the head) is missing")
        if got == _count(cfg, block_norms=0):
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


@functools.lru_cache(maxsize=None)
def measured_run():
    """A 3-step fp32 training run of the tiny model on this CPU (once per process): its last
    step's metrics (tokens_per_s, and the model TFLOP/s the trainer itself reports)."""
    from ultrascale.config import RunConfig, TrainConfig
    from ultrascale.testing.compare import train_single

    cfg = RunConfig(model=get_preset("tiny"), train=TrainConfig(steps=3, seq_len=64, micro_batch=8,
                                                                progress=False, measure_activations=False))
    return cfg, train_single(cfg).metrics[-1]


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
        if abs(got - s * want) <= 1e-6 * s * want:
            raise AssertionError(f"{where}: that is per sequence of {s} tokens; the playbook counts FLOPs per "
                                 f"token (6N + 12·L·h·s), so that tokens/s x FLOPs per token is FLOP/s")
        if s != cfg.max_seq_len and abs(got - _flops(cfg, cfg.max_seq_len)) <= 1e-6 * want:
            raise AssertionError(f"{where}: your attention term uses cfg.max_seq_len = {cfg.max_seq_len}; "
                                 f"the run's sequence length is seq_len = {s}: each token attends to the "
                                 f"tokens of its own sequence")
        if abs(got - (6 * n + 12 * L * h * s * s)) <= 1e-6 * want:
            raise AssertionError(f"{where}: your attention term is 12·L·h·s², the FLOPs of a whole sequence's "
                                 f"attention; per token it is 12·L·h·s (each token's query against s keys)")
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
        own = m["tokens_per_s"] * fpt / peak  # the MFU of the FLOPs per token the learner returned
        if abs(got - own) > 1e-6 * own and abs(fpt - _flops(cfg.model, cfg.train.seq_len)) <= 1e-6 * fpt:
            counted = got * peak / m["tokens_per_s"]
            raise AssertionError(
                f"{where}: your flops_per_token ({fpt:,.0f}) is right, but your MFU counts {counted:,.0f} FLOPs "
                f"per token: compute the MFU from the same flops_per_token you return, attention term included")
        raise AssertionError(f"{where}: MFU = tokens_per_s x flops_per_token / peak_flops")
    for tps, pct in playbook_runs():
        _, got = _pair(model_flops_and_mfu(get_preset("8b"), 4096, tps, 989.5e12), "the playbook's 8B run")
        assert abs(100 * got - pct) <= 0.06, (
            f"the playbook's 8B run at {tps:,.0f} tokens/s/GPU on an H100 (989.5 dense bf16 TFLOP/s) "
            f"reports MFU {pct}%; yours gives {100 * got:.2f}%")
    mfu = m["tokens_per_s"] * fpt / peak
    print(f"Your formula on the check's run of the tiny model (seq_len {cfg.train.seq_len}): {fpt:,.0f} FLOPs per "
          f"token x {m['tokens_per_s']:,.0f} tokens/s = {mfu * peak / 1e9:.2f} GFLOP/s, MFU {mfu:.1%} of a "
          f"{peak / 1e9:.0f} GFLOP/s peak, as the trainer reports it.")
