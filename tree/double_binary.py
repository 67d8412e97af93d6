"""Double binary tree allreduce (NCCL's): two complementary pipelined binary trees, each
reducing and broadcasting half of the buffer.

In one binary tree the leaves (half the ranks) only send and receive once per segment while
inner nodes carry three times that: half of the links' capacity is left idle. Two trees in
which every leaf of one is an inner node of the other balance that: every rank is an inner node
of exactly one tree and a leaf of the other, and each tree carries half of the buffer.

Construction. Tree 1 is the in-order binary tree of ``tree.pipelined`` (``btree``) on the ranks
themselves: root 0 (with one child), inner nodes the even ranks, leaves the odd ranks. Tree 2
is a *mirrored* in-order tree, whose leaves are therefore the even ranks: for even p, ``btree``
of p nodes with node v on rank p - 1 - v (NCCL's ``ncclGetDtree``); for odd p, mirroring p
nodes would keep the parity of ranks, so tree 2 mirrors ``btree`` of p + 1 nodes (node v on
rank p - v) and drops its root, the phantom rank p, whose only child becomes the root. (NCCL
shifts tree 1 by one rank for odd p instead, which leaves rank 0 inner in both trees and makes
the order wrap.) Examples:

    p = 2: tree 1  0 -> 1             tree 2  1 -> 0
    p = 3: tree 1  0 -> 2 -> 1        tree 2  1 -> {0, 2}
    p = 4: tree 1  0 -> 2 -> {1, 3}   tree 2  3 -> 1 -> {0, 2}
    p = 5: tree 1  0 -> 4 -> 2 -> {1, 3}          tree 2  1 -> {0, 3}, 3 -> {2, 4}

Walk-through for p = 4: rank 2 receives segment j of half 1 from 1 and 3, reduces
(1 op 2) op 3 and sends it to 0, which reduces 0 op (1 op 2 op 3) and sends the result back
down 0 -> 2 -> {1, 3}; at the same time rank 1 reduces half 2 as (0 op 1) op 2 from 0 and 2
and sends it to 3, whose result goes back down 3 -> 1 -> {0, 2}. In both trees a node combines
``first child op self op second child`` and subtrees are runs of consecutive ranks, so every
element is reduced in ascending rank order (grouped by the tree), once, at the root, and
broadcast: every rank ends with the same bits.

Each half moves as *segments* of at most ``seg`` elements, pipelined as in ``tree.pipelined``.
The schedule lists the reduce of segment j of both trees for every j, then the broadcasts, so
the messages between any two ranks match in one global order (reduce before broadcast, then
segment, then tree) and every wait points at an earlier message: no deadlock. Per segment pair
a rank receives and sends four half-segments: about 2 n beta + n gamma for n bytes, with
2 ceil(log2 p) + m segment steps of latency for m segments per half: the ring's bandwidth at
a tree's latency.
"""
from collectives.schedule import IN, OUT, Schedule, segments, split
from collectives.tree.pipelined import binary_tree, broadcast_segment, btree, reduce_segment
from collectives.tree.slots import Slots

__all__ = ["double_binary_tree_allreduce", "double_binary_trees"]


def double_binary_trees(rank: int, size: int):
    """This rank's ``(parent, first, second)`` in tree 1 and in tree 2 (module doc)."""
    one = binary_tree(rank, size)
    nodes = size + size % 2
    mirror = nodes - 1   # node v of the mirrored tree is rank mirror - v

    def real(v):
        return None if v is None or mirror - v >= size else mirror - v
    parent, first, second = btree(mirror - rank, nodes)
    return one, (real(parent), real(second), real(first))  # mirroring swaps the sides


def double_binary_tree_allreduce(rank: int, size: int, count: int, *, seg=None) -> Schedule:
    """Allreduce over two complementary pipelined binary trees, half of the buffer each."""
    s = Schedule(rank, size, count, name="tree.double_binary_tree_allreduce")
    if size == 1:
        s.copy((OUT, 0, count), (IN, 0, count))
        return s
    trees = double_binary_trees(rank, size)
    halves = split(count, 2)
    pieces = [list(segments(halves[t], halves[t + 1], seg)) for t in (0, 1)]
    slots = Slots(s, halves[1], seg, per_round=4)
    rounds = max(len(pieces[0]), len(pieces[1]))
    for j in range(rounds):
        for t in (0, 1):
            if j < len(pieces[t]):
                reduce_segment(s, trees[t], *pieces[t][j], slots)
    for j in range(rounds):
        for t in (0, 1):
            if j < len(pieces[t]):
                broadcast_segment(s, trees[t], *pieces[t][j])
    return s
