"""The training loop: one optimizer step over a global batch, repeated.

A step: zero the fp32 gradients; for each micro-batch run forward and backward
with the loss divided by the number of micro-batches (so the sum is the mean over
the global batch), communicating only after the last one; clip; let AdamW update
the fp32 main parameters; copy them back to the compute parameters.
Under fp16 the loss is also multiplied by the dynamic loss scale, the gradients
divided by it after the reduction, and a step whose gradients are not finite on
some rank is skipped by every rank (train/loss_scale.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from ultrascale import parallel
from ultrascale.config import RunConfig
from ultrascale.distributed import failures
from ultrascale.distributed.context import ParallelContext
from ultrascale.errors import Diverged, no_room, no_room_error
from ultrascale.model import build_model, flops_per_token
from ultrascale.model.moe import moe_layers, step_loads, update_router_bias
from ultrascale.spans import BACKWARD, EVAL, FORWARD, OPTIMIZER, STEP, comm, span
from ultrascale.train import resume
from ultrascale.train.data import check_eval, is_prepared_spec, load_tokenizer, prepared_tokenizer, run_batches
from ultrascale.train.header import header_lines, start_lines, tokenizer_words
from ultrascale.train.loss_scale import DynamicLossScaler
from ultrascale.train.metrics import ActivationMeter, optimizer_state_tensors, peak_resident_bytes, storage_bytes
from ultrascale.train.optim import build_adamw, clip_grad_norm_, lr_at
from ultrascale.train.peak import above_peak_warning, describe_device, run_peak
from ultrascale.train.profile import profile_window
from ultrascale.train.recompute import apply_recompute


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    state: dict | None = None  # the final fp32 parameters, by single-device name
    # The first step's reduced gradients (before clipping and any update), by single-device
    # name; kept only when asked for (run_training(..., keep_first_grads=True)).
    first_grads: dict | None = None


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: ParallelContext, log_to_stdout: bool = False,
                 keep_first_grads: bool = False):
        self.cfg, self.ctx, self.log_to_stdout = cfg, ctx, log_to_stdout
        self.keep_first_grads, self.first_grads = keep_first_grads, None
        t = cfg.train
        from ultrascale.parallel.precision import check_dtype_support

        check_dtype_support(t.dtype, ctx.device)  # before any work: a dtype this device cannot run
        self.scaler = (DynamicLossScaler(t.loss_scale_init, t.loss_scale_window) if t.dtype == "fp16" else None)
        # A prepared corpus names the tokenizer it was made with; a raw one is tokenized with --tokenizer.
        vocab = (prepared_tokenizer(t.data).get("vocab_size", 257) if is_prepared_spec(t.data)
                 else load_tokenizer(t.tokenizer).vocab_size)
        if vocab > cfg.model.vocab_size:
            from ultrascale.errors import ConfigError

            raise ConfigError(f"the tokenizer has {vocab} tokens but the model only "
                              f"{cfg.model.vocab_size}: pass --vocab-size {vocab}")
        self.data, self.val, self.data_line = run_batches(t, cfg.global_batch)
        check_eval(t, self.val, cfg.global_batch)  # under torchrun no launcher checked it

        # --init-from hf:DIR: trained weights instead of the random draw; each rank reads the
        # full tensors it needs and keeps its slice of them, whatever the layout.
        source = None
        if t.init_from:
            from ultrascale.model.hf import hf_weights, parse_init_from

            source = hf_weights(parse_init_from(t.init_from), cfg.model)
        self.model = build_model(cfg.model, t.seed, ctx.device, transform=parallel.shard_model(ctx, cfg),
                                 source=source)
        apply_recompute(self.model, t.recompute)
        parallel.compile_model(self.model, cfg)  # --compile: after sharding and recomputation, before dp
        self.moe = moe_layers(self.model)
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        params = [p for p in self.model.parameters() if p.requires_grad]
        # The gradient owner also casts the model to the compute dtype and makes the
        # tensors the optimizer updates (fp32 masters, ZeRO shards of them).
        self.grads = parallel.build_grads(self.model, params, ctx, cfg)
        self.main = self.grads.main
        self.model_parallel_sq = parallel.grad_norm_reducer(ctx)
        # A tensor replicated on several ranks that all add to the norm counts 1/copies on each.
        self.norm_shares = [getattr(p, "grad_norm_share", 1.0) * s
                            for p, s in zip(self.grads.grad_owners(), self.grads.norm_shares())]
        self.loss_fn = parallel.loss_function(ctx, cfg)
        # --offload: the main parameters live off the device, and so does the optimizer's step.
        self.offloaded = self.main if self.main.where else None
        self.opt = build_adamw(self.main.main, self.main.decay, t, self.offloaded)
        self.meter = ActivationMeter(list(self.model.parameters()) + list(self.model.buffers()))
        self.pipeline = parallel.pipeline_runtime(self.model, ctx, cfg, self.grads, self.loss_fn, self.meter)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        # The ceiling of MFU, per device (--peak; measuring it is collective: every rank is here).
        self.peak, self.peak_source, self.peak_origin = run_peak(t.peak, ctx.device, t.dtype, ctx.world_size)
        self.step = 0
        self.updates, self.saved_step = 0, None  # this run's optimizer updates and last save: what a divergence says
        # AdamW's updates since the run began, resumes included: its bias correction counts these, not
        # the steps (an fp16 step that overflowed is skipped); a checkpoint keeps it.
        self.optimizer_steps = 0
        if t.save or t.resume:
            # torch.distributed.checkpoint (and DTensor, sympy under it) costs a second per process to
            # import: only the runs that save or resume pay it.
            from ultrascale.train import checkpoint
        if t.save and ctx.rank == 0:
            checkpoint.clean_partial_saves(t.save, bool(t.keep_last))  # what a killed run left
        if t.resume:
            self._resume(t.resume)
        if t.save:
            checkpoint.check_shared(t.save, ctx)  # before any work, not after the last step

    # -- one step -----------------------------------------------------------
    def backward_scale(self) -> float:
        """What each rank's backward starts from, besides 1 / micro-batches: 1 without fp16; with it,
        the loss scale divided by the dp x cp ranks whose gradients are averaged. Each of those
        ranks' losses is the mean over its own share of the global batch, dp x cp times its share of
        the global mean, and the average divides that away only after backward: without the
        division every fp16 gradient in backward would be dp x cp times one process's, and
        overflow (and skip the step) where one process does not. With it, each micro-batch's
        backward carries what one process's carries, and the overflow decision is one process's."""
        if self.scaler is None:
            return 1.0
        return self.scaler.scale / self.ctx.size("dp_cp")

    def forward_backward(self, micro_batches) -> float:
        """Run every micro-batch (inputs, targets, positions); return the mean loss of this rank's micro-batches."""
        scale = self.backward_scale()
        for m in self.moe:
            # The balance losses join each micro-batch's loss as the loss does: scaled, and divided by
            # the micro-batches (their gradient is injected in backward, past the loss's scaling).
            m.aux_scale = scale / self.cfg.train.grad_accum
        if self.pipeline is not None:
            self.pipeline.loss_scale = scale
            return self.pipeline.run(micro_batches)
        n = len(micro_batches)
        total = torch.zeros((), device=self.ctx.device)
        for j, (inputs, targets, positions) in enumerate(micro_batches):
            sync = contextlib.nullcontext() if j == n - 1 else self.grads.no_sync()
            measure = self.meter.forward() if self.cfg.train.measure_activations else contextlib.nullcontext()
            with sync:
                with measure, span(FORWARD):
                    loss = self.loss_fn(self.model(inputs, positions), targets)
                with span(BACKWARD):
                    (loss * (scale / n) if scale != 1.0 else loss / n).backward()
            total += loss.detach()
        return (total / n).item()

    def train_step(self) -> dict:
        cfg, ctx, t = self.cfg, self.ctx, self.cfg.train
        start = time.perf_counter()
        micro_batches = self.data.micro_batches(self.step, ctx.coords["dp"], cfg.parallel.dp, t.grad_accum, ctx.device)
        micro_batches = parallel.shard_sequences(micro_batches, ctx, cfg)  # context parallelism: this rank's tokens
        self.grads.zero()
        for m in self.moe:
            m.reset_stats()
        loss = self.forward_backward(micro_batches)
        self.grads.finish()
        scale, finite = None, True
        if self.scaler is not None:
            # Unscale, and agree over every rank whether any gradient overflowed.
            scale = self.scaler.scale
            finite = self.scaler.unscale_and_check(self.grads.grads(), world=ctx.world_size > 1,
                                                   applied=self.backward_scale())
            if not finite and scale <= self.scaler.min_scale:
                # No smaller scale to try: every later step would overflow and be skipped too (DeepSpeed
                # stops here as well).
                raise Diverged(self._diverged(f"the gradients overflow fp16 at loss scale {scale:g}, the smallest",
                                              lr_at(self.step, t)))
            self.scaler.update(finite)
        if self.keep_first_grads and self.first_grads is None and finite:  # fp16: the first step not skipped
            # The parallel algebra itself, before the optimizer can amplify or hide anything.
            self.first_grads = parallel.full_state(self.names, self.grads.params, self.grads.full_grads(), ctx)
        grad_norm, lr = self.optimizer_step(finite)
        moe = self._moe_step() if self.moe else None
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        elapsed = time.perf_counter() - start
        self.step += 1
        with comm("loss.all_reduce"):
            loss = ctx.all_reduce_mean(loss)
        tokens = cfg.global_batch * t.seq_len
        tokens_per_s = tokens / elapsed
        # MFU = FLOPs per token x tokens/s / (peak x devices): per device on both sides.
        tflops = tokens_per_s * self.flops_per_token / ctx.world_size / 1e12  # per device
        return {
            "step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
            "tokens_per_s": tokens_per_s, "tflops": tflops,
            # Above 100%, MFU says only that the peak is wrong: left out, and flagged (one warning, _Log).
            "mfu": tflops / self.peak if self.peak and tflops <= self.peak else None,
            "mfu_above_peak": bool(self.peak) and tflops > self.peak,
            "peak_tflops": self.peak, "peak_source": self.peak_source,
            "step_time_s": elapsed, "memory": self.memory(),
            **({"moe": moe} if moe is not None else {}),
            **({"loss_scale": scale, "skipped": not finite} if scale is not None else {}),
        }

    def eval_batches(self) -> int:
        """Validation batches per evaluation: --eval-batches, or as many as the held-out split holds."""
        return 0 if self.val is None else min(self.cfg.train.eval_batches, self.val.batches_in_order())

    def evaluate(self) -> float:
        """The mean loss over the first eval_batches() global batches of the held-out split: each rank
        its rows, forward only, averaged over the data ranks as the training loss is (the same global
        batch, whatever the layout, so every layout's validation loss is one process's)."""
        cfg, ctx, t = self.cfg, self.ctx, self.cfg.train
        was_training = self.model.training
        self.model.eval()
        total, n = 0.0, self.eval_batches()
        try:
            for b in range(n):
                micro_batches = self.val.micro_batches(b, ctx.coords["dp"], cfg.parallel.dp, t.grad_accum, ctx.device)
                micro_batches = parallel.shard_sequences(micro_batches, ctx, cfg)
                with torch.no_grad(), span(EVAL):
                    if self.pipeline is not None:
                        loss = self.pipeline.evaluate(micro_batches)
                    else:
                        loss = sum(self.loss_fn(self.model(x, pos), y).item() for x, y, pos in micro_batches)
                        loss /= len(micro_batches)
                with comm("loss.all_reduce"):
                    total += ctx.all_reduce_mean(loss)
        finally:
            self.model.train(was_training)
            for m in self.moe:  # a forward's routing counts belong to the training step that follows
                m.reset_stats()
        return total / n

    def optimizer_step(self, finite: bool = True) -> tuple[float | None, float]:
        """Clip the reduced gradients, update the main parameters, copy them to the model; a step
        whose gradients overflowed (fp16) is skipped, and has no meaningful norm."""
        t = self.cfg.train
        lr = lr_at(self.step, t)
        if not finite:
            return None, lr
        with span(OPTIMIZER):
            grads = self.grads.grads()
            grad_norm = clip_grad_norm_(grads, t.grad_clip, self._reduce_norm_sq, self.norm_shares)
            if not math.isfinite(grad_norm):
                raise Diverged(self._diverged(f"the gradient norm is {grad_norm}", lr))
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.main.attach_grads(grads)
            self.opt.step()
            self.updates += 1
            self.optimizer_steps += 1
            self.main.detach_grads()
            self.main.copy_to_model()
        return grad_norm, lr

    def _diverged(self, what: str, lr: float) -> str:
        """Why the run stops: a NaN or infinite gradient would make every parameter NaN in this
        update (Megatron's check for NaN in the loss and gradients), and an fp16 overflow at the
        smallest loss scale would be skipped at every step from here on. Both are agreed over every
        rank (the norm is reduced, the overflow flag too), so all of them stop here together, before
        the update: the parameters, and every checkpoint, stay those of the step before. A plain
        resume would only diverge again (the same batches, the same schedule): the line says what
        to start again with, or how to go back to the last save with another schedule."""
        t = self.cfg.train
        kept = f" ({t.save} holds step {self.saved_step}, saved before it)" if self.saved_step else ""
        head = f"step {self.step + 1}: {what}: training diverged, and stopped before this step's update{kept}. "
        wider = {"bf16": "fp32", "fp16": "bf16"}.get(t.dtype)  # a dtype with more range, if any
        if not self.updates:  # nothing this run did moved the weights: the learning rate is not the cause
            return (head + f"No update of this run came before it: look at the weights it started from "
                    f"(--init-from, --resume) and the data" + (f", or train with --dtype {wider}" if wider else ""))
        also = ("" if t.grad_clip else ", with --grad-clip 1.0") + (f", or --dtype {wider}" if wider else "")
        back = (f"; or go back to step {self.saved_step} with --resume {t.save} --override-schedule and a lower "
                f"--lr" if self.saved_step else "")
        return (head + f"Start again with a lower --lr (now {t.lr:g}, {lr:.3g} at this step) or a longer "
                f"--warmup-steps (now {t.warmup_steps}){also}{back}")

    def _moe_step(self) -> dict:
        """Loads of this step's tokens over all data ranks: the router bias update, and the metrics
        (of the MoE layers on this pipeline stage)."""
        import torch.distributed as dist

        groups = [self.ctx.group(g) for g in ("dp_cp",) + (("tp",) if self.cfg.parallel.sp else ())]

        def reduce_sum(t):
            for g in groups:
                if g is not None:
                    with comm("moe.stats_all_reduce"):
                        dist.all_reduce(t, group=g)
            return t

        counts, (dropped, assigned, aux, z, calls) = step_loads(self.model, reduce_sum)
        update_router_bias(self.model, counts)
        cv = (counts.std(dim=1, unbiased=False) / counts.mean(dim=1)).mean()
        return {"tokens_per_expert_min": int(counts.min()), "tokens_per_expert_max": int(counts.max()),
                "tokens_per_expert_cv": float(cv), "dropped_fraction": float(dropped / assigned),
                "aux_loss": float(aux / calls), "z_loss": float(z / calls)}

    def _reduce_norm_sq(self, sq):
        sq = self.grads.reduce_norm_sq(sq)
        return self.model_parallel_sq(sq) if self.model_parallel_sq else sq

    def memory(self) -> dict:
        mem = {
            "params": storage_bytes(self.grads.param_tensors()),
            "grads": storage_bytes(self.grads.grads()),
            "optim": storage_bytes(optimizer_state_tensors(self.opt)) + self.main.master_bytes(),
            "activations": self.meter.take_peak() if self.cfg.train.measure_activations else None,
            "peak_rss": peak_resident_bytes(),
        }
        if self.offloaded is not None:
            # Off the device: the optimizer's shard, in host memory or files ("to"), and ZeRO-3's parameter
            # shard, in host memory whatever the optimizer's tier ("params_to").
            zero3 = self.cfg.parallel.zero == 3
            mem["offloaded"] = {"to": self.offloaded.where, "optim": self.offloaded.offloaded_bytes(),
                                "params": mem["params"] if zero3 else 0, "params_to": "cpu" if zero3 else None}
            mem["optim"] = 0
            mem["params"] -= mem["offloaded"]["params"]
        if self.ctx.device.type == "cuda":
            mem["allocator_peak"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return mem

    # -- the run ------------------------------------------------------------
    def fit(self) -> TrainResult:
        t, ctx = self.cfg.train, self.ctx
        result = TrainResult()
        log = _Log(t, ctx.is_logging_rank, self.step, self.log_to_stdout, self.cfg)
        # --profile: a torch.profiler trace of the --profile-steps window (nothing at all without it).
        profiler = profile_window(t, ctx.rank, ctx.device, self.step + 1)
        # What the run is (model, layout, batch, precision, where it writes), then its data and its peak.
        for line in header_lines(self) + log.destinations():
            log.say(line)
        log.say(f"data: {self.data_line}; tokenizer: {tokenizer_words(t.tokenizer, self.cfg.model.vocab_size)}")
        if t.eval_every:
            log.say(f"validation: every {t.eval_every} steps, {self.eval_batches()} global batches "
                    f"({self.eval_batches() * self.cfg.global_batch * t.seq_len:,} tokens) of the held-out split")
        log.say(f"peak {self.peak:.4g} TFLOP/s per device ({self.peak_source}, {t.dtype}, "
                f"{describe_device(ctx.device)}): MFU is measured against it ({self.peak_origin})")
        for line in start_lines(self):  # what it loaded, what it will not save, what the first step compiles
            log.say(line)
        try:
            while self.step < t.steps:
                failures.note_step(self.step + 1)
                with span(STEP):
                    m = self.train_step()
                profiler.step_done()
                m["epoch"] = self.data.epochs(self.step)[0] if len(self.data.sources) == 1 else \
                    self.data.epochs(self.step)
                if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                    m["val_loss"] = self.evaluate()
                result.losses.append(m["loss"])
                result.metrics.append(m)
                log.write(m)
                if t.save and t.save_every and self.step % t.save_every == 0 and self.step < t.steps:
                    self.save(t.save)
        finally:
            profiler.close()
            log.close()
        if t.save:
            self.save(t.save)
        if t.pp_trace and self.pipeline is not None:
            self.pipeline.write_trace(t.pp_trace, self.cfg.parallel.pp_schedule)
        # Every file the run wrote, named (the checkpoint was, at each save).
        for path, what in ((t.log_jsonl, "one JSON line per step"), (t.tensorboard, "TensorBoard events"),
                           (t.profile, "torch.profiler traces, one per rank: read them with ultrascale trace"),
                           (t.pp_trace if self.pipeline is not None else "", "the last step's pipeline timeline")):
            if path:
                log.say(f"wrote {path}: {what}")
        result.state = self.full_state_dict()
        result.first_grads = self.first_grads
        return result

    def full_state_dict(self) -> dict:
        """The fp32 parameters under their single-device names, on the CPU."""
        return parallel.full_state(self.names, self.grads.params, self.grads.full_params(), self.ctx)

    # -- checkpoints --------------------------------------------------------
    def save(self, path: str) -> None:
        """Save to `path`, or with --keep-last to path/step-NNNNNN, keeping the newest N of those."""
        from ultrascale.train import checkpoint

        keep = self.cfg.train.keep_last
        target = os.path.join(path, resume.STEP_DIR.format(self.step)) if keep else path
        checkpoint.save(target, self)
        self.saved_step = self.step
        if keep and self.ctx.rank == 0:  # the save is whole on every rank: older ones may go
            import shutil

            for _, old in resume.step_dirs(path)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        if self.log_to_stdout and self.ctx.is_logging_rank:
            print(f"saved {target} at step {self.step}", flush=True)

    def _resume(self, path: str) -> None:
        """Continue from `path`, whatever layout wrote it (train/checkpoint.py)."""
        from ultrascale.train import checkpoint

        record = checkpoint.read_record(path)
        resume.check_resume(path, record, self.cfg)
        if not self.cfg.train.lr_decay_steps:  # the schedule the checkpoint was trained with
            import dataclasses

            saved = record.config.train.lr_decay_steps or record.config.train.steps
            self.cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, lr_decay_steps=saved))
        self.step = checkpoint.load(path, self)


