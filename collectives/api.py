"""The public API: argument checks and buffer wrapping, then ``collectives.dispatch``.

Each collective checks its arguments with the facts every rank has, so a bad call raises the
same ``ValueError``/``TypeError`` on every rank before a byte moves, wraps ``x`` and ``out`` into
flat zero-copy views (``collectives.buffers``) and hands the resulting ``Call`` to
``dispatch.start``, which validates across ranks where asked, chooses the algorithm and runs it.
Every call takes this one way: nothing of a caller's arrays is remembered between calls, so an
array passed to a collective and then dropped is freed at once. The repeated case is explicit:
``allreduce_init`` and its siblings (MPI-4's persistent collectives) check, wrap and choose
once, and ``start()``/``wait()`` run the call as often as wanted.

Without ``out`` the input is never modified and a new array of x's kind is returned; ``out=x``
is in place, and an allreduce is in place on every rank or on none (as ``MPI_IN_PLACE``). On
error the input is untouched; ``out`` may be partly written if the error came from the network
after the collective started (checks happen before).
"""
from __future__ import annotations

import math

import numpy as np

from . import check as _check
from . import select, shapes
from .buffers import Buffer, numpy_buffer, wrap
from .call import Call, make_call
from .dispatch import auto_pick, comm_context, start
from .ops import resolve
from .persistent import Persistent
from .progress import Request
from .select import NATIVE, REGISTRY
from .signature import (APART, NONE, SAME, Changed, Plan, bound, counts_key, planned,
                        result_of, where)

__all__ = ["allreduce", "reduce", "broadcast", "reduce_scatter", "allgather", "alltoall",
           "gather", "scatter", "barrier", "iallreduce", "ireduce", "ibroadcast",
           "ireduce_scatter", "iallgather", "ialltoall", "igather", "iscatter", "ibarrier",
           "allreduce_init", "reduce_init", "broadcast_init", "reduce_scatter_init",
           "allgather_init", "alltoall_init", "gather_init", "scatter_init", "barrier_init",
           "algorithms", "auto_pick", "Call", "Persistent"]

# How a prepared call runs: now, blocking; started, as a Request; or kept as a persistent request.
BLOCKING, NONBLOCKING, PERSISTENT = "blocking", "nonblocking", "persistent"


def algorithms(collective: str) -> tuple[str, ...]:
    """Names that ``algorithm=`` accepts for ``collective`` (besides ``"auto"``)."""
    return select.algorithms(collective)


# -- checks and buffers ------------------------------------------------------------------------
def _address(buf: Buffer) -> tuple[int, int]:
    iface = getattr(buf.flat, "__cuda_array_interface__", None) or \
        buf.flat.__array_interface__
    first = iface["data"][0]
    return first, first + buf.flat.nbytes


def _output(x: Buffer, out, shape, what="out") -> tuple[Buffer, bool]:
    """Wrap ``out`` (or make one of ``shape``); returns ``(buffer, in_place)``."""
    if out is None:
        return x.new(shape), False
    if out is x.obj and shape is x.shape:  # in place, as allreduce/reduce call it: x is out
        if x.readonly:
            raise ValueError(f"{what} is read-only")
        return x, x.count > 0
    if type(out) is np.ndarray and x.kind == "numpy" and out.dtype == x.dtype and \
            out.shape == shape and (flags := out.flags).c_contiguous and flags.writeable and \
            ((out.base is None and x.obj.base is None and out is not x.obj) or  # two arrays
             not np.may_share_memory(x.flat, out)):  # owning their memory are apart
        return numpy_buffer(out), False  # the common case, checked at once
    o = wrap(out, what)
    if o.kind != x.kind or o.dtype != x.dtype or o.device != x.device:
        raise TypeError(f"{what} is {o.describe()}, expected a {x.kind} {x.dtype.name} buffer "
                        f"on {x.device}")
    if o.shape != shape and o.shape != tuple(shape):
        raise ValueError(f"{what} has shape {list(o.shape)}, expected {list(shape)}")
    if o.readonly:
        raise ValueError(f"{what} is read-only")
    if x.kind == "numpy" and not np.may_share_memory(x.flat, o.flat):
        return o, False  # the common case, without address arithmetic
    xa, oa = _address(x), _address(o)
    same = xa == oa and x.count > 0
    if not same and x.count and o.count and xa[0] < oa[1] and oa[0] < xa[1]:
        raise ValueError(f"{what} partly overlaps x; pass out=x for in place or a separate "
                         f"buffer")
    return o, same


