"""Fault: one rank passes different arguments; run with COLLECTIVES_CHECK=1.

Every rank must raise ``MismatchError`` with the same message naming the ranks and the fields
that differ. The script catches it, prints ``rank R: MismatchError: ...`` on stdout, checks that
its buffers are untouched, runs one correct allreduce to show the job goes on, and exits 0.

    COLLECTIVES_CHECK=1 mpiexec -n 3 python tests/faults/mismatch.py KIND

KIND: elements, dtype, op, root, collective, counts, algorithm, out (rank 1's out has the wrong
shape: its own check fails, the others hear of it), ddp (rank 0 passes 10 elements, the
others 20: the example of the issue).
"""
import sys

import numpy as np
from mpi4py import MPI

import collectives as coll

kind = sys.argv[1]
world = MPI.COMM_WORLD
rank = world.Get_rank()
odd = rank == 1            # the rank that does something different
n = 12
x = np.arange(n, dtype=np.float32) + rank
out = np.full(n, -7, np.float32)
x0 = x.copy()

try:
    if kind == "elements":
        x = np.arange(n + (2 if odd else 0), dtype=np.float32)
        x0 = x.copy()
        out = np.full(x.shape, -7, np.float32)
        coll.allreduce(x, out=out)
    elif kind == "ddp":
        x = np.ones(10 if rank == 0 else 20, np.float32)
        x0 = x.copy()
        out = np.full(x.shape, -7, np.float32)
        coll.allreduce(x, out=out)
    elif kind == "dtype":
        x = x.astype(np.float64 if odd else np.float32)
        x0 = x.copy()
        out = np.full(x.shape, -7, x.dtype)
        coll.allreduce(x, out=out)
    elif kind == "op":
        coll.allreduce(x, "max" if odd else "sum", out=out)
    elif kind == "root":
        coll.reduce(x, root=1 if odd else 0, out=out)
    elif kind == "collective":
        if odd:
            coll.broadcast(out)
        else:
            coll.allreduce(x, out=out)
    elif kind == "counts":
        counts = [4, 4, 4] if not odd else [2, 5, 5]
        out = np.full(counts[rank], -7, np.float32)
        coll.reduce_scatter(x, counts=counts, out=out)
    elif kind == "algorithm":
        coll.allreduce(x, out=out, algorithm="native" if odd else "ring")
    elif kind == "out":
        out = np.full(n + (1 if odd else 0), -7, np.float32)
        coll.allreduce(x, out=out)
    else:
        raise SystemExit(f"unknown kind {kind}")
except coll.MismatchError as exc:
    intact = np.array_equal(x, x0) and (out == -7).all()
    print(f"rank {rank}: MismatchError: {exc} | buffers intact: {intact}", flush=True)
else:
    print(f"rank {rank}: no error", flush=True)

# The ranks still agree on the sequence of collectives: a correct call works.
y = coll.allreduce(np.full(5, rank, np.int64))
print(f"rank {rank}: after: {int(y[0])}", flush=True)
