"""Checkpoints in torch.distributed.checkpoint (DCP), resumable in any layout.

A checkpoint directory (format 3, record.FORMAT):
    meta.json          the run record (train/record.py): the step, the whole resolved run, the
                       tokenizer and data it trained on, the router biases, and "files": every
                       other file below with its size and CRC-32
    .metadata          DCP's index: every tensor's full shape and where each chunk lies
    __N_0.distcp       the chunks rank N wrote (empty for a rank that holds nothing to write)

What is stored is layout-free: for every parameter, under its single-device
name, the fp32 master value (`model.<name>`) and AdamW's two moments
(`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`), as rectangular chunks of the
full tensor with their offsets (parallel/placement.py says which chunks this
rank holds: whole parameters, tensor-parallel slabs, ZeRO flat pieces cut into
rectangles). DCP's own resharding then gives every rank of any other layout
exactly the elements it holds, and the standard tools read it:
`python -m torch.distributed.checkpoint.format_utils dcp_to_torch_save DIR out.pt`
gives one file of full tensors. meta.json keeps the training step (the data
position: the batches are a pure function of (seed, step)) and Adam's own step
count beside it: the updates made, fewer than the steps when fp16 skipped some
(an overflow skips the update, and Adam's bias correction counts updates).

A checkpoint knows when it is damaged (train/integrity.py): every reader checks
that each listed file is there with its size, and `ultrascale train --resume` and
`export` check every byte against its checksum before loading anything; a
missing, truncated or changed file is one line naming it. Format 2 (no file
list) still loads, with a warning that it cannot be verified. Damage the checksums
cannot show (format 2's, or a meta.json rewritten to match changed files) is met
by DCP while it reads: that too is one line, naming the checkpoint (`_reading`).

Saves are atomic: every rank writes into `DIR.tmp`; when all have finished,
each rank checksums its own files, and rank 0 adds meta.json and swaps it in
(DIR -> DIR.old, DIR.tmp -> DIR, DIR.old removed). A crash anywhere in a save
leaves the previous checkpoint whole: as `DIR` with a partial `DIR.tmp` beside
it (ignored by readers, removed by the next run that saves, or at once by the
launcher when a rank died), or, between the two renames, as `DIR.old` with no
`DIR`, which the next reader renames back (record.put_back_old). A save that
cannot write (a full disk) removes its `DIR.tmp` and ends the run in one line,
the previous checkpoint intact. Every rank must see the same directory: on
several machines, a filesystem shared by all of them (checked when the run
starts, see `check_shared`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ultrascale.errors import ConfigError
from ultrascale.train import integrity
from ultrascale.train.data import data_identity, tokenizer_identity
from ultrascale.train.record import RunRecord, put_back_old, read_record, verified, write_record

KINDS = ("model", "optim.exp_avg", "optim.exp_avg_sq")


# -- DCP planners over explicit chunks ------------------------------------------
class _ChunkSavePlanner(DefaultSavePlanner):
    """Writes the given {(fqn, offsets): tensor} chunks of tensors of known full shapes.
    DCP's global plan merges every rank's chunks into one index and checks they tile
    each tensor exactly."""

    def __init__(self, chunks: dict, full_shapes: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks, self.full_shapes = chunks, full_shapes

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        super().set_up_planner({}, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape),
                               properties=TensorProperties.create_from_tensor(t),
                               size=torch.Size(self.full_shapes[fqn])))
                 for (fqn, offsets), t in self.chunks.items()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item):
        return self.chunks[(write_item.index.fqn, tuple(write_item.index.offset))]


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads into the given {(fqn, offsets): tensor view} chunks, whatever chunks were saved."""

    def __init__(self, chunks: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        super().set_up_planner({}, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        by_fqn: dict[str, list] = {}
        for fqn, offsets in self.chunks:
            by_fqn.setdefault(fqn, []).append(offsets)
        items = []
        for fqn, offsets_list in by_fqn.items():
            saved = self.metadata.state_dict_metadata.get(fqn)
            if saved is None:
                raise ConfigError(f"the checkpoint has no tensor {fqn!r}: it was written for another model")
            wanted = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=self.chunks[(fqn, o)].shape)
                      for o in offsets_list]
            items += create_read_items_for_chunk_list(fqn, saved, wanted)
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.chunks[(index.fqn, tuple(index.offset))]


