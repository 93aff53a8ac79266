"""ZeRO-Offload: this rank's optimizer shard leaves the device, and AdamW steps on the host.

ZeRO cuts the optimizer states into N_d shards (zero.py); offload moves this
rank's shard off the accelerator too, for when even 1/N_d of them does not fit
(Ren et al. 2021, ZeRO-Offload; Rajbhandari et al. 2021, ZeRO-Infinity):

cpu   the fp32 master weights and AdamW's two moments live in host memory (pinned
      on CUDA, so copies run asynchronously) and AdamW steps there, as DeepSpeed's
      ZeRO-Offload does; with ZeRO-3 the parameter shards live there too and are
      copied to the device at each gather (FSDP2's CPUOffloadPolicy).
disk  the same states in files under --offload-dir (ZeRO-Infinity's NVMe tier),
      streamed through the host one segment at a time: read, stepped, written
      back. Only a segment's buffers are resident: the states leave RAM as well.

The optimizer step, segment by segment (at most SEGMENT elements of the shard):
  gradient  device -> host   (side stream on CUDA: the next segment's copy overlaps this step)
  states    file -> host     (disk)
  AdamW on the host          (torch's own AdamW arithmetic, per element)
  states    host -> file     (disk)
  master    host -> device   (side stream: the next segment's step overlaps the copy)
On a machine without an accelerator host and device are the same memory: the
copies are between two CPU tensors, and the same code runs (and is tested).

Per rank, with Psi parameters, this moves k*Psi/N_d bytes (k = 12: master and two
moments, fp32) off the device, and with ZeRO-3 the parameter shard (b*Psi/N_d).
The gradient shard stays on the device until the step copies it over. The price
is time: 4 bytes per element each way over PCIe, and an optimizer step at the
host's speed (plan/time.py).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
from torch import nn
from torch.optim.adamw import adamw

from ultrascale.errors import ConfigError

SEGMENT = 1 << 20  # elements streamed at once: 4 MiB per fp32 tensor
KINDS = ("master", "exp_avg", "exp_avg_sq")


def host_empty(numel: int, dtype, device) -> torch.Tensor:
    """Host memory for copies to and from `device`: pinned (page-locked) when that is a GPU, so
    the copies can run asynchronously on a side stream."""
    return torch.empty(numel, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


class HostStates:
    """This rank's masters and moments in host memory: one flat fp32 tensor per kind."""

    where = "cpu"

    def __init__(self, numel: int, device):
        self.flat = {k: host_empty(numel, torch.float32, device).zero_() for k in KINDS}

    def view(self, kind: str) -> torch.Tensor:
        """The whole flat tensor of `kind` (the optimizer's and the checkpoint's view of it)."""
        return self.flat[kind]

    def write(self, kind: str, lo: int, values: torch.Tensor) -> None:
        self.flat[kind][lo:lo + values.numel()].copy_(values)

    @contextlib.contextmanager
    def segment(self, slot: int, lo: int, hi: int):
        """{kind: tensor} of elements [lo, hi): in host memory already, so views."""
        yield {k: self.flat[k][lo:hi] for k in KINDS}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())


class DiskStates:
    """This rank's masters and moments in three files under `directory`, streamed in segments.

    The files are anonymous (unlinked at creation, like tempfile.TemporaryFile): they
    take space while the run lives and leave nothing behind, whatever way it ends. Their
    space is reserved up front, so a full disk is refused at start, not in the middle of
    a step. A memory map of each (`view`) serves checkpoints and comparisons only;
    training reads and writes through two segment-sized buffers per kind.
    """

    where = "disk"

    def __init__(self, numel: int, device, directory: str, rank: int):
        import numpy as np

        self.numel, self.files, self.mapped = numel, {}, {}
        for k in KINDS:
            try:
                os.makedirs(directory, exist_ok=True)  # every rank: several nodes may each have their own disk
                f = tempfile.TemporaryFile(dir=directory, prefix=f"ultrascale-rank{rank}-{k}-")
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(f.fileno(), 0, max(1, numel) * 4)
                else:
                    f.truncate(max(1, numel) * 4)
            except OSError as e:
                raise ConfigError(f"--offload-dir {directory}: cannot hold {3 * numel * 4 / 2**20:.1f} MiB of "
                                  f"optimizer states on rank {rank} ({e.strerror}): free space there or choose "
                                  f"another directory") from None
            self.files[k] = f
            # Zero-filled by the reservation: AdamW's moments start at zero.
            self.mapped[k] = torch.from_numpy(np.memmap(f, dtype=np.float32, mode="r+", shape=(max(1, numel),)))
        n = min(SEGMENT, max(1, numel))
        self.buffers = [{k: host_empty(n, torch.float32, device) for k in KINDS} for _ in range(2)]

    def view(self, kind: str) -> torch.Tensor:
        return self.mapped[kind][:self.numel]

    def _read(self, kind: str, lo: int, into: torch.Tensor) -> None:
        f = self.files[kind]
        f.seek(lo * 4)
        f.readinto(memoryview(into.numpy()).cast("B"))

    def write(self, kind: str, lo: int, values: torch.Tensor) -> None:
        f = self.files[kind]
        f.seek(lo * 4)
        f.write(memoryview(values.detach().contiguous().numpy()).cast("B"))
        f.flush()  # into the page cache, where the memory map (checkpoints) sees it

    @contextlib.contextmanager
    def segment(self, slot: int, lo: int, hi: int):
        """{kind: tensor} of elements [lo, hi), read into buffer set `slot`; written back on exit."""
        bufs = {k: self.buffers[slot][k][:hi - lo] for k in KINDS}
        for k in KINDS:
            self._read(k, lo, bufs[k])
        yield bufs
        for k in KINDS:
            self.write(k, lo, bufs[k])

    def nbytes(self) -> int:
        return 3 * self.numel * 4


