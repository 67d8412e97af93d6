"""The public API: argument checks and buffer wrapping, then ``collectives.dispatch``.

Each collective checks its arguments with the facts every rank has, so a bad call raises the
same ``ValueError``/``TypeError`` on every rank before a byte moves, wraps ``x`` and ``out`` into
flat zero-copy views (``collectives.buffers``) and hands the resulting ``Call`` to
``dispatch.start``, which validates across ranks where asked, chooses the algorithm and runs it.

Without ``out`` the input is never modified and a new array of x's kind is returned; ``out=x``
is in place, and an allreduce is in place on every rank or on none (as ``MPI_IN_PLACE``). On
error the input is untouched; ``out`` may be partly written if the error came from the network
after the collective started (checks happen before).
"""
from __future__ import annotations

import math

import numpy as np

from . import check as _check
from . import kept, select, shapes
from .buffers import Buffer, wrap
from .dispatch import Call, auto_pick, avg_finalizer, comm_context, make_call, start
from .ops import resolve
from .progress import Request
from .select import NATIVE, REGISTRY

__all__ = ["allreduce", "reduce", "broadcast", "reduce_scatter", "allgather", "alltoall",
           "gather", "scatter", "barrier", "iallreduce", "ireduce", "ibroadcast",
           "ireduce_scatter", "iallgather", "ialltoall", "igather", "iscatter", "ibarrier",
           "algorithms", "auto_pick", "Call"]


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
    o = wrap(out, what)
    if o.kind != x.kind or o.dtype != x.dtype or o.device != x.device:
        raise TypeError(f"{what} is {o.describe()}, expected a {x.kind} {x.dtype.name} buffer "
                        f"on {x.device}")
    if o.shape != shape and o.shape != tuple(shape):
        raise ValueError(f"{what} has shape {list(o.shape)}, expected {list(shape)}")
    if o.readonly:
        raise ValueError(f"{what} is read-only")
    if o.obj is x.obj or (x.kind == "numpy" and not np.may_share_memory(x.flat, o.flat)):
        return o, o.obj is x.obj and x.count > 0  # the common cases, without address arithmetic
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


# -- the collectives --------------------------------------------------------------------------
def _allreduce(x, op, out, comm, algorithm, check, blocking, key=None):
    ctx = comm_context(comm, "allreduce")
    try:
        xb = wrap(x, "x")
        opr = resolve(op, xb.dtype)
        outb, inplace = _output(xb, out, xb.shape)
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "allreduce", check, exc)
    call = make_call("allreduce", ctx, xb, outb, opr, 0, None, inplace, blocking)
    finalize = avg_finalizer(call) if opr.is_avg else None
    result = start(call, algorithm, check, outb.obj, finalize)
    if blocking:
        kept.keep(key, x, out, comm, call, result, finalize)
    return result


def allreduce(x, op="sum", *, out=None, comm=None, algorithm="auto", check=None):
    """Reduce ``x`` over all ranks of ``comm``; every rank gets the result (like x)."""
    key = ("allreduce", id(x), id(out), op, id(comm), algorithm)
    result = kept.repeat(key, x, out, check)
    if result is not kept.MISS:
        return result
    keep = out is not None and kept.small(x, out, op, algorithm)
    return _allreduce(x, op, out, comm, algorithm, check, True, key if keep else None)


def iallreduce(x, op="sum", *, out=None, comm=None, algorithm="auto", check=None) -> Request:
    """Non-blocking ``allreduce``: ``Request.wait()`` returns the result."""
    return _allreduce(x, op, out, comm, algorithm, check, False)


def _reduce(x, op, root, out, comm, algorithm, check, blocking, key=None):
    ctx = comm_context(comm, "reduce")
    try:
        root = _root(root, ctx.size)
        xb = wrap(x, "x")
        opr = resolve(op, xb.dtype)
        if ctx.rank == root or out is not None:  # a given out is checked everywhere
            outb, inplace = _output(xb, out, xb.shape)
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "reduce", check, exc)
    if ctx.rank == root:
        result = outb.obj
    else:  # out is ignored (never written) off the root
        outb, inplace, result = None, False, None
    call = make_call("reduce", ctx, xb, outb, opr, root, None, inplace, blocking)
    finalize = avg_finalizer(call)
    result = start(call, algorithm, check, result, finalize)
    if blocking:
        kept.keep(key, x, out, comm, call, result, finalize)
    return result


