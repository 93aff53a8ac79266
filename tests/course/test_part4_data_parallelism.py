"""Part 4's answers: overlapped data parallelism with per-parameter hooks, and gradient buckets, on 2 ranks."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 4

# Exercise 1's answers differ in the hook, or in what follows backward: the rest is the starter's.
_HEAD = '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    pending = []
'''
_TAIL = '''
    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(model(x), y).backward()
    for work in pending:
        work.wait()
    for h in handles:
        h.remove()
'''


def _hooked(hook, tail=_TAIL):
    return _HEAD + hook + tail


def _on_ddp(hook):
    return _HEAD + hook + '''
    ddp = DDP(model)
    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(ddp(x), y).backward()
    for work in pending:
        work.wait()
    for h in handles:
        h.remove()
'''


# Exercise 2's answers: the rule's buckets, or another grouping, then the reduction of each bucket.
_BUCKETS = '''
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
_REDUCE = '''
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        flat.div_(world)
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
'''


def _grouped(grouping):
    """Buckets made another way, each reduced as the rule says."""
    return '''
def bucketed_all_reduce(params, cap_numel):
    world = dist.get_world_size()
''' + grouping + _REDUCE


WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, 'hooks never removed', 'stay registered after the step', '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    pending = []

    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.all_reduce(p.grad, async_op=True))

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(model(x), y).backward()
    for w in pending:
        w.wait()
'''),
    # The notebook's 2 ranks written in: right there, 1.5x the average on 3.
    (1, "divides by 2, the notebook's world size", "on 3 ranks (24 samples) rank 0's gradients are 1.500x", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(2)
        pending.append(dist.all_reduce(p.grad, async_op=True))
''')),
    (1, "sums instead of averaging", "summed, not averaged", _hooked('''
    def on_grad_ready(p):
        pending.append(dist.all_reduce(p.grad, async_op=True))
''')),
    (1, "SUM hook on top of DDP", "reduced twice: DDP already averages every gradient across the ranks, and "
     "your hook all-reduces it again, so the gradients come out 2.000x", _on_ddp('''
    def on_grad_ready(p):
        dist.all_reduce(p.grad)  # the hook of the section's example: SUM, on top of DDP
''')),
    (1, "averaging hook on top of DDP", "it again: averaged twice", _on_ddp('''
    def on_grad_ready(p):
        p.grad.div_(world)
        dist.all_reduce(p.grad)
''')),
    (1, "asynchronous SUM hook on top of DDP", "races with DDP's copy of the gradient", _on_ddp('''
    def on_grad_ready(p):
        pending.append(dist.all_reduce(p.grad, async_op=True))
''')),
    (1, "DDP alone, no hooks", "DDP did all the communication", '''
def overlapped_data_parallel(model, x, y, loss_fn):
    ddp = DDP(model)
    loss_fn(ddp(x), y).backward()
'''),
    (1, "hook and a loop after backward", "reduced twice (12 all-reduces for 6 gradients", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.all_reduce(p.grad, async_op=True))
''', _TAIL + '''
    for p in model.parameters():
        dist.all_reduce(p.grad)
''')),
    (1, "averages twice: a hook and a loop", "12 all-reduces for 6 gradients. The values are right", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.all_reduce(p.grad, async_op=True))
''', _TAIL + '''
    for p in model.parameters():
        p.grad.div_(world)
        dist.all_reduce(p.grad)
''')),
    (1, "reduces to rank 0 only", "only rank 0 holds the reduced gradients", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.reduce(p.grad, dst=0, async_op=True))
''')),
    (1, "reduces to rank 0, then broadcasts", "reduce to rank 0 then broadcast", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.reduce(p.grad, dst=0, async_op=True))
''', _TAIL + '''
    for p in model.parameters():
        dist.broadcast(p.grad, src=0)
''')),
    (1, "broadcasts rank 0's gradients", "broadcast copies rank 0's gradient", _hooked('''
    def on_grad_ready(p):
        pending.append(dist.broadcast(p.grad, src=0, async_op=True))
''')),
    (1, "all-gathers and sums locally", "all-gathered", _hooked('''
    def on_grad_ready(p):
        copies = [torch.zeros_like(p.grad) for _ in range(world)]
        dist.all_gather(copies, p.grad)
        p.grad.copy_(torch.stack(copies).mean(0))
''')),
    (1, "swaps gradients point to point", "point to point", _hooked('''
    def on_grad_ready(p):
        other = 1 - dist.get_rank()
        theirs = torch.empty_like(p.grad)
        send = dist.isend(p.grad.clone(), other)
        dist.recv(theirs, other)
        send.wait()
        p.grad.add_(theirs).div_(world)
''')),
    (1, "ReduceOp.AVG and a division too", "ReduceOp.AVG already divides", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, async_op=True))
''')),
    (1, "all-reduces a copy in bfloat16", "bfloat16", '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    pending = []

    def on_grad_ready(p):
        half = (p.grad / world).to(torch.bfloat16)  # half the bytes on the network
        pending.append((p, half, dist.all_reduce(half, async_op=True)))

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(model(x), y).backward()
    for p, half, work in pending:
        work.wait()
        p.grad.copy_(half)
    for h in handles:
        h.remove()
'''),
    (1, "all-reduces a copy, never written back", "did not reach p.grad", _hooked('''
    def on_grad_ready(p):
        share = p.grad / world  # a new tensor: p.grad itself is never reduced
        pending.append(dist.all_reduce(share, async_op=True))
        shares.append(share)

    shares = []
''')),
    (1, "averages on rank 0 only", "only rank 0 ended with the average", _hooked('''
    def on_grad_ready(p):
        pending.append(dist.all_reduce(p.grad, async_op=True))
''', _TAIL + '''
    if dist.get_rank() == 0:
        for p in model.parameters():
            p.grad.div_(world)
''')),
    (1, "divides before and after", "divided by the world size twice", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.all_reduce(p.grad, async_op=True))
''', _TAIL + '''
    for p in model.parameters():
        p.grad.div_(world)
''')),
    # The division raced with the reduction: whether it lands before or after is the timing's.
    (1, "divides while the all-reduce is in flight", "changed in place (div_, mul_, ...) while their asynchronous",
     _hooked('''
    def on_grad_ready(p):
        pending.append(dist.all_reduce(p.grad, async_op=True))
        p.grad.div_(world)
''')),
    # Hooks on the weights only: the biases keep each rank's own gradient.
    (1, "hooks on the weights only", "were never all-reduced", _HEAD + '''
    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.all_reduce(p.grad, async_op=True))

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters() if p.dim() > 1]
    loss_fn(model(x), y).backward()
    for work in pending:
        work.wait()
    for h in handles:
        h.remove()
'''),
    # Imported by name before the check wraps torch.distributed: the name in the answer's globals is wrapped too.
    (1, "blocking all_reduce imported by name", "each all-reduce blocks", '''
from torch.distributed import all_reduce

def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()

    def on_grad_ready(p):
        p.grad.div_(world)
        all_reduce(p.grad)

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(model(x), y).backward()
    for h in handles:
        h.remove()
'''),
    (1, "never waits", "never waited for", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.all_reduce(p.grad, async_op=True))
''', '''
    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(model(x), y).backward()
    for h in handles:
        h.remove()
''')),
    (1, "naive: reduces after backward", "start after backward has finished", '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    loss_fn(model(x), y).backward()
    pending = [dist.all_reduce(p.grad.div_(world), async_op=True) for p in model.parameters()]
    for work in pending:
        work.wait()
'''),
    (1, "one flat all-reduce after backward", "one all-reduce for 6 gradients", '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    loss_fn(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(world)
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
'''),
    (1, "blocking all-reduce in the hook", "each all-reduce blocks", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(world)
        dist.all_reduce(p.grad)
''')),
    (1, "asynchronous all-reduce waited for in the hook", "waited for in the hook that started it", _hooked('''
    def on_grad_ready(p):
        p.grad.div_(world)
        dist.all_reduce(p.grad, async_op=True).wait()
''')),
    (1, "divides by a count still zero", "a NaN or an infinity in rank 0's gradients", '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    pending = []
    backwards = 0  # counted after backward: still 0 when the hooks run

    def on_grad_ready(p):
        p.grad.div_(world * backwards)
        pending.append(dist.all_reduce(p.grad, async_op=True))
''' + _TAIL + '''
    backwards += 1
'''),
    (1, "hooks registered on rank 0 only", "deadlock on 2 ranks", '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    pending = []

    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.all_reduce(p.grad, async_op=True))

    handles = []
    if dist.get_rank() == 0:  # "the main rank does the communication"
        handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(model(x), y).backward()
    for work in pending:
        work.wait()
    for h in handles:
        h.remove()
'''),
    (2, "never writes the reduced bucket back", "torch.cat makes a copy", _BUCKETS + '''
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        flat.div_(world)
        dist.all_reduce(flat)
'''),
    (2, "closes the still-empty bucket when the first gradient is over the cap", "the still-empty bucket was closed",
     _grouped('''
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if size + p.numel() > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(current)
''')),
    (2, "all-reduces an empty bucket it made with torch.zeros", "an empty bucket", '''
def bucketed_all_reduce(params, cap_numel):
    world = dist.get_world_size()
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if size + p.numel() > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket]) if bucket else torch.zeros(0)
        flat.div_(world)
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
'''),
    (2, "drops the last, partial bucket", "you dropped the last, partial bucket", _grouped('''
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
''')),
    (2, "one bucket per layer", "one bucket per layer", _grouped('''
    buckets = [[params[i], params[i - 1]] for i in range(len(params) - 1, 0, -2)]
''')),
    (2, "DDP's rule: close once the cap is reached", "that is PyTorch DDP's rule", _grouped('''
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
    (2, "a full bucket closed early (>= for >)", "may hold exactly cap_numel", _grouped('''
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() >= cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(current)
''')),
    (2, "counts bytes, not elements", "counted bytes", _grouped('''
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
''')),
    (2, "forward order", "registration (forward) order", _grouped('''
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
    (2, "one all-reduce per parameter", "one per parameter is no bucketing", _grouped('''
    buckets = [[p] for p in reversed(params)]
''')),
    (2, "one bucket for everything", "one bucket of all 484 elements", _grouped('''
    buckets = [list(reversed(params))]
''')),
    (2, "sums the buckets instead of averaging", "summed, not averaged", _BUCKETS + '''
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
'''),
    (2, "writes the slices back in forward order", "offsets in bucket order", _BUCKETS + '''
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket]).div_(world)
        dist.all_reduce(flat)
        offset = 0
        for p in reversed(bucket):  # "registration order", the order of params
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
'''),
    (2, "all-gathers each bucket and sums", "all-gathered", _BUCKETS + '''
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        copies = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(copies, flat)
        flat = torch.stack(copies).sum(0) / world
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
'''),
    (2, "reduces each bucket to rank 0, then broadcasts", "reduce to rank 0 then broadcast", _BUCKETS + '''
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket]).div_(world)
        dist.reduce(flat, dst=0)
        dist.broadcast(flat, src=0)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
'''),
    (2, "counts the ranks from zeros", "a NaN or an infinity in rank 0's gradients", _BUCKETS + '''
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
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    # The rule's buckets, each flattened in forward order (reversed again inside): the same buckets, the
    # same all-reduces, each gradient copied back from where it was put.
    (2, "each bucket flattened in forward order", _BUCKETS + '''
    for bucket in buckets:
        inside = bucket[::-1]
        flat = torch.cat([p.grad.reshape(-1) for p in inside])
        flat.div_(world)
        dist.all_reduce(flat)
        offset = 0
        for p in inside:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
'''),
    (1, 'waited through futures (torch.futures.wait_all)', '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    pending = []

    def on_grad_ready(p):
        p.grad.div_(world)
        pending.append(dist.all_reduce(p.grad, async_op=True).get_future())

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(model(x), y).backward()
    torch.futures.wait_all(pending)
    for h in handles:
        h.remove()
'''),
    (1, "one all-reduce in flight: each hook waits for the previous one", '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    last = []

    def on_grad_ready(p):
        if last:
            last.pop().wait()
        p.grad.div_(world)
        last.append(dist.all_reduce(p.grad, async_op=True))

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(model(x), y).backward()
    for work in last:
        work.wait()
    for h in handles:
        h.remove()
'''),
    (1, "sums in the hook, divides after waiting", '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    pending = {}

    def on_grad_ready(p):
        pending[p] = dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=dist.group.WORLD, async_op=True)

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for _, p in model.named_parameters()]
    loss_fn(model(x), y).backward()
    for p, work in reversed(list(pending.items())):
        work.wait()
        p.grad /= world
    for h in handles:
        h.remove()
'''),
    (1, "scales the loss instead of the gradients", '''
def overlapped_data_parallel(model, x, y, loss_fn):
    world = dist.get_world_size()
    pending = []

    def on_grad_ready(p):
        pending.append(dist.all_reduce(p.grad, async_op=True))

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters() if p.requires_grad]
    loss = loss_fn(model(x), y) / world  # the sum of the ranks' gradients is then the average
    loss.backward()
    while pending:
        pending.pop().wait()
    for h in handles:
        h.remove()
'''),
    (1, "ReduceOp.AVG, imported by name", '''
from torch.distributed import ReduceOp, all_reduce

def overlapped_data_parallel(model, x, y, loss_fn):
    pending = []

    def on_grad_ready(p):
        pending.append(all_reduce(p.grad, op=ReduceOp.AVG, async_op=True))  # gloo averages too, in this torch

    handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in model.parameters()]
    loss_fn(model(x), y).backward()
    for work in pending:
        work.wait()
    for h in handles:
        h.remove()
'''),
    (2, "one preallocated buffer per bucket, asynchronous, divided after", '''
def bucketed_all_reduce(params, cap_numel):
    world = dist.get_world_size()
    buckets = [[]]
    for p in params[::-1]:
        if buckets[-1] and sum(q.numel() for q in buckets[-1]) + p.numel() > cap_numel:
            buckets.append([])
        buckets[-1].append(p)
    works = []
    for bucket in buckets:
        flat = torch.zeros(sum(p.numel() for p in bucket))
        offset = 0
        for p in bucket:
            flat[offset:offset + p.numel()] = p.grad.flatten()
            offset += p.numel()
        works.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
    for bucket, flat, work in works:
        work.wait()
        for p, piece in zip(bucket, torch.split(flat / world, [p.numel() for p in bucket])):
            p.grad.copy_(piece.view_as(p.grad))
'''),
    (2, "all_reduce imported by name, ReduceOp.AVG", '''
from torch.distributed import ReduceOp, all_reduce

def bucketed_all_reduce(params, cap_numel):
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([p.grad.flatten() for p in bucket])
        all_reduce(flat, op=ReduceOp.AVG)  # averages: no division
        for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(piece.view_as(p.grad))
'''),
    (2, "torch's flatten and unflatten helpers", '''
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

def bucketed_all_reduce(params, cap_numel):
    world = dist.get_world_size()
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    buckets.append(current)
    for bucket in buckets:
        grads = [p.grad for p in bucket]
        flat = _flatten_dense_tensors(grads)
        flat /= world
        dist.all_reduce(flat)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
'''),
]
