"""Step time: compute from FLOPs, communication per collective, what hides behind what.

Compute. Training FLOPs per token are 6N + 12·L·h·s (the playbook's count: 2N
forward, 4N backward, plus the attention scores and values; with heads that are
not h / heads wide, 6·L·s·heads·(d_qk + d_v): shape.attn_core_flops), N the
active parameters of the blocks a stage holds (an MoE model's leading dense
blocks count their MLP, its MoE blocks top_k experts); a rank does its
stage's share (its blocks, the head's matmul on the stage holding it), divided
by tp·cp (context parallelism's ring on contiguous shards adds its last rank's
extra causal work: _context_parallel). Recomputation adds a forward: full, 2N_blocks + 4·L·h·s per token;
selective, the attention core's 4·L·h·s. Time = FLOPs / (peak x mfu), mfu being
the framework's achievable fraction (calibration.py), plus a fixed cost per
block per micro-batch (kernel launches and the small kernels between matmuls).

Collectives, ring algorithms over n ranks, message of B bytes on a link of
bandwidth W and per-step latency alpha (the playbook's appendix A0; Thakur et
al. 2005):
  all-reduce            2(n-1)/n · B/W + 2(n-1)·alpha
  reduce-scatter,
  all-gather            (n-1)/n · B/W + (n-1)·alpha    (B: the full, unsharded size)
  all-to-all            (n-1)/n · B/W + (n-1)·alpha
  send/recv             B/W + alpha
A group whose ranks are all inside one node uses NVLink, otherwise InfiniBand
(the slowest link of a ring sets its pace). Ranks are laid out dp x pp x cp x
tp with tp innermost: a group of stride k and size n stays in a node when k·n <=
node size.

The expert all-to-all (expert_all_to_all) splits a rank's copies between its NIC
(those for other nodes) and NVLink (those for its own), under node-limited
routing one copy per destination node; its group fills nodes where the framework
orders ranks so (expert_ranks).

Overlap (the playbook's appendix A3: communication hides when the compute it
runs beside takes longer): the data-parallel gradient reduction runs beside the
last micro-batch's backward, and only what exceeds it, plus the last bucket,
shows; ZeRO-3's gathers and reduce-scatters run beside each micro-batch's
compute; ring attention's K/V passes run beside the attention blocks. Tensor
parallel and expert all-to-all collectives, context parallelism's all-gather and
Ulysses' all-to-alls sit on the critical path (their consumers wait for them)
and are counted whole, but for the expert all-to-all under DualPipe, which runs
one micro-batch's forward beside another's backward so each one's all-to-all
travels while the other computes: there only what exceeds the compute shows
(exposed_expert_comm; DeepSeek-V3 report, section 3.2.1; deepseek-ai/DualPipe).
ZeRO-1/2's parameter all-gather after the optimizer step and the pipeline's
sends are counted whole too. The pipeline
bubble is bubble.py's fraction of the micro-batches' time.

Synchronization: what the playbook's measured runs pay beyond bytes and FLOPs
(docs/planner.md, "The time model at scale"): two constants of the framework
(calibration.py) and one of the cluster (hardware.py). Every ring step of a
collective on the critical path (tensor parallel, expert all-to-all) costs
collective_step_s: its launch and the wait for
the group's slowest member. A pipeline stage pays pipeline_sync_factor times that
when its framework synchronizes the host on every receive (nanotron reads the
incoming tensor's shape on the CPU, so the CPU stops running ahead of the GPU and
each collective after it is paid as it is launched). And on the playbook's cluster
every micro-batch pays node_pair_sync_s per pair of nodes in the job: the same for
a 1B and an 80B model at 64 nodes, a cost of that cluster rather than of the
layout or the software, so it belongs to the cluster preset and no other carries it.

`gpu` below is a hardware.Cluster: the chip's figures and the links between chips.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ultrascale.plan.bubble import bubble_fraction
from ultrascale.plan import passes
from ultrascale.plan.hardware import Link
from ultrascale.plan.precision import get_precision
from ultrascale.parallel.pipeline.partition import v_shaped
from ultrascale.plan.states import stage_blocks, stage_params

RING_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}


def latency_steps(n: int) -> int:
    """Latency terms of one collective: NCCL picks the better of a ring (n - 1 steps) and a tree
    (2·log2 n steps: up and down a binary tree)."""
    return min(n - 1, 2 * math.ceil(math.log2(n)))


def ring_time(kind: str, nbytes: float, n: int, link) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return RING_STEPS[kind] * ((n - 1) / n * nbytes / link.bandwidth + latency_steps(n) * link.latency)


def p2p_time(nbytes: float, link) -> float:
    return nbytes / link.bandwidth + link.latency


def link_of(gpu, lay, dim: str) -> Link:
    """The link the `dim` group of `lay` communicates over (cached: the search asks often)."""
    return _link(gpu.node_size, gpu.intra, gpu.inter, lay.dp, lay.pp, lay.cp, lay.tp, lay.ep, dim)


@functools.lru_cache(maxsize=4096)
def _link(node_size, intra, inter, dp, pp, cp, tp, ep, dim) -> Link:
    grid = _Grid(dp, pp, cp, tp, ep)
    return group_link(_Nodes(node_size, intra, inter), group_ranks(grid, dim))


@dataclass(frozen=True)
class _Grid:
    dp: int
    pp: int
    cp: int
    tp: int
    ep: int


@dataclass(frozen=True)
class _Nodes:
    node_size: int
    intra: Link
    inter: Link


def group_ranks(lay, dim: str) -> list[int]:
    """The global ranks of the `dim` group that holds rank 0, in the engine's grid: rank =
    ((dp_i·pp + pp_i)·cp + cp_i)·tp + tp_i (tp innermost). Expert groups are consecutive dp ranks;
    data parallelism reduces over dp x cp."""
    def rank(d=0, p=0, c=0, t=0):
        return ((d * lay.pp + p) * lay.cp + c) * lay.tp + t
    if dim == "tp":
        return [rank(t=t) for t in range(lay.tp)]
    if dim == "cp":
        return [rank(c=c) for c in range(lay.cp)]
    if dim == "pp_next":  # a stage and the next: what a pipeline send crosses
        return [rank(p=0), rank(p=1)]
    if dim == "ep":
        return [rank(d=d) for d in range(lay.ep)]
    return [rank(d=d, c=c) for d in range(lay.dp) for c in range(lay.cp)]  # "dp": the dp x cp group


def group_link(gpu, ranks: list[int]) -> Link:
    """The link a ring over `ranks` runs at.

    Inside a node: NVLink. Across nodes the ring's node-crossing hops set the pace; NCCL runs one
    channel per NIC, so a group with g members in each node drives g NICs at once: bandwidth
    g x the per-GPU InfiniBand bandwidth (never above NVLink's), latency the inter-node one.
    """
    per_node = {}
    for r in ranks:
        per_node[r // gpu.node_size] = per_node.get(r // gpu.node_size, 0) + 1
    if len(per_node) <= 1:
        return gpu.intra
    members = min(per_node.values())
    return Link(gpu.inter.name, min(gpu.intra.bandwidth, members * gpu.inter.bandwidth), gpu.inter.latency)


def playbook_flops_per_token(shape, seq_len: int) -> float:
    """6N + 12·L·h·s, N all parameters (active ones for an MoE): what the playbook's MFU divides by.
    The attention term is the heads' real widths (shape.attn_core_flops): 12·h·s where a head is
    h / heads wide for queries, keys and values, more for Qwen3's 128-wide heads on hidden 2048 or
    MLA's 192-wide query/key heads."""
    return 6 * shape.active_params() + shape.layers * shape.attn_core_flops(seq_len)


@dataclass
class StepTime:
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    breakdown: dict  # seconds per optimizer step, by cause

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "breakdown_s": dict(self.breakdown)}


