"""``python -m bench broadcast``: every broadcast beside MPI's ``Bcast`` and gloo.

busbw = algbw. The API broadcasts in place, so only the in-place columns exist.
"""
from bench.cli import main as _main
from bench.collective import Collective, rank_data

__all__ = ["Broadcast", "main"]


class Broadcast(Collective):
    """Every rank's buffer gets the root's N elements."""

    name = "broadcast"
    has_op = False
    rooted = True
    modes = ("in",)

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        return lambda: coll.broadcast(x, root, comm=comm, algorithm=algorithm)

    def expected(self, rank, n, x_count, dtype, op, root):
        return rank_data(root, x_count, dtype, op)

    def gloo(self, dist, tx, tout, mode, op, root):
        return lambda: dist.broadcast(tx, src=root)


def main(argv=None) -> int:
    """Run the broadcast benchmark (options: ``python -m bench broadcast -h``)."""
    return _main(Broadcast(), argv)
