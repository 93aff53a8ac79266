"""What each rank called: the collectives a learner's code runs, watched while it runs.

A check that compares only the values a rank returns cannot tell a distributed algorithm
from a local one: every rank running every expert, or all-gathering K and V and masking,
gives the right numbers without the communication the exercise teaches. So while a
learner's function runs on a rank (`ranks.on_ranks`), the functions of
`torch.distributed` are wrapped: each call is recorded as a `Call` (its kind, the
global ranks of its group, the bytes this rank put in, the reduction, the peer), and
a check reads them back to name what was called, what was not, and what was forbidden.

The functional collectives (torch.distributed._functional_collectives, the API that
torch.distributed.nn.functional's warning points to) are recorded as the same kinds:
funcol.all_reduce is an all_reduce. They return at once (the wait is in the first use of
the tensor), so they announce nothing.

The same wrapping says where a rank is stuck. On entering a call that can block (a
collective, a recv, the wait of an isend/irecv) a rank writes one line to a file of its
own ("<time> <key> all_reduce SUM over ranks [0, 1], 64 B"), and clears it on leaving.
The process that runs the check reads those files: when every rank that has not
returned has been blocked for `STALL` seconds and no two of them wait in calls that
answer each other, nothing can move any more, and it says which rank waits in which
call, instead of waiting for a timeout. Ranks that all wait in the same collective (the
n-th on their group, of the same size), or a send and the recv that takes it, are only
slow (a big tensor, a loaded machine): the key on each line says which call it is.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from dataclasses import dataclass

STALL = 6.0  # seconds every unfinished rank has been blocked before it is called a deadlock

# The functions of torch.distributed that move data, and which argument holds this rank's data.
_DATA_ARG = {
    "all_reduce": "tensor", "reduce": "tensor", "broadcast": "tensor",
    "all_gather": "tensor", "all_gather_into_tensor": "input_tensor", "all_gather_single": "input_tensor",
    "reduce_scatter": "input_list", "reduce_scatter_tensor": "input", "reduce_scatter_single": "input",
    "all_to_all": "input_tensor_list", "all_to_all_single": "input",
    "gather": "tensor", "scatter": "scatter_list",
    "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
    "barrier": None,
    "all_gather_object": None, "broadcast_object_list": None, "gather_object": None,
    "scatter_object_list": None, "send_object_list": None, "recv_object_list": None,
}
_SAME = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_ASYNC = ("isend", "irecv")  # return a Work whose wait() is where they block
# Collectives whose data is the same size on every rank of the group: a size that differs is no match.
_SAME_SIZE = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "barrier")
# torch.distributed._functional_collectives: name -> (the kind recorded, its reduction argument or None).
_FUNCOL = {
    "all_reduce": ("all_reduce", "reduceOp"), "broadcast": ("broadcast", None),
    "all_gather_single": ("all_gather_into_tensor", None), "all_gather_tensor": ("all_gather_into_tensor", None),
    "all_gather_single_autograd": ("all_gather_into_tensor", None),
    "all_gather_tensor_autograd": ("all_gather_into_tensor", None),
    "reduce_scatter_single": ("reduce_scatter_tensor", "reduceOp"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", "reduceOp"),
    "reduce_scatter_single_autograd": ("reduce_scatter_tensor", "reduceOp"),
    "reduce_scatter_tensor_autograd": ("reduce_scatter_tensor", "reduceOp"),
    "all_to_all_single": ("all_to_all_single", None), "all_to_all_single_autograd": ("all_to_all_single", None),
}


@dataclass(frozen=True)
class Call:
    """One call of a torch.distributed function on one rank."""

    kind: str  # the function's name: "all_reduce", "isend", ...
    group: tuple  # the global ranks of the group it ran over
    bytes: int  # the bytes of this rank's data: the tensor sent, reduced or gathered from
    op: str | None = None  # the reduction, for all_reduce, reduce and reduce_scatter: "SUM", "AVG", ...
    peer: int | None = None  # the other rank (global), for send and recv

    def __str__(self) -> str:
        op = f" {self.op}" if self.op else ""
        if self.peer is not None:
            where = f" {'to' if self.kind in ('send', 'isend') else 'from'} rank {self.peer}"
        else:
            where = f" over ranks {list(self.group)}"
        return f"{self.kind}{op}{where}, {self.bytes} B"


def kinds(calls) -> list[str]:
    """The kinds of `calls`, in order: ["all_reduce", "all_reduce"]; the deprecated names are said as
    their successors (all_gather_into_tensor is all_gather_single)."""
    return [_SAME.get(c.kind, c.kind) for c in calls]


def sent(calls) -> int:
    """Bytes this rank sent point to point (send and isend)."""
    return sum(c.bytes for c in calls if c.kind in ("send", "isend"))


# ---- on a rank ------------------------------------------------------------------------------------

_RECORD: list[Call] | None = None
_STATUS: str | None = None  # this rank's file, where a blocking call is announced
_DEPTH = [0]  # inside a wrapped call: the calls it makes itself are its own business
_SEQ: dict = {}  # group -> collectives called on it so far: the n-th on a group is the same call on each rank;
#                 "send>P" / "recv<P" -> sends to / receives from rank P entered so far
_PENDING: list = []  # every request handed to the learner (_WatchedWork), waited for or not


def calls() -> list[Call]:
    """The calls recorded so far on this rank (a check's own rank-side code may read them)."""
    return list(_RECORD or [])


@contextlib.contextmanager
def unwatched():
    """A check's own communication (gathering results to compare): not the learner's, not recorded."""
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1


def _bytes(value) -> int:
    import torch

    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _announce(line: str | None, key: str = "-") -> None:
    """`line` (None: not blocked) in this rank's status file, with the time and the call's key. Written
    whole and then renamed, so that the reader never sees half a line."""
    if _STATUS is None:
        return
    part = f"{_STATUS}.part"
    # With the key, how many collectives this rank has entered on each group: a rank still inside the n-th
    # collective of a group that every other member has entered (one may have left it already, its part
    # done, and be blocked further on) is finishing, not deadlocked.
    entered = "/".join(f"{group if isinstance(group, str) else ','.join(map(str, group))}#{n}"
                       for group, n in _SEQ.items())
    with open(part, "w") as f:
        f.write("" if line is None else f"{time.time()} {key}|{entered} {line}")
    os.replace(part, _STATUS)


def _key(call: Call) -> str:
    """Which call this is, in words the other ranks' keys can be matched against: "send>1:64" and
    "recv<0:64" take each other's message; "all_reduce@0,1#3:64" is the same collective on ranks 0 and 1."""
    if call.kind in ("send", "isend"):
        _SEQ[f"send>{call.peer}"] = _SEQ.get(f"send>{call.peer}", 0) + 1
        return f"send>{call.peer}:{call.bytes}"
    if call.kind in ("recv", "irecv"):
        if call.peer is not None:
            _SEQ[f"recv<{call.peer}"] = _SEQ.get(f"recv<{call.peer}", 0) + 1
        return f"recv<{'*' if call.peer is None else call.peer}:{call.bytes}"
    kind = _SAME.get(call.kind, call.kind)
    _SEQ[call.group] = n = _SEQ.get(call.group, 0) + 1
    size = f":{call.bytes}" if call.kind in _SAME_SIZE else ""
    return f"{kind}@{','.join(map(str, call.group))}#{n}{size}"


class _WatchedWork:
    """An isend/irecv's Work (or an async collective's): its wait() is where the rank blocks, so that is
    what is announced. Whether it was waited for is kept (`unwaited`): a request left unwaited is a race
    that passes or fails by luck, so it is named every time, whatever the timing."""

    def __init__(self, work, call: Call, key: str | None):
        self._work, self._call, self._key = work, call, key
        self.waited = False
        _PENDING.append(self)

    def wait(self, *args, **kwargs):
        self.waited = True
        if self._key is None:  # a batch's request: its sends and receives were announced one by one
            return self._work.wait(*args, **kwargs)
        _announce(f"the wait of {self._call}", self._key)
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            _announce(None)

    def get_future(self):
        self.waited = True  # waited for through the future (torch.futures.wait_all, fut.wait())
        return self._work.get_future()

    def is_completed(self):
        done = self._work.is_completed()
        self.waited = self.waited or bool(done)  # polled until complete: as good as a wait
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def unwaited() -> list[Call]:
    """The calls of this rank whose request (the Work an isend, irecv or async_op=True returned) was never
    waited for, in the order they were made."""
    return [w._call for w in _PENDING if not w.waited]


def _describe(name: str, signature, args, kwargs) -> Call:
    import torch.distributed as dist

    bound = signature.bind_partial(*args, **kwargs).arguments
    group = bound.get("group")
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    data = _DATA_ARG.get(name)
    op = bound.get("op")
    if name in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"):
        op = getattr(op, "name", None) or str(op).split(".")[-1] if op is not None else "SUM"
    else:
        op = None
    peer = None
    if name in POINT_TO_POINT:
        peer = bound.get("dst", bound.get("src"))
        local = bound.get("group_dst", bound.get("group_src"))
        if peer is None and local is not None:
            peer = ranks[local]
    return Call(name, ranks, _bytes(bound.get(data)) if data else 0, op, peer)


def _wrap(name: str, original):
    signature = inspect.signature(original)

    def watched(*args, **kwargs):
        if _DEPTH[0] or _RECORD is None:
            return original(*args, **kwargs)
        try:
            call = _describe(name, signature, args, kwargs)
        except Exception:  # noqa: BLE001 - arguments torch will refuse itself, in its own words
            return original(*args, **kwargs)
        _RECORD.append(call)
        key = _key(call)
        blocks = name not in _ASYNC and not kwargs.get("async_op", False)
        if blocks:
            _announce(str(call), key)
        _DEPTH[0] += 1
        try:
            result = original(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
            if blocks:
                _announce(None)
        if result is not None and not isinstance(result, int) and hasattr(result, "wait"):
            return _WatchedWork(result, call, key)
        return result

    watched.__watched__ = original
    watched.__name__ = name
    watched.__doc__ = original.__doc__
    return watched


def _wrap_batch(original):
    """batch_isend_irecv: its sends and receives are recorded and announced one by one (the wrapped isend
    and irecv it calls, whose requests gloo returns as the batch's); the requests it returns are the ones
    to wait for, and the only ones kept as pending."""

    def watched(p2p_op_list, *args, **kwargs):
        if _DEPTH[0] or _RECORD is None:
            return original(p2p_op_list, *args, **kwargs)
        before = len(_PENDING)
        works = original(p2p_op_list, *args, **kwargs)
        if not isinstance(works, list):
            return works
        inner = _PENDING[before:]
        del _PENDING[before:]
        out = []
        for w in works:
            if any(w is i for i in inner):
                _PENDING.append(w)
                out.append(w)
            else:  # a backend that coalesces: one request of its own for the batch
                out.append(_WatchedWork(w, Call("batch_isend_irecv", (), sum(_bytes(getattr(op, "tensor", None))
                                                                            for op in p2p_op_list)), None))
        return out

    watched.__watched__ = original
    watched.__name__ = "batch_isend_irecv"
    watched.__doc__ = original.__doc__
    return watched


def _funcol_ranks(group) -> tuple:
    """The global ranks of a functional collective's group: a ProcessGroup, a list of ranks, a group's
    name, a 1-D DeviceMesh or (mesh, dim)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if isinstance(group, (list, tuple)) and group and all(isinstance(r, int) for r in group):
        return tuple(group)
    if isinstance(group, tuple) and len(group) == 2:
        group = group[0].get_group(group[1])
    elif hasattr(group, "get_group"):
        group = group.get_group()
    if isinstance(group, str):
        group = c10d._resolve_process_group(group)
    return tuple(dist.get_process_group_ranks(group))


def _wrap_funcol(name: str, original):
    """A functional collective, recorded as the kind of torch.distributed's that does the same. It returns
    at once (an AsyncCollectiveTensor): nothing blocks here, nothing is announced."""
    kind, op_arg = _FUNCOL[name]
    signature = inspect.signature(original)

    def watched(*args, **kwargs):
        if _DEPTH[0] or _RECORD is None:
            return original(*args, **kwargs)
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
            op = str(bound[op_arg]).upper() if op_arg else None
            call = Call(kind, _funcol_ranks(bound.get("group")), _bytes(bound.get("self")), op)
        except Exception:  # noqa: BLE001 - arguments torch will refuse itself, in its own words
            return original(*args, **kwargs)
        _RECORD.append(call)
        _key(call)  # counted on its group, as the other ranks count it
        _DEPTH[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1

    watched.__watched__ = original
    watched.__name__ = name
    watched.__doc__ = original.__doc__
    return watched


@contextlib.contextmanager
def watching(status_file: str | None = None):
    """Record every torch.distributed call made inside, and announce blocking ones in `status_file`.

    Both `torch.distributed.X` and `distributed_c10d.X` are replaced (batch_isend_irecv checks its
    ops against the latter's isend/irecv), and put back on leaving."""
    global _RECORD, _STATUS
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved = []
    for name in _DATA_ARG:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapper = _wrap(name, original)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                saved.append((module, name, original))
                setattr(module, name, wrapper)
    original = getattr(c10d, "batch_isend_irecv", None)
    if original is not None:
        wrapper = _wrap_batch(original)
        for module in (dist, c10d):
            if getattr(module, "batch_isend_irecv", None) is original:
                saved.append((module, "batch_isend_irecv", original))
                setattr(module, "batch_isend_irecv", wrapper)
    try:
        import torch.distributed._functional_collectives as funcol
    except ImportError:
        funcol = None
    for name in _FUNCOL if funcol is not None else ():
        original = getattr(funcol, name, None)
        if callable(original):
            saved.append((funcol, name, original))
            setattr(funcol, name, _wrap_funcol(name, original))
    _RECORD, _STATUS = [], status_file
    _SEQ.clear()
    _PENDING.clear()
    _announce(None)
    try:
        yield _RECORD
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
        _RECORD, _STATUS = None, None


# ---- in the process that runs the check -----------------------------------------------------------

def _answered(blocked: dict, entered: dict | None = None) -> bool:
    """Whether some of the blocked ranks wait in calls that complete each other: all the ranks of a group
    in the same collective (or past it: `entered`, rank -> group -> collectives entered on it), or a send
    and the recv of its message. They move, however slowly."""
    entered = entered or {}
    for rank, key in blocked.items():
        if key.startswith("send>"):
            peer, size = key[len("send>"):].split(":", 1)
            if peer.isdigit() and blocked.get(int(peer)) in (f"recv<{rank}:{size}", f"recv<*:{size}"):
                return True
        elif key.startswith("recv<"):
            # The sender may have left its send already (its part done: the message is on its way) and be
            # blocked further on: the j-th receive from P is answered once P has entered its j-th send here.
            peer = key[len("recv<"):].split(":", 1)[0]
            j = entered.get(rank, {}).get(f"recv<{peer}", 0)
            if peer.isdigit() and j and entered.get(int(peer), {}).get(f"send>{rank}", 0) >= j:
                return True
        elif "@" in key and "#" in key:
            members, n = key.split("@", 1)[1].split(":", 1)[0].split("#", 1)
            group = members.split(",")
            if all(r.isdigit() and (blocked.get(int(r)) == key or entered.get(int(r), {}).get(members, 0) >= int(n))
                   for r in group):
                return True
    return False


def _entered(text: str) -> dict:
    """A status line's "0,1#3/0#1": group -> collectives entered on it."""
    out = {}
    for part in filter(None, text.split("/")):
        group, _, n = part.rpartition("#")
        if n.isdigit():
            out[group] = int(n)
    return out


def stalled(status_dir: str, pending: list[int], world: int, stall: float | None = None) -> str | None:
    """A sentence naming where each unfinished rank waits, when all of them have been blocked in a call
    for `stall` seconds (STALL if None) and none of those calls can complete another's (a deadlock:
    none of them can move another); None while any may still move."""
    stall = STALL if stall is None else stall
    now, waiting, blocked, entered = time.time(), [], {}, {}
    for rank in pending:
        try:
            with open(os.path.join(status_dir, f"rank{rank}")) as f:
                line = f.read()
        except OSError:
            return None
        parts = line.split(" ", 2)
        if len(parts) < 3:
            return None  # computing: it may yet reach the call the others wait in
        since, key, what = parts
        key, _, counts = key.partition("|")
        try:
            if now - float(since) < stall:
                return None
        except ValueError:
            return None
        blocked[rank] = key
        entered[rank] = _entered(counts)
        waiting.append(f"rank {rank} waits in {what}")
    if not waiting or _answered(blocked, entered):
        return None
    done = [r for r in range(world) if r not in pending]
    if done:
        waiting.append(f"rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} had returned")
    return "; ".join(waiting)
