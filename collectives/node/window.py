"""The runtime under ``algorithm="shm"``: one MPI-3 shared-memory window per node communicator,
and the machinery that moves a collective through it in rounds.

*Window.* The k ranks of a node map one window (``MPI.Win.Allocate_shared``) that all of them
can read: per rank ``SLOTS`` slots of ``chunk`` bytes and, in the header, one cache line per
(counter, rank) and an info line per rank. ``window(ctx)`` allocates it once per communicator
and chunk size (collectively, on the first call) and caches it on the context.

*Counters, not barriers.* Each rank owns three int64 counters in the header (rounds copied in,
reduced, done reading) that it raises after each step, ordering its memory with
``MPI_Win_sync``. ``Window.pipeline`` runs a collective's rounds through its two or three phases: a
step of round i may run once every rank's counter of the step before reached i + 1, and
writing round i's slot once every rank finished reading round i - SLOTS, the previous user of
that slot. A rank runs whatever step is allowed, so one that holds a core copies in rounds
ahead while a peer is descheduled; a rank with nothing to do spins ``COLLECTIVES_SHM_SPIN``
polls, then yields its core (at once when the node has fewer cores than ranks: the rank it
waits for may be waiting for its core).

*The handshake: arrive -> work -> depart.* A call that does not move in rounds (CMA's
single-copy reads, ``collectives.node.onepass``) meets its peers twice: ``arrive`` shows what the
call's peers need on this rank's info line (``Info``: an input's address, a descriptor of
registered buffers) and raises its ``seq`` field, after ordering the rank's earlier stores;
``arrived`` says (or waits until) every rank did, after which a rank may read what the others
showed and work on their memory; ``depart`` raises every counter by one round, and
``departed`` says (or waits until) every rank did, after which nobody's memory is read or
written by this call any more. The polled forms return False instead of waiting, so a
``ShmWork`` polled by ``test`` returns ``LATER`` and the rank goes on computing.
``publish``/``finish`` are the blocking forms. The ``Window`` writes its counters and info
line itself; callers use these methods.

*Single-copy reads.* Where the kernel lets the ranks read each other's memory
(``collectives.node.cma``; probed once per window, collectively, and on only where every rank can),
``publish`` shows a call's buffer address to the peers and ``finish`` waits until every peer
has read it.

*Order.* Calls run one at a time per window, in the order they were issued (the same on every
rank): ``ShmWork`` queues each call on its window; ``wait``/``test`` (or the progress thread)
run the oldest pending one first. The algorithms are in ``collectives.node.shm``.
"""
from __future__ import annotations

import os
import threading
from collections import deque

import numpy as np

from .. import config
from ..p2p import idle  # the one way to wait: spin, yield the core, sleep when far behind
from . import cma

__all__ = ["Window", "window", "ShmWork", "Info", "idle", "round_up", "slot_bytes", "rank_bytes",
           "SLOTS", "PHASES", "LATER"]

SLOTS = 4                    # rounds in flight per rank: slack for a descheduled peer
PHASES = 3                   # counters: copied in, reduced, done reading
_LINE = 64                   # one cache line per counter


class Info:
    """The layout of a rank's info line (8 int64 fields, one cache line): where each field is."""

    PID = 0     # the rank's process id (CMA reads name it)
    SEQ = 1     # handshake calls this rank has arrived at (``Window.arrive``)
    SRC = 2     # the address of this call's input (``arrive(src=...)``, CMA reads)
    SELF = 3    # the line's own address in its rank's mapping (what a probe read must find)
    DESC = slice(4, 8)  # a named one-pass call's (x window, x offset, out window, out offset)


_NAMES = ("copy in", "reduce", "finish reading")
LATER = object()  # what a ShmWork's fn returns from a poll that would have to wait


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def slot_bytes(ranks: int, chunk: int | None = None) -> int:
    """A slot's bytes for ``chunk`` (default ``COLLECTIVES_SHM_CHUNK_BYTES``) on ``ranks``
    ranks: at least one element of the widest dtype (16 bytes) per rank, whole cache lines."""
    return round_up(max(64, 16 * ranks, chunk or config.get("COLLECTIVES_SHM_CHUNK_BYTES")),
                    64)


