"""The MPI executor: runs any ``Schedule`` over an ``MPI.Comm``.

One ``Run`` is one collective in flight. It is a state machine over the schedule's ``Plan``:
an op whose dependencies have completed is *ready*; a ready reduce/copy runs at once (numpy or
cupy with ``out=``), a ready send/recv is posted non-blocking as soon as every earlier message
to/from the same peer has been posted (messages between a pair match in program order, MPI's
non-overtaking rule, under one tag per collective). ``wait()`` blocks in ``Waitany`` when
nothing is ready; ``test()`` advances without blocking. Because algorithms emit every chunk as
several segments, the DAG lets the reduction of segment k run while segment k+1 is still on the
wire, and receives are posted ahead of the matching sends.

Collectives run on a private ``Dup`` of the caller's communicator (``context(comm)``), cached
on it as an MPI attribute, so their messages never match the caller's own. Each collective
takes the next tag of that context, the same on every rank because collectives are called in
the same order everywhere, so overlapping non-blocking collectives never match each other's
messages. Scratch (``TMP``) comes from a pool on the context and is reused between calls.

The transport is passed in: ``MPITransport`` posts ``Isend``/``Irecv`` on byte views; the CUDA
module wraps it to stage device memory through host buffers; the in-process simulator
(``collectives.sim``) implements it with mailboxes. ``Run`` only needs ``isend``, ``irecv``,
``waitany``, ``testsome`` and ``finish``.

Under Open MPI's fault tolerance (ULFM, ``mpirun --with-ft ulfm``) the transport tests its
requests one at a time (``MPI_Test``), never with ``Waitany``, ``Testany`` or ``Testsome``.
Once a communicator is revoked, ULFM marks each pending request such a call scans with
``ERR_REVOKED``, though a send to a live peer stays in flight, and when the call then reports
an error it frees every marked request of the array (``ompi_errhandler_request_invoke``). The
send's completion (the peer's refusal, which its own revoke sends) then meets a freed request
with an error, which Open MPI makes fatal to the job ("Send error after request freed").
``MPI_Test`` frees its own request only, and only once complete. A run that fails with
requests in flight is kept, buffers and all (``_ABANDONED``): MPI may still complete them.

A run that blocks advances the others in flight too. Non-blocking runs started through
``launch_schedule`` are tracked (weakly, oldest first); a blocking ``wait`` takes every other
tracked run that no thread is advancing now (its lock, never waited for) and waits in one
``Waitany`` over all their requests, finishing each completion in its own run. So a later
collective's schedule moves on while an earlier one is waited, as MPI's own progress moves
every request: DDP's buckets run their stages side by side (bucket k+1 reduced inside the node
while bucket k is on the network) instead of each bucket's stages waiting for the bucket before
it. An error of another run stays with that run, for its own wait to raise.

``COLLECTIVES_SEGMENT_BYTES`` (``collectives.config``) is the largest message an algorithm
emits; tests set it small so that short arrays walk the multi-segment paths.

``schedule_for(call, builder)`` builds (once per shape: cached) the schedule of an API call and
``launch_schedule(call, schedule)`` binds it to the call's buffers and starts it: the one entry
point through which the API and the composite algorithms run a schedule.
"""
from __future__ import annotations

import atexit
import functools
import os
import threading
import weakref
from collections import deque

import numpy as np

from . import config
from .errors import CollectiveError, MessageSizeError, network_error
from .progress import polite_waits, ulfm_launched
from .schedule import RECV, REDUCE, SEND, build

__all__ = ["Context", "context", "Run", "MPITransport", "segment_elems", "schedule_for",
           "launch_schedule"]


