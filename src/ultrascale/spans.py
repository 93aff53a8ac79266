"""The names of what a profiled step records: one vocabulary for every layer that records.

Every technique's communication and the trainer's phases are spans of a
`torch.profiler` trace, named here in one place so that a trace reads the same
whatever the layout. This module sits below everything that records (parallel/,
train/) and imports torch alone. A span is a `torch.profiler.record_function`
(not an NVTX range: those would need `torch.autograd.profiler.emit_nvtx`, which
this code does not enter). torch is imported when a span is recorded, so that reading
the vocabulary (the trace reader, every command's parser) costs no torch import:

    step, forward, backward, optimizer     what the trainer does
    comm:<technique>.<operation>           every communication the engine issues

`comm(...)` is what the communication sites call; it costs one flag test when no
profiler is recording (`recording(True)` is called by train/profile.py's window).

Asynchronous collectives (overlapped and bucketed data parallelism, ZeRO's
reduce-scatters and all-gathers) return at once: their `comm:` span covers the
launch only, and a `comm:*.wait` span covers the time the main thread blocks on
them. The time such a collective actually runs is recorded by the backend
itself: ProcessGroupGloo's worker thread records a `gloo:all_reduce` (or
`gloo:reduce_scatter`, ...) event from the moment it starts the operation to the
moment it completes (measured on 2 CPU ranks: a 16 MB async all-reduce launched
in a 1 ms span runs for 13 ms in `gloo:all_reduce` on the worker thread; in a
bucketed run, a 0.3 ms `comm:dp.bucket_all_reduce` and an 11 ms `gloo:all_reduce`);
on NCCL the `nccl*` kernels on the GPU stream do the same. That is the
true duration the overlap metric needs, so no span of ours stretches from launch
to wait(): such a span would measure time "in flight", including time the
operation had long finished and sat waiting for wait() to be called.
"""

from __future__ import annotations

import contextlib

# -- the span vocabulary ------------------------------------------------------
STEP = "step"
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"  # clipping (with its norm all-reduce), AdamW, the copy back to the model
EVAL = "eval"  # a validation batch's forward, between steps (--eval-every)
COMPUTE = (FORWARD, BACKWARD, OPTIMIZER)

COMM_PREFIX = "comm:"
# A pipeline action, named as the schedule prints it (pp:F3.1, pp:POST_B2.1, pp:RECV_F0): the
# schedule as executed, readable in the trace. Neither compute nor communication by itself.
PP_ACTION = "pp:"
# The communication the engine issues, "technique.operation" (a leading "comm:" is added).
COMM = {
    "dp.all_reduce": "a gradient's all-reduce (naive: blocking; overlap: the async launch)",
    "dp.bucket_all_reduce": "a gradient bucket's async all-reduce launch",
    "dp.wait": "waiting for the data-parallel all-reduces in flight",
    "zero.reduce_scatter": "ZeRO: a bucket's async reduce-scatter launch",
    "zero.all_gather": "ZeRO: the async all-gather launch of updated (1/2) or needed (3) parameters",
    "zero.wait": "ZeRO: waiting for reduce-scatters or all-gathers in flight",
    "tp.all_reduce": "tensor parallelism: an activation or gradient all-reduce (and the loss' reductions)",
    "tp.all_gather": "sequence parallelism: the sequence all-gather entering the TP region",
    "tp.reduce_scatter": "sequence parallelism: the sequence reduce-scatter leaving the TP region",
    "sp.grad_all_reduce": "sequence parallelism: a norm weight's gradient summed over the TP group",
    "pp.send": "pipeline: an activation or gradient send (async launch)",
    "pp.recv": "pipeline: an activation or gradient receive (blocking)",
    "pp.irecv": "pipeline: a gradient receive posted ahead (DualPipe's pairs: async launch)",
    "pp.recv_wait": "pipeline: waiting for a receive posted ahead",
    "pp.wait": "pipeline: waiting for the sends of the step",
    "pp.broadcast": "pipeline: the last stage's loss to the other stages",
    "cp.send_recv": "context parallelism: a ring step's K/V exchange (launch)",
    "cp.wait": "context parallelism: waiting for a ring step's K/V",
    "cp.all_gather": "context parallelism: K/V all-gather",
    "cp.reduce_scatter": "context parallelism: K/V gradient reduce-scatter",
    "cp.all_to_all": "context parallelism (Ulysses): heads <-> sequence all-to-all",
    "ep.all_to_all": "expert parallelism: token dispatch and return (and their counts)",
    "ep.all_gather": "expert parallelism (allgather dispatch): tokens to every expert rank",
    "ep.reduce_scatter": "expert parallelism (allgather dispatch): outputs back to their ranks",
    "ep.grad_all_reduce": "expert weights' gradients over the expert-data-parallel group",
    "grad_norm.all_reduce": "the squared gradient norm over the ranks holding different pieces",
    "moe.stats_all_reduce": "MoE routing statistics over the data ranks",
    "loss.all_reduce": "the step's loss averaged over the data ranks, for the log",
}
# Events of the backends themselves that are communication: gloo's worker-thread events,
# NCCL's kernels.
BACKEND_COMM_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")

_NULL = contextlib.nullcontext()
_active = False  # set while a profiler is running: the spans are recorded only then


def recording(on: bool) -> None:
    """Record the spans from now on (a profiler window opened) or stop (it closed)."""
    global _active
    _active = on


def span(name: str):
    """A named span of the profiled steps (a no-op when profiling is off)."""
    if not _active:
        return _NULL
    import torch.profiler

    return torch.profiler.record_function(name)


def comm(what: str):
    """The span of one communication, `what` one of COMM's keys."""
    if not _active:
        return _NULL
    assert what in COMM, what
    import torch.profiler

    return torch.profiler.record_function(COMM_PREFIX + what)


def is_comm(name: str) -> bool:
    return name.startswith(COMM_PREFIX) or name.startswith(BACKEND_COMM_PREFIXES)
