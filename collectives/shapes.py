"""What a collective's ranks learn of each other's shapes before the data moves.

Counts and rows given by the caller are checked here; where ranks may differ and the caller did
not say (``allgather``, ``gather`` without ``counts``; ragged ``alltoall`` without
``recv_counts``; ``scatter``'s root), one small exchange tells every rank (an ``MPI_Allgather``
of counts, the root's ``MPI_Bcast`` of ``collectives.p2p``'s typed header and the counts),
watched like a collective. A rank whose own arguments were refused still joins it, with a mark,
so that every rank raises instead of the others waiting.
"""
from __future__ import annotations

import functools
import math
from array import array

import numpy as np

from . import check as _check
from . import p2p as _p2p
from . import watchdog as _watchdog
from .buffers import Buffer, wrap

__all__ = ["balanced", "counts_of", "CountBuffers", "MatrixBuffers", "allgather_counts",
           "learn", "learned", "Learned", "kept", "given", "elements", "alltoall_counts",
           "alltoall_learned", "row_counts", "rows_of", "MAX_AXES", "scatter_header",
           "scatter_known"]


_INT = frozenset((int,))


@functools.lru_cache(maxsize=1024)
def balanced(count: int, size: int) -> tuple[int, ...]:
    """``numpy.array_split``'s sizes of ``count`` over ``size`` ranks (a program's few lengths
    repeat: cached, as the tuple costs more than a small call's MPI)."""
    q, r = divmod(count, size)
    return (q + 1,) * r + (q,) * (size - r)


def counts_of(counts, size: int) -> tuple[int, ...]:
    """``counts`` as a tuple of ``size`` non-negative ints, or a ValueError saying why not."""
    if type(counts) is tuple or type(counts) is list:  # plain ints: no numpy for a few counts
        values = tuple(counts)
        if len(values) == size and _INT.issuperset(map(type, values)) and \
                (not values or min(values) >= 0):
            return values
    try:
        values = np.asarray(counts)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is not a counts list
        values = np.asarray([None])
    if values.ndim != 1 or len(values) != size or values.dtype.kind not in "iu" or \
            (values < 0).any():
        raise ValueError(f"counts must be {size} non-negative integers (one per rank), got "
                         f"{counts!r}")
    return tuple(int(c) for c in values)


class _Exchange:
    """A small exchange before a collective's data moves, as the watchdog sees it: the
    communicator's reused blocking entry (``watchdog.enter``), described only when a report
    needs it. One a communicator, reused like the entry: exchanges on it come one at a
    time."""

    __slots__ = ("collective", "seq", "how")

    def __init__(self, ctx):
        self.collective, self.seq, self.how = "", -1, ""

    def describe(self) -> str:
        return f"{self.collective} #{self.seq} ({self.how})"


def _exchange(ctx, collective: str, how: str, method, *args) -> None:
    """``method(*args)``, an exchange every rank of ``ctx`` joins, watched like a blocking
    collective."""
    entry = None
    if ctx.size > 1:
        what = ctx.slots.get(_Exchange) or ctx.slot(_Exchange)
        what.collective = collective
        what.seq = ctx.seq
        what.how = how
        entry = _watchdog.enter(ctx, what)
    try:
        method(*args)
    except BaseException as exc:
        if entry is not None:
            _watchdog.unwatch(entry, exc)
        raise
    if entry is not None:
        entry.release()


class CountBuffers:
    """One communicator's buffers for the row-count exchange (``allgather_counts``): this
    rank's (rows, elements per row), and every rank's, one after the other. Python arrays of
    int64: setting two numbers and reading a few back costs less than numpy's indexing."""

    __slots__ = ("mine", "table", "send", "recv")

    def __init__(self, ctx):
        from mpi4py import MPI
        self.mine, self.table = array("q", bytes(16)), array("q", bytes(16 * ctx.size))
        self.send, self.recv = [self.mine, MPI.INT64_T], [self.table, MPI.INT64_T]


def allgather_counts(ctx, xb: Buffer | None, collective="allgather") -> array:
    """Every rank's (rows, elements per row) of ``x``, from one small Allgather: the
    communicator's table (``CountBuffers.table``, valid until its next exchange), rank after
    rank. A rank whose ``x`` was refused (``xb`` None) joins with rows -1, so that every rank
    raises (``learned``) instead of the others waiting."""
    # Plain ints and buffers kept on the communicator: this runs on every allgather without
    # counts, and numpy's reductions on two-element arrays made it 25 us at 8 B, n = 2,
    # against 3 us for the MPI_Allgather.
    bufs = ctx.slots.get(CountBuffers) or ctx.slot(CountBuffers)
    mine = bufs.mine
    if xb is None:
        mine[0] = mine[1] = -1
    else:
        shape = xb.shape
        mine[0] = shape[0] if shape else 1
        mine[1] = 1 if len(shape) < 2 else math.prod(shape[1:])
    _exchange(ctx, collective, "exchanging row counts: MPI_Allgather", ctx.comm.Allgather,
              bufs.send, bufs.recv)
    return bufs.table


