"""Attention on one block of keys, with its log-sum-exp; the merge of blocks; the backward of a block.

Context parallelism never has all of a query's keys in one place, so attention
is computed block by block and the partial results are combined exactly. For
queries Q [b, H, m, d] and one block of keys and values K, V [b, KV, n, d]
(GQA: KV divides H, query head j reads key head j // (H / KV)):

  S = Q K^T / sqrt(d)              masked: full, or diagonal-causal (the block on the diagonal)
  lse = log sum_j exp(S_ij)        per query row, fp32
  O = exp(S - lse) V               that block's softmax-weighted values

Two blocks over disjoint keys merge without ever forming the whole row
(the numerically stable form, in fp32):

  lse = log(exp(lse1) + exp(lse2)) = max + log(exp(lse1 - max) + exp(lse2 - max))
  O   = exp(lse1 - lse) O1 + exp(lse2 - lse) O2

Backward, as flash attention does it: with the rows' final O, lse and dO, each
block's gradients come from that block alone (its probabilities are
exp(S - lse) with the *global* lse):

  D = rowsum(dO ∘ O);  P = exp(S - lse);  dV = P^T dO;  dP = dO V^T;
  dS = P ∘ (dP - D);   dQ = dS K / sqrt(d);  dK = dS^T Q / sqrt(d)

So a fused attention kernel that returns lse in forward, and takes (O, lse) in
backward, computes a block exactly: handed the final O and global lse instead of
the block's own, its backward is the block's share of the whole row's gradient
(what torch's own ring attention does with the CUDA kernels). On the CPU that
kernel is `_scaled_dot_product_flash_attention_for_cpu` and its backward: tiled,
so no m x n score matrix is ever built, and GQA read in place (no repeated K/V).
On CUDA the forward takes the memory-efficient kernel (it returns lse) and the
backward the math below; the math is also the fallback where no kernel runs (or
where torch's CPU kernel would fail on this machine), and the formulas above written
out for a reader.

The variants differ only in where the key blocks come from (a ring, an
all-gather); they all call `attend` and `attend_backward` here. Under the causal
mask the sequence is cut into equal chunks, and a (query chunk, key chunk) pair
is computed fully (an earlier key chunk), under the diagonal mask (the same
chunk), or skipped (a later one). Neighbouring full pairs that lie next to each
other in memory are joined into one kernel call (zig-zag's two query chunks on
one earlier key chunk, or one query chunk on both chunks of an earlier block):
fewer calls and fewer merges for the same work.
"""

from __future__ import annotations

import collections

import torch

from ultrascale.parallel.precision import flash_attention_fails_here

# (query, key) score elements computed per rank, forward and backward: the attention work.
WORK: collections.Counter = collections.Counter()

_CPU_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def chunk_pairs(q_chunks, k_chunks):
    """(i, j, causal) for the pairs of query chunk q_chunks[i] and key chunk k_chunks[j]
    (global chunk indices) that a causal model computes."""
    for i, a in enumerate(q_chunks):
        for j, c in enumerate(k_chunks):
            if c < a:
                yield i, j, False
            elif c == a:
                yield i, j, True
            # c > a: keys after every query of the chunk, masked out entirely: skipped


def joined_pairs(q_chunks, k_chunks):
    """chunk_pairs as kernel calls: (query chunks i0..i1, key chunks j0..j1, causal), half-open,
    where full pairs adjacent in storage are joined into one rectangle. Causal pairs stay alone."""
    runs = []  # per query chunk, its full pairs as runs of consecutive key chunks
    for i, j, causal in chunk_pairs(q_chunks, k_chunks):
        if causal:
            yield i, i + 1, j, j + 1, True
        elif runs and runs[-1][0] == i and runs[-1][3] == j:
            runs[-1][3] = j + 1
        else:
            runs.append([i, i + 1, j, j + 1])
    joined = []
    for i0, i1, j0, j1 in runs:  # the same key run for the next query chunk: one taller rectangle
        if joined and joined[-1][1] == i0 and joined[-1][2:] == [j0, j1]:
            joined[-1][1] = i1
        else:
            joined.append([i0, i1, j0, j1])
    for i0, i1, j0, j1 in joined:
        yield i0, i1, j0, j1, False


