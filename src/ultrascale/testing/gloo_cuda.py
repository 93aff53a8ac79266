"""Several ranks on one GPU: gloo carries their CUDA tensors, through host memory.

NCCL refuses two ranks on one device ("Duplicate GPU detected"), so a machine with
one GPU cannot run an NCCL layout of two ranks. gloo can, with every rank's model
and activations on the same CUDA device; but gloo implements only `all_reduce` and
`broadcast` for CUDA tensors (torch.distributed's backend table). Within
`staged()`, the other operations the engine calls (point-to-point sends and
receives, batched or not, `all_gather`, `all_to_all_single`) copy a CUDA tensor
to the host, run gloo's CPU implementation there, and copy the result back into
the CUDA tensor: the same bytes arrive in the same tensors, only slower. What
this checks is the engine's computation on CUDA under each layout's algebra (a
tensor created on the wrong device, a CUDA-only kernel path); NCCL itself needs
a GPU per rank.

`stage_cpu=True` stages CPU tensors too (into fresh host buffers), so that the
copying can be tested on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist


class _Staged:
    """A request on a host copy; `wait` then copies what arrived into the device tensor."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor | None):
        self.work, self.host, self.target = work, host, target

    def wait(self, *args, **kwargs):
        if self.work is not None:
            self.work.wait(*args, **kwargs)
        if self.target is not None:
            self.target.copy_(self.host)
            self.target = None  # copied once
        return True

    def is_completed(self) -> bool:
        return self.target is None and (self.work is None or self.work.is_completed())


class P2POp:
    """torch.distributed.P2POp, but for the staged isend / irecv below (the original refuses them)."""

    def __init__(self, op, tensor, peer, group=None, tag=0):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def staged(stage_cpu: bool = False):
    """A context in which the operations gloo cannot run on CUDA tensors go through host copies."""
    orig = {name: getattr(dist, name) for name in
            ("send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather", "all_to_all_single")}

    def needs(t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or stage_cpu

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)  # a fresh buffer even for a CPU tensor

    def send(tensor, *args, **kwargs):
        return orig["send"](host(tensor) if needs(tensor) else tensor, *args, **kwargs)

    def recv(tensor, *args, **kwargs):
        if not needs(tensor):
            return orig["recv"](tensor, *args, **kwargs)
        buf = host(tensor)
        src = orig["recv"](buf, *args, **kwargs)
        tensor.copy_(buf)
        return src

    def isend(tensor, *args, **kwargs):
        if not needs(tensor):
            return orig["isend"](tensor, *args, **kwargs)
        buf = host(tensor)  # the copy is synchronous: the device tensor may change once this returns
        return _Staged(orig["isend"](buf, *args, **kwargs), buf, None)

    def irecv(tensor, *args, **kwargs):
        if not needs(tensor):
            return orig["irecv"](tensor, *args, **kwargs)
        buf = host(tensor)
        return _Staged(orig["irecv"](buf, *args, **kwargs), buf, tensor)

    def batch_isend_irecv(ops):
        # gloo does not coalesce: the original posts the operations one by one, as here.
        works = []
        for op in ops:
            fn = isend if op.op in (isend, orig["isend"]) else irecv
            works.append(fn(op.tensor, op.peer, group=op.group, tag=op.tag))  # peer: a global rank
        return works

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not needs(tensor):
            return orig["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
        bufs = [host(t) for t in tensor_list]
        orig["all_gather"](bufs, host(tensor), group=group)
        for t, b in zip(tensor_list, bufs):
            t.copy_(b)
        return _Staged(None, bufs[0], None) if async_op else None

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if not needs(output):
            return orig["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group=group,
                                             async_op=async_op)
        buf = host(output)
        orig["all_to_all_single"](buf, host(input), output_split_sizes, input_split_sizes, group=group)
        output.copy_(buf)
        return _Staged(None, buf, None) if async_op else None

    patches = dict(send=send, recv=recv, isend=isend, irecv=irecv, batch_isend_irecv=batch_isend_irecv,
                   all_gather=all_gather, all_to_all_single=all_to_all_single, P2POp=P2POp)
    stack = contextlib.ExitStack()
    for name, fn in patches.items():
        stack.enter_context(mock.patch.object(dist, name, fn))
    return stack