def _up_projections(shape) -> int:
    """MLA's up-projections (q_b_proj, kv_b_proj): what DeepSeek-V3 runs again in backward."""
    if not shape.is_mla:
        return 0
    q_b = shape.q_lora_rank * shape.q_dim if shape.q_lora_rank else 0
    return q_b + shape.kv_lora_rank * shape.heads * (shape.head_dim + shape.v_dim_per_head)


def _stage_flops(shape, lay, blocks, tokens, fw=None) -> tuple[float, float, float, float]:
    """(FLOPs, recompute FLOPs) of one micro-batch on one rank of a stage holding `blocks`
    (states.block_counts: its dense and MoE blocks), and of each the part in the blocks' linears
    (what a float8 framework runs on the FP8 tensor cores)."""
    n_layers, _, has_head, n_dense = blocks
    h, s = shape.hidden, lay.seq_len
    block_params = ((n_layers - n_dense) * shape.block_active_params(moe=True)
                    + n_dense * shape.block_active_params(moe=False))
    attn = shape.attn_core_flops(s) * n_layers
    linear = 6 * block_params
    flops = linear + attn + (6 * shape.vocab * h if has_head else 0)
    extra = {"none": 0.0, "selective": attn / 3, "full": 2 * block_params + attn / 3}[lay.recompute]
    extra_linear = {"none": 0.0, "selective": 0.0, "full": 2 * block_params}[lay.recompute]
    if fw is not None and fw.recompute_norms and lay.recompute != "full":  # DeepSeek-V3, section 3.2.3
        extra += 2 * _up_projections(shape) * n_layers
        extra_linear += 2 * _up_projections(shape) * n_layers
    div = lay.tp * lay.cp
    return tokens * flops / div, tokens * extra / div, tokens * linear / div, tokens * extra_linear / div


