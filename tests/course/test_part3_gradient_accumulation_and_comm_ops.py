"""Part 3's answers: gradient accumulation over micro-batches (one process), and a ring all-reduce built
from send and recv on 4 real ranks."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 3

# The reference ring with one line changed, as the mistakes below change it.
RING = '''
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
        chunks[into].copy_(buf)
'''


def ring(old, new):
    assert old in RING, old
    return RING.replace(old, new)


WRONG = [  # (exercise, label, what the check must say, answer source)
    # The step count of the notebook's 4 ranks written in: right there, one step too many on 3.
    (2, "3 steps written in", "a ring all-reduce sends 2(N-1) = 4", ring("for step in range(world - 1):",
                                                                       "for step in range(3):")),
    # A request left unwaited passes or fails by the timing (gloo sends a small chunk at once): named every time.
    (2, "the isend's request never waited for", "the request of isend to rank", ring(
        "exchange(chunks[out], buf, right, left)", '''sending = dist.isend(chunks[out], right)
        dist.recv(buf, left)''')),
    (2, "batch_isend_irecv, only the receive waited for", "the request of isend to rank", ring(
        "exchange(chunks[out], buf, right, left)",
        '''ops = [dist.P2POp(dist.isend, chunks[out], right), dist.P2POp(dist.irecv, buf, left)]
        dist.batch_isend_irecv(ops)[1].wait()''')),
    (2, "irecv posted first, chunks of t.chunk", "t.chunk(N) can give fewer than N pieces", '''
def ring_all_reduce(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = t.chunk(world)   # 257 elements: 65, 65, 65, 62 - still one chunk per rank
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world - 1):
            shift = step if phase == "reduce-scatter" else step - 1
            out, into = (rank - shift) % world, (rank - shift - 1) % world
            buf = torch.zeros_like(chunks[into])
            receiving = dist.irecv(buf, left)
            sending = dist.isend(chunks[out], right)
            receiving.wait()
            sending.wait()
            if phase == "reduce-scatter":
                chunks[into].add_(buf)
            else:
                chunks[into].copy_(buf)
'''),
    (1, 'its own MSE, not loss_fn', 'never called loss_fn', '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    # the sum of squared errors divided by the whole batch's element count: exact, no weighting needed
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        loss = ((model(xb) - yb) ** 2).sum() / y.numel()
        loss.backward()
'''),
    (2, 't.chunk instead of t.tensor_split', 't.chunk(N) can give fewer than N pieces', '''
def ring_all_reduce(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.chunk(world))
    for step in range(world - 1):
        out, into = (rank - step) % world, (rank - step - 1) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, right, left)
        chunks[into] += buf
    for step in range(world - 1):
        out, into = (rank + 1 - step) % world, (rank - step) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, right, left)
        chunks[into].copy_(buf)
'''),
    (1, "sums the micro-batches", "an average, not a sum", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        loss_fn(model(xb), yb).backward()
'''),
    (1, "divides by the number of micro-batches", "weight each micro-batch loss by its share of the samples", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        (loss_fn(model(xb), yb) / num_micro_batches).backward()
'''),
    (1, "zeroes the gradients in the loop", "do not call zero_grad() between micro-batches", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        model.zero_grad()
        (loss_fn(model(xb), yb) * len(xb) / len(x)).backward()
'''),
    (1, "divides by a sample count never counted", "a NaN or an infinity in your accumulated gradients", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    seen = 0  # samples so far: meant to grow by len(xb) each micro-batch
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        (loss_fn(model(xb), yb) * len(xb)).backward()
    for p in model.parameters():
        p.grad /= seen
'''),
    (1, "the whole batch in one pass", "in one forward pass", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    loss_fn(model(x), y).backward()   # the same gradient, and no loop to get wrong
'''),
    (1, "sums the losses, one backward", "every micro-batch ran forward before any ran backward", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    total = 0
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        total = total + loss_fn(model(xb), yb) * (len(xb) / len(x))
    total.backward()
'''),
    (1, "skips the last micro-batch", "forward pass(es) for", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    xs, ys = x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)
    for i in range(num_micro_batches - 1):
        (loss_fn(model(xs[i]), ys[i]) * (len(xs[i]) / len(x))).backward()
'''),
    (1, "micro-batches of a fixed size", "saw micro-batches of sizes", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    size = len(x) // num_micro_batches   # 8 samples in 3: 2, 2, 2 - and the last 2 samples?
    for i in range(num_micro_batches):
        xb, yb = x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]
        (loss_fn(model(xb), yb) * (len(xb) / len(x))).backward()
'''),

    # The ring's length taken from t.chunk's pieces: right where N divides the tensor, short on 6 elements.
    (2, "a ring over the pieces of t.chunk", "your ring went round 3 chunks in 4 steps",
     ring("    chunks = list(t.tensor_split(world))\n", "    chunks = list(t.chunk(world))\n    world = len(chunks)\n")),
    # A chunk rebound to a new tensor in the reduce-scatter: both phases run, and t never sees their sums.
    (2, "a chunk rebound, not written in place", "A chunk rebound (chunks[j] = chunks[j] + buf) is a new tensor",
     ring("        chunks[into] += buf", "        chunks[into] = chunks[into] + buf")),
    (2, "reduce-scatter only", "add the all-gather phase", ring('''
    for step in range(world - 1):
        out, into = (rank + 1 - step) % world, (rank - step) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, right, left)
        chunks[into].copy_(buf)
''', '\n')),
    (2, "adds in the all-gather phase", "copy it into yours, do not add it",
     ring("chunks[into].copy_(buf)", "chunks[into] += buf")),
    (2, "overwrites in the reduce-scatter phase", "add each received chunk to yours (+=)",
     ring("chunks[into] += buf", "chunks[into].copy_(buf)")),
    (2, "calls the collective", "rank 0 called dist.all_reduce", '''
def ring_all_reduce(t):
    dist.all_reduce(t)
'''),
    (2, "reduce-scatter and all-gather collectives", "called dist.all_gather, dist.reduce_scatter", '''
def ring_all_reduce(t):
    world = dist.get_world_size()
    chunks = list(t.chunk(world))
    mine = torch.empty_like(chunks[0])
    dist.reduce_scatter(mine, chunks)
    dist.all_gather(chunks, mine)
    t.copy_(torch.cat(chunks))
'''),
    (2, "ring reduce-scatter, then the all-gather collective", "called dist.all_gather", ring('''
    for step in range(world - 1):
        out, into = (rank + 1 - step) % world, (rank - step) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, right, left)
        chunks[into].copy_(buf)
''', '''
    mine = chunks[(rank + 1) % world].clone()
    pieces = [torch.empty_like(c) for c in chunks]
    dist.all_gather(pieces, mine)
    for j, piece in enumerate(pieces):
        chunks[(j + 1) % world].copy_(piece)
''')),
    (2, "goes through rank 0", "where a ring sends 2(N-1)/N x 16,384 = 24,576", '''
def ring_all_reduce(t):
    root_all_reduce(t)
'''),
    (2, "everyone sends everything to everyone", "each sent to every other rank", '''
def ring_all_reduce(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = t.clone()
    requests = [dist.isend(mine, peer) for peer in range(world) if peer != rank]
    buf = torch.empty_like(t)
    for peer in range(world):
        if peer != rank:
            dist.recv(buf, peer)
            t += buf
    for request in requests:
        request.wait()
'''),
    (2, "passes whole tensors around the ring", "more than one chunk", '''
def ring_all_reduce(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    passing = t.clone()
    for step in range(world - 1):   # each rank's tensor travels around once
        buf = torch.empty_like(t)
        exchange(passing, buf, right, left)
        t += buf
        passing = buf
'''),
    (2, "one step too many in the reduce-scatter", "range(world - 1) in each phase",
     ring("    for step in range(world - 1):\n        out, into = (rank - step) % world, (rank - step - 1) % world",
          "    for step in range(world):\n        out, into = (rank - step) % world, (rank - step - 1) % world")),
    (2, "sends to rank + 2", "sends only to its right-hand neighbour",
     ring("right, left = (rank + 1) % world, (rank - 1) % world",
          "right, left = (rank + 2) % world, (rank - 2) % world")),
    (2, "averages", "do not divide by the world size", RING + "    t /= world\n"),
    (2, "its own complete chunk never written", "a NaN or an infinity in rank 0's t after your ring", '''
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
    (2, "chunks cloned, t never written", "t is unchanged on every rank",
     ring("chunks = list(t.tensor_split(world))", "chunks = [c.clone() for c in t.tensor_split(world)]")),
    (2, "chunks of numel // world", "were never summed", ring(
        "chunks = list(t.tensor_split(world))",
        "size = t.numel() // world\n    chunks = [t[i * size:(i + 1) * size] for i in range(world)]")),
    (2, "blocking sends first: a deadlock", "post the send with dist.isend", '''
def ring_all_reduce(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.tensor_split(world))
    for step in range(world - 1):
        out, into = (rank - step) % world, (rank - step - 1) % world
        buf = torch.empty_like(chunks[into])
        dist.send(chunks[out], right)
        dist.recv(buf, left)
        chunks[into] += buf
    for step in range(world - 1):
        out, into = (rank + 1 - step) % world, (rank - step) % world
        buf = torch.empty_like(chunks[into])
        dist.send(chunks[out], right)
        dist.recv(buf, left)
        chunks[into].copy_(buf)
'''),
    (2, "goes round the ring but sums with a functional all-reduce", "a collective does the communication", '''
def ring_all_reduce(t):
    import torch.distributed._functional_collectives as funcol
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.tensor_split(world))
    for step in range(2 * (world - 1)):
        buf = torch.empty_like(chunks[(rank - step - 1) % world])
        exchange(chunks[(rank - step) % world].clone(), buf, right, left)
    t.copy_(funcol.all_reduce(t, "sum", dist.group.WORLD))
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "weights by samples, divides at the end", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        (loss_fn(model(xb), yb) * len(xb)).backward()     # the sum of the squared errors' means, by samples
    for p in model.parameters():
        p.grad /= len(x)
'''),
    (1, "the weight passed to backward", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    for xb, yb in zip(x.chunk(num_micro_batches), y.chunk(num_micro_batches)):
        loss = loss_fn(model(xb), yb)
        loss.backward(gradient=torch.tensor(len(xb) / len(x)))
'''),
    (1, "autograd.grad, added by hand", '''
def accumulate_gradients(model, loss_fn, x, y, num_micro_batches):
    params = list(model.parameters())
    for xb, yb in zip(x.tensor_split(num_micro_batches), y.tensor_split(num_micro_batches)):
        grads = torch.autograd.grad(loss_fn(model(xb), yb) * len(xb) / len(x), params)
        for p, g in zip(params, grads):
            p.grad = g if p.grad is None else p.grad + g
'''),

    (2, "batch_isend_irecv", ring(
        "exchange(chunks[out], buf, right, left)",
        '''ops = [dist.P2POp(dist.isend, chunks[out], right), dist.P2POp(dist.irecv, buf, left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()''')),
    (2, "blocking send and recv, even ranks first", ring("exchange(chunks[out], buf, right, left)", '''if rank % 2 == 0:
            dist.send(chunks[out], right)
            dist.recv(buf, left)
        else:
            dist.recv(buf, left)
            dist.send(chunks[out], right)''')),
    (2, "the ring turning leftwards", '''
def ring_all_reduce(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.tensor_split(world))
    for step in range(world - 1):   # the mirror image: send left, receive from the right
        out, into = (rank + step) % world, (rank + step + 1) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, left, right)
        chunks[into] += buf
    for step in range(world - 1):
        out, into = (rank - 1 + step) % world, (rank + step) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, left, right)
        chunks[into].copy_(buf)
'''),
    (2, "reduce-scatter rightwards, all-gather leftwards", '''
def ring_all_reduce(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.tensor_split(world))
    for step in range(world - 1):   # reduce-scatter, rightwards: rank r ends with the sum of chunk r + 1
        out, into = (rank - step) % world, (rank - step - 1) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, right, left)
        chunks[into] += buf
    for step in range(world - 1):   # all-gather, leftwards
        out, into = (rank + 1 + step) % world, (rank + 2 + step) % world
        buf = torch.empty_like(chunks[into])
        exchange(chunks[out], buf, left, right)
        chunks[into].copy_(buf)
'''),

]
