"""Fault: rank 2 skips one collective (a branch taken on one rank only).

Ranks 0 and 1 wait in the allreduce for rank 2, which went on to a barrier of its own. The
watchdog (run with COLLECTIVES_TIMEOUT=3) prints what every rank waits for, names rank 2 as
the rank that never joined, and aborts the job (mpiexec exits with 124).

    mpiexec -n 3 python tests/faults/skip.py [algorithm] [blocking|nonblocking]

With ``exchange`` for the algorithm, #1 is an allgather without counts: the ranks wait in its
exchange of row counts, and the watchdog names that. With ``again``, two such allgathers (#1,
#2) settle a plan first, and rank 2 skips #3: the others wait in the plan's exchange, the
first step of the call itself.
"""
import sys

import numpy as np
from mpi4py import MPI

import collectives as coll

algorithm = sys.argv[1] if len(sys.argv) > 1 else "ring"
blocking = (sys.argv[2] if len(sys.argv) > 2 else "blocking") == "blocking"
world = MPI.COMM_WORLD
rank = world.Get_rank()
x = np.arange(1000, dtype=np.float32)
coll.allreduce(x, algorithm="ring" if algorithm in ("exchange", "again") else algorithm)  # #0
if algorithm == "again":                        # #1, #2: every rank, settling a plan
    coll.allgather(x)
    coll.allgather(x)
if rank != 2 and algorithm in ("exchange", "again"):  # #1 (#3): rank 2 skips the exchange
    coll.allgather(x)
elif rank != 2:                                 # #1: rank 2 skips it
    if blocking:
        coll.allreduce(x, algorithm=algorithm)
    else:
        coll.iallreduce(x, algorithm=algorithm).wait()
world.Barrier()
print(f"rank {rank}: unreachable: the job should have been aborted", flush=True)
