"""Cases for Part 5: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

MISTAKES = [
            ("1", "returns a float", "return an int", '''
    def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
        return gbs_tokens / seq_len / (mbs * dp)
    '''),
            ("1", "never refuses", "more GPUs than the batch can feed", '''
    def grad_accum_steps(gbs_tokens, seq_len, mbs, dp):
        return gbs_tokens // seq_len // (mbs * dp)
    '''),
            ("2", "sums the micro-batches", "divide each micro-batch loss by grad_accum", '''
    def dp_ga_grads(replicas, x, y, loss_fn, grad_accum, all_reduce_sum):
        dp = len(replicas)
        for r, (xs, ys) in enumerate(zip(x.chunk(dp), y.chunk(dp))):
            for xb, yb in zip(xs.chunk(grad_accum), ys.chunk(grad_accum)):
                loss_fn(replicas[r](xb), yb).backward()
        for params in zip(*(m.parameters() for m in replicas)):
            grads = [p.grad for p in params]
            all_reduce_sum(grads)
            for g in grads:
                g.div_(dp)
    '''),
            ("2", "sums the ranks", "the all-reduce sums", '''
    def dp_ga_grads(replicas, x, y, loss_fn, grad_accum, all_reduce_sum):
        dp = len(replicas)
        for r, (xs, ys) in enumerate(zip(x.chunk(dp), y.chunk(dp))):
            for xb, yb in zip(xs.chunk(grad_accum), ys.chunk(grad_accum)):
                (loss_fn(replicas[r](xb), yb) / grad_accum).backward()
        for params in zip(*(m.parameters() for m in replicas)):
            all_reduce_sum([p.grad for p in params])
    '''),
]

PRINTED = [
    "4,194,304 tokens / 4096 tokens per sample = 1024 samples per step",
    "DP =  128: GA = 1024 / (2 x 128) = 4\n",
    "accumulated / one big batch: 4.000",
]
