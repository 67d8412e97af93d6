"""One-pass allreduce on registered buffers (``collectives.registered``) of a single node.

Vocabulary: the buffer of ``count`` elements is cut into ``n`` *slices* (``numpy.array_split``
sizes), slice r owned by rank r; a slice is walked in *chunks* of ``CHUNK`` bytes, small enough
that a chunk's reads and its accumulator stay in cache.

Walk through n = 4: every rank's input x_j and output out_j are segments of shared windows that
every rank maps. Rank 2 takes its slice, and for each chunk c copies x_0[c] into a private
accumulator, adds x_1[c], x_2[c], x_3[c] in that order (so the result is the same bits on every
rank and in every run), then writes the accumulator into out_0[c] .. out_3[c]. Each rank reads
its slice of every input once and writes its slice of every output once: 2N bytes per rank,
the memory-traffic bound of an allreduce. In place (out = x) is safe: rank r only writes slice
r, which no other rank reads, and it has read all of slice c's inputs before writing it.

*Deciding collectively.* Below ``THRESHOLD`` bytes (the same on every rank: an allreduce has
one count) nothing is checked and the ordinary path runs, so small calls pay one dictionary
miss at most. Above it every rank contributes (registered?, window sequence and offset of x
and of out) to one 10-integer ``MPI_Allreduce(MIN)`` of the values and their negatives; the
one-pass path runs only if every rank is registered on this communicator, on one node, with
identical sequence numbers and offsets. Otherwise (mixed, another communicator's buffer, a
released one) every rank takes the ordinary path, with the same results.

*Memory ordering.* Before reading peers' inputs: ``MPI_Win_sync`` on the windows, a barrier of
the node communicator, ``MPI_Win_sync`` again (the MPI-3 shared-memory idiom: the sync orders
this rank's earlier stores before the barrier, the second makes peers' stores visible). The
same fence after the writes, so no rank returns (and reads or reuses its output) before every
slice of it is written. Two barriers per call, none per chunk.
"""
from __future__ import annotations

import numpy as np

from . import registered

__all__ = ["allreduce", "THRESHOLD", "CHUNK"]

THRESHOLD = 1 << 16   # bytes: below this the ordinary path runs without a check
CHUNK = 1 << 17       # bytes per chunk: accumulator and one peer's chunk fit in L2
_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
           "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
_SCRATCH: dict = {}


def _plain(x):
    """``x`` as a numpy array sharing its memory, or None (a device buffer, a dtype numpy has
    no view for): only such arrays can be registered."""
    if isinstance(x, np.ndarray):
        return x
    try:
        if getattr(x, "device", None) is not None and str(x.device) == "cpu":
            return x.numpy()  # CPU torch tensor: a zero-copy view
    except (TypeError, RuntimeError):  # torch.bfloat16 and others numpy cannot view
        pass
    return None


def _nbytes(x) -> int:
    nbytes = getattr(x, "nbytes", None)
    if nbytes is None and hasattr(x, "element_size"):  # torch
        nbytes = x.numel() * x.element_size()
    return int(nbytes or 0)


def _agree(comm, x, out):
    """The two Registrations and offsets if every rank may take the one-pass path, else None."""
    from mpi4py import MPI  # loaded already: a registered buffer exists
    hx = None if x is None else registered.lookup(x)
    ho = None if out is None else registered.lookup(out)
    ok = hx is not None and ho is not None and hx[0].comm is comm and ho[0].comm is comm \
        and hx[0].single and ho[0].single and x.flags["C_CONTIGUOUS"] \
        and out.flags["C_CONTIGUOUS"]
    vals = np.zeros(10, np.int64)
    if ok:
        vals[:5] = (1, hx[0].seq, hx[1], ho[0].seq, ho[1])
    vals[5:] = -vals[:5]
    comm.Allreduce(MPI.IN_PLACE, vals, op=MPI.MIN)
    if vals[0] != 1 or not np.array_equal(vals[:5], -vals[5:]):
        return None
    return hx, ho


def _fence(regs):
    for reg in regs:
        reg.win.Sync()
    regs[0].node.Barrier()
    for reg in regs:
        reg.win.Sync()


def allreduce(x, op: str, out, comm):
    """Run the one-pass allreduce if every rank may; the result, or None for the normal path."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if comm is None else comm
    ufunc = _UFUNCS.get(op)
    if ufunc is None or not isinstance(comm, MPI.Comm) or comm.Get_size() == 1:
        return None
    if out is None:  # a fresh result is an ordinary array: nothing to gain
        return None
    # Every rank passes the same size, so every rank agrees (one small Allreduce) or none does;
    # a rank whose buffers cannot take the path says so in the agreement.
    if _nbytes(x) < THRESHOLD:
        return None
    xa = _plain(x)
    oa = xa if out is x else _plain(out)
    if xa is not None and oa is not None and (oa.shape != xa.shape or oa.dtype != xa.dtype):
        oa = None
    got = _agree(comm, xa, oa)
    if got is None:
        return None
    (rx, offx), (ro, offo) = got
    dt, count, n, r = xa.dtype, xa.size, comm.Get_size(), comm.Get_rank()
    nb = count * dt.itemsize
    ins = [seg[offx:offx + nb].view(dt) for seg in rx.segs]
    outs = [seg[offo:offo + nb].view(dt) for seg in ro.segs]
    base, extra = divmod(count, n)
    lo = r * base + min(r, extra)
    hi = lo + base + (r < extra)
    step = max(1, CHUNK // dt.itemsize)
    acc = _SCRATCH.get(dt)
    if acc is None:
        acc = _SCRATCH[dt] = np.empty(step, dt)
    regs = [rx] if rx is ro else [rx, ro]
    _fence(regs)
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        m = acc[:b - a]
        np.copyto(m, ins[0][a:b])
        for j in range(1, n):
            ufunc(m, ins[j][a:b], out=m)
        for j in range(n):
            outs[j][a:b] = m
    _fence(regs)
    return out
