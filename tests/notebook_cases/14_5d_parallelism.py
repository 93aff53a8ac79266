"""Cases for Part 14: lines the notebook must print from its own runs."""

from printed import Close

from ultrascale.testing.compare import FP32


PRINTED = [
    "llama3-70b: 70.6B parameters, 80 layers, 64 heads; h100-80gb: 79.2 GiB, 8 GPUs per node",
    "pp    groups: [[0, 2], [1, 3], [4, 6], [5, 7]]",
    "dp    groups: [[0, 4], [1, 5], [2, 6], [3, 7]]",
    "  rank 3: dp=1 pp=0 tp=1  tp [2, 3]  pp [3]  dp [1, 3]",
    "  rank 3: dp=1 pp=1 tp=0  tp [3]  pp [2, 3]  dp [1, 3]",
    Close('one process          : losses 5.582918 5.467266 5.239688', rel=FP32.loss_rtol),
    "dp64 tp1 pp1 zero3: states   16.4 GiB + activations 101.5 GiB ->  150.5 GiB per GPU, does not fit",
    "dp8  tp4 pp2 zero1: states   45.2 GiB + activations  25.3 GiB ->   77.1 GiB per GPU, fits",
    "mbs 1 x ga 32 x dp 8 = 256 sequences:  77.1 GiB (fits)",
    "mbs 2 x ga 16 x dp 8 = 256 sequences: 108.1 GiB (does not fit)",
    "  dp8 tp8+sp pp1 zero1 rc:none mbs2 ga16                   78.8 GiB    707 tok/s/GPU",
    "  tp8 pp1 dp8    707 tok/s/GPU: compute 14.88  tp comm 4.57",
    "3,287 runs, 1,758 finished",
    "mean Spearman (tokens/s/GPU, per group) 0.813",
    "38 layouts lie within the time model's error (±17.7%) of the fastest",
    "sync: 20 µs per ring step of a collective on the critical path, x8 inside a pipeline (calibration.py); "
    "0.2 ms x nodes² per micro-batch, 0.82 s at 64 nodes (hardware.py)",
    "   1 nodes:  0.98, p90 1.16; bytes and FLOPs alone  1.02  (69 runs, median measured MFU 37.8%)",
    "   4 nodes:  1.12, p90 4.43; bytes and FLOPs alone  1.55  (203 runs, median measured MFU 14.8%)",
    "  16 nodes:  0.97, p90 3.12; bytes and FLOPs alone  1.97  (416 runs, median measured MFU 9.3%)",
    "  32 nodes:  0.86, p90 2.93; bytes and FLOPs alone  3.62  (355 runs, median measured MFU 4.4%)",
    "  64 nodes:  1.07, p90 1.46; bytes and FLOPs alone 14.11  (281 runs, median measured MFU 0.9%)",
    "at 4-32 nodes, runs 3 or more times slower than predicted: 11%",
    "  calibrated on 1B + 8B: collective_step_s 20 us, pipeline_sync_factor 8, node_pair_sync_s 0.2 ms",
    "  calibrated on 3B + 80B: collective_step_s 20 us, pipeline_sync_factor 8, node_pair_sync_s 0.2 ms",
    "(all in [0.8, 1.25]); mean Spearman 0.802",
    "(all in [0.8, 1.25]); mean Spearman 0.822",
    "7 of the 42 layouts that fit lie within ±17.7% of the fastest",
    "planner's choice for the tiny model: dp4 tp1 pp1 zero0 rc:none mbs2 ga1",
    "with --tp 2:                         dp2 tp2+sp pp1 zero0 rc:none mbs4 ga1",
    "[parallel]\ndp = 2\ntp = 2",
]
