"""Node-aware two-level all-to-all: one message per pair of nodes crosses the node boundary.

Vocabulary: rank r sends *block* (r, q) of ``matrix[r][q]`` elements to every rank q. For two
nodes A and B, the *courier* of A for B is the member of A at index ``index(B) mod |A|``: it
collects every block that A's ranks send to B's, in one *pack*, and hands out the pack that comes
back. Couriers spread the node pairs over a node's ranks, so no rank carries them all.

1. Inside each node, ranks exchange their blocks for each other directly (pairwise).
2. Gather: every rank of A sends its blocks for B's ranks to A's courier for B, which lays them
   out in the pack destination-major (B's ranks in order, each with A's blocks for it in order).
3. Exchange: A's courier for B and B's courier for A trade packs: one message (as segments of at
   most ``seg`` elements) each way per node pair.
4. Scatter: the courier cuts the pack from B by destination (each cut is contiguous, by step 2's
   layout on B's side) and sends each rank of A its blocks from B, straight into its output.

Walk-through for 4 ranks as 2 nodes x 2 (A = (0, 1), B = (2, 3)): A's courier for B is rank 1
(index 1 mod 2), B's courier for A is rank 2. Ranks 0 and 1 swap their blocks for each other;
rank 0 sends blocks (0, 2) and (0, 3) to rank 1, which packs (0, 2), (1, 2), (0, 3), (1, 3)
and trades the pack with rank 2 for B's pack (2, 0), (3, 0), (2, 1), (3, 1); rank 1 sends
(2, 0), (3, 0) to rank 0 and keeps (2, 1), (3, 1). Across the node boundary each rank sends
one message per remote node it is courier for, about (N - 1) / k for N nodes of k ranks,
against a flat pairwise's (N - 1) k: 1/k^2 of the messages, each k^2 times larger, and every
byte still crosses once.

Every rank must know every block's size (the whole ``matrix``): the API exchanges it. Messages
between two ranks are listed in one canonical order (step, then remote node, then rank) on both
sides, so they match.
"""
from __future__ import annotations

from collectives.schedule import IN, OUT, TMP, Schedule, offsets, segments

__all__ = ["hierarchical_alltoall", "couriers"]


def couriers(nodes) -> dict:
    """``{(A, B): rank}``: node index A's courier for node index B (A != B)."""
    return {(a, b): nodes[a][b % len(nodes[a])]
            for a in range(len(nodes)) for b in range(len(nodes)) if a != b}


def _runs(ranks):
    """Sorted ``ranks`` as maximal runs of consecutive ranks: ``[(first, end), ...]``."""
    runs = []
    for q in ranks:
        if runs and runs[-1][1] == q:
            runs[-1][1] = q + 1
        else:
            runs.append([q, q + 1])
    return [tuple(r) for r in runs]


def _move(s, peer, regions, seg, sending):
    for buf, a, b in regions:
        for x, y in segments(a, b, seg):
            (s.send if sending else s.recv)(peer, (buf, x, y))


def hierarchical_alltoall(rank: int, size: int, send, recv, *, seg=None, matrix=None,
                          nodes=None, numas=None) -> Schedule:
    """Two-level all-to-all over ``nodes`` (tuples of ranks; None: one node). ``matrix[i][j]``:
    elements rank i sends to rank j; ``send``/``recv`` are this rank's row and column."""
    if matrix is None:
        raise ValueError("the hierarchical all-to-all needs every rank's counts (the API "
                         "exchanges them unless recv_counts is given)")
    nodes = tuple(tuple(sorted(g)) for g in (nodes or (tuple(range(size)),)))
    node_of = {q: i for i, g in enumerate(nodes) for q in g}
    me = node_of[rank]
    home = nodes[me]
    sb, rb = offsets(send), offsets(recv)
    s = Schedule(rank, size, sb[-1], rb[-1], name="hierarchical_alltoall")
    s.alias = False
    s.copy((OUT, rb[rank], rb[rank + 1]), (IN, sb[rank], sb[rank + 1]))
    # 1. inside the node, pairwise
    k, j = len(home), home.index(rank)
    for step in range(1, k):
        to, frm = home[(j + step) % k], home[(j - step) % k]
        _move(s, to, [(IN, sb[to], sb[to + 1])], seg, True)
        _move(s, frm, [(OUT, rb[frm], rb[frm + 1])], seg, False)
    courier = couriers(nodes)
    remote = [b for b in range(len(nodes)) if b != me]
    mine = [b for b in remote if courier[(me, b)] == rank]   # node pairs this rank carries
    # 2. gather: what every rank of this node sends to node b, at its courier, in pack order
    packs, backs = {}, {}
    for b in mine:
        far = nodes[b]
        packs[b] = s.scratch(sum(matrix[a][q] for a in home for q in far))
        backs[b] = s.scratch(sum(matrix[q][a] for a in home for q in far))
    staged = {}
    for b in remote:
        far, c = nodes[b], courier[(me, b)]
        runs = [(IN, sb[f], sb[e]) for f, e in _runs(far)]
        if c != rank:
            _move(s, c, runs, seg, True)
        else:
            for a in home:
                if a == rank:
                    continue
                n = sum(matrix[a][q] for q in far)
                base = s.scratch(n)
                staged[(a, b)] = base
                at, regions = base, []
                for f, e in _runs(far):
                    m = sum(matrix[a][q] for q in range(f, e))
                    regions.append((TMP, at, at + m))
                    at += m
                _move(s, a, regions, seg, False)
    for b in mine:
        far = nodes[b]
        at = packs[b]
        for q in far:                      # destination-major
            for a in home:
                m = matrix[a][q]
                if a == rank:
                    src = (IN, sb[q], sb[q + 1])
                else:
                    base = staged[(a, b)] + sum(matrix[a][x] for x in far if x < q)
                    src = (TMP, base, base + m)
                s.copy((TMP, at, at + m), src)
                at += m
    # 3. exchange packs between couriers
    for b in mine:
        peer = courier[(b, me)]
        n_out = sum(matrix[a][q] for a in home for q in nodes[b])
        n_in = sum(matrix[q][a] for a in home for q in nodes[b])
        _move(s, peer, [(TMP, packs[b], packs[b] + n_out)], seg, True)
        _move(s, peer, [(TMP, backs[b], backs[b] + n_in)], seg, False)
    # 4. scatter the pack from node b: rank a's blocks from b are contiguous (a-major there)
    for b in remote:
        far, c = nodes[b], courier[(me, b)]
        if c == rank:
            at = backs[b]
            for a in home:
                n = sum(matrix[q][a] for q in far)
                if a == rank:
                    pos = at
                    for f, e in _runs(far):
                        m = rb[e] - rb[f]
                        s.copy((OUT, rb[f], rb[e]), (TMP, pos, pos + m))
                        pos += m
                else:
                    regions, pos = [], at
                    for f, e in _runs(far):
                        m = sum(matrix[q][a] for q in range(f, e))
                        regions.append((TMP, pos, pos + m))
                        pos += m
                    _move(s, a, regions, seg, True)
                at += n
        else:
            _move(s, c, [(OUT, rb[f], rb[e]) for f, e in _runs(far)], seg, False)
    return s
