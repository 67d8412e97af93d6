"""Point-to-point messages outside schedules: pipeline stages, the parameter server, headers.

The executor moves a schedule's messages; everything else that one rank sends to another goes
through here, so there is one wire format for a typed array and one way to wait:

- a **typed header** is ``HEADER`` int64 words: the dtype's code (its index in
  ``buffers.DTYPES``, the one dtype table), the number of axes, then up to ``MAXDIM`` axis
  lengths (``header``, ``parse``);
- **send and receive** of numpy arrays and torch tensors are the buffer-based, capitalised
  mpi4py calls on a flat byte view of the caller's memory (``isend``, ``irecv``, ``send``,
  ``recv``): no copy, no pickle. A strided array is refused (``buffers.wrap``), never copied
  in secret. A receive checks the bytes that arrived against the bytes expected before any
  land (``MessageSizeError`` naming both); ``send_typed`` and ``recv_typed`` put the header
  in front, so the receiver allocates the array and a receiver that expects another dtype or
  shape gets a ``MessageTypeError`` naming both;
- **one wait**, ``wait(test, ...)``: polls ``test`` and, between polls, yields the core
  (``idle``: on a node with no core to spare, a rank that spins inside MPI takes the core its
  peer computes on), then sleeps in 0.1 ms steps once the peer is far behind. A wait that does
  not finish at once is registered with the watchdog as this rank's own (``watch_local``), so
  ``COLLECTIVES_STALL_WARNING`` and ``COLLECTIVES_TIMEOUT`` bound it and the report names what
  it waits for and from whom. Every ``what`` (the task in words, for the report and the
  errors) is a string or a function that makes it, called only when it is needed;
- ``Sends``: sends in flight with the buffers they read, released as they complete.
"""
from __future__ import annotations

import os
import time

import numpy as np

from . import watchdog
from .buffers import DTYPES, wrap
from .errors import CollectiveError, MessageSizeError
from .progress import polite_waits, ulfm_launched

__all__ = ["MAXDIM", "HEADER", "MessageTypeError", "code_of", "dtype_of", "header", "parse",
           "signature", "describe", "as_bytes", "empty", "isend", "irecv", "send", "recv",
           "send_typed", "recv_typed", "probe", "recv_header", "recv_probed", "Sends",
           "wait", "wait_all", "idle"]

MAXDIM = 8                 # axes a typed header carries
HEADER = 2 + MAXDIM        # int64 words: dtype code, number of axes, axis lengths

_CODES = {dt: i for i, dt in enumerate(DTYPES)}
_TORCH_OF: dict = {}       # numpy dtype -> torch dtype, filled on first use (torch is optional)
_NUMPY_OF: dict = {}       # torch dtype -> numpy dtype


class MessageTypeError(CollectiveError, TypeError):
    """A typed message's dtype or shape is not the one its receiver expects."""


# -- the typed header ----------------------------------------------------------------------------
def _torch_tables():
    if not _TORCH_OF:
        import torch

        from .buffers import torch_dtype_to_numpy
        for t in (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                  torch.float16, torch.float32, torch.float64, torch.complex64,
                  torch.complex128, torch.bfloat16):
            dt = torch_dtype_to_numpy(t)
            _TORCH_OF[dt], _NUMPY_OF[t] = t, dt
    return _TORCH_OF, _NUMPY_OF


def _numpy_dtype(dtype) -> np.dtype:
    """``dtype`` (numpy's, a name, or torch's) as a numpy dtype."""
    if isinstance(dtype, np.dtype):
        return dtype
    if type(dtype).__module__ == "torch":
        found = _torch_tables()[1].get(dtype)
        if found is None:
            raise TypeError(f"unsupported torch dtype {dtype}; supported: "
                            f"{', '.join(str(t) for t in _torch_tables()[1])}")
        return found
    return np.dtype(dtype)


def code_of(dtype) -> int:
    """The wire code of ``dtype`` (numpy or torch): its index in ``buffers.DTYPES``."""
    dt = _numpy_dtype(dtype)
    code = _CODES.get(dt)
    if code is None:
        raise TypeError(f"unsupported dtype {dt.name}; supported: "
                        f"{', '.join(d.name for d in DTYPES)}")
    return code