def keep_steps_up_to(path: str, step: int) -> None:
    """A resumed run logging into an existing file: the rows past the checkpoint's step (the steps the
    interrupted run made after its last save, made again now) and a last line the kill cut short are
    dropped, the file replaced whole (a kill here leaves the old file or the new one)."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    kept = []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the torn last line
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] <= step:
            kept.append(line)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class _Log:
    """Per-step output of the logging rank: a line (or a progress bar), the JSONL file, TensorBoard and
    W&B (train/loggers.py: the same scalars, and the run's configuration once)."""

    def __init__(self, t, active: bool, first_step: int, to_stdout: bool, cfg: RunConfig | None = None):
        self.active, self.every, self.jsonl = active, t.log_every, None
        self.to_stdout = to_stdout and active
        self.bar = self.tb = self.wandb = None
        self.warned_peak = False
        if not active:
            return
        if t.wandb:  # first: a run W&B refuses (no credentials) ends here, before the logs are opened
            from ultrascale.train.loggers import WandbRun

            self.wandb = WandbRun(t.wandb, cfg.to_dict() if cfg is not None else {})
        if t.log_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(t.log_jsonl)), exist_ok=True)
            if t.resume:
                keep_steps_up_to(t.log_jsonl, first_step)
            # Unbuffered: a row is on disk whole when write() returns, or not at all (a full disk).
            self.jsonl, self.jsonl_path = open(t.log_jsonl, "ab" if t.resume else "wb", buffering=0), t.log_jsonl
        if t.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # The logging rank alone (rank 0 unless pipelined: the last stage, which has the loss).
            self.tb = SummaryWriter(log_dir=t.tensorboard)
            if cfg is not None:
                from ultrascale.train.loggers import write_hparams

                write_hparams(self.tb, cfg.to_dict(), ["train/loss"] + (["val/loss"] if t.eval_every else []))
        # Under `--nproc` stderr is the launcher's pipe; it says when it ends on a terminal.
        tty = sys.stderr.isatty() or os.environ.get("ULTRASCALE_STDERR_TTY") == "1"
        if self.to_stdout and t.progress and tty:
            from tqdm import tqdm

            self.bar = tqdm(total=t.steps, initial=first_step, unit="step", dynamic_ncols=True, leave=False)

    def write(self, m: dict) -> None:
        if not self.active:
            return
        if self.jsonl:
            self._append_row(json.dumps(m) + "\n")
        if self.tb is not None:
            for tag, value in tensorboard_scalars(m).items():
                self.tb.add_scalar(tag, value, m["step"])
            self.tb.flush()  # as the JSONL: a run that dies keeps its steps so far
        if self.wandb is not None:
            self.wandb.log(tensorboard_scalars(m), m["step"])
        if self.to_stdout and (m["step"] % self.every == 0 or m["step"] == 1):
            self.say(format_step(m))
        if m.get("mfu_above_peak") and not self.warned_peak:  # once a run
            self.warned_peak = True
            self.say(above_peak_warning(m))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{m['loss']:.4f}")

    def _append_row(self, row: str) -> None:
        """One JSONL row, whole: a write the filesystem refuses for want of room is cut back to the rows
        before it and ends the run in one line (the checkpoints written so far stand)."""
        data, start = memoryview(row.encode()), self.jsonl.tell()
        try:
            while data:
                data = data[self.jsonl.write(data):]
        except OSError as e:
            with contextlib.suppress(OSError):
                self.jsonl.truncate(start)
            if no_room(e):
                raise no_room_error(self.jsonl_path, e, f"its rows up to step {json.loads(row)['step'] - 1} are kept") \
                    from None
            raise

    def say(self, line: str) -> None:
        if self.to_stdout:
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)

    def destinations(self) -> list[str]:
        """Where the logged steps can be seen besides the files the header names: the W&B run."""
        return [self.wandb.describe()] if self.wandb is not None else []

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.bar is not None:
            self.bar.close()


