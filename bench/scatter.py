"""``python -m bench scatter``: every scatter beside MPI's ``Scatterv`` and gloo.

The size column is the root's whole input buffer; each rank gets size / n bytes of it;
busbw = algbw x (n-1)/n.
"""
from bench.cli import main as _main
from bench.collective import Collective, rank_data

__all__ = ["Scatter", "main"]


class Scatter(Collective):
    """Rank r gets block r (B elements) of the root's buffer."""

    name = "scatter"
    has_op = False
    rooted = True
    modes = ("out",)

    def counts(self, count, n):
        block = max(1, count // n)
        return block * n, block, block * n

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        return lambda: coll.scatter(x, root, out=out, comm=comm, algorithm=algorithm)

    def expected(self, rank, n, x_count, dtype, op, root):
        block = x_count // n
        return rank_data(root, x_count, dtype, None)[rank * block:(rank + 1) * block]

    def gloo(self, dist, tx, tout, mode, op, root):
        n = dist.get_world_size()
        rows = list(tx.chunk(n)) if dist.get_rank() == root else None
        return lambda: dist.scatter(tout, rows, src=root)

    def auto_bytes(self, x_count, n):
        return x_count // n


def main(argv=None) -> int:
    """Run the scatter benchmark (options: ``python -m bench scatter -h``)."""
    return _main(Scatter(), argv)