def _matmul_s(flops, linear, peak, fw, gpu) -> float:
    """Seconds of `flops`, of which `linear` run in float8 where the framework does (twice the dense
    rate on FP8 tensor cores; the attention core, norms and head stay in the compute dtype)."""
    if not fw.float8:
        return flops / (peak * fw.mfu)
    return (linear / gpu.peak_flops["fp8"] + (flops - linear) / peak) / fw.mfu


def _memory_bound_s(shape, lay, gpu, fw, blocks, tokens, b) -> float:
    """Seconds of the elementwise passes the framework's time constants do not already hold
    (plan/passes.py): eager kernels where its constants were set on fused ones (or the saving the other
    way), and float8's casts. At the HBM's rate: memory-bound, no matmul in them."""
    n_layers, has_head = blocks[0], blocks[2]
    moved = 0.0
    if fw.kernels != fw.kernels_timed:
        fwd, bwd = passes.eager_bytes(shape, lay, b)
        again = 2 if lay.recompute == "full" else 1  # full recomputation runs the forward's passes again
        eager = tokens / lay.cp * (n_layers * (again * fwd + bwd)
                                   + (passes.eager_head_bytes(shape, lay, b) if has_head else 0.0))
        moved += eager if fw.kernels == "eager" else -eager
    if fw.float8:
        moved += passes.cast_bytes(shape, lay, b, n_layers, tokens)
    return moved / gpu.hbm_bandwidth


def _exposed_tp(shape, lay, gpu, fw, peak, n_layers, n_dense, tokens, one: float, regathers: int) -> float:
    """What sequence parallelism's collectives add when each is cut into tp pieces that run beside the
    matmul it feeds or follows (async TP; Megatron's --tp-comm-overlap). Each collective (`one` seconds:
    an all-gather and a reduce-scatter of a full activation take the same) is paired with its own matmul:
    forward, the all-gather before q/k/v and the reduce-scatter after o, the all-gather before the MLP's
    first linears (gate and up) and the reduce-scatter after its last (down); backward their conjugates,
    beside the input- and weight-gradient matmuls (twice the forward's FLOPs), and a re-gather of a
    linear's input beside its weight gradient. A pair shows the collective's first piece (nothing to
    compute before it arrives) and whatever of the other tp - 1 exceeds its matmul: small matmuls (the
    attention's projections, or FP8 ones) hide less."""
    h, div = shape.hidden, lay.tp * lay.cp

    def mm(params_per_token):  # seconds of one forward matmul of these parameters over the micro-batch
        flops = 2 * params_per_token * tokens / div
        return _matmul_s(flops, flops, peak, fw, gpu)

    def pair(matmul):
        return one / lay.tp + max(0.0, one * (lay.tp - 1) / lay.tp - matmul)

    def mlp_legs(f):  # (first linears, last linear) parameters of an MLP of width f
        return (2 if shape.mlp == "swiglu" else 1) * h * f, f * h

    qkv, o = h * (shape.q_dim + shape.k_dim + shape.v_dim), shape.attn_out_dim * h
    # An MoE block's MLP: its top_k experts' legs and the shared expert's, added leg by leg.
    moe_mlps = [mlp_legs(shape.expert_ffn)] * shape.top_k + ([mlp_legs(shape.shared_expert_ffn)]
                                                             if shape.shared_expert_ffn else [])
    moe_mlp = tuple(map(sum, zip(*moe_mlps)))
    total = 0.0
    for count, (first, last) in ((n_dense, mlp_legs(shape.ffn_hidden)), (n_layers - n_dense, moe_mlp)):
        if not count:
            continue
        block = sum(pair(k * mm(p)) for p in (qkv, o, first, last) for k in (1, 2))  # forward, backward
        block += regathers / 2 * (pair(mm(qkv)) + pair(mm(first)))  # beside the weight gradients
        total += count * block
    return total


