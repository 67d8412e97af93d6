"""Pairwise-exchange all-to-all, with ragged blocks.

Vocabulary: rank r's input IN holds ``size`` *blocks*, block j (``send[j]`` elements) for rank
j; its output OUT holds block i (``recv[i]`` elements) from every rank i, in rank order. A
*step* pairs every rank with one partner to send to and another to receive from.

Rank r keeps its own block (a local copy), then at step s = 1 .. p-1 sends block r+s to rank
r+s and receives block r-s from rank r-s (mod p), so every pair of ranks exchanges exactly one
message each way, p-1 steps in all, and no rank is the target of two senders in one step.
Walk-through for p = 4, rank 0: step 1 sends block 1 to rank 1 and receives rank 3's block for
it; step 2 exchanges with rank 2 both ways; step 3 sends to rank 3 and receives from rank 1.
Blocks longer than ``seg`` elements move as several segments. The executor posts the steps in
this order as fast as the network takes them; nothing waits for a whole step to finish.
"""
from collectives.schedule import IN, OUT, Schedule, offsets, segments

__all__ = ["pairwise_alltoall"]


def pairwise_alltoall(rank: int, size: int, send, recv, *, seg=None,
                      matrix=None) -> Schedule:
    """Pairwise all-to-all: IN has ``sum(send)`` elements (block j for rank j), OUT
    ``sum(recv)`` (block i from rank i). ``matrix`` (every rank's ``send``) is not needed."""
    sb, rb = offsets(send), offsets(recv)
    s = Schedule(rank, size, sb[-1], rb[-1], name="ring.pairwise_alltoall")
    s.alias = False
    s.copy((OUT, rb[rank], rb[rank + 1]), (IN, sb[rank], sb[rank + 1]))
    for step in range(1, size):
        to, frm = (rank + step) % size, (rank - step) % size
        sends = list(segments(sb[to], sb[to + 1], seg))
        recvs = list(segments(rb[frm], rb[frm + 1], seg))
        for j in range(max(len(sends), len(recvs))):
            if j < len(sends):
                s.send(to, (IN,) + sends[j])
            if j < len(recvs):
                s.recv(frm, (OUT,) + recvs[j])
    return s