def reduce(x, op="sum", root=0, *, out=None, comm=None, algorithm="auto", check=None):
    """Reduce ``x`` over all ranks onto ``root``: the result there, None elsewhere."""
    key = ("reduce", id(x), id(out), op, root, id(comm), algorithm)
    result = kept.repeat(key, x, out, check)
    if result is not kept.MISS:
        return result
    keep = kept.small(x, out, op, algorithm) and type(root) is int
    return _reduce(x, op, root, out, comm, algorithm, check, True, key if keep else None)


def ireduce(x, op="sum", root=0, *, out=None, comm=None, algorithm="auto",
            check=None) -> Request:
    """Non-blocking ``reduce``."""
    return _reduce(x, op, root, out, comm, algorithm, check, False)


def _broadcast(x, root, comm, algorithm, check, blocking, key=None):
    ctx = comm_context(comm, "broadcast")
    try:
        root = _root(root, ctx.size)
        xb = wrap(x, "x")
        if xb.readonly:  # refused on the root too, so that every rank gives the same verdict
            raise ValueError("x is read-only: broadcast fills it in place on every rank but "
                             "the root; pass a writable array on every rank")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "broadcast", check, exc)
    call = make_call("broadcast", ctx, xb, xb, None, root, None, True, blocking)
    result = start(call, algorithm, check, xb.obj)
    if blocking:
        kept.keep(key, x, x, comm, call, result, None)
    return result


def broadcast(x, root=0, *, comm=None, algorithm="auto", check=None):
    """Fill ``x`` on every rank with root's ``x``, in place; returns x."""
    key = ("broadcast", id(x), root, id(comm), algorithm)
    result = kept.repeat(key, x, x, check)
    if result is not kept.MISS:
        return result
    keep = kept.small(x, None, None, algorithm) and type(root) is int
    return _broadcast(x, root, comm, algorithm, check, True, key if keep else None)


def ibroadcast(x, root=0, *, comm=None, algorithm="auto", check=None) -> Request:
    """Non-blocking ``broadcast``."""
    return _broadcast(x, root, comm, algorithm, check, False)


def _reduce_scatter(x, op, counts, out, comm, algorithm, check, blocking, key=None):
    ctx = comm_context(comm, "reduce_scatter")
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
    call = make_call("reduce_scatter", ctx, xb, outb, opr, 0, counts, False, blocking)
    finalize = avg_finalizer(call)
    result = start(call, algorithm, check, outb.obj, finalize)
    if blocking:
        kept.keep(key, x, out, comm, call, result, finalize)
    return result


def reduce_scatter(x, op="sum", *, counts=None, out=None, comm=None, algorithm="auto",
                   check=None):
    """Reduce flat ``x`` over all ranks; rank r gets block r (``counts[r]`` elements, 1-D)."""
    key = ("reduce_scatter", id(x), id(out), op, counts, id(comm), algorithm)
    result = kept.repeat(key, x, out, check)
    if result is not kept.MISS:
        return result
    keep = kept.small(x, out, op, algorithm) and (counts is None or type(counts) is tuple)
    return _reduce_scatter(x, op, counts, out, comm, algorithm, check, True,
                           key if keep else None)


def ireduce_scatter(x, op="sum", *, counts=None, out=None, comm=None, algorithm="auto",
                    check=None) -> Request:
    """Non-blocking ``reduce_scatter``."""
    return _reduce_scatter(x, op, counts, out, comm, algorithm, check, False)


def _allgather(x, out, comm, algorithm, check, blocking, rows=None, key=None):
    ctx = comm_context(comm, "allgather")
    xb, counts, rows = shapes.gathered(ctx, x, rows, check, "allgather")
    shape = (rows,) + tuple(xb.shape[1:]) if xb.shape else (rows,)
    try:
        outb, inplace = _output(xb, out, shape)
        if inplace:
            raise ValueError("allgather cannot run in place: out must not be x")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "allgather", check, exc)
    call = make_call("allgather", ctx, xb, outb, None, 0, counts, False, blocking)
    result = start(call, algorithm, check, outb.obj)
    if blocking:
        kept.keep(key, x, out, comm, call, result, None)
    return result


