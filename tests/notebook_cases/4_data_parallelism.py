"""Cases for Part 4: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

MISTAKES = [
            ("1", "sums instead of averaging", "divide by the number of replicas", '''
    def data_parallel_grads(replicas, x, y, loss_fn, all_reduce_sum):
        world = len(replicas)
        for r, (xb, yb) in enumerate(zip(x.chunk(world), y.chunk(world))):
            loss_fn(replicas[r](xb), yb).backward()
        for params in zip(*(m.parameters() for m in replicas)):
            all_reduce_sum([p.grad for p in params])
    '''),
            ("1", "averages into replica 0 only", "differs from replica 0's", '''
    def data_parallel_grads(replicas, x, y, loss_fn, all_reduce_sum):
        world = len(replicas)
        for r, (xb, yb) in enumerate(zip(x.chunk(world), y.chunk(world))):
            loss_fn(replicas[r](xb), yb).backward()
        for params in zip(*(m.parameters() for m in replicas)):
            params[0].grad.copy_(torch.stack([p.grad for p in params]).mean(0))
    '''),
            ("2", "never writes the reduced bucket back", "torch.cat makes a copy", '''
    def bucketed_all_reduce(params, cap_numel, all_reduce):
        buckets, current, size = [], [], 0
        for p in reversed(params):
            if current and size + p.numel() > cap_numel:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        buckets.append(current)
        for bucket in buckets:
            all_reduce(torch.cat([p.grad.reshape(-1) for p in bucket]))
    '''),
            ("2", "drops the last, partial bucket", "last, partial bucket", '''
    def bucketed_all_reduce(params, cap_numel, all_reduce):
        buckets, current, size = [], [], 0
        for p in reversed(params):
            if current and size + p.numel() > cap_numel:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        for bucket in buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            all_reduce(flat)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
    '''),
            ("2", "one bucket per layer", "by size (not per layer)", '''
    def bucketed_all_reduce(params, cap_numel, all_reduce):
        for i in range(len(params) - 1, 0, -2):  # bias and weight of one layer together
            bucket = [params[i], params[i - 1]]
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            all_reduce(flat)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
    '''),
]

PRINTED = [
    "summed gradient / single-model gradient: 4.000",
    "forward + backward inside no_sync: all-reduce calls after each micro-batch [0, 0, 0, 1], full-batch gradient: True",
    "only backward inside no_sync     : all-reduce calls after each micro-batch [1, 2, 3, 4]",
]
