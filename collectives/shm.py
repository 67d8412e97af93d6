"""``algorithm="shm"``: allreduce, reduce-scatter, all-gather, broadcast and reduce through one
MPI-3 shared-memory window on a node.

Message-based algorithms move every byte through the library at each hop (one copy with
single-copy transports such as CMA, two through shared cells) and write it to memory at every
hop and reduction. Here the k ranks of a node map one
window that all of them can read, and the buffer streams through it in *rounds* of at most
``CHUNK_BYTES`` per rank (cache-sized, so what one rank writes is still in cache when the others
read it). Allreduce, round by round, for rank r of k, the round's chunk cut into k *slices*:

1. *copy in*: r copies the slices of its input that other ranks reduce into its *slot* of the
   window (its own slice stays where it is: only r reads it);
2. *reduce*: once every rank has copied in, r reduces slice r straight from its own input and
   the k - 1 slots into its slot, combining as ``algorithm="ring"`` does (``_fold``);
3. *copy out*: once every rank has reduced, each rank copies all k reduced slices to its output.

Per rank that is one read of the input and one write of the output from memory; everything in
between touches the window, which stays in cache while its round is in flight. One rank
computes each element, so the result is bitwise identical everywhere. Each reduction here
combines in the order of one message-based algorithm, so that ``auto`` may race the two
(``select.bits``): this allreduce and the reduce-scatter as ring does (an element of ring's
block j from rank j + 1 around to rank j), the whole rounds below and the reduce as tree does
on its way to the root (at each node of its in-order binary tree: first child's subtree, the
node's own, second child's), on any number of ranks. Whichever order costs the same here: k - 1
combining passes over each element.

*Whole rounds* (allreduces up to ``WHOLE_MAX_BYTES``: 128 KiB at 2 ranks, 512 KiB at more):
every rank copies its whole round into its slot, and once every rank has, each reduces every
slot into its output: k times the arithmetic, but the ranks meet once a round,
not twice, and on a node with more ranks than cores a meeting costs the scheduler's time, not
the copy's. Every rank computes each element alike, so the results agree bitwise.
Measured (``mpiexec -n 3``, 2 cores, medians of the benchmark's rounds, one launch): 32 KiB
184 against 234 us, 128 KiB 216 against 275, 512 KiB 429 against 458, 2 MiB 1720 against 1488
(so not there); at 2 ranks 128 KiB 67 against 72, 512 KiB 150 against 129.

*Reduce*: the ranks other than the root copy each round into their slots and go on (their
slot is written again only after the root read it: the slot guard below), and the root reduces
its input and their slots into its output. Only the root waits, so a reduce
costs about a copy on the others. Measured against the best message-based algorithm
(binomial, tree) and MPICH's own (one launch each): 2 ranks 1.1x at 128 KiB, 1.45-2x from
512 KiB; 3 ranks 1.1x at 128 KiB, 1.4-2.2x from 512 KiB. From 3 ranks and
``SPLIT_MIN_BYTES`` (512 KiB) the root's child in the tree combines the others' slots and its
own input in place in those slots, and the root combines only its input and that one result
(``_reduce_split``, three steps a round): the root's k - 1 passes over each round become one,
and the one it had into a third array (``a op b`` into ``c``) ran at half the speed of one in
place on this machine, even in L2. Against the root alone (``mpiexec -n 3``, 2 cores, medians
of 15 interleaved 10 ms blocks, one launch): out of place 0.75 at 512 KiB, 0.62 at 2 MiB, 0.71
at 8 MiB, 0.86-1.03 at 32 MiB; in place 0.77, 0.59, 0.57, 0.59-0.66; at 4 ranks 0.58-0.78 from
512 KiB. In the benchmark's runs at 3 ranks, 512 KiB - 32 MiB, shm ran at 0.74-1.03x tree's
speed out of place and 0.96-1.31x in place before (``docs/bench.md``, runs AE and AF), and at
1.11-1.73x and 1.26-2.39x after (AG-AI). Below 512 KiB the extra meeting costs more than it
saves (8-32 KiB 1.4-1.75x the time, 256 KiB in place 1.46x).

Synchronization is by counters, not barriers: each rank owns three int64 counters in the
window's header (rounds copied in, reduced, done reading; one cache line each) that it raises
after each step, ordering its memory with ``MPI_Win_sync``. A step of round i may run once every
rank's counter of the step before reached i + 1; copying in round i once every rank finished
reading round i - SLOTS, the previous user of that slot (``SLOTS`` = 4 per rank). A rank runs
whatever step is allowed, so one that holds a core copies in rounds ahead while a peer is
descheduled; a rank with nothing to do spins briefly, then ``sched_yield``s (at once when the
node has fewer cores than ranks). Reduce-scatter reduces rank r's block straight into r's output
(no copy out); all-gather and broadcast copy in, then copy out.

*Single-copy all-gather and broadcast.* Where the kernel lets the ranks of a node read each
other's memory (``process_vm_readv``, Linux cross-memory attach: see ``collectives.cma``; probed
once per window, collectively), an all-gather or broadcast of at least ``CMA_MIN_BYTES`` (2 MiB)
skips the window: each rank publishes its buffer's address in the window's header and reads
every peer's block (the root's buffer) straight into its output, one copy instead of two
(all-gather: measured 1.16x at 4 MiB, 1.3x at 64 MiB at n = 2; 1.05-1.1x at n = 3). Broadcast
through the window runs in two modes minutes apart here: in the slow one the root's copy of
each 1 MiB round into its slot took 275 us (3.8 GB/s; the other rank's copy out, 85 us), and
8 MiB took 2-3 ms against MPICH's 1.0-1.4; in the fast one 0.55-0.8 ms. The single copy writes
nothing shared (n = 2, medians of 8 rounds of 5-call blocks, three launches: 2 MiB 124-128 us
against the window's 165-188 and native's 191-213; 8 MiB 820-994 against 917-1079 and
978-1165; 32 MiB within 5% of both). The same idea measured no faster for the reductions, and
was left out: a kernel copy runs at about half ``memcpy``'s speed here (9-12 against 18-20 GB/s
into a cache-sized buffer), so trading two ``memcpy``s through the cache-resident window for one
kernel copy only pays where the window's second copy also missed the cache. Allreduce at n = 2,
16 MiB: reading the inputs across processes 1.0-1.1x of the window path, reading only the
results 1.05-1.08x, and slower at 32 and 64 MiB or at n = 3; reduce-scatter 0.7x at n = 2.

The window is allocated once per communicator and chunk size (collectively, on the first
``shm`` call) and cached on the communicator's context; later calls reuse it. Calls run one at a
time per window, in the order they were issued (the same on every rank): a non-blocking call is
run by the progress thread; ``wait``/``test`` in another thread run earlier pending ones first.

Requirements: every rank of the communicator on one node (``MPI.COMM_TYPE_SHARED``) and, under a
simulated topology (``COLLECTIVES_RANKS_PER_NODE``), on one simulated node: otherwise a
``ValueError`` on every rank. Host memory only. Every dtype and op of the toolkit.

Knob: ``COLLECTIVES_SHM_CHUNK_BYTES`` (default 1 MiB) or ``set_chunk_bytes``.
Measure it: ``mpiexec -n 2 python -m collectives.shm`` (see ``_bench``).
"""
from __future__ import annotations

