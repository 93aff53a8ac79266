"""Cases for Part 3: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

MISTAKES = [
            ("1", "sums the micro-batches", "an average, not a sum", '''
    def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
        for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
            loss_fn(model(xb), yb).backward()
    '''),
            ("1", "divides by the number of micro-batches", "weight each micro-batch loss by its share of the samples", '''
    def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
        for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
            (loss_fn(model(xb), yb) / num_micro_batches).backward()
    '''),
            ("1", "zeroes the gradients in the loop", "do not call zero_grad() between micro-batches", '''
    def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
        for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
            model.zero_grad()
            (loss_fn(model(xb), yb) * len(xb) / len(x)).backward()
    '''),
            ("1", "divides by a sample count never counted", "a NaN or an infinity in your accumulated gradients", '''
    def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
        seen = 0  # samples so far: meant to grow by len(xb) each micro-batch
        for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
            (loss_fn(model(xb), yb) * len(xb)).backward()
        for p in model.parameters():
            p.grad /= seen
    '''),
            ("2", "reduce-scatter only", "add the all-gather phase", '''
    def ring_all_reduce(t):
        rank, world = dist.get_rank(), dist.get_world_size()
        right, left = (rank + 1) % world, (rank - 1) % world
        chunks = list(t.tensor_split(world))
        for step in range(world - 1):
            out, into = (rank - step) % world, (rank - step - 1) % world
            buf = torch.empty_like(chunks[into])
            exchange(chunks[out], buf, right, left)
            chunks[into] += buf
    '''),
            ("2", "adds in the all-gather phase", "copy it into yours, do not add it", '''
    def ring_all_reduce(t):
        rank, world = dist.get_rank(), dist.get_world_size()
        right, left = (rank + 1) % world, (rank - 1) % world
        chunks = list(t.tensor_split(world))
        for step in range(world - 1):
            out, into = (rank - step) % world, (rank - step - 1) % world
            buf = torch.empty_like(chunks[into])
            exchange(chunks[out], buf, right, left)
            chunks[into] += buf
        for step in range(world - 1):
            out, into = (rank + 1 - step) % world, (rank - step) % world
            buf = torch.empty_like(chunks[into])
            exchange(chunks[out], buf, right, left)
            chunks[into] += buf
    '''),
            ("2", "overwrites in the reduce-scatter phase", "add each received chunk to yours (+=)", '''
    def ring_all_reduce(t):
        rank, world = dist.get_rank(), dist.get_world_size()
        right, left = (rank + 1) % world, (rank - 1) % world
        chunks = list(t.tensor_split(world))
        for step in range(world - 1):
            out, into = (rank - step) % world, (rank - step - 1) % world
            buf = torch.empty_like(chunks[into])
            exchange(chunks[out], buf, right, left)
            chunks[into].copy_(buf)
        for step in range(world - 1):
            out, into = (rank + 1 - step) % world, (rank - step) % world
            buf = torch.empty_like(chunks[into])
            exchange(chunks[out], buf, right, left)
            chunks[into].copy_(buf)
    '''),
            ("2", "calls the collective", "from dist.send / dist.recv", '''
    def ring_all_reduce(t):
        dist.all_reduce(t)
    '''),
            ("2", "goes through rank 0", "where a ring sends 2(N-1)/N x 16,384 = 24,576", '''
    def ring_all_reduce(t):
        root_all_reduce(t)
    '''),
            ("2", "averages", "do not divide by the world size", '''
    def ring_all_reduce(t):
        root_all_reduce(t)
        t /= dist.get_world_size()
    '''),
            ("2", "its own complete chunk never written", "a NaN or an infinity in rank 0's t after your ring", '''
    def ring_all_reduce(t):
        rank, world = dist.get_rank(), dist.get_world_size()
        right, left = (rank + 1) % world, (rank - 1) % world
        chunks = list(t.tensor_split(world))
        for step in range(world - 1):
            out, into = (rank - step) % world, (rank - step - 1) % world
            buf = torch.empty_like(chunks[into])
            exchange(chunks[out], buf, right, left)
            chunks[into] += buf
        # the complete sums, gathered apart from t (NaN marks a chunk not received yet)
        result = [torch.full_like(c, float("nan")) for c in chunks]
        for step in range(world - 1):
            out, into = (rank + 1 - step) % world, (rank - step) % world
            exchange(chunks[out] if step == 0 else result[out], result[into], right, left)
        t.copy_(torch.cat(result))
    '''),
]

PRINTED = [
    "summed micro-batch gradients / one big batch:   4.000",
    "saved for backward, batch of 8: 78,208 bytes; micro-batch of 2: 28,768 bytes",
    "  rank 3: [31, 32, 33, 34]                 ->  [1, 2, 3, 4]",
    "  rank 0: [1, 2, 3, 4]                     ->  [64, 68, 72, 76]",
    "  rank 3: [31, 32]                         ->  [[1, 2], [11, 12], [21, 22], [31, 32]]",
    "  rank 2: [21, 22, 23, 24, 25, 26, 27, 28] ->  [5, 6]",
    "  rank 3: [31, 32, 33, 34, 35, 36, 37, 38] ->  [88, 92]",
    "  rank 1: [11, 12, 13, 14, 15, 16, 17, 18] ->  [[3, 4], [13, 14], [23, 24], [33, 34]]",
    "rank 0: sent 49,152 bytes, result 4",
    "rank 1: sent 16,384 bytes, result 4",
    "rank 2: sent 12,288 bytes, first value of each chunk [1, 2, 3, 4]",
    "(N-1)/N x 16,384 = 12,288 bytes; a ring all-reduce, twice that: 2(N-1)/N x 16,384 = 24,576 bytes",
]
