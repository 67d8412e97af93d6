"""One-pass collectives on registered buffers (``collectives.node.registered``) of a single node.

When every rank's buffers of a call lie in shared windows that every rank of the node maps,
no byte has to be copied into a window or through the MPI library: each rank reads its peers'
inputs and writes its peers' outputs directly. Vocabulary: a buffer of ``count`` elements is cut
into ``n`` *slices* (``numpy.array_split`` sizes), slice r owned by rank r; a slice is walked in
*chunks* of ``CHUNK`` bytes, small enough that a chunk and its partial result stay in cache.

Walk through an allreduce at n = 4: rank 2 takes slice 2, and for each chunk c computes
x_0[c] op x_1[c] into out_0[c], folds x_2[c] and x_3[c] into it, in rank order (so the result
is the same bits on every rank and in every run), then copies out_0[c] (in cache) into out_1[c],
out_2[c] and out_3[c]. Each rank reads its slice of every input once and writes its slice of
every output once: 2N bytes per rank, the memory-traffic bound of an allreduce. In place
(out = x) is safe: slice r of every buffer is read and written by rank r only, and out_0[c] is
written only after x_0[c] was read.

The others, for rank r:

- ``reduce_scatter``: block r of every input, folded in rank order chunk by chunk straight into
  r's own output;
- ``reduce``: slice r of every input, folded into slice r of the root's output (through a
  private accumulator when the root reduces in place and is not rank 0, whose input would be
  overwritten before it is read);
- ``allgather``: every peer's input copied into r's own output, at that peer's place;
- ``broadcast``: slice r of the root's buffer copied into slice r of every other rank's (every
  rank copies, the root too).

*Deciding collectively* (``agree``, the record's preference). The one-pass path is tried for
``auto`` calls of more than ``THRESHOLD`` bytes (the same size on every rank) on a
communicator where registered buffers exist, all of whose ranks share one node. Every rank
contributes (registered?, window sequence and byte offset of x and of out) to one small
``MPI_Allreduce(MIN)`` of the values and their negatives; the path runs only if every rank is
registered on this communicator with the same windows and offsets, and the plan ``launch``
receives is where they are. Otherwise (mixed, another communicator's buffer, a released one,
a device tensor) every rank takes the ordinary path, with the same results. An agreement is
kept per communicator and registered pair (``Agreed``): the same call on the same registered
buffers runs one-pass again without the exchange, so every rank must then pass its registered
buffers again, as it did (DDP's buckets do). On several nodes
(real or simulated) of one size, an allreduce runs as the node composite
(``collectives.node.composite``): the one-pass fold on each node, a ring across nodes, the
one-pass copies back.

*Synchronisation: flags in a window, no MPI call per chunk.* The work runs as an ``ShmWork`` on
the communicator's shm window (``collectives.node.window``), inside the window's handshake: each
rank arrives (after ``MPI_Win_sync``, which orders its earlier stores to its buffers before the
flag), waits until every rank has (every input written, every output free to be written), does
its part, then departs and waits for every peer to: nobody returns, and reads or reuses its
output, before every slice of it is written. An ``i*`` call that is polled
(``Request.test``; DDP polls from its gradient hooks) never waits for a peer: it arrives, does
its part if every rank has arrived, and otherwise returns to the caller's computation until the
next poll (``window.LATER``). The shm window orders these calls with the communicator's other
shm calls, runs them from the progress thread when there is one, and tells the watchdog whom a
stuck rank waits for.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..registry import DIRECT, ONE_NODE, Algorithm
from . import composite, registered
from .window import LATER, Info, ShmWork, window

__all__ = ["ALGORITHM", "COLLECTIVES", "THRESHOLD", "CHUNK", "Agreed", "agree", "launch"]

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
THRESHOLD = 1 << 16   # bytes per rank: up to this the ordinary path runs without a check
CHUNK = 1 << 18       # bytes per chunk: a partial result and one peer's chunk fit in L2
_NONE = np.iinfo(np.int64).max  # "nothing to say" in the agreement (ranks without an out)


def _where(buf, ctx):
    """(window seq, byte offset, registration) of a wrapped buffer registered on ``ctx``'s
    communicator, or None."""
    if buf is None or buf.is_device:
        return None
    hit = registered.lookup(buf.flat)
    if hit is None or hit[0].comm != ctx.user_comm:
        return None
    return hit[0].seq, hit[1], hit[0]


def _positions(ctx, reg, ranks) -> list[int] | None:
    """The segments (node ranks of ``reg``) of communicator ranks ``ranks``; None if one of
    them is on another node."""
    from mpi4py import MPI
    mine, theirs = ctx.comm.Get_group(), reg.node.Get_group()
    try:
        where = MPI.Group.Translate_ranks(mine, list(ranks), theirs)
    finally:
        mine.Free()
        theirs.Free()
    return None if MPI.UNDEFINED in where else list(where)


def _needs_out(call) -> bool:
    """Whether peers write this rank's output (so it must be registered too)."""
    return call.collective == "allreduce" or (call.collective == "reduce" and
                                              call.ctx.rank == call.root)