def _root(root, size) -> int:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or \
            not 0 <= root < size:
        raise ValueError(f"root {root!r} out of range for a communicator of {size} ranks")
    return int(root)


# -- reductions ---------------------------------------------------------------------------------
def _allreduce(x, op, out, comm, algorithm, check, mode):
    ctx = comm_context(comm, "allreduce")
    key = None
    if mode is BLOCKING and type(x) is np.ndarray:
        key = ("allreduce", algorithm, op, x.dtype, x.shape, out is None, out is x)
        if (call := bound(ctx, key, x, out)) is not None:
            return start(call, algorithm, check, call.out.obj)
    try:
        xb = wrap(x, "x")
        opr = resolve(op, xb.dtype)
        outb, inplace = _output(xb, out, xb.shape)
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "allreduce", check, exc)
    call = make_call("allreduce", ctx, xb, outb, opr, 0, None, inplace, mode is BLOCKING)
    if mode is PERSISTENT:
        return Persistent(call, algorithm, check, outb.obj)
    plan, placed = None, where(x, out)
    if key is not None and not (inplace and placed is APART):  # same memory: full path
        plan = Plan(key, ("allreduce", opr, 0, None, xb.shape, inplace, placed, True, None))
    call.plan = plan
    return start(call, algorithm, check, outb.obj)


def allreduce(x, op="sum", *, out=None, comm=None, algorithm="auto", check=None):
    """Reduce ``x`` over all ranks of ``comm``; every rank gets the result (like x)."""
    return _allreduce(x, op, out, comm, algorithm, check, BLOCKING)


def iallreduce(x, op="sum", *, out=None, comm=None, algorithm="auto", check=None) -> Request:
    """Non-blocking ``allreduce``: ``Request.wait()`` returns the result."""
    return _allreduce(x, op, out, comm, algorithm, check, NONBLOCKING)


def allreduce_init(x, op="sum", *, out=None, comm=None, algorithm="auto",
                   check=None) -> Persistent:
    """Persistent ``allreduce`` (``MPI_Allreduce_init``): checked and chosen once, then run by
    ``start()``/``wait()`` as often as wanted on the same buffers. Collective."""
    return _allreduce(x, op, out, comm, algorithm, check, PERSISTENT)


def _reduce(x, op, root, out, comm, algorithm, check, mode):
    ctx = comm_context(comm, "reduce")
    key = None
    if mode is BLOCKING and type(x) is np.ndarray and type(root) is int:
        key = ("reduce", algorithm, op, root, x.dtype, x.shape, out is None, out is x)
        if (call := bound(ctx, key, x, out)) is not None:
            return start(call, algorithm, check, result_of(call))
    inplace = False
    try:
        root = _root(root, ctx.size)
        xb = wrap(x, "x")
        opr = resolve(op, xb.dtype)
        if ctx.rank == root or out is not None:  # a given out is checked everywhere
            outb, inplace = _output(xb, out, xb.shape)
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "reduce", check, exc)
    plan, placed = None, where(x, out)
    if key is not None and not (inplace and placed is APART):  # same memory: full path
        receives = ctx.rank == root
        plan = Plan(key, ("reduce", opr, root, None, xb.shape, inplace and receives,
                          placed if receives or out is not None else NONE, receives, None))
    if ctx.rank == root:
        result = outb.obj
    else:  # out is ignored (never written) off the root
        outb, inplace, result = None, False, None
    call = make_call("reduce", ctx, xb, outb, opr, root, None, inplace, mode is BLOCKING)
    if mode is PERSISTENT:
        return Persistent(call, algorithm, check, result)
    call.plan = plan
    return start(call, algorithm, check, result)


def reduce(x, op="sum", root=0, *, out=None, comm=None, algorithm="auto", check=None):
    """Reduce ``x`` over all ranks onto ``root``: the result there, None elsewhere."""
    return _reduce(x, op, root, out, comm, algorithm, check, BLOCKING)


