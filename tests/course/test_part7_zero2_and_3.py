"""Part 7's answers: a ZeRO-3 Linear layer on 2 ranks (gather its parameters just in time in forward and
again in backward, reduce-scatter its gradient) and the bytes each rank sends per step under DP and ZeRO-1/2/3."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 7

GATHER = '''
def gather_linear(shard, shape, all_gather):
    world = dist.get_world_size()
    out_f, in_f = shape
    full = torch.empty(shard.numel() * world)
    all_gather(full, shard.detach())
    return full[:out_f * in_f].view(out_f, in_f), full[out_f * in_f:out_f * in_f + out_f]
'''

BACKWARD = '''
def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
    world = dist.get_world_size()
    weight, bias = gather_linear(shard, shape, all_gather)
    grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
'''

PAD_AND_SCATTER = '''
    flat = torch.zeros(shard.numel() * world)
    n = grad_w.numel() + grad_b.numel()
    flat[:n] = torch.cat([grad_w.reshape(-1), grad_b])
    grad_shard = torch.empty(shard.numel())
    reduce_scatter(grad_shard, flat)
'''

ZERO3_SOLUTION = BACKWARD + PAD_AND_SCATTER + '''
    return grad_x, grad_shard / world
'''


def ring_formula(stage0="2 * ring * grads", stage1="ring * (grads + params)",
                 stage2="ring * (micro_batches * grads + params)",
                 stage3="micro_batches * ring * (2 * params - param_bytes * psi_kept + grads)"):
    """The solution's formula with one stage's line replaced: a learner's one mistake."""
    return f'''
def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
    ring = (n - 1) / n
    grads, params = grad_bytes * psi, param_bytes * psi
    if stage == 0:
        return {stage0}
    if stage == 1:
        return {stage1}
    if stage == 2:
        return {stage2}
    return {stage3}
'''


WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "sums instead of averaging", "reduce-scatter sums over the ranks - divide by the world size",
     GATHER + BACKWARD + PAD_AND_SCATTER + '''
    return grad_x, grad_shard
'''),
    (1, "keeps the gathered parameters for backward", "gather them again in zero3_backward", '''
GATHERED = {}

def gather_linear(shard, shape, all_gather):
    world = dist.get_world_size()
    out_f, in_f = shape
    full = torch.empty(shard.numel() * world)
    all_gather(full, shard.detach())
    GATHERED[shape] = full
    return full[:out_f * in_f].view(out_f, in_f), full[out_f * in_f:out_f * in_f + out_f]

def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
    world = dist.get_world_size()
    out_f, in_f = shape
    full = GATHERED[shape]
    weight, bias = full[:out_f * in_f].view(out_f, in_f), full[out_f * in_f:out_f * in_f + out_f]
    grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
''' + PAD_AND_SCATTER + '''
    return grad_x, grad_shard / world
'''),
    (1, "slices the local gradient without reduce-scatter", "reduce-scatter each layer's flat gradient once",
     GATHER + '''
def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
    world, rank = dist.get_world_size(), dist.get_rank()
    weight, bias = gather_linear(shard, shape, all_gather)
    grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
    flat = torch.zeros(shard.numel() * world)
    n = grad_w.numel() + grad_b.numel()
    flat[:n] = torch.cat([grad_w.reshape(-1), grad_b])
    return grad_x, flat[rank * shard.numel():(rank + 1) * shard.numel()].clone()
'''),
    (1, "returns no gradient for the input", "must return the gradient with respect to the input x",
     GATHER + BACKWARD + PAD_AND_SCATTER + '''
    return None, grad_shard / world
'''),
    (1, "keeps the padding in the bias", "drop the padding", '''
def gather_linear(shard, shape, all_gather):
    world = dist.get_world_size()
    out_f, in_f = shape
    full = torch.empty(shard.numel() * world)
    all_gather(full, shard.detach())
    return full[:out_f * in_f].view(out_f, in_f), full[out_f * in_f:]
''' + ZERO3_SOLUTION),
    (1, "the padding of the gradient never written", "a NaN or an infinity in layer 2's shard gradient on rank 1",
     GATHER + BACKWARD + '''
    flat = torch.full((shard.numel() * world,), float("nan"))  # torch.empty in a learner's code: NaN here
    n = grad_w.numel() + grad_b.numel()
    flat[:n] = torch.cat([grad_w.reshape(-1), grad_b])
    grad_shard = torch.empty(shard.numel())
    reduce_scatter(grad_shard, flat)
    return grad_x, grad_shard / world
'''),
    (1, "all-reduces the layer's gradient and keeps its slice", "all-reduced layer 0's whole flat gradient",
     GATHER + BACKWARD + '''
    rank = dist.get_rank()
    flat = torch.zeros(shard.numel() * world)
    n = grad_w.numel() + grad_b.numel()
    flat[:n] = torch.cat([grad_w.reshape(-1), grad_b])
    dist.all_reduce(flat)
    return grad_x, flat[rank * shard.numel():(rank + 1) * shard.numel()] / world
'''),
    (1, "gathers with an all-reduce of a zero-filled vector", "an all-reduce of a zero-filled vector", '''
def gather_linear(shard, shape, all_gather):
    world, rank = dist.get_world_size(), dist.get_rank()
    out_f, in_f = shape
    full = torch.zeros(shard.numel() * world)
    full[rank * shard.numel():(rank + 1) * shard.numel()] = shard.detach()
    dist.all_reduce(full)  # the other ranks add zeros to this rank's slice
    return full[:out_f * in_f].view(out_f, in_f), full[out_f * in_f:out_f * in_f + out_f]
''' + ZERO3_SOLUTION),
    (1, "concatenates the gathered shards in reverse rank order", "in reverse rank order", '''
def gather_linear(shard, shape, all_gather):
    world = dist.get_world_size()
    out_f, in_f = shape
    pieces = [torch.empty(shard.numel()) for _ in range(world)]
    dist.all_gather(pieces, shard.detach())
    full = torch.cat(pieces[::-1])
    return full[:out_f * in_f].view(out_f, in_f), full[out_f * in_f:out_f * in_f + out_f]
''' + ZERO3_SOLUTION),
    (1, "reads the weight column by column", "row by row", '''
def gather_linear(shard, shape, all_gather):
    world = dist.get_world_size()
    out_f, in_f = shape
    full = torch.empty(shard.numel() * world)
    all_gather(full, shard.detach())
    return full[:out_f * in_f].view(in_f, out_f).t(), full[out_f * in_f:out_f * in_f + out_f]
''' + ZERO3_SOLUTION),
    (1, "averages the input's gradient too", "divided the gradient of the input by the world size",
     GATHER + BACKWARD + PAD_AND_SCATTER + '''
    return grad_x / world, grad_shard / world
'''),
    (1, "all-reduces the input's gradient across ranks", "the gradient with respect to x stays on its rank",
     GATHER + BACKWARD + PAD_AND_SCATTER + '''
    dist.all_reduce(grad_x)
    return grad_x / world, grad_shard / world
'''),
    (1, "reduce-scatters the unpadded gradient", "a rank failed with a size error", GATHER + BACKWARD + '''
    flat = torch.cat([grad_w.reshape(-1), grad_b])
    grad_shard = torch.empty(shard.numel())
    reduce_scatter(grad_shard, flat)
    return grad_x, grad_shard / world
'''),
    (1, "both ranks receive the other's shard before sending theirs", "deadlock on 2 ranks: rank 0 waits in recv", '''
def gather_linear(shard, shape, all_gather):
    rank = dist.get_rank()
    out_f, in_f = shape
    theirs = torch.empty(shard.numel())
    dist.recv(theirs, src=1 - rank)  # two ranks: swap shards point to point
    dist.send(shard.detach().clone(), dst=1 - rank)
    full = torch.cat([shard.detach(), theirs] if rank == 0 else [theirs, shard.detach()])
    return full[:out_f * in_f].view(out_f, in_f), full[out_f * in_f:out_f * in_f + out_f]
''' + ZERO3_SOLUTION),
    (2, "ZeRO-3 gathers once, like ZeRO-1", "all-gathers the parameters in forward and again in backward",
     ring_formula(stage3="micro_batches * ring * (params + grads)")),
    (2, "payload instead of what a rank sends", "each rank sends (N-1)/N of the buffer", '''
def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
    grads, params = grad_bytes * psi, param_bytes * psi
    if stage == 0:
        return 2 * grads
    if stage == 1:
        return grads + params
    if stage == 2:
        return micro_batches * grads + params
    return micro_batches * (2 * params - param_bytes * psi_kept + grads)
'''),
    (2, "ZeRO-2 reduce-scatters once per step", "ZeRO-2 reduce-scatters the gradients after every micro-batch",
     ring_formula(stage2="ring * (grads + params)")),
    (2, "DP all-reduces every micro-batch", "all-reduces once per step",
     ring_formula(stage0="micro_batches * 2 * ring * grads")),
    (2, "ZeRO-3 ignores the kept root unit", "that is what psi_kept is for",
     ring_formula(stage3="micro_batches * ring * (2 * params + grads)")),
    (2, "ZeRO-3 left as NaN", "a NaN or an infinity in your count for ZeRO-3 on 2 ranks with 1 micro-batch",
     ring_formula(stage3='float("nan")  # TODO: ZeRO-3')),
    (2, "DP's all-reduce counted as one ring phase", "an all-reduce is a reduce-scatter then an all-gather",
     ring_formula(stage0="ring * grads")),
    (2, "ZeRO-3 once per step, not per micro-batch", "multiply by the number of micro-batches",
     ring_formula(stage3="ring * (2 * params - param_bytes * psi_kept + grads)")),
    # The ring's factors as the numbers they are on 2 ranks: right there, 1.5x and 0.75x off on 4.
    (2, "the ring's factors written for 2 ranks", "the ring's factors depend on N",
     ring_formula(stage0="grads", stage1="(grads + params) / 2", stage2="(micro_batches * grads + params) / 2",
                  stage3="micro_batches * (2 * params - param_bytes * psi_kept + grads) / 2")),
    (2, "ZeRO-1 all-gathers the parameters in gradient bytes", "all-gather the updated parameters (param_bytes each)",
     ring_formula(stage1="ring * 2 * grads", stage2="ring * (micro_batches + 1) * grads")),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "torch.distributed's own collectives, not the ones passed in", '''
def gather_linear(shard, shape, all_gather):
    world = dist.get_world_size()
    out_f, in_f = shape
    full = shard.new_empty(shard.numel() * world)
    dist.all_gather_into_tensor(full, shard.detach())
    weight, bias, _padding = full.split([out_f * in_f, out_f, full.numel() - out_f * in_f - out_f])
    return weight.view(out_f, in_f), bias

def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
    world = dist.get_world_size()
    weight, bias = gather_linear(shard, shape, all_gather)
    grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
    flat = torch.cat([grad_w.flatten(), grad_b])
    flat = torch.nn.functional.pad(flat, (0, shard.numel() * world - flat.numel()))
    grad_shard = torch.zeros_like(shard)
    dist.reduce_scatter_tensor(grad_shard, flat / world)  # averaged before the sum: the same mean
    return grad_x, grad_shard
'''),
    (1, "list collectives, and autograd for the layer's gradients", '''
def gather_linear(shard, shape, all_gather):
    world = dist.get_world_size()
    out_f, in_f = shape
    pieces = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(pieces, shard.detach().contiguous())
    full = torch.cat(pieces)
    return full[:out_f * in_f].reshape(out_f, in_f), full[out_f * in_f:out_f * (in_f + 1)]

def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
    world = dist.get_world_size()
    weight, bias = (t.detach().requires_grad_(True) for t in gather_linear(shard, shape, all_gather))
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        y = torch.nn.functional.linear(x, weight, bias)
        grad_x, grad_w, grad_b = torch.autograd.grad(y, (x, weight, bias), grad_out)
    flat = torch.zeros(shard.numel() * world)
    flat[:weight.numel() + bias.numel()] = torch.cat([grad_w.reshape(-1), grad_b])
    grad_shard = torch.empty_like(shard)
    dist.reduce_scatter(grad_shard, list(flat.chunk(world)))
    return grad_x, grad_shard / world
'''),
    (2, "the ring factor applied once, at the end", '''
def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
    buffers = {  # full buffers each rank passes through a reduce-scatter or an all-gather per step
        0: 2 * grad_bytes * psi,
        1: grad_bytes * psi + param_bytes * psi,
        2: micro_batches * grad_bytes * psi + param_bytes * psi,
        3: micro_batches * (grad_bytes * psi + param_bytes * (2 * psi - psi_kept)),
    }
    return buffers[stage] * (n - 1) / n
'''),
    (2, "ZeRO-3 counted collective by collective", '''
def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
    ring = (n - 1) / n
    if stage == 0:
        return 2 * ring * grad_bytes * psi
    if stage in (1, 2):
        reduce_scatters = micro_batches if stage == 2 else 1
        return ring * (reduce_scatters * grad_bytes * psi + param_bytes * psi)
    forward_gathers = ring * param_bytes * psi
    backward_gathers = ring * param_bytes * (psi - psi_kept)
    reduce_scatter = ring * grad_bytes * psi
    return micro_batches * (forward_gathers + backward_gathers + reduce_scatter)
'''),
]
