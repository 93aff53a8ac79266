"""Part 12, interleaved and zero-bubble schedules: layers of virtual stages, and a linear layer's
backward split into its input-gradient and weight-gradient halves.

Exercise 1 is checked against the engine's partition (ultrascale.parallel.pipeline.partition),
the rule its pipeline runtime cuts the model with; an answer that calls that partition is told
to write it, and a wrong one is recognised by the rule it follows (ids from 1, a lap of v ranks,
sizes rounded up, a V swapped or upside down). Exercise 2 is checked against torch
autograd on the same layer, and by deferring the weight half past a whole backward.
"""

from __future__ import annotations

from ultrascale.series.checks import require_finite

CASES_1 = [(8, 4, 2), (8, 2, 2), (10, 2, 2), (12, 4, 3), (7, 2, 3), (16, 4, 2), (6, 2, 1)]


def _dealt(stages, p, v, index):
    """The virtual stages dealt to (rank, chunk) by `index(r, c)`, None where it runs past the end."""
    try:
        return [[list(stages[index(r, c)]) for c in range(v)] for r in range(p)]
    except IndexError:
        return None


def _placement_mistake(where, got, stages, n, p, v):
    """The message for a layer placement that is not the engine's, the mistake named where known;
    None for the engine's (chunk c of rank r is virtual stage c·p + r)."""
    if got == _dealt(stages, p, v, lambda r, c: c * p + r):
        return None
    flat = sorted(i for rank in got for chunk in rank for i in chunk)
    if flat == list(range(1, n + 1)):
        return (f"{where}: your layers are numbered 1..{n}; layer ids count from 0, as the model's blocks do: "
                f"0..{n - 1}")
    if v > 1 and got == _dealt(stages, p, v, lambda r, c: c * v + r):
        return (f"{where}: rank {p - 1} chunk 1 holds {got[p - 1][1]}, virtual stage 1·v + {p - 1}: chunk c of "
                f"rank r is virtual stage c·p + r (a lap of the ring passes all p ranks), so it holds "
                f"{list(stages[p + p - 1])}")
    if flat != list(range(n)):
        missing = sorted(set(range(n)) - set(flat))
        if missing:
            return (f"{where}: layers {missing} are on no rank: {n} does not divide by p·v = {p * v}; the first "
                    f"{n} mod {p * v} = {n % (p * v)} virtual stages take one layer more")
        return f"{where}: some layers are on two chunks: {flat}"
    sizes_got = sorted(len(c) for rank in got for c in rank)
    if sizes_got == sorted(len(s) for s in stages):
        per_rank = [sorted(i for c in rank for i in c) for rank in got]
        if per_rank == [list(range(r * n // p, (r + 1) * n // p)) for r in range(p)] and v > 1:
            return (f"{where}: rank 0 holds {got[0]}, one contiguous run of layers cut into chunks; interleaving "
                    f"deals the p·v virtual stages round-robin: chunk c of rank r is virtual stage c·p + r, so "
                    f"rank 0 holds {[list(stages[c * p]) for c in range(v)]}")
    order = [len(got[s % p][s // p]) for s in range(p * v)]
    if order != [len(s) for s in stages]:
        size = -(-n // (p * v))
        if order == [max(0, min(size, n - s * size)) for s in range(p * v)]:
            return (f"{where}: virtual stages hold {order} layers: every one ⌈n/(p·v)⌉ = {size} and the last what "
                    f"remains; the engine balances them, sizes differ by at most one: "
                    f"{[len(s) for s in stages]}, the first {n} mod {p * v} taking one more")
        return (f"{where}: virtual stages hold {order} layers, the engine {[len(s) for s in stages]}: the first "
                f"{n} mod {p * v} virtual stages take the extra layers (virtual stage 0 first)")
    for r in range(p):
        for c in range(v):
            if got[r][c] != list(stages[c * p + r]):
                return (f"{where}: rank {r} chunk {c} holds {got[r][c]}, the engine puts {list(stages[c * p + r])} "
                        f"there: it is virtual stage c·p + r = {c * p + r}, and the virtual stages take the layers "
                        f"in order")
    return None


def exercise_1(layer_assignment):
    """layer_assignment(n_layers, p, v) -> [[layer ids of chunk c] for c in range(v)] for each rank."""
    from ultrascale.parallel.pipeline.partition import split
    from ultrascale.series.checks.part11 import engine_calls

    _, called = engine_calls("ultrascale.parallel.pipeline.partition", layer_assignment, 10, 2, 2)
    if called:
        raise AssertionError(f"layer_assignment calls the engine's partition ({', '.join(sorted(called))}): the "
                             f"exercise is to write it: cut the layers into p·v virtual stages, the first n mod p·v "
                             f"one larger, and give chunk c of rank r virtual stage c·p + r")
    for n, p, v in CASES_1:
        got = layer_assignment(n, p, v)
        where = f"{n} layers, p = {p}, v = {v}"
        stages = split(n, p, v)
        require_finite(got, f"your layer ids for {where}")  # int(nan) would fail with a ValueError
        try:
            got = [[[int(i) for i in chunk] for chunk in rank] for rank in got]
        except TypeError:
            raise AssertionError(f"{where}: return a list per rank, of a list per chunk, of layer ids") from None
        if len(got) != p or any(len(rank) != v for rank in got):
            raise AssertionError(f"{where}: got {len(got)} ranks with {[len(r) for r in got]} chunks; "
                                 f"want {p} ranks of {v} chunks each")
        problem = _placement_mistake(where, got, stages, n, p, v)
        if problem:
            raise AssertionError(problem)
    print(f"the layers of every (rank, chunk) match the engine's partition for {len(CASES_1)} (layers, p, v)")


# -- exercise 2 ---------------------------------------------------------------------------------

def _first_line(e) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _describe(name, got, want):
    import torch

    if not isinstance(got, torch.Tensor):
        return f"{name} is {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"{name} has shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if got.dtype != want.dtype:
        dtype, wanted = (str(t).replace("torch.", "") for t in (got.dtype, want.dtype))
        return (f"{name} is {dtype}, the layer's tensors {wanted}: make buffers like the inputs "
                f"(torch.zeros_like, or dtype=x.dtype; torch.zeros(...) alone is float32)")
    return None


def exercise_2(input_grad, weight_grad):
    """input_grad(grad_out, weight) -> grad_x; weight_grad(x, grad_out) -> (grad_w, grad_b)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    F.linear(x, w, b).backward(grad_out)

    try:
        gx = input_grad(grad_out.clone(), w.detach().clone())
    except NotImplementedError:
        raise
    except RuntimeError as e:
        raise AssertionError(f"input_grad failed ({_first_line(e)}): y = x Wᵀ + b, so "
                             f"dL/dx = grad_out @ W, [..., out] @ [out, in]") from None
    problem = _describe("the input gradient", gx, x.grad)
    if problem:
        raise AssertionError(f"{problem}: dL/dx = grad_out @ W has the shape of x")
    require_finite(gx, "your input gradient")
    if not torch.allclose(gx, x.grad):
        raise AssertionError("the input gradient differs from autograd's: y = x Wᵀ + b, so dL/dx = grad_out @ W")
    try:
        got = weight_grad(x.detach().clone(), grad_out.clone())
    except NotImplementedError:
        raise
    except RuntimeError as e:
        raise AssertionError(f"weight_grad failed ({_first_line(e)}): flatten x and grad_out to "
                             f"[tokens, features] first") from None
    if not isinstance(got, tuple) or len(got) != 2:
        raise AssertionError("weight_grad returns a tuple (grad_w, grad_b)")
    require_finite(got, "your (weight, bias) gradients")
    gw, gb = got
    if isinstance(gw, torch.Tensor) and tuple(gw.shape) == tuple(w.shape)[::-1]:
        raise AssertionError(f"your weight gradient has shape {tuple(gw.shape)}, the weight {tuple(w.shape)} "
                             f"([out, in]): it is transposed; dL/dW = grad_outᵀ @ x")
    if isinstance(gw, torch.Tensor) and gw.dim() == 3:
        raise AssertionError(f"your weight gradient has shape {tuple(gw.shape)}: one per batch element; the "
                             f"weight is shared by every token, so sum over batch and sequence: reshape x and "
                             f"grad_out to [tokens, features], then grad_outᵀ @ x")
    problem = _describe("the weight gradient", gw, w.grad)
    if problem:
        raise AssertionError(f"{problem}: dL/dW = grad_outᵀ @ x over all tokens, [out, in]")
    tokens = x.shape[0] * x.shape[1]
    if not torch.allclose(gw, w.grad):
        if torch.allclose(gw * tokens, w.grad):
            raise AssertionError(f"your weight gradient is the mean over the {tokens} tokens: every token adds its "
                                 f"own g xᵀ to the gradient of the weight it shares, so dL/dW is their sum, "
                                 f"grad_outᵀ @ x with no division")
        raise AssertionError("the weight gradient differs from autograd's: dL/dW = grad_outᵀ @ x, summed over "
                             "every token")
    if gb is None:
        raise AssertionError("the bias gradient is NoneType: weight_grad returns it too, (grad_w, grad_b); like "
                             "the weight's, nobody upstream waits for it, so it belongs to W: dL/db = grad_out "
                             "summed over every token")
    if isinstance(gb, torch.Tensor) and gb.dim() > 1 and gb.shape[-1] == b.shape[0]:
        raise AssertionError(f"your bias gradient has shape {tuple(gb.shape)}: the bias is added to every token, "
                             f"so its gradient sums grad_out over batch and sequence: shape {tuple(b.shape)}")
    problem = _describe("the bias gradient", gb, b.grad)
    if problem:
        raise AssertionError(f"{problem}: dL/db = grad_out summed over every token")
    if not torch.allclose(gb, b.grad):
        if torch.allclose(gb * 10, b.grad):
            raise AssertionError("your bias gradient is the mean over the 10 tokens: the bias is added to every "
                                 "token, so its gradient is the sum")
        raise AssertionError("the bias gradient differs from autograd's: dL/db = grad_out summed over every token")

    # Deferred: a two-layer chain whose backward computes only input gradients; the weights' come later.
    pending = []

    class SplitLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, weight, bias):
            ctx.save_for_backward(inp, weight)
            ctx.bias = bias
            return F.linear(inp, weight, bias)

        @staticmethod
        def backward(ctx, g_out):
            inp, weight = ctx.saved_tensors
            pending.append((weight, ctx.bias, inp, g_out))
            return input_grad(g_out, weight), None, None

    w1 = torch.randn(8, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(5, 8, generator=g, dtype=torch.float64)
    loss = (torch.tanh(F.linear(x2, w1, b1)) @ w2.t()).square().sum()
    ref = torch.autograd.grad(loss, [x2, w1, b1])
    out = torch.tanh(SplitLinear.apply(x2, w1, b1)) @ w2.t()
    out.square().sum().backward()
    assert w1.grad is None, "the backward pass must not touch the weights' .grad: W comes later"
    for weight, bias, inp, g_out in pending:  # the W pass, deferred
        weight.grad, bias.grad = weight_grad(inp, g_out)
    for name, got_t, want_t in (("x", x2.grad, ref[0]), ("weight", w1.grad, ref[1]), ("bias", b1.grad, ref[2])):
        assert torch.allclose(got_t, want_t), (f"with W deferred after the whole backward, the gradient of the "
                                               f"{name} differs from autograd's")
    print("input and weight gradients equal autograd's, also with the weight pass deferred after the backward")


def exercise_v(v_placement):
    """v_placement(p) -> [[stage of chunk 0, stage of chunk 1] for each rank]: DualPipeV's V."""
    from ultrascale.parallel.pipeline.partition import virtual_stages
    from ultrascale.series.checks.part11 import engine_calls

    _, called = engine_calls("ultrascale.parallel.pipeline.partition", v_placement, 4)
    if called:
        raise AssertionError(f"v_placement calls the engine's placement ({', '.join(sorted(called))}): the "
                             f"exercise is to write it: chunk 0 of rank r goes down, chunk 1 comes back up")
    for p in (2, 3, 4, 8):
        want = [virtual_stages(r, p, 2, vshape=True) for r in range(p)]
        try:
            placement = v_placement(p)
            require_finite(placement, f"your stages for p = {p}")  # int(nan) would fail with a ValueError
            got = [[int(s) for s in pair] for pair in placement]
        except TypeError:
            raise AssertionError(f"p = {p}: return a list per rank of its two stages") from None
        if len(got) != p or any(len(pair) != 2 for pair in got):
            raise AssertionError(f"p = {p}: want {p} ranks of 2 stages each, got {got}")
        if got == want:
            continue
        if got == [[r, p + r] for r in range(p)]:
            raise AssertionError(f"p = {p}: {got} is interleaving's loop (chunk c is stage c·p + r): stage p "
                                 f"would start again on rank 0, not turn on rank {p - 1}; in a V, rank r's "
                                 f"second stage is 2p - 1 - r, so rank 0 holds {want[0]}")
        if got == [pair[::-1] for pair in want]:
            raise AssertionError(f"p = {p}: {got} has the chunks swapped: chunk 0 carries the micro-batches down "
                                 f"the ranks (stage r on rank r), chunk 1 brings them back up (stage 2p - 1 - r), "
                                 f"so rank 0 holds {want[0]}")
        if got == [[p - 1 - r, p + r] for r in range(p)]:
            raise AssertionError(f"p = {p}: {got} is a V upside down: it starts on rank {p - 1} and turns on rank "
                                 f"0. The micro-batches enter where the embedding is, stage 0 on rank 0, go down to "
                                 f"rank {p - 1}, turn there and come back up: rank 0 holds {want[0]}")
        if sorted(s for pair in got for s in pair) != list(range(2 * p)):
            raise AssertionError(f"p = {p}: the stages {sorted(s for pair in got for s in pair)} are not "
                                 f"0 .. {2 * p - 1}, each once (off by one? rank 0's second stage is {2 * p - 1})")
        where = {s: r for r, pair in enumerate(got) for s in pair}
        for s in range(2 * p - 1):
            if abs(where[s] - where[s + 1]) > 1:
                raise AssertionError(f"p = {p}: stage {s} on rank {where[s]} sends to stage {s + 1} on rank "
                                     f"{where[s + 1]}: not a neighbour; the V goes down then back up")
        raise AssertionError(f"p = {p}: got {got}, the engine places {want}: chunk 0 goes down (stage r), "
                             f"chunk 1 comes back up (stage 2p - 1 - r)")
    print("the V matches the engine's DualPipeV placement for p = 2, 3, 4, 8")