def agree(call, nbytes: int):
    """Where every rank's x and out are (window and offset of each; ``reduce``: the root's
    out), if every rank runs ``call`` (``auto``, ``nbytes`` per rank, the same everywhere)
    one-pass, else None. Collective whenever the size qualifies and the communicator has
    registered buffers (known alike on every rank). On several nodes (real or simulated)
    only allreduce runs one-pass, node by node (``_allreduce_nodes``), on nodes of one size
    whose ranks share a registration's node."""
    ctx = call.ctx
    if nbytes <= THRESHOLD or ctx.size == 1 or not registered.on(ctx.user_comm):
        return None
    from mpi4py import MPI
    from ..topology import topology
    topo = topology(ctx)
    if not topo.single_node and (call.collective != "allreduce" or
                                 len({len(g) for g in topo.nodes}) != 1):
        return None
    x = _where(call.x, ctx)
    out = _where(call.out, ctx) if _needs_out(call) else (_NONE, _NONE, None)
    agreed = ctx.slot(Agreed).plans
    # reduce: the plan holds the root's output, which the other ranks do not see: not kept
    key = None if x is None or out is None or call.collective == "reduce" else \
        (call.collective, nbytes, x[:2], out[:2])
    plan = agreed.get(key)
    if plan is not None:
        return plan
    lo = np.zeros(5, np.int64)
    if x is not None and out is not None:
        node = topo.nodes[topo.node[ctx.rank]]
        if all(_positions(ctx, w[2], node) is not None for w in (x, out) if w[2] is not None):
            lo[:] = (1, *x[:2], *out[:2])
    hi = lo.copy()
    if call.collective == "reduce" and ctx.rank != call.root:
        lo[3:], hi[3:] = _NONE, -_NONE  # only the root's output is agreed on
    both = np.concatenate([lo, -hi])
    ctx.comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MIN)
    if both[0] != 1 or not np.array_equal(both[:5], -both[5:]):
        return None
    plan = tuple(int(v) for v in both[1:5])
    if key is not None:
        if len(agreed) >= 1024:  # a program's buckets are few; a bound all the same
            agreed.clear()
        agreed[key] = plan
    return plan


class Agreed:
    """The one-pass plans every rank of a communicator agreed on, by (collective, bytes, this
    rank's x and out: window sequence and offset; not ``reduce``, whose plan holds the root's
    output). A call on the same registered buffers
    runs one-pass again without the exchange: registrations are collective, so where one rank
    repeats an agreed call on its registered buffers, every rank does (as DDP's buckets do)."""

    __slots__ = ("plans",)

    def __init__(self, ctx):
        self.plans: dict = {}


def _peers(call, seq, offset, counts, dtype, positions=None):
    """The buffers at ``offset`` in window ``seq`` of the ranks whose segments are at
    ``positions`` (default: every rank, in order), ``counts[j]`` elements each."""
    reg = registered.live(call.ctx.user_comm, seq)
    segs = reg.segs if positions is None else [reg.segs[p] for p in positions]
    nbytes = [c * dtype.itemsize for c in counts]
    return reg, [seg[offset:offset + nb].view(dtype) for seg, nb in zip(segs, nbytes)]


def _bounds(count: int, n: int, r: int) -> tuple[int, int]:
    base, extra = divmod(count, n)
    lo = r * base + min(r, extra)
    return lo, lo + base + (r < extra)


def _fold(op, dst, parts, a: int, b: int, step: int, at: int = 0, n: int = 1) -> None:
    """``dst[a - at:b - at]`` = ``parts[0][a:b]`` op ``parts[1][a:b]`` op ..., chunk by chunk,
    in rank order; ``avg`` over ``n`` ranks: the sum of every part divided by ``n`` first
    (``ops.mean_first``), while the chunk is in cache, so no partial sum overflows. ``dst`` may
    be ``parts[0]`` (in place) but no later part."""
    if op.is_avg:
        quotient = np.empty(min(step, b - a), dst.dtype)
        for c in range(a, b, step):
            e = min(c + step, b)
            d, q = dst[c - at:e - at], quotient[:e - c]
            ops.mean_first(parts[0][c:e], n, d)
            for p in parts[1:]:
                ops.mean_first(p[c:e], n, q)
                np.add(d, q, out=d)
        return
    for c in range(a, b, step):
        e = min(c + step, b)
        d = dst[c - at:e - at]
        op.reduce(d, parts[0][c:e], parts[1][c:e])
        for p in parts[2:]:
            op.reduce(d, d, p[c:e])


