"""Binomial trees: reduce to a root, broadcast from a root, and allreduce as the two in turn.

Vocabulary: ranks are renumbered from the root, v = (rank - root) mod p. In the binomial tree
the parent of v is v with its lowest set bit cleared, and the children of v are v + 2^k for
every 2^k below v's lowest set bit (every 2^k < p for the root) with v + 2^k < p. Child v + 2^k
roots the subtree of virtual ranks [v + 2^k, v + 2^(k+1)), so the tree has ceil(log2 p) levels
and the root has that many children. A *step* k is the exchange across distance 2^k.

Reduce: v receives from its children in increasing distance, reducing each into its partial
(``OUT = partial op child``, the lower virtual ranks' contribution first, so every element is
reduced in the fixed order of virtual ranks 0, 1, ..., p - 1 grouped by the tree), then sends
the partial to its parent. Broadcast runs the tree the other way, the farthest child first.
Walk-through for p = 4, root 0:

    reduce    step 0: 1 -> 0, 3 -> 2      (0 holds 0+1, 2 holds 2+3)
              step 1: 2 -> 0              (0 holds (0+1)+(2+3))
    broadcast step 1: 0 -> 2
              step 0: 0 -> 1, 2 -> 3

Each buffer moves as segments of at most ``seg`` elements, so a rank forwards segment j while
it still receives segment j + 1. Leaves send straight from IN; partials live in OUT (every rank
has a ``count``-element OUT for reduce: scratch on non-roots); received segments land in
receive slots (``tree.slots``). Cost for n bytes, L = ceil(log2 p): reduce
L alpha + L n beta + L n gamma, broadcast L alpha + L n beta, allreduce 2 L alpha +
2 L n beta + L n gamma. The root's link carries every one of its L subtrees' data, segmented
or not, so binomial trees are for short messages, where L messages of latency is the least any
tree can do; the pipelined binary tree takes the long ones.
"""
from collectives.schedule import IN, OUT, Schedule, segments
from collectives.tree.slots import Slots

__all__ = ["binomial_reduce", "binomial_broadcast", "binomial_allreduce",
           "append_binomial_reduce", "append_binomial_broadcast", "binomial_neighbours"]


def binomial_neighbours(rank: int, size: int, root: int = 0):
    """``(parent, children)`` of ``rank`` in the binomial tree rooted at ``root``; parent None
    at the root, children in increasing distance (smallest subtree first)."""
    v = (rank - root) % size
    parent, children, mask = None, [], 1
    while mask < size:
        if v & mask:
            parent = (v - mask + root) % size
            break
        if v + mask < size:
            children.append((v + mask + root) % size)
        mask <<= 1
    return parent, children


def append_binomial_reduce(s: Schedule, count: int, root: int, seg) -> None:
    """Append the binomial reduce of ``IN[0:count]`` into ``OUT`` on ``root``."""
    parent, children = binomial_neighbours(s.rank, s.size, root)
    slots = Slots(s, count, seg, per_round=min(2, len(children)))
    for a, b in segments(0, count, seg):
        partial = (IN, a, b)
        for child in children:
            t = slots.take(b - a)
            s.recv(child, t)
            s.reduce((OUT, a, b), partial, t)
            partial = (OUT, a, b)
        if parent is not None:
            s.send(parent, partial)
        else:
            s.copy((OUT, a, b), partial)  # a lone root (p = 1)


def append_binomial_broadcast(s: Schedule, count: int, root: int, seg) -> None:
    """Append the binomial broadcast of ``OUT[0:count]`` from ``root``."""
    parent, children = binomial_neighbours(s.rank, s.size, root)
    for a, b in segments(0, count, seg):
        if parent is not None:
            s.recv(parent, (OUT, a, b))
        for child in reversed(children):
            s.send(child, (OUT, a, b))


def binomial_reduce(rank: int, size: int, count: int, root: int = 0, *, seg=None) -> Schedule:
    """Binomial-tree reduce of ``count`` elements to ``root``."""
    s = Schedule(rank, size, count, name="tree.binomial_reduce")
    append_binomial_reduce(s, count, root, seg)
    return s


def binomial_broadcast(rank: int, size: int, count: int, root: int = 0, *,
                       seg=None) -> Schedule:
    """Binomial-tree broadcast of ``count`` elements from ``root`` (the buffer is OUT)."""
    s = Schedule(rank, size, count, name="tree.binomial_broadcast")
    append_binomial_broadcast(s, count, root, seg)
    return s


def binomial_allreduce(rank: int, size: int, count: int, *, seg=None) -> Schedule:
    """Binomial reduce to rank 0, then binomial broadcast from rank 0."""
    s = Schedule(rank, size, count, name="tree.binomial_allreduce")
    append_binomial_reduce(s, count, 0, seg)
    append_binomial_broadcast(s, count, 0, seg)
    return s
