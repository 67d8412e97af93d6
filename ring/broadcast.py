"""Pipelined ring broadcast.

Ranks are ordered along the ring starting at the root (virtual rank v = rank - root mod p). The
root sends the buffer to v = 1 as segments of at most ``seg`` elements; every other rank
receives each segment into place and forwards it to v + 1 at once (the last rank only
receives). With m segments the time is (p - 2 + m) segment times instead of (p - 1) m: for long
buffers each rank's link carries the data once, whatever p. Walk-through for p = 4, root 0,
3 segments: 0 sends s0, s1, s2 to 1; 1 forwards each to 2 as it lands; 2 forwards to 3.

The buffer is both input and output: the schedule only touches OUT.
"""
from collectives.schedule import OUT, Schedule, segments

__all__ = ["broadcast"]


def broadcast(rank: int, size: int, count: int, root: int = 0, *, seg=None) -> Schedule:
    """Pipelined ring broadcast of ``count`` elements from ``root``."""
    s = Schedule(rank, size, count, name="ring.broadcast")
    v = (rank - root) % size
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    for a, b in segments(0, count, seg):
        if v > 0:
            s.recv(prev, (OUT, a, b))
        if v < size - 1:
            s.send(nxt, (OUT, a, b))
    return s
