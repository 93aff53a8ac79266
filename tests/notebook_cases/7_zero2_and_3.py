"""Cases for Part 7: lines the notebook must print from its own runs (its exercises' answers are in
tests/course/)."""

PRINTED = [
    "tiny model: psi = 106,944 parameters",
    "ZeRO-0: params  2.00  grads  4.00  optim 12.00  | total 18.00",
    "ZeRO-1: params  2.00  grads  4.00  optim  6.00  | total 12.00",
    "ZeRO-2: params  2.00  grads  2.00  optim  6.00  | total 10.00",
    "ZeRO-3: params  1.00  grads  2.00  optim  6.00  | total  9.00",
    "all-gather     root (embedding, final norm, head)\nall-gather     block 0\nall-gather     block 1\n"
    "    forward  block 0\nall-gather     block 2\n    forward  block 1",
    "linear_grads matches autograd: True",
    "micro-batches 1 | DP    : 1 x all_reduce (4.00 psi B) + 8 B of scalars -> sent 4.00 B/param",
    "micro-batches 1 | ZeRO-1: 1 x reduce_scatter (4.00 psi B), 1 x all_gather (2.00 psi B) + 12 B of scalars "
    "-> sent 3.00 B/param",
    "micro-batches 2 | ZeRO-2: 2 x reduce_scatter (8.00 psi B), 1 x all_gather (2.00 psi B) + 12 B of scalars "
    "-> sent 5.00 B/param",
    "micro-batches 2 | ZeRO-3: 10 x all_gather (6.77 psi B), 6 x reduce_scatter (8.00 psi B) + 12 B of scalars "
    "-> sent 7.38 B/param",
    "root unit, kept gathered from forward to backward: 32,960 of 106,944 parameters (30.8%)",
    "DP    : 2.00 psi elements per step (1 micro-batch)",
    "ZeRO-1: 2.00 psi elements per step (1 micro-batch)",
    "ZeRO-3: 2.69 psi elements per step (1 micro-batch)",
    "ZeRO-3 without the kept root would be 3 psi; with it: 3 - 0.31 = 2.69 psi",
    "  64    152.0  [  119.7]       63.7* [   31.3]       49.0* [   16.6]       35.3* [    1.9]",
    "llama3-8b ZeRO-1: doubling N saves < 10% from N = 8 on (73.5 GiB per GPU)",
    # Offload: what leaves the device, measured; and the planner's answer where nothing else fits.
    "ZeRO-1, offload cpu : device params  2.00  grads  4.00  optim  0.00 | host  6.00",
    "ZeRO-3, offload none: device params  1.00  grads  2.00  optim  6.00 | host  0.00",
    "ZeRO-3, offload cpu : device params  0.00  grads  2.00  optim  0.00 | host  7.00",
    "h100-80gb, per GPU: PCIe 50 GB/s to the host, HBM 3.35 TB/s, host memory 46 GB/s",
    "llama3-70b on 8 x h100-80gb, no offload: 123 layouts, 0 fit",
    "the planner's answer: dp8 tp1 pp1 zero3 offload:cpu rc:full mbs2 ga1",
]
