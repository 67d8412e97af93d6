"""Fault: an exception in user code on rank 1 while the others enter a collective.

Run as ``mpiexec -n 3 python -m mpi4py tests/faults/user_error.py``: mpi4py's runner aborts the
job on an unhandled exception (exit code 1), so the others do not wait. Run as plain ``python``
the failed rank exits and the others wait in the allreduce until the watchdog ends the job
(exit code 124), naming rank 1.
"""
import numpy as np
from mpi4py import MPI

import collectives as coll

rank = MPI.COMM_WORLD.Get_rank()
x = np.arange(1000, dtype=np.float32)
coll.allreduce(x)
if rank == 1:
    raise RuntimeError("rank 1: a bug in user code")
coll.allreduce(x)
print(f"rank {rank}: unreachable: the job should have been aborted", flush=True)
