"""Registered buffers: arrays whose memory lies in an MPI-3 shared window of the node's ranks.

``empty(shape, dtype, comm=comm)`` is collective over ``comm`` (every rank calls it, in the same
order; shapes may differ between ranks): it returns this rank's segment of a shared window on
the node communicator (``topology.node_comm``, which honours simulated nodes) as an array.
Every rank maps every segment of its node, so a collective on registered buffers can read a
peer's input and write a peer's output directly (``collectives.node.onepass``).

*Size classes and reuse.* A rank's segment is its request rounded up to a power of two (4 KiB
at least, so every segment is page-aligned). Windows are pooled: an array that dies gives its
window back, and a later ``empty`` whose requests fit every rank's segment of a pooled window
takes that window instead of allocating (``MPI_Win_allocate_shared`` is a collective that maps
and faults fresh pages; a training loop that allocates buffers of the same sizes every step
allocates windows only once). At most ``POOL`` windows wait in the pool per communicator; the
oldest beyond it are freed.

*Lifetime.* A window is given back collectively, but arrays die at different times on
different ranks. When an array is garbage-collected, ``weakref.finalize`` unregisters it
locally at once (so no later call reaches its memory through ``lookup``) and queues its
window; the next ``empty`` on the communicator, already collective, learns which windows every
rank has released (one small ``MPI_Allgather`` with every rank's request) and pools or frees
those.
A window is never freed while any rank still holds an array in it.

*Identity.* Windows are numbered per communicator, the same numbers on every rank (``empty`` is
collective). ``lookup(arr)`` returns (registration, byte offset) for an array inside a live
registered segment, or None; ``live(comm, seq)`` the registration a peer named.
"""
from __future__ import annotations

import weakref

import numpy as np

__all__ = ["empty", "is_registered", "lookup", "live", "single_node", "on", "Registration",
           "POOL"]

POOL = 4              # windows kept for reuse per communicator
SETTLE = 14           # released windows a rank reports per ``empty`` (later calls take the rest)
_PAGE = 4096
_NODES = weakref.WeakSet()  # every _Node of this process, for ``lookup``


def on(comm) -> bool:
    """Whether ``empty`` has been called on ``comm``: the same on every rank of it at any
    collective call, since ``empty`` is collective over ``comm`` too. Asking ``single_node``
    makes the communicator's entry but registers nothing: that alone is not "on" (else every
    large call there would agree on buffers that cannot be registered)."""
    from ..executor import cached_context
    ctx = cached_context(comm)
    entry = None if ctx is None else ctx.slots.get(_Node)
    return entry is not None and entry.next > 0


class Registration:
    """One shared window: every rank's segment as a uint8 array, and the communicator.

    ``lo``/``hi``: the address range of this rank's segment while an array lives in it,
    (-1, -1) otherwise (``lookup`` then never finds it)."""

    __slots__ = ("seq", "comm", "node", "win", "segs", "lo", "hi")

    def __init__(self, seq, comm, node, win, segs):
        self.seq, self.comm, self.node = seq, comm, node
        self.win, self.segs = win, segs
        self.lo = self.hi = -1

    def attach(self) -> None:
        mine = self.segs[self.node.Get_rank()]
        self.lo = mine.ctypes.data
        self.hi = self.lo + mine.nbytes

    def free(self) -> None:
        self.lo = self.hi = -1
        self.segs = []
        self.win.Unlock_all()
        self.win.Free()


class _Node:
    """What one communicator's registrations share: its node communicator and windows (a slot
    of the communicator's ``Context``; an array's finalizer keeps it while the array lives)."""

    def __init__(self, ctx):
        from ..topology import node_comm, topology
        self.comm = ctx.user_comm
        self.private = ctx.comm  # the toolkit's own messages: never the caller's communicator
        # The topology's nodes, simulated ones included, so that every layer that asks
        # "one node?" (dispatch, DDP, ZeRO) hears the same answer.
        self.node = node_comm(self.comm)
        self.single = topology(self.comm).single_node
        self.next = 0
        self.live: dict = {}       # seq -> Registration with an array in it on this rank
        self.released: set = set()  # seqs whose array died here, not yet agreed on
        self.pool: dict = {}       # seq -> Registration released everywhere, free to reuse

    def close(self) -> None:
        """Free every window, in the order they were made (the same on every rank: each was
        made collectively), when the context goes: at the latest at exit, before MPI is
        finalized. An array still in one must not be touched afterwards."""
        from mpi4py import MPI
        if MPI.Is_finalized():
            return
        every = {**self.live, **self.pool}
        self.live, self.pool = {}, {}
        for seq in sorted(every):
            every[seq].free()