def _grouped(x, kv_heads):
    """[b, H, m, ...] -> [b, KV, H/KV, m, ...]: the query heads that share one key head, together."""
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _scores(q, k, causal: bool, scale: float):
    """S in fp32, [b, KV, H/KV, m, n]: the scaled scores, -inf above the diagonal if causal."""
    s = _grouped(q.float() * scale, k.shape[1]) @ k.float().unsqueeze(2).transpose(-1, -2)
    if causal:
        m, n = s.shape[-2:]
        s.masked_fill_(torch.ones(m, n, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def _forward_math(q, k, v, causal, scale):
    p = _scores(q, k, causal, scale)
    row_max = p.amax(dim=-1, keepdim=True)
    p.sub_(row_max).exp_()
    row_sum = p.sum(dim=-1, keepdim=True)
    out = (p @ v.float().unsqueeze(2)).div_(row_sum)
    lse = (row_max + row_sum.log()).squeeze(-1)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _backward_math(q, k, v, dout, out, lse, causal, scale):
    kv_heads = k.shape[1]
    delta = (dout.float() * out.float()).sum(-1)
    p = _scores(q, k, causal, scale).sub_(_grouped(lse, kv_heads).unsqueeze(-1)).exp_()  # P, in place of S
    do = _grouped(dout.float(), kv_heads)
    dv = (p.transpose(-1, -2) @ do).sum(2)
    ds = (do @ v.float().unsqueeze(2).transpose(-1, -2)).sub_(_grouped(delta, kv_heads).unsqueeze(-1)).mul_(p)
    dq = (ds @ k.float().unsqueeze(2)).flatten(1, 2).mul_(scale)
    dk = (ds.transpose(-1, -2) @ _grouped(q.float(), kv_heads)).sum(2).mul_(scale)
    return dq, dk, dv


def _forward_cuda(q, k, v, causal, scale):
    """Memory-efficient attention with its log-sum-exp (fp32/fp16/bf16 on CUDA); None where it cannot run."""
    kernel = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
    if kernel is None:
        return None
    group = q.shape[1] // k.shape[1]
    if group > 1:  # the kernel wants as many key heads as query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    try:
        out, lse = kernel(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    except RuntimeError:  # no kernel for this shape or dtype on this GPU
        return None
    return out.float(), lse[..., : q.shape[2]].float()  # some versions pad lse's rows to a multiple of 32


def _cpu_kernel(q, kernel) -> bool:
    """Whether to call torch's CPU flash kernel: it exists, and it can run q's dtype here (bf16 on a
    CPU with AMX stops in the kernel when ATen runs below AVX512: see precision.py)."""
    return q.device.type == "cpu" and kernel is not None and not flash_attention_fails_here(q.dtype)


def block_forward(q, k, v, causal: bool, scale: float):
    """(O, lse) of queries q against one key block: O [b, H, m, d] (fp32, or q's dtype from the
    CPU kernel: the merge accumulates in fp32 either way), lse [b, H, m] fp32."""
    if _cpu_kernel(q, _CPU_FORWARD):
        return _CPU_FORWARD(q, k, v, 0.0, causal, scale=scale)
    if q.is_cuda:
        result = _forward_cuda(q, k, v, causal, scale)
        if result is not None:
            return result
    return _forward_math(q, k, v, causal, scale)


def block_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    """(dQ, dK, dV) of one block from the rows' final O [b, H, m, d] and global lse [b, H, m]
    (dQ for q's rows, dK and dV for this key block; q's dtype from the CPU kernel, else fp32)."""
    if _cpu_kernel(q, _CPU_BACKWARD):
        return _CPU_BACKWARD(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    return _backward_math(q, k, v, dout, out, lse, causal, scale)


def merge(out, lse, block_out, block_lse) -> None:
    """In place: (out, lse) <- the exact combination of (out, lse) with one more block's result."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(torch.exp(block_lse - new).unsqueeze(-1) * block_out)
    lse.copy_(new)


def _slices(q, k, q_chunks, k_chunks):
    cq, ck = q.shape[2] // len(q_chunks), k.shape[2] // len(k_chunks)
    for i0, i1, j0, j1, causal in joined_pairs(q_chunks, k_chunks):
        yield slice(i0 * cq, i1 * cq), slice(j0 * ck, j1 * ck), causal


def attend(q, k, v, q_chunks, k_chunks, out, lse, scale: float) -> None:
    """Merge into (out, lse) the attention of q (holding q_chunks) on k, v (holding k_chunks)."""
    for qs, ks, causal in _slices(q, k, q_chunks, k_chunks):
        block_out, block_lse = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal, scale)
        WORK["forward"] += block_lse.shape[-1] * (ks.stop - ks.start)
        merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)


def attend_backward(q, k, v, dout, out, lse, q_chunks, k_chunks, dq, dk, dv, scale: float) -> None:
    """Add the gradients of the pairs `attend` computed into dq (for q) and dk, dv (for this key
    block), from q's rows' final O and global lse."""
    for qs, ks, causal in _slices(q, k, q_chunks, k_chunks):
        bq, bk, bv = block_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], dout[:, :, qs], out[:, :, qs],
                                    lse[:, :, qs], causal, scale)
        WORK["backward"] += (qs.stop - qs.start) * (ks.stop - ks.start)
        dq[:, :, qs] += bq
        dk[:, :, ks] += bk
        dv[:, :, ks] += bv


def start(q):
    """The empty accumulators of a merge: O = 0 and lse = -inf (fp32), for q's rows."""
    b, h, m, d = q.shape
    return (torch.zeros(b, h, m, d, dtype=torch.float32, device=q.device),
            torch.full((b, h, m), float("-inf"), dtype=torch.float32, device=q.device))


def finish(out, dtype):
    """O in the compute dtype, as [b, H, m, d] over [b, m, H, d] memory: the layout the projections
    were viewed from, so o_proj's input is a view of it (no copy kept for backward)."""
    b, h, m, d = out.shape
    return torch.empty(b, m, h, d, dtype=dtype, device=out.device).transpose(1, 2).copy_(out)