def ireduce(x, op="sum", root=0, *, out=None, comm=None, algorithm="auto",
            check=None) -> Request:
    """Non-blocking ``reduce``."""
    return _reduce(x, op, root, out, comm, algorithm, check, NONBLOCKING)


def reduce_init(x, op="sum", root=0, *, out=None, comm=None, algorithm="auto",
                check=None) -> Persistent:
    """Persistent ``reduce`` (``MPI_Reduce_init``). Collective."""
    return _reduce(x, op, root, out, comm, algorithm, check, PERSISTENT)


def _reduce_scatter(x, op, counts, out, comm, algorithm, check, mode):
    ctx = comm_context(comm, "reduce_scatter")
    key = None
    if mode is BLOCKING and type(x) is np.ndarray and (given := counts_key(counts)) is not False:
        key = ("reduce_scatter", algorithm, op, x.dtype, x.shape, given, out is None, out is x)
        if (call := bound(ctx, key, x, out)) is not None:
            return start(call, algorithm, check, call.out.obj)
    try:
        xb = wrap(x, "x")
        opr = resolve(op, xb.dtype)
        if counts is None:
            counts = shapes.balanced(xb.count, ctx.size)
        else:
            counts = shapes.counts_of(counts, ctx.size)
            if sum(counts) != xb.count:
                raise ValueError(f"counts add up to {sum(counts)}, but x has {xb.count} "
                                 f"elements")
        outb, inplace = _output(xb, out, (counts[ctx.rank],))
        if inplace:
            raise ValueError("reduce_scatter cannot run in place: out must not be x")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "reduce_scatter", check, exc)
    call = make_call("reduce_scatter", ctx, xb, outb, opr, 0, counts, False, mode is BLOCKING)
    if mode is PERSISTENT:
        return Persistent(call, algorithm, check, outb.obj)
    plan = None if key is None else Plan(key, ("reduce_scatter", opr, 0, counts, outb.shape,
                                               False, where(x, out), True, None))
    call.plan = plan
    return start(call, algorithm, check, outb.obj)


def reduce_scatter(x, op="sum", *, counts=None, out=None, comm=None, algorithm="auto",
                   check=None):
    """Reduce flat ``x`` over all ranks; rank r gets block r (``counts[r]`` elements, 1-D)."""
    return _reduce_scatter(x, op, counts, out, comm, algorithm, check, BLOCKING)


def ireduce_scatter(x, op="sum", *, counts=None, out=None, comm=None, algorithm="auto",
                    check=None) -> Request:
    """Non-blocking ``reduce_scatter``."""
    return _reduce_scatter(x, op, counts, out, comm, algorithm, check, NONBLOCKING)


def reduce_scatter_init(x, op="sum", *, counts=None, out=None, comm=None, algorithm="auto",
                        check=None) -> Persistent:
    """Persistent ``reduce_scatter`` (``MPI_Reduce_scatter_init``). Collective."""
    return _reduce_scatter(x, op, counts, out, comm, algorithm, check, PERSISTENT)


# -- data movement ------------------------------------------------------------------------------
def _broadcast(x, root, comm, algorithm, check, mode):
    ctx = comm_context(comm, "broadcast")
    key = None
    if mode is BLOCKING and type(x) is np.ndarray and type(root) is int:
        key = ("broadcast", algorithm, root, x.dtype, x.shape)
        if (call := bound(ctx, key, x, x)) is not None:
            return start(call, algorithm, check, x)
    try:
        root = _root(root, ctx.size)
        xb = wrap(x, "x")
        if xb.readonly:  # refused on the root too, so that every rank gives the same verdict
            raise ValueError("x is read-only: broadcast fills it in place on every rank but "
                             "the root; pass a writable array on every rank")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "broadcast", check, exc)
    call = make_call("broadcast", ctx, xb, xb, None, root, None, True, mode is BLOCKING)
    if mode is PERSISTENT:
        return Persistent(call, algorithm, check, xb.obj)
    plan = None if key is None else Plan(key, ("broadcast", None, root, None, xb.shape, True,
                                               SAME, True, None))
    call.plan = plan
    return start(call, algorithm, check, xb.obj)