def _node(comm) -> _Node:
    from ..executor import context
    ctx = context(comm)
    entry = ctx.slots.get(_Node)
    if entry is None:
        entry = ctx.slot(_Node)
        _NODES.add(entry)
    return entry


def _release(seq: int, entry: _Node) -> None:
    reg = entry.live.get(seq)
    if reg is not None:
        reg.lo = reg.hi = -1  # unreachable through lookup from now on
    entry.released.add(seq)


def _settle(entry: _Node, nbytes: int) -> list[int]:
    """Pool the windows every rank has released; every rank's request (collective: one
    ``MPI_Allgather`` of ``2 + SETTLE`` integers a rank, the oldest released windows first)."""
    mine = np.full(2 + SETTLE, -1, np.int64)
    released = sorted(entry.released)[:SETTLE]
    mine[0], mine[1:1 + len(released)] = nbytes, released
    said = np.empty((entry.private.Get_size(), mine.size), np.int64)
    entry.private.Allgather(mine, said)
    common = set(said[0, 1:].tolist()).intersection(*(set(row[1:].tolist()) for row in said))
    common.discard(-1)
    for seq in sorted(common):
        entry.released.discard(seq)
        reg = entry.live.pop(seq, None)
        if reg is not None:
            entry.pool[seq] = reg
    return [int(need) for need in said[:, 0]]


def _reuse(entry: _Node, needs: list[int]):
    """The smallest pooled window whose every rank's segment fits its request, or None; the
    same on every rank (the pool and the requests are)."""
    fits = [reg for reg in entry.pool.values()
            if all(seg.nbytes >= need for seg, need in zip(reg.segs, needs))]
    if not fits:
        return None
    best = min(fits, key=lambda reg: (sum(seg.nbytes for seg in reg.segs), reg.seq))
    return entry.pool.pop(best.seq)


def _allocate(entry: _Node, nbytes: int) -> Registration:
    from mpi4py import MPI
    while len(entry.pool) >= POOL:  # the oldest pooled windows make room
        entry.pool.pop(min(entry.pool)).free()
    size = max(_PAGE, 1 << max(0, (max(nbytes, 1) - 1).bit_length()))
    win = MPI.Win.Allocate_shared(size, 1, comm=entry.node)
    win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch for its life: what Win_sync needs
    segs = []
    for j in range(entry.node.Get_size()):
        buf, _unit = win.Shared_query(j)
        segs.append(np.frombuffer(buf, dtype=np.uint8))
    seq = entry.next
    entry.next += 1
    return Registration(seq, entry.comm, entry.node, win, segs)


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
    needs = _settle(entry, nbytes)
    reg = _reuse(entry, needs) or _allocate(entry, nbytes)
    reg.attach()
    entry.live[reg.seq] = reg
    # The finalizer sits on an array of its own buffer object: numpy collapses every view's
    # base onto it, so the window is released only when no view of it is left.
    own, _unit = reg.win.Shared_query(entry.node.Get_rank())
    holder = np.frombuffer(own, dtype=dt, count=nbytes // dt.itemsize)
    weakref.finalize(holder, _release, reg.seq, entry)
    return holder.reshape(shape)


def _address(x):
    if isinstance(x, np.ndarray):
        return x.ctypes.data, x.nbytes
    ptr = getattr(x, "data_ptr", None)
    if ptr is not None and getattr(x, "device", None) is not None and x.device.type == "cpu":
        return x.data_ptr(), x.numel() * x.element_size()
    return None


def lookup(x):
    """(Registration, byte offset) of ``x`` inside a live registered segment, or None."""
    if not _NODES:
        return None
    where = _address(x)
    if where is None:
        return None
    addr, n = where
    for entry in _NODES:
        for reg in entry.live.values():
            if reg.lo <= addr and addr + n <= reg.hi:
                return reg, addr - reg.lo
    return None


def single_node(comm) -> bool:
    """Whether every rank of ``comm`` shares one node (collective on first use per comm)."""
    return _node(comm).single


def live(comm, seq: int) -> Registration:
    """The registration ``seq`` of ``comm`` (one every rank agreed is live)."""
    return _node(comm).live[seq]


def is_registered(x) -> bool:
    """True if ``x`` lies in a live registered buffer (``empty``) of this process."""
    return lookup(x) is not None