def allgather(x, *, counts=None, out=None, comm=None, algorithm="auto", check=None):
    """Concatenate every rank's ``x`` along axis 0 (ranks may differ in that axis' length).
    ``counts``: every rank's rows, given alike on every rank or on none; without it they are
    learned with one small exchange."""
    key = ("allgather", id(x), id(out), counts, id(comm), algorithm)
    result = kept.repeat(key, x, out, check)
    if result is not kept.MISS:
        return result
    keep = type(counts) is tuple and kept.small(x, out, None, algorithm)
    return _allgather(x, out, comm, algorithm, check, True, counts, key if keep else None)


def iallgather(x, *, counts=None, out=None, comm=None, algorithm="auto",
               check=None) -> Request:
    """Non-blocking ``allgather``."""
    return _allgather(x, out, comm, algorithm, check, False, counts)


# -- all-to-all, gather, scatter, barrier ------------------------------------------------------
def _alltoall(x, counts, recv_counts, out, comm, algorithm, check, blocking, key=None):
    ctx = comm_context(comm, "alltoall")
    size = ctx.size
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
        recv, matrix = shapes.alltoall_counts(ctx, xb, send, recv, error)
    elif error is not None:
        raise _check.failed(ctx, "alltoall", check, error)
    elif recv is None:  # equal blocks: the same from everyone (as MPI_Alltoall)
        recv, matrix = send, (send,) * size
    row = shapes.rows_of(xb)[1]
    try:
        outb, inplace = _output(xb, out, (sum(recv),) + tuple(xb.shape[1:]))
        if inplace:
            raise ValueError("alltoall cannot run in place: out must not be x")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "alltoall", check, exc)
    counts_e = (shapes.elements(send, row), shapes.elements(recv, row),
                None if matrix is None else tuple(shapes.elements(r, row) for r in matrix))
    call = make_call("alltoall", ctx, xb, outb, None, 0, counts_e, False, blocking)
    # Without the matrix, auto cannot size the call alike on every rank: MPI's own then.
    algo = REGISTRY["alltoall"][NATIVE] if matrix is None and algorithm == "auto" else None
    result = start(call, algorithm, check, outb.obj, None, algo)
    if blocking:
        kept.keep(key, x, out, comm, call, result, None)
    return result


def alltoall(x, counts=None, *, recv_counts=None, out=None, comm=None, algorithm="auto",
             check=None):
    """Split ``x``'s axis 0 into blocks for the ranks (equal, or ``counts[j]`` rows for rank
    j); returns the rows received from every rank, concatenated in rank order."""
    key = ("alltoall", id(x), id(out), counts, recv_counts, id(comm), algorithm)
    result = kept.repeat(key, x, out, check)
    if result is not kept.MISS:
        return result
    keep = (counts is None or type(recv_counts) is tuple) and \
        type(counts) in (tuple, kept.NONE) and kept.small(x, out, None, algorithm)
    return _alltoall(x, counts, recv_counts, out, comm, algorithm, check, True,
                     key if keep else None)


def ialltoall(x, counts=None, *, recv_counts=None, out=None, comm=None, algorithm="auto",
              check=None) -> Request:
    """Non-blocking ``alltoall`` (ragged counts without ``recv_counts`` are exchanged first,
    blocking)."""
    return _alltoall(x, counts, recv_counts, out, comm, algorithm, check, False)


def _gather(x, root, out, comm, algorithm, check, blocking, rows=None, key=None):
    ctx = comm_context(comm, "gather")
    try:
        root = _root(root, ctx.size)
    except ValueError as exc:
        raise _check.failed(ctx, "gather", check, exc)
    xb, counts, rows = shapes.gathered(ctx, x, rows, check, "gather")
    outb, result = None, None
    if ctx.rank == root:
        try:
            outb, inplace = _output(xb, out, (rows,) + tuple(xb.shape[1:]) if xb.shape
                                    else (rows,))
            if inplace:
                raise ValueError("gather cannot run in place: out must not be x")
        except (TypeError, ValueError) as exc:
            raise _check.failed(ctx, "gather", check, exc)
        result = outb.obj
    call = make_call("gather", ctx, xb, outb, None, root, counts, False, blocking)
    result = start(call, algorithm, check, result)
    if blocking:
        kept.keep(key, x, out, comm, call, result, None)
    return result


