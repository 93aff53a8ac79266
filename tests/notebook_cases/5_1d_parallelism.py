"""Lines Part 5's notebook must print from its own runs (its exercises' answers: tests/course)."""

from printed import Close

from ultrascale.testing.compare import FP32

PRINTED = [
    "llama3-8b: 8.03B parameters; h100-80gb: 79.2 GiB",
    "MBS 2 x GA 4 x DP 128 = 1024 samples = 4,194,304 tokens per step",
    "4,194,304 tokens / 4096 tokens per sample = 1024 samples per step",
    "DP =  128: GA = 1024 / (2 x 128) = 4\n",
    "  dp128 tp1 pp1 zero3 rc:none mbs2 ga4      65.7 GiB  step 3.74 s  8,756 tokens/s/GPU",
    "planner's choice: MBS 2 x GA 4 x DP 128 = 1024 sequences",
    "ZeRO-3, MBS 3:  97.0 GiB does not fit",
    "of which parameters, gradients and optimizer states 119.7 GiB",
    Close("DP 1 x MBS 8 x GA 1 = 8 sequences: losses 5.5829, 5.2560, 4.9662; activations 2,713,668 bytes per rank",
          rel=FP32.loss_rtol),
    Close("DP 2 x MBS 2 x GA 2 = 8 sequences: losses 5.5829, 5.2560, 4.9662; activations 678,948 bytes per rank",
          rel=FP32.loss_rtol),
    "  128 GPUs: MBS 2 x GA  4  step  3.74 s   8,756 tokens/s/GPU  exposed DP communication 0.000 s  "
    "sync 0.20 s = GA x 51 ms (16 nodes)",
    "  512 GPUs: MBS 2 x GA  1  step  1.70 s   4,809 tokens/s/GPU  exposed DP communication 0.000 s  "
    "sync 0.82 s = GA x 819 ms (64 nodes)",
    " 1024 GPUs: MBS 1 x GA  1  step  3.83 s   1,070 tokens/s/GPU  exposed DP communication 0.092 s  "
    "sync 3.28 s = GA x 3277 ms (128 nodes)",
    " 2048 GPUs: no layout - 1024 sequences cannot give every GPU a micro-batch",
]