def broadcast(x, root=0, *, comm=None, algorithm="auto", check=None):
    """Fill ``x`` on every rank with root's ``x``, in place; returns x."""
    return _broadcast(x, root, comm, algorithm, check, BLOCKING)


def ibroadcast(x, root=0, *, comm=None, algorithm="auto", check=None) -> Request:
    """Non-blocking ``broadcast``."""
    return _broadcast(x, root, comm, algorithm, check, NONBLOCKING)


def broadcast_init(x, root=0, *, comm=None, algorithm="auto", check=None) -> Persistent:
    """Persistent ``broadcast`` (``MPI_Bcast_init``). Collective."""
    return _broadcast(x, root, comm, algorithm, check, PERSISTENT)


def _allgather(x, out, comm, algorithm, check, mode, rows=None):
    ctx = comm_context(comm, "allgather")
    key = given = table = learned = None
    if mode is BLOCKING and type(x) is np.ndarray and (given := counts_key(rows)) is not False:
        key = ("allgather", algorithm, x.dtype, x.shape, given, out is None, out is x)
        if given is not None:  # every rank's rows given: the signature is known before
            if (call := bound(ctx, key, x, out)) is not None:
                return start(call, algorithm, check, call.out.obj)
        elif (call := bound(ctx, key, x, out)) is not None:  # the plan's exchange, first
            try:
                return start(call, algorithm, check, call.out.obj)
            except Changed as changed:  # a rank's counts differ: the full path, with them
                table, learned = changed.table, call.plan.learned
    if rows is not None:
        xb, counts, rows = shapes.given(ctx, x, rows, check, "allgather")
    else:  # learned: with one exchange, or with the plan's (``table``: every rank's counts)
        xb, counts, rows, learned = shapes.learn(ctx, x, "allgather", table, learned)
    shape = (rows,) + tuple(xb.shape[1:]) if xb.shape else (rows,)
    try:
        outb, inplace = _output(xb, out, shape)
        if inplace:
            raise ValueError("allgather cannot run in place: out must not be x")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "allgather", check, exc)
    call = make_call("allgather", ctx, xb, outb, None, 0, counts, False, mode is BLOCKING)
    if mode is PERSISTENT:
        return Persistent(call, algorithm, check, outb.obj)
    plan = None if key is None else Plan(key, ("allgather", None, 0, counts, shape, False,
                                               where(x, out), True, None), learned)
    call.plan = plan
    return start(call, algorithm, check, outb.obj)


def allgather(x, *, counts=None, out=None, comm=None, algorithm="auto", check=None):
    """Concatenate every rank's ``x`` along axis 0 (ranks may differ in that axis' length).
    ``counts``: every rank's rows, given alike on every rank or on none; without it they are
    learned with one small exchange."""
    return _allgather(x, out, comm, algorithm, check, BLOCKING, counts)


def iallgather(x, *, counts=None, out=None, comm=None, algorithm="auto",
               check=None) -> Request:
    """Non-blocking ``allgather``."""
    return _allgather(x, out, comm, algorithm, check, NONBLOCKING, counts)


def allgather_init(x, *, counts=None, out=None, comm=None, algorithm="auto",
                   check=None) -> Persistent:
    """Persistent ``allgather`` (``MPI_Allgather_init``). Collective."""
    return _allgather(x, out, comm, algorithm, check, PERSISTENT, counts)


