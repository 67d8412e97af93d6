"""``python -m bench allgather``: every all-gather beside MPI's ``Allgather`` and gloo.

The size column is the whole output buffer (nccl-tests); each rank contributes size / n bytes;
busbw = algbw x (n-1)/n. Out of place only (the API refuses ``out=x``).
"""
import numpy as np

from bench.cli import main as _main
from bench.collective import Collective, rank_data

__all__ = ["Allgather", "main"]


class Allgather(Collective):
    """Every rank gets every rank's B elements, concatenated in rank order."""

    name = "allgather"
    has_op = False
    modes = ("out",)

    def counts(self, count, n):
        block = max(1, count // n)
        return block, block * n, block * n

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        return lambda: coll.allgather(x, out=out, comm=comm, algorithm=algorithm)

    def expected(self, rank, n, x_count, dtype, op, root):
        return np.concatenate([rank_data(r, x_count, dtype, op) for r in range(n)])

    def gloo(self, dist, tx, tout, mode, op, root):
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: fn(tout, tx)


def main(argv=None) -> int:
    """Run the all-gather benchmark (options: ``python -m bench allgather -h``)."""
    return _main(Allgather(), argv)
