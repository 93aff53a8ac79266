"""Tensor and sequence parallelism against the single-process run, on real gloo processes."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultrascale.config import ConfigError, ParallelConfig, RunConfig, TrainConfig, validate
from ultrascale.model import get_preset
from ultrascale.testing.compare import (
    RunRecord,
    assert_matches,
    compare,
    single_process_config,
    train_parallel,
    train_single,
)
from ultrascale.testing.harness import run_distributed, worker_context
from ultrascale.testing.tolerance import FP32_REORDER

FP32_ELEMENT = FP32_REORDER.element_rtol  # one op against its reference, reordered (docs/engine.md)


def config(world, tp, sp=False, zero=0, steps=4, tied=False, grad_accum=2, micro_batch=2, bias=False):
    p = ParallelConfig(dp=world // tp, tp=tp, sp=sp, zero=zero, bucket_mb=0.05)
    t = TrainConfig(steps=steps, seq_len=32, micro_batch=micro_batch, grad_accum=grad_accum, seed=7, progress=False)
    model = get_preset("tiny", tie_embeddings=tied or None)
    if bias:
        import dataclasses

        model = dataclasses.replace(model, bias=True, norm="layernorm", mlp="gelu")
    return RunConfig(model=model, parallel=p, train=t)


@functools.lru_cache(maxsize=None)
def reference(world, tp, tied=False, bias=False):
    return RunRecord.of(train_single(single_process_config(validate(config(world, tp, tied=tied, bias=bias), world))))


LAYOUTS = [  # (world, tp, sp, zero, tied)
    (2, 2, False, 0, False), (2, 2, True, 0, False),
    (4, 4, False, 0, False), (4, 4, True, 0, True),
    (4, 2, False, 0, False), (4, 2, True, 0, False),  # dp 2 x tp 2
    (4, 2, True, 1, True), (4, 2, False, 1, False),  # dp 2 x tp 2 with ZeRO-1
    (4, 2, True, 3, False),  # and ZeRO-3: units gathered within each TP shard
]


@pytest.mark.equivalence
@pytest.mark.parametrize("world,tp,sp,zero,tied", LAYOUTS,
                         ids=[f"dp{w // t}-tp{t}{'-sp' if s else ''}{f'-zero{z}' if z else ''}{'-tied' if ti else ''}"
                              for w, t, s, z, ti in LAYOUTS])
def test_matches_the_single_process_run(world, tp, sp, zero, tied):
    ref = reference(world, tp, tied)
    per_rank = train_parallel(config(world, tp, sp, zero, tied=tied), world)
    label = f"dp {world // tp} x tp {tp}{' + sp' if sp else ''}{f' zero {zero}' if zero else ''}{' tied' if tied else ''}"
    for rank, got in enumerate(per_rank):  # every rank gathers the same full parameters
        assert_matches(compare(label, ref, got, record=rank == 0))


@pytest.mark.equivalence
def test_biases_and_layernorm_under_tp_and_sp():
    # The GPT-style block: column biases sharded, the row bias added once after the reduction.
    ref = reference(2, 2, bias=True)
    got = train_parallel(config(2, 2, sp=True, bias=True), 2)[0]
    assert_matches(compare("tp 2 + sp, GPT block with biases", ref, got))


def test_activation_memory_falls_with_tp_and_further_with_sp():
    def act(world, tp, sp):
        per_rank = train_parallel(config(world, tp, sp, steps=1, grad_accum=1, micro_batch=4), world)
        return max(got.memory[0]["activations"] for got in per_rank)

    one = train_single(single_process_config(validate(config(1, 1, steps=1, grad_accum=1, micro_batch=4), 1)))
    tp1 = one.metrics[0]["memory"]["activations"]
    tp2, tp2_sp = act(2, 2, False), act(2, 2, True)
    assert tp2_sp < tp2 < tp1, (tp1, tp2, tp2_sp)


# -- the vocabulary-parallel loss ---------------------------------------------
def _loss_and_grad(vocab, tp_world):
    from ultrascale.parallel.tensor.loss import vocab_parallel_cross_entropy

    ctx = worker_context(ParallelConfig(tp=tp_world))
    rank, world = ctx.index("tp"), ctx.size("tp")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, vocab, generator=g)
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    targets[0, :] = vocab - 1  # the last real token sits next to the padding
    padded = -(-vocab // world) * world
    full = torch.cat([logits, torch.zeros(3, 5, padded - vocab)], dim=-1)
    shard = full.chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, targets, ctx.group("tp"), rank, vocab)
    loss.backward()
    parts = [torch.empty_like(shard.grad) for _ in range(world)]
    dist.all_gather(parts, shard.grad, group=ctx.group("tp"))
    return loss.item(), torch.cat(parts, dim=-1)[..., :vocab], logits, targets


@pytest.mark.parametrize("world,vocab", [(2, 257), (4, 257), (4, 12), (2, 9)])
def test_vocab_parallel_loss_equals_cross_entropy(world, vocab):
    loss, grad, logits, targets = run_distributed(world, _loss_and_grad, vocab, world)[0]
    logits.requires_grad_()
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ref.backward()
    assert abs(loss - ref.item()) < 1e-6
    torch.testing.assert_close(grad, logits.grad, rtol=FP32_ELEMENT, atol=1e-7)


# -- configuration errors -------------------------------------------------------
@pytest.mark.parametrize("parallel,seq_len,message", [
    (ParallelConfig(tp=3), 32, "must divide both the 8 query heads"),
    (ParallelConfig(sp=True), 32, "--sp shards activations"),
    (ParallelConfig(tp=2, sp=True), 33, "must divide by it"),
])
def test_layouts_that_cannot_work(parallel, seq_len, message):
    cfg = RunConfig(model=get_preset("tiny"), parallel=parallel, train=TrainConfig(seq_len=seq_len))
    with pytest.raises(ConfigError, match=message):
        validate(cfg, parallel.tp)