def _alltoall(x, counts, recv_counts, out, comm, algorithm, check, mode):
    ctx = comm_context(comm, "alltoall")
    size = ctx.size
    key = table = learned = None
    if mode is BLOCKING and type(x) is np.ndarray and (given := counts_key(counts)) is not False \
            and (expected := counts_key(recv_counts)) is not False:
        key = ("alltoall", algorithm, x.dtype, x.shape, given, expected, out is None, out is x)
        if given is None or expected is not None:  # nothing to learn
            if (call := bound(ctx, key, x, out)) is not None:
                return start(call, algorithm, check, call.out.obj)
        elif (call := bound(ctx, key, x, out)) is not None:  # ragged: the plan's exchange
            try:
                return start(call, algorithm, check, call.out.obj)
            except Changed as changed:  # a rank's counts differ: the full path, with them
                table, learned = changed.table, call.plan.learned
    recv = matrix = error = xb = send = None
    try:
        xb = wrap(x, "x")
        if not xb.shape:
            raise ValueError("alltoall: x must have an axis 0 (its rows go to the ranks)")
        send = shapes.row_counts("alltoall", xb.shape[0], counts, size)
        if recv_counts is not None:
            recv = shapes.counts_of(recv_counts, size)
        record = REGISTRY["alltoall"].get(algorithm) if type(algorithm) is str else None
        takes = None if record is None else record.counts  # an unknown name: told later
        if takes is select.EQUAL and (counts is not None or recv_counts is not None):
            raise ValueError(f"alltoall: algorithm {algorithm!r} needs equal blocks (counts=None)")
        if takes is select.MATRIX and recv_counts is not None:
            raise ValueError(f"alltoall: algorithm {algorithm!r} needs every rank's counts; "
                             f"leave recv_counts out")
    except (TypeError, ValueError) as exc:
        error = exc
    if counts is not None and recv_counts is None:  # ragged: learn what comes from whom
        if table is None:  # (else exchanged with the plan's)
            table = shapes.alltoall_counts(ctx, xb, send if error is None else None)
        recv, matrix = shapes.alltoall_learned(ctx, table, error)
        learned = shapes.kept(ctx, shapes.MatrixBuffers, learned)  # what a plan keeps of it
    elif error is not None:
        raise _check.failed(ctx, "alltoall", check, error)
    elif recv is None:  # equal blocks: the same from everyone (as MPI_Alltoall)
        recv, matrix = send, (send,) * size
    row = shapes.rows_of(xb)[1]
    shape = (sum(recv),) + tuple(xb.shape[1:])
    try:
        outb, inplace = _output(xb, out, shape)
        if inplace:
            raise ValueError("alltoall cannot run in place: out must not be x")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "alltoall", check, exc)
    send_e = shapes.elements(send, row)
    counts_e = (send_e, shapes.elements(recv, row),
                None if matrix is None else (send_e,) * size if recv is send else
                tuple(shapes.elements(r, row) for r in matrix))
    call = make_call("alltoall", ctx, xb, outb, None, 0, counts_e, False, mode is BLOCKING)
    # Without the matrix, auto cannot size the call alike on every rank: MPI's own then.
    algo = REGISTRY["alltoall"][NATIVE] if matrix is None and algorithm == "auto" else None
    if mode is PERSISTENT:
        return Persistent(call, algorithm, check, outb.obj, algo)
    plan = None if key is None else Plan(key, ("alltoall", None, 0, counts_e, shape, False,
                                               where(x, out), True, None), learned)
    call.plan = plan
    return start(call, algorithm, check, outb.obj, algo)


def alltoall(x, counts=None, *, recv_counts=None, out=None, comm=None, algorithm="auto",
             check=None):
    """Split ``x``'s axis 0 into blocks for the ranks (equal, or ``counts[j]`` rows for rank
    j); returns the rows received from every rank, concatenated in rank order."""
    return _alltoall(x, counts, recv_counts, out, comm, algorithm, check, BLOCKING)


def ialltoall(x, counts=None, *, recv_counts=None, out=None, comm=None, algorithm="auto",
              check=None) -> Request:
    """Non-blocking ``alltoall`` (ragged counts without ``recv_counts`` are exchanged first,
    blocking)."""
    return _alltoall(x, counts, recv_counts, out, comm, algorithm, check, NONBLOCKING)


def alltoall_init(x, counts=None, *, recv_counts=None, out=None, comm=None, algorithm="auto",
                  check=None) -> Persistent:
    """Persistent ``alltoall`` (``MPI_Alltoall_init``; ragged counts are learned once, here).
    Collective."""
    return _alltoall(x, counts, recv_counts, out, comm, algorithm, check, PERSISTENT)


