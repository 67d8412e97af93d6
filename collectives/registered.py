"""Registered buffers: arrays whose memory lies in an MPI-3 shared window of the node's ranks.

``empty(shape, dtype, comm=comm)`` is collective over ``comm`` (every rank calls it with the
same shape and dtype, in the same order): it allocates one shared window on the node
communicator (``comm.Split_type(COMM_TYPE_SHARED)``) with one segment per rank, and returns
this rank's segment as an array. Every rank maps every segment, so a collective on registered
buffers can read a peer's input and write a peer's output directly (``collectives.onepass``).

*Lifetime.* A window is freed collectively (``MPI_Win_free``), but arrays die at different
times on different ranks. When an array is garbage-collected, ``weakref.finalize`` only
unregisters it locally (so no later call can reach its memory through the registry) and queues
its window; the next ``empty`` on the same communicator, already collective, agrees on the
windows every rank has released and frees those, in allocation order.

*Identity.* Each window has a sequence number, the same on every rank (``empty`` is
collective). ``lookup(arr)`` returns (registration, byte offset) for an array inside a live
registered segment, or None.
"""
from __future__ import annotations

import weakref

import numpy as np

__all__ = ["empty", "is_registered", "lookup", "Registration", "active"]

_LIVE: dict = {}        # seq -> Registration
_NODES: dict = {}       # id(comm) -> (comm, node comm, single node?, next seq, released seqs)
_ACTIVE = [False]


def active() -> bool:
    """True once any registered buffer has been allocated in this process."""
    return _ACTIVE[0]


class Registration:
    """One shared window: every rank's segment as a uint8 array, and the communicator."""

    __slots__ = ("seq", "comm", "node", "single", "win", "segs", "nbytes", "lo", "hi",
                 "__weakref__")

    def __init__(self, seq, comm, node, single, win, segs, nbytes):
        self.seq, self.comm, self.node, self.single = seq, comm, node, single
        self.win, self.segs, self.nbytes = win, segs, nbytes
        mine = segs[node.Get_rank()]
        self.lo = mine.ctypes.data
        self.hi = self.lo + nbytes


def _node(comm):
    from mpi4py import MPI
    entry = _NODES.get(id(comm))
    if entry is None or entry[0] is not comm:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        single = comm.allreduce(node.Get_size(), op=MPI.MIN) == comm.Get_size()
        entry = [comm, node, single, 0, set()]
        _NODES[id(comm)] = entry
    return entry


def _free_released(entry) -> None:
    comm, node = entry[0], entry[1]
    mine = sorted(entry[4])
    everyone = comm.allgather(mine)  # small: a list of ints per rank, only inside empty()
    common = set(mine)
    for other in everyone:
        common &= set(other)
    for seq in sorted(common):
        reg = _LIVE.pop(seq, None)
        entry[4].discard(seq)
        if reg is not None:
            reg.win.Unlock_all()
            reg.win.Free()


def _release(seq, entry) -> None:
    reg = _LIVE.get(seq)
    if reg is not None:
        reg.lo = reg.hi = -1  # unreachable through lookup from now on
    entry[4].add(seq)


def empty(shape, dtype, *, comm=None):
    """A new uninitialised numpy array in a shared window of the node's ranks (collective)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if comm is None else comm
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    entry = _node(comm)
    _free_released(entry)
    node = entry[1]
    # size classes: powers of two from 4 KiB, so every rank's segment is page-aligned
    alloc = max(4096, 1 << max(0, (max(nbytes, 1) - 1).bit_length()))
    win = MPI.Win.Allocate_shared(alloc, 1, comm=node)
    win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch for its life: what Win_sync needs
    segs = []
    for j in range(node.Get_size()):
        buf, _unit = win.Shared_query(j)
        segs.append(np.frombuffer(buf, dtype=np.uint8, count=alloc))
    seq = entry[3]
    entry[3] += 1
    reg = Registration(seq, comm, node, entry[2], win, segs, alloc)
    _LIVE[seq] = reg
    _ACTIVE[0] = True
    # The finalizer sits on an array of its own buffer object: numpy collapses every view's
    # base onto it, so the window is released only when no view of it is left.
    own, _unit = win.Shared_query(node.Get_rank())
    flat = np.frombuffer(own, dtype=dt, count=nbytes // dt.itemsize)
    weakref.finalize(flat, _release, seq, entry)
    return flat.reshape(shape)


def _address(x):
    if isinstance(x, np.ndarray):
        return x.ctypes.data, x.nbytes
    ptr = getattr(x, "data_ptr", None)
    if ptr is not None and getattr(x, "device", None) is not None and x.device.type == "cpu":
        return x.data_ptr(), x.numel() * x.element_size()
    return None


def lookup(x):
    """(Registration, byte offset) of ``x`` inside a live registered segment, or None."""
    if not _ACTIVE[0]:
        return None
    where = _address(x)
    if where is None:
        return None
    addr, n = where
    for reg in _LIVE.values():
        if reg.lo <= addr and addr + n <= reg.hi:
            return reg, addr - reg.lo
    return None


def is_registered(x) -> bool:
    """True if ``x`` lies in a live registered buffer (``empty``) of this process."""
    return lookup(x) is not None
