"""Fault: an exception on rank 1 before its first collective, while the others enter one.

The others wait in the toolkit's first call on the communicator (its private Dup, which every
rank must join). ``import collectives`` installed an excepthook that aborts the job (exit 1) at
once, under ``python -m mpi4py`` or plain ``python``; with ``COLLECTIVES_ABORT_ON_EXCEPTION=0``
the watchdog ends it instead (exit 124), naming rank 1 as the rank that never joined.

    mpiexec -n 3 python tests/faults/early_error.py
"""
import numpy as np
from mpi4py import MPI

import collectives as coll

rank = MPI.COMM_WORLD.Get_rank()
if rank == 1:
    raise RuntimeError("rank 1: a bug before the first collective")
coll.allreduce(np.arange(1000, dtype=np.float32))
print(f"rank {rank}: unreachable: the job should have been aborted", flush=True)
