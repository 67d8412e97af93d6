"""How the bytes of device buffers move: handed to a CUDA-aware MPI, or staged through pinned
host memory (the buffers themselves: ``collectives.cuda``).

Transport (``transport(ctx, buf)``, one per collective on device buffers)
    - Aware (``cuda.aware()``): ``DirectTransport`` hands the device views to MPI, after
      synchronizing the stream whose kernels produced them (MPI has no notion of streams).
    - Not aware: ``StagingTransport`` wraps the MPI transport. A send is copied device->host into
      a pinned block on a copy stream, and its ``Isend`` is posted when that copy has landed; a
      receive lands in a pinned block and is copied host->device on a second copy stream, which
      the compute stream then waits for. Since the schedules cut chunks into segments, the copy
      of segment k+1 overlaps the transfer of segment k, both directions at once.

Streams
    Work queued on the caller's current stream (cupy's, and torch's for tensors) comes before
    any of ours: our first stream waits for it, and no byte leaves before the kernels that made
    it have run. The executor may run one collective from two threads (the caller's, then the
    progress thread); every entry into the transport chains the calling thread's current stream
    after the previous one, so the collective's kernels form one ordered sequence. When the
    collective completes, the transport blocks until its last kernel and copy are done: from
    ``wait()`` (or a blocking call's return) on, the result is complete for any stream.

Native and direct algorithms
    ``native(call, dispatch)``: the MPI library's own collective on device views when it is
    CUDA-aware and the reduction is one of its builtins; else the whole buffer is staged through
    pinned host memory around the host collective. ``staged(call, dispatch)`` does the same for
    direct algorithms that only work on host memory (``shm``).

Backends
    The device operations sit behind a small interface (``CupyDevice``); ``register_backend``
    adds another for a device-name prefix. The CPU tests register a fake device whose copies
    happen late, on their own queue, to prove the staging logic without a GPU.

Pinned memory: ``COLLECTIVES_PINNED_CACHE_BYTES`` bounds what the pool keeps for reuse.
"""
from __future__ import annotations

import copy
import threading
from collections import deque

import numpy as np

from . import config
from .buffers import Buffer
from .cuda import aware, import_cupy
from .errors import CollectiveError
from .schedule import RECV, SEND

__all__ = ["transport", "native", "staged", "DirectTransport", "StagingTransport", "PinnedPool",
           "CupyDevice", "register_backend", "device", "MIN_BLOCK"]

MIN_BLOCK = 4096  # the smallest pinned block


