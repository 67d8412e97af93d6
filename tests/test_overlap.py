"""Schedules in flight side by side under mpiexec (n = 1..5): a wait on one advances the others.

Rank 0 starts B (on one communicator) and then A (on another) and waits on A first; every
other rank finishes B before it even starts A. A ring allreduce of many tiny segments takes
many steps of every rank, so B completes only if rank 0's wait on A also advances B: before
the executor's waits did, this job hung. Without the progress thread (the caller's thread
runs the schedules) and with it, A blocking and non-blocking.
"""
import numpy as np
import pytest

import collectives as coll
from collectives import executor
from tests.mpiutil import assert_all, world

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("thread", [False, True])
@pytest.mark.parametrize("blocking", [False, True])
def test_a_wait_advances_the_schedules_started_before(setting, thread, blocking):
    setting("COLLECTIVES_PROGRESS_THREAD", thread)
    setting("COLLECTIVES_SEGMENT_BYTES", 24)   # 3 int64 a message: hundreds of steps
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    ca, cb = comm.Dup(), comm.Dup()
    n = 301
    xa = np.arange(n, dtype=np.int64) + rank
    xb = np.full(n, rank + 1, np.int64)
    for c in (ca, cb):  # their contexts (a collective Dup each) made before the test proper
        coll.allreduce(np.ones(4, np.int64), comm=c, algorithm="ring")
    try:
        if rank == 0:
            b = coll.iallreduce(xb, comm=cb, algorithm="ring")
            if blocking:
                ga = coll.allreduce(xa, comm=ca, algorithm="ring")
            else:
                ga = coll.iallreduce(xa, comm=ca, algorithm="ring").wait()
            gb = b.wait()
        else:
            gb = coll.iallreduce(xb, comm=cb, algorithm="ring").wait()
            ga = coll.allreduce(xa, comm=ca, algorithm="ring")
        ok = np.array_equal(ga, size * np.arange(n) + size * (size - 1) // 2) and \
            np.array_equal(gb, np.full(n, size * (size + 1) // 2))
    finally:
        ca.Free()
        cb.Free()
    assert_all(ok, "both allreduces")


def test_many_in_flight_waited_in_any_order(setting):
    """Buckets of a DDP-like loop: eight non-blocking allreduces of several algorithms, waited
    last first and first first; results exact, and nothing finished is tracked afterwards."""
    setting("COLLECTIVES_PROGRESS_THREAD", False)
    setting("COLLECTIVES_SEGMENT_BYTES", 64)
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    ok = True
    for order in (reversed, list):
        xs = [np.full(50 + 37 * k, rank + k, np.int64) for k in range(8)]
        reqs = [coll.iallreduce(x, out=x, algorithm=("ring", "tree", "recursive_doubling")[k % 3])
                for k, x in enumerate(xs)]
        for k in order(range(8)):
            got = reqs[k].wait()
            ok &= bool(np.array_equal(got, np.full(50 + 37 * k, size * (size - 1) // 2
                                                   + size * k)))
    left = [ref() for ref in executor._IN_FLIGHT]
    ok &= all(r is None or r.done for r in left)
    assert_all(ok, "eight allreduces in flight")
