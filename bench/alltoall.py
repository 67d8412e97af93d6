"""``python -m bench alltoall``: every all-to-all beside MPI's ``Alltoall`` and gloo.

The size column is each rank's send buffer (nccl-tests): size / n bytes go to every rank;
busbw = algbw x (n-1)/n. Out of place only (the API refuses ``out=x``).
"""
import numpy as np

from bench.cli import main as _main
from bench.collective import Collective, rank_data

__all__ = ["Alltoall", "main"]


class Alltoall(Collective):
    """Rank r's block j (B elements) goes to rank j; every rank gets block r of every rank."""

    name = "alltoall"
    has_op = False
    modes = ("out",)

    def counts(self, count, n):
        block = max(1, count // n)
        return block * n, block * n, block * n

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        return lambda: coll.alltoall(x, out=out, comm=comm, algorithm=algorithm)

    def expected(self, rank, n, x_count, dtype, op, root):
        block = x_count // n
        return np.concatenate([rank_data(r, x_count, dtype, None)[rank * block:(rank + 1) * block]
                               for r in range(n)])

    def gloo(self, dist, tx, tout, mode, op, root):
        return lambda: dist.all_to_all_single(tout, tx)


def main(argv=None) -> int:
    """Run the all-to-all benchmark (options: ``python -m bench alltoall -h``)."""
    return _main(Alltoall(), argv)
