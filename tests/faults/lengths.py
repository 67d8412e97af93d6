"""Fault: the DDP hang of other libraries: rank 0 passes 10 elements, the others 20.

    mpiexec -n 3 python -m mpi4py tests/faults/lengths.py [algorithm] [elements]

With COLLECTIVES_CHECK=1 every rank raises ``MismatchError`` before a byte moves. With checking
off, the free size guard (a receive of the wrong size raises ``MessageSizeError``; one too long
for its buffer is a truncation MPI reports, also raised as ``MessageSizeError``) ends the job
under ``python -m mpi4py``; a rank left waiting is ended by the watchdog.
``elements`` (default 10) scales the lengths: rank 0 passes it, the others twice as many.
"""
import sys

import numpy as np
from mpi4py import MPI

import collectives as coll

algorithm = sys.argv[1] if len(sys.argv) > 1 else "auto"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
rank = MPI.COMM_WORLD.Get_rank()
x = np.ones(n if rank == 0 else 2 * n, np.float32)
y = coll.allreduce(x, algorithm=algorithm)
print(f"rank {rank}: completed: {y[:3]} ... {y[-3:]}", flush=True)
