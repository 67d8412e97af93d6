"""Hierarchical collectives: ring stages on rank groups, node- and NUMA-aware.

Vocabulary. A *level* is a partition of the ranks into groups: NUMA domains, then nodes, then
the world (levels equal to the one below are dropped, so a job without NUMA information has two:
nodes and world). An element's *owner* in a group is the one rank of the group that holds the
group's partial result for it. A *job* is a ring stage (reduce-scatter or all-gather) among a
few *members* (ranks, in ring order) over a list of element intervals, each member's *block*
being the intervals it owns afterwards (reduce-scatter) or before (all-gather). Ring stages move
their blocks as segments of at most ``seg`` elements through ``SLOTS`` scratch slots per job.

Allreduce, walk-through for 4 ranks as 2 nodes x 2 (nodes (0, 1), (2, 3)), N elements:

1. node level: reduce-scatter inside each node: rank 0 owns [0, N/2) of node 0's sum, rank 1
   [N/2, N); ranks 2 and 3 likewise for node 1;
2. world level: the owners of an element on every node (one per node: ranks 0 and 2 for
   [0, N/2), ranks 1 and 3 for [N/2, N)) reduce-scatter it: rank 0 owns [0, N/4) of the total,
   rank 2 [N/4, N/2), ...; both jobs run at once (Horovod's and han's "cross" allreduce);
3. world level all-gather among the same members, then node level all-gather inside each node.

Each rank sends 2 (P - 1) / P * N / k bytes across the node boundary (P nodes of k ranks), where
a flat ring sends up to 2 (n - 1) / n * N from one rank: at most 1/k of it.

Uneven levels (the fallback rule). When the groups of a level differ in size (5 ranks as 3 + 2),
their owners' intervals do not line up across nodes. The rule, applied at every level: cut the
buffer at the union of all owners' interval boundaries; each piece has exactly one owner per
subgroup, and the pieces with the same owners form one job, whose intervals are split among its
members in shares weighted 1/d for a member in d jobs (so that loads even out). With 3 + 2,
node 0 owns thirds and node 1 halves, so the world level has four two-member jobs ([0, N/3) for
ranks 0 and 3, [N/3, N/2) for 1 and 3, [N/2, 2N/3) for 1 and 4, [2N/3, N) for 2 and 4): every
element still crosses the node boundary once each way, no rank idles (the largest share is
2N/9 against the ideal N/5), and with even groups the rule reduces to steps 1-3 above.

Reduce-scatter, allgather and reduce use the same machinery with *targets*: an element's owner
in a group that holds its target rank (the rank that receives its block; the root for reduce) is
that rank, so that the top level leaves each element on its target with no extra hop; elements
of other groups' targets are shared out in balanced shares as above. Allgather is the reverse of
reduce-scatter: all-gather jobs from the top level down. Reduce (a reduce-scatter whose every
element targets the root) becomes a chain of pipelined segments within each group. Broadcast is a
pipelined ring broadcast among the entry ranks of the top-level groups (the root for its own
group, the lowest rank for the others), then inside every group from its entry, level by level;
segments flow through all levels at once.

Every builder takes ``nodes`` and ``numas`` (tuples of rank groups, as
``collectives.topology.Topology.kwargs()`` gives them): the API passes the communicator's
topology (``select.TOPOLOGY``), and in-process tests pass simulated ones directly.
"""
from __future__ import annotations

import functools
import math
from bisect import bisect_right

from collectives.schedule import IN, OUT, TMP, Schedule, offsets, segments, split

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "plan", "levels",
           "SLOTS"]

SLOTS = 4


