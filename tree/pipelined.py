"""Pipelined binary tree: reduce, broadcast, and allreduce as a reduce/broadcast pipeline.

The tree is NCCL's in-order binary tree (``ncclGetBtree``). Number ranks v = 0 .. p-1 (from
the root: v = rank - root mod p). Let b be the lowest set bit of v; v's parent is
(v ^ b) | 2b, or v ^ b when that is >= p; its children are v - b/2 and v + b/2 (the latter
halved towards v while it is >= p). Leaves are the odd v; the root v = 0 has one child, the
largest power of two below p. The subtree of a node is a contiguous run of v, its *first*
child's run below v and its *second* child's run above, so reducing ``first op self op second``
combines every element in the order v = 0, 1, ..., p - 1 (grouped by the tree). Depth:
ceil(log2 p) edges. Walk-through for p = 4: 0 -> 2 -> {1, 3}; reduce: 2 computes
(1 op 2) op 3 and sends it to 0, which computes 0 op (1 op 2 op 3); broadcast: 0 -> 2 -> 1, 3.

Vocabulary: the buffer is cut into *segments* of at most ``seg`` elements; a node receives
segment j from its children, reduces it and sends it up while its children already send
segment j + 1, so with m segments a reduce takes about (depth + m) segment times instead of
depth * m. Received segments land in receive slots (``tree.slots``); partials live in OUT; a
leaf sends straight from IN.

Allreduce reduces to rank 0 and broadcasts back, both pipelined, in one schedule: segment j's
broadcast starts as soon as the root has reduced it, while later segments are still going up
(on every link the up and down messages travel in opposite directions, so neither waits for
the other).

Cost for n bytes in m segments, depth D = ceil(log2 p), a pipeline *stage* being what the
busiest (inner) node does per segment: reduce and broadcast take D + m - 1 stages of 2
messages (2 receives, or 2 sends) of n/m bytes, about 2 (D + m - 1) alpha + 2 n beta
(+ 2 n gamma for the reduce) when m >> D; allreduce takes 2 D + m - 1 stages of 3 receives and
3 sends: about 3 n beta + 2 n gamma, against the ring's 2 n beta, but with O(log p) latency
instead of O(p). ``tree.double_binary`` brings the bandwidth term down to 2 n beta.
"""
from collectives.schedule import IN, OUT, Schedule, segments
from collectives.tree.slots import Slots

__all__ = ["reduce", "broadcast", "allreduce", "btree", "binary_tree", "reduce_segment",
           "broadcast_segment"]


def btree(v: int, size: int):
    """``(parent, first, second)`` of ``v`` in the in-order binary tree of ``size`` nodes
    rooted at 0 (NCCL's ``ncclGetBtree``); None where there is none."""
    bit = 1
    while bit < size and not (bit & v):
        bit <<= 1
    if v == 0:
        return None, None, (bit >> 1 if size > 1 else None)
    parent = (v ^ bit) | (bit << 1)
    if parent >= size:
        parent = v ^ bit
    low = bit >> 1
    first = v - low if low else None
    second = v + low if low else None
    while second is not None and second >= size:
        low >>= 1
        second = v + low if low else None
    return parent, first, second


def binary_tree(rank: int, size: int, *, shift: int = 0):
    """``(parent, first, second)`` of ``rank`` in ``btree`` laid on the ranks from ``shift``:
    node v is rank ``(v + shift) mod size`` (the root is ``shift``). ``first`` is the child
    whose contribution is combined before this rank's own, ``second`` the one after."""
    def real(v):
        return None if v is None else (v + shift) % size
    parent, first, second = btree((rank - shift) % size, size)
    return real(parent), real(first), real(second)


def reduce_segment(s: Schedule, node, a: int, b: int, slots: Slots) -> None:
    """Append one segment ``[a, b)`` of the tree reduce at ``node = (parent, first, second)``:
    OUT = first op IN op second, sent to the parent."""
    parent, first, second = node
    partial = (IN, a, b)
    if first is not None:
        t = slots.take(b - a)
        s.recv(first, t)
        s.reduce((OUT, a, b), t, partial)
        partial = (OUT, a, b)
    if second is not None:
        t = slots.take(b - a)
        s.recv(second, t)
        s.reduce((OUT, a, b), partial, t)
        partial = (OUT, a, b)
    if parent is not None:
        s.send(parent, partial)
    else:
        s.copy((OUT, a, b), partial)  # a lone root (p = 1)


def broadcast_segment(s: Schedule, node, a: int, b: int) -> None:
    """Append one segment ``[a, b)`` of the tree broadcast of OUT at ``node``."""
    parent, first, second = node
    if parent is not None:
        s.recv(parent, (OUT, a, b))
    for child in (second, first):
        if child is not None:
            s.send(child, (OUT, a, b))


def reduce(rank: int, size: int, count: int, root: int = 0, *, seg=None) -> Schedule:
    """Pipelined binary-tree reduce of ``count`` elements to ``root``."""
    s = Schedule(rank, size, count, name="tree.reduce")
    node = binary_tree(rank, size, shift=root)
    slots = Slots(s, count, seg, per_round=2)
    for a, b in segments(0, count, seg):
        reduce_segment(s, node, a, b, slots)
    return s


def broadcast(rank: int, size: int, count: int, root: int = 0, *, seg=None) -> Schedule:
    """Pipelined binary-tree broadcast of ``count`` elements from ``root`` (the buffer is OUT)."""
    s = Schedule(rank, size, count, name="tree.broadcast")
    node = binary_tree(rank, size, shift=root)
    for a, b in segments(0, count, seg):
        broadcast_segment(s, node, a, b)
    return s


def allreduce(rank: int, size: int, count: int, *, seg=None) -> Schedule:
    """Pipelined binary-tree reduce to rank 0 overlapped with the broadcast back."""
    s = Schedule(rank, size, count, name="tree.allreduce")
    node = binary_tree(rank, size)
    slots = Slots(s, count, seg, per_round=2)
    pieces = list(segments(0, count, seg))
    for a, b in pieces:
        reduce_segment(s, node, a, b, slots)
    for a, b in pieces:
        broadcast_segment(s, node, a, b)
    return s
