"""Cases for Part 2: lines the notebook must print from its own runs (the wrong answers a learner
might write are in tests/course/test_part2_activation_memory_recomputation.py)."""

# Its bf16 attention takes the kernel the kernel set allows (parallel/precision.py): under both sets.
KERNELS = True

PRINTED = [
    "tiny: h=64, heads a=8, kv width=32, SwiGLU f=128, 2 blocks",
    "fp32: one block, b=2, s=16 keeps 140,544 bytes = 4,392 per token",
    "bf16: one block, b=2, s=16 keeps 87,296 bytes = 2,728 per token:",
    "b=4: s=64:  1.07 MiB (4392 B/token)   s=128:  2.14 MiB (4392 B/token)   s=256:  4.29 MiB (4392 B/token)",
    "each extra position adds 32 bytes per token = 4 bytes x 8 heads: one fp32 attention probability per head per key",
    "llama3-8b, one sequence of  4096: flash   26.7 GiB, eager   58.7 GiB",
    "at s=256 the probabilities are 8,192 of the 12,808 bytes per token (64%)",
    "llama3-8b, one sequence of  8192: flash   53.3 GiB, eager  181.3 GiB  (flash: 6.67 MiB per token)",
    "FLOPs/token 1,180,032 (+26.3%)",
    "selective adds 65,536 FLOPs per token: QK^T once more, 2 x L x h x s = 65,536",
    "llama3-8b, seq 4096, flash attention, --recompute full     : activations   1.2 GiB",
]
