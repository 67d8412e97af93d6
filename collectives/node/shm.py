"""``algorithm="shm"``: allreduce, reduce-scatter, all-gather, broadcast and reduce through one
MPI-3 shared-memory window on a node (the window and its rounds: ``collectives.node.window``).

Message-based algorithms move every byte through the library at each hop and write it to memory
at every hop and reduction. Here the k ranks of a node map one window that all of them can
read, and the buffer streams through it in *rounds* of at most ``COLLECTIVES_SHM_CHUNK_BYTES``
per rank (cache-sized, so what one rank writes is still in cache when the others read it).
Allreduce, round by round, for rank r of k, the round's chunk cut into k *slices*:

1. *copy in*: r copies the slices of its input that other ranks reduce into its *slot* of the
   window (its own slice stays where it is: only r reads it);
2. *reduce*: once every rank has copied in, r reduces slice r straight from its own input and
   the k - 1 slots into its slot, combining as ``algorithm="ring"`` does (``_fold``);
3. *copy out*: once every rank has reduced, each rank copies all k reduced slices to its output.

Per rank that is one read of the input and one write of the output from memory; everything in
between touches the window, which stays in cache while its round is in flight. One rank
computes each element, so the result is bitwise identical everywhere. Each reduction combines
in the order of one message-based algorithm (``bits``): this allreduce and the reduce-scatter
as ring does (an element of ring's block j from rank j + 1 around to rank j), the whole rounds
and the reduce as tree does on its way to the root (at each node of its in-order binary tree:
first child's subtree, the node's own, second child's), on any number of ranks.

*Whole rounds* (allreduces up to ``WHOLE_MAX_BYTES``, or ``COLLECTIVES_SHM_WHOLE_BYTES``):
every rank copies its whole round into its slot, and once every rank has, each reduces every
slot into its output: k times the arithmetic, but the ranks meet once a round, not twice, and
on a node with more ranks than cores a meeting costs the scheduler's time, not the copy's.
Every rank computes each element alike, so the results agree bitwise.

*Reduce*: the ranks other than the root copy each round into their slots and go on (their
slot is written again only after the root read it: the slot guard of ``Window.pipeline``), and
the root reduces its input and their slots into its output; only the root waits. From 3 ranks
and ``SPLIT_MIN_BYTES`` the root's child in the tree combines the others' slots and its own
input in place in those slots, and the root combines only its input and that one result
(``_reduce_split``, three steps a round): the root's k - 1 passes over each round become one.

Reduce-scatter reduces rank r's block straight into r's output (no copy out); all-gather and
broadcast copy in, then copy out.

*Single-copy all-gather and broadcast.* Where the kernel lets the ranks of a node read each
other's memory (``collectives.node.cma``, ``COLLECTIVES_SHM_CMA``), an all-gather or broadcast of at
least ``CMA_MIN_BYTES`` skips the window: each rank publishes its buffer's address and reads
every peer's block (the root's buffer) straight into its output, one copy instead of two. The
reductions keep the window: a kernel copy runs at about half ``memcpy``'s speed, so trading two
copies through the cache-resident window for one kernel copy does not pay there.

Requirements: every rank of the communicator on one node (``MPI.COMM_TYPE_SHARED``) and, under a
simulated topology (``COLLECTIVES_RANKS_PER_NODE``), on one simulated node: otherwise a
``ValueError`` on every rank. Host memory only. Every dtype and op of the toolkit.

Entry points: ``launch(call)`` runs one collective; composites that run shm phases inside their
own work (``hierarchical_shm``) call ``reduce_scatter_rounds`` and ``allgather_rounds`` on a
``window(ctx)`` inside a ``ShmWork``.
"""
from __future__ import annotations

import numpy as np

from .. import config
from ..schedule import split
from ..tree.pipelined import btree
from .window import ShmWork, Window, window

__all__ = ["launch", "reduce_scatter_rounds", "allgather_rounds", "bits", "window", "ShmWork",
           "CMA_MIN_BYTES", "WHOLE_MAX_BYTES", "SPLIT_MIN_BYTES"]