def _allreduce(work, call, ins, outs, step):
    n, r = call.ctx.size, call.ctx.rank
    lo, hi = _bounds(call.x.count, n, r)
    first = outs[0]
    for c in range(lo, hi, step):
        e = min(c + step, hi)
        _fold(call.op, first, ins, c, e, e - c, n=n)
        for o in outs[1:]:
            np.copyto(o[c:e], first[c:e])


def _reduce(work, call, ins, outs, step):
    n, r, root = call.ctx.size, call.ctx.rank, call.root
    lo, hi = _bounds(call.x.count, n, r)
    dst = outs[root]
    if dst.ctypes.data == ins[root].ctypes.data and root != 0 and hi > lo:
        # in place at the root: x_root's slice is still to be read when x_0 op x_1 is written
        acc = call.ctx.take_scratch(("onepass", call.x.dtype), step,
                                    lambda k: np.empty(k, call.x.dtype))
        try:
            for c in range(lo, hi, step):
                e = min(c + step, hi)
                _fold(call.op, acc, ins, c, e, e - c, at=c, n=n)
                np.copyto(dst[c:e], acc[:e - c])
        finally:
            call.ctx.give_scratch(("onepass", call.x.dtype), acc)
    else:
        _fold(call.op, dst, ins, lo, hi, step, n=n)


def _reduce_scatter(work, call, ins, out, step):
    r, counts = call.ctx.rank, call.counts
    lo = sum(counts[:r])
    _fold(call.op, out, ins, lo, lo + counts[r], step, at=lo, n=call.ctx.size)


def _broadcast(work, call, bufs, step):
    """Slice r of the root's buffer into slice r of every other rank's, chunk by chunk: every
    rank copies, not only the ones that receive."""
    n, r, root = call.ctx.size, call.ctx.rank, call.root
    lo, hi = _bounds(call.x.count, n, r)
    src = bufs[root]
    for c in range(lo, hi, step):
        e = min(c + step, hi)
        for j, dst in enumerate(bufs):
            if j != root:
                np.copyto(dst[c:e], src[c:e])


def _allgather(work, call, ins, out):
    at = 0
    for j, c in enumerate(call.counts):
        if j != call.ctx.rank or ins[j].ctypes.data != out[at:].ctypes.data:
            np.copyto(out[at:at + c], ins[j])
        at += c


def _allreduce_nodes(work, call, ins, outs, step, here):
    """Allreduce over several nodes as the node composite (``composite.allreduce``), for
    local rank j of a node's k: slice j of the node's inputs folded one-pass (as
    ``_allreduce``; ``avg``: quotients by the call's rank count) into the first output, the
    ring across nodes on it (a sum), then written into every output of the node."""
    k, j, op = here.size, here.rank, call.op
    lo, hi = _bounds(call.x.count, k, j)
    first = outs[0]

    def stage_in():
        if k > 1 or op.is_avg:  # avg: the node's quotients over every rank of the call
            _fold(op, first, ins, lo, hi, step, n=call.ctx.size)
        elif first is not ins[0]:
            np.copyto(first[lo:hi], ins[0][lo:hi])
        return first[lo:hi]

    def stage_out(block):
        for c in range(lo, hi, step):
            e = min(c + step, hi)
            for o in outs[1:]:
                np.copyto(o[c:e], first[c:e])

    composite.allreduce(work, here, op, stage_in, stage_out)


def _refused(win) -> str | None:
    """Why a named call cannot run one-pass, from every rank's descriptor; None if it can."""
    table = win.shown(Info.DESC)
    bad = [j for j, desc in enumerate(table) if desc != table[0] or min(desc) < 0]
    if not bad:
        return None
    return (f"algorithm 'onepass' needs x and out registered (collectives.empty) on every "
            f"rank, at the same offsets of the same windows; rank(s) {bad} passed ordinary "
            f"buffers or other windows or offsets (algorithm='auto' checks and falls back)")


