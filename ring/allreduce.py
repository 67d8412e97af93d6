"""Ring allreduce: ring reduce-scatter then ring all-gather, on balanced blocks.

Each rank sends and receives 2 (p - 1) / p of the buffer, the bandwidth optimum; latency is
2 (p - 1) messages. Partial sums accumulate in OUT at the blocks' own offsets, so no extra copy
is made, in place or not: step 0 of the reduce-scatter sends straight from IN, and every block
of OUT is either reduced on this rank (OUT = IN op received) or received whole in the
all-gather. After the reduce-scatter rank r holds the final block r; the all-gather forwards it.
See ``ring.reduce_scatter`` and ``ring.allgather`` for the steps and the p = 4 walk-through.
"""
from collectives.ring.allgather import append_allgather
from collectives.ring.reduce_scatter import append_reduce_scatter
from collectives.schedule import IN, OUT, Schedule, split

__all__ = ["allreduce"]


def allreduce(rank: int, size: int, count: int, *, seg=None) -> Schedule:
    """Ring allreduce of ``count`` elements."""
    s = Schedule(rank, size, count, name="ring.allreduce")
    if size == 1:
        s.copy((OUT, 0, count), (IN, 0, count))
        return s
    bounds = split(count, size)
    append_reduce_scatter(s, bounds, seg, acc_in_out=True)
    append_allgather(s, bounds, seg, first_from_in=False)
    return s
