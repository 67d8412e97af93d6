"""Ring all-gather with ragged blocks.

Rank r's input is block r (``counts[r]`` elements, possibly 0) of the result. At step s
(0 .. p-2) rank r forwards block (r - s) to r + 1 and receives block (r - s - 1) from r - 1,
straight into its place in OUT; at step 0 the block sent is read from IN, so no copy delays the
first message. Walk-through for p = 4, rank 0: step 0 sends block 0 (from IN), receives block 3;
step 1 sends 3, receives 2; step 2 sends 2, receives 1. Each block moves as segments of at most
``seg`` elements, so a segment is forwarded as soon as it has arrived.
"""
from collectives.schedule import IN, OUT, Schedule, offsets, segments

__all__ = ["allgather", "append_allgather"]


def append_allgather(s: Schedule, bounds, seg, *, first_from_in: bool) -> None:
    """Append the ring all-gather of blocks ``bounds`` in OUT (rank r's own block already there,
    or read from ``IN[0:counts[r]]`` at step 0 when ``first_from_in``)."""
    r, p = s.rank, s.size
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_k, recv_k = (r - step) % p, (r - step - 1) % p
        if step == 0 and first_from_in:
            send_buf, send_at = IN, 0
        else:
            send_buf, send_at = OUT, bounds[send_k]
        sends = list(segments(0, bounds[send_k + 1] - bounds[send_k], seg))
        recvs = list(segments(bounds[recv_k], bounds[recv_k + 1], seg))
        for j in range(max(len(sends), len(recvs))):
            if j < len(sends):
                a, b = sends[j]
                s.send(right, (send_buf, send_at + a, send_at + b))
            if j < len(recvs):
                s.recv(left, (OUT,) + recvs[j])


def allgather(rank: int, size: int, counts, *, seg=None) -> Schedule:
    """Ring all-gather: IN has ``counts[rank]`` elements, OUT ``sum(counts)``."""
    bounds = offsets(counts)
    s = Schedule(rank, size, counts[rank], bounds[-1], name="ring.allgather")
    s.alias = False
    s.copy((OUT, bounds[rank], bounds[rank + 1]), (IN, 0, counts[rank]))
    append_allgather(s, bounds, seg, first_from_in=True)
    return s
