"""Memory-bound passes: the bytes that kernels which do no matmul move through HBM.

A block's matmuls are timed by their FLOPs (time.py); the elementwise work between them is
timed by its traffic, bytes / HBM bandwidth. Two things change that traffic and nothing
else models them:

Eager against fused kernels. An eager RMSNorm as torchtitan writes its Llama (x.float(),
pow(2), mean, rsqrt, x·rstd, type_as, ·weight) runs one kernel per op, each reading its inputs
and writing its output, and autograd runs one or two per op backward; fused (torch.compile,
Megatron's, Apex's) it reads x once and writes once. EAGER below is what those kernels move,
forward and backward, per element of the op's input and by the activation dtype's bytes:
counted op by op from the kernels themselves (tests/test_plan_passes.py runs the same code
under a dispatch mode that adds up each aten op's tensors and must find these figures). FUSED
is one kernel each way: every input read once, every output written once (backward: the
gradient and the saved inputs read, the input gradients written).

  op              the code                                      per element of
  rmsnorm         torchtitan's RMSNorm (fp32 inside)            each norm's input (h)
  rope            torchtitan's complex RoPE (fp32 inside)       q and k
  swiglu          silu(gate) · up                               the gate (f)
  gelu            gelu(a + bias)                                a (f)
  cross_entropy   cross_entropy(logits.float())                 the logits (vocabulary, / tp)

A framework's time constants are set on its own kernels (Framework.kernels_timed), so a run on
other kernels adds (or saves) only the difference, at the card's HBM bandwidth (a kernel reaches
less than the datasheet's rate: this is the least eager can cost). Full recomputation runs the
forward's share again.

Float8 casts. A float8 linear (torchao's Float8Linear, tensorwise scaling) casts its input
forward and its output's gradient backward, and its weight once per micro-batch: each cast reads
the tensor twice (its amax, then the scaled cast: a tensorwise scale needs the whole tensor's
amax first) and writes one byte, and the backward's transposed copy reads and writes one byte
more: 2b + 3 bytes per element. What the FP8 tensor cores save on a GEMM these passes spend
again; a small GEMM saves less than its casts cost.
"""

from __future__ import annotations

# (forward, backward) bytes per element, by the activation dtype's bytes (2: bf16, 4: fp32).
EAGER = {
    "rmsnorm": {2: (36, 96), 4: (28, 96)},
    "rope": {2: (20, 20), 4: (8, 8)},
    "swiglu": {2: (10, 18), 4: (20, 36)},
    "gelu": {2: (8, 8), 4: (16, 16)},
    "cross_entropy": {2: (18, 26), 4: (12, 20)},
}


def fused(op: str, b: int) -> tuple[int, int]:
    """One kernel each way: (inputs + output, gradient + saved inputs + input gradients) x b."""
    return {"rmsnorm": (2 * b, 3 * b), "rope": (2 * b, 2 * b), "swiglu": (3 * b, 5 * b),
            "gelu": (2 * b, 3 * b), "cross_entropy": (b, 2 * b)}[op]


def _extra(op: str, b: int) -> tuple[float, float]:
    """(forward, backward) bytes per element that the eager kernels move beyond the fused one."""
    (ef, eb), (ff, fb) = EAGER[op][b], fused(op, b)
    return ef - ff, eb - fb


def eager_bytes(shape, lay, b: int) -> tuple[float, float]:
    """(forward, backward) bytes per token per block that eager kernels move beyond fused ones on one
    rank (divided by tp like the blocks' work): two norms (and Qwen3's per-head q/k norms), RoPE on q
    and k, the MLP's activation over its width (an MoE block: top_k experts' and the shared expert's)."""
    norms = 2 * shape.hidden + (shape.q_dim + shape.k_dim if shape.qk_norm else 0)
    width = (shape.top_k * shape.expert_ffn + shape.shared_expert_ffn) if shape.is_moe else shape.ffn_hidden
    fwd = bwd = 0.0
    for op, n in (("rmsnorm", norms), ("rope", shape.q_dim + shape.k_dim),
                  ("swiglu" if shape.mlp == "swiglu" else "gelu", width)):
        f, g = _extra(op, b)
        fwd, bwd = fwd + n * f, bwd + n * g
    return fwd / lay.tp, bwd / lay.tp


def eager_head_bytes(shape, lay, b: int) -> float:
    """Per token, what an eager fp32 cross-entropy over the vocabulary moves beyond a fused one, both ways."""
    return shape.vocab * sum(_extra("cross_entropy", b)) / lay.tp


def cast_elements(shape) -> tuple[int, int]:
    """(per token, per micro-batch) elements a block's float8 linears cast: each linear's input and its
    output's gradient (k + n for a k x n linear, every token), and its weight (k·n, once)."""
    h, q, k, v, o = shape.hidden, shape.q_dim, shape.k_dim, shape.v_dim, shape.attn_out_dim
    attn = 3 * h + q + k + v + o + h  # q, k, v from h; o from the attention's output to h
    weights = h * (q + k + v) + o * h

    def mlp(f):
        legs = 3 if shape.mlp == "swiglu" else 2  # gate and up from h, down back; or up and down
        return (legs - 1) * (h + f) + (f + h), legs * h * f

    if shape.is_moe:
        tokens, w = mlp(shape.expert_ffn)
        per_token = attn + shape.top_k * tokens
        weights += shape.experts * w
        if shape.shared_expert_ffn:
            st, sw = mlp(shape.shared_expert_ffn)
            per_token, weights = per_token + st, weights + sw
    else:
        tokens, w = mlp(shape.ffn_hidden)
        per_token, weights = attn + tokens, weights + w
    return per_token, weights


def cast_bytes(shape, lay, b: int, n_blocks: int, tokens: int) -> float:
    """Bytes one rank's float8 casts move in one micro-batch of `tokens` over `n_blocks` blocks: the
    activations' and gradients' casts divided by tp·cp like the blocks' work, the weights' by tp (an
    expert's weights by ep too)."""
    per_token, weights = cast_elements(shape)
    if shape.is_moe:
        weights = weights / lay.ep
    return (2 * b + 3) * n_blocks * (tokens * per_token / (lay.tp * lay.cp) + weights / lay.tp)