class _Copies:
    """Copies between host and device: on CUDA asynchronous, on a side stream, each with an event
    to wait on; on the CPU plain copies (host and device are one memory)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        if self.stream is None:
            dst.copy_(src)
            return None
        # What the compute stream wrote (the gradients, last step's parameters) must be done first.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def join(self) -> None:
        """The compute stream waits for every copy issued so far (before it reads the parameters)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def _wait(event) -> None:
    if event is not None:
        event.synchronize()


class OffloadedMain:
    """ZeRO's main parameters off the device (the interface of precision.MainParams).

    pieces: ZeRO's (bucket, start, end) of this rank's shard; `main[i]` is piece i's
    fp32 master, a view of the host (or memory-mapped) flat tensor; `shard_view(b, s, e)`
    is where the compute copy of the piece lives (the device shard, or ZeRO-3's host shard),
    which `push` writes after each segment's step.
    """

    def __init__(self, pieces, initial, decay, shard_view, after_update, device, where: str, directory: str = "",
                 rank: int = 0):
        self.pieces, self.decay, self.where = pieces, decay, where
        self.shard_view, self.after_update = shard_view, after_update
        sizes = [end - start for _, start, end in pieces]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        numel = sum(sizes)
        self.states = (DiskStates(numel, device, directory, rank) if where == "disk"
                       else HostStates(numel, device))
        for off, values in zip(self.offsets, initial):  # masters copy the fp32 initial values
            self.states.write("master", off, values.detach().float().flatten().cpu())
        self.main = [nn.Parameter(self.states.view("master")[off:off + n], requires_grad=False)
                     for off, n in zip(self.offsets, sizes)]
        self.copies = _Copies(device)
        self.grads, self.pushed = None, False

    def segments(self):
        """(piece, lo, hi) in the flat coordinates of the states, each at most SEGMENT long."""
        for i, (off, m) in enumerate(zip(self.offsets, self.main)):
            for lo in range(off, off + m.numel(), SEGMENT):
                yield i, lo, min(lo + SEGMENT, off + m.numel())

    def piece_range(self, i: int, lo: int, hi: int) -> tuple:
        """Segment [lo, hi) of piece i as a slice of the piece."""
        return slice(lo - self.offsets[i], hi - self.offsets[i])

    def push(self, i: int, lo: int, hi: int, master: torch.Tensor):
        """Copy a stepped segment of the masters to the compute copy (casting to its dtype)."""
        b, start, _ = self.pieces[i]
        r = self.piece_range(i, lo, hi)
        dst = self.shard_view(b, start + r.start, start + r.stop)
        return self.copies.copy(dst, master)

    # -- MainParams' interface -------------------------------------------------
    def attach_grads(self, grads) -> None:
        """Keep the device gradients aside (a host tensor's .grad cannot be a device tensor)."""
        self.grads = grads
        self.pushed = False

    def detach_grads(self) -> None:
        self.grads = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if not self.pushed:  # after a checkpoint load: every master, from the states
            for slot, (i, lo, hi) in enumerate(self.segments()):
                with self.states.segment(slot % 2, lo, hi) as s:
                    _wait(self.push(i, lo, hi, s["master"]))
        self.copies.join()
        self.pushed = False
        self.after_update()

    def master_bytes(self) -> int:
        return 0  # on the device; the host's or the disk's are `offloaded_bytes`

    def offloaded_bytes(self) -> int:
        return self.states.nbytes()


class OffloadedAdamW(torch.optim.AdamW):
    """torch's AdamW over an OffloadedMain, stepped one segment at a time on the host.

    Its `state` holds, per master, views of the offloaded moments (what checkpoints save
    and load); `step` streams them. Each segment runs torch's functional AdamW (the code
    AdamW.step runs, element by element), so the result does not depend on the cut.
    """

    def __init__(self, main: OffloadedMain, groups, **hyper):
        super().__init__(groups, foreach=False, **hyper)
        self.offload = main
        for off, m in zip(main.offsets, main.main):
            self.state[m] = {"step": torch.tensor(0.0),
                             **{k: main.states.view(k)[off:off + m.numel()] for k in KINDS[1:]}}

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "closures are not supported"
        main = self.offload
        group_of = {id(m): g for g in self.param_groups for m in g["params"]}
        segments = list(main.segments())
        grads = [host_empty(min(SEGMENT, max(1, sum(m.numel() for m in main.main))), torch.float32,
                            main.copies.device) for _ in range(2)]

        def fetch(k):  # gradient segment k, device -> host
            i, lo, hi = segments[k]
            dst = grads[k % 2][:hi - lo]
            return dst, main.copies.copy(dst, main.grads[i].view(-1)[main.piece_range(i, lo, hi)])

        pushed = [None, None]
        nxt = fetch(0) if segments else None
        for k, (i, lo, hi) in enumerate(segments):
            grad, ready = nxt
            if k + 1 < len(segments):
                nxt = fetch(k + 1)  # overlaps this segment's step
            _wait(ready)
            _wait(pushed[k % 2])  # the buffers of segment k - 2 are free once their copy is done
            m = main.main[i]
            g = group_of[id(m)]
            step = self.state[m]["step"].clone()  # adamw adds one to it
            with main.states.segment(k % 2, lo, hi) as s:
                adamw([s["master"]], [grad], [s["exp_avg"]], [s["exp_avg_sq"]], [], [step],
                      foreach=False, amsgrad=False, beta1=g["betas"][0], beta2=g["betas"][1],
                      lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)
                pushed[k % 2] = main.push(i, lo, hi, s["master"])
        for m in main.main:
            self.state[m]["step"] += 1
        for event in pushed:
            _wait(event)
        main.pushed = True