# -- device backends -----------------------------------------------------------------------------
class CupyDevice:
    """The device operations the transports need, on one CUDA device through cupy."""

    def __init__(self, index: int):
        self.cp = import_cupy()
        import cupyx
        self.cupyx = cupyx
        self.rt = self.cp.cuda.runtime
        self.index = index

    def activate(self) -> None:
        """Make this device current in the calling thread (the progress thread starts on 0)."""
        if self.rt.getDevice() != self.index:
            self.rt.setDevice(self.index)

    def current_stream(self):
        """The calling thread's current cupy stream."""
        return self.cp.cuda.get_current_stream()

    @staticmethod
    def key(stream) -> int:
        """A stream's identity (equal for two handles of one stream)."""
        return stream.ptr

    def new_stream(self):
        """A fresh non-blocking stream on this device."""
        self.activate()
        return self.cp.cuda.Stream(non_blocking=True)

    def record(self, stream):
        """An event recorded on ``stream`` now."""
        event = self.cp.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    @staticmethod
    def wait(stream, event) -> None:
        """Make ``stream`` wait for ``event``."""
        stream.wait_event(event)

    @staticmethod
    def query(event) -> bool:
        """Whether ``event`` has completed."""
        return event.done

    @staticmethod
    def synchronize(event) -> None:
        """Block until ``event`` has completed."""
        event.synchronize()

    def pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory: the copy engines reach it without a bounce buffer."""
        return self.cupyx.empty_pinned((nbytes,), dtype=np.uint8)

    def to_host(self, host, dev, stream) -> None:
        """Queue a copy of device view ``dev`` into host array ``host`` on ``stream``."""
        if host.nbytes:
            self.rt.memcpyAsync(host.ctypes.data, dev.data.ptr, host.nbytes,
                                self.rt.memcpyDeviceToHost, stream.ptr)

    def to_device(self, dev, host, stream) -> None:
        """Queue a copy of host array ``host`` into device view ``dev`` on ``stream``."""
        if host.nbytes:
            self.rt.memcpyAsync(dev.data.ptr, host.ctypes.data, host.nbytes,
                                self.rt.memcpyHostToDevice, stream.ptr)

    def caller_streams(self, buf) -> list:
        """Streams besides cupy's current one whose queued work must come first (torch's)."""
        if buf.kind != "torch":
            return []
        import torch
        return [self.external_stream(torch.cuda.current_stream(self.index).cuda_stream)]

    def external_stream(self, handle: int):
        """cupy's view of another library's stream (a ``cudaStream_t`` as an int): through the
        CUDA stream protocol where cupy has it (cupy >= 14 deprecates ``ExternalStream``)."""
        from_external = getattr(self.cp.cuda.Stream, "from_external", None)
        if from_external is not None:
            return from_external(_StreamHandle(handle))
        return self.cp.cuda.ExternalStream(handle)


class _StreamHandle:
    """A raw stream handle that speaks the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_BACKENDS: dict = {"cuda": CupyDevice}
_STATES: dict = {}
_STATES_LOCK = threading.Lock()


def register_backend(prefix: str, factory) -> None:
    """Use ``factory(index)`` for buffers whose device is ``"<prefix>:<index>"``."""
    _BACKENDS[prefix] = factory


class _DeviceState:
    """Per device, process-wide: the backend, the pinned pool and idle copy-stream pairs."""

    def __init__(self, backend):
        self.device = backend
        self.pool = PinnedPool(backend)
        self._streams: list = []
        self._lock = threading.Lock()

    def take_streams(self):
        with self._lock:
            if self._streams:
                return self._streams.pop()
        return self.device.new_stream(), self.device.new_stream()

    def give_streams(self, pair) -> None:
        with self._lock:
            self._streams.append(pair)


def _state(name: str) -> _DeviceState:
    with _STATES_LOCK:
        state = _STATES.get(name)
        if state is None:
            prefix, _, index = name.partition(":")
            factory = _BACKENDS.get(prefix)
            if factory is None:
                raise TypeError(f"no device backend for {name!r}; known: {sorted(_BACKENDS)}")
            state = _STATES[name] = _DeviceState(factory(int(index or 0)))
    return state


def device(name: str):
    """The backend object that serves device ``name`` (e.g. ``"cuda:0"``)."""
    return _state(name).device


