"""``algorithm="native"``: the MPI library's own collectives, blocking or not.

Built-in MPI datatypes and ops are used where the library defines the pair (sum of float32,
bxor of int64, lor of bool, ...); other pairs (float16, bfloat16, sum of bool, ...) run with a
commutative user-defined ``MPI.Op`` over a contiguous datatype of one element, whose kernel is
``collectives.ops``. Data-movement collectives move bytes (``MPI.BYTE``), so every dtype works.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np

from .ops import Op
from .progress import Done, NativeWork

__all__ = ["launch", "bind", "allreduce", "reduce", "broadcast", "reduce_scatter", "allgather",
           "alltoall", "gather", "scatter", "barrier",
           "mpi_type_op"]

_CACHE: dict = {}
_DONE = Done()  # stateless: one serves every blocking call

# (op name, numpy kind) pairs MPI defines on the matching builtin type.
_BUILTIN = {
    "sum": "iufc", "avg": "iufc", "prod": "iufc", "min": "iuf", "max": "iuf",
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
            name = "SUM" if op.name == "avg" else op.name.upper()
            result = (mpitype, getattr(MPI, name))
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
    comm, x, blocking = call.ctx.comm, call.x.flat, call.blocking
    out = None if call.out is None else call.out.flat
    collective = call.collective
    if collective == "allreduce":
        return allreduce(comm, out if call.inplace else x, out, call.op, blocking)
    if collective == "reduce":
        if out is None:  # a non-root rank: nothing received
            out = x
        return reduce(comm, out if call.inplace else x, out, call.op, call.root, blocking)
    if collective == "broadcast":
        return broadcast(comm, out, call.root, blocking)
    if collective == "reduce_scatter":
        return reduce_scatter(comm, x, out, call.counts, call.op, blocking)
    if collective == "allgather":
        return allgather(comm, x, out, call.counts, blocking)
    if collective == "alltoall":
        return alltoall(comm, x, out, call.counts[0], call.counts[1], blocking)
    if collective == "gather":
        return gather(comm, x, out, call.counts, call.root, blocking)
    if collective == "scatter":
        return scatter(comm, x, out, call.counts, call.root, blocking)
    if collective == "barrier":
        return barrier(comm, blocking)
    raise ValueError(f"no native {collective}")


def bind(call):
    """A blocking allreduce of ``call``'s buffers, bound once: a callable that runs it and
    returns None (the API's small-call path repeats it for the same buffers)."""
    mpitype, mpiop = mpi_type_op(call.op)
    x, out = call.x.flat, call.out.flat
    recv = [out, out.shape[0], mpitype]
    return functools.partial(call.ctx.comm.Allreduce,
                             _send(out if call.inplace else x, out, mpitype), recv, mpiop)


def _work(request, blocking, info):
    work = NativeWork(request, info)
    return work.wait() if blocking else work


def _send(x, out, mpitype):
    """The send argument: ``MPI.IN_PLACE`` when x and out are one array."""
    if x is out:
        from mpi4py import MPI
        return MPI.IN_PLACE
    return [x, x.shape[0], mpitype]


def allreduce(comm, x, out, op: Op, blocking: bool):
    mpitype, mpiop = mpi_type_op(op)
    recv = [out, out.shape[0], mpitype]
    if blocking:
        comm.Allreduce(_send(x, out, mpitype), recv, mpiop)
        return _DONE
    return _work(comm.Iallreduce(_send(x, out, mpitype), recv, mpiop), False, "Iallreduce")


def reduce(comm, x, out, op: Op, root: int, blocking: bool):
    """``out`` is only written on ``root`` (pass ``out=x`` there for in place)."""
    mpitype, mpiop = mpi_type_op(op)
    is_root = comm.Get_rank() == root
    send = _send(x, out, mpitype) if is_root else [x, x.shape[0], mpitype]
    recv = [out, out.shape[0], mpitype] if is_root else None
    if blocking:
        comm.Reduce(send, recv, mpiop, root)
        return _DONE
    return _work(comm.Ireduce(send, recv, mpiop, root), False, "Ireduce")


def broadcast(comm, buf, root: int, blocking: bool):
    from mpi4py import MPI
    view = [buf.view(np.uint8), MPI.BYTE]
    if blocking:
        comm.Bcast(view, root)
        return _DONE
    return _work(comm.Ibcast(view, root), False, "Ibcast")


def reduce_scatter(comm, x, out, counts, op: Op, blocking: bool):
    """``MPI_Reduce_scatter_block`` when every rank gets as many elements, else
    ``MPI_Reduce_scatter`` with the counts."""
    mpitype, mpiop = mpi_type_op(op)
    recv = [out, counts[comm.Get_rank()], mpitype]
    if _even(counts):
        # the send buffer without a count: mpi4py 4 reads a count here as one block's, older
        # releases as the whole buffer's; from the buffer alone, both take its length
        send = [x, mpitype]
        if blocking:
            comm.Reduce_scatter_block(send, recv, mpiop)
            return _DONE
        return _work(comm.Ireduce_scatter_block(send, recv, mpiop), False,
                     "Ireduce_scatter_block")
    send = [x, sum(counts), mpitype]
    if blocking:
        comm.Reduce_scatter(send, recv, counts, mpiop)
        return _DONE
    return _work(comm.Ireduce_scatter(send, recv, counts, mpiop), False, "Ireduce_scatter")


def _even(counts: tuple) -> bool:
    """Whether every rank has as many elements (MPI's block calls then, not the vector ones)."""
    return counts.count(counts[0]) == len(counts)


@functools.lru_cache(maxsize=256)
def _layout(counts: tuple, itemsize: int) -> tuple[list, list]:
    """Allgatherv's byte counts and displacements (a program's few shapes repeat: cached, as
    numpy's cumsum on a few counts cost more than the 8-byte call itself)."""
    nbytes = [c * itemsize for c in counts]
    return nbytes, list(itertools.accumulate(nbytes[:-1], initial=0))


def allgather(comm, x, out, counts, blocking: bool):
    """``MPI_Allgather`` when every rank sends as many elements, else ``MPI_Allgatherv``.

    Not Allgatherv for all: MPICH runs it by other algorithms than Allgather, 1.3-2x slower for
    equal counts (docs/performance.md)."""
    from mpi4py import MPI
    send = [x.view(np.uint8), MPI.BYTE]
    if _even(counts):
        recv = [out.view(np.uint8), MPI.BYTE]
        if blocking:
            comm.Allgather(send, recv)
            return _DONE
        return _work(comm.Iallgather(send, recv), False, "Iallgather")
    recv = [out.view(np.uint8), _layout(counts, out.dtype.itemsize), MPI.BYTE]
    if blocking:
        comm.Allgatherv(send, recv)
        return _DONE
    return _work(comm.Iallgatherv(send, recv), False, "Iallgatherv")


def alltoall(comm, x, out, send, recv, blocking: bool):
    """``MPI_Alltoall`` when every block has one size, else ``MPI_Alltoallv`` (bytes)."""
    from mpi4py import MPI
    if _even(send) and _even(recv) and send[0] == recv[0]:
        sbuf, rbuf = [x.view(np.uint8), MPI.BYTE], [out.view(np.uint8), MPI.BYTE]
        if blocking:
            comm.Alltoall(sbuf, rbuf)
            return _DONE
        return _work(comm.Ialltoall(sbuf, rbuf), False, "Ialltoall")
    sbuf = [x.view(np.uint8), _layout(tuple(send), x.dtype.itemsize), MPI.BYTE]
    rbuf = [out.view(np.uint8), _layout(tuple(recv), out.dtype.itemsize), MPI.BYTE]
    if blocking:
        comm.Alltoallv(sbuf, rbuf)
        return _DONE
    return _work(comm.Ialltoallv(sbuf, rbuf), False, "Ialltoallv")


def gather(comm, x, out, counts, root: int, blocking: bool):
    """``MPI_Gatherv`` (bytes); ``out`` is only written on ``root``."""
    from mpi4py import MPI
    send = [x.view(np.uint8), MPI.BYTE]
    recv = None
    if comm.Get_rank() == root:
        recv = [out.view(np.uint8), _layout(tuple(counts), out.dtype.itemsize), MPI.BYTE]
    if blocking:
        comm.Gatherv(send, recv, root)
        return _DONE
    return _work(comm.Igatherv(send, recv, root), False, "Igatherv")


def scatter(comm, x, out, counts, root: int, blocking: bool):
    """``MPI_Scatterv`` (bytes); ``x`` is only read on ``root``."""
    from mpi4py import MPI
    send = None
    if comm.Get_rank() == root:
        send = [x.view(np.uint8), _layout(tuple(counts), x.dtype.itemsize), MPI.BYTE]
    recv = [out.view(np.uint8), MPI.BYTE]
    if blocking:
        comm.Scatterv(send, recv, root)
        return _DONE
    return _work(comm.Iscatterv(send, recv, root), False, "Iscatterv")


def barrier(comm, blocking: bool):
    """``MPI_Barrier`` / ``MPI_Ibarrier``."""
    if blocking:
        comm.Barrier()
        return _DONE
    return _work(comm.Ibarrier(), False, "Ibarrier")
