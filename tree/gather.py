"""Binomial-tree gather and scatter, with ragged blocks.

Vocabulary: rank i's *block* has ``counts[i]`` elements; the root's buffer holds every block in
rank order. Ranks are renumbered *relative* to the root, v = (r - root) mod p, so the root is 0.
A rank's *subtree* is the relative ranks v .. v + 2^k - 1 (those below p), where 2^k is the
lowest set bit of v (the root's subtree is everyone): its blocks are contiguous in relative
order.

Gather: at round k = 0, 1, ... a rank whose bit k is set sends everything it holds (its
subtree's blocks) to v - 2^k and is done; otherwise it receives the subtree of v + 2^k (if
that rank exists). Scatter is the same tree walked the other way: a rank receives its subtree
from its parent, then hands each child its subtree, the largest first. Walk-through for
p = 4, root 0: gather round 0 has 1 -> 0 and 3 -> 2, round 1 has 2 -> 0 carrying blocks 2 and
3; scatter sends 0 -> 2 (blocks 2, 3), then 0 -> 1 and 2 -> 3. ceil(log2 p) rounds; the root
moves every byte once.

Non-root ranks keep their subtree in TMP in relative order; the root reads and writes its
buffer in place. A relative range wraps past rank p - 1 in absolute order at most once, so a
subtree is at most two pieces of the root's buffer; both ends of a message cut it at the same
place (and into the same segments), so the pieces match.
"""
from collectives.schedule import IN, OUT, TMP, Schedule, offsets, segments

__all__ = ["binomial_gather", "binomial_scatter"]


def _tree(rank: int, size: int, root: int):
    """``(v, parent, children)``: relative rank, the parent's absolute rank (None at the root)
    and the children as ``(absolute rank, first relative, end relative)``, smallest first."""
    v = (rank - root) % size
    children, k = [], 1
    while k < size and not v & k:
        if v + k < size:
            children.append(((v + k + root) % size, v + k, min(v + 2 * k, size)))
        k *= 2
    parent = None if v == 0 else (v - (v & -v) + root) % size
    return v, parent, children


def _pieces(first: int, end: int, size: int, root: int):
    """Relative ``[first, end)`` cut where the absolute rank order wraps past p - 1."""
    wrap = size - root
    if first < wrap < end:
        return [(first, wrap), (wrap, end)]
    return [(first, end)]


class _Layout:
    """Where relative blocks are: in the root's buffer (absolute order) or a subtree's TMP."""

    def __init__(self, size, root, counts):
        self.size, self.root = size, root
        self.absolute = offsets(counts)
        self.relative = offsets([counts[(root + v) % size] for v in range(size)])

    def in_root(self, buf, a, b):
        """Relative blocks ``[a, b)`` (one piece) in the root's buffer ``buf``."""
        at = self.absolute[(self.root + a) % self.size]
        return (buf, at, at + self.relative[b] - self.relative[a])

    def in_subtree(self, base, v, a, b):
        """Relative blocks ``[a, b)`` in the TMP of relative rank ``v`` (at ``base``)."""
        lo = base + self.relative[a] - self.relative[v]
        return (TMP, lo, lo + self.relative[b] - self.relative[a])

    def span(self, a, b):
        return self.relative[b] - self.relative[a]


def _move(s, peer, region, seg, sending):
    for a, z in segments(region[1], region[2], seg):
        (s.send if sending else s.recv)(peer, (region[0], a, z))


def binomial_gather(rank: int, size: int, counts, root: int, *, seg=None) -> Schedule:
    """Gather: IN has ``counts[rank]`` elements; the root's OUT ``sum(counts)``, others' 0."""
    lay = _Layout(size, root, counts)
    v, parent, children = _tree(rank, size, root)
    mine = counts[rank]
    s = Schedule(rank, size, mine, lay.absolute[-1] if v == 0 else 0,
                 name="tree.binomial_gather")
    s.alias = False
    end = children[-1][2] if children else v + 1
    if v == 0:
        s.copy((OUT, lay.absolute[rank], lay.absolute[rank + 1]), (IN, 0, mine))
        for child, a, b in children:
            for pa, pb in _pieces(a, b, size, root):
                _move(s, child, lay.in_root(OUT, pa, pb), seg, False)
        return s
    base = s.scratch(lay.span(v, end))
    s.copy(lay.in_subtree(base, v, v, v + 1), (IN, 0, mine))
    for child, a, b in children:
        for pa, pb in _pieces(a, b, size, root):
            _move(s, child, lay.in_subtree(base, v, pa, pb), seg, False)
    for pa, pb in _pieces(v, end, size, root):
        _move(s, parent, lay.in_subtree(base, v, pa, pb), seg, True)
    return s


def binomial_scatter(rank: int, size: int, counts, root: int, *, seg=None) -> Schedule:
    """Scatter: the root's IN has ``sum(counts)`` elements, others' 0; OUT ``counts[rank]``."""
    lay = _Layout(size, root, counts)
    v, parent, children = _tree(rank, size, root)
    mine = counts[rank]
    s = Schedule(rank, size, lay.absolute[-1] if v == 0 else 0, mine,
                 name="tree.binomial_scatter")
    s.alias = False
    end = children[-1][2] if children else v + 1
    if v == 0:
        for child, a, b in reversed(children):
            for pa, pb in _pieces(a, b, size, root):
                _move(s, child, lay.in_root(IN, pa, pb), seg, True)
        s.copy((OUT, 0, mine), (IN, lay.absolute[rank], lay.absolute[rank + 1]))
        return s
    base = s.scratch(lay.span(v, end))
    for pa, pb in _pieces(v, end, size, root):
        _move(s, parent, lay.in_subtree(base, v, pa, pb), seg, False)
    for child, a, b in reversed(children):
        for pa, pb in _pieces(a, b, size, root):
            _move(s, child, lay.in_subtree(base, v, pa, pb), seg, True)
    s.copy((OUT, 0, mine), lay.in_subtree(base, v, v, v + 1))
    return s