# -- pinned host memory --------------------------------------------------------------------------
class PinnedPool:
    """Page-locked host blocks for staging, reused across messages and calls (thread-safe).

    Blocks come in power-of-two sizes; at most ``limit`` bytes of them are kept for reuse
    (default ``COLLECTIVES_PINNED_CACHE_BYTES``). A block given back with a copy still queued
    on it (``give(block, event)``) is reused only once that copy is done.
    """

    def __init__(self, backend, limit: int | None = None):
        self.device = backend
        self.limit = config.get("COLLECTIVES_PINNED_CACHE_BYTES") if limit is None else limit
        self.free: dict[int, list] = {}
        self.pending: deque = deque()
        self.cached = 0
        self.allocated = 0  # bytes ever allocated (tests and diagnostics)
        self._lock = threading.Lock()

    @staticmethod
    def size_class(nbytes: int) -> int:
        """The block size that holds ``nbytes``: a power of two, at least ``MIN_BLOCK``."""
        return max(MIN_BLOCK, 1 << max(0, nbytes - 1).bit_length())

    def take(self, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` (uint8); slice it to the length you need."""
        size = self.size_class(nbytes)
        with self._lock:
            self._reclaim()
            blocks = self.free.get(size)
            if blocks:
                self.cached -= size
                return blocks.pop()
            self.allocated += size
        return self.device.pinned(size)

    def give(self, block, event=None) -> None:
        """Return ``block``; with ``event``, only once that event (its last copy) is done."""
        with self._lock:
            if event is not None and not self.device.query(event):
                self.pending.append((event, block))
                return
            self._keep(block)

    def _reclaim(self) -> None:
        while self.pending and self.device.query(self.pending[0][0]):
            self._keep(self.pending.popleft()[1])

    def _keep(self, block) -> None:
        if self.cached + block.nbytes <= self.limit:
            self.free.setdefault(block.nbytes, []).append(block)
            self.cached += block.nbytes
        # else dropped: the memory is freed when the array is garbage-collected


# -- transports ----------------------------------------------------------------------------------
class _DeviceTransport:
    """What both device transports share: stream chaining and the completion barrier."""

    def __init__(self, inner, backend, callers=()):
        self.inner = inner
        self.device = backend
        backend.activate()
        self.last = backend.current_stream()
        for stream in callers:  # e.g. torch's current stream, when it is not cupy's
            if backend.key(stream) != backend.key(self.last):
                backend.wait(self.last, backend.record(stream))

    def _enter(self):
        """The calling thread's current stream, ordered after everything queued so far."""
        dev = self.device
        dev.activate()
        cur = dev.current_stream()
        if dev.key(cur) != dev.key(self.last):
            dev.wait(cur, dev.record(self.last))
            self.last = cur
        return cur

    def close(self) -> None:
        """Block until every kernel and copy of this collective is done (called at completion)."""
        cur = self._enter()
        self.device.synchronize(self.device.record(cur))


class DirectTransport(_DeviceTransport):
    """Device views straight to a CUDA-aware MPI, each after its producer kernels finished."""

    def _ready(self) -> None:
        # MPI reads and writes device memory outside any stream: earlier kernels that make
        # (send) or still read (recv into a reused region) these bytes must have run.
        cur = self._enter()
        self.device.synchronize(self.device.record(cur))

    def isend(self, view, peer: int, tag: int):
        """Post a send of ``view`` to ``peer`` (the transport interface)."""
        self._ready()
        return self.inner.isend(view, peer, tag)

    def irecv(self, view, peer: int, tag: int):
        """Post a receive into ``view`` from ``peer`` (the transport interface)."""
        self._ready()
        return self.inner.irecv(view, peer, tag)

    def waitany(self, handles):
        """Block until one of ``handles`` completes; ``(index, status)``."""
        self._enter()
        return self.inner.waitany(handles)

    def testsome(self, handles):
        """The ``(index, status)`` of the ``handles`` that have completed."""
        self._enter()
        return self.inner.testsome(handles)

    def finish(self, handle, status, nbytes: int, op) -> None:
        """Check a completed message (the transport interface)."""
        self.inner.finish(handle, status, nbytes, op)


_COPYING, _WIRE, _DONE = 0, 1, 2


class _Message:
    """One staged message: its device view, its pinned block and where it stands."""

    __slots__ = ("kind", "view", "peer", "tag", "block", "host", "req", "event", "state")

    def __init__(self, kind, view, peer, tag, block):
        self.kind, self.view, self.peer, self.tag = kind, view, peer, tag
        self.block = block
        self.host = block[:view.nbytes]
        self.req = self.event = None
        self.state = _COPYING


class StagingTransport(_DeviceTransport):
    """Device memory staged through pinned host blocks around a host transport (``inner``).

    A send goes ``_COPYING`` (device->host copy queued) -> ``_WIRE`` (``Isend`` posted, in the
    order the executor posted the sends, since the copy stream is FIFO) -> ``_DONE``. A receive
    is ``_WIRE`` at once (``Irecv`` into its block) and ``_DONE`` once the host->device copy is
    queued and the current stream told to wait for it; its block returns to the pool when that
    copy is done.
    """

    def __init__(self, inner, backend, pool, *, streams=None, callers=(), on_close=None):
        super().__init__(inner, backend, callers)
        self.pool = pool
        self.streams = streams if streams is not None else (backend.new_stream(),
                                                            backend.new_stream())
        self.d2h, self.h2d = self.streams
        self.copying: deque = deque()
        self.on_close = on_close

    def isend(self, view, peer: int, tag: int):
        """Post a send of ``view`` to ``peer`` (the transport interface)."""
        cur = self._enter()
        dev = self.device
        m = _Message(SEND, view, peer, tag, self.pool.take(view.nbytes))
        dev.wait(self.d2h, dev.record(cur))  # the kernels that made these bytes come first
        dev.to_host(m.host, view, self.d2h)
        m.event = dev.record(self.d2h)
        self.copying.append(m)
        return m

    def irecv(self, view, peer: int, tag: int):
        """Post a receive into ``view`` from ``peer`` (the transport interface)."""
        self._enter()
        m = _Message(RECV, view, peer, tag, self.pool.take(view.nbytes))
        m.req = self.inner.irecv(m.host, peer, tag)
        m.state = _WIRE
        return m

    def _post_copied(self) -> None:
        """Post the ``Isend`` of every send whose device->host copy has landed, in order."""
        dev, copying = self.device, self.copying
        while copying and dev.query(copying[0].event):
            m = copying.popleft()
            m.event = None
            m.req = self.inner.isend(m.host, m.peer, m.tag)
            m.state = _WIRE

    def _arrived(self, m: _Message, status, cur) -> None:
        """``m``'s transfer completed on the wire."""
        self.inner.finish(m.req, status, m.host.nbytes, (m.kind, m.peer, None, ()))
        m.req = None
        if m.kind == RECV:
            dev = self.device
            dev.wait(self.h2d, dev.record(cur))  # earlier kernels on this region come first
            dev.to_device(m.view, m.host, self.h2d)
            landed = dev.record(self.h2d)
            dev.wait(cur, landed)  # ... and every later kernel sees the bytes
            self.pool.give(m.block, landed)
        else:
            self.pool.give(m.block)
        m.block = m.host = None
        m.state = _DONE

    def _test_wire(self, handles, cur) -> bool:
        wire = [m for m in handles if m.state == _WIRE]
        if not wire:
            return False
        done = self.inner.testsome([m.req for m in wire])
        for j, status in done:
            self._arrived(wire[j], status, cur)
        return bool(done)

    def testsome(self, handles):
        """The ``(index, status)`` of the ``handles`` that have completed."""
        cur = self._enter()
        self._post_copied()
        self._test_wire(handles, cur)
        return [(k, None) for k, m in enumerate(handles) if m.state == _DONE]

    def waitany(self, handles):
        """Block until one of ``handles`` completes; ``(index, status)``."""
        cur = self._enter()
        while True:
            self._post_copied()
            for k, m in enumerate(handles):
                if m.state == _DONE:
                    return k, None
            if self.copying:
                # A send waits for its copy: keep MPI progressing, then wait out the oldest
                # copy (bounded: it depends on the GPU alone, never on a peer).
                if not self._test_wire(handles, cur):
                    self.device.synchronize(self.copying[0].event)
                continue
            wire = [m for m in handles if m.state == _WIRE]
            if not wire:
                raise CollectiveError("staging transport: nothing in flight to wait for")
            j, status = self.inner.waitany([m.req for m in wire])
            self._arrived(wire[j], status, cur)

    def finish(self, handle, status, nbytes: int, op) -> None:
        """Check a completed message (the transport interface)."""
        pass  # checked in _arrived, while the inner status was still ours

    def close(self) -> None:
        super().close()
        if self.on_close is not None:
            self.on_close(self.streams)


def transport(ctx, buf):
    """The transport of one collective on device buffer ``buf`` (direct or staged)."""
    state = _state(buf.device)
    callers = state.device.caller_streams(buf)
    if aware():
        return DirectTransport(ctx.transport, state.device, callers)
    return StagingTransport(ctx.transport, state.device, state.pool,
                            streams=state.take_streams(), callers=callers,
                            on_close=state.give_streams)


# -- algorithm="native" ----------------------------------------------------------------------------
def _builtin(op) -> bool:
    """Whether MPI reduces ``op`` itself (a user-defined op's kernel would get device pointers)."""
    if op is None:
        return True
    from .native import mpi_type_op
    return mpi_type_op(op)[0].is_predefined


def native(call, dispatch):
    """``dispatch(call)`` (the host native path) for a call on device buffers."""
    state = _state(call.x.device)
    callers = state.device.caller_streams(call.x)
    if aware() and _builtin(call.op):
        dev = state.device
        dev.activate()
        for stream in [dev.current_stream(), *callers]:
            dev.synchronize(dev.record(stream))
        return dispatch(call)
    return _Staged(call, dispatch, state, callers)


def staged(call, dispatch):
    """``dispatch(host_call)`` on pinned host copies of ``call``'s device buffers; the result
    is copied back when the work completes (for algorithms that only work on host memory)."""
    state = _state(call.x.device)
    return _Staged(call, dispatch, state, state.device.caller_streams(call.x))


class _Staged:
    """A host collective run on pinned host copies of device buffers; copies back at the end."""

    __slots__ = ("work", "done", "error", "_state", "_streams", "_blocks", "_back")

    def __init__(self, call, dispatch, state, callers):
        self.done = False
        self.error = None
        self._state = state
        self._blocks = []
        dev = state.device
        dev.activate()
        # Host collectives read and write outside any stream: everything queued before the
        # call (the input's producers, the output's earlier readers) must have run.
        for stream in [dev.current_stream(), *callers]:
            dev.synchronize(dev.record(stream))
        self._streams = state.take_streams()
        rank, coll = call.ctx.rank, call.collective
        needs_in = not (coll == "broadcast" and rank != call.root)
        hx = self._host(call.x)
        if needs_in:
            dev.to_host(_bytes(hx.flat), _bytes(call.x.flat), self._streams[0])
            dev.synchronize(dev.record(self._streams[0]))
        if call.inplace:
            hout = hx
        elif call.out is None:
            hout = None
        else:
            hout = self._host(call.out)
        back = call.out is not None and not (coll == "broadcast" and rank == call.root)
        self._back = (hout.flat, call.out.flat) if back and call.out.count else None
        host = copy.copy(call)  # the same call, on the host blocks
        host.x, host.out = hx, hout
        self.work = dispatch(host)

    def _host(self, buf) -> Buffer:
        block = self._state.pool.take(buf.flat.nbytes)
        self._blocks.append(block)
        flat = block[:buf.flat.nbytes].view(buf.dtype)
        return Buffer(flat, flat, (buf.count,), "numpy")

    def _finish(self) -> None:
        dev = self._state.device
        if self._back is not None:
            src, dst = self._back
            dev.activate()
            stream = self._streams[1]
            dev.wait(stream, dev.record(dev.current_stream()))
            dev.to_device(_bytes(dst), _bytes(src), stream)
            dev.synchronize(dev.record(stream))
        for block in self._blocks:
            self._state.pool.give(block)
        self._blocks = []
        self._state.give_streams(self._streams)
        self.done = True

    def start(self):
        return self

    def wait(self):
        if self.error is not None:
            raise self.error
        if not self.done:
            try:
                self.work.wait()
                self._finish()
            except BaseException as exc:
                self.error, self.done = exc, True
                raise
        return self

    def test(self) -> bool:
        if self.error is not None:
            raise self.error
        if not self.done and self.work.test():
            self._finish()
        return self.done

    def waiting_for(self) -> str:
        return f"{self.work.waiting_for()} (staged through host memory)"


def _bytes(arr):
    return arr.view(np.uint8) if arr.dtype != np.uint8 else arr