# -- what this rank holds ------------------------------------------------------------
def _optimizer_chunks(trainer, writing: bool) -> tuple[dict, dict]:
    """{(fqn, offsets): view} of this rank's masters and Adam moments, and {fqn: full shape}."""
    from ultrascale import parallel

    opt, main = trainer.opt, trainer.main.main
    chunks, shapes = {}, {}
    for c in parallel.optimizer_chunks(trainer.grads, trainer.names, trainer.ctx, writing):
        m = main[c.index]
        state = opt.state[m]
        for kind, tensor in zip(KINDS, (m.detach(), state["exp_avg"], state["exp_avg_sq"])):
            fqn = f"{kind}.{c.name}"
            chunks[(fqn, c.offsets)] = c.view(tensor)
            shapes[fqn] = c.full_shape
    return chunks, shapes


def _ensure_adam_state(opt, step: int) -> None:
    """AdamW creates its state on the first step; a resumed run needs it now, to load into."""
    for group in opt.param_groups:
        for m in group["params"]:
            state = opt.state[m]
            if not state:
                state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
            # On the parameter's device: the fused AdamW reads its step there (a CPU tensor beside CUDA ones fails).
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=m.device)


def _router_biases(trainer) -> dict:
    """{buffer name: values} of every MoE router bias (aux-loss-free balancing), all pipeline stages'.
    Replicated on every rank of a stage (the loads are summed over data parallelism): meta.json holds them."""
    mine = {n: b.tolist() for n, b in trainer.model.named_buffers() if n.endswith("router_bias")}
    if trainer.ctx.size("pp") > 1:
        stages = [None] * trainer.ctx.size("pp")
        dist.all_gather_object(stages, mine, group=trainer.ctx.group("pp"))
        mine = {n: v for stage in stages for n, v in stage.items()}
    return mine


# -- save and load -------------------------------------------------------------------
@contextlib.contextmanager
def _quiet():
    """DCP warns that one process means no process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _paths(path: str):
    path = path.rstrip("/")
    return path, path + ".tmp", path + ".old"


def save(path: str, trainer) -> None:
    ctx = trainer.ctx
    path, tmp, old = _paths(path)
    if ctx.rank == 0:
        clean_partial(path)  # a partial save of an earlier, interrupted run
        os.makedirs(tmp)
    ctx.barrier()
    try:
        if any(not trainer.opt.state[m] for g in trainer.opt.param_groups for m in g["params"]):
            # No update yet (a save before any step, or after fp16 skipped them all): AdamW has not made
            # its state; a fresh one (zero moments, no updates) is what the next update would start from.
            _ensure_adam_state(trainer.opt, trainer.optimizer_steps)
        chunks, shapes = _optimizer_chunks(trainer, writing=True)
        biases = _router_biases(trainer)
        with _quiet():
            dcp.save({}, storage_writer=_writer(tmp, trainer.step, ctx.rank),
                     planner=_ChunkSavePlanner(chunks, shapes), no_dist=not ctx.is_distributed)
        files = _describe_files(tmp, ctx)  # rank 0 waits here for every rank's part
        if ctx.rank == 0:
            t = trainer.cfg.train
            write_record(tmp, RunRecord(
                step=trainer.step, config=trainer.cfg, optimizer_steps=trainer.optimizer_steps,
                world_size=ctx.world_size, tokenizer=tokenizer_identity(t.tokenizer), data=data_identity(t.data),
                router_bias=biases, loss_scale=trainer.scaler.state_dict() if trainer.scaler is not None else None,
                files=files))
            _swap_in(path, tmp, old, trainer.step)
    except BaseException as e:
        if ctx.rank == 0:
            clean_partial(path)
        _raise_if_unwritable(e, path)
        raise
    ctx.barrier()


def _describe_files(tmp: str, ctx) -> dict | None:
    """On rank 0, meta.json's {file: {bytes, crc32}} of every file DCP wrote (a rank that holds
    nothing to write still writes its empty `__N_0.distcp`: listed too). When dcp.save returns,
    every rank's files are complete. Each rank checksums those it wrote itself (`__RANK_*`,
    still in its page cache) in parallel; rank 0 also the index and any other."""
    names = sorted(n for n in os.listdir(tmp) if n != "meta.json")
    mine = [n for n in names if _writer_rank(n, ctx.world_size) == ctx.rank]
    described = integrity.describe(tmp, mine)
    if not ctx.is_distributed:
        return described
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(described, gathered, dst=0)
    return {n: d for part in gathered for n, d in sorted(part.items())} if ctx.rank == 0 else None


def _writer_rank(name: str, world: int) -> int:
    """The rank that wrote a file of DCP's: `__N_0.distcp` is rank N's; the index rank 0's."""
    head = name[2:].split("_", 1)[0] if name.startswith("__") else ""
    return int(head) if head.isdigit() and int(head) < world else 0


