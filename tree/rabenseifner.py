"""Rabenseifner's allreduce: a reduce-scatter by vector halving, then an all-gather by vector
doubling (any p, through the fold of ``tree.fold``).

Vocabulary: p' = 2^L virtual ranks; at reduce-scatter *step* k (distance d = 2^k) virtual rank
v and its *partner* v XOR d hold partials of the same *range* of the buffer (the whole buffer
at step 0); each sends the partner one half of the range and reduces the half it keeps (the
lower half if bit d of v is 0) with the partner's partial of it. Partials therefore always
cover aligned groups of 2^k consecutive virtual ranks, and the partner combines ``lower group
op upper group`` as recursive doubling does: the result, reduced by one rank per range, is
bitwise the one ``recursive_doubling_allreduce`` computes everywhere. After L steps v holds a
range of about n / p' elements reduced over all ranks (range number bit-reverse(v)); the
all-gather retraces the steps backwards (distance p'/2 down to 1), each swap doubling the
range held, so every rank ends with the same bits. The largest halves travel between
neighbours (d = 1), which on a cluster are usually on one node.

Ranges are cut into *segments* of at most ``seg`` elements; received segments land in receive
slots (``tree.slots``); partials live in OUT at their own offsets (step 0 reads IN), so no copy
is made in place or out of place. Walk-through for p = 4 (quarters Q0..Q3):

    reduce-scatter step 0: 0 <-> 1, 2 <-> 3 swap halves    (0 keeps Q0-Q1 of 0+1, 2 of 2+3)
                   step 1: 0 <-> 2, 1 <-> 3 swap quarters  (0 keeps Q0 of 0+1+2+3, 1 keeps Q2)
    all-gather     step 1: 0 <-> 2, 1 <-> 3 swap quarters  (0 holds Q0-Q1)
                   step 0: 0 <-> 1, 2 <-> 3 swap halves    (all hold Q0-Q3)

Cost for n bytes, p = p' = 2^L: 2 L alpha + 2 (p - 1)/p n beta + (p - 1)/p n gamma: the
ring's bandwidth with logarithmic latency. Otherwise the pairs of the fold first reduce on the
odd rank and get the result back at the end: 2 more messages and 2 n beta + n gamma on them.
"""
from collectives.schedule import IN, OUT, Schedule, split
from collectives.tree.fold import Fold, begin_allreduce
from collectives.tree.recursive_doubling import append_gather
from collectives.tree.recursive_halving import append_halving
from collectives.tree.slots import Slots

__all__ = ["rabenseifner_allreduce", "vector_halving_steps"]


def vector_halving_steps(fold: Fold, v: int):
    """Per reduce-scatter step (distance doubling): ``(peer virtual rank, sent ranges, kept
    ranges)`` as ``(first, stop)`` indices of the p' balanced ranges."""
    lo, hi, d, steps = 0, fold.pp, 1, []
    while d < fold.pp:
        mid = (lo + hi) // 2
        if v & d:
            steps.append((v ^ d, (lo, mid), (mid, hi)))
            lo = mid
        else:
            steps.append((v ^ d, (mid, hi), (lo, mid)))
            hi = mid
        d <<= 1
    return steps


def rabenseifner_allreduce(rank: int, size: int, count: int, *, seg=None) -> Schedule:
    """Allreduce as a vector-halving reduce-scatter plus a vector-doubling all-gather."""
    s = Schedule(rank, size, count, name="tree.rabenseifner_allreduce")
    begun = begin_allreduce(s, count, seg)  # 1. a rank that sits out is done here
    if begun is None:
        return s
    fold, v, pieces = begun
    ranges = split(count, fold.pp)
    steps = vector_halving_steps(fold, v)
    kept = steps[0][2]
    paired = fold.paired(rank)
    slots = Slots(s, count if paired else ranges[kept[1]] - ranges[kept[0]], seg)
    first = IN
    if paired:  # 1. stand for the pair: OUT = IN[rank - 1] op IN[rank]
        for a, b in pieces:
            t = slots.take(b - a)
            s.recv(rank - 1, t)
            s.reduce((OUT, a, b), t, (IN, a, b))
        first = OUT
    places = [(first, 0)] + [(OUT, 0)] * fold.steps
    append_halving(s, fold, v, steps, ranges, seg, slots, places)  # 2.
    gather = [(peer_v, keep, give) for peer_v, give, keep in reversed(steps)]
    append_gather(s, fold, gather, ranges, seg)  # 3.
    if paired:  # 4. hand the result back
        for a, b in pieces:
            s.send(rank - 1, (OUT, a, b))
    return s