def tensorboard_scalars(m: dict) -> dict[str, float]:
    """The TensorBoard tags of one step's metrics: train/*, memory/* (bytes), moe/*; None left out."""
    out = {f"train/{k}": m[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "step_time_s")}
    for k, v in m["memory"].items():
        if isinstance(v, dict):  # --offload's {to, optim, params, params_to}: the byte counts
            out.update({f"memory/{k}_{part}": n for part, n in v.items()
                        if isinstance(n, (int, float)) and not isinstance(n, bool)})
        else:
            out[f"memory/{k}"] = v
    out.update({f"moe/{k}": v for k, v in m.get("moe", {}).items()})
    if "val_loss" in m:
        out["val/loss"] = m["val_loss"]
    if isinstance(m.get("epoch"), float):
        out["train/epoch"] = m["epoch"]
    return {k: float(v) for k, v in out.items() if v is not None}


def _mb(n):
    return "-" if n is None else f"{n / 2**20:.2f}MiB"


def format_step(m: dict) -> str:
    mem = m["memory"]
    mfu = " | mfu >100% (peak too low: --peak)" if m.get("mfu_above_peak") else \
        "" if m["mfu"] is None else f" | mfu {100 * m['mfu']:.1f}%"
    e = m.get("moe")
    moe = "" if e is None else (
        f" | tokens/expert {e['tokens_per_expert_min']}-{e['tokens_per_expert_max']} cv "
        f"{e['tokens_per_expert_cv']:.2f} drop {100 * e['dropped_fraction']:.1f}% aux {e['aux_loss']:.3f}")
    norm = "skipped" if m["grad_norm"] is None else f"{m['grad_norm']:.3f}"
    scale = "" if "loss_scale" not in m else (
        f" | loss scale {m['loss_scale']:g}{' (overflow: step skipped)' if m['skipped'] else ''}")
    val = f" | val loss {m['val_loss']:.4f}" if "val_loss" in m else ""
    epoch = m.get("epoch")
    epoch = "" if epoch is None else f" | epoch {epoch:.3g}" if isinstance(epoch, float) else \
        " | epochs " + "/".join(f"{e:.3g}" for e in epoch)
    return (f"step {m['step']:>5} | loss {m['loss']:.4f}{val}{epoch} | grad norm {norm} | lr {m['lr']:.2e} | "
            f"{m['tokens_per_s']:,.0f} tok/s | {m['tflops']:.3g} TFLOP/s{mfu} | "
            f"params {_mb(mem['params'])} grads {_mb(mem['grads'])} optim {_mb(mem['optim'])} "
            f"act {_mb(mem['activations'])}{moe}{scale}")


def run_training(cfg: RunConfig, ctx: ParallelContext, log_to_stdout: bool = False,
                 keep_first_grads: bool = False) -> TrainResult:
    return Trainer(cfg, ctx, log_to_stdout, keep_first_grads).fit()