def dtype_of(code: int) -> np.dtype:
    """The numpy dtype of wire code ``code`` (``MessageTypeError`` for a code out of range)."""
    code = int(code)
    if not 0 <= code < len(DTYPES):
        raise MessageTypeError(f"dtype code {code} is not one of the {len(DTYPES)} known")
    return DTYPES[code]


def header(dtype, shape, out: np.ndarray | None = None) -> np.ndarray:
    """The typed header of an array of ``dtype`` and ``shape`` (into ``out``, ``HEADER``
    int64 words, where given)."""
    shape = tuple(shape)
    if len(shape) > MAXDIM:
        raise ValueError(f"a typed message carries {MAXDIM} axes at most, got {len(shape)} "
                         f"(shape {shape})")
    hdr = np.zeros(HEADER, np.int64) if out is None else out
    hdr[0], hdr[1] = code_of(dtype), len(shape)
    hdr[2:2 + len(shape)] = shape
    hdr[2 + len(shape):] = 0
    return hdr


def parse(hdr) -> tuple[np.dtype, tuple[int, ...]]:
    """``(dtype, shape)`` of a typed header."""
    ndim = int(hdr[1])
    if not 0 <= ndim <= MAXDIM:
        raise MessageTypeError(f"a typed header of {ndim} axes (at most {MAXDIM})")
    return dtype_of(hdr[0]), tuple(int(n) for n in hdr[2:2 + ndim])


def signature(x) -> tuple[np.dtype, tuple[int, ...]]:
    """``(numpy dtype, shape)`` of a numpy array or torch tensor."""
    return _numpy_dtype(x.dtype), tuple(x.shape)


def describe(dtype, shape) -> str:
    """An array's dtype and shape in words: ``float32 (4, 3)``."""
    return f"{_numpy_dtype(dtype).name} {tuple(shape)}"


def as_bytes(x, what: str = "buffer") -> np.ndarray:
    """The bytes of ``x`` (numpy array or CPU torch tensor) as a flat uint8 numpy view: no
    copy; a strided ``x`` is a ``ValueError`` (``buffers.wrap``)."""
    flat = wrap(x, what).flat
    if not isinstance(flat, np.ndarray):
        raise TypeError(f"{what}: point-to-point messages carry host memory; got "
                        f"{type(x).__name__} on a device")
    return flat.view(np.uint8)


def empty(dtype, shape, kind: str = "numpy"):
    """An uninitialised array of ``dtype`` and ``shape``: numpy's, or a torch tensor."""
    dt = _numpy_dtype(dtype)
    if kind == "numpy":
        return np.empty(shape, dt)
    if kind != "torch":
        raise ValueError(f"kind is 'numpy' or 'torch', got {kind!r}")
    import torch
    t = _torch_tables()[0].get(dt)
    if t is None:
        raise MessageTypeError(f"torch has no dtype for {dt.name}")
    return torch.empty(shape, dtype=t)


# -- messages ------------------------------------------------------------------------------------
def _mpi():
    from mpi4py import MPI
    return MPI


def isend(comm, x, dest: int, tag: int):
    """Post a send of ``x``'s bytes: the MPI request. ``x`` must not change or be freed until
    it completes (``Sends`` keeps it)."""
    return comm.Isend([as_bytes(x, "send buffer"), _mpi().BYTE], dest, tag)


def irecv(comm, out, source: int, tag: int):
    """Post a receive into ``out``'s bytes: the MPI request (no size check: ``recv`` checks)."""
    return comm.Irecv([as_bytes(out, "receive buffer"), _mpi().BYTE], source, tag)


def send(comm, x, dest: int, tag: int, what="") -> None:
    """Send ``x``'s bytes to ``dest``; the wait is watched (``what``: the message in words)."""
    req = isend(comm, x, dest, tag)
    wait(req.Test, what or "a point-to-point send", lambda: f"send to rank {dest} (tag {tag}, "
         f"{describe(*signature(x))})", comm)