# All-gathers and broadcasts of at least this many bytes read peers' memory (where they may).
CMA_MIN_BYTES = 2 << 20
# Allreduces of at most this many bytes meet once a round, not twice (``_allreduce_whole``), by
# rank count (None: any other); ``COLLECTIVES_SHM_WHOLE_BYTES`` sets one bound for every count.
WHOLE_MAX_BYTES = {2: 128 << 10, None: 512 << 10}
# A reduce of at least this many bytes a rank, on 3 ranks or more, splits the root's work with
# its child in the tree (``_reduce_split``); below it the extra meeting costs more than it saves.
SPLIT_MIN_BYTES = 512 << 10


def _combine(win: Window, op, dst, parts, root: int = 0) -> None:
    """``dst`` = ``parts`` (one array a rank) combined as ``algorithm="tree"`` combines them
    on its way to ``root`` (``tree.pipelined``: at each node of its in-order binary tree,
    first child's subtree, then the node's own, then second child's), so that shm's whole
    rounds and reduce give tree's bits (``bits``).
    ``dst`` may be ``parts[root]`` (the tree's root reads its own first); partial results of
    the subtrees live in the window's scratch, one chunk per tree level."""
    if len(parts) == 1:
        np.copyto(dst, parts[0])
    else:
        _combine_node(win, op, dst, parts, root, 0, 0)


def _combine_node(win: Window, op, dst, parts, root: int, v: int, depth: int):
    """Tree node v's subtree combined (``_combine``): an input as it is, or scratch. A
    module-level function, not a closure: a closure that calls itself is a reference cycle,
    and it would keep every call's ``dst`` (a caller's output) until the cyclic collector
    runs."""
    _, first, second = btree(v, len(parts))
    mine = parts[(v + root) % len(parts)]
    if first is None and second is None:
        return mine
    out = dst if depth == 0 else win.scratch(dst.dtype, depth)[:dst.shape[0]]
    if first is not None:
        op.reduce(out, _combine_node(win, op, dst, parts, root, first, depth + 1), mine)
        mine = out
    if second is not None:
        op.reduce(out, mine, _combine_node(win, op, dst, parts, root, second, depth + 1))
    return out


def _fold(op, dst, parts, start: int) -> None:
    """``dst`` = ``parts`` (one array a rank) combined as ``algorithm="ring"`` combines a block
    on its way around the ring (``ring.reduce_scatter``): ``parts[start]``, then the next rank's,
    and so on, ``parts[start - 1]`` last; the block that ends on rank j starts at j + 1. So
    shm's reduce-scatters give ring's bits (``bits``). ``dst`` is none of ``parts``."""
    k = len(parts)
    if k == 1:
        np.copyto(dst, parts[0])
        return
    op.reduce(dst, parts[start % k], parts[(start + 1) % k])
    for t in range(2, k):
        op.reduce(dst, dst, parts[(start + t) % k])


def _fold_ring(op, dst, parts, at: int, blocks) -> None:
    """``_fold`` for the elements ``at:at + len(dst)`` of a buffer whose ring blocks start at
    ``blocks`` (``split(count, k)``): each piece of one block folds from that block's start."""
    end = at + dst.shape[0]
    for j in range(len(blocks) - 1):
        lo, hi = max(blocks[j], at), min(blocks[j + 1], end)
        if hi > lo:
            _fold(op, dst[lo - at:hi - at], [p[lo - at:hi - at] for p in parts], j + 1)


def bits(collective: str, nbytes: int, k: int) -> str:
    """Which algorithm's bits shm's ``collective`` of ``nbytes`` gives on one node of ``k``
    ranks: ``"tree"`` (``_combine``) or ``"ring"`` (``_fold``): the results equal that
    algorithm's bit for bit."""
    if collective == "reduce_scatter":
        return "ring"
    return "ring" if collective == "allreduce" and not _whole(nbytes, k) else "tree"


def _whole(nbytes: int, k: int) -> bool:
    """Whether an allreduce of ``nbytes`` on ``k`` ranks meets once a round
    (``_allreduce_whole``)."""
    limit = config.get("COLLECTIVES_SHM_WHOLE_BYTES")
    if limit is None:
        limit = WHOLE_MAX_BYTES.get(k, WHOLE_MAX_BYTES[None])
    return nbytes <= limit