import os
import threading
from collections import deque

import numpy as np

from . import cma
from .schedule import split
from .tree.pipelined import btree

__all__ = ["CHUNK_BYTES", "CMA", "SLOTS", "set_chunk_bytes", "set_cma", "ShmWork", "launch",
           "window"]

CHUNK_BYTES = int(os.environ.get("COLLECTIVES_SHM_CHUNK_BYTES", 1 << 20))
CMA = os.environ.get("COLLECTIVES_SHM_CMA", "1") != "0"  # single-copy reads where they work
CMA_MIN_BYTES = 2 << 20      # all-gathers of at least this many bytes use them (measured)
SLOTS = 4                    # rounds in flight per rank: slack for a descheduled peer
# Allreduces of at most this many bytes meet once a round, not twice (``_allreduce_whole``), by
# rank count (None: any other); ``COLLECTIVES_SHM_WHOLE_BYTES`` sets one bound for every count.
WHOLE_MAX_BYTES = {2: 128 << 10, None: 512 << 10}
if "COLLECTIVES_SHM_WHOLE_BYTES" in os.environ:
    WHOLE_MAX_BYTES = {None: int(os.environ["COLLECTIVES_SHM_WHOLE_BYTES"])}
_PHASES = 3                  # counters: copied in, reduced, done reading
# A reduce of at least this many bytes a rank, on 3 ranks or more, splits the root's work with
# its child in the tree (``_reduce_split``).
SPLIT_MIN_BYTES = 512 << 10
_LINE = 64                   # one cache line per counter
# Each rank's info line (int64): its pid, calls published, its input's address, and the address
# of the line itself in its own mapping (what a peer's probe read must find).
_PID, _SEQ, _SRC, _SELF = range(4)
_NAMES = ("copy in", "reduce", "finish reading")
# Polls (about 1.5 us each) before a waiting rank yields its core; none when the node has
# fewer cores than ranks, since then the rank we wait for may be waiting for our core.
SPIN = int(os.environ.get("COLLECTIVES_SHM_SPIN", 200))


