"""Fault: rank 1 is stuck in compute (a loop that never ends) while the others wait in a
collective; ``first`` makes it stuck before its first collective on the communicator.

The watchdog ends the job (exit 124) after ``COLLECTIVES_TIMEOUT``, naming rank 1: asked, it
answers that it has not started the collective (its watchdog thread runs beside the loop), or,
before the first collective, the others name it as the rank that never joined.

    mpiexec -n 3 python tests/faults/stuck.py [first]
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as coll

first = len(sys.argv) > 1 and sys.argv[1] == "first"
rank = MPI.COMM_WORLD.Get_rank()
x = np.arange(1000, dtype=np.float32)
if not first:
    coll.allreduce(x)
if rank == 1:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # compute that takes far longer than the timeout
        sum(range(10_000))
coll.allreduce(x)
print(f"rank {rank}: unreachable: the job should have been aborted", flush=True)
