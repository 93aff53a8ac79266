"""Tolerance classes: every bound a comparison is held to comes from the arithmetic of the two runs.

Two runs of the same function differ by rounding only, and how much depends on *where* their
arithmetic differs, never on the machine that ran them: another vector width sums in another order,
but the number of roundings that order can stack up is the same on every CPU. So a bound is not a
measurement tightened around one machine's run (a measurement is printed beside it, for the record).
It is

    unit roundoff u of the narrowest format where the runs round differently  x  a growth factor g

with u = 2^-p (p: the format's significand bits, the implicit one included) and g, per compared
quantity, the number of such roundings that can stack up in it, stated with its reason in the class.
A class whose values then pass through a cast to a narrower format (FP8) adds what a cast makes of a
difference: a value within that difference of one of the cast's rounding boundaries lands one whole
step of the narrow format away (see `Cast`). docs/engine.md ("Tolerance classes") has the table.

A compiled path is held to the class of the lowest precision its fused kernels touch: inductor fuses
and reorders, so compiled-vs-eager in fp32 is the fp32-reordering class, and compiled FP8 against
eager FP8 is the FP8 class (both runs cast; they differ where a reordered fp32 value crosses one of
fp8's rounding boundaries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Format:
    """A floating-point format by its significand: u = 2^-bits is half the spacing at 1."""

    name: str
    significand_bits: int  # the implicit leading one included: fp32 24, bf16 8, fp16 11, e4m3 4, e5m2 3

    @property
    def u(self) -> float:
        return 2.0 ** -self.significand_bits


FP32_FORMAT = Format("fp32", 24)
BF16_FORMAT = Format("bf16", 8)
FP16_FORMAT = Format("fp16", 11)
E4M3 = Format("float8_e4m3fn", 4)
E5M2 = Format("float8_e5m2", 3)  # the output gradients' format in torchao's recipe: the narrowest cast


@dataclass(frozen=True)
class Growth:
    """How many roundings of size u can stack up in each compared quantity (testing/compare.py)."""

    loss: float  # every step's loss, relative
    grad: float  # the first step's gradient, per tensor, relative L2
    norm: float  # every step's gradient norm, relative
    param: float  # the final parameters, per tensor, mean |difference| over sum(lr)


@dataclass(frozen=True)
class Tolerance:
    """Bounds of one comparison (testing/compare.py says what each compares)."""

    loss_rtol: float  # per step, |a - b| / |b|
    grad_rtol: float  # first-step gradient, per tensor ||a - b|| / ||b||
    norm_rtol: float  # gradient norm before clipping, every step, |a - b| / |b|
    param_mean: float  # final parameters, per tensor mean(|a - b|) / (sum of the learning rates)


@dataclass(frozen=True)
class Cast:
    """The values pass through a cast to `to` after the two runs' values differ.

    A difference d (relative) in a value before the cast changes the cast's result only where the
    value lies within d of one of the cast's rounding boundaries, a share d / (2 u_to) of values
    spread over the spacing 2 u_to; there it moves by one whole step, 2 u_to. So, with d the base
    bound of each quantity: a mean over many values (the loss, the norm) moves by
    share x step = d, once more; a tensor's relative L2 by step x sqrt(share) = sqrt(2 u_to d);
    AdamW's update of a crossed element by at most 2 lr (a sign), so the parameters' mean by
    2 x share = d / u_to."""

    to: Format

    def widen(self, base: Tolerance) -> Tolerance:
        u = self.to.u
        return Tolerance(loss_rtol=2 * base.loss_rtol, grad_rtol=base.grad_rtol + math.sqrt(2 * u * base.grad_rtol),
                         norm_rtol=2 * base.norm_rtol, param_mean=base.param_mean + base.param_mean / u)


@dataclass(frozen=True)
class ToleranceClass:
    name: str
    format: Format | None  # where the two runs round differently; None: they do not (exact)
    growth: Growth
    why: str  # the reason for the growth factors, in one sentence or two (docs/engine.md prints it)
    cast: Cast | None = None

    @property
    def tolerance(self) -> Tolerance:
        if self.format is None:
            return Tolerance(0.0, 0.0, 0.0, 0.0)
        u, g = self.format.u, self.growth
        base = Tolerance(u * g.loss, u * g.grad, u * g.norm, u * g.param)
        return self.cast.widen(base) if self.cast else base

    @property
    def element_rtol(self) -> float:
        """The bound of one tensor compared element by element (a layer's output, one op against a
        reference written out): the gradient's growth, one reduction's worth of roundings."""
        return 0.0 if self.format is None else self.format.u * self.growth.grad


EXACT = ToleranceClass(
    "exact", None, Growth(0, 0, 0, 0),
    "the same kernels on the same values in the same order: bit-identical (data and pipeline parallelism's "
    "micro-batches, a resumed run's continuation, a checkpoint read back)")

FP32_REORDER = ToleranceClass(
    "fp32 reordering", FP32_FORMAT, Growth(loss=2 ** 8, grad=2 ** 8, norm=2 ** 11, param=2 ** 13),
    "the same fp32 arithmetic summed in another order (a reduction split over ranks, another vector width, "
    "inductor's fused kernels): a reordered sum of n terms moves by at most (n - 1) u of the sum of their "
    "magnitudes, and the widest reduction of the test models (hidden, MLP width, vocabulary, tokens of a "
    "micro-batch) is at most 2^8 terms; a later step's norm carries the parameter differences of up to 8 "
    "steps before it (2^11); the parameters those of 32 steps of updates (2^13)")

BF16 = ToleranceClass(
    "bf16", BF16_FORMAT, Growth(loss=1, grad=16, norm=16, param=16),
    "bf16 compute against one process fed the same micro-batches: the same bf16 operations except where a "
    "layout splits a reduction (tensor parallelism's partial sums, ZeRO-3's norm, context parallelism's "
    "blockwise merge), each one extra rounding to bf16 of at most u; the loss is a mean of such errors "
    "over the batch's tokens (1); a gradient meets one in each block's forward output and backward input "
    "gradient, 2 x 4 blocks, twice for margin (16); norms and AdamW's updates inherit the gradients' (16)")

FP16 = ToleranceClass(
    "fp16", FP16_FORMAT, BF16.growth,
    "as bf16, with fp16's unit roundoff: the same operations and the same extra roundings")

FP8 = ToleranceClass(
    "fp8", FP32_FORMAT, FP32_REORDER.growth,
    "both runs cast the linears' inputs and weights to e4m3 and the output gradients to e5m2; they differ "
    "where fp32 arithmetic before a cast was reordered (inductor's fused amax, scale and cast), which the "
    "cast turns into a whole e5m2 step for the values that lie that close to a rounding boundary",
    cast=Cast(E5M2))

# An MoE layer's tensors when the routing is decided in 16 bits: a token whose top-k scores are within
# the format's rounding of each other is routed by that rounding, which a layout changes (tensor
# parallelism's partial sums, context parallelism's merge), and with a capacity the tokens an expert drops
# move with it. That is no rounding of the values but a share of the rows: the matrix's cells give each
# expert 64 assignments a micro-batch (128 tokens x top-2 / 4 experts), and a moved assignment changes its
# expert's gradient and update by its share of them. Bounded at 16 of 64 moved: a missing reduction or a
# wrong scale is O(1).
ROUTED_SHARE = 16 / 64


def routed(cls: ToleranceClass) -> Tolerance:
    """The bound of an MoE layer's tensors routed in 16 bits: its gradients' and parameters' share
    (ROUTED_SHARE); the losses and norms keep `cls`'s bounds."""
    t = cls.tolerance
    return Tolerance(loss_rtol=t.loss_rtol, grad_rtol=ROUTED_SHARE, norm_rtol=t.norm_rtol, param_mean=ROUTED_SHARE)