def _gather(x, root, out, comm, algorithm, check, mode, rows=None):
    ctx = comm_context(comm, "gather")
    key = given = table = learned = None
    numpy = mode is BLOCKING and type(x) is np.ndarray and type(root) is int
    if numpy and (given := counts_key(rows)) is not False:
        key = ("gather", algorithm, root, x.dtype, x.shape, given, out is None, out is x)
        if given is not None:  # every rank's rows given: the signature is known before
            if (call := bound(ctx, key, x, out)) is not None:
                return start(call, algorithm, check, result_of(call))
        elif (call := bound(ctx, key, x, out)) is not None:  # the plan's exchange, first
            try:
                return start(call, algorithm, check, result_of(call))
            except Changed as changed:  # a rank's counts differ: the full path, with them
                table, learned = changed.table, call.plan.learned
    try:
        root = _root(root, ctx.size)
    except ValueError as exc:
        raise _check.failed(ctx, "gather", check, exc)
    if rows is not None:
        xb, counts, rows = shapes.given(ctx, x, rows, check, "gather")
    else:  # learned: with one exchange, or with the plan's (``table``: every rank's counts)
        xb, counts, rows, learned = shapes.learn(ctx, x, "gather", table, learned)
    outb, result = None, None
    shape = (rows,) + tuple(xb.shape[1:]) if xb.shape else (rows,)
    if ctx.rank == root:
        try:
            outb, inplace = _output(xb, out, shape)
            if inplace:
                raise ValueError("gather cannot run in place: out must not be x")
        except (TypeError, ValueError) as exc:
            raise _check.failed(ctx, "gather", check, exc)
        result = outb.obj
    call = make_call("gather", ctx, xb, outb, None, root, counts, False, mode is BLOCKING)
    if mode is PERSISTENT:
        return Persistent(call, algorithm, check, result)
    plan = None
    if key is not None:
        receives = ctx.rank == root
        plan = Plan(key, ("gather", None, root, counts, shape, False,
                          where(x, out) if receives else NONE, receives, None), learned)
    call.plan = plan
    return start(call, algorithm, check, result)


def gather(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto", check=None):
    """Every rank's ``x`` concatenated along axis 0 on ``root`` (ranks may differ in that
    axis' length); None on the other ranks. ``counts``: every rank's rows, given alike on
    every rank or on none; without it they are learned with one small exchange."""
    return _gather(x, root, out, comm, algorithm, check, BLOCKING, counts)


def igather(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto",
            check=None) -> Request:
    """Non-blocking ``gather`` (without ``counts``, the row counts are exchanged first,
    blocking)."""
    return _gather(x, root, out, comm, algorithm, check, NONBLOCKING, counts)


def gather_init(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto",
                check=None) -> Persistent:
    """Persistent ``gather`` (``MPI_Gather_init``). Collective."""
    return _gather(x, root, out, comm, algorithm, check, PERSISTENT, counts)


def _scatter(x, root, counts, out, comm, algorithm, check, mode):
    ctx = comm_context(comm, "scatter")
    # With out on every rank, each rank knows what it receives (as MPI_Scatterv): no header
    # for MPI's own. A toolkit algorithm (a tree) needs every rank's counts: the header then.
    known = out is not None and (algorithm == "auto" or algorithm == NATIVE)
    key = None
    if mode is BLOCKING and known and type(out) is np.ndarray and type(root) is int and \
            (x is None or type(x) is np.ndarray) and (given := counts_key(counts)) is not False:
        key = ("scatter", algorithm, root, None if x is None else x.dtype,
               None if x is None else x.shape, given, out.dtype, out.shape, out is x)
        if (call := bound(ctx, key, x, out)) is not None:
            if ctx.size > 1 and _check.enabled(check):
                _verify_scatter(ctx, root, algorithm, out)
            return start(call, algorithm, check, call.out.obj)
    try:
        root = _root(root, ctx.size)
        if known:
            dtype, trailing, counts = shapes.scatter_known(ctx, root, x, out, counts)
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "scatter", check, exc)
    if ctx.size > 1 and _check.enabled(check):
        _verify_scatter(ctx, root, algorithm, out)
    if not known:
        dtype, trailing, counts = shapes.scatter_header(ctx, root, x, counts)
    try:
        if ctx.rank == root:
            xb = wrap(x, "x")
        elif x is not None:  # its kind and device; the root's dtype and shape
            xb = wrap(x, "x")
            if xb.dtype != dtype or tuple(xb.shape[1:]) != trailing:
                raise TypeError(f"scatter: x on rank {ctx.rank} is {xb.describe()}; the root "
                                f"scatters {dtype.name} rows of shape {list(trailing)}")
            xb = wrap(x[:0], "x") if xb.shape else xb.new((0,) + trailing)  # no allocation
        elif out is not None:
            xb = wrap(out[:0], "out")
        else:
            xb = wrap(np.empty((0,) + trailing, dtype), "x")
        outb, inplace = _output(xb, out, (counts[ctx.rank],) + trailing)
        if inplace:
            raise ValueError("scatter cannot run in place: out must not be x")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "scatter", check, exc)
    row = math.prod(trailing)
    call = make_call("scatter", ctx, xb, outb, None, root, shapes.elements(counts, row), False,
                     mode is BLOCKING)
    # Without the header, the ranks other than the root may know only their own block: auto
    # cannot size the call alike on every rank, so MPI's own (MPI_Scatterv) runs.
    algo = REGISTRY["scatter"][NATIVE] if known and algorithm == "auto" else None
    if mode is PERSISTENT:
        return Persistent(call, algorithm, check, outb.obj, algo)
    plan = None
    if key is not None:  # off the root, x stands in as an empty array of the root's rows
        stand_in = None if ctx.rank == root else numpy_buffer(np.empty((0,) + trailing, dtype))
        plan = Plan(key, ("scatter", None, root, call.counts, outb.shape, False, APART, True,
                          stand_in))
    call.plan = plan
    return start(call, algorithm, check, outb.obj, algo)


