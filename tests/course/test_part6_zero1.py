"""Part 6's answers: the ZeRO-1 optimizer step on 2 ranks (shard the master weights, reduce-scatter the
gradients, update a shard, all-gather the parameters) and the bytes of model states per ZeRO-1 rank."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 6

SHARD = '''
def shard_parameters(params):
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = sum(p.numel() for p in params)
    size = -(-numel // world)
    flat = torch.zeros(size * world)
    flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
    return nn.Parameter(flat[rank * size:(rank + 1) * size].clone())
'''

REDUCE_SCATTER = '''
def zero1_step(params, master, opt):
    world, rank = dist.get_world_size(), dist.get_rank()
    numel, padded = sum(p.numel() for p in params), master.numel() * world
    flat_grad = torch.zeros(padded)
    flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
    shard_grad = torch.empty(master.numel())
    reduce_scatter(shard_grad, flat_grad)
    master.grad = shard_grad / world
'''

GATHER = '''
    opt.step()
    full = torch.empty(padded)
    all_gather(full, master.detach())
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "sums instead of averaging", "reduce-scatter sums over the ranks - divide by the world size", SHARD + '''
def zero1_step(params, master, opt):
    world, rank = dist.get_world_size(), dist.get_rank()
    numel, padded = sum(p.numel() for p in params), master.numel() * world
    flat_grad = torch.zeros(padded)
    flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
    shard_grad = torch.empty(master.numel())
    reduce_scatter(shard_grad, flat_grad)
    master.grad = shard_grad
''' + GATHER),
    (1, "no padding for an odd number of parameters", "pad it with zeros to a multiple of the world size", '''
def shard_parameters(params):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    size = flat.numel() // world
    return nn.Parameter(flat[rank * size:(rank + 1) * size].clone())

def zero1_step(params, master, opt):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat_grad = torch.cat([p.grad.reshape(-1) for p in params])
    shard_grad = torch.empty(master.numel())
    reduce_scatter(shard_grad, flat_grad)
    master.grad = shard_grad / world
    opt.step()
    full = torch.empty(flat_grad.numel())
    all_gather(full, master.detach())
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''),
    (1, "never all-gathers the updated shards", "all-gather the updated master shards",
     SHARD + REDUCE_SCATTER + '''
    opt.step()
    flat = torch.zeros(padded)
    flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
    flat[rank * master.numel():(rank + 1) * master.numel()] = master.detach()
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''),
    (1, "keeps the whole model as master weights", "ZeRO-1 keeps only this rank's shard", '''
def shard_parameters(params):
    return nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]).clone())

def zero1_step(params, master, opt):
    world = dist.get_world_size()
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(grad)
    master.grad = grad / world
    opt.step()
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(master[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''),
    (1, "slices the local gradient without communicating", "its own micro-batch's gradient only", SHARD + '''
def zero1_step(params, master, opt):
    world, rank = dist.get_world_size(), dist.get_rank()
    numel, padded = sum(p.numel() for p in params), master.numel() * world
    flat_grad = torch.zeros(padded)
    flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
    master.grad = flat_grad[rank * master.numel():(rank + 1) * master.numel()].clone()
''' + GATHER),
    # Summing over torch.empty's garbage (NaN here, every run) would spoil the values too; the all-reduce where
    # an all-gather belongs is said first.
    (1, "all-gathers with an all-reduce over NaN", "twice the bytes of an all-gather",
     SHARD + REDUCE_SCATTER + '''
    opt.step()
    full = torch.full((padded,), float("nan"))  # torch.empty in a learner's code: NaN here, every run
    full[rank * master.numel():(rank + 1) * master.numel()] = master.detach()
    dist.all_reduce(full)  # every rank fills its own slice: the sum is the whole vector
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''),
    (1, "every rank runs Adam on the whole model", "ran an optimizer over all 43 parameters", SHARD + '''
def zero1_step(params, master, opt):
    # A second Adam over the whole model, made once: every rank updates everything, as in plain DP.
    world, rank = dist.get_world_size(), dist.get_rank()
    if not hasattr(zero1_step, "adam"):
        zero1_step.adam = torch.optim.Adam(params, lr=opt.param_groups[0]["lr"])
    numel, padded = sum(p.numel() for p in params), master.numel() * world
    flat_grad = torch.zeros(padded)
    flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat_grad)
    flat_grad /= world
    master.grad = flat_grad[rank * master.numel():(rank + 1) * master.numel()].clone()
    opt.step()
    offset = 0
    for p in params:
        p.grad = flat_grad[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    zero1_step.adam.step()
'''),
    (1, "keeps Part 4's all-reduce and reduce-scatters too", "the all-reduce of plain data parallelism", SHARD + '''
def zero1_step(params, master, opt):
    world, rank = dist.get_world_size(), dist.get_rank()
    for p in params:  # data parallelism's averaged all-reduce, as in Part 4
        dist.all_reduce(p.grad)
        p.grad /= world
    numel, padded = sum(p.numel() for p in params), master.numel() * world
    flat_grad = torch.zeros(padded)
    flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
    shard_grad = torch.empty(master.numel())
    reduce_scatter(shard_grad, flat_grad)
    master.grad = shard_grad / world
''' + GATHER),
    (1, "gathers the shards on rank 0 and broadcasts the whole model", "one rank's broadcast of all 44 elements",
     SHARD + REDUCE_SCATTER + '''
    opt.step()
    shards = [torch.empty(master.numel()) for _ in range(world)] if rank == 0 else None
    dist.gather(master.detach(), shards, dst=0)
    full = torch.cat(shards) if rank == 0 else torch.empty(padded)
    dist.broadcast(full, src=0)
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''),
    (1, "rank r takes the slice of the other end", "rank 0's master weights hold rank 1's slice", '''
def shard_parameters(params):
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = sum(p.numel() for p in params)
    size = -(-numel // world)
    flat = torch.zeros(size * world)
    flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
    mine = world - 1 - rank
    return nn.Parameter(flat[mine * size:(mine + 1) * size].clone())
''' + REDUCE_SCATTER + GATHER),
    (1, "the padding of the gradient left unwritten", "a NaN or an infinity in rank 1's master shard .grad", SHARD + '''
def zero1_step(params, master, opt):
    world, rank = dist.get_world_size(), dist.get_rank()
    numel, padded = sum(p.numel() for p in params), master.numel() * world
    flat_grad = torch.full((padded,), float("nan"))  # torch.empty in a learner's code: NaN here, every run
    flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
    shard_grad = torch.empty(master.numel())
    reduce_scatter(shard_grad, flat_grad)
    master.grad = shard_grad / world
''' + GATHER),
    (1, "both ranks receive the other's shard before sending theirs", "deadlock on 2 ranks: rank 0 waits in recv",
     SHARD + REDUCE_SCATTER + '''
    opt.step()
    other = 1 - rank  # two ranks: swap shards point to point
    theirs = torch.empty(master.numel())
    dist.recv(theirs, src=other)
    dist.send(master.detach().clone(), dst=other)
    shards = [master.detach(), theirs] if rank == 0 else [theirs, master.detach()]
    full = torch.cat(shards)
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''),
    (2, "8 bytes per parameter of optimizer state", "k = 4 + 4 + 4 = 12", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    return {"params": 2 * psi, "grads": grad_bytes * psi, "optim": 8 * psi / n}
'''),
    (2, "optimizer states not divided by N", "divide k*psi by N", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    return {"params": 2 * psi, "grads": grad_bytes * psi, "optim": 12 * psi}
'''),
    (2, "gradients sharded too (ZeRO-2)", "sharding them is ZeRO-2", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    return {"params": 2 * psi, "grads": grad_bytes * psi / n, "optim": 12 * psi / n}
'''),
    (2, "parameters sharded too (ZeRO-3)", "sharding them is ZeRO-3", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    return {"params": 2 * psi / n, "grads": grad_bytes * psi, "optim": 12 * psi / n}
'''),
    (2, "bf16 gradients whatever grad_bytes says", "use grad_bytes, not a fixed 2", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    return {"params": 2 * psi, "grads": 2 * psi, "optim": 12 * psi / n}
'''),
    (2, "fp32 master weights counted with the parameters", "The fp32 master weights are optimizer state", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    return {"params": (2 + 4) * psi, "grads": grad_bytes * psi, "optim": 8 * psi / n}
'''),
    (2, "parameters in fp32", "the parameters are bf16: 2 bytes each", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    return {"params": 4 * psi, "grads": grad_bytes * psi, "optim": 12 * psi / n}
'''),
    (2, "answers in GiB", "answer in bytes, not GiB", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    GiB = 2**30
    return {"params": 2 * psi / GiB, "grads": grad_bytes * psi / GiB, "optim": 12 * psi / n / GiB}
'''),
    (2, "the total instead of the owners", "return a dict with the keys 'params', 'grads' and 'optim'", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    return 2 * psi + grad_bytes * psi + 12 * psi / n
'''),
    (2, "a term left as NaN", "a NaN or an infinity in your bytes for the planner's Llama 3 8B", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    k = float("nan")  # TODO: bytes of optimizer state per parameter
    return {"params": 2 * psi, "grads": grad_bytes * psi, "optim": k * psi / n}
'''),
    (1, "all-reduces the whole gradient and keeps its slice", "all-reduced the gradients before opt.step()", SHARD + '''
def zero1_step(params, master, opt):
    world, rank = dist.get_world_size(), dist.get_rank()
    size = master.numel()
    flat_grad = torch.cat([p.grad.reshape(-1) for p in params])
    flat_grad = torch.cat([flat_grad, flat_grad.new_zeros(size * world - flat_grad.numel())])
    dist.all_reduce(flat_grad)
    master.grad = flat_grad[rank * size:(rank + 1) * size] / world
    opt.step()
    shards = [torch.empty(size) for _ in range(world)]
    dist.all_gather(shards, master.detach())
    numel = sum(p.numel() for p in params)
    torch.nn.utils.vector_to_parameters(torch.cat(shards)[:numel], params)
'''),
    (1, "all-gathers with an all-reduce of a zero-filled vector", "twice the bytes of an all-gather", SHARD + REDUCE_SCATTER + '''
    opt.step()
    full = torch.zeros(padded)
    full[rank * master.numel():(rank + 1) * master.numel()] = master.detach()
    dist.all_reduce(full)
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "list reduce_scatter and all_gather, chunks of the padded vector", '''
def shard_parameters(params):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.cat([p.detach().flatten() for p in params])
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % world)])
    return nn.Parameter(list(flat.chunk(world))[rank].clone())

def zero1_step(params, master, opt):
    world = dist.get_world_size()
    flat = torch.cat([p.grad.flatten() for p in params])
    flat = torch.cat([flat, flat.new_zeros(master.numel() * world - flat.numel())])
    mine = torch.empty_like(master)
    dist.reduce_scatter(mine, [c.contiguous() for c in flat.chunk(world)])
    master.grad = mine.div_(world)
    opt.step()
    pieces = [torch.empty_like(master) for _ in range(world)]
    dist.all_gather(pieces, master.detach())
    full, offset = torch.cat(pieces), 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''),
    (1, "averages before the reduce-scatter; every owner broadcasts its shard", '''
def shard_parameters(params):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.nn.utils.parameters_to_vector(params).detach()
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % world))
    return nn.Parameter(flat.chunk(world)[rank].clone())

def zero1_step(params, master, opt):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat_grad = torch.cat([p.grad.reshape(-1) for p in params]) / world
    flat_grad = torch.nn.functional.pad(flat_grad, (0, master.numel() * world - flat_grad.numel()))
    master.grad = torch.zeros_like(master)
    dist.reduce_scatter_tensor(master.grad, flat_grad)
    opt.step()
    full = torch.zeros(master.numel() * world)
    for owner, piece in enumerate(full.chunk(world)):
        if owner == rank:
            piece.copy_(master.detach())
        dist.broadcast(piece, src=owner)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(full[:sum(p.numel() for p in params)], params)
'''),
    (2, "integer arithmetic and an extra total", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    owners = {"params": 2 * psi, "grads": grad_bytes * psi, "optim": (4 + 4 + 4) * psi // n}
    owners["total"] = sum(owners.values())
    return owners
'''),
    (2, "bytes per parameter first, then times psi", '''
def zero1_bytes_per_rank(psi, n, grad_bytes=2):
    per_param = dict(params=2.0, grads=float(grad_bytes), optim=12.0 / n)
    return {owner: b * psi for owner, b in per_param.items()}
'''),
]
