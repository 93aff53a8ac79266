"""Cases for Part 7: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

_GATHER = '''
    def gather_linear(shard, shape, all_gather):
        world = dist.get_world_size()
        out_f, in_f = shape
        full = torch.empty(shard.numel() * world)
        all_gather(full, shard.detach())
        return full[:out_f * in_f].view(out_f, in_f), full[out_f * in_f:out_f * in_f + out_f]
'''

_PAD_AND_SCATTER = '''
        flat = torch.zeros(shard.numel() * world)
        n = grad_w.numel() + grad_b.numel()
        flat[:n] = torch.cat([grad_w.reshape(-1), grad_b])
        grad_shard = torch.empty(shard.numel())
        reduce_scatter(grad_shard, flat)
'''

MISTAKES = [
    ("1", "sums instead of averaging", "reduce-scatter sums over the ranks - divide by the world size", _GATHER + '''
    def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
        world = dist.get_world_size()
        weight, bias = gather_linear(shard, shape, all_gather)
        grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
''' + _PAD_AND_SCATTER + '''
        return grad_x, grad_shard
'''),
    ("1", "keeps the gathered parameters for backward", "gather them again in zero3_backward", '''
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
''' + _PAD_AND_SCATTER + '''
        return grad_x, grad_shard / world
'''),
    ("1", "slices the local gradient without reduce-scatter", "reduce-scatter each layer's flat gradient once",
     _GATHER + '''
    def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
        world, rank = dist.get_world_size(), dist.get_rank()
        weight, bias = gather_linear(shard, shape, all_gather)
        grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
        flat = torch.zeros(shard.numel() * world)
        n = grad_w.numel() + grad_b.numel()
        flat[:n] = torch.cat([grad_w.reshape(-1), grad_b])
        return grad_x, flat[rank * shard.numel():(rank + 1) * shard.numel()].clone()
'''),
    ("1", "returns no gradient for the input", "must return the gradient with respect to the input x", _GATHER + '''
    def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
        world = dist.get_world_size()
        weight, bias = gather_linear(shard, shape, all_gather)
        grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
''' + _PAD_AND_SCATTER + '''
        return None, grad_shard / world
'''),
    ("1", "keeps the padding in the bias", "drop the padding", '''
    def gather_linear(shard, shape, all_gather):
        world = dist.get_world_size()
        out_f, in_f = shape
        full = torch.empty(shard.numel() * world)
        all_gather(full, shard.detach())
        return full[:out_f * in_f].view(out_f, in_f), full[out_f * in_f:]

    def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
        world = dist.get_world_size()
        weight, bias = gather_linear(shard, shape, all_gather)
        grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
''' + _PAD_AND_SCATTER + '''
        return grad_x, grad_shard / world
'''),
    ("1", "the padding of the gradient never written", "a NaN or an infinity in layer 2's shard gradient on rank 1",
     _GATHER + '''
    def zero3_backward(grad_out, x, shard, shape, all_gather, reduce_scatter):
        world = dist.get_world_size()
        weight, bias = gather_linear(shard, shape, all_gather)
        grad_x, grad_w, grad_b = linear_grads(x, weight, bias, grad_out)
        flat = torch.full((shard.numel() * world,), float("nan"))  # NaN: a slot left unwritten shows
        n = grad_w.numel() + grad_b.numel()
        flat[:n] = torch.cat([grad_w.reshape(-1), grad_b])
        grad_shard = torch.empty(shard.numel())
        reduce_scatter(grad_shard, flat)
        return grad_x, grad_shard / world
'''),
    ("2", "ZeRO-3 gathers once, like ZeRO-1", "all-gathers the parameters in forward and again in backward", '''
    def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
        ring = (n - 1) / n
        grads, params = grad_bytes * psi, param_bytes * psi
        if stage == 0:
            return 2 * ring * grads
        if stage == 1:
            return ring * (grads + params)
        if stage == 2:
            return ring * (micro_batches * grads + params)
        return micro_batches * ring * (params + grads)
'''),
    ("2", "payload instead of what a rank sends", "each rank sends (N-1)/N of the buffer", '''
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
    ("2", "ZeRO-2 reduce-scatters once per step", "ZeRO-2 reduce-scatters the gradients after every micro-batch", '''
    def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
        ring = (n - 1) / n
        grads, params = grad_bytes * psi, param_bytes * psi
        if stage == 0:
            return 2 * ring * grads
        if stage in (1, 2):
            return ring * (grads + params)
        return micro_batches * ring * (2 * params - param_bytes * psi_kept + grads)
'''),
    ("2", "DP all-reduces every micro-batch", "all-reduces once per step", '''
    def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
        ring = (n - 1) / n
        grads, params = grad_bytes * psi, param_bytes * psi
        if stage == 0:
            return micro_batches * 2 * ring * grads
        if stage == 1:
            return ring * (grads + params)
        if stage == 2:
            return ring * (micro_batches * grads + params)
        return micro_batches * ring * (2 * params - param_bytes * psi_kept + grads)
'''),
    ("2", "ZeRO-3 ignores the kept root unit", "that is what psi_kept is for", '''
    def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
        ring = (n - 1) / n
        grads, params = grad_bytes * psi, param_bytes * psi
        if stage == 0:
            return 2 * ring * grads
        if stage == 1:
            return ring * (grads + params)
        if stage == 2:
            return ring * (micro_batches * grads + params)
        return micro_batches * ring * (2 * params + grads)
'''),
    ("2", "ZeRO-3 left as NaN", "a NaN or an infinity in your count for ZeRO-3 with 1 micro-batch", '''
    def comm_bytes_per_rank(stage, psi, n, micro_batches=1, param_bytes=2, grad_bytes=4, psi_kept=0):
        ring = (n - 1) / n
        grads, params = grad_bytes * psi, param_bytes * psi
        if stage == 0:
            return 2 * ring * grads
        if stage == 1:
            return ring * (grads + params)
        if stage == 2:
            return ring * (micro_batches * grads + params)
        return float("nan")  # TODO: ZeRO-3
'''),
]

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
    "llama3-70b on 8 x h100-80gb, no offload: 123 layouts, 0 fit",
    "the planner's answer: dp8 tp1 pp1 zero3 offload:cpu rc:full mbs2 ga1",
]