def _verify_scatter(ctx, root, algorithm, out) -> None:
    """The cross-rank check of a scatter, before its header: ranks given out on some ranks
    only are told so, instead of a hang."""
    _check.verify(ctx.comm, collective="scatter", root=root, sequence=ctx.seq,
                  algorithm=f"{algorithm}, out {'given' if out is not None else 'none'}")


def scatter(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto", check=None):
    """This rank's block of root's ``x``, split on axis 0 in equal blocks or by ``counts``
    (given on the root); ``x`` is read on the root only (None elsewhere is fine). ``out``,
    given on every rank or on none: with it (and ``auto`` or ``native``), each rank receives
    ``out``'s rows and nothing moves but the data (as ``MPI_Scatterv``); without it, or for
    another algorithm named (which needs every rank's counts), the root's dtype, trailing
    shape and counts reach the others in one small header first."""
    return _scatter(x, root, counts, out, comm, algorithm, check, BLOCKING)


def iscatter(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto",
             check=None) -> Request:
    """Non-blocking ``scatter`` (without ``out``, the root's header is broadcast first,
    blocking)."""
    return _scatter(x, root, counts, out, comm, algorithm, check, NONBLOCKING)


def scatter_init(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto",
                 check=None) -> Persistent:
    """Persistent ``scatter`` (``MPI_Scatter_init``). Collective."""
    return _scatter(x, root, counts, out, comm, algorithm, check, PERSISTENT)


_NOTHING = wrap(np.empty(0, np.uint8), "x")  # a barrier's buffers


def _barrier(comm, algorithm, check, mode):
    ctx = comm_context(comm, "barrier")
    call = make_call("barrier", ctx, _NOTHING, _NOTHING, None, 0, None, False,
                     mode is BLOCKING)
    if mode is PERSISTENT:
        return Persistent(call, algorithm, check, None)
    key = ("barrier", algorithm)
    plan = None if mode is not BLOCKING else planned(ctx, key) or Plan(key)
    call.plan = plan
    return start(call, algorithm, check, None)


def barrier(comm=None, *, algorithm="auto", check=None) -> None:
    """Block until every rank of ``comm`` has called ``barrier``."""
    _barrier(comm, algorithm, check, BLOCKING)


def ibarrier(comm=None, *, algorithm="auto", check=None) -> Request:
    """Non-blocking ``barrier``: ``Request.wait()`` returns once every rank has called it."""
    return _barrier(comm, algorithm, check, NONBLOCKING)


def barrier_init(comm=None, *, algorithm="auto", check=None) -> Persistent:
    """Persistent ``barrier`` (``MPI_Barrier_init``). Collective."""
    return _barrier(comm, algorithm, check, PERSISTENT)