def segment_elems(itemsize: int) -> int:
    """Elements of ``itemsize`` bytes in one segment (``COLLECTIVES_SEGMENT_BYTES``)."""
    return max(1, config.get("COLLECTIVES_SEGMENT_BYTES") // max(1, itemsize))


# -- per-communicator context -------------------------------------------------------------------
class Context:
    """What the toolkit keeps per user communicator: a private Dup, the tag counter, scratch."""

    def __init__(self, comm):
        from mpi4py import MPI
        if comm.Is_inter():
            raise TypeError("intercommunicators are not supported; pass an intracommunicator")
        self.user_comm = comm
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        self.tag_ub = int(tag_ub)
        self.seq = 0
        self.lock = threading.Lock()
        self._scratch: dict = {}
        # Each layer's own state of this communicator, one typed slot a layer (``slot``).
        self.slots: dict = {}
        self.transport = MPITransport(self.comm)
        # Non-blocking calls that move only when a rank runs them (shm's), not yet done: a later
        # call on this communicator runs them first (dispatch.start).
        self.pending: list = []

    def slot(self, kind):
        """This communicator's state of one layer above the executor: the instance of the
        class ``kind``, made as ``kind(self)`` on first use and closed with the context (its
        ``close()``, if it has one)."""
        state = self.slots.get(kind)
        if state is None:
            state = self.slots[kind] = kind(self)
        return state

    def next_seq(self) -> int:
        """The sequence number of the next collective (the same on every rank)."""
        seq = self.seq
        self.seq += 1
        return seq

    def tag(self, seq: int) -> int:
        return seq % self.tag_ub

    def take_scratch(self, key, n: int, alloc):
        """A scratch array of at least ``n`` elements for ``key``; give it back with ``give``."""
        with self.lock:
            free = self._scratch.setdefault(key, [])
            for i, arr in enumerate(free):
                if arr.shape[0] >= n:
                    return free.pop(i)
        return alloc(max(n, 1))

    def give_scratch(self, key, arr) -> None:
        with self.lock:
            free = self._scratch.setdefault(key, [])
            free.append(arr)
            free.sort(key=lambda a: a.shape[0])
            del free[:-4]  # keep the four largest

    def free(self) -> None:
        self._scratch.clear()
        for state in list(self.slots.values()):
            close = getattr(state, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - best effort at teardown
                    pass
        self.slots.clear()
        from mpi4py import MPI
        if not MPI.Is_finalized() and self.comm != MPI.COMM_NULL:
            self.comm.Free()


_KEYVAL = None
_KEYVAL_LOCK = threading.Lock()
# Every live context, in the order they were made (the same on every rank of a communicator:
# making one is a collective ``Dup``).
_LIVE: list = []


@atexit.register
def _free_at_exit() -> None:
    """Free every live context (its shared windows, sub-communicators and ``Dup``), in the
    order they were made, before mpi4py finalizes MPI (mpi4py finalizes after the interpreter's
    ``atexit`` hooks). A window still open at ``MPI_Finalize`` makes MPICH's OFI netmod fail
    it ("fabricclose ... Device or resource busy") when ranks talk over a network."""
    from mpi4py import MPI
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    for ref in _LIVE:
        ctx = ref()
        if ctx is not None:
            _delete_context(None, None, ctx)
    _LIVE.clear()


def _delete_context(comm, keyval, ctx):
    try:
        ctx.free()
    except Exception:  # noqa: BLE001 - never raise out of an MPI callback
        pass


def cached_context(comm) -> Context | None:
    """``comm``'s ``Context`` if it has one already (``context`` makes it: a collective call)."""
    return None if _KEYVAL is None else comm.Get_attr(_KEYVAL)


def context(comm) -> Context:
    """The toolkit's ``Context`` for ``comm`` (created on first use, cached on the comm)."""
    global _KEYVAL
    if _KEYVAL is not None:  # after the first call: one attribute lookup, no lock
        ctx = comm.Get_attr(_KEYVAL)
        if ctx is not None:
            return ctx
    from mpi4py import MPI
    with _KEYVAL_LOCK:
        if _KEYVAL is None:
            _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_context)
        ctx = comm.Get_attr(_KEYVAL)
        if ctx is None:
            ctx = Context(comm)
            comm.Set_attr(_KEYVAL, ctx)
            _LIVE[:] = [ref for ref in _LIVE if ref() is not None]
            _LIVE.append(weakref.ref(ctx))
    return ctx


# -- transport -----------------------------------------------------------------------------------
class MPITransport:
    """Non-blocking byte transfers on one communicator."""

    __slots__ = ("comm", "_byte", "_mpi", "counter", "polite", "singly")

    def __init__(self, comm):
        from mpi4py import MPI
        self.comm = comm
        self.counter = None  # collectives.traffic.count_traffic installs a LinkTraffic here
        self._mpi = MPI
        self._byte = MPI.BYTE
        # On a node with no core to spare, MPI's spinning Waitany keeps the core that the
        # rank being waited for needs: poll and yield instead (measured: 3 ranks on 2 cores,
        # an 8-byte ring allreduce took 8.3 ms spinning, 0.22 ms yielding).
        self.polite = polite_waits()
        # Under ULFM, one request at a time (the module doc: a revoke must not free a send
        # still in flight).
        self.singly = ulfm_launched()

    def isend(self, view, peer: int, tag: int):
        if self.counter is not None:
            self.counter.add(peer, view.nbytes)
        return self.comm.Isend([view, self._byte], peer, tag)

    def irecv(self, view, peer: int, tag: int):
        return self.comm.Irecv([view, self._byte], peer, tag)

    def finish(self, handle, status, nbytes: int, op) -> None:
        """Called when ``handle`` completed: verify a receive got exactly ``nbytes`` bytes."""
        if status is not None and op[0] == RECV:
            got = status.Get_count(self._byte)
            if got != nbytes:
                raise MessageSizeError(
                    f"rank {self.comm.Get_rank()}: expected {nbytes} bytes from rank "
                    f"{op[1]}, received {got}; do all ranks pass the same length and dtype?")

    def waitany(self, handles):
        """Block until one of ``handles`` completes: ``(index, status)``."""
        status = self._mpi.Status()  # one per call: the progress thread may wait at once
        if self.singly:
            while True:
                for k, handle in enumerate(handles):
                    if handle.Test(status):
                        return k, status
                if self.polite:
                    os.sched_yield()
        if self.polite:
            testany = self._mpi.Request.Testany
            while True:
                k, done = testany(handles, status)
                if done:
                    return k, status
                os.sched_yield()
        k = self._mpi.Request.Waitany(handles, status)
        return k, status

    def testsome(self, handles):
        """The ``(index, status)`` of the handles complete now (maybe none)."""
        if self.singly:
            done, status = [], self._mpi.Status()
            for k, handle in enumerate(handles):
                if handle.Test(status):
                    done.append((k, status))
                    status = self._mpi.Status()
            return done
        statuses = []
        try:
            done = self._mpi.Request.Testsome(handles, statuses)
        except self._mpi.Exception as exc:
            err = _status_error(self._mpi, exc, statuses)
            if err is exc:
                raise
            raise err from exc
        if not done:
            return ()
        return list(zip(done, statuses))


def _status_error(mpi, exc, statuses):
    """The error of the request that failed, where a test of several requests reports only
    ``ERR_IN_STATUS`` (a truncation, or under ULFM a revoked communicator or a dead peer, which
    elastic training must tell apart); ``exc`` itself otherwise."""
    if exc.Get_error_class() != mpi.ERR_IN_STATUS:
        return exc
    for status in statuses:
        code = status.Get_error()
        if code not in (mpi.SUCCESS, mpi.ERR_PENDING):
            return mpi.Exception(code)
    return exc


_U8 = np.dtype(np.uint8)
# Runs that failed with requests in flight (a process failure under ULFM): never freed, as
# their requests may still complete into (or from) their buffers.
_ABANDONED: list = []
# Non-blocking runs of ``launch_schedule`` in flight, oldest first, as weak references: a run
# nobody can wait for any more is not kept (nor its buffers).
_IN_FLIGHT: list = []
_IN_FLIGHT_LOCK = threading.Lock()


def _track(run: Run) -> Run:
    if not run.done:
        with _IN_FLIGHT_LOCK:
            if len(_IN_FLIGHT) >= 32:  # runs completed by test() alone are forgotten here
                _IN_FLIGHT[:] = [ref for ref in _IN_FLIGHT
                                 if (r := ref()) is not None and not r.done]
            _IN_FLIGHT.append(weakref.ref(run))
    return run


def _others(run: Run) -> list:
    """The tracked runs in flight besides ``run`` on the same kind of transport, oldest
    first, each locked for this thread (the caller releases them); finished ones are
    forgotten."""
    if not _IN_FLIGHT or getattr(run.transport, "singly", False):
        return []  # under ULFM a request's error must reach its own run: one run at a time
    kind = type(run.transport)
    taken = []
    with _IN_FLIGHT_LOCK:
        live = []
        for ref in _IN_FLIGHT:
            r = ref()
            if r is None or r.done:
                continue
            live.append(ref)
            if r is not run and type(r.transport) is kind and r.lock.acquire(False):
                if r.done:  # finished by another thread since the test above
                    r.lock.release()
                else:
                    taken.append(r)
        _IN_FLIGHT[:] = live
    return taken


class Run:
    """One schedule in flight on one rank (see the module doc).

    Written for the interpreter: this runs for every op of every call, and a call of a few ops
    costs ~10 us of Python here against ~2 us for the MPI calls, so the hot methods hold their
    lookups in locals and slice regions inline."""

    __slots__ = ("plan", "typed", "raw", "op", "transport", "tag", "pending", "ready",
                 "posted", "next", "handles", "hops", "left", "done", "itemsize", "info",
                 "error", "on_done", "lock", "__weakref__")

    def __init__(self, plan, in_flat, out_flat, tmp_flat, op, transport, tag, *,
                 info="", on_done=None):
        self.plan = plan
        self.typed = (in_flat, out_flat, tmp_flat)
        # the three as flat uint8 views (numpy or cupy), the bytes messages travel in
        self.raw = tuple(None if a is None else a.view(_U8) for a in self.typed) \
            if plan.queues else ()
        self.itemsize = out_flat.dtype.itemsize
        self.op = op
        self.transport = transport
        self.tag = tag
        self.info = info
        self.on_done = on_done
        self.pending = plan.ndeps.copy()
        self.ready = deque(plan.roots)
        self.posted = [False] * len(plan.ops)  # comm op ready (deps done); may still wait its turn
        self.next = dict.fromkeys(plan.queues, 0)
        self.handles: list = []   # outstanding MPI requests ...
        self.hops: list = []      # ... and the op index of each
        self.left = len(plan.ops)
        self.done = False
        self.error = None
        self.lock = threading.Lock()  # held by the thread advancing this run

    def describe(self) -> str:
        """What this run is, for errors: ``info``, or what it returns when it is a callable
        (the API passes ``Call.describe``: formatting it on every call cost ~2 us)."""
        return self.info() if callable(self.info) else self.info

    # -- the state machine ------------------------------------------------------------------
    def _post_turns(self, key) -> None:
        """Post the ops of one (kind, peer) queue whose turn has come and whose deps are done."""
        plan = self.plan
        queue, msg = plan.queues[key], plan.msg
        pos = self.next[key]
        posted, handles, hops = self.posted, self.handles, self.hops
        raw = self.raw
        s, tag, peer = self.itemsize, self.tag, key[1]
        post = self.transport.isend if key[0] == SEND else self.transport.irecv
        while pos < len(queue) and posted[queue[pos]]:
            i = queue[pos]
            buf, a, b = msg[i]
            handles.append(post(raw[buf][a * s:b * s], peer, tag))
            hops.append(i)
            pos += 1
        self.next[key] = pos

    def _drain(self) -> None:
        """Run every ready local op and post every ready message whose turn has come."""
        plan = self.plan
        ops, ready, typed = plan.ops, self.ready, self.typed
        while ready:
            i = ready.popleft()
            kind, peer, dst, srcs = ops[i]
            if kind < REDUCE:  # a message: posted once its turn in its queue has come
                self.posted[i] = True
                key = plan.keys[i]
                if plan.order[i] == self.next[key]:
                    self._post_turns(key)
                continue
            if kind == REDUCE:
                (d, da, db), (x, xa, xb), (y, ya, yb) = dst, srcs[0], srcs[1]
                self.op.reduce(typed[d][da:db], typed[x][xa:xb], typed[y][ya:yb])
            else:  # COPY
                (d, da, db), (x, xa, xb) = dst, srcs[0]
                typed[d][da:db] = typed[x][xa:xb]
            self._complete(i)

    def _finished(self, k: int, status) -> None:
        """Request ``k`` of ``handles`` completed."""
        handles, hops, plan = self.handles, self.hops, self.plan
        i, h = hops[k], handles[k]
        last, last_op = handles.pop(), hops.pop()  # swap-removal: lower indices stay valid
        if k < len(handles):
            handles[k], hops[k] = last, last_op
        buf, a, b = plan.msg[i]
        self.transport.finish(h, status, (b - a) * self.itemsize, plan.ops[i])
        self._complete(i)

    def _complete(self, i: int) -> None:
        """Op ``i`` is done: the ops that waited only for it become ready."""
        self.left -= 1
        pending, ready = self.pending, self.ready
        for u in self.plan.users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)

    def _check_stuck(self) -> None:
        if self.left and not self.handles and not self.ready:
            raise CollectiveError(f"{self.describe()}: schedule cannot progress "
                                  f"({self.left} ops left, nothing in flight)")

    def start(self) -> Run:
        """Post what can be posted and run what is ready, without blocking (a blocking caller
        may go straight to ``wait``)."""
        with self.lock:
            self._advance(block=False)
        return self

    def _advance(self, block: bool, first=None) -> bool:
        """Run the schedule as far as it goes (``block``: to its end); ``first``: a completed
        request ``(index, status)`` of this run to finish before anything else."""
        try:
            if first is not None:
                self._finished(*first)
            while True:
                self._drain()
                if self.left == 0:
                    self._finish_run()
                    return True
                self._check_stuck()
                if block:
                    others = _others(self)
                    if others:
                        self._wait_with(others)
                        continue
                    k, status = self.transport.waitany(self.handles)
                    self._finished(k, status)
                else:
                    done = self.transport.testsome(self.handles)
                    if not done:
                        return False
                    # Finish from the highest index down: swap-removal keeps lower ones valid.
                    for k, status in sorted(done, key=lambda t: -t[0]):
                        self._finished(k, status)
        except BaseException as exc:
            self.error = network_error(exc, self.describe())
            self.done = True
            if self.handles:
                _ABANDONED.append(self)
            if self.error is exc:
                raise
            raise self.error from exc

    def _wait_with(self, others: list) -> None:
        """Block until a request of this run or of ``others`` (locked by this thread, released
        here) completes, and finish it in its own run; the others advance first."""
        try:
            handles, owners = list(self.handles), [(self, k) for k in range(len(self.handles))]
            for r in others:
                try:
                    r._advance(False)
                except Exception:  # noqa: BLE001 - the run keeps its error for its own wait
                    continue
                if not r.done:
                    handles += r.handles
                    owners += [(r, k) for k in range(len(r.handles))]
            k, status = self.transport.waitany(handles)
            run, index = owners[k]
            if run is self:
                self._finished(index, status)
            else:
                try:
                    run._advance(False, (index, status))
                except Exception:  # noqa: BLE001 - as above
                    pass
        finally:
            for r in others:
                r.lock.release()

    def _finish_run(self) -> None:
        if not self.done:
            self.done = True
            if self.on_done is not None:
                self.on_done()

    def wait(self):
        """Run to completion (blocking)."""
        if self.error is not None:
            raise self.error
        if not self.done:
            with self.lock:
                if not self.done:
                    self._advance(block=True)
                elif self.error is not None:  # failed while another thread advanced it
                    raise self.error
        return self

    def test(self) -> bool:
        """Advance without blocking; True when complete. False at once while another thread
        advances this run."""
        if self.error is not None:
            raise self.error
        if self.done:
            return True
        if not self.lock.acquire(False):
            return False
        try:
            if self.done:
                if self.error is not None:
                    raise self.error
                return True
            return self._advance(block=False)
        finally:
            self.lock.release()

    def waiting_for(self) -> str:
        """What this run waits on now (for the watchdog)."""
        parts = []
        for i in self.hops:
            kind, peer, dst, srcs = self.plan.ops[i]
            parts.append(f"{'send to' if kind == SEND else 'recv from'} rank {peer} "
                         f"(op {i} of {len(self.plan.ops)})")
        return "; ".join(parts) or "nothing in flight"