def _swap_in(path: str, tmp: str, old: str, step: int) -> None:
    """DIR.tmp becomes DIR. Between the two renames there is no DIR: a crash there leaves the
    previous checkpoint as DIR.old, which every reader puts back (record.put_back_old)."""
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    _fault("swap", step, 0)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _raise_if_unwritable(e: BaseException, path: str) -> None:
    """A file the save could not write (a full disk, a quota, a read-only mount): one line naming
    it, the previous checkpoint being intact. DCP reports each rank's failure inside a
    CheckpointException, on every rank."""
    causes = [e] + [failure[0] for failure in getattr(e, "failures", {}).values()]
    err = next((c for c in causes if isinstance(c, OSError)), None)
    if err is None:
        # torch.save's zip writer sees a short write only as a position it did not reach ("unexpected
        # pos"), without the OS error: on a disk, a quota or a file-size limit that is full.
        short = next((c for c in causes if isinstance(c, RuntimeError) and "unexpected pos" in str(c)), None)
        if short is None:
            return
        err = OSError("a write stopped short, the disk, its quota or the file-size limit (ulimit -f) full")
    where, step = err.filename or path + ".tmp", _saved_step(path)
    then = (f"{path} still holds step {step}: free space there (or pass another --save) and continue with "
            f"--resume {path}" if step is not None else "nothing was saved: free space there or pass another --save")
    raise ConfigError(f"--save {path}: cannot write {where}: {err.strerror or err}; {then}") from None


def _saved_step(path: str) -> int | None:
    try:
        return read_record(path, "--save").step
    except (ConfigError, OSError):
        return None


# -- the crash tests' hook -------------------------------------------------------------
FAULT_ENV = "ULTRASCALE_SAVE_FAULT"


def _fault(point: str, step: int, rank: int, file: str = "") -> None:
    """For tests of what a crash or a full disk during a save leaves (tests/test_checkpoint_damage.py):
    ULTRASCALE_SAVE_FAULT="point=P,step=S,action=A[,rank=R]" acts in the save of step S, on rank R
    (default: every rank), at point P: "write" (a chunk file of DCP's written, its index not
    yet) or "swap" (rank 0, between the two renames). Action "pause" prints a line and sleeps
    until the process is killed, so a test can kill it exactly there; "enospc" raises the
    OSError a full disk gives. Unset, the save never looks further."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    f = dict(kv.split("=", 1) for kv in spec.split(","))
    if f["point"] != point or int(f["step"]) != step or int(f.get("rank", rank)) != rank:
        return
    if f["action"] == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)
    print(f"save paused at {point}, step {step}, rank {rank}", flush=True)
    while True:
        time.sleep(60)


def _writer(tmp: str, step: int, rank: int):
    """DCP's file writer; under ULTRASCALE_SAVE_FAULT, with the "write" point after each chunk file."""
    writer = dcp.FileSystemWriter(tmp)
    if os.environ.get(FAULT_ENV):
        create = writer.fs.create_stream

        @contextlib.contextmanager
        def create_stream(file, mode):
            with create(file, mode) as stream:
                yield stream
                if str(file).endswith(".distcp"):
                    _fault("write", step, rank, str(file))

        writer.fs.create_stream = create_stream
    return writer