def expert_ranks(lay, fw) -> list[int]:
    """The expert-parallel group holding rank 0. Megatron-Core orders ranks tp-cp-ep-dp-pp (pipeline
    outermost), torchtitan's mesh is pp-dp-cp-tp with ep inside dp, and DeepSeek-V3 runs EP64
    "spanning 8 nodes" (arXiv 2412.19437, section 3.2): an expert group is ep ranks tp·cp apart,
    filling nodes. Our engine's grid (dp x pp x cp x tp) puts them pp·cp·tp apart (group_ranks)."""
    if not fw.ep_fills_nodes:
        return group_ranks(lay, "ep")
    return [e * lay.tp * lay.cp for e in range(lay.ep)]


def route_nodes(shape, nodes: int) -> int:
    """Nodes a token's experts can lie on under node-limited routing (0: no limit): topk_groups of
    expert_groups groups, laid out in order on the expert group's nodes (a group on one node, or
    spread over nodes / expert_groups of them), and never more than top_k."""
    if not shape.topk_groups:
        return 0
    nodes_per_group = max(1, nodes // shape.expert_groups)
    return min(shape.top_k, nodes, shape.topk_groups * nodes_per_group)


def expert_all_to_all(shape, lay, gpu, fw, act_full: float) -> float:
    """Seconds of one all-to-all of an MoE block (a dispatch or a combine) for one micro-batch.

    Each rank sends top_k copies of its tokens (act_full bytes per copy) to the experts' ranks. Inside
    one node: a ring all-to-all over NVLink. Across N nodes, g ranks of the group in each: a copy
    leaves for another node with probability (N - 1)/N, over the rank's own NIC, while the copies for
    its own node go over NVLink, at the same time: the slower of the two sets the time. Under
    node-limited routing (route_nodes), a token is sent once to each node it is routed to and
    forwarded there over NVLink to its experts' GPUs (DeepSeek-V3, section 3.2.2: at most 4 nodes a
    token, IB at 50 GB/s and NVLink at 160 GB/s per GPU; DeepEP's internode kernels): M copies cross,
    not top_k. Without it, the all-to-all sends every copy (NCCL's, Megatron's default dispatcher)."""
    ranks = expert_ranks(lay, fw)
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r // gpu.node_size] = per_node.get(r // gpu.node_size, 0) + 1
    n, nodes, k = len(ranks), len(per_node), shape.top_k
    if nodes == 1:
        return ring_time("all_to_all", k * act_full, n, gpu.intra)
    g = min(per_node.values())
    limit = route_nodes(shape, nodes)
    if limit:
        ib, nvlink = limit * (nodes - 1) / nodes * act_full, k * (g - 1) / g * act_full
    else:
        ib, nvlink = k * (n - g) / n * act_full, k * (g - 1) / n * act_full
    return max(ib / gpu.inter.bandwidth, nvlink / gpu.intra.bandwidth) + latency_steps(n) * gpu.inter.latency


def overlapped_share(lay) -> float:
    """Share of a rank's forward and backward chunks that DualPipe runs as overlapped pairs: the
    forward of one micro-batch beside the backward of another, each one's all-to-all running while
    the other computes (DeepSeek-V3, section 3.2.1, Figure 4; deepseek-ai/DualPipe's README: "full
    overlap of forward and backward computation-communication phases"). DualPipeV's rank 0, the one
    with the fewest pairs, runs 2(m - 2p + 1) of them in its steady phase and p - 1 in the next
    (parallel/pipeline/schedules.py, dualpipe_v) of its 2m chunks each way. 1F1B, the interleaved
    and zero-bubble schedules run one micro-batch at a time: nothing to overlap with."""
    if not v_shaped(lay.schedule) or lay.pp == 1:
        return 0.0
    p, m = lay.pp, lay.grad_accum
    return max(0.0, (2 * m - 3 * p + 1) / (2 * m))


def exposed_expert_comm(a2a: float, compute: float, lay) -> float:
    """What a micro-batch's expert all-to-alls add to its time: all of them where nothing runs beside
    them; in DualPipe's overlapped pairs only what exceeds the compute they hide behind,
    max(0, a2a - compute) (the pair takes the longer of its computation and its communication)."""
    share = overlapped_share(lay)
    return share * max(0.0, a2a - compute) + (1 - share) * a2a


def _stage_time(shape, lay, gpu, fw, blocks, peak) -> dict:
    """Seconds of one micro-batch (forward and backward) on one rank of a stage holding `blocks`."""
    b = get_precision(lay.precision).act_bytes
    tokens = lay.micro_batch * lay.seq_len
    n_layers, n_moe = blocks[0], blocks[0] - blocks[3]
    flops, extra, linear, extra_linear = _stage_flops(shape, lay, blocks, tokens, fw)
    t = {"compute": _matmul_s(flops, linear, peak, fw, gpu), "recompute": _matmul_s(extra, extra_linear, peak, fw, gpu),
         "kernel_overhead": (fw.layer_overhead_s * n_layers + fw.microbatch_overhead_s
                             + _memory_bound_s(shape, lay, gpu, fw, blocks, tokens, b))}
    if fw.attention == "eager" or (lay.cp > 1 and fw.cp_block_attention == "eager"):
        # Attention without a fused kernel writes the s x s scores to memory and reads them back: the
        # softmax forward (scores in, probabilities out, read by the values' matmul) and backward (four
        # more passes), again when the forward is recomputed. Memory-bound, at the HBM's rate.
        passes = 8 + (4 if lay.recompute != "none" else 0)
        scores = lay.micro_batch * shape.heads / lay.tp * lay.seq_len * lay.seq_len / lay.cp * b
        t["compute"] += passes * scores * n_layers / gpu.hbm_bandwidth
    act_full = tokens * b * shape.hidden / lay.cp  # one full activation of a micro-batch
    tp_link = link_of(gpu, lay, "tp")
    if lay.sp_on:
        # Per block: 2 all-gathers + 2 reduce-scatters forward, their conjugates backward, and 2 more
        # all-gathers where the framework keeps only the shard of a linear's input (re-gather). An
        # all-gather and a reduce-scatter of the same activation cost the same.
        gathers = 4 if fw.sp_keeps_gathered_input else 6
        one = ring_time("all_gather", act_full, lay.tp, tp_link)
        if fw.tp_overlap:  # each collective cut into pieces beside its matmul
            tp = _exposed_tp(shape, lay, gpu, fw, peak, n_layers, blocks[3], tokens, one, gathers - 4)
        else:
            tp = n_layers * (gathers + 4) * one
        tp_steps = n_layers * (gathers + 4) * (lay.tp - 1)
    else:  # 2 all-reduces forward, 2 backward
        tp = n_layers * 4 * ring_time("all_reduce", act_full, lay.tp, tp_link)
        tp_steps = n_layers * 4 * 2 * (lay.tp - 1)
    if blocks[1] or blocks[2]:  # vocabulary-parallel embedding / head
        tp += 2 * ring_time("all_gather" if lay.sp_on else "all_reduce", act_full, lay.tp, tp_link)
        tp_steps += 2 * (1 if lay.sp_on else 2) * (lay.tp - 1)
    t["tp_comm"] = tp
    t["cp_comm"] = t["cp_imbalance"] = 0.0
    cp_steps = 0
    if lay.cp > 1:
        t["cp_comm"], t["cp_imbalance"], cp_steps = _context_parallel(shape, lay, gpu, fw, n_layers, tokens, b, peak)
    # Synchronization (see the module's docstring): every ring step of a collective on the critical
    # path costs collective_step_s, pipeline_sync_factor times more where a pipeline receive
    # synchronizes the host; and each micro-batch pays node_pair_sync_s per pair of nodes.
    factor = fw.pipeline_sync_factor if lay.pp > 1 else 1.0
    t["ep_comm"], ep_steps = 0.0, 0
    if lay.ep > 1 and n_moe:  # dispatch and combine, forward and backward, each an all-to-all
        t["ep_comm"] = n_moe * 4 * expert_all_to_all(shape, lay, gpu, fw, act_full)
        ep_steps = n_moe * 4 * (lay.ep - 1)
        if overlapped_share(lay):  # off the critical path where overlapped: its steps' waits with it
            ep_sync = ep_steps * fw.collective_step_s * factor
            t["ep_comm"] = exposed_expert_comm(t["ep_comm"] + ep_sync, t["compute"] + t["recompute"], lay)
            ep_steps = 0
    steps = tp_steps + cp_steps + ep_steps
    nodes = -(-lay.world // gpu.node_size)
    t["sync"] = steps * fw.collective_step_s * factor + gpu.node_pair_sync_s * nodes**2
    t["pp_comm"] = 0.0
    if lay.pp > 1:  # receive the input forward, the gradient backward (once per chunk, interleaved)
        pp_link = link_of(gpu, lay, "pp_next")
        t["pp_comm"] = 2 * lay.chunks * p2p_time(act_full / (lay.tp if lay.sp_on else 1), pp_link)
    return t


def _context_parallel(shape, lay, gpu, fw, n_layers, tokens, b, peak) -> tuple[float, float, int]:
    """(communication that shows, the slowest rank's extra attention, critical-path ring steps) of one
    micro-batch under context parallelism, by attention variant (parallel/context/).

    ring, zigzag  cp - 1 K/V passes forward, twice that backward (K/V, then dK/dV), beside the
                  attention blocks' compute: only what exceeds it shows.
    allgather     an all-gather of K and V forward and a reduce-scatter of their gradients backward,
                  before and after the attention that needs them: on the critical path.
    ulysses       all-to-alls of q, k, v in and the output back, forward and backward: on the path.
    Recomputation (selective or full) runs the context-parallel attention's forward again, and its
    communication with it.
    Causal balance: zig-zag and all-gather (zig-zag shards) give every rank the same work, Ulysses
    whole sequences of a head shard. The ring's contiguous shards give rank r (r + 1/2) of the
    cp²/2 causal blocks: the last rank (2cp - 1)/cp times the mean, and the step waits for it. The
    attention FLOPs elsewhere are the playbook's 12·h·s, every score of the s x s matrix; a causal
    kernel computes the half under the diagonal: that half is what the ranks share unevenly, and
    what the ring's passes run beside.
    """
    again = lay.recompute != "none"
    cp_link = link_of(gpu, lay, "cp")
    causal = tokens * shape.attn_core_flops(lay.seq_len) / 2 * n_layers / (lay.tp * lay.cp)  # FLOPs, balanced
    causal_s = causal / (peak * fw.mfu) * (4 / 3 if again else 1)  # recomputation: the forward's third again
    kv = 2 * tokens / lay.cp * shape.kv_dim * b / lay.tp  # this rank's K and V, bytes
    imbalance = causal_s * (lay.cp - 1) / lay.cp if lay.cp_attention == "ring" else 0.0
    if lay.cp_attention in ("ring", "zigzag"):
        ring = (3 + again) * (lay.cp - 1) * p2p_time(kv, cp_link) * n_layers
        return max(0.0, ring - causal_s), imbalance, 0
    if lay.cp_attention == "allgather":
        gathered = kv * lay.cp  # the whole sequence's K and V
        comm = ((1 + again) * ring_time("all_gather", gathered, lay.cp, cp_link)
                + ring_time("reduce_scatter", gathered, lay.cp, cp_link)) * n_layers
        return comm, imbalance, (2 + again) * (lay.cp - 1) * n_layers
    if lay.cp_attention == "ulysses":
        q = tokens / lay.cp * (shape.q_dim + shape.attn_out_dim) / 2 * b / lay.tp  # q and O; k and v: kv
        one_way = 2 * ring_time("all_to_all", q, lay.cp, cp_link) + 2 * ring_time("all_to_all", kv / 2, lay.cp, cp_link)
        return (2 + again) * one_way * n_layers, imbalance, 4 * (2 + again) * (lay.cp - 1) * n_layers
    raise ValueError(f"cp_attention must be ring, zigzag, allgather or ulysses, got {lay.cp_attention!r}")


def _collectives(kind, nbytes, n, link, bucket_bytes) -> float:
    """A reduction of nbytes cut into buckets: one bandwidth term, one latency term per bucket."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    buckets = max(1, -(-nbytes // bucket_bytes))
    return RING_STEPS[kind] * ((n - 1) / n * nbytes / link.bandwidth
                               + buckets * latency_steps(n) * link.latency)


def _offloaded_step(lay, gpu, shard, grad_b, param_b, m) -> tuple[float, float]:
    """(optimizer, offload) seconds under ZeRO-Offload (parallel/offload.py).

    The optimizer steps on the host, bound by its memory: the same bytes as on the GPU. Beside it,
    segment by segment, run the PCIe copies (the gradient shard down, the updated parameters up)
    and, for disk, the states' reads and writes (12 bytes an element each way): the engine's
    pipeline overlaps the three, and what exceeds the host step shows. With ZeRO-3 the parameter
    shard also goes up before each of a micro-batch's two gathers: counted whole (an upper bound,
    the prefetch may hide part of it).
    """
    host = gpu.offload_host
    optimizer = shard * (4 + 4 + 8 + 8 + grad_b + param_b) / host.memory_bandwidth
    pcie = shard * (grad_b + param_b) / host.pcie_bandwidth
    disk = 2 * 12 * shard / host.disk_bandwidth if lay.offload == "disk" else 0.0
    gathers = 2 * m * shard * param_b / host.pcie_bandwidth if lay.zero == 3 else 0.0
    return optimizer, max(0.0, max(pcie, disk) - optimizer) + gathers


def step_time(shape, lay, gpu, fw) -> StepTime:
    prec = get_precision(lay.precision)
    peak = gpu.peak_flops["fp32" if prec.act_bytes == 4 else "bf16"]
    stages = stage_blocks(shape, lay.pp, fw.partition, lay.chunks, lay.first_stage_layers, lay.last_stage_layers,
                          v_shaped(lay.schedule))
    per_stage = [_stage_time(shape, lay, gpu, fw, blk, peak) for blk in stages]
    slow = max(range(len(stages)), key=lambda i: sum(per_stage[i].values()))
    t = per_stage[slow]  # the slowest stage sets the pipeline's pace
    per_mb = sum(t.values())
    m = lay.grad_accum
    bubble = bubble_fraction(lay.schedule, lay.pp, m, lay.chunks) * m * (per_mb - t["pp_comm"])
    backward = (t["compute"] + t["recompute"]) * 2 / 3  # backward is 4 of the 6 FLOPs per parameter

    # Data parallelism over dp x cp ranks, outermost in the grid.
    n = lay.dp * lay.cp
    dp_link = link_of(gpu, lay, "dp")
    dense, expert = stage_params(shape, lay, stages[slow])
    psi = dense + expert
    grad_b = 4 if prec.fp32_grad_bytes else prec.param_bytes
    cap = lay.bucket_mb * 2**20
    last_bucket = ring_time("all_reduce", min(cap, psi * grad_b), n, dp_link)
    if lay.zero == 0:
        dp = max(0.0, _collectives("all_reduce", psi * grad_b, n, dp_link, cap) - backward) + last_bucket
    elif lay.zero in (1, 2):
        rs = _collectives("reduce_scatter", psi * grad_b, n, dp_link, cap)
        # ZeRO-2 reduce-scatters every micro-batch (each beside its own backward), ZeRO-1 once.
        dp = (m if lay.zero == 2 else 1) * max(0.0, rs - backward) + last_bucket / 2
        dp += _collectives("all_gather", psi * prec.param_bytes, n, dp_link, cap)  # after the step
    else:
        per_mb_comm = (2 * _collectives("all_gather", psi * prec.param_bytes, n, dp_link, cap)
                       + _collectives("reduce_scatter", psi * grad_b, n, dp_link, cap))
        if lay.pp > 1 and not fw.zero3_reshards_in_pipeline:  # gathered once, reduced once, per step
            dp = max(0.0, per_mb_comm - t["compute"] - t["recompute"])
        else:
            dp = m * max(0.0, per_mb_comm - t["compute"] - t["recompute"])
    shard = psi / (n if lay.zero else 1)
    # AdamW reads and writes the fp32 master and both moments, reads the gradient, writes the parameter.
    optimizer = shard * (4 + 4 + 8 + 8 + grad_b + prec.param_bytes) / gpu.hbm_bandwidth
    offload = 0.0
    if lay.offload != "none":
        optimizer, offload = _offloaded_step(lay, gpu, shard, grad_b, prec.param_bytes, m)

    step = m * per_mb + bubble + dp + optimizer + offload
    breakdown = {k: m * v for k, v in t.items()}
    breakdown.update(bubble=bubble, dp_comm=dp, optimizer=optimizer, offload=offload)
    tps = lay.tokens_per_step / step / lay.world
    mfu = tps * playbook_flops_per_token(shape, lay.seq_len) / peak
    return StepTime(step, tps, mfu, breakdown)
