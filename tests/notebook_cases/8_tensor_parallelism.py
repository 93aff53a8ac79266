"""Cases for Part 8: lines the notebook must print from its own runs (its exercises' answers are
tests/course/test_part8_tensor_parallelism.py)."""

PRINTED = [
    "rank 0: column-then-row, one all-reduce: max |error|",
    "params      one process   427,776 B   tp = 2, per rank   214,784 B   (0.502x)",
    "layers.0.attn.q_proj.weight      rank 0 (32, 64)    rank 1 (32, 64)",
    "all-reduces of a [b, s, h] activation (16,384 B) per step on rank 0: 10 = 4 x 2 blocks + 2 (4L + 2 = 10)",
    "the other all-reduces per step: {4: 1, 256: 3} (bytes: count)",
    "llama3-8b's vocabulary: 128,256 logits per token",
]