CLASSES = {c.name: c for c in (EXACT, FP32_REORDER, BF16, FP16, FP8)}


def for_dtype(dtype: str) -> ToleranceClass:
    """The class of a layout against one process in this compute dtype (fp32 runs: their reductions
    reordered; 16-bit runs: against one process fed the same micro-batches)."""
    return {"fp32": FP32_REORDER, "bf16": BF16, "fp16": FP16}[dtype]


def for_run(dtype: str, fp8: bool = False) -> ToleranceClass:
    """The class of a run against its control: its dtype's, and with FP8 linears that class seen
    through the casts (the two runs' values before a cast differ by the dtype's class)."""
    cls = for_dtype(dtype)
    if not fp8:
        return cls
    return FP8 if cls is FP32_REORDER else replace(cls, name=f"{cls.name} + fp8", cast=Cast(E5M2))


def table() -> str:
    """The classes as the Markdown table of docs/engine.md ("Tolerance classes")."""
    rows = ["| class | u | growth (loss, grad, norm, param) | losses | step-1 gradients | norms | parameters / sum(lr) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in CLASSES.values():
        t = c.tolerance
        u = "-" if c.format is None else f"2^-{c.format.significand_bits}"
        g = c.growth
        cast = f", then a cast to {c.cast.to.name}" if c.cast else ""
        rows.append(f"| {c.name} | {u}{cast} | {g.loss:g}, {g.grad:g}, {g.norm:g}, {g.param:g} | "
                    f"{t.loss_rtol:.2g} | {t.grad_rtol:.2g} | {t.norm_rtol:.2g} | {t.param_mean:.2g} |")
    rows.append(f"| 16-bit routing (an MoE layer's tensors) | the share of an expert's assignments moved | - | "
                f"the dtype's | {ROUTED_SHARE:g} | the dtype's | {ROUTED_SHARE:g} |")
    return "\n".join(rows)
