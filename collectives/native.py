"""``algorithm="native"``: the MPI library's own collectives, blocking or not.

Built-in MPI datatypes and ops are used where the library defines the pair (sum of float32,
bxor of int64, lor of bool, ...); other pairs (float16, bfloat16, sum of bool, ...) run with a
commutative user-defined ``MPI.Op`` over a contiguous datatype of one element, whose kernel is
``collectives.ops``. Data-movement collectives move bytes (``MPI.BYTE``), so every dtype works.
"""
from __future__ import annotations

import functools

import numpy as np

from .ops import Op
from .progress import DONE, NativeWork

__all__ = ["launch", "prepare", "arguments", "mpi_type_op"]

_CACHE: dict = {}

# (op name, numpy kind) pairs MPI defines on the matching builtin type.
_BUILTIN = {
    "sum": "iufc", "prod": "iufc", "min": "iuf", "max": "iuf",
    "band": "iu", "bor": "iu", "bxor": "iu",
}
_MPI_TYPES = {
    "i1": "INT8_T", "i2": "INT16_T", "i4": "INT32_T", "i8": "INT64_T",
    "u1": "UINT8_T", "u2": "UINT16_T", "u4": "UINT32_T", "u8": "UINT64_T",
    "f4": "FLOAT", "f8": "DOUBLE", "c8": "C_FLOAT_COMPLEX", "c16": "C_DOUBLE_COMPLEX",
}
_BOOL = {"sum": "LOR", "max": "LOR", "bor": "LOR", "prod": "LAND", "min": "LAND",
         "band": "LAND", "bxor": "LXOR"}


def mpi_type_op(op: Op):
    """``(MPI datatype, MPI.Op)`` that reduce ``op.dtype`` with ``op`` (kept on ``op``)."""
    if op.mpi is not None:
        return op.mpi
    key = (op.name, op.dtype)
    hit = _CACHE.get(key)
    if hit is not None:
        op.mpi = hit
        return hit
    from mpi4py import MPI
    dtype, kind = op.dtype, op.dtype.kind
    result = None
    if kind == "b":
        result = (MPI.C_BOOL, getattr(MPI, _BOOL[op.name]))
    elif kind in _BUILTIN[op.name] and not (kind == "f" and dtype.itemsize < 4):
        mpitype = getattr(MPI, _MPI_TYPES.get(dtype.str[1:], "DATATYPE_NULL"))
        if mpitype != MPI.DATATYPE_NULL:
            result = (mpitype, getattr(MPI, op.name.upper()))
    if result is None:
        mpitype = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()

        def kernel(inbuf, inoutbuf, datatype, _op=op, _dtype=dtype):
            a = np.frombuffer(inbuf, _dtype)
            b = np.frombuffer(inoutbuf, _dtype)
            _op.reduce(b, a, b)

        result = (mpitype, MPI.Op.Create(kernel, commute=True))
    _CACHE[key] = op.mpi = result
    return result


def launch(call):
    """Start ``call`` (a ``collectives.dispatch.Call`` on host buffers) with the MPI library's own
    collective: done at once when it blocks, else the library's request as work."""
    name, args = _ARGUMENTS[call.collective](call, _mpi())
    comm = call.ctx.comm
    if call.blocking:
        getattr(comm, name)(*args)
        return DONE
    iname = "I" + name.lower()  # Allreduce -> Iallreduce, Bcast -> Ibcast, ...
    return NativeWork(getattr(comm, iname)(*args), iname)


def arguments(call) -> tuple[str, tuple]:
    """The blocking mpi4py method that runs ``call`` and its arguments: the block forms
    (``MPI_Allgather``, ``MPI_Gather``, ...) where every rank moves as much, the vector forms
    (bytes) otherwise. Reductions use the (type, op) pair of ``mpi_type_op``; data movement
    moves bytes (``MPI.BYTE``: the buffer as it is, its bytes counted by mpi4py), so every
    dtype works."""
    return _ARGUMENTS[call.collective](call, _mpi())


def _barrier(call, MPI):
    return "Barrier", ()