def learn(ctx, x, collective, table: array | None = None,
          before: Learned | None = None) -> tuple[Buffer, tuple[int, ...], int, Learned]:
    """``(x wrapped, every rank's element count, total rows, what a plan keeps of the
    exchange)`` of an allgather or gather without counts, from one exchange of every rank's
    (rows, elements per row) (``allgather_counts``); where ``table`` is given, that exchange
    was made already, with the plan ``before``'s row (``Learned.again``). A rank whose x is
    refused joins it all the same, and every rank raises (``learned``)."""
    try:
        xb, error = wrap(x, "x"), None
    except (TypeError, ValueError) as exc:
        xb, error = None, exc
    if table is None:
        table = allgather_counts(ctx, xb, collective)
    counts, rows = learned(ctx, table, error, collective)
    return xb, counts, rows, kept(ctx, CountBuffers, before)


def learned(ctx, table: array, error, collective) -> tuple[tuple[int, ...], int]:
    """``(every rank's element count, total rows)`` from ``learn``'s exchange; the error of a
    rank whose x was refused (``check.settle``) or of trailing axes that differ, on every
    rank."""
    every = table.tolist()
    every_rows, every_row = every[0::2], every[1::2]
    if min(every_rows) < 0:
        _check.settle(ctx.comm, collective, error)
    row = every_row[ctx.rank]
    if every_row.count(row) != ctx.size:
        shapes = ", ".join(f"rank {r}: {e} per row" for r, e in enumerate(every_row))
        raise ValueError(f"{collective}: x's trailing axes must agree on every rank ({shapes})")
    if row == 1:
        return tuple(every_rows), sum(every_rows)
    return tuple(r * row for r in every_rows), sum(every_rows)


class Learned:
    """What a signature's plan keeps of its count exchange (``kept``), to make it again as
    its calls' first step (``again``): this rank's row as it sent it (its own copy: the row
    follows from the signature), the communicator's receive buffer, and every rank's rows as
    they were."""

    __slots__ = ("send", "recv", "table")

    def __init__(self, send, recv, table):
        self.send, self.recv, self.table = send, recv, table

    def again(self, ctx) -> array | None:
        """The exchange made again on ``ctx``, inside its call's watched lifecycle
        (``collectives.dispatch.start``): None where every rank's rows are what they were,
        else every rank's rows now (the communicator's table). Every rank joins it, with the
        same signature's plan or with ``allgather_counts``/``alltoall_counts`` (the same
        message) where it has none."""
        recv = self.recv
        ctx.comm.Allgather(self.send, recv)
        table = recv[0]
        return None if table == self.table else table


def kept(ctx, buffers, before: Learned | None = None) -> Learned:
    """What a plan keeps of the exchange just made on ``ctx`` with ``buffers``
    (``CountBuffers``, ``MatrixBuffers``): by ``allgather_counts``/``alltoall_counts``, or as
    an earlier plan's ``before`` (which sent this rank's row from its own)."""
    bufs = ctx.slots[buffers]
    send = [array("q", bufs.mine), bufs.send[1]] if before is None else before.send
    return Learned(send, bufs.recv, array("q", bufs.table))


def given(ctx, x, rows, check, collective) -> tuple[Buffer, tuple[int, ...], int]:
    """``(x wrapped, every rank's element count, total rows)`` of an allgather or gather
    whose ``rows`` (every rank's, given alike on every rank) are checked against x: nothing
    to exchange, as ``MPI_Allgather``."""
    try:
        xb = wrap(x, "x")
        rows = counts_of(rows, ctx.size)
        mine, row = rows_of(xb)
        if rows[ctx.rank] != mine:
            raise ValueError(f"{collective}: counts[{ctx.rank}] is {rows[ctx.rank]}, but "
                             f"x has {mine} rows on rank {ctx.rank}")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, collective, check, exc)
    return xb, elements(rows, row), sum(rows)


def elements(counts, row: int) -> tuple[int, ...]:
    return counts if row == 1 else tuple(c * row for c in counts)


def alltoall_counts(ctx, xb, send) -> array:
    """Every rank's (elements per row, send counts), from one small Allgather: the
    communicator's table (``MatrixBuffers.table``, valid until its next exchange), rank i's
    send counts in row i. A rank whose arguments were refused (``send`` None) joins with -1,
    so that every rank raises (``alltoall_learned``) instead of the others waiting. The
    table, as bytes, is part of the call's signature."""
    bufs = ctx.slots.get(MatrixBuffers) or ctx.slot(MatrixBuffers)
    mine = bufs.mine
    if send is None:
        mine[:] = array("q", (-1,) * (ctx.size + 1))
    else:
        mine[0] = rows_of(xb)[1]
        mine[1:] = array("q", send)
    _exchange(ctx, "alltoall", "exchanging counts: MPI_Allgather", ctx.comm.Allgather,
              bufs.send, bufs.recv)
    return bufs.table


