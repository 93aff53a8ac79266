"""Cases for Part 6: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

_SHARD = '''
    def shard_parameters(params):
        world, rank = dist.get_world_size(), dist.get_rank()
        numel = sum(p.numel() for p in params)
        size = -(-numel // world)
        flat = torch.zeros(size * world)
        flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
        return nn.Parameter(flat[rank * size:(rank + 1) * size].clone())
'''

_GATHER = '''
        opt.step()
        full = torch.empty(padded)
        all_gather(full, master.detach())
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
'''

MISTAKES = [
    ("1", "sums instead of averaging", "reduce-scatter sums over the ranks - divide by the world size", _SHARD + '''
    def zero1_step(params, master, opt):
        world, rank = dist.get_world_size(), dist.get_rank()
        numel, padded = sum(p.numel() for p in params), master.numel() * world
        flat_grad = torch.zeros(padded)
        flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
        shard_grad = torch.empty(master.numel())
        reduce_scatter(shard_grad, flat_grad)
        master.grad = shard_grad
''' + _GATHER),
    ("1", "no padding for an odd number of parameters", "pad it with zeros to a multiple of the world size", '''
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
    ("1", "never all-gathers the updated shards", "all-gather the updated master shards", _SHARD + '''
    def zero1_step(params, master, opt):
        world, rank = dist.get_world_size(), dist.get_rank()
        numel, padded = sum(p.numel() for p in params), master.numel() * world
        flat_grad = torch.zeros(padded)
        flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
        shard_grad = torch.empty(master.numel())
        reduce_scatter(shard_grad, flat_grad)
        master.grad = shard_grad / world
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
    ("1", "keeps the whole model as master weights", "ZeRO-1 keeps only this rank's shard", '''
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
    ("1", "slices the local gradient without communicating", "its own micro-batch's gradient only", _SHARD + '''
    def zero1_step(params, master, opt):
        world, rank = dist.get_world_size(), dist.get_rank()
        numel, padded = sum(p.numel() for p in params), master.numel() * world
        flat_grad = torch.zeros(padded)
        flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
        master.grad = flat_grad[rank * master.numel():(rank + 1) * master.numel()].clone()
''' + _GATHER),
    ("1", "all-gathers with an all-reduce over NaN", "a NaN or an infinity in rank 0's parameters", _SHARD + '''
    def zero1_step(params, master, opt):
        world, rank = dist.get_world_size(), dist.get_rank()
        numel, padded = sum(p.numel() for p in params), master.numel() * world
        flat_grad = torch.zeros(padded)
        flat_grad[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
        shard_grad = torch.empty(master.numel())
        reduce_scatter(shard_grad, flat_grad)
        master.grad = shard_grad / world
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
    ("2", "8 bytes per parameter of optimizer state", "k = 4 + 4 + 4 = 12", '''
    def zero1_bytes_per_rank(psi, n, grad_bytes=2):
        return {"params": 2 * psi, "grads": grad_bytes * psi, "optim": 8 * psi / n}
'''),
    ("2", "optimizer states not divided by N", "divide k*psi by N", '''
    def zero1_bytes_per_rank(psi, n, grad_bytes=2):
        return {"params": 2 * psi, "grads": grad_bytes * psi, "optim": 12 * psi}
'''),
    ("2", "gradients sharded too (ZeRO-2)", "sharding them is ZeRO-2", '''
    def zero1_bytes_per_rank(psi, n, grad_bytes=2):
        return {"params": 2 * psi, "grads": grad_bytes * psi / n, "optim": 12 * psi / n}
'''),
    ("2", "bf16 gradients whatever grad_bytes says", "use grad_bytes, not a fixed 2", '''
    def zero1_bytes_per_rank(psi, n, grad_bytes=2):
        return {"params": 2 * psi, "grads": 2 * psi, "optim": 12 * psi / n}
'''),
    ("2", "a term left as NaN", "a NaN or an infinity in your bytes for the planner's Llama 3 8B", '''
    def zero1_bytes_per_rank(psi, n, grad_bytes=2):
        k = float("nan")  # TODO: bytes of optimizer state per parameter
        return {"params": 2 * psi, "grads": grad_bytes * psi, "optim": k * psi / n}
'''),
]

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