def set_chunk_bytes(nbytes: int) -> int:
    """Set the per-rank round size (bytes) for later calls; returns the previous value."""
    global CHUNK_BYTES
    if nbytes < 64:
        raise ValueError(f"shm chunk must be at least 64 bytes, got {nbytes}")
    old, CHUNK_BYTES = CHUNK_BYTES, int(nbytes)
    return old


def set_cma(flag: bool) -> bool:
    """Use single-copy reads (where the window found them working) in later calls; returns the
    previous setting. The same on every rank of a communicator."""
    global CMA
    old, CMA = CMA, bool(flag)
    return old


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# -- the window ------------------------------------------------------------------------------
class Window:
    """One shared window on a node: every rank's ``SLOTS`` slots and its three counters.

    ``slot(dtype, s, j)``: slot s of rank j as a flat array of ``dtype``. ``counters[p]``:
    every rank's counter of phase p (0 copied in, 1 reduced, 2 done reading), a strided view
    of rank 0's header, one cache line per (phase, rank). ``base``: rounds run so far (the same
    on every rank). Runs one collective at a time, in ticket order.
    """

    def __init__(self, comm, chunk: int):
        from mpi4py import MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.chunk = chunk
        header = _round_up((_PHASES + 1) * self.size * _LINE, 4096)
        self.header = header
        self.stride = header + SLOTS * chunk
        self.win = MPI.Win.Allocate_shared(self.stride, 1, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.mem = []
        for j in range(self.size):
            buf, _unit = self.win.Shared_query(j)
            self.mem.append(np.frombuffer(buf, dtype=np.uint8, count=self.stride))
        lines = self.mem[0][:(_PHASES + 1) * self.size * _LINE].view(np.int64)
        lines = lines.reshape(_PHASES + 1, self.size, _LINE // 8)
        self.counters = [lines[p, :, 0] for p in range(_PHASES)]
        self.mine = [lines[p, self.rank, :1] for p in range(_PHASES)]
        self.info = lines[_PHASES]
        for cell in self.mine:
            cell[0] = 0
        line = self.info[self.rank]
        line[:] = 0
        line[_PID] = os.getpid()
        line[_SELF] = line.ctypes.data
        # Fault the slots in now, not in a call: each rank writes its own and maps the others'
        # (at 512 KiB, 2 ranks, each of a window's first 4 calls took 0.5-1.6 ms instead of 60 us,
        # and auto's trial sized shm's blocks from one of them).
        self.mem[self.rank][header:].fill(0)
        self.win.Sync()
        comm.Barrier()  # every counter is zero before anyone raises one
        for j in range(self.size):
            if j != self.rank:
                int(self.mem[j][header::4096].sum())  # one byte a page: the mapping
        self.base = 0
        self.calls = 0
        self.spin = SPIN if self.size <= (os.cpu_count() or 1) else 0
        self.reader = cma.Reader() if CMA and cma.available() else None
        self.cma = self._agree_cma()
        self._views: dict = {}
        # Ticket order: calls run one at a time, in the order they were issued.
        self.cond = threading.Condition()
        self.queue: deque = deque()
        self.running = False
        self.closed = False

    def slot(self, dtype, s: int, j: int):
        """Slot ``s`` of rank ``j`` as a flat ``dtype`` array (views cached)."""
        key = (dtype, s, j)
        view = self._views.get(key)
        if view is None:
            at = self.header + s * self.chunk
            view = self.mem[j][at:at + self.chunk].view(dtype)
            self._views[key] = view
        return view

    def scratch(self, dtype, level: int):
        """This rank's private chunk for partial results at ``level`` of ``_combine``'s tree."""
        key = ("scratch", dtype, level)
        view = self._views.get(key)
        if view is None:
            raw = np.empty(self.chunk, np.uint8)
            raw.fill(0)  # its pages faulted in now, not in a call
            view = self._views[key] = raw.view(dtype)
        return view

    def _probe(self) -> bool:
        """Whether this rank can read every peer's info line with ``process_vm_readv``."""
        got = np.zeros(1, np.int64)
        for j in range(self.size):
            if j == self.rank:
                continue
            try:
                self.reader.read(int(self.info[j, _PID]), got.ctypes.data,
                                 int(self.info[j, _SELF]), 8)
            except OSError:
                return False
            if got[0] != self.info[j, _PID]:
                return False
        return True

    def _agree_cma(self) -> bool:
        """Single-copy reads between the ranks of the node, if every rank can make them."""
        from mpi4py import MPI
        if self.size == 1 or not self.comm.allreduce(self.reader is not None, op=MPI.LAND):
            return False
        if self.comm.allreduce(self._probe(), op=MPI.LAND):
            return True
        # Yama's ptrace_scope = 1 allows reads only from a declared tracer: declare, retry.
        cma.allow_peers()
        self.comm.Barrier()
        return bool(self.comm.allreduce(self._probe(), op=MPI.LAND))

    def publish(self, work, src) -> list:
        """Show this call's input to the peers; their ``(rank, pid, input address)``s.

        Collective: returns once every rank published the same call. A rank publishes its next
        call only after every peer finished reading this one (``finish``), so the addresses a
        peer reads stay valid for the whole call.
        """
        seq = self.calls + 1
        line = self.info[self.rank]
        line[_SRC] = src.ctypes.data
        self.win.Sync()
        line[_SEQ] = seq
        seqs = self.info[:, _SEQ]
        _await(work, self, lambda: seqs.min() >= seq,
               lambda: f"rank(s) {[j for j in range(self.size) if seqs[j] < seq]} to start")
        self.win.Sync()
        return [(j, int(self.info[j, _PID]), int(self.info[j, _SRC]))
                for j in range(self.size) if j != self.rank]

    def finish(self, work) -> None:
        """Say this rank is done reading its peers' buffers (raise every counter by one round),
        then wait until every peer has finished reading this rank's."""
        self.win.Sync()
        self.base += 1
        for cell in self.mine:
            cell[0] = self.base
        last, base = self.counters[_PHASES - 1], self.base
        _await(work, self, lambda: last.min() >= base,
               lambda: f"rank(s) {self.late(_PHASES - 1, base)} to finish reading")
        self.calls += 1

    def late(self, phase: int, value: int) -> list[int]:
        """Ranks whose counter ``phase`` is below ``value`` (for messages)."""
        return [j for j in range(self.size) if self.counters[phase][j] < value]

    def close(self) -> None:
        """Unlock and free the window and its communicator (context teardown)."""
        if self.closed:
            return
        self.closed = True
        from mpi4py import MPI
        if MPI.Is_finalized():
            return
        self._views.clear()
        self.mem.clear()
        self.counters = self.mine = self.info = None
        self.win.Unlock_all()
        self.win.Free()
        self.comm.Free()


def window(ctx, chunk: int | None = None) -> Window:
    """The (cached) shared window of ``ctx`` for ``chunk`` bytes per slot; collective."""
    from mpi4py import MPI
    # A slot holds at least one element of the widest dtype (16 bytes) per rank.
    chunk = _round_up(max(64, 16 * ctx.size, chunk or CHUNK_BYTES), 64)
    key = ("shm.window", chunk)
    win = ctx.stash.get(key)
    if win is not None:
        return win
    from .topology import topology
    topo = topology(ctx)
    shared = ctx.comm.Split_type(MPI.COMM_TYPE_SHARED, key=ctx.rank)
    if shared.Get_size() != ctx.size or not topo.single_node:
        nodes = len(topo.nodes) if not topo.single_node else "several"
        shared.Free()
        raise ValueError(f"algorithm 'shm' needs every rank on one node, but the {ctx.size} "
                         f"ranks of this communicator span {nodes} nodes ({topo.source}); use "
                         f"'hierarchical' or a node communicator")
    win = Window(shared, chunk)
    ctx.stash[key] = win
    return win


# -- the work object ------------------------------------------------------------------------
class ShmWork:
    """One shm collective: run when its turn comes (see the module doc)."""

    __slots__ = ("win", "fn", "args", "done", "error", "where", "call", "_claimed")
    needs_progress = True  # moves only when a rank runs it (api._drain)

    def __init__(self, win: Window, fn, args, call):
        self.win, self.fn, self.args, self.call = win, fn, args, call
        self.done = False
        self.error = None
        self.where = None
        self._claimed = False
        with win.cond:
            win.queue.append(self)

    def start(self):
        """Nothing to post: the work runs in ``wait`` (or the progress thread)."""
        return self

    def _run_next(self, block: bool) -> bool:
        """Run the oldest pending work of the window if nobody runs one; False if busy."""
        win = self.win
        with win.cond:
            while True:
                if self.done:
                    return True
                if not win.running and win.queue:
                    head = win.queue[0]
                    win.running = True
                    head._claimed = True
                    break
                if not block:
                    return False
                win.cond.wait()
        try:
            head.fn(head, *head.args)
        except BaseException as exc:  # noqa: BLE001 - stored, then raised by the waiter
            head.error = exc
        finally:
            with win.cond:
                head.done = True
                win.queue.popleft()
                win.running = False
                win.cond.notify_all()
        return True

    def wait(self):
        """Run this call (after the window's earlier ones) to completion; raise its error."""
        while not self.done:
            self._run_next(block=True)
        if self.error is not None:
            raise self.error
        return self

    def test(self) -> bool:
        """Runs this call (and earlier pending ones) to completion if the window is free."""
        if not self.done:
            self._run_next(block=False)
        if self.done and self.error is not None:
            raise self.error
        return self.done

    @property
    def info(self) -> str:
        """The call in words (made when asked: a watchdog's message, not every call's cost)."""
        return self.call.describe()

    def waiting_for(self) -> str:
        """What this call waits on now (for the watchdog)."""
        where = self.where
        if self.done:
            return "nothing"
        if where is None:
            return f"shm {self.info}: running" if self._claimed else \
                f"shm {self.info}: queued behind an earlier shm call"
        if callable(where):
            return f"shm {self.info}: waiting for {where()}"
        done, base = where
        waits = []
        for p, i in enumerate(done):
            if p and i < done[p - 1]:
                late = self.win.late(p - 1, base + i + 1)
                waits.append(f"rank(s) {late} to {_NAMES[p - 1]} round {i}")
        if not waits:
            late = self.win.late(_PHASES - 1, base + done[0] - SLOTS + 1)
            waits.append(f"rank(s) {late} to free the slot of round {done[0]}")
        return f"shm {self.info}: waiting for " + "; ".join(waits)


# -- the algorithms (run by ShmWork, in the window's order) -----------------------------------
def _await(work, win: Window, ready, what) -> None:
    """Spin, then yield, until ``ready()``; ``what()`` says whom we wait for (watchdog)."""
    if ready():
        return
    work.where = what
    spins = 0
    while not ready():
        spins += 1
        _idle(spins, win.spin)
    work.where = None


def _idle(spins: int, spin: int) -> None:
    """The ``spins``-th wait of a rank with nothing to do: spin ``spin`` times, then yield the
    core (oversubscribed ranks give it to the one we wait for), and after 65536 waits sleep
    0.1 ms at a time (a peer far behind: stop burning a core)."""
    if spins > spin:
        if spins < 1 << 16:
            os.sched_yield()
        else:
            threading.Event().wait(1e-4)


def _pipeline(work, win: Window, rounds: int, phases) -> None:
    """Run ``rounds`` rounds through ``phases`` (two or three), each step as soon as it may.

    Phase p of round i may run once every rank finished phase p - 1 of round i; phase 0 (which
    writes the round's slot) once every rank finished the last phase of round i - SLOTS, the
    previous user of that slot. A rank runs whatever step is allowed, reductions first (the
    others wait for them), so a rank that has the core copies in rounds ahead while a peer is
    descheduled: ranks meet at a round, not at every step. The last phase raises the later
    counters too, so the slot guard (counter 2) works whatever the phase count.
    """
    base = win.base
    depth = len(phases)
    counters, mine, sync = win.counters, win.mine, win.win.Sync
    done = [0] * depth            # rounds this rank finished, per phase
    order = sorted(range(depth), key=lambda p: (p != 1, p))  # reduce, copy in, copy out
    spins, spin = 0, win.spin
    while done[-1] < rounds:
        moved = False
        for p in order:
            i = done[p]
            if i >= rounds or (p and i >= done[p - 1]):
                continue
            if p == 0:
                ready = counters[_PHASES - 1].min() >= base + i - SLOTS + 1
            else:
                ready = counters[p - 1].min() >= base + i + 1
            if not ready:
                continue
            sync()  # see the others' data only after their counters
            phases[p](i, (base + i) % SLOTS)
            sync()  # our data is visible before our counter
            done[p] = i + 1
            for q in range(p, _PHASES if p == depth - 1 else p + 1):
                mine[q][0] = base + i + 1
            moved = True
            break
        if moved:
            spins = 0
            work.where = None
            continue
        spins += 1
        if spins == 1:
            work.where = (done[:], base)
        _idle(spins, spin)
    work.where = None
    win.base = base + rounds


def _combine(win: Window, op, dst, parts, root: int = 0) -> None:
    """``dst`` = ``parts`` (one array a rank) combined as ``algorithm="tree"`` combines them
    on its way to ``root`` (``tree.pipelined``: at each node of its in-order binary tree,
    first child's subtree, then the node's own, then second child's), so that shm's whole
    rounds and reduce give tree's bits and ``auto`` may race them (``select.bits``).
    ``dst`` may be ``parts[root]`` (the tree's root reads its own first); partial results of
    the subtrees live in the window's scratch, one chunk per tree level."""
    k = len(parts)

    def node(v: int, depth: int):  # v's subtree combined: an input as it is, or scratch
        _, first, second = btree(v, k)
        mine = parts[(v + root) % k]
        if first is None and second is None:
            return mine
        out = dst if depth == 0 else win.scratch(dst.dtype, depth)[:dst.shape[0]]
        if first is not None:
            op.reduce(out, node(first, depth + 1), mine)
            mine = out
        if second is not None:
            op.reduce(out, mine, node(second, depth + 1))
        return out

    if k == 1:
        np.copyto(dst, parts[0])
    else:
        node(0, 0)


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
    ranks: ``"tree"`` (``_combine``) or ``"ring"`` (``_fold``); see ``select.bits``."""
    if collective == "reduce_scatter":
        return "ring"
    return "ring" if collective == "allreduce" and not _whole(nbytes, k) else "tree"


def _whole(nbytes: int, k: int) -> bool:
    """Whether an allreduce of ``nbytes`` on ``k`` ranks meets once a round
    (``_allreduce_whole``)."""
    return nbytes <= WHOLE_MAX_BYTES.get(k, WHOLE_MAX_BYTES[None])


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

    _pipeline(work, win, rounds, (copy_in, reduce, copy_out))


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

    _pipeline(work, win, -(-n // step), (_copy_in(win, src, step), reduce))


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
    _pipeline(work, win, -(-n // step), phases)


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
    each round instead of k - 1 (the first of them into a third array, at half the speed of
    one in place here); in all, k - 2 copies and k - 1 reductions a round, against k - 1
    copies and k - 1 reductions before."""
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
    _pipeline(work, win, -(-n // step), phases)


def _bounds(counts):
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


def _reduce_scatter(work, win: Window, src, out, op, counts) -> None:
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

    _pipeline(work, win, rounds, (copy_in, reduce))


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


def _allgather(work, win: Window, src, out, counts) -> None:
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

    _pipeline(work, win, rounds, (copy_in, copy_out))


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

    _pipeline(work, win, rounds, (copy_in, copy_out))


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
        return ShmWork(win, _reduce_scatter, (win, x, out, call.op, tuple(call.counts)), call)
    # All-gather and broadcast: single-copy reads from CMA_MIN_BYTES. The output's size is the
    # same on every rank, so every rank takes the same path.
    single = out is not None and win.cma and CMA and out.nbytes >= CMA_MIN_BYTES
    if call.collective == "allgather":
        return ShmWork(win, _allgather_cma if single else _allgather,
                       (win, x, out, tuple(call.counts)), call)
    if call.collective == "broadcast":
        return ShmWork(win, _broadcast_cma if single else _broadcast, (win, out, call.root), call)
    raise ValueError(f"algorithm 'shm' does not implement {call.collective}")


class _Algorithm:
    """The object ``collectives.select`` registers: ``launch(call) -> work``."""

    __slots__ = ()

    @staticmethod
    def launch(call) -> ShmWork:
        return launch(call)


ALGORITHM = _Algorithm()


def _register() -> None:
    from collectives import select
    for collective in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        select.register(collective, "shm", ALGORITHM)


_register()


# -- measurement: python -m collectives.shm ----------------------------------------------------
def _bench(argv=None) -> None:
    """Allreduce busbw of shm, native and ring, interleaved, and the copy bound (see --help)."""
    import argparse
    import time

    from mpi4py import MPI

    import collectives as coll

    parser = argparse.ArgumentParser(
        prog="mpiexec -n N python -m collectives.shm",
        description="float32 allreduce: shm vs the MPI library's own (native) vs ring, "
                    "interleaved in rotating order; medians over rounds of the slowest rank's "
                    "time. 'bound' is the time 2*n*N bytes take at the bandwidth of one large "
                    "numpy.copyto measured in the same run (rank 0 alone); 'of bound' is "
                    "bound / shm time.")
    parser.add_argument("--sizes", default="16,64", help="MiB per rank, comma-separated")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--chunk", type=int, default=None, help="shm chunk bytes")
    parser.add_argument("--algorithms", default="shm,native,ring")
    parser.add_argument("--inplace", action="store_true", help="out=x (reset between calls)")
    args = parser.parse_args(argv)
    if args.chunk:
        set_chunk_bytes(args.chunk)
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    algs = args.algorithms.split(",")
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    if rank == 0:
        print(f"# n = {n}, float32, {'in place' if args.inplace else 'out of place'}, shm chunk "
              f"{CHUNK_BYTES} B, {args.rounds} rounds; median and best of the slowest rank")
        print(f"# {'MiB':>6} {'algorithm':>10} {'stat':>6} {'time ms':>9} {'busbw':>8} "
              f"{'x native':>8} {'x ring':>8} {'of bound':>9}   (busbw in GB/s)")
    for mib in (float(m) for m in args.sizes.split(",")):
        count = int(mib * (1 << 20)) // 4
        init = np.full(count, 1.0 + rank, np.float32)
        x = init.copy()
        out = x if args.inplace else np.empty_like(x)
        times: dict[str, list[float]] = {a: [] for a in algs}
        copies = []
        for a in algs:  # warm up: windows, pages, schedules
            coll.allreduce(x, out=out, algorithm=a)
        for i in range(args.rounds):
            for a in algs[i % len(algs):] + algs[:i % len(algs)]:
                if args.inplace:
                    np.copyto(x, init)
                comm.Barrier()
                t0 = time.perf_counter()
                coll.allreduce(x, out=out, algorithm=a)
                dt = time.perf_counter() - t0
                times[a].append(comm.allreduce(dt, op=MPI.MAX))
            comm.Barrier()
            if rank == 0:
                t0 = time.perf_counter()
                np.copyto(out if out is not x else init, x)
                copies.append(time.perf_counter() - t0)
            comm.Barrier()
        if rank != 0:
            continue
        nbytes = count * 4
        copy = float(np.median(copies))
        bound = 2 * n * nbytes / (nbytes / copy)
        for label, stat in (("median", np.median), ("best", np.min)):
            t = {a: float(stat(v)) for a, v in times.items()}
            for a in algs:
                vs = " ".join(f"{t[b] / t[a]:8.2f}" if b in t else f"{'-':>8}"
                              for b in ("native", "ring"))
                print(f"  {mib:6g} {a:>10} {label:>6} {t[a] * 1e3:9.2f} "
                      f"{factor * nbytes / t[a] / 1e9:8.2f} {vs} {bound / t[a]:9.2f}")
        print(f"  {mib:6g} {'copyto':>10} {'median':>6} {copy * 1e3:9.2f} "
              f"{nbytes / copy / 1e9:8.2f}  (GB/s copied by rank 0 alone)")


if __name__ == "__main__":
    _bench()