def probe(comm, source: int, tag: int, what=""):
    """Wait (watched) for a message from ``source`` with ``tag`` (either may be ``ANY_*``):
    ``(matched message, status)``, taken from MPI's queue so no other receive can have it."""
    MPI = _mpi()
    status = MPI.Status()
    found: list = []

    def test() -> bool:
        msg = comm.Improbe(source, tag, status)
        if msg is None:
            return False
        found.append(msg)
        return True
    wait(test, what or "a point-to-point receive",
         lambda: f"a message from {_peer(source)} ({_tag(tag)})", comm)
    return found[0], status


def recv_probed(msg, status, out, what=""):
    """Receive matched message ``msg`` into ``out``, after checking its size: a message of
    another size is taken off the wire all the same (the stream stays in step) and raises
    ``MessageSizeError`` naming both sizes."""
    MPI = _mpi()
    view = as_bytes(out, "receive buffer")
    got = status.Get_count(MPI.BYTE)
    if got != view.nbytes:
        msg.Recv([bytearray(got), got, MPI.BYTE])
        raise MessageSizeError(f"{_text(what)}: expected {view.nbytes} "
                               f"bytes ({describe(*signature(out))}) from rank "
                               f"{status.Get_source()} (tag {status.Get_tag()}), received {got}")
    msg.Recv([view, MPI.BYTE])
    return out


def recv(comm, out, source: int, tag: int, what=""):
    """Receive exactly ``out``'s bytes from ``source`` into ``out`` (watched wait; a message of
    another size is a ``MessageSizeError``)."""
    msg, status = probe(comm, source, tag, what)
    return recv_probed(msg, status, out, what)


def recv_header(msg) -> tuple[np.dtype, tuple[int, ...]]:
    """``(dtype, shape)`` from matched message ``msg``, a typed header."""
    hdr = np.empty(HEADER, np.int64)
    msg.Recv([hdr, _mpi().INT64_T])
    return parse(hdr)


def send_typed(comm, x, dest: int, tag: int, sends: Sends | None = None) -> Sends:
    """Post ``x``'s typed header, then its bytes, both on ``tag`` (MPI's non-overtaking rule
    delivers them in that order); into ``sends`` (a new ``Sends`` if None), returned."""
    view = as_bytes(x, "send buffer")  # refused before anything is posted
    hdr = header(*signature(x))
    sends = Sends() if sends is None else sends
    sends.add(comm.Isend([hdr, _mpi().INT64_T], dest, tag), hdr)
    sends.add(comm.Isend([view, _mpi().BYTE], dest, tag), x)
    return sends


def recv_typed(comm, source: int, tag: int, kind: str = "numpy", expect=None, what=""):
    """A typed message (``send_typed``) from ``source``: a new array of ``kind`` (``numpy`` or
    ``torch``). ``expect=(dtype, shape)``: anything else is a ``MessageTypeError`` naming both
    (its data is taken off the wire all the same)."""
    msg, _ = probe(comm, source, tag, what)
    dtype, shape = recv_header(msg)
    msg, status = probe(comm, source, tag, what)
    if expect is not None:
        want = (_numpy_dtype(expect[0]), tuple(expect[1]))
        if want != (dtype, shape):
            got = status.Get_count(_mpi().BYTE)
            msg.Recv([bytearray(got), got, _mpi().BYTE])
            raise MessageTypeError(f"{_text(what)}: expected "
                                   f"{describe(*want)} from rank {source} (tag {tag}), "
                                   f"received {describe(dtype, shape)}")
    return recv_probed(msg, status, empty(dtype, shape, kind), what)