def _allreduce(work, win: Window, src, out, op) -> None:
    """Allreduce in two meetings a round (above ``WHOLE_MAX_BYTES``): rank r reduces slice r
    of each round, combining each element as ring does (``_fold_ring``)."""
    r, k = win.rank, win.size
    n, dtype = out.shape[0], out.dtype
    step = win.chunk // dtype.itemsize  # at least k: see window()
    rounds = -(-n // step)
    full = split(step, k)
    blocks = split(n, k)  # ring's blocks, whose order each element takes

    def cut(i):  # every round but the last has the same slices
        return full if (i + 1) * step <= n else split(n - i * step, k)

    def copy_in(i, s):  # the slices the other ranks reduce; slice r stays in the input
        c0, c = i * step, cut(i)
        mine = win.slot(dtype, s, r)
        if c[r]:
            np.copyto(mine[:c[r]], src[c0:c0 + c[r]])
        if c[k] > c[r + 1]:
            np.copyto(mine[c[r + 1]:c[k]], src[c0 + c[r + 1]:c0 + c[k]])

    def reduce(i, s):  # slice r, from this rank's input and the others' slots, into our slot
        c0, c = i * step, cut(i)
        a, b = c[r], c[r + 1]
        if b > a:
            parts = [src[c0 + a:c0 + b] if j == r else win.slot(dtype, s, j)[a:b]
                     for j in range(k)]
            _fold_ring(op, win.slot(dtype, s, r)[a:b], parts, c0 + a, blocks)

    def copy_out(i, s):
        c0, c = i * step, cut(i)
        for j in range(k):
            if c[j + 1] > c[j]:
                np.copyto(out[c0 + c[j]:c0 + c[j + 1]], win.slot(dtype, s, j)[c[j]:c[j + 1]])

    win.pipeline(work, rounds, (copy_in, reduce, copy_out))


def _copy_in(win: Window, src, step: int):
    """The phase that copies round i of ``src`` (``step`` elements a round) into this rank's
    slot s."""
    n, r = src.shape[0], win.rank

    def copy_in(i, s):
        c0 = i * step
        np.copyto(win.slot(src.dtype, s, r)[:min(n, c0 + step) - c0], src[c0:c0 + step])
    return copy_in


def _allreduce_whole(work, win: Window, src, out, op) -> None:
    """Allreduce with one meeting a round (below ``WHOLE_MAX_BYTES``): every rank copies its
    whole round into its slot, then combines every slot into its output (``_combine``)."""
    k = win.size
    n, dtype = out.shape[0], out.dtype
    step = win.chunk // dtype.itemsize

    def reduce(i, s):
        c0 = i * step
        m = min(n, c0 + step) - c0
        _combine(win, op, out[c0:c0 + m], [win.slot(dtype, s, j)[:m] for j in range(k)])

    win.pipeline(work, -(-n // step), (_copy_in(win, src, step), reduce))


def _reduce(work, win: Window, src, out, op, root) -> None:
    """Reduce onto ``root``: the others copy each round into their slots and go on (one phase:
    their slot is written again only once the root has read it, the slot guard); the root
    combines its input and their slots into its output (``_combine``: its own first, so the
    output may be the input). From 3 ranks and ``SPLIT_MIN_BYTES`` the root's child in the
    tree combines for it (``_reduce_split``)."""
    r, k = win.rank, win.size
    n, dtype = src.shape[0], src.dtype
    step = win.chunk // dtype.itemsize
    if k >= 3 and src.nbytes >= SPLIT_MIN_BYTES:
        return _reduce_split(work, win, src, out, op, root)

    def reduce(i, s):
        c0 = i * step
        m = min(n, c0 + step) - c0
        parts = [src[c0:c0 + m] if j == r else win.slot(dtype, s, j)[:m] for j in range(k)]
        _combine(win, op, out[c0:c0 + m], parts, root)

    phases = (lambda i, s: None, reduce) if r == root else (_copy_in(win, src, step),)
    win.pipeline(work, -(-n // step), phases)


_SUBTREES: dict = {}  # k -> _subtree(k)


def _subtree(k: int):
    """The root's child ``c`` in ``btree`` of ``k`` nodes and how it combines its subtree (every
    node but the root) in place: ``(c, ops, last)``, ops ``(dst, a, b)`` meaning ``dst = a op
    b`` over virtual ranks' slots (``"x"``: c's own input, never written), ``last`` the slot
    that ends up with the subtree's result. The order of every operand is ``_combine``'s, so
    the bits are tree's."""
    plan = _SUBTREES.get(k)
    if plan is None:
        c = btree(0, k)[2]
        ops = []

        def node(v):
            _, first, second = btree(v, k)
            mine = "x" if v == c else v
            if first is not None:
                a = node(first)
                ops.append((a, a, mine))  # a is a slot: only c's own part is "x"
                mine = a
            if second is not None:
                b = node(second)
                out = b if mine == "x" else mine
                ops.append((out, mine, b))
                mine = out
            return mine

        last = node(c)
        plan = _SUBTREES[k] = (c, tuple(ops), last)
    return plan


def _reduce_split(work, win: Window, src, out, op, root) -> None:
    """Reduce in three steps a round: the ranks but the root and its child c copy their round
    into their slots; c combines them and its own input in place in those slots, as tree
    combines c's subtree (``_subtree``); the root combines its input and c's result into its
    output, as tree's root does. The root, which everyone waits for, then makes one pass over
    each round instead of k - 1 (and one in place is faster than one into a third array); in
    all, k - 2 copies and k - 1 reductions a round."""
    r, k = win.rank, win.size
    n, dtype = src.shape[0], src.dtype
    step = win.chunk // dtype.itemsize
    c, ops, last = _subtree(k)
    v = (r - root) % k

    def at(i, s, h, m):  # handle h of round i: c's own input, or virtual rank h's slot
        return src[i * step:i * step + m] if h == "x" else win.slot(dtype, s, (h + root) % k)[:m]

    def rows(i):
        return min(n, (i + 1) * step) - i * step

    def combine(i, s):
        m = rows(i)
        for d, a, b in ops:
            op.reduce(at(i, s, d, m), at(i, s, a, m), at(i, s, b, m))

    def finish(i, s):
        c0, m = i * step, rows(i)
        op.reduce(out[c0:c0 + m], src[c0:c0 + m], at(i, s, last, m))

    def idle(i, s):
        return None

    if v == 0:
        phases = (idle, idle, finish)
    elif v == c:
        phases = (idle, combine, idle)
    else:
        phases = (_copy_in(win, src, step), idle, idle)
    win.pipeline(work, -(-n // step), phases)


def _bounds(counts):
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


def reduce_scatter_rounds(work, win: Window, src, out, op, counts) -> None:
    """Reduce-scatter ``src`` (every rank's blocks of ``counts`` elements) into this rank's
    ``out`` through ``win``, inside ``work`` (a running ``ShmWork``): a copy-in phase, then each
    rank folds its own block from the others' slots as ring does (``_fold``)."""
    r, k = win.rank, win.size
    dtype = out.dtype
    bounds = _bounds(counts)
    piece = max(1, win.chunk // dtype.itemsize // k)  # every block's share of a slot
    rounds = -(-max(counts) // piece)

    def copy_in(i, s):  # round i's piece of every other rank's block, at position t * piece
        lo = i * piece
        mine = win.slot(dtype, s, r)
        for t in range(k):
            m = min(counts[t], lo + piece) - lo
            if t != r and m > 0:
                np.copyto(mine[t * piece:t * piece + m], src[bounds[t] + lo:bounds[t] + lo + m])

    def reduce(i, s):  # this rank's piece, straight into its output
        lo = i * piece
        m = min(counts[r], lo + piece) - lo
        if m > 0:
            parts = [src[bounds[r] + lo:bounds[r] + lo + m] if j == r else
                     win.slot(dtype, s, j)[r * piece:r * piece + m] for j in range(k)]
            _fold(op, out[lo:lo + m], parts, r + 1)

    win.pipeline(work, rounds, (copy_in, reduce))


def _allgather_cma(work, win: Window, src, out, counts) -> None:
    """Each peer's block read straight from its input into our output: one copy, no window.

    A peer's input must not change until we have read it: ``finish`` waits for every peer to
    say it is done reading ours before the call returns.
    """
    r, size = win.rank, out.dtype.itemsize
    bounds = _bounds(counts)
    np.copyto(out[bounds[r]:bounds[r + 1]], src[:counts[r]])
    peers = win.publish(work, src)
    here, read = out.ctypes.data, win.reader.read
    for j, pid, there in peers:
        if counts[j]:
            read(pid, here + bounds[j] * size, there, counts[j] * size)
    win.finish(work)


def allgather_rounds(work, win: Window, src, out, counts) -> None:
    """All-gather every rank's ``src`` (``counts[r]`` elements) into ``out`` through ``win``,
    inside ``work`` (a running ``ShmWork``): copy in, then copy every peer's block out."""
    r, k = win.rank, win.size
    dtype = out.dtype
    bounds = _bounds(counts)
    np.copyto(out[bounds[r]:bounds[r + 1]], src[:counts[r]])
    piece = max(1, win.chunk // dtype.itemsize)
    rounds = -(-max(counts) // piece)

    def copy_in(i, s):
        lo = i * piece
        m = min(counts[r], lo + piece) - lo
        if m > 0:
            np.copyto(win.slot(dtype, s, r)[:m], src[lo:lo + m])

    def copy_out(i, s):
        lo = i * piece
        for t in range(k):
            m = min(counts[t], lo + piece) - lo
            if t != r and m > 0:
                np.copyto(out[bounds[t] + lo:bounds[t] + lo + m], win.slot(dtype, s, t)[:m])

    win.pipeline(work, rounds, (copy_in, copy_out))


def _broadcast(work, win: Window, buf, root) -> None:
    r, n, dtype = win.rank, buf.shape[0], buf.dtype
    piece = max(1, win.chunk // dtype.itemsize)
    rounds = -(-n // piece)

    def copy_in(i, s):
        if r == root:
            lo = i * piece
            np.copyto(win.slot(dtype, s, root)[:min(n, lo + piece) - lo], buf[lo:lo + piece])

    def copy_out(i, s):
        if r != root:
            lo = i * piece
            np.copyto(buf[lo:lo + piece], win.slot(dtype, s, root)[:min(n, lo + piece) - lo])

    win.pipeline(work, rounds, (copy_in, copy_out))


def _broadcast_cma(work, win: Window, buf, root) -> None:
    """Every other rank reads the root's buffer straight into its own: one copy, no window."""
    peers = win.publish(work, buf)
    if win.rank != root and buf.nbytes:
        pid, there = next((pid, there) for j, pid, there in peers if j == root)
        win.reader.read(pid, buf.ctypes.data, there, buf.nbytes)
    win.finish(work)


def launch(call) -> ShmWork:
    """Start ``call`` with the shm algorithm (the ``launch`` protocol of ``collectives.api``)."""
    if call.x.is_device:
        raise TypeError(f"algorithm 'shm' works on host memory; got {call.x.describe()}")
    win = window(call.ctx)
    x, out = call.x.flat, call.out.flat if call.out is not None else None
    if call.collective == "allreduce":
        src = out if call.inplace else x
        fn = _allreduce_whole if _whole(out.nbytes, win.size) else _allreduce
        return ShmWork(win, fn, (win, src, out, call.op), call)
    if call.collective == "reduce":
        src = out if call.inplace else x
        return ShmWork(win, _reduce, (win, src, out, call.op, call.root), call)
    if call.collective == "reduce_scatter":
        return ShmWork(win, reduce_scatter_rounds, (win, x, out, call.op, tuple(call.counts)),
                       call)
    # All-gather and broadcast: single-copy reads from CMA_MIN_BYTES. The output's size is the
    # same on every rank, so every rank takes the same path.
    single = (out is not None and win.cma and config.get("COLLECTIVES_SHM_CMA")
              and out.nbytes >= CMA_MIN_BYTES)
    if call.collective == "allgather":
        return ShmWork(win, _allgather_cma if single else allgather_rounds,
                       (win, x, out, tuple(call.counts)), call)
    if call.collective == "broadcast":
        return ShmWork(win, _broadcast_cma if single else _broadcast, (win, out, call.root), call)
    raise ValueError(f"algorithm 'shm' does not implement {call.collective}")
