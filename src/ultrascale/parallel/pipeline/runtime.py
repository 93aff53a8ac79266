"""Execute a schedule's action list on this pipeline rank, exactly as simulated.

Activations and their gradients move between neighbouring ranks point to point
(send is asynchronous, receive waits); each message is tagged with its kind,
micro-batch and chunk, so a forward activation can never be taken for a
gradient even when both travel between the same two ranks (interleaving wraps
around from the last rank to the first). Every action's start and end are
recorded, so a real step can be drawn like a simulated one.

A recorded step (`--pp-trace`) also keeps the schedule's clock, a Lamport clock:
each compute action lasts its unit cost (simulate.UNIT_COSTS), each message
carries its sender's clock in a second, 8-byte message, and a receive moves the
receiver's clock up to it. That timeline is made by the runtime's own order of
actions and the messages it really waited for, and by nothing the machine's load
can stretch: it equals the simulator's exactly when the runtime waits on what
the simulator assumes, and no more (the wall-clock one adds the messages' time
and the machine's).

In a V (DualPipeV) a chunk's neighbour may sit on either side, or on the rank
itself: at the turn of the V, rank p-1 hands its chunk 0's output to its chunk 1
(and the gradient back) through a local mailbox instead of a message.

DualPipe's overlapped pairs (a forward of one micro-batch, then the backward of
another on the other chunk): the backward's gradient receive is posted (POST_B,
an irecv) before the forward runs, and the forward's output is sent (isend)
before the backward runs, so each one's message travels, on gloo's transport
thread or NCCL's stream, while the other computes; RECV_B then waits only for
what has not yet arrived. Every action runs inside a `pp:<action>` span, so a
profiled step shows the schedule as executed.

Gradients: every backward runs inside the gradient owner's `no_sync()` except
the last one of each chunk (for zero-bubble: its last I and last W), so data
parallelism reduces once per optimizer step, after the last backward.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from ultrascale.parallel.pipeline.partition import rank_of_stage, v_shaped
from ultrascale.parallel.pipeline.schedules import schedule, stage_of
from ultrascale.parallel.pipeline.simulate import UNIT_COSTS
from ultrascale.parallel.pipeline.stage import (
    StageChunk,
    WeightGradStore,
    apply_weight_grads,
    split_layers,
    virtual_stages,
)
from ultrascale.spans import BACKWARD, FORWARD, PP_ACTION, comm, span


class PipelineRuntime:
    def __init__(self, model, ctx, cfg, grads, loss_fn, meter):
        pc, t = cfg.parallel, cfg.train
        self.ctx, self.grads, self.loss_fn, self.meter = ctx, grads, loss_fn, meter
        self.loss_scale = 1.0  # set by the trainer each step under fp16
        self.p, self.v, self.rank = ctx.size("pp"), pc.pp_chunks, ctx.index("pp")
        self.m, self.seq_len = t.grad_accum, t.seq_len
        self.measure = t.measure_activations
        self.vshape = v_shaped(pc.pp_schedule)
        self.ranks = ctx.group_ranks["pp"]
        layers = split_layers(cfg.model.layers, self.p, self.v, pc.pp_first_stage_layers, pc.pp_last_stage_layers)
        last = self.p * self.v - 1
        self.last_rank = self.ranks[rank_of_stage(last, self.p, self.vshape)]  # holds the loss
        self.chunks = [StageChunk(model, layers[s], s == 0, s == last)
                       for s in virtual_stages(self.rank, self.p, self.v, self.vshape)]
        self.mailbox: dict = {}  # the V's turn: (kind, micro, destination stage) -> tensor
        self.posted: dict = {}  # receives posted ahead: (kind, micro, destination stage) -> (work, buffer)
        self.actions = schedule(pc.pp_schedule, self.p, self.m, self.v)[self.rank]
        self.synced = self._last_backwards()
        # What travels between stages: this rank's shard of the sequence (cp), cut again by tp under SP.
        local_seq = t.seq_len // ctx.size("cp") // (ctx.size("tp") if pc.sp else 1)
        self.shape = (t.micro_batch, local_seq, cfg.model.hidden)
        self.dtype = next(model.parameters()).dtype
        self.trace: list = []
        self.clocked = bool(t.pp_trace)  # keep the schedule's clock (module docstring) in a recorded step
        self.now: float | None = None  # that clock, during run() when clocked
        self.weight_grads: dict = {}  # zero-bubble: what each I left for its W

    def _last_backwards(self) -> set:
        """Indices of the actions that must communicate gradients: per chunk, the last that adds to
        the linear weights (a B or a W) and the last that adds to the other parameters (a B or an I).
        DualPipeV mixes full and split backwards on one chunk, so either may come last."""
        last = {}
        for i, a in enumerate(self.actions):
            if a.kind in ("B", "W"):
                last[("linear", a.chunk)] = i
            if a.kind in ("B", "I"):
                last[("other", a.chunk)] = i
        return set(last.values())

    def _tag(self, micro: int, dest_stage: int, kind: str) -> int:
        """Named by where the message goes, so sender and receiver agree even across the
        wrap from the last rank's chunk c to the first rank's chunk c + 1."""
        return ((micro * self.p * self.v + dest_stage) * 2 + (kind == "B")) + 1

    def _clock_tag(self, micro: int, dest_stage: int, kind: str) -> int:
        """The clock travelling with that message: past every data tag (the largest is 2 m p v)."""
        return self._tag(micro, dest_stage, kind) + 2 * self.m * self.p * self.v

    def _clock_buffer(self):
        return torch.zeros(1, dtype=torch.float64, device=self.ctx.device)

    def _peer(self, stage: int) -> int | None:
        """Global rank holding a virtual stage; None when it is this rank (the V's turn)."""
        r = rank_of_stage(stage, self.p, self.vshape)
        return None if r == self.rank else self.ranks[r]

    def _send(self, tensor, stage: int, kind: str, micro: int, sends: list) -> None:
        peer = self._peer(stage)
        if peer is None:  # the V's turn: the next stage is on this rank
            self.mailbox[(kind, micro, stage)] = tensor
            return
        with comm("pp.send"):
            sends.append((dist.isend(tensor, dst=peer, tag=self._tag(micro, stage, kind)), tensor))
            if self.now is not None:
                clock = self._clock_buffer() + self.now
                sends.append((dist.isend(clock, dst=peer, tag=self._clock_tag(micro, stage, kind)), clock))

    def _post(self, stage: int, kind: str, micro: int, src_stage: int) -> None:
        """Post a receive now (irecv); the matching RECV waits for it."""
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.ctx.device)
        clock = None
        with comm("pp.irecv"):
            work = dist.irecv(buf, src=self._peer(src_stage), tag=self._tag(micro, stage, kind))
            if self.now is not None:
                buffer = self._clock_buffer()
                clock = (dist.irecv(buffer, src=self._peer(src_stage), tag=self._clock_tag(micro, stage, kind)), buffer)
        self.posted[(kind, micro, stage)] = (work, buf, clock)

    def _arrived(self, sent) -> None:
        """A message is in: the schedule's clock cannot be behind the one it was sent at."""
        self.now = max(self.now, sent.item())

    def _recv(self, stage: int, kind: str, micro: int, src_stage: int):
        peer = self._peer(src_stage)
        if peer is None:
            return self.mailbox.pop((kind, micro, stage))
        if (kind, micro, stage) in self.posted:
            work, buf, clock = self.posted.pop((kind, micro, stage))
            with comm("pp.recv_wait"):
                work.wait()
                if clock is not None:
                    clock[0].wait()
                    self._arrived(clock[1])
            return buf
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.ctx.device)
        with comm("pp.recv"):
            dist.recv(buf, src=peer, tag=self._tag(micro, stage, kind))
            if self.now is not None:
                buffer = self._clock_buffer()
                dist.recv(buffer, src=peer, tag=self._clock_tag(micro, stage, kind))
                self._arrived(buffer)
        return buf

    def run(self, micro_batches) -> float:
        """Forward and backward of every micro-batch (inputs, targets, positions); returns the mean
        loss (on every pipeline rank)."""
        inputs, outputs, losses, sends, recv_grad = {}, {}, {}, [], {}
        held, in_flight, peak = {}, 0, 0
        self.trace = []
        self.now = 0.0 if self.clocked else None
        t0 = time.perf_counter()
        for i, a in enumerate(self.actions):
            start, clock_start = time.perf_counter(), self.now
            key, stage = (a.micro, a.chunk), stage_of(self.rank, a.chunk, self.p, self.vshape)
            with span(PP_ACTION + repr(a)):
                if a.kind == "POST_B":
                    self._post(stage, "B", a.micro, stage + 1)
                elif a.kind == "RECV_F":
                    inputs[key] = self._recv(stage, "F", a.micro, stage - 1).detach().requires_grad_()
                elif a.kind == "RECV_B":
                    recv_grad[key] = self._recv(stage, "B", a.micro, stage + 1)
                elif a.kind == "SEND_F":
                    self._send(outputs[key].detach(), stage + 1, "F", a.micro, sends)
                elif a.kind == "SEND_B":
                    self._send(inputs.pop(key).grad, stage - 1, "B", a.micro, sends)
                elif a.kind == "F":
                    chunk = self.chunks[a.chunk]
                    x = micro_batches[a.micro][0] if chunk.first else inputs[key]
                    with self.meter.forward() if self.measure else contextlib.nullcontext(), span(FORWARD):
                        out = chunk(x, self.seq_len, micro_batches[a.micro][2])
                        if chunk.last:
                            loss = self.loss_fn(out, micro_batches[a.micro][1])
                            losses[key] = loss.detach()
                            # The sum over micro-batches is the global-batch mean (times fp16's loss scale).
                            out = loss / self.m if self.loss_scale == 1.0 else loss * (self.loss_scale / self.m)
                    outputs[key] = out
                    if self.measure:
                        held[key] = sum(self.meter.saved.values())
                        in_flight += held[key]
                        peak = max(peak, in_flight)
                else:  # B, I, W
                    sync = contextlib.nullcontext() if i in self.synced else self.grads.no_sync()
                    with sync, span(BACKWARD):
                        self._backward(a, outputs, recv_grad)
                    if a.kind in ("B", "I") and key in held:
                        in_flight -= held.pop(key)
            if self.now is not None and a.kind in UNIT_COSTS:
                self.now += UNIT_COSTS[a.kind]
            self.trace.append((repr(a), a.kind, start - t0, time.perf_counter() - t0)
                              + ((clock_start, self.now) if self.now is not None else ()))
        with comm("pp.wait"):
            for work, _ in sends:
                work.wait()
        self.now = None  # evaluate() and an unrecorded step send no clocks
        if self.measure:
            self.meter.peak = max(self.meter.peak, peak)
        return self._mean_loss(losses)

    def evaluate(self, micro_batches) -> float:
        """Forward only (the validation loss): every micro-batch through the virtual stages in order,
        each rank running the stages it holds; the mean loss on every pipeline rank. No schedule is
        needed: nothing waits for a backward, so a stage only waits for its input (sends are
        asynchronous), and no activation is kept."""
        stages = virtual_stages(self.rank, self.p, self.v, self.vshape)
        losses, sends = {}, []
        with torch.no_grad():
            for micro, (inputs, targets, positions) in enumerate(micro_batches):
                for c, stage in enumerate(stages):
                    chunk = self.chunks[c]
                    x = inputs if chunk.first else self._recv(stage, "F", micro, stage - 1)
                    with span(FORWARD):
                        out = chunk(x, self.seq_len, positions)
                    if chunk.last:
                        losses[(micro, c)] = self.loss_fn(out, targets)
                    else:
                        self._send(out, stage + 1, "F", micro, sends)
        with comm("pp.wait"):
            for work, _ in sends:
                work.wait()
        return self._mean_loss(losses)

    def _backward(self, a, outputs, recv_grad) -> None:
        key = (a.micro, a.chunk)
        if a.kind == "W":
            apply_weight_grads(self.weight_grads.pop(key))
            return
        out = outputs.pop(key)
        grad = recv_grad.pop(key, None)  # None on the last stage: `out` is the loss
        WeightGradStore.deferring = a.kind == "I"
        try:
            torch.autograd.backward(out, grad)
        finally:
            WeightGradStore.deferring = False
        if a.kind == "I":
            self.weight_grads[key] = WeightGradStore.flush()

    def _mean_loss(self, losses) -> float:
        """The last stage has the losses; every pipeline rank gets their mean."""
        device = self.ctx.device if self.ctx.backend == "nccl" else "cpu"
        total = torch.zeros((), dtype=torch.float64, device=device)
        if losses:
            total += sum(loss.double().to(device) for loss in losses.values()) / self.m
        if self.p > 1:
            with comm("pp.broadcast"):
                dist.broadcast(total, src=self.last_rank, group=self.ctx.group("pp"))
        return total.item()

    def write_trace(self, path: str, schedule_name: str) -> None:
        """Write the last step's recorded timeline of every pipeline rank (JSON, for `pp-schedule --trace`)."""
        from ultrascale.parallel.pipeline.draw import write_trace

        ranks = [None] * self.p
        dist.all_gather_object(ranks, self.trace, group=self.ctx.group("pp"))
        if self.ctx.is_logging_rank:
            # Ranks' clocks start at their own step start; they begin the step together (after the optimizer step).
            write_trace(path, schedule_name, self.p, self.v, [[tuple(x) for x in r] for r in ranks])
