"""Fault: rank 1 dies (SIGKILL) in the middle of a collective.

Rank 1 starts a non-blocking allreduce of a large array (the others are in the same blocking
allreduce, waiting for its messages) and kills itself. ``mpiexec`` sees a process die and ends
the job (non-zero exit status) without waiting for the watchdog.
"""
import os
import signal

import numpy as np
from mpi4py import MPI

import collectives as coll

rank = MPI.COMM_WORLD.Get_rank()
x = np.ones(1 << 20, dtype=np.float32)
coll.allreduce(x[:10])
if rank == 1:
    coll.iallreduce(x, algorithm="ring")
    os.kill(os.getpid(), signal.SIGKILL)
coll.allreduce(x, algorithm="ring")
print(f"rank {rank}: unreachable: the job should have ended", flush=True)