class Sends:
    """Sends in flight and the buffers they read: a buffer is released (may be freed by its
    owner) once its send completed. ``reap`` drops the completed ones; ``wait`` all of them."""

    __slots__ = ("requests", "buffers")

    def __init__(self):
        self.requests: list = []
        self.buffers: list = []

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request, buffer=None) -> None:
        """Keep ``buffer`` until ``request`` completes."""
        self.requests.append(request)
        self.buffers.append(buffer)

    def reap(self) -> None:
        """Release the sends that have completed (``MPI_Testsome``; under ULFM each tested
        alone, as in ``_test_each``)."""
        if not self.requests:
            return
        if ulfm_launched():
            done = [i for i, r in enumerate(self.requests) if r.Test()]
        else:
            done = _mpi().Request.Testsome(self.requests)
        if done:
            gone = set(done)
            keep = [i for i in range(len(self.requests)) if i not in gone]
            self.requests = [self.requests[i] for i in keep]
            self.buffers = [self.buffers[i] for i in keep]

    def wait(self, what: str, comm) -> None:
        """Complete every send (watched wait: ``what`` in the report), releasing them."""
        reqs = self.requests
        wait_all(reqs, what, comm, lambda: f"{len(reqs)} sends to complete")
        self.requests, self.buffers = [], []


# -- the one wait --------------------------------------------------------------------------------
class _Waiting:
    """The watchdog's view of a wait: what it waits for, in words (made only when asked)."""

    __slots__ = ("text",)
    done = False  # as the watchdog reads a work's state: the wait ends its entry itself

    def __init__(self, text):
        self.text = text

    def waiting_for(self) -> str:
        return self.text() if callable(self.text) else self.text


def wait(test, what, waiting_for, comm) -> None:
    """Return once ``test()`` is true, polling it and yielding the core in between (``idle``).

    A wait that does not end at the first poll is registered with the watchdog as this rank's
    own on ``comm``: ``what`` (the rank's task in words; a string, or a function that makes
    it, called only then) and ``waiting_for`` (the message or peer awaited, likewise) are
    what a stall warning or the timeout prints before the job is aborted.
    """
    if test():
        return
    entry = None
    if watchdog.enabled():
        entry = watchdog.watch_local(comm, what() if callable(what) else what,
                                     _Waiting(waiting_for))
    try:
        spin = 0 if polite_waits() else SPIN
        spins = 0
        while not test():
            spins += 1
            idle(spins, spin)
    finally:
        if entry is not None:
            entry.end()


def wait_all(requests: list, what, comm, waiting_for=None) -> None:
    """``wait`` for every MPI request of ``requests`` (``MPI_Testall``; ``_test_each`` under
    ULFM)."""
    if not requests:
        return
    testall = _test_each if ulfm_launched() else _mpi().Request.Testall
    wait(lambda: testall(requests), what,
         waiting_for or (lambda: f"{len(requests)} messages to complete"), comm)


def _test_each(requests: list) -> bool:
    """Whether every request is complete, each tested alone (``MPI_Test``: a completed one
    becomes ``MPI_REQUEST_NULL``). Under Open MPI's fault tolerance a test of several requests
    (``MPI_Testall``, ``MPI_Testsome``) that meets a revoked communicator marks every pending
    request it scans as failed and frees them, sends to live peers still in flight included,
    and their later completion aborts the job (``collectives.executor`` tests one at a time for
    the same reason; docs/elastic.md)."""
    return all(r.Test() for r in requests)


SPIN = 1 << 12   # polls before yielding where the node has a core to spare for each rank
FAR = 1 << 16    # yields before sleeping: the peer is far behind, stop burning the core


def idle(spins: int, spin: int = 0) -> None:
    """The ``spins``-th poll of a rank with nothing else to do: after ``spin`` polls yield the
    core (oversubscribed ranks give it to the one we wait for), and past ``FAR`` more sleep
    0.1 ms at a time (a peer far behind: stop burning a core)."""
    if spins > spin:
        if spins < spin + FAR:
            os.sched_yield()
        else:
            time.sleep(1e-4)


def _text(what) -> str:
    """``what`` in words: a string, or a function that makes it (called only when needed)."""
    text = what() if callable(what) else what
    return text or "point-to-point receive"


def _peer(source: int) -> str:
    return "any rank" if source == _mpi().ANY_SOURCE else f"rank {source}"


def _tag(tag: int) -> str:
    return "any tag" if tag == _mpi().ANY_TAG else f"tag {tag}"
