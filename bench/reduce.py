"""``python -m bench reduce``: every reduce beside MPI's ``Reduce`` and gloo.

busbw = algbw. Only the root's result is checked (the other ranks get none).
"""
from bench.cli import main as _main
from bench.collective import Collective, expected_reduce

__all__ = ["Reduce", "main"]


class Reduce(Collective):
    """The root gets the reduction of every rank's N elements."""

    name = "reduce"
    rooted = True

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        dst = x if mode == "in" else out
        return lambda: coll.reduce(x, op, root, out=dst, comm=comm, algorithm=algorithm)

    def expected(self, rank, n, x_count, dtype, op, root):
        return expected_reduce(n, x_count, dtype, op) if rank == root else None

    def gloo(self, dist, tx, tout, mode, op, root):
        if mode != "in":
            return None  # torch.distributed's reduce is in place only
        return lambda: dist.reduce(tx, dst=root, op=op)


def main(argv=None) -> int:
    """Run the reduce benchmark (options: ``python -m bench reduce -h``)."""
    return _main(Reduce(), argv)
