"""``python -m bench reduce_scatter``: every reduce-scatter beside MPI's ``Reduce_scatter_block``.

The size column is the whole input buffer (nccl-tests); rank r gets block r of size / n bytes;
busbw = algbw x (n-1)/n. Out of place only (the API refuses ``out=x``).
"""
import numpy as np

from bench.cli import main as _main
from bench.collective import Collective, expected_reduce

__all__ = ["ReduceScatter", "main"]


class ReduceScatter(Collective):
    """Reduce n x B elements over all ranks; rank r keeps block r."""

    name = "reduce_scatter"
    modes = ("out",)

    def counts(self, count, n):
        block = max(1, count // n)
        return block * n, block, block * n

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        return lambda: coll.reduce_scatter(x, op, out=out, comm=comm, algorithm=algorithm)

    def expected(self, rank, n, x_count, dtype, op, root):
        block = x_count // n
        return np.ascontiguousarray(
            expected_reduce(n, x_count, dtype, op)[rank * block:(rank + 1) * block])

    def gloo(self, dist, tx, tout, mode, op, root):
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: fn(tout, tx, op=op)


def main(argv=None) -> int:
    """Run the reduce-scatter benchmark (options: ``python -m bench reduce_scatter -h``)."""
    return _main(ReduceScatter(), argv)
