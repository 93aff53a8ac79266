"""Cases for Part 16: lines the notebook must print from its own runs."""

from printed import Close
from ultrascale.testing.tolerance import FP16_FORMAT, FP32_REORDER

FLUSHED = FP32_REORDER.tolerance.grad_rtol / (2 * FP16_FORMAT.u)


PRINTED = [
    "model: tiny, 106,944 parameters",
    "fp32        32   8   23    3.4e+38         1.18e-38             1.4e-45         1.19e-07",
    "bf16        16   8    7   3.39e+38         1.18e-38            9.18e-41          0.00781",
    "fp16        16   5   10   6.55e+04          6.1e-05            5.96e-08         0.000977",
    "fp8 e4m3     8   4    3        448           0.0156             0.00195            0.125",
    "fp8 e5m2     8   5    2   5.73e+04          6.1e-05            1.53e-05             0.25",
    "fp16     : 1.001 -> 1.000977   70000 -> inf",
    "fp8 e4m3 : 1.001 -> 1.000000   70000 -> 448        1e-6 -> 0",
    # Which gradients fall under fp16's smallest subnormal depends on the fp32 backward's rounding: a cast
    # after fp32 reordering (testing/tolerance.py, Cast), which moves a share d / (2 u_fp16) of the values,
    # d the fp32 class's gradient bound: 1.5e-5 / 2^-10 = 1.6e-2 of the values near the threshold at most.
    Close("fp16 backward, loss scale       1:  38.5% of the gradients flushed to zero", rel=FLUSHED),
    Close("fp16 backward, loss scale   65536:   0.0% of the gradients flushed to zero", rel=FLUSHED),
    "fp32: bytes per parameter: model weights 4 + gradients 4 + optimizer (Adam's moments and the fp32 masters) 8 = 16",
    "bf16: bytes per parameter: model weights 2 + gradients 4 + optimizer (Adam's moments and the fp32 masters) 12 = 18",
    "step 1: loss scale 2^20  skipped True",
    "step 4: loss scale 2^17  skipped True",
    "step 5: loss scale 2^16  skipped False",
    "step 7: loss scale 2^17  skipped False",
    # e4m3 keeps full resolution within about 2^15 of its largest value
    "e4m3: largest 448; smallest normal 0.015625, 2^14.8 below it; smallest subnormal 0.00195312, 2^17.8 below it",
]
