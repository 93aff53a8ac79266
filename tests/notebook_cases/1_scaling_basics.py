"""Cases for Part 1: lines the notebook must print from its own runs (the wrong answers a learner
might write are in tests/course/test_part1_scaling_basics.py)."""

from printed import ByMachine

from ultrascale.parallel.precision import flash_attention_fails_here

BF16_ON_MATH_KERNEL = "bf16 attention ran on SDPA's math kernel here"
FLASH_RATIO = "bf16 activations / fp32 activations: 0.67"

# Its bf16 attention takes the kernel the kernel set allows (parallel/precision.py): under both sets.
KERNELS = True

PRINTED = [
    "tiny model: 106,944 parameters",
    "fp32: params 4 + grads 4 + optim 8 = 16 bytes per parameter; activations 5.18 MiB for 8 x 64 tokens",
    "bf16: params 2 + grads 4 + optim 12 = 18 bytes per parameter",
    "activations at the end of forward: 12.7 x the parameters",
    # Where torch's CPU flash kernel cannot run bf16 (an AMX CPU under a kernel set below avx512), the
    # run says so and its ratio is the math kernel's: the same machine and kernel set as the notebook's.
    ByMachine(BF16_ON_MATH_KERNEL if flash_attention_fails_here("bf16") else FLASH_RATIO,
              (BF16_ON_MATH_KERNEL, FLASH_RATIO)),
    "parameters that do no matmul: embedding 16,448 + norms 320 of N = 106,944 (16%); in llama3-8b: 6.5%",
    "llama3-8b (8.03B), fp32            : params 4 + grads 4 + optim 8 = 16 bytes/param = 120 GiB",
    "llama3-8b (8.03B), bf16            : params 2 + grads 2 + optim 12 = 16 bytes/param = 120 GiB",
    "llama3-8b (8.03B), bf16-fp32-grads : params 2 + grads 4 + optim 12 = 18 bytes/param = 135 GiB",
    "the runs above: 8 samples x 64 tokens = 512 tokens; the trainer counted 512 tokens per optimizer step",
    "h= 4096 L=32 v=131072: model 6,981,033,984  formula 6,981,033,984  equal: True",
    "weight matmuls (aten.mm): 541,056 = 6 x 90,176 parameters in matmuls: True",
    "attention (aten.bmm):     98,304 = 12 x L x h x s = 98,304: True",
]
