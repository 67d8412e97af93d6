"""``python -m bench gather``: every gather beside MPI's ``Gatherv`` and gloo.

The size column is the root's whole output buffer; each rank contributes size / n bytes;
busbw = algbw x (n-1)/n. Only the root's result is checked (the other ranks get none).
"""
import numpy as np

from bench.cli import main as _main
from bench.collective import Collective, rank_data

__all__ = ["Gather", "main"]


class Gather(Collective):
    """The root gets every rank's B elements, concatenated in rank order."""

    name = "gather"
    has_op = False
    rooted = True
    modes = ("out",)

    def counts(self, count, n):
        block = max(1, count // n)
        return block, block * n, block * n

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        return lambda: coll.gather(x, root, out=out, comm=comm, algorithm=algorithm)

    def expected(self, rank, n, x_count, dtype, op, root):
        if rank != root:
            return None
        return np.concatenate([rank_data(r, x_count, dtype, None) for r in range(n)])

    def gloo(self, dist, tx, tout, mode, op, root):
        n = dist.get_world_size()
        rows = list(tout.chunk(n)) if dist.get_rank() == root else None
        return lambda: dist.gather(tx, rows, dst=root)


def main(argv=None) -> int:
    """Run the gather benchmark (options: ``python -m bench gather -h``)."""
    return _main(Gather(), argv)
