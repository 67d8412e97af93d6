"""Recursive doubling (the butterfly): allreduce by whole-buffer exchange, and all-gather.

Vocabulary: p' = 2^L virtual ranks (``tree.fold`` maps any p onto them); at *step* k
(k = 0 .. L-1, distance d = 2^k) virtual rank v exchanges with its *partner* v XOR d. Every
message is cut into *segments* of at most ``seg`` elements, sent and received in turn.

Allreduce: at each step partners swap their whole partial and both compute
``lower op upper`` (first the partial of the partner whose bit d is 0), so the two compute the
same bits; after L steps every virtual rank holds the reduction over all ranks, combined as a
balanced tree in ascending rank order, identical everywhere. Received segments land in receive
slots (``tree.slots``); the partial lives in OUT (step 0 reads IN). Walk-through for p = 4:

    step 0: 0 <-> 1, 2 <-> 3     (0 and 1 hold 0+1; 2 and 3 hold 2+3)
    step 1: 0 <-> 2, 1 <-> 3     (all hold (0+1)+(2+3))

Cost: L (alpha + n beta + n gamma): latency-optimal, for short messages. With the fold, a pair
(2i, 2i+1) first reduces on 2i+1, which hands the result back at the end: 2 more messages and
2 n beta.

All-gather: virtual rank v starts with its block(s) in place in OUT; at step k it holds the
blocks of its aligned group of 2^k virtual ranks and swaps them with the partner's group, so
the data held doubles every step. Blocks may be ragged and empty. Walk-through for p = 4,
rank 0: step 0 sends block 0 and receives block 1; step 1 sends blocks 0-1, receives 2-3.
Cost: L alpha + (p' - 1)/p' n beta for n bytes gathered (balanced blocks); with the fold, the
even rank of a pair sends its block to the odd one first and receives everything else last.
"""
from collectives.schedule import IN, OUT, Schedule, offsets, segments
from collectives.tree.fold import Fold, begin_allreduce
from collectives.tree.slots import Slots

__all__ = ["recursive_doubling_allreduce", "recursive_doubling_allgather", "doubling_steps",
           "append_gather", "append_exchange"]


def append_exchange(s: Schedule, peer: int, send_range, recv_range, seg) -> None:
    """Send elements ``send_range`` of OUT to ``peer`` and receive ``recv_range`` of OUT from
    it, segment by segment, alternating (both sides list the same segments)."""
    sends = list(segments(*send_range, seg))
    recvs = list(segments(*recv_range, seg))
    for j in range(max(len(sends), len(recvs))):
        if j < len(sends):
            s.send(peer, (OUT,) + sends[j])
        if j < len(recvs):
            s.recv(peer, (OUT,) + recvs[j])


def doubling_steps(fold: Fold, v: int):
    """Per step (distance doubling): ``(peer virtual rank, held blocks, received blocks)``,
    the blocks as ``(first, stop)`` virtual block indices."""
    steps, d = [], 1
    while d < fold.pp:
        group = v & ~(d - 1)
        steps.append((v ^ d, (group, group + d), (group ^ d, (group ^ d) + d)))
        d <<= 1
    return steps


def append_gather(s: Schedule, fold: Fold, steps, vbounds, seg) -> None:
    """Append the all-gather ``steps`` (see ``doubling_steps``) over virtual blocks
    ``vbounds`` (p' + 1 element offsets) in OUT, the blocks held at step 0 being in place."""
    for peer_v, held, got in steps:
        append_exchange(s, fold.real(peer_v), (vbounds[held[0]], vbounds[held[1]]),
                        (vbounds[got[0]], vbounds[got[1]]), seg)


def recursive_doubling_allreduce(rank: int, size: int, count: int, *, seg=None) -> Schedule:
    """Butterfly allreduce: log2 p steps of whole-buffer exchange (fold for non-powers of 2)."""
    s = Schedule(rank, size, count, name="tree.recursive_doubling_allreduce")
    begun = begin_allreduce(s, count, seg)  # 1. a rank that sits out is done here
    if begun is None:
        return s
    fold, v, pieces = begun
    slots = Slots(s, count, seg)
    partial = IN
    if fold.paired(rank):  # 1. stand for the pair: OUT = IN[rank - 1] op IN[rank]
        for a, b in pieces:
            t = slots.take(b - a)
            s.recv(rank - 1, t)
            s.reduce((OUT, a, b), t, (IN, a, b))
        partial = OUT
    d = 1
    while d < fold.pp:  # 2. the butterfly
        peer = fold.real(v ^ d)
        for a, b in pieces:
            s.send(peer, (partial, a, b))
            t = slots.take(b - a)
            s.recv(peer, t)
            if v & d:
                s.reduce((OUT, a, b), t, (partial, a, b))
            else:
                s.reduce((OUT, a, b), (partial, a, b), t)
        partial = OUT
        d <<= 1
    if fold.paired(rank):  # 3. hand the result back
        for a, b in pieces:
            s.send(rank - 1, (OUT, a, b))
    return s


def recursive_doubling_allgather(rank: int, size: int, counts, *, seg=None) -> Schedule:
    """Recursive-doubling all-gather of ragged blocks: IN has ``counts[rank]`` elements, OUT
    ``sum(counts)``."""
    bounds = offsets(counts)
    total = bounds[-1]
    s = Schedule(rank, size, counts[rank], total, name="tree.recursive_doubling_allgather")
    s.alias = False
    own = (bounds[rank], bounds[rank + 1])
    s.copy((OUT,) + own, (IN, 0, counts[rank]))
    if size == 1:
        return s
    fold = Fold(size)
    v = fold.vrank(rank)
    if v is None:  # 1. sit out: hand the block over, get everything else back
        for a, b in segments(0, counts[rank], seg):
            s.send(rank + 1, (IN, a, b))
        for a, b in (0, own[0]), (own[1], total):
            for piece in segments(a, b, seg):
                s.recv(rank + 1, (OUT,) + piece)
        return s
    if fold.paired(rank):  # 1. take the even partner's block
        for piece in segments(bounds[rank - 1], bounds[rank], seg):
            s.recv(rank - 1, (OUT,) + piece)
    vbounds = [bounds[fold.first(u)] for u in range(fold.pp + 1)]
    append_gather(s, fold, doubling_steps(fold, v), vbounds, seg)  # 2.
    if fold.paired(rank):  # 3. hand the partner everything but its own block
        for a, b in (0, bounds[rank - 1]), (bounds[rank], total):
            for piece in segments(a, b, seg):
                s.send(rank - 1, (OUT,) + piece)
    return s
