"""Cases for Part 6: lines the notebook must print from its own runs (its exercises' answers are in
tests/course/)."""

PRINTED = [
    "tiny model: psi = 106,944 parameters",
    "ZeRO-0 rank 1: bytes per parameter: params  2.00  grads  4.00  optim 12.00  | total 18.00",
    "ZeRO-1 rank 0: bytes per parameter: params  2.00  grads  4.00  optim  6.00  | total 12.00",
    "ZeRO-1 rank 1: bytes per parameter: params  2.00  grads  4.00  optim  6.00  | total 12.00",
    "rank 0: local [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] -> reduce-scatter [10.0, 12.0, 14.0] -> all-gather "
    "[10.0, 12.0, 14.0, 16.0, 18.0, 20.0] | equals all-reduce: True",
    "optim : DP 1,283,328 B  ZeRO-1   641,664 B  ratio 0.500",
    "engine = 2*psi + 4*psi + 12*psi/N on every owner: True",
    "  1    15.0    15.0    89.7   119.7 |        119.7        89.7",
    " 64    15.0    15.0     1.4    31.3 |         31.3        30.8",
    "ultrascale plan memory --model llama3-8b --dp 8 --zero 1: optimizer states per GPU 11.2 GiB",
    "ZeRO-1 on 64 GPUs saves 88.3 GiB per GPU (planner); k = 8 would claim 58.9 GiB",
]
