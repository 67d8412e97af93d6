"""``python -m bench allreduce``: every allreduce algorithm beside MPI's ``Allreduce`` and gloo.

busbw = algbw x 2(n-1)/n; the table also shows the fraction of the memory-bandwidth bound
(2 n N bytes moved at the measured ``numpy.copyto`` bandwidth) that each algorithm reaches.
"""
from bench.cli import main as _main
from bench.collective import Collective, expected_reduce

__all__ = ["Allreduce", "main"]


class Allreduce(Collective):
    """Every rank gets the reduction of every rank's N elements."""

    name = "allreduce"

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        dst = x if mode == "in" else out
        return lambda: coll.allreduce(x, op, out=dst, comm=comm, algorithm=algorithm)

    def expected(self, rank, n, x_count, dtype, op, root):
        return expected_reduce(n, x_count, dtype, op)

    def gloo(self, dist, tx, tout, mode, op, root):
        if mode != "in":
            return None  # torch.distributed's all_reduce is in place only
        return lambda: dist.all_reduce(tx, op=op)


def main(argv=None) -> int:
    """Run the allreduce benchmark (options: ``python -m bench allreduce -h``)."""
    return _main(Allreduce(), argv)
