"""Activation memory: what autograd keeps between forward and backward, per token.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models") count, per layer, sbh·(34 + 5as/h) bytes for a GPT block in 16-bit, and
show how tensor (/t) and sequence (/t for the rest) parallelism divide it. We do
the same count for OUR block (RMSNorm, RoPE, GQA through SDPA, SwiGLU, no
dropout), tensor by tensor, as `torch.autograd` saves it. With b the bytes of the
compute dtype, h hidden, kv = kv_heads·head_dim, f the FFN width, a heads:

  saved tensor                       bytes/token   region (who divides it)
  attn_norm (eager RMSNorm)          4h + 4 + 4h   norm: fp32 input, rstd, x·rstd
  attn_norm (fused RMSNorm)          b·h + 4       norm: input, rstd
  norm output (q/k/v input)          b·h           linear_in (all-gathered under SP)
  q, k after RoPE; v                 b(h + 2kv)    tp
  SDPA logsumexp                     4a            tp   (recomputed: selective)
  SDPA output                        b·h           tp   (recomputed: selective)
  (o_proj's input is a view of the SDPA output: attention runs on [b, s, heads, d] memory)
  mlp_norm, its output               as above
  SwiGLU gate, up, silu, product     4·b·f         tp   (GELU: 2·b·f)

RoPE saves nothing of its own (its cos/sin tables are buffers), and flash-style
SDPA (`_scaled_dot_product_flash_attention_for_cpu` on CPU, FlashAttention on
GPU) keeps the output and the logsumexp, never the s x s score matrix: the
5as/h term of Korthikanti is gone. Measured with the engine's ActivationMeter
(tests/test_plan_engine.py): the eager column is our engine, exactly.

The widths are the shape's: q is heads·head_dim wide, k and v kv_heads·head_dim
(Qwen3's 128-wide heads on hidden 2048 make q twice h), and the SDPA output
heads·v_head_dim. Per-head q/k norms (Qwen3) keep their inputs and one statistic
a head. Multi-head latent attention (DeepSeek-V3, shape.py) keeps its two
latents and their norms, replicated on every tensor-parallel rank, then q, k and
v decompressed per head (d + r, d + r and d_v wide): `_mla_terms`. An MoE model's
leading dense blocks keep a dense MLP's tensors (layer_terms(moe=False)); an MoE
block adds its shared expert's MLP to the routed experts'. DeepSeek-V3's own
storage (FP8 copies, norms and up-projections recomputed) is `_deepseek_terms`,
chosen by the framework (calibration.py, `deepseek`).

Regions: `tp` tensors live in the head / FFN-column shards (/tp); `norm` tensors
are the full-hidden ones that sequence parallelism cuts along the sequence
(/tp with SP, whole without); `linear_in` is the input of a column-parallel
linear: with SP it is all-gathered, and Megatron keeps only the shard (re-gather
in backward), others keep the gathered copy; `replicated` tensors are whole on every tp
rank (MLA's latents). Full recomputation keeps only each block's input; selective
recomputation drops the attention core (Megatron) or, under torchtitan's op-level policy,
keeps only the outputs of chosen ops (`op_policy_terms`).

Context parallelism cuts every token-wise tensor by cp (measured against the
engine, tests/test_context_parallel.py), with what each attention variant adds:
  ring, zigzag   nothing: the ring's autograd function keeps q, k, v, O and lse of the shard,
                 what SDPA keeps unsharded;
  allgather      K and V all-gathered over cp, kept for backward: b·2kv per token of the
                 whole sequence (/tp only) instead of the shard's (selective: recomputed);
  ulysses        the attention output is a copy after the all-to-all back (o_proj's input),
                 b·h per token besides the SDPA output (selective: only the copy survives);
and per micro-batch (not per layer or token of the batch) the RoPE cos and sin rows
of the shard's positions, gathered from the tables: 4·head_dim bytes per position.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ActivationSpec:
    """What the activation count depends on besides the shape."""

    act_bytes: int  # b: 2 in bf16, 4 in fp32
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    recompute: str = "none"
    cp_attention: str = "zigzag"  # allgather | ring | zigzag | ulysses (see the module docstring)
    kernels: str = "eager"  # eager: our engine as written; fused: fused norms, [b, s, heads, d] attention
    sp_keeps_gathered_input: bool = False
    # flash: the attention keeps its output and logsumexp (SDPA, FlashAttention); eager: it keeps the
    # s x s softmax (and, with dropout, its mask and output): Korthikanti's 5as/h term; math: SDPA's
    # math backend on a CPU, in fp32 (our engine where the CPU flash kernel cannot run the dtype).
    attention: str = "flash"
    dropout: bool = False  # dropout after attention and MLP keeps a 1-byte mask each (Megatron's GPT)
    fused_swiglu: bool = False  # a fused SwiGLU keeps gate, up and the product (3f), recomputing silu
    seq_len: int = 0  # keys each query sees, for eager attention's s x s tensors
    # What "selective" recomputation keeps: "attention" (Megatron's: everything but the attention
    # core) or "op" (torchtitan's op-level policy: the outputs of chosen ops, the rest replayed).
    selective: str = "attention"
    # DeepSeek-V3's low-precision storage (arXiv 2412.19437, sections 3.2.3 and 3.3): see _deepseek_terms.
    fp8_cache: bool = False  # linears' inputs kept in FP8, the attention output in E5M6, SwiGLU recomputed
    recompute_norms: bool = False  # RMSNorm outputs and MLA up-projections recomputed in backward


def _norm(shape, spec: ActivationSpec, width: int | None = None, rows: int = 1) -> list[tuple[str, float, str]]:
    """What a norm over `width` features (the hidden size unless given) keeps per token; `rows` norms
    per token (per-head q/k norms) keep one statistic each."""
    h, b = width or shape.hidden, spec.act_bytes
    if shape.norm == "layernorm":
        stats = 2 * (b if spec.kernels == "eager" else 4) * rows  # mean and rstd (the CPU kernel keeps them in dtype)
        return [("norm input", b * h, "norm"), ("norm mean/rstd", stats, "norm")]
    if spec.kernels == "eager":
        # F.rms_norm decomposed: upcast to fp32 (a copy in bf16, the input itself in fp32), rsqrt, x * rsqrt.
        return [("norm input (fp32)", 4 * h, "norm"), ("norm rstd", 4 * rows, "norm"),
                ("norm x*rstd (fp32)", 4 * h, "norm")]
    return [("norm input", b * h, "norm"), ("norm rstd", 4 * rows, "norm")]


def _in_region(terms, region: str) -> list[tuple[str, float, str]]:
    return [(n, v, region) for n, v, _ in terms]


def _mla_terms(shape, spec: ActivationSpec, kv_region: str) -> list[tuple[str, float, str]]:
    """Multi-head latent attention as training runs it (shape.py's docstring): the latents and their
    norms, replicated on every tensor-parallel rank; per head, the decompressed q and k (d + r wide,
    RoPE applied to the r part) and v, what the attention core keeps."""
    b, out = spec.act_bytes, []
    if shape.q_lora_rank:
        out += [("q latent " + n, v, r) for n, v, r in _in_region(_norm(shape, spec, shape.q_lora_rank), "replicated")]
        out.append(("q latent norm output", b * shape.q_lora_rank, "replicated"))
    out += [("kv latent " + n, v, r) for n, v, r in _in_region(_norm(shape, spec, shape.kv_lora_rank), "replicated")]
    out.append(("kv latent norm output", b * shape.kv_lora_rank, "replicated"))
    return out + [("q after RoPE", b * shape.q_dim, "tp"), ("k after RoPE", b * shape.k_dim, kv_region),
                  ("v", b * shape.v_dim, kv_region)]


def _attention_terms(shape, spec: ActivationSpec) -> list[tuple[str, float, str]]:
    h, b, a = shape.hidden, spec.act_bytes, shape.heads
    kv_region = "cp_gathered" if spec.cp > 1 and spec.cp_attention == "allgather" else "tp"
    out = [("attn_norm output", b * h, "linear_in")]
    if shape.is_mla:
        out += _mla_terms(shape, spec, kv_region)
    else:
        if shape.qk_norm:  # per-head RMSNorms of q and k before RoPE: their inputs and statistics
            out += [("q_norm " + n, v, r) for n, v, r in _in_region(_norm(shape, spec, shape.q_dim, a), "tp")]
            out += [("k_norm " + n, v, r)
                    for n, v, r in _in_region(_norm(shape, spec, shape.k_dim, shape.kv_heads), kv_region)]
        if spec.attention == "math":
            # SDPA's math backend on a CPU (the engine's kernel where torch's CPU flash kernel cannot run
            # the dtype, parallel/precision.py): it upcasts to fp32 and repeats k and v to every query head,
            # so its two matmuls keep the scaled q, k and v in fp32 at the query heads' width.
            out += [("q scaled (fp32, SDPA math)", 4 * shape.q_dim, "tp"),
                    ("k repeated to every head (fp32)", 4 * shape.q_dim, "tp"),
                    ("v repeated to every head (fp32)", 4 * shape.attn_out_dim, "tp")]
        else:
            out += [("q after RoPE", b * shape.q_dim, "tp"), ("k after RoPE", b * shape.k_dim, kv_region),
                    ("v", b * shape.v_dim, kv_region)]
    if spec.attention == "math":
        out.append(("attention softmax (fp32)", 4 * a * spec.seq_len, "tp"))  # the scores' softmax, every key
    elif spec.attention == "eager":
        # Per query token, one score per head and key: the softmax output (b), with dropout its
        # 1-byte mask and its output (b): 5·a·s bytes in 16-bit, all recomputed under selective.
        s = spec.seq_len
        out.append(("attention softmax", b * a * s, "tp"))
        if spec.dropout:
            out += [("attention dropout mask", a * s, "tp"), ("attention dropout output", b * a * s, "tp")]
    else:
        out.append(("SDPA logsumexp", 4 * a, "tp"))
    out.append(("SDPA output", b * shape.attn_out_dim, "tp"))
    return out


def _mlp_terms(spec: ActivationSpec, mlp: str, f: int, copies: int = 1) -> list[tuple[str, float, str]]:
    """An MLP of width f on `copies` copies of each token: SwiGLU keeps gate, up, silu(gate) and the
    product (fused: no silu), GELU its input and output."""
    if mlp == "swiglu":
        names = ("gate", "up", "silu*up") if spec.fused_swiglu else ("gate", "up", "silu(gate)", "silu*up")
    else:
        names = ("up", "gelu(up)")
    return [(n, copies * spec.act_bytes * f, "tp") for n in names]


def layer_terms(shape, spec: ActivationSpec, moe: bool | None = None) -> list[tuple[str, float, str]]:
    """(tensor, bytes per token, region) that one block saves without recomputation; moe: an MoE block
    or a dense one (None: the model's kind, its MoE blocks for an MoE model)."""
    moe = shape.is_moe if moe is None else moe
    if spec.fp8_cache or spec.recompute_norms:
        return _deepseek_terms(shape, spec, moe)
    h, b = shape.hidden, spec.act_bytes
    out = [("attn_norm " + n, v, r) for n, v, r in _norm(shape, spec)]
    out += _attention_terms(shape, spec)
    if spec.dropout:
        out.append(("attention residual dropout mask", h, "norm"))
    if spec.cp > 1 and spec.cp_attention == "ulysses":
        out.append(("Ulysses output, back in the sequence shard", b * shape.attn_out_dim, "tp"))
    out += [("mlp_norm " + n, v, r) for n, v, r in _norm(shape, spec)]
    out.append(("mlp_norm output", b * h, "linear_in"))
    if moe:
        out += _moe_terms(shape, spec)
    else:
        out += [(f"mlp {n}", v, r) for n, v, r in _mlp_terms(spec, shape.mlp, shape.ffn_hidden)]
    if spec.dropout:
        out.append(("mlp residual dropout mask", h, "norm"))
    return out


def _moe_terms(shape, spec):
    """Top-k routing as model/moe.py runs it (checked against the engine's meter in
    tests/test_expert_parallel.py). The router's input in fp32, router probabilities (fp32
    softmax, E per token), the top-k scores, their sum and the weights; each token is copied to
    k experts (the permuted expert inputs, b·h each; the expert outputs, b·h each, kept by the
    weighting; the weighted outputs, b·h each, kept by the index_add that
    combines them); each copy runs an expert MLP (4·b·f_e for SwiGLU); the routing's int64
    indices (four per copy) and keep mask; the shared expert's MLP on every token (its input is the
    mlp_norm output, counted above). Expert parallelism moves the copies between ranks but,
    balanced, each rank still processes k copies per local token: an unbalanced router puts more
    on the ranks of the popular experts, which this does not model."""
    b, h, k = spec.act_bytes, shape.hidden, shape.top_k
    out = [("router input in fp32 (a copy below fp32)", 0 if b == 4 else 4 * h, "norm"),
           ("router probabilities (fp32)", 4 * shape.experts, "norm"),
           ("top-k scores, their sum, weights", 4 * k + 4 + (0 if b == 4 else b * k), "norm"),
           ("expert inputs (dispatched copies)", k * b * h, "norm"),
           ("expert outputs (before weighting)", k * b * h, "norm"),
           ("weighted expert outputs (combine)", k * b * h, "norm"),
           ("routing indices (int64) and keep mask", 33 * k, "norm")]
    out += [(f"expert MLPs {n}", v, r) for n, v, r in _mlp_terms(spec, "swiglu", shape.expert_ffn, k)]
    if shape.shared_expert_ffn:
        out += [(f"shared expert {n}", v, r) for n, v, r in _mlp_terms(spec, "swiglu", shape.shared_expert_ffn)]
    return out


# FP8 with one fp32 scale per 128 elements (1 x 128 activation tiles): 1 + 4/128 bytes an element.
FP8 = 1 + 4 / 128
E5M6 = 1.5  # 12 bits: the attention output, which the attention's backward also reads


def _deepseek_terms(shape, spec: ActivationSpec, moe: bool) -> list[tuple[str, float, str]]:
    """DeepSeek-V3's training (arXiv 2412.19437):
    recompute_norms (section 3.2.3): every RMSNorm and MLA's up-projections run again in backward, so
      a norm keeps only its input (the residual stream, the latents) and q, k, v are rebuilt from the
      latents: no norm output, no decompressed q / k / v is kept;
    fp8_cache (section 3.3.1, Figure 6; 3.3.3): a linear keeps its input in FP8 (tile scales
      included); the attention output (o_proj's input, which the attention's backward reads too) in
      E5M6; an MLP keeps its SwiGLU inputs (gate, up) in FP8 and recomputes the SwiGLU output, which
      is down_proj's input, in backward; the routed experts' inputs are dispatched, and kept, in FP8.
      The router's weights are applied inside the SwiGLU (Megatron-Core's weighted SwiGLU for
      DeepEP), so the combine, a sum, keeps nothing. The same rules hold for the leading dense
      blocks' MLP (the report names the MoE's; the dense MLP runs the same FP8 linears).
    Either alone keeps the other's tensors as the standard count does."""
    b, h, k = spec.act_bytes, shape.hidden, shape.top_k
    lin = FP8 if spec.fp8_cache else b  # bytes per element of a kept linear input
    out = [("attn_norm input", b * h, "norm")]
    if not spec.recompute_norms:
        out += [("attn_norm rstd", 4, "norm"), ("attn_norm output", lin * h, "linear_in")]
    if shape.is_mla:
        if shape.q_lora_rank:
            out.append(("q latent", b * shape.q_lora_rank, "replicated"))
        out.append(("kv latent and RoPE key", b * (shape.kv_lora_rank + shape.qk_rope_head_dim), "replicated"))
        if not spec.recompute_norms:
            out += [("q latent norm output", lin * shape.q_lora_rank, "replicated"),
                    ("kv latent norm output", lin * shape.kv_lora_rank, "replicated")]
    if not (spec.recompute_norms and shape.is_mla):
        out += [("q after RoPE", b * shape.q_dim, "tp"), ("k after RoPE", b * shape.k_dim, "tp"),
                ("v", b * shape.v_dim, "tp")]
    out += [("SDPA logsumexp", 4 * shape.heads, "tp"),
            ("SDPA output", (E5M6 if spec.fp8_cache else b) * shape.attn_out_dim, "tp"),
            ("mlp_norm input", b * h, "norm")]
    if not spec.recompute_norms:
        out += [("mlp_norm rstd", 4, "norm"), ("mlp_norm output", lin * h, "linear_in")]

    def mlp(name, f, copies):
        if not spec.fp8_cache:
            return [(f"{name} {n}", v, r) for n, v, r in _mlp_terms(spec, "swiglu", f, copies)]
        return [(f"{name} gate, up (FP8)", copies * 2 * FP8 * f, "tp")]

    if not moe:
        return out + mlp("mlp", shape.ffn_hidden, 1)
    out += [("router probabilities and top-k (fp32)", 4 * shape.experts + 8 * k, "norm"),
            ("expert inputs (dispatched copies)", k * lin * h, "norm")]
    if not spec.fp8_cache:  # the standard count's expert outputs, kept by the weighting and the combine
        out.append(("expert outputs (before weighting)", k * b * h, "norm"))
    out += mlp("expert MLPs", shape.expert_ffn, k)
    if shape.shared_expert_ffn:
        out += mlp("shared expert", shape.shared_expert_ffn, 1)
    return out


def divisor(region: str, spec: ActivationSpec) -> int:
    sp = spec.sp and spec.tp > 1
    if region == "tp":
        return spec.tp * spec.cp
    if region == "cp_gathered":  # the whole sequence's, on every cp rank
        return spec.tp
    if region == "norm":
        return (spec.tp if sp else 1) * spec.cp
    if region == "tp_partial":  # a row-parallel output before its reduce-scatter: the full sequence of the group
        return spec.cp
    if region == "linear_in":
        return (spec.tp if sp and not spec.sp_keeps_gathered_input else 1) * spec.cp
    if region == "replicated":  # on every tensor-parallel rank whole (MLA's latents)
        return spec.cp
    raise ValueError(region)


def op_policy_terms(shape, spec: ActivationSpec) -> list[tuple[str, float, str]]:
    """What torchtitan's op-level selective checkpointing keeps of a block (its `op` policy,
    torchtitan/models/llama3/infra/parallelize.py, `_save_list`): the block's input (the
    checkpoint's argument), the attention kernel's output and log-sum-exp, and the output of every
    other matmul in call order (wq kept, wk replayed, wv kept, wo replayed, w1 kept, w3 replayed,
    w2 kept). Norms, RoPE, SiLU and the products are replayed in the backward."""
    h, kv, b, a, f = shape.hidden, shape.kv_dim, spec.act_bytes, shape.heads, shape.ffn_hidden
    return [("block input", b * h, "norm"), ("q (wq output)", b * h, "tp"), ("v (wv output)", b * kv, "tp"),
            ("SDPA output", b * h, "tp"), ("SDPA logsumexp", 4 * a, "tp"), ("w1 output", b * f, "tp"),
            # w2's output before the sequence-parallel reduce-scatter: every token of the tp group, all of h
            ("w2 output", b * h, "tp_partial")]


@functools.lru_cache(maxsize=65536)  # a search asks for the same few blocks hundreds of thousands of times
def layer_bytes(shape, spec: ActivationSpec, tokens: int, recompute: str | None = None,
                moe: bool | None = None) -> float:
    """Bytes one block keeps for `tokens` tokens of a micro-batch (before cp / tp division); moe: an MoE
    block or a dense one (None: the model's kind)."""
    recompute = spec.recompute if recompute is None else recompute
    if recompute == "full":
        # Only the block's input survives (the residual stream, in the compute dtype, SP-sharded).
        return tokens * spec.act_bytes * shape.hidden / divisor("norm", spec)
    if recompute == "selective" and spec.selective == "op" and not shape.is_moe:
        return sum(tokens * per_token / divisor(region, spec) for _, per_token, region in op_policy_terms(shape, spec))
    total = 0.0
    if recompute == "selective" and spec.attention == "math":
        # The core is recomputed whatever its kernel: what survives is its inputs, as under flash.
        spec = replace(spec, attention="flash")
    for name, per_token, region in layer_terms(shape, spec, moe):
        if recompute == "selective":
            # The attention core is recomputed: its logsumexp (and what a context-parallel core adds)
            # is not kept; its inputs, the shard's q, k, v, are; its output survives as the input
            # o_proj saves (a view of it, or the Ulysses copy).
            if name in ("SDPA logsumexp", "Ulysses output, back in the sequence shard", "attention softmax",
                        "attention dropout mask", "attention dropout output"):
                continue
            region = "tp" if region == "cp_gathered" else region
        total += tokens * per_token / divisor(region, spec)
    return total


def rope_bytes(shape, spec: ActivationSpec, seq_len: int) -> float:
    """Context parallelism: the cos and sin rows of the shard's positions (fp32, head_dim/2 each),
    gathered from the tables once per forward of a stage; without it they are views of the tables."""
    if spec.cp == 1:
        return 0.0
    rotated = shape.qk_rope_head_dim if shape.is_mla else shape.head_dim  # MLA: RoPE on its r-wide part only
    return 2 * 4 * rotated // 2 * seq_len / spec.cp


def embedding_bytes(tokens: int, spec: ActivationSpec) -> float:
    """What the embedding keeps (first pipeline stage): its int64 input ids; vocabulary-parallel
    (tp > 1), the ids local to its shard and a bool mask of the tokens outside it.
    (On CPU the engine's ids are a view of the step's [batch, s + 1] token windows, and the meter
    counts that whole storage: a few hundred bytes more than this, see docs/planner.md.)"""
    return tokens * (8 if spec.tp == 1 else 9) / spec.cp


def final_norm_bytes(shape, spec: ActivationSpec, tokens: int) -> float:
    """The final norm and its output (the head's input), on the last pipeline stage."""
    terms = _norm(shape, spec) + [("final norm output", spec.act_bytes * shape.hidden, "linear_in")]
    return sum(tokens * v / divisor(r, spec) for _, v, r in terms)


def padded_vocab(shape, tp: int) -> int:
    return -(-shape.vocab // tp) * tp


def loss_saved_bytes(shape, spec: ActivationSpec, tokens: int) -> float:
    """What the loss keeps for backward. One rank: F.cross_entropy's fp32 log-softmax, the int64
    targets and one fp32 scalar (the mean's weight). Vocabulary-parallel (tp > 1): the fp32 softmax
    of this rank's columns, the int64 local target indices and a bool mask of the targets it owns."""
    if spec.tp == 1:
        return tokens * (4 * shape.vocab + 8) / spec.cp + 4
    v = padded_vocab(shape, spec.tp) // spec.tp
    return tokens * (4 * v + 8 + 1) / spec.cp


def loss_transient_bytes(shape, spec: ActivationSpec, tokens: int) -> float:
    """Alive only while the loss runs: the logits in the compute dtype and, in bf16, their fp32 copy."""
    v = padded_vocab(shape, spec.tp) // spec.tp
    per_logit = spec.act_bytes + (4 if spec.act_bytes != 4 else 0)
    return tokens * per_logit * v / spec.cp
