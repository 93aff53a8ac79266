"""Cases for Part 15: lines the notebook must print from its own runs."""


PRINTED = [
    "datasheet  HBM3 bandwidth (TB/s)                        3.35",
    "on-chip SRAM in all: 33 MiB, against 80 GB of HBM",
    "ridge point (BF16 peak / HBM bandwidth): 295 FLOP per byte read or written",
    "add   : intensity   0.08 FLOP/byte",
    "matmul: intensity  64.00 FLOP/byte",
    "same values as eager: True",
    "softmax from the blocked normaliser == torch.softmax: True",
    "naive attention at 4096 tokens, 32 heads: scores 1.0 GiB in bf16",
]