def _broadcast(call, MPI):
    return "Bcast", ([call.out.flat, MPI.BYTE], call.root)


def _allreduce(call, MPI):
    mpitype, mpiop = call.op.mpi or mpi_type_op(call.op)
    out = call.out.flat
    return "Allreduce", (MPI.IN_PLACE if call.inplace else [call.x.flat, mpitype],
                         [out, mpitype], mpiop)


def _reduce(call, MPI):
    mpitype, mpiop = call.op.mpi or mpi_type_op(call.op)
    x = call.x.flat
    if call.out is None:  # a non-root rank: nothing received
        return "Reduce", ([x, mpitype], None, mpiop, call.root)
    return "Reduce", (MPI.IN_PLACE if call.inplace else [x, mpitype],
                      [call.out.flat, mpitype], mpiop, call.root)


def _reduce_scatter(call, MPI):
    mpitype, mpiop = call.op.mpi or mpi_type_op(call.op)
    x, counts = call.x.flat, call.counts
    recv = [call.out.flat, counts[call.ctx.rank], mpitype]
    if _even(counts):
        # the send buffer without a count: mpi4py 4 reads a count here as one block's,
        # older releases as the whole buffer's; from the buffer alone, both take its length
        return "Reduce_scatter_block", ([x, mpitype], recv, mpiop)
    return "Reduce_scatter", ([x, sum(counts), mpitype], recv, counts, mpiop)


def _allgather(call, MPI):
    out = call.out.flat
    # Not Allgatherv for all: MPICH runs it by other algorithms than Allgather, 1.3-2x slower
    # for equal counts (docs/performance.md).
    if _even(call.counts):
        return "Allgather", ([call.x.flat, MPI.BYTE], [out, MPI.BYTE])
    return "Allgatherv", ([call.x.flat, MPI.BYTE],
                          [out, _layout(call.counts, out.dtype.itemsize), MPI.BYTE])


def _alltoall(call, MPI):
    x, out = call.x.flat, call.out.flat
    sends, recvs, matrix = call.counts
    # The block form only where every rank knows that every rank sends every rank as much
    # (the matrix of equal blocks, or a learned one): a rank whose own counts happen to be
    # even, among ranks whose are not, must call MPI_Alltoallv as they do.
    if matrix is not None and _even(sends) and matrix.count(sends) == len(matrix):
        return "Alltoall", ([x, MPI.BYTE], [out, MPI.BYTE])
    return "Alltoallv", ([x, _layout(tuple(sends), x.dtype.itemsize), MPI.BYTE],
                         [out, _layout(tuple(recvs), out.dtype.itemsize), MPI.BYTE])


def _gather(call, MPI):
    send = [call.x.flat, MPI.BYTE]
    even = _even(call.counts)  # known alike on every rank: the same form everywhere
    if call.ctx.rank != call.root:  # out is only written on the root
        return ("Gather" if even else "Gatherv"), (send, None, call.root)
    out = call.out.flat
    if even:
        return "Gather", (send, [out, MPI.BYTE], call.root)
    return "Gatherv", (send, [out, _layout(tuple(call.counts), out.dtype.itemsize), MPI.BYTE],
                       call.root)


def _scatter(call, MPI):
    # x is only read on the root. Always the vector form: a rank given out knows only its own
    # block (api.scatter), so the ranks could not agree on the block form.
    x = call.x.flat
    sent = None if call.ctx.rank != call.root else \
        [x, _layout(tuple(call.counts), x.dtype.itemsize), MPI.BYTE]
    return "Scatterv", (sent, [call.out.flat, MPI.BYTE], call.root)


def prepare(call):
    """``launch`` for the blocking calls of ``call``'s signature (its collective, dtype,
    shapes, op, root and counts: ``collectives.dispatch.Plan``): the mpi4py method, the
    datatypes, op and layouts worked out once; each call passes only its buffers."""
    MPI = _mpi()
    name, args = _ARGUMENTS[call.collective](call, MPI)
    return _PREPARE[call.collective](getattr(call.ctx.comm, name), args, MPI)