def _run(work, win, call, regs, body, args, desc=None):
    """The window's handshake around this rank's part: arrive (every input written, every
    output free to be written), do the part once every rank has arrived, depart, and return
    once every rank has departed. Polled (``test``), each step that would wait returns
    ``LATER`` instead: this rank goes on computing, and a peer that arrives later is not kept
    waiting for it longer than until its next poll. A named call (``desc``: where its
    buffers are) first checks every rank's descriptor, and refuses on every rank alike.
    ``body(work, call, *args)`` is this rank's part (``work`` for a part that itself waits on
    peers: the node composite's ring across nodes)."""
    wins = [reg.win for reg in regs]
    if work.state is None:
        win.arrive(desc=desc, wins=wins)
        work.state = "arrived"
    if work.state == "arrived":
        if not win.arrived(work, work.polling, wins):
            return LATER
        why = None if desc is None else _refused(win)
        if why is None:
            body(work, call, *args)
        win.depart(wins)
        work.state = why or "done"
    if not win.departed(work, work.polling, "finish their part"):
        return LATER
    if work.state != "done":
        raise ValueError(work.state)
    return None


def launch(call, agreed=None) -> ShmWork:
    """Start ``call`` one-pass: where ``agree`` found every rank's buffers, or by name
    (``agreed`` None: allreduce only, each rank's buffers checked inside the call)."""
    ctx, dt = call.ctx, call.x.dtype
    step = max(1, CHUNK // dt.itemsize)
    if agreed is None:
        return _launch_named(call, step)
    from ..topology import topology
    if not topology(ctx).single_node:
        return _launch_nodes(call, agreed, step)
    win = window(ctx)
    seq_x, off_x, seq_o, off_o = agreed
    collective, n = call.collective, ctx.size
    if collective == "allgather":
        reg, ins = _peers(call, seq_x, off_x, call.counts, dt)
        return ShmWork(win, _run, (win, call, [reg], _allgather, (ins, call.out.flat)), call)
    reg, ins = _peers(call, seq_x, off_x, [call.x.count] * n, dt)
    if collective == "broadcast":
        return ShmWork(win, _run, (win, call, [reg], _broadcast, (ins, step)), call)
    if collective == "reduce_scatter":
        return ShmWork(win, _run, (win, call, [reg], _reduce_scatter,
                                   (ins, call.out.flat, step)), call)
    reg_o, outs = _peers(call, seq_o, off_o, [call.x.count] * n, dt)
    body = _allreduce if collective == "allreduce" else _reduce
    regs = [reg] if reg_o is reg else [reg, reg_o]
    return ShmWork(win, _run, (win, call, regs, body, (ins, outs, step)), call)


def _launch_named(call, step) -> ShmWork:
    """``algorithm="onepass"`` by name (allreduce, one node): no agreement before the call;
    each rank shows where its buffers are in its window line, and the call runs one-pass
    only if every rank's are registered alike, else it is a ``ValueError`` on every rank."""
    ctx, dt = call.ctx, call.x.dtype
    win = window(ctx)
    x, out = _where(call.x, ctx), _where(call.out, ctx)
    if x is None or out is None:
        return ShmWork(win, _run, (win, call, [], None, (), (-1, -1, -1, -1)), call)
    counts = [call.x.count] * ctx.size
    reg, ins = _peers(call, x[0], x[1], counts, dt)
    reg_o, outs = _peers(call, out[0], out[1], counts, dt)
    regs = [reg] if reg_o is reg else [reg, reg_o]
    return ShmWork(win, _run, (win, call, regs, _allreduce, (ins, outs, step),
                               (x[0], x[1], out[0], out[1])), call)


def _launch_nodes(call, agreed, step) -> ShmWork:
    """``_allreduce_nodes`` as a work of the node's shm window."""
    from ..topology import topology
    ctx, dt = call.ctx, call.x.dtype
    topo = topology(ctx)
    node = topo.nodes[topo.node[ctx.rank]]
    here = composite.node(ctx)
    seq_x, off_x, seq_o, off_o = agreed
    counts = [call.x.count] * len(node)
    reg = registered.live(ctx.user_comm, seq_x)
    reg, ins = _peers(call, seq_x, off_x, counts, dt, _positions(ctx, reg, node))
    reg_o = registered.live(ctx.user_comm, seq_o)
    reg_o, outs = _peers(call, seq_o, off_o, counts, dt, _positions(ctx, reg_o, node))
    regs = [reg] if reg_o is reg else [reg, reg_o]
    return ShmWork(here.win, _run, (here.win, call, regs, _allreduce_nodes,
                                    (ins, outs, step, here)), call)


# By name: allreduce on one node. As ``auto``'s preference: every collective of COLLECTIVES.
ALGORITHM = Algorithm("onepass", DIRECT, ("allreduce",), launch=launch, needs=ONE_NODE,
                      agree=agree, prefers=COLLECTIVES, averages=True, agree_above=THRESHOLD,
                      registered=True)