def gather(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto", check=None):
    """Every rank's ``x`` concatenated along axis 0 on ``root`` (ranks may differ in that
    axis' length); None on the other ranks. ``counts``: every rank's rows, given alike on
    every rank or on none; without it they are learned with one small exchange."""
    key = ("gather", id(x), id(out), root, counts, id(comm), algorithm)
    result = kept.repeat(key, x, out, check)
    if result is not kept.MISS:
        return result
    keep = type(counts) is tuple and type(root) is int and kept.small(x, out, None, algorithm)
    return _gather(x, root, out, comm, algorithm, check, True, counts, key if keep else None)


def igather(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto",
            check=None) -> Request:
    """Non-blocking ``gather`` (without ``counts``, the row counts are exchanged first,
    blocking)."""
    return _gather(x, root, out, comm, algorithm, check, False, counts)


def _scatter(x, root, counts, out, comm, algorithm, check, blocking, header=True, key=None):
    ctx = comm_context(comm, "scatter")
    try:
        root = _root(root, ctx.size)
        if not header:
            dtype, trailing, counts = shapes.scatter_known(ctx, root, x, out, counts)
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "scatter", check, exc)
    if header:
        dtype, trailing, counts = shapes.scatter_header(ctx, root, x, counts)
    try:
        if ctx.rank == root:
            xb = wrap(x, "x")
        elif x is not None:  # its kind and device; the root's dtype and shape
            xb = wrap(x, "x")
            if xb.dtype != dtype or tuple(xb.shape[1:]) != trailing:
                raise TypeError(f"scatter: x on rank {ctx.rank} is {xb.describe()}; the root "
                                f"scatters {dtype.name} rows of shape {list(trailing)}")
            xb = xb.new((0,) + trailing)
        elif out is not None:
            xb = wrap(out, "out").new((0,) + trailing)
        else:
            xb = wrap(np.empty((0,) + trailing, dtype), "x")
        outb, inplace = _output(xb, out, (counts[ctx.rank],) + trailing)
        if inplace:
            raise ValueError("scatter cannot run in place: out must not be x")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "scatter", check, exc)
    row = math.prod(trailing)
    call = make_call("scatter", ctx, xb, outb, None, root, shapes.elements(counts, row), False,
                     blocking)
    result = start(call, algorithm, check, outb.obj)
    if blocking:  # kept on out (x is None off the root)
        kept.keep(key, out, x, comm, call, result, None)
    return result


def scatter(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto", check=None,
            header=True):
    """This rank's block of root's ``x``, split on axis 0 in equal blocks or by ``counts``
    (given on the root); ``x`` is read on the root only (None elsewhere is fine). The root's
    dtype, trailing shape and counts reach the others in one small header; ``header=False``
    (alike on every rank) skips it where every rank passes ``out`` and, if ragged, ``counts``
    (as ``MPI_Scatterv``)."""
    key = ("scatter", id(x), id(out), None if x is None else x.dtype, root, counts, id(comm),
           algorithm, header)
    result = kept.repeat(key, out, out, check)
    if result is not kept.MISS:
        return result
    keep = not header and type(root) is int and (counts is None or type(counts) is tuple) and \
        kept.small(out, x, None, algorithm)
    return _scatter(x, root, counts, out, comm, algorithm, check, True, header,
                    key if keep else None)


def iscatter(x, root=0, *, counts=None, out=None, comm=None, algorithm="auto",
             check=None, header=True) -> Request:
    """Non-blocking ``scatter`` (the root's header is broadcast first, blocking, unless
    ``header=False``)."""
    return _scatter(x, root, counts, out, comm, algorithm, check, False, header)


_NOTHING = np.empty(0, np.uint8)


def _barrier(comm, algorithm, check, blocking, key=None):
    ctx = comm_context(comm, "barrier")
    xb = wrap(_NOTHING, "x")
    call = make_call("barrier", ctx, xb, xb, None, 0, None, False, blocking)
    result = start(call, algorithm, check, None)
    if blocking:
        kept.keep(key, _NOTHING, None, comm, call, result, None)
    return result


def barrier(comm=None, *, algorithm="auto", check=None) -> None:
    """Block until every rank of ``comm`` has called ``barrier``."""
    key = ("barrier", id(comm), algorithm)
    if kept.repeat(key, _NOTHING, None, check) is kept.MISS:
        _barrier(comm, algorithm, check, True, key if type(algorithm) is str else None)


def ibarrier(comm=None, *, algorithm="auto", check=None) -> Request:
    """Non-blocking ``barrier``: ``Request.wait()`` returns once every rank has called it."""
    return _barrier(comm, algorithm, check, False)