def _prepared_barrier(method, args, MPI):
    def run(call):
        method()
        return DONE
    return run


def _prepared_broadcast(method, args, MPI):
    byte, root = MPI.BYTE, args[1]

    def run(call):
        method([call.out.flat, byte], root)
        return DONE
    return run


def _prepared_allreduce(method, args, MPI):
    (_, mpitype), mpiop, in_place = args[1], args[2], MPI.IN_PLACE

    def run(call):
        method(in_place if call.inplace else [call.x.flat, mpitype], [call.out.flat, mpitype],
               mpiop)
        return DONE
    return run


def _prepared_reduce(method, args, MPI):
    sent, received, mpiop, root = args
    mpitype, in_place = (sent if received is None else received)[-1], MPI.IN_PLACE

    def run(call):
        out = call.out
        if out is None:
            method([call.x.flat, mpitype], None, mpiop, root)
        else:
            method(in_place if call.inplace else [call.x.flat, mpitype], [out.flat, mpitype],
                   mpiop, root)
        return DONE
    return run


def _prepared_reduce_scatter(method, args, MPI):
    if len(args) == 3:  # Reduce_scatter_block
        (_, mpitype), (_, count, _), mpiop = args

        def run(call):
            method([call.x.flat, mpitype], [call.out.flat, count, mpitype], mpiop)
            return DONE
        return run
    (_, total, mpitype), (_, count, _), counts, mpiop = args

    def run(call):
        method([call.x.flat, total, mpitype], [call.out.flat, count, mpitype], counts, mpiop)
        return DONE
    return run


def _prepared_exchange(method, args, MPI):
    """Allgather(v), Alltoall(v): what is sent and received, in bytes, each with its layout
    where it has one."""
    sent, received = args[0][1:], args[1][1:]
    if len(sent) == len(received) == 1:  # the block forms
        byte = MPI.BYTE

        def run(call):
            method([call.x.flat, byte], [call.out.flat, byte])
            return DONE
        return run

    def run(call):
        method([call.x.flat, *sent], [call.out.flat, *received])
        return DONE
    return run


def _prepared_gather(method, args, MPI):
    sent, received, root = args[0][1:], args[1] and args[1][1:], args[2]

    def run(call):
        out = call.out
        method([call.x.flat, *sent], None if out is None else [out.flat, *received], root)
        return DONE
    return run


def _prepared_scatter(method, args, MPI):
    sent, received, root = args[0] and args[0][1:], args[1][1:], args[2]

    def run(call):
        method(None if sent is None else [call.x.flat, *sent], [call.out.flat, *received],
               root)
        return DONE
    return run


_PREPARE = {"barrier": _prepared_barrier, "broadcast": _prepared_broadcast,
            "allreduce": _prepared_allreduce, "reduce": _prepared_reduce,
            "reduce_scatter": _prepared_reduce_scatter, "allgather": _prepared_exchange,
            "alltoall": _prepared_exchange, "gather": _prepared_gather,
            "scatter": _prepared_scatter}


# collective -> (call, mpi4py.MPI) -> (the blocking mpi4py method's name, its arguments)
_ARGUMENTS = {"barrier": _barrier, "broadcast": _broadcast, "allreduce": _allreduce,
              "reduce": _reduce, "reduce_scatter": _reduce_scatter, "allgather": _allgather,
              "alltoall": _alltoall, "gather": _gather, "scatter": _scatter}


_MPI: list = []  # mpi4py.MPI, imported by the first call (not by importing the package)


def _mpi():
    if not _MPI:
        from mpi4py import MPI
        _MPI.append(MPI)
    return _MPI[0]


def _even(counts: tuple) -> bool:
    """Whether every rank has as many elements (MPI's block calls then, not the vector ones)."""
    return counts.count(counts[0]) == len(counts)


@functools.lru_cache(maxsize=256)
def _layout(counts: tuple, itemsize: int) -> list:
    """A vector call's byte counts, block after block: mpi4py places the blocks one after the
    other when given counts alone (a list of displacements would be read on every call).
    Cached: a program's few shapes repeat."""
    return [c * itemsize for c in counts]