# -- levels and ownership -----------------------------------------------------------------
def levels(size: int, nodes=None, numas=None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The partitions of ``range(size)`` the algorithms walk up: NUMA, nodes, world.

    A level equal to the one below it (singletons at the bottom) is dropped.
    """
    world = (tuple(range(size)),)
    nodes = world if nodes is None else tuple(tuple(g) for g in nodes)
    numas = nodes if numas is None else tuple(tuple(g) for g in numas)
    _check_partition(size, nodes, "nodes")
    _check_partition(size, numas, "numas")
    node_of = {r: i for i, g in enumerate(nodes) for r in g}
    for g in numas:
        if len({node_of[r] for r in g}) != 1:
            raise ValueError(f"NUMA group {g} spans several nodes")
    out = []
    prev = tuple((r,) for r in range(size))
    for level in (numas, nodes, world):
        canon = tuple(sorted(tuple(sorted(g)) for g in level))
        if canon != prev:
            out.append(canon)
            prev = canon
    return tuple(out)


def _check_partition(size, groups, name):
    seen = sorted(r for g in groups for r in g)
    if seen != list(range(size)):
        raise ValueError(f"{name} {groups} is not a partition of ranks 0..{size - 1}")


def _share(intervals, weights) -> list[list[tuple[int, int]]]:
    """Cut a list of intervals (in order) into shares proportional to integer ``weights``."""
    total = sum(b - a for a, b in intervals)
    parts = len(weights)
    if len(set(weights)) == 1:
        cuts = split(total, parts)
    else:
        acc = [0]
        for w in weights:
            acc.append(acc[-1] + w)
        cuts = [total * c // acc[-1] for c in acc]
    shares: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
    pos = 0  # elements before the current interval
    k = 0
    for a, b in intervals:
        x = a
        while x < b:
            while cuts[k + 1] <= pos + (x - a):
                k += 1
            take = min(b, a + cuts[k + 1] - pos)
            shares[k].append((x, take))
            x = take
        pos += b - a
    return shares


class Job(tuple):
    """One ring stage: ``(members, blocks)``; ``blocks[i]`` are member i's intervals."""

    __slots__ = ()
    members = property(lambda self: self[0])
    blocks = property(lambda self: self[1])


@functools.lru_cache(maxsize=256)
def plan(size: int, count: int, levels_, targets=None) -> tuple[tuple[Job, ...], ...]:
    """The jobs of every level, for every rank at once.

    ``targets``: None (allreduce: balanced owners) or the ``size + 1`` offsets of the target
    blocks (reduce-scatter, allgather; reduce passes the root's block as the whole buffer).
    """
    # cover[g]: the owners of every element in group g of the level below: (start, stop, owner)
    cover = {(r,): [(0, count, r)] if count else [] for r in range(size)}
    tb = sorted(set(targets)) if targets is not None else []
    out = []
    for level in levels_:
        jobs_here = []
        new_cover = {}
        for group in level:
            subs = [g for g in cover if g[0] in group and set(g) <= set(group)]
            subs.sort()
            if len(subs) == 1:
                new_cover[group] = cover[subs[0]]
                continue
            members_of = set(group)
            bounds = sorted({0, count} | {x for g in subs for a, b, _ in cover[g] for x in (a, b)}
                            | {x for x in tb if 0 < x < count})
            # Owners of each elementary piece, one per subgroup, in subgroup order.
            starts = [[a for a, _, _ in cover[g]] for g in subs]
            pieces: dict[tuple[int, ...], list[tuple[int, int]]] = {}
            for x, y in zip(bounds, bounds[1:]):
                if y <= x:
                    continue
                members = tuple(cover[g][bisect_right(starts[i], x) - 1][2]
                                for i, g in enumerate(subs))
                pieces.setdefault(members, []).append((x, y))
            # A member in d jobs takes a 1/d-weighted share of each, so loads even out.
            degree: dict[int, int] = {}
            for members in pieces:
                for m in members:
                    degree[m] = degree.get(m, 0) + 1
            lcm = math.lcm(*degree.values())
            owned: list[tuple[int, int, int]] = []
            for members, intervals in pieces.items():
                weights = [lcm // degree[m] for m in members]
                blocks: list[list[tuple[int, int]]] = [[] for _ in members]
                if targets is None:
                    blocks = _share(intervals, weights)
                else:
                    outside = []
                    for a, b in intervals:
                        t = bisect_right(targets, a) - 1  # skips empty target blocks
                        if t in members_of:
                            assert t in members, (t, members)
                            blocks[members.index(t)].append((a, b))
                        else:
                            outside.append((a, b))
                    for i, share in enumerate(_share(outside, weights)):
                        blocks[i].extend(share)
                        blocks[i].sort()
                jobs_here.append(Job((members, tuple(tuple(b) for b in blocks))))
                owned += [(a, b, m) for m, blk in zip(members, blocks) for a, b in blk]
            owned.sort()
            new_cover[group] = owned
        cover = new_cover
        out.append(tuple(jobs_here))
    return tuple(out)


# -- ring stages on a job ---------------------------------------------------------------------
def _slot_size(job: Job, seg) -> int:
    longest = max((b - a for blk in job.blocks for a, b in blk), default=1)
    return max(1, min(longest, seg) if seg else longest)


def _pieces(block, seg):
    for a, b in block:
        yield from segments(a, b, seg)


def _ring_reduce_scatter(s: Schedule, job: Job, seg, slots: int, slot: int, src, acc) -> None:
    """Append member ``s.rank``'s part of a ring reduce-scatter of ``job``.

    ``src(a, b)``/``acc(a, b)``: the region holding this rank's contribution / partial sum of
    elements [a, b). At step k a member sends its partial of block (i - k - 1) to the right and
    reduces block (i - k - 2) from the left into its own partial; after q - 1 steps it holds
    the group's sum of its own block i (see ``ring.reduce_scatter``).
    """
    members, blocks = job
    q = len(members)
    i = members.index(s.rank)
    right, left = members[(i + 1) % q], members[(i - 1) % q]
    piece = 0
    for step in range(q - 1):
        send_k, recv_k = (i - step - 1) % q, (i - step - 2) % q
        sends = list(_pieces(blocks[send_k], seg))
        recvs = list(_pieces(blocks[recv_k], seg))
        for j in range(max(len(sends), len(recvs))):
            if j < len(sends):
                a, b = sends[j]
                s.send(right, src(a, b) if step == 0 else acc(a, b))
            if j < len(recvs):
                a, b = recvs[j]
                t = slots + (piece % SLOTS) * slot
                piece += 1
                s.recv(left, (TMP, t, t + b - a))
                s.reduce(acc(a, b), src(a, b), (TMP, t, t + b - a))


def _ring_allgather(s: Schedule, job: Job, seg, have, put) -> None:
    """Append member ``s.rank``'s part of a ring all-gather of ``job``.

    ``have(a, b)``: where this rank reads elements it holds; ``put(a, b)``: where it receives.
    At step k a member forwards block (i - k) to the right and receives block (i - k - 1).
    """
    members, blocks = job
    q = len(members)
    i = members.index(s.rank)
    right, left = members[(i + 1) % q], members[(i - 1) % q]
    for step in range(q - 1):
        send_k, recv_k = (i - step) % q, (i - step - 1) % q
        sends = list(_pieces(blocks[send_k], seg))
        recvs = list(_pieces(blocks[recv_k], seg))
        for j in range(max(len(sends), len(recvs))):
            if j < len(sends):
                s.send(right, have(*sends[j]))
            if j < len(recvs):
                s.recv(left, put(*recvs[j]))


def _my_jobs(jobs, rank):
    return [j for j in jobs if rank in j.members]


def _reserve_slots(s: Schedule, per_level, seg) -> list[list[tuple[int, int]]]:
    """TMP slots for every job of this rank: separate per job of a level, shared by levels."""
    base = s.tmp
    layout, need = [], 0
    for jobs in per_level:
        at, here = base, []
        for job in jobs:
            slot = _slot_size(job, seg)
            here.append((at, slot))
            at += SLOTS * slot
        layout.append(here)
        need = max(need, at - base)
    s.scratch(need)
    return layout


def _reduce_phase(s: Schedule, per_level, layout, seg, src, acc) -> None:
    fresh = True  # this rank's contribution is still its input
    for jobs, slots in zip(per_level, layout):
        for job, (at, slot) in zip(jobs, slots):
            _ring_reduce_scatter(s, job, seg, at, slot, src if fresh else acc, acc)
        if jobs:
            fresh = False


def _gather_phase(s: Schedule, per_level, seg, have, put) -> None:
    for jobs in reversed(per_level):
        for job in jobs:
            _ring_allgather(s, job, seg, have, put)


# -- the collectives ---------------------------------------------------------------------------
def allreduce(rank: int, size: int, count: int, *, seg=None, nodes=None, numas=None) -> Schedule:
    """Hierarchical allreduce: reduce-scatter up the levels, all-gather down."""
    s = Schedule(rank, size, count, name="hierarchical.allreduce")
    if size == 1:
        s.copy((OUT, 0, count), (IN, 0, count))
        return s
    lv = levels(size, nodes, numas)
    per_level = [_my_jobs(jobs, rank) for jobs in plan(size, count, lv)]
    layout = _reserve_slots(s, per_level, seg)
    _reduce_phase(s, per_level, layout, seg, lambda a, b: (IN, a, b), lambda a, b: (OUT, a, b))
    _gather_phase(s, per_level, seg, lambda a, b: (OUT, a, b), lambda a, b: (OUT, a, b))
    return s


def reduce_scatter(rank: int, size: int, counts, *, seg=None, nodes=None,
                   numas=None) -> Schedule:
    """Hierarchical reduce-scatter: rank r ends with block r (``counts[r]`` elements)."""
    bounds = offsets(counts)
    total, lo, hi = bounds[-1], bounds[rank], bounds[rank + 1]
    s = Schedule(rank, size, total, counts[rank], name="hierarchical.reduce_scatter")
    s.alias = False
    if size == 1:
        s.copy((OUT, 0, total), (IN, 0, total))
        return s
    lv = levels(size, nodes, numas)
    per_level = [_my_jobs(jobs, rank) for jobs in plan(size, total, lv, tuple(bounds))]
    # Partials of this rank's own block accumulate in OUT, the others in TMP[0:total-counts[r]].
    s.scratch(total - (hi - lo))
    layout = _reserve_slots(s, per_level, seg)

    def acc(a, b):
        if lo <= a and b <= hi:
            return OUT, a - lo, b - lo
        assert b <= lo or a >= hi, (a, b, lo, hi)  # target boundaries are cut points
        return (TMP, a, b) if b <= lo else (TMP, a - (hi - lo), b - (hi - lo))

    _reduce_phase(s, per_level, layout, seg, lambda a, b: (IN, a, b), acc)
    return s


def allgather(rank: int, size: int, counts, *, seg=None, nodes=None, numas=None) -> Schedule:
    """Hierarchical all-gather: every rank's block, concatenated in rank order."""
    bounds = offsets(counts)
    lo, hi = bounds[rank], bounds[rank + 1]
    s = Schedule(rank, size, counts[rank], bounds[-1], name="hierarchical.allgather")
    s.alias = False
    s.copy((OUT, lo, hi), (IN, 0, hi - lo))
    if size == 1:
        return s
    lv = levels(size, nodes, numas)
    per_level = [_my_jobs(jobs, rank) for jobs in plan(size, bounds[-1], lv, tuple(bounds))]

    def have(a, b):  # this rank's own block is read from IN, so no copy delays it
        return (IN, a - lo, b - lo) if lo <= a and b <= hi else (OUT, a, b)

    _gather_phase(s, per_level, seg, have, lambda a, b: (OUT, a, b))
    return s


def reduce(rank: int, size: int, count: int, root: int = 0, *, seg=None, nodes=None,
           numas=None) -> Schedule:
    """Hierarchical reduce onto ``root``: a reduce-scatter whose one block is the root's."""
    s = Schedule(rank, size, count, name="hierarchical.reduce")
    if size == 1:
        s.copy((OUT, 0, count), (IN, 0, count))
        return s
    lv = levels(size, nodes, numas)
    targets = tuple([0] * (root + 1) + [count] * (size - root))
    per_level = [_my_jobs(jobs, rank) for jobs in plan(size, count, lv, targets)]
    layout = _reserve_slots(s, per_level, seg)
    _reduce_phase(s, per_level, layout, seg, lambda a, b: (IN, a, b), lambda a, b: (OUT, a, b))
    return s


def broadcast(rank: int, size: int, count: int, root: int = 0, *, seg=None, nodes=None,
              numas=None) -> Schedule:
    """Hierarchical pipelined broadcast: a ring chain per group, top level first."""
    s = Schedule(rank, size, count, name="hierarchical.broadcast")
    lv = levels(size, nodes, numas)
    below = [tuple((r,) for r in range(size))] + [tuple(level) for level in lv[:-1]]
    chains = []
    for level, lower in zip(reversed(lv), reversed(below)):
        for group in level:
            subs = sorted(g for g in lower if g[0] in group)
            if len(subs) < 2:
                continue
            entries = [root if root in g else g[0] for g in subs]
            start = entries.index(root) if root in group else 0
            chains.append(entries[start:] + entries[:start])
    for a, b in segments(0, count, seg):
        for chain in chains:
            if rank not in chain:
                continue
            v = chain.index(rank)
            if v > 0:
                s.recv(chain[v - 1], (OUT, a, b))
            if v < len(chain) - 1:
                s.send(chain[v + 1], (OUT, a, b))
    return s
