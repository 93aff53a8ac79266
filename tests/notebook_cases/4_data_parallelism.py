"""Cases for Part 4: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

_EX1_HEAD = '''
    def overlapped_data_parallel(model, x, y, loss_fn):
        world = dist.get_world_size()
        pending = []
'''

_EX1_TAIL = '''
        handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
        loss_fn(model(x), y).backward()
        for work in pending:
            work.wait()
        for h in handles:
            h.remove()
'''


def _ex1(hook, tail=_EX1_TAIL):
    return _EX1_HEAD + hook + tail


_EX2_BUCKETS = '''
    def bucketed_all_reduce(params, cap_numel):
        world = dist.get_world_size()
        buckets, current, size = [], [], 0
        for p in reversed(params):
            if current and size + p.numel() > cap_numel:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            buckets.append(current)
'''

_EX2_REDUCE = '''
        for bucket in buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            flat.div_(world)
            dist.all_reduce(flat)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
'''


def _ex2(buckets, reduce=_EX2_REDUCE):
    return buckets + reduce


MISTAKES = [
    ("1", "sums instead of averaging", "summed, not averaged", _ex1('''
        def on_grad_ready(p):
            pending.append(dist.all_reduce(p.grad, async_op=True))
''')),
    ("1", "SUM hook on top of DDP", "reduced twice: DDP already averages every gradient across the ranks, and "
     "your hook all-reduces it again, so the gradients come out 2.000x", _EX1_HEAD + '''
        def on_grad_ready(p):
            dist.all_reduce(p.grad)  # the example notebook's hook: SUM, on top of DDP

        ddp = DDP(model)
        handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
        loss_fn(ddp(x), y).backward()
        for work in pending:
            work.wait()
        for h in handles:
            h.remove()
'''),
    ("1", "averaging hook on top of DDP", "it again: averaged twice", _EX1_HEAD + '''
        def on_grad_ready(p):
            p.grad.div_(world)
            dist.all_reduce(p.grad)

        ddp = DDP(model)
        handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
        loss_fn(ddp(x), y).backward()
        for work in pending:
            work.wait()
        for h in handles:
            h.remove()
'''),
    ("1", "hook and a loop after backward", "reduced twice (12 all-reduces for 6 gradients", _ex1('''
        def on_grad_ready(p):
            p.grad.div_(world)
            pending.append(dist.all_reduce(p.grad, async_op=True))
''', _EX1_TAIL + '''
        for p in model.parameters():
            dist.all_reduce(p.grad)
''')),
    ("1", "reduces to rank 0 only", "only rank 0 holds the reduced gradients", _ex1('''
        def on_grad_ready(p):
            p.grad.div_(world)
            pending.append(dist.reduce(p.grad, dst=0, async_op=True))
''')),
    ("1", "averages on rank 0 only", "only rank 0 ended with the average", _ex1('''
        def on_grad_ready(p):
            pending.append(dist.all_reduce(p.grad, async_op=True))
''', _EX1_TAIL + '''
        if dist.get_rank() == 0:
            for p in model.parameters():
                p.grad.div_(world)
''')),
    ("1", "asynchronous SUM hook on top of DDP", "races with DDP's copy of the gradient", _EX1_HEAD + '''
        def on_grad_ready(p):
            pending.append(dist.all_reduce(p.grad, async_op=True))

        ddp = DDP(model)
        handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
        loss_fn(ddp(x), y).backward()
        for work in pending:
            work.wait()
        for h in handles:
            h.remove()
'''),
    ("1", "never waits", "never waited for", _ex1('''
        def on_grad_ready(p):
            p.grad.div_(world)
            pending.append(dist.all_reduce(p.grad, async_op=True))
''', '''
        handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
        loss_fn(model(x), y).backward()
        for h in handles:
            h.remove()
''')),
    ("1", "naive: reduces after backward", "start after backward has finished", '''
    def overlapped_data_parallel(model, x, y, loss_fn):
        world = dist.get_world_size()
        loss_fn(model(x), y).backward()
        pending = [dist.all_reduce(p.grad.div_(world), async_op=True) for p in model.parameters()]
        for work in pending:
            work.wait()
'''),
    ("1", "blocking all-reduce in the hook", "each all-reduce blocks", _ex1('''
        def on_grad_ready(p):
            p.grad.div_(world)
            dist.all_reduce(p.grad)
''')),
    ("1", "divides by a count still zero", "a NaN or an infinity in rank 0's gradients", '''
    def overlapped_data_parallel(model, x, y, loss_fn):
        world = dist.get_world_size()
        pending = []
        backwards = 0  # counted after backward: still 0 when the hooks run

        def on_grad_ready(p):
            p.grad.div_(world * backwards)
            pending.append(dist.all_reduce(p.grad, async_op=True))
''' + _EX1_TAIL + '''
        backwards += 1
'''),
    ("2", "never writes the reduced bucket back", "torch.cat makes a copy", _ex2(_EX2_BUCKETS, '''
        for bucket in buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            flat.div_(world)
            dist.all_reduce(flat)
''')),
    ("2", "drops the last, partial bucket", "you dropped the last, partial bucket", _ex2('''
    def bucketed_all_reduce(params, cap_numel):
        world = dist.get_world_size()
        buckets, current, size = [], [], 0
        for p in reversed(params):
            if current and size + p.numel() > cap_numel:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
''')),
    ("2", "one bucket per layer", "one bucket per layer", _ex2('''
    def bucketed_all_reduce(params, cap_numel):
        world = dist.get_world_size()
        buckets = [[params[i], params[i - 1]] for i in range(len(params) - 1, 0, -2)]
''')),
    ("2", "DDP's rule: close once the cap is reached", "that is PyTorch DDP's rule", _ex2('''
    def bucketed_all_reduce(params, cap_numel):
        world = dist.get_world_size()
        buckets, current, size = [], [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel()
            if size >= cap_numel:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
''')),
    ("2", "forward order", "registration (forward) order", _ex2('''
    def bucketed_all_reduce(params, cap_numel):
        world = dist.get_world_size()
        buckets, current, size = [], [], 0
        for p in params:
            if current and size + p.numel() > cap_numel:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            buckets.append(current)
''')),
    ("2", "one all-reduce per parameter", "one per parameter is no bucketing", _ex2('''
    def bucketed_all_reduce(params, cap_numel):
        world = dist.get_world_size()
        buckets = [[p] for p in reversed(params)]
''')),
    ("2", "sums instead of averaging", "summed, not averaged", _ex2(_EX2_BUCKETS, '''
        for bucket in buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
''')),
    ("2", "counts the ranks from zeros", "a NaN or an infinity in rank 0's gradients", _ex2(_EX2_BUCKETS, '''
        ranks = torch.zeros(1)  # meant torch.ones: each rank adds 1, the sum is the world size
        dist.all_reduce(ranks)
        for bucket in buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat)
            flat.div_(ranks)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
''')),
]

PRINTED = [
    "hidden behind compute: rank 0 0%, rank 1 0%",  # naive: the profiler sees no overlap
    "rank 0 of 2, backend gloo\nrank 1 of 2, backend gloo",
    "summed  : ranks agree: True, gradient / single-process gradient: 2.000, equal to it: False",
    "averaged: ranks agree: True, gradient / single-process gradient: 1.000, equal to it: True",
    "gradients ready, in this order: ['4.bias', '4.weight', '2.bias', '2.weight', '0.bias', '0.weight']",
    "DDP alone                  : gradients 1.000x the single-process ones, ranks agree: True, extra all-reduces: 0",
    "DDP + SUM hook (the seed's): gradients 2.000x the single-process ones, ranks agree: True, extra all-reduces: 6",
    "DDP + averaging hook       : gradients 1.000x the single-process ones, ranks agree: True, extra all-reduces: 6",
    "  iteration 1: ['0.weight', '0.bias', '2.weight', '2.bias', '4.weight', '4.bias'] = 484 elements",
    "  iteration 2: ['4.bias', '4.weight', '2.bias', '2.weight'] = 340 elements | "
    "['0.bias', '0.weight'] = 144 elements",
    "six Linear(256, 256), default caps (first bucket 1 MiB, then 25 MiB):",
    "  iteration 1: 12 tensors = 1.506 MiB",
    "  iteration 2: 8 tensors = 1.004 MiB | 4 tensors = 0.502 MiB",
    "1,182,720 parameters in 16 tensors (4.5 MiB of fp32 gradients), 2 ranks, rank 0, best of 10\n",
    "every mode's averaged gradients equal DDP's: True",
    "forward + backward inside no_sync: all-reduce calls after each micro-batch [0, 0, 0, 1], ranks agree: True, "
    "full-batch gradient: True",
    "only backward inside no_sync     : all-reduce calls after each micro-batch [1, 2, 3, 4], ranks agree: True, "
    "full-batch gradient: True",
]