# -- running an API call's schedule --------------------------------------------------------------
@functools.lru_cache(maxsize=512)
def _build(builder, collective, rank, size, count, counts, root, seg, extra):
    s = build(builder, collective, rank, size, count, counts, root, seg, **dict(extra))
    s.validate()
    s.plan()
    return s


def schedule_for(call, builder, extra: tuple = ()):
    """The schedule ``builder`` makes for ``call`` (an API call: ``collectives.dispatch.Call``),
    built once per shape and segment size; ``extra``: further keyword arguments as pairs."""
    counts = None if call.counts is None else tuple(call.counts)
    return _build(builder, call.collective, call.ctx.rank, call.ctx.size, call.x.count, counts,
                  call.root, segment_elems(call.x.dtype.itemsize), extra)


def launch_schedule(call, schedule) -> Run:
    """Bind ``schedule`` to ``call``'s buffers and start it: a ``Run`` (started, unless the call
    blocks: its caller waits at once). Scratch comes from the context's pool and goes back when
    the run ends; device buffers move through the CUDA transports."""
    ctx, x, out = call.ctx, call.x, call.out
    # Out of place, receives land straight in the reduction that consumes them (see
    # Schedule.direct); in place, IN is OUT and they must go through scratch.
    plan = schedule.plan(direct=not call.inplace)
    key = (x.kind, x.device, x.dtype)
    taken = []  # scratch to give back
    tmp = None
    if plan.schedule.tmp:
        tmp = ctx.take_scratch(key, plan.schedule.tmp, lambda n: x.new((n,)).flat)
        taken.append(tmp)
    if out is None:  # reduce on a non-root rank: OUT is scratch
        out_flat = ctx.take_scratch(key, x.count, lambda n: x.new((n,)).flat)[:x.count]
        taken.append(out_flat.base if out_flat.base is not None else out_flat)
    else:
        out_flat = out.flat
    in_flat = out_flat if call.inplace else x.flat
    if x.is_device:
        from . import cuda_transport
        transport = cuda_transport.transport(ctx, x)
    else:
        transport = ctx.transport
    close = getattr(transport, "close", None)  # device transports: wait for queued GPU work
    release = None
    if close is not None or taken:
        def release():
            if close is not None:
                close()
            for arr in taken:
                ctx.give_scratch(key, arr)

    run = Run(plan, in_flat, out_flat, tmp, call.op, transport, ctx.tag(call.seq),
              info=call.describe, on_done=release)
    return run if call.blocking else _track(run.start())
