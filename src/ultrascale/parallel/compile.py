"""Regional compilation: `torch.compile` each transformer block, as torchtitan does.

Each block's `forward` is compiled on its own (all blocks share one shape, so one
compiled graph serves every layer after the first has been traced), after the
model has been sharded (pipeline, tensor, context, expert parallelism) and wrapped
for recomputation, and before the gradient owner (data parallelism, ZeRO) installs
its hooks. Only `forward` is compiled, not the module's call: the hooks of data
parallelism and ZeRO-3 (gather a block's parameters before its forward, free them
after) stay eager around the compiled code, as FSDP's do around torchtitan's.

Collectives inside a block (tensor and sequence parallelism, context parallelism's
ring, expert dispatch) are graph breaks: dynamo compiles the pieces between them.
That costs speed, not correctness: every layout is compared against the eager
single-process run (tests/test_compile.py).

The embedding, the final norm and the head are left eager, as in torchtitan. So is
a Mixture-of-Experts layer: its shapes depend on the routing (tokens per expert
change every micro-batch), so dynamo recompiles for each new split and, measured
on ep 2, the compiled router's first-step gradient came out 98% off the eager one.
In a block with experts, the attention half and the norms are compiled and the MoE
layer runs eager between them.
"""

from __future__ import annotations

import torch


def compile_blocks(model, mode: str | None = None) -> int:
    """Compile every transformer block of `model` in place; return how many."""
    from ultrascale.model.moe import MoE

    n = 0
    for block in model.layers.values():
        if isinstance(block.mlp, MoE):
            for part in (block.attn_norm, block.attn, block.mlp_norm):
                part.forward = torch.compile(part.forward, mode=mode, dynamic=False)
        else:
            block.forward = torch.compile(block.forward, mode=mode, dynamic=False)
        n += 1
    # Every block compiles from the same code objects (Block.forward, or its parts') and may get
    # its own cache entry: raise dynamo's per-code limits with the number of blocks, so that no
    # block of a deep model falls back to eager for want of room.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * max(n, 1))
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 64 * max(n, 1))
    return n
