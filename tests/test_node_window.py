"""The node window's handshake and the node composite's ring under mpiexec (n = 1..5).

The handshake (``collectives.node.window.Window``: arrive -> work -> depart) is checked step by
step, with one rank held back by barriers on another communicator, so that what the others see
does not depend on timing: a polled ``arrived``/``departed`` returns False and names the late
rank (what the watchdog prints), a waiting one returns once it has come, and every rank ends
the call with the same counters. The composite's ring across nodes (``composite.allreduce``
with the world as the cross communicator) gives the exact sum and ``avg`` sums.
"""
import numpy as np
import pytest

from collectives.node import composite
from collectives.node.window import Info, Window
from collectives.ops import resolve
from tests.mpiutil import assert_all, one_node_only, world


class _Work:
    """What a window writes while a call waits: ``where``, whom it waits for."""

    where = None


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_handshake_polls_names_the_late_rank_and_ends_alike():
    one_node_only()
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    late = size - 1
    win = Window(comm.Dup(), 4096)
    work, bad = _Work(), []
    try:
        for call in range(2):
            src = np.full(4, rank + call, np.int64)
            if rank != late:
                win.arrive(src=src)
            comm.Barrier()
            if rank != late:  # the late rank arrives only after the next barrier
                if win.arrived(work, poll=True):
                    bad.append((call, "arrived before the late rank"))
                elif work.where() != f"rank(s) [{late}] to arrive":
                    bad.append((call, work.where()))
            comm.Barrier()
            if rank == late:
                win.arrive(src=src)
            win.arrived(work)
            shown = win.shown(Info.SRC)
            if win.shown(Info.SEQ) != [call + 1] * size or shown[rank] != src.ctypes.data:
                bad.append((call, "info line", win.shown(Info.SEQ)))
            if rank != late:
                win.depart()
            comm.Barrier()
            if rank != late:
                if win.departed(work, poll=True, what="finish reading"):
                    bad.append((call, "departed before the late rank"))
                elif work.where() != f"rank(s) [{late}] to finish reading":
                    bad.append((call, work.where()))
            comm.Barrier()
            if rank == late:
                win.depart()
            win.departed(work)
            if (win.base, win.calls) != (call + 1, call + 1):
                bad.append((call, "counters", win.base, win.calls))
        everyone = comm.allgather((win.base, win.calls))
        if len(set(everyone)) != 1:
            bad.append(("ranks differ", everyone))
    finally:
        comm.Barrier()
        win.close()
    assert_all(not bad, str(bad[:3]))


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_composite_ring_across_nodes(op):
    """``composite.allreduce`` with every rank a node of one: the ring across all of them,
    run by the executor inside the caller's work; ``avg`` sums (the caller divides)."""
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    here = composite.Node(None, 0, 1, comm)
    x = ((rank + 1) * 3 + np.arange(97) % 5).astype(np.float64)
    got = []
    composite.allreduce(_Work(), here, resolve(op, np.dtype(np.float64)),
                        lambda: x.copy(), got.append)
    want = sum((r + 1) * 3 + np.arange(97) % 5 for r in range(size)).astype(np.float64)
    assert_all(len(got) == 1 and np.array_equal(got[0], want), f"{got[:1]} != {want[:4]}")
