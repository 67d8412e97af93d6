"""Recursive halving reduce-scatter (ragged blocks, any p).

Vocabulary: the buffer is cut into p *blocks* (block r, ``counts[r]`` elements, ends up reduced
on rank r); ``tree.fold`` maps the p ranks onto p' = 2^L virtual ranks, virtual rank v owning
the contiguous *virtual block* v (the blocks of the real ranks it stands for). At *step* k
(k = 0 .. L-1, distance d = p' / 2^(k+1)) virtual rank v holds partials of an aligned run of
2d virtual blocks; it sends the half that its partner v XOR d keeps and receives the partner's
partial of the half it keeps, reducing it into its own (``lower op upper``: first the partial
of the partner whose bit d is 0, whose group holds the lower ranks). After L steps v holds its
virtual block reduced over all ranks, each element computed by one rank in a fixed order.
Distance halving keeps every range sent a contiguous run of blocks, one message whatever the
ragged counts, and leaves block r on rank r (distance doubling, as ``tree.rabenseifner`` does,
leaves the ranges in bit-reversed order, and the blocks a rank keeps at step 0 would be every
other one: p' / 2 messages). Every message is cut into *segments* of at most ``seg`` elements
landing in receive slots (``tree.slots``).
Walk-through for p = 4 (blocks B0..B3):

    step 0 (d = 2): 0 <-> 2, 1 <-> 3: 0 keeps B0-B1, 2 keeps B2-B3, ... (partials of 2 ranks)
    step 1 (d = 1): 0 <-> 1, 2 <-> 3: 0 keeps B0, 1 keeps B1, ...       (partials of 4 ranks)

Step 0 sends straight from IN; partials live in a scratch area ``acc`` and the last step
reduces straight into OUT. With the fold, the even rank of a pair first sends its whole input
to the odd one, which reduces it into ``acc`` and finally sends the even rank its block.
Cost for n bytes in all: L alpha + (p' - 1)/p' n (beta + gamma), plus with the fold one more
message each way and n (beta + gamma) on the pairs.
"""
from collectives.schedule import IN, OUT, TMP, Schedule, offsets, segments
from collectives.tree.fold import Fold
from collectives.tree.slots import Slots

__all__ = ["recursive_halving_reduce_scatter", "append_halving", "halving_steps"]


def halving_steps(fold: Fold, v: int):
    """Per step (distance halving): ``(peer virtual rank, sent blocks, kept blocks)``, the
    blocks as ``(first, stop)`` virtual block indices."""
    lo, hi, d, steps = 0, fold.pp, fold.pp // 2, []
    while d:
        mid = lo + d
        if v & d:
            steps.append((v - d, (lo, mid), (mid, hi)))
            lo = mid
        else:
            steps.append((v + d, (mid, hi), (lo, mid)))
            hi = mid
        d //= 2
    return steps


def _at(place, a: int, b: int):
    """The region of elements ``[a, b)`` stored at ``place = (buffer, shift)`` (element k at
    ``buffer[k + shift]``)."""
    buf, shift = place
    return (buf, a + shift, b + shift)


def append_halving(s: Schedule, fold: Fold, v: int, steps, vbounds, seg, slots: Slots,
                   places) -> None:
    """Append the reduce-scatter ``steps`` (see ``halving_steps``) of virtual rank ``v`` over
    virtual blocks ``vbounds`` (p' + 1 element offsets).

    ``places[k]`` is where this rank's partials are before step k (``places[L]``: after the
    last step), as ``(buffer, shift)``.
    """
    for k, (peer_v, give, keep) in enumerate(steps):
        peer, src, dst = fold.real(peer_v), places[k], places[k + 1]
        sends = list(segments(vbounds[give[0]], vbounds[give[1]], seg))
        recvs = list(segments(vbounds[keep[0]], vbounds[keep[1]], seg))
        for j in range(max(len(sends), len(recvs))):
            if j < len(sends):
                s.send(peer, _at(src, *sends[j]))
            if j < len(recvs):
                a, b = recvs[j]
                t = slots.take(b - a)
                s.recv(peer, t)
                if peer_v < v:
                    s.reduce(_at(dst, a, b), t, _at(src, a, b))
                else:
                    s.reduce(_at(dst, a, b), _at(src, a, b), t)


def recursive_halving_reduce_scatter(rank: int, size: int, counts, *, seg=None) -> Schedule:
    """Recursive-halving reduce-scatter: IN has ``sum(counts)`` elements, OUT ``counts[rank]``."""
    bounds = offsets(counts)
    total = bounds[-1]
    s = Schedule(rank, size, total, counts[rank], name="tree.recursive_halving_reduce_scatter")
    s.alias = False
    if size == 1:
        s.copy((OUT, 0, total), (IN, 0, total))
        return s
    fold = Fold(size)
    v = fold.vrank(rank)
    if v is None:  # 1. sit out: hand the input over, get the block back
        for a, b in segments(0, total, seg):
            s.send(rank + 1, (IN, a, b))
        for a, b in segments(0, counts[rank], seg):
            s.recv(rank + 1, (OUT, a, b))
        return s
    vbounds = [bounds[fold.first(u)] for u in range(fold.pp + 1)]
    steps = halving_steps(fold, v)
    largest = vbounds[steps[0][2][1]] - vbounds[steps[0][2][0]]
    paired = fold.paired(rank)
    slots = Slots(s, total if paired else largest, seg)
    if paired:  # 1. stand for the pair: acc = IN[rank - 1] op IN[rank], all blocks
        acc = (TMP, s.scratch(total))
        for a, b in segments(0, total, seg):
            t = slots.take(b - a)
            s.recv(rank - 1, t)
            s.reduce(_at(acc, a, b), t, (IN, a, b))
        places = [acc] * (fold.steps + 1)
    else:  # partials of the half kept at step 0 onwards; the last step lands in OUT
        kept = vbounds[steps[0][2][0]]
        acc = (TMP, s.scratch(largest) - kept) if fold.steps > 1 else None
        places = [(IN, 0)] + [acc] * (fold.steps - 1) + [(OUT, -bounds[rank])]
    append_halving(s, fold, v, steps, vbounds, seg, slots, places)  # 2.
    if paired:  # 3. keep this rank's block, hand the partner its own
        s.copy((OUT, 0, counts[rank]), _at(acc, bounds[rank], bounds[rank + 1]))
        for a, b in segments(bounds[rank - 1], bounds[rank], seg):
            s.send(rank - 1, _at(acc, a, b))
    return s