def alltoall_learned(ctx, table: array, error):
    """``(recv, matrix)`` in rows from ``alltoall_counts``' table: what this rank receives
    from each rank, and every rank's send counts; the error of a rank whose arguments were
    refused (``check.settle``) or of trailing axes that differ, on every rank."""
    every = table.tolist()  # plain ints: numpy's reductions on a few counts cost more
    size = ctx.size
    width = size + 1
    per_row = every[0::width]  # each rank's elements per row, then its send counts
    row = per_row[ctx.rank]
    if min(per_row) < 0:
        _check.settle(ctx.comm, "alltoall", error)
    if per_row.count(row) != size:
        shapes = ", ".join(f"rank {j}: {r} per row" for j, r in enumerate(per_row))
        raise ValueError(f"alltoall: x's trailing axes must agree on every rank ({shapes})")
    matrix = tuple(tuple(every[j + 1:j + width]) for j in range(0, len(every), width))
    return tuple(every[1 + ctx.rank::width]), matrix


class MatrixBuffers:
    """One communicator's buffers for the all-to-all count exchange (``alltoall_counts``):
    this rank's (elements per row, send counts), and every rank's."""

    __slots__ = ("mine", "table", "send", "recv")

    def __init__(self, ctx):
        from mpi4py import MPI
        width = ctx.size + 1
        self.mine = array("q", bytes(8 * width))
        self.table = array("q", bytes(8 * width * ctx.size))
        self.send, self.recv = [self.mine, MPI.INT64_T], [self.table, MPI.INT64_T]


def row_counts(collective: str, rows: int, counts, size: int) -> tuple[int, ...]:
    """The rows for each rank: ``counts`` checked against x's ``rows``, or equal blocks."""
    if counts is None:
        if rows % size:
            raise ValueError(f"{collective}: x has {rows} rows, which {size} ranks cannot "
                             f"share equally; pass counts (rows for each rank)")
        return (rows // size,) * size
    counts = counts_of(counts, size)
    if sum(counts) != rows:
        raise ValueError(f"{collective}: counts add up to {sum(counts)}, but x has {rows} rows")
    return counts


def rows_of(xb: Buffer) -> tuple[int, int]:
    """``(rows, elements per row)`` of ``xb``: axis 0 and the product of the others."""
    shape = xb.shape
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


MAX_AXES = _p2p.MAXDIM  # of a scattered array, besides axis 0 (p2p's typed header)


def scatter_header(ctx, root, x, counts):
    """The root's ``(dtype, trailing shape, counts in rows)``, told to every rank by one small
    Bcast (a mark that the root's arguments passed, p2p's typed header of a row, the counts);
    a refused call on the root is a ``ValueError`` on every rank."""
    size = ctx.size
    typed = slice(1, 1 + _p2p.HEADER)
    head = np.zeros(1 + _p2p.HEADER + size, np.int64)
    error = None
    if ctx.rank == root:
        try:
            xb = wrap(x, "x")
            if not xb.shape or len(xb.shape) > MAX_AXES + 1:
                raise ValueError(f"scatter: x must have 1 to {MAX_AXES + 1} axes, has "
                                 f"{len(xb.shape)}")
            counts = row_counts("scatter", xb.shape[0], counts, size)
            _p2p.header(xb.dtype, xb.shape[1:], out=head[typed])
            head[typed.stop:] = counts
            head[0] = 1
        except (TypeError, ValueError) as exc:
            error = exc
    _exchange(ctx, "scatter", "the root's counts: MPI_Bcast", ctx.comm.Bcast, head, root)
    if error is not None:
        raise error
    if head[0] != 1:
        raise ValueError(f"scatter: the root (rank {root}) refused its arguments (its own "
                         f"error says why)")
    dtype, trailing = _p2p.parse(head[typed])
    return dtype, trailing, tuple(head[typed.stop:].tolist())


def scatter_known(ctx, root, x, out, counts):
    """``scatter_header``'s answer from what every rank passed itself, with no message (as
    ``MPI_Scatterv``, whose every rank knows what it receives): the dtype and trailing shape of
    ``out``, and the counts (given, or equal blocks of ``out``'s rows where not: a rank other
    than the root needs only its own block)."""
    ob = wrap(out, "out")
    if not ob.shape:
        raise ValueError("scatter: out must have an axis 0 (the rows this rank receives)")
    dtype, trailing = ob.dtype, tuple(ob.shape[1:])
    counts = counts_of(counts, ctx.size) if counts is not None else (ob.shape[0],) * ctx.size
    if counts[ctx.rank] != ob.shape[0]:
        raise ValueError(f"scatter: counts[{ctx.rank}] is {counts[ctx.rank]}, but out has "
                         f"{ob.shape[0]} rows on rank {ctx.rank}")
    if ctx.rank == root:
        xb = wrap(x, "x")
        if xb.dtype != dtype or tuple(xb.shape[1:]) != trailing or \
                (xb.shape[0] if xb.shape else 1) != sum(counts):
            raise TypeError(f"scatter: x on the root is {xb.describe()}, but the blocks are "
                            f"{sum(counts)} {dtype.name} rows of shape {list(trailing)}")
    return dtype, trailing, counts