def rank_bytes(ranks: int, chunk: int) -> int:
    """One rank's part of a window of ``ranks`` ranks with slots of ``chunk`` bytes: the
    counters' header (whole pages) and ``SLOTS`` slots."""
    return round_up((PHASES + 1) * ranks * _LINE, 4096) + SLOTS * chunk


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
        self.stride = rank_bytes(self.size, chunk)
        self.header = header = self.stride - SLOTS * chunk
        self.win = MPI.Win.Allocate_shared(self.stride, 1, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.mem = []
        for j in range(self.size):
            buf, _unit = self.win.Shared_query(j)
            self.mem.append(np.frombuffer(buf, dtype=np.uint8, count=self.stride))
        lines = self.mem[0][:(PHASES + 1) * self.size * _LINE].view(np.int64)
        lines = lines.reshape(PHASES + 1, self.size, _LINE // 8)
        self.counters = [lines[p, :, 0] for p in range(PHASES)]
        self.mine = [lines[p, self.rank, :1] for p in range(PHASES)]
        self.info = lines[PHASES]
        for cell in self.mine:
            cell[0] = 0
        line = self.info[self.rank]
        line[:] = 0
        line[Info.PID] = os.getpid()
        line[Info.SELF] = line.ctypes.data
        # Fault the slots in now, not in a call: each rank writes its own and maps the others'
        # (otherwise a window's first calls run several times slower than the rest).
        self.mem[self.rank][header:].fill(0)
        self.win.Sync()
        comm.Barrier()  # every counter is zero before anyone raises one
        for j in range(self.size):
            if j != self.rank:
                int(self.mem[j][header::4096].sum())  # one byte a page: the mapping
        self.base = 0
        self.calls = 0
        spin = config.get("COLLECTIVES_SHM_SPIN")
        self.spin = spin if self.size <= (os.cpu_count() or 1) else 0
        use_cma = config.get("COLLECTIVES_SHM_CMA")
        self.reader = cma.Reader() if use_cma and cma.available() else None
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
                self.reader.read(int(self.info[j, Info.PID]), got.ctypes.data,
                                 int(self.info[j, Info.SELF]), 8)
            except OSError:
                return False
            if got[0] != self.info[j, Info.PID]:
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

    # -- the handshake: arrive -> work -> depart (see the module doc) ---------------------------
    def arrive(self, src=None, desc=None, wins=()) -> None:
        """This rank arrives at the next handshake call: its stores so far (to its own memory
        and to ``wins``, other shared windows it wrote) ordered before its arrival, ``src``
        (an array a peer may read, CMA) and ``desc`` (``Info.DESC``) shown on its info line."""
        line = self.info[self.rank]
        if src is not None:
            line[Info.SRC] = src.ctypes.data
        if desc is not None:
            line[Info.DESC] = desc
        for w in wins:
            w.Sync()
        self.win.Sync()
        line[Info.SEQ] = self.calls + 1

    def arrived(self, work, poll: bool = False, wins=(), what: str = "arrive") -> bool:
        """Whether every rank arrived at this call (``poll``) or, waiting until then, True;
        once True, what every rank stored before arriving is visible here (``wins`` too).
        ``what``: the arrival in words, for the watchdog."""
        seq, seqs = self.calls + 1, self.info[:, Info.SEQ]
        if not self._reached(work, poll, lambda: seqs.min() >= seq,
                             lambda: f"rank(s) {[j for j in range(self.size) if seqs[j] < seq]} "
                                     f"to {what}"):
            return False
        self.win.Sync()
        for w in wins:
            w.Sync()
        return True

    def shown(self, field) -> list:
        """Every rank's ``field`` of its info line (an ``Info`` position or slice), in rank
        order, as shown at this call's arrival."""
        return self.info[:, field].tolist()

    def depart(self, wins=()) -> None:
        """This rank is done with the call: its stores (to ``wins`` too) ordered before, every
        counter raised by one round."""
        for w in wins:
            w.Sync()
        self.win.Sync()
        base = self.base + 1
        for cell in self.mine:
            cell[0] = base

    def departed(self, work, poll: bool = False, what: str = "finish") -> bool:
        """Whether every rank departed (``poll``) or, waiting until then, True; once True
        the call is over here: no rank touches this rank's memory for it any more."""
        base, last = self.base + 1, self.counters[PHASES - 1]
        if not self._reached(work, poll, lambda: last.min() >= base,
                             lambda: f"rank(s) {self.late(PHASES - 1, base)} to {what}"):
            return False
        self.win.Sync()
        self.base = base
        self.calls += 1
        return True

    def publish(self, work, src) -> list:
        """Show this call's input to the peers; their ``(rank, pid, input address)``s.

        Collective: returns once every rank published the same call. A rank publishes its next
        call only after every peer finished reading this one (``finish``), so the addresses a
        peer reads stay valid for the whole call.
        """
        self.arrive(src=src)
        self.arrived(work, what="start")
        pids, srcs = self.shown(Info.PID), self.shown(Info.SRC)
        return [(j, pids[j], srcs[j]) for j in range(self.size) if j != self.rank]

    def finish(self, work) -> None:
        """Say this rank is done reading its peers' buffers, then wait until every peer has
        finished reading this rank's."""
        self.depart()
        self.departed(work, what="finish reading")

    def _reached(self, work, poll: bool, ready, what) -> bool:
        """``ready()`` now, or after waiting for it unless ``poll`` (then ``work.where`` says
        whom this rank waits for until its next poll)."""
        if ready():
            work.where = None
            return True
        if poll:
            work.where = what
            return False
        _wait_until(work, self, ready, what)
        return True

    # -- rounds through the slots --------------------------------------------------------------
    def pipeline(self, work, rounds: int, phases) -> None:
        """Run ``rounds`` rounds through ``phases`` (two or three), each step as soon as it may.

        Phase p of round i may run once every rank finished phase p - 1 of round i; phase 0
        (which writes the round's slot) once every rank finished the last phase of round
        i - SLOTS, the previous user of that slot. A rank runs whatever step is allowed,
        reductions first (the others wait for them), so a rank that has the core copies in
        rounds ahead while a peer is descheduled: ranks meet at a round, not at every step.
        The last phase raises the later counters too, so the slot guard (counter 2) works
        whatever the phase count.
        """
        base = self.base
        depth = len(phases)
        counters, mine, sync = self.counters, self.mine, self.win.Sync
        done = [0] * depth            # rounds this rank finished, per phase
        order = sorted(range(depth), key=lambda p: (p != 1, p))  # reduce, copy in, copy out
        spins, spin = 0, self.spin
        while done[-1] < rounds:
            moved = False
            for p in order:
                i = done[p]
                if i >= rounds or (p and i >= done[p - 1]):
                    continue
                if p == 0:
                    ready = counters[PHASES - 1].min() >= base + i - SLOTS + 1
                else:
                    ready = counters[p - 1].min() >= base + i + 1
                if not ready:
                    continue
                sync()  # see the others' data only after their counters
                phases[p](i, (base + i) % SLOTS)
                sync()  # our data is visible before our counter
                done[p] = i + 1
                for q in range(p, PHASES if p == depth - 1 else p + 1):
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
            idle(spins, spin)
        work.where = None
        self.base = base + rounds

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
    chunk = slot_bytes(ctx.size, chunk)
    windows = ctx.slot(_Windows).by_chunk
    win = windows.get(chunk)
    if win is not None:
        return win
    from ..topology import node_comm, topology
    topo = topology(ctx)
    if not topo.single_node:
        raise ValueError(f"algorithm 'shm' needs every rank on one node, but the {ctx.size} "
                         f"ranks of this communicator span {len(topo.nodes)} nodes "
                         f"({topo.source}); use 'hierarchical' or a node communicator")
    win = windows[chunk] = Window(node_comm(ctx).Dup(), chunk)  # the window's own comm
    return win


class _Windows:
    """A communicator's shared windows, one per chunk size, freed with its context."""

    __slots__ = ("by_chunk",)

    def __init__(self, ctx):
        self.by_chunk: dict = {}

    def close(self) -> None:
        for win in self.by_chunk.values():
            win.close()


# -- the work object ------------------------------------------------------------------------
class ShmWork:
    """One shm collective: run when its turn comes (see the module doc).

    ``fn(work, *args)`` runs the collective. A ``fn`` may also move in steps: while
    ``work.polling`` (a ``test``, not a ``wait``) it may return ``LATER`` instead of waiting
    for a peer, keeping its progress in ``work.state``; it is called again at the next
    ``test`` or ``wait`` of the window, and the window runs nothing else meanwhile."""

    __slots__ = ("win", "fn", "args", "done", "error", "where", "call", "_claimed", "polling",
                 "state")
    needs_progress = True  # moves only when a rank runs it (dispatch._drain)

    def __init__(self, win: Window, fn, args, call):
        self.win, self.fn, self.args, self.call = win, fn, args, call
        self.done = False
        self.error = None
        self.where = None
        self._claimed = False
        self.polling = False
        self.state = None
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
        head.polling = not block
        later = False
        try:
            later = head.fn(head, *head.args) is LATER
        except BaseException as exc:  # noqa: BLE001 - stored, then raised by the waiter
            head.error = exc
        with win.cond:
            if not later:
                head.done = True
                win.queue.popleft()
            win.running = False
            win.cond.notify_all()
        return not later

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
            late = self.win.late(PHASES - 1, base + done[0] - SLOTS + 1)
            waits.append(f"rank(s) {late} to free the slot of round {done[0]}")
        return f"shm {self.info}: waiting for " + "; ".join(waits)


# -- waiting and the rounds ------------------------------------------------------------------
def _wait_until(work, win: Window, ready, what) -> None:
    """Spin, then yield, until ``ready()``; ``what()`` says whom we wait for (watchdog)."""
    if ready():
        return
    work.where = what
    spins = 0
    while not ready():
        spins += 1
        idle(spins, win.spin)
    work.where = None