def load(path: str, trainer) -> int:
    """Fill this rank's masters and Adam moments from `path`, whatever layout wrote it; the step.

    Every listed file is checked for its size here, on each rank (read_record); the checksums
    were checked once before the run started (`ultrascale train`), or call `record.verified`."""
    record = read_record(path)
    trainer.optimizer_steps = record.optimizer_steps  # Adam's count of updates
    _ensure_adam_state(trainer.opt, trainer.optimizer_steps)
    chunks, _ = _optimizer_chunks(trainer, writing=False)
    _read_index(path, "--resume")  # a damaged index named as such (DCP reads it again, each rank)
    with _quiet(), _reading(path, "--resume", alone=not trainer.ctx.is_distributed):
        dcp.load({}, storage_reader=dcp.FileSystemReader(path), planner=_ChunkLoadPlanner(chunks),
                 no_dist=not trainer.ctx.is_distributed)
    trainer.main.copy_to_model()  # masters -> compute parameters (and ZeRO's all-gather)
    if trainer.scaler is not None and record.loss_scale is not None:
        trainer.scaler.load_state_dict(record.loss_scale)
    saved = model_buffers(record)
    with torch.no_grad():
        for name, b in trainer.model.named_buffers():
            if name in saved:
                b.copy_(saved[name].to(b.dtype))
    return record.step


def read_full_state(path: str) -> tuple[RunRecord, dict]:
    """(the run record, {single-device name: full fp32 tensor}) of a checkpoint, in
    this one process (for export): DCP assembles each tensor from the chunks of all ranks."""
    from ultrascale.train.resume import latest

    path = latest(path)  # a directory of per-step saves (--keep-last): the latest
    record = verified(path, what="checkpoint")  # every byte, before DCP reads any
    index = _read_index(path, "checkpoint")
    full = {fqn[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
            for fqn, md in index.state_dict_metadata.items() if fqn.startswith("model.")}
    chunks = {(f"model.{name}", (0,) * t.dim()): t for name, t in full.items()}
    with _quiet(), _reading(path, "checkpoint", alone=True):
        dcp.load({}, storage_reader=dcp.FileSystemReader(path), planner=_ChunkLoadPlanner(chunks), no_dist=True)
    return record, full


def model_buffers(record: RunRecord) -> dict:
    """{buffer name: tensor} of what the model's forward reads beside its parameters and that training
    changes: every MoE router bias (aux-loss-free balancing), kept in meta.json. RoPE's tables are
    not here: they follow from the shape."""
    return {name: torch.tensor(values, dtype=torch.float32) for name, values in record.router_bias.items()}


def trained_model(path: str, device="cpu"):
    """The model a checkpoint holds, in one process, as training left it: its shape from the run
    record, every parameter assembled from every rank's chunks, and its buffers (router biases).
    What `generate` runs; `export` writes the same tensors."""
    from ultrascale.model.transformer import build_model
    from ultrascale.train.resume import latest

    record, state = read_full_state(latest(path))
    model = build_model(record.config.model, seed=0, source={**state, **model_buffers(record)}).to(device)
    unread = sorted(set(record.router_bias) - {name for name, _ in model.named_buffers()})
    if unread:  # a bias the model has no place for would be dropped: another model
        raise ConfigError(f"checkpoint {path}: its run record holds router biases the model has no buffer for "
                          f"({unread[0]}): the checkpoint is damaged; use another checkpoint")
    return model


def _read_index(path: str, what: str):
    """DCP's index of the checkpoint (`.metadata`); one that cannot be decoded is one line naming it."""
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - whatever unpickling a damaged file raises
        raise ConfigError(f"{what} {path}: {os.path.join(path, '.metadata')}, the index of its tensors, cannot "
                          f"be read ({_said(e)}): the checkpoint is damaged; {integrity._FIX}") from None


@contextlib.contextmanager
def _reading(path: str, what: str, alone: bool):
    """DCP reading the tensors of the checkpoint `path`: a file it cannot decode is one line naming
    the checkpoint.

    The checksums find damage before anything is read, but not in a checkpoint without them
    (format 2), nor in one whose meta.json was rewritten to match its files: there DCP itself
    meets the truncated or changed file. It reports a failed read or plan as a
    CheckpointException (a BaseException), on every rank at once; a planner's own ConfigError
    inside it is that error. Other exceptions are DCP's own only when it runs `alone` (no process
    group): with one, they are collectives that failed (a rank lost), which the run reports as such."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except ConfigError:
        raise
    except CheckpointException as e:
        causes = [failure[0] for _, failure in sorted(e.failures.items())]
        own = next((c for c in causes if isinstance(c, ConfigError)), None)
        if own is not None:
            raise ConfigError(str(own)) from None
        raise _damaged(path, what, causes[0] if causes else e) from None
    except Exception as e:  # noqa: BLE001 - any failure to decode the files is the same damage
        if not alone:
            raise
        raise _damaged(path, what, e) from None


def _damaged(path: str, what: str, cause: BaseException) -> ConfigError:
    return ConfigError(f"{what} {path}: its tensor files cannot be read ({_said(cause)}): the checkpoint is "
                       f"damaged; {integrity._FIX}")


def _said(e: BaseException) -> str:
    """The first sentence of an exception's message ("PytorchStreamReader failed reading zip archive:
    ..."), or its name where it has none (an EOFError: a file ends early)."""
    text = str(e).strip()
    return text.splitlines()[0].split(". ")[0][:100] if text else type(e).__name__


def check_shared(path: str, ctx) -> None:
    """Before training: every rank must see the directory rank 0 creates (one filesystem)."""
    if not ctx.is_distributed:
        return
    _, tmp, _ = _paths(path)
    if ctx.rank == 0:
        os.makedirs(tmp, exist_ok=True)
    ctx.barrier()
    missing = torch.tensor([0 if os.path.isdir(tmp) else 1])
    dist.all_reduce(missing)
    if ctx.rank == 0:
        os.rmdir(tmp)  # only the probe: every rank has looked (the all-reduce waited for all)
    if missing.item():
        raise ConfigError(f"--save {path}: {missing.item()} of {ctx.world_size} ranks cannot see the directory "
                          f"rank 0 created: checkpoints need a filesystem shared by every node")


def clean_partial_saves(save: str, per_step: bool) -> None:
    """clean_partial of --save, and with --keep-last (per_step) of every DIR/step-N a save left
    unfinished (its step-N.tmp, or a step-N.old with no step-N). Call it from one process."""
    clean_partial(save)
    if per_step and os.path.isdir(save):
        for name in os.listdir(save):
            base, _, suffix = name.rpartition(".")
            if base.startswith("step-") and suffix in ("tmp", "old"):
                clean_partial(os.path.join(save, base))


def clean_partial(path: str) -> None:
    """Remove what an interrupted or failed `save` left: `DIR.tmp`, and put back `DIR.old`.

    `save` writes into DIR.tmp and only then swaps it in (DIR -> DIR.old, DIR.tmp -> DIR),
    so DIR.tmp is never a finished checkpoint anyone relies on; DIR.old is the last good
    one only if the swap stopped half-way (DIR missing). Call it from one process.
    """
    path = path.rstrip("/")
    tmp, old = path + ".tmp", path + ".old"
    put_back_old(path)
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
