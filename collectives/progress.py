"""Non-blocking collectives: ``Request`` and the background progress thread.

An ``i*`` call posts its first messages in the caller's thread, then hands the running collective
(a ``Run``, or a native MPI request) to one daemon *progress thread* that drives the collectives
to completion in the order they were started: the same order on every rank, so the thread never
waits on a collective that another rank's thread has not reached. It blocks inside MPI (which
releases the GIL), so the caller keeps computing (autograd, say) while the bytes move.

``Request.wait()`` returns the result; ``Request.test()`` says whether it is complete. Several
requests may be outstanding and waited on in any order. With ``COLLECTIVES_PROGRESS_THREAD=0``
(or ``auto``, the default, on a node with no core to spare: see ``use_thread``) no thread is
started and ``test()``/``wait()`` advance the collective in the caller's thread.
"""
from __future__ import annotations

import atexit
import functools
import os
import queue
import threading

from . import config
from .errors import network_error

__all__ = ["Request", "Done", "DONE", "NativeWork", "Worker", "use_thread", "ulfm_launched"]


def _local_ranks() -> int | None:
    """Ranks on this node, as the launcher says (MPICH's Hydra, Open MPI, Slurm)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def busy_node() -> bool:
    """Whether this node runs at least as many ranks as this rank has cores (launcher's word).

    Read once: the launcher's variables and the cores a rank is bound to are set before it
    starts, and ``use_thread`` asks on every non-blocking call (3 us with the syscall)."""
    local = _local_ranks()
    return local is not None and local >= _cores()


def polite_waits() -> bool:
    """Whether waits poll and yield the core instead of spinning inside MPI.

    ``COLLECTIVES_WAIT=yield`` or ``spin`` decides; by default, yield on a busy node."""
    setting = config.get("COLLECTIVES_WAIT")
    if setting in ("yield", "poll"):
        return True
    if setting in ("spin", "block"):
        return False
    return busy_node()


@functools.lru_cache(maxsize=None)
def ulfm_launched() -> bool:
    """Whether the launcher runs this job under Open MPI's fault tolerance (ULFM: ``mpirun
    --with-ft ulfm`` sets ``OMPI_MCA_mpi_ft_enable`` in every rank); read once."""
    value = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower()
    return value in ("1", "true", "yes", "on", "enabled")


def use_thread() -> bool:
    """Whether ``i*`` collectives get the progress thread (``COLLECTIVES_PROGRESS_THREAD``).

    ``1``: always; ``0``: never (``test``/``wait`` progress them in the caller's thread);
    ``auto`` (default): only when the node has a core to spare for it. MPI waits by spinning,
    so a progress thread on a node with as many ranks as cores takes the core the caller's
    own computation (autograd) needs: measured here, DDP's step was 0.83x gloo's with the
    thread and 0.72x without it at 2 ranks on 2 cores.
    """
    setting = config.get("COLLECTIVES_PROGRESS_THREAD")
    return not busy_node() if setting is None else setting


class Done:
    """Work that completed at once (one rank, no elements)."""

    __slots__ = ()
    done = True
    error = None

    def start(self):
        return self

    def wait(self):
        return self

    def test(self) -> bool:
        return True

    def waiting_for(self) -> str:
        return "nothing"


DONE = Done()  # stateless: one serves every call that completed at once


class NativeWork:
    """A non-blocking collective of the MPI library itself, seen as work."""

    __slots__ = ("request", "done", "error", "info")

    def __init__(self, request, info=""):
        self.request = request
        self.done = False
        self.error = None
        self.info = info

    def start(self):
        return self

    def wait(self):
        if not self.done:
            try:
                self.request.Wait()
            except Exception as exc:
                self.error = network_error(exc, self.info)
                if self.error is exc:
                    raise
                raise self.error from exc
            finally:
                self.done = True
        return self

    def test(self) -> bool:
        if not self.done:
            self.done = bool(self.request.Test())
        return self.done

    def waiting_for(self) -> str:
        return f"the MPI library's own collective ({self.info})"


class Worker:
    """A daemon thread that runs ``handle(item)`` for each ``put(item)``, in order.

    Stopped at exit (an ``atexit`` hook, so before MPI is finalized and before the interpreter
    starts tearing down) and joined, so that it never drops the last reference to a buffer
    while the interpreter finalizes: a daemon thread that frees a torch tensor then is killed
    by the interpreter inside torch's C++ and takes the process down with it ("terminate called
    without an active exception"). ``close()`` (returns at once) or ``stop()`` (joins) may
    also be called earlier; items put after that are never run.
    """

    def __init__(self, name: str, handle):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.handle = handle
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def put(self, item) -> None:
        self.queue.put(item)

    def _loop(self):
        while True:
            item = self.queue.get()
            if item is None:
                return
            self.handle(item)
            item = None  # hold no buffer while idle

    def close(self) -> None:
        """End the thread once the items queued so far are done; returns at once."""
        if not self.closed:
            self.closed = True
            self.queue.put(None)
            atexit.unregister(self.stop)

    def stop(self, timeout: float = 5.0) -> None:
        """Let the items queued so far finish (up to ``timeout`` s), then end the thread."""
        self.close()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)


def _drive(req) -> None:
    """The progress thread's step: run one request's work to completion."""
    try:
        req._work.wait()
    except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
        req._error = exc
    req._release()
    req._event.set()


_THREAD = None
_THREAD_LOCK = threading.Lock()


def _progress_thread() -> Worker:
    """The progress thread: drives started work to completion, first started first."""
    global _THREAD
    with _THREAD_LOCK:
        if _THREAD is None or not _THREAD.thread.is_alive():
            _THREAD = Worker("collectives-progress", _drive)
    return _THREAD


class Request:
    """A collective in flight. ``wait()`` returns its result; ``test()`` polls it."""

    __slots__ = ("_work", "_result", "_finalize", "_event", "_error", "_lock", "_final",
                 "_release_hook", "description", "__weakref__")

    def __init__(self, work, result=None, finalize=None, *, description="", thread=None,
                 release=None):
        self._work = work
        self._result = result
        self._finalize = finalize
        self._error = None
        self._lock = threading.Lock()
        self._final = False
        self._release_hook = release
        self.description = description
        if thread is None:
            thread = use_thread()
        if thread and not work.done:
            self._event = threading.Event()
            _progress_thread().put(self)
        else:
            self._event = None
            if work.done:  # complete already: nothing tracks it but this request
                self._release()

    def _release(self) -> None:
        """The work has ended: let go of whatever tracks it besides this request (``release``,
        the watchdog's entry), so that only the caller's own references keep its buffers."""
        hook, self._release_hook = self._release_hook, None
        if hook is not None:
            hook(self._work)

    def _complete(self):
        with self._lock:
            if not self._final:
                self._final = True
                self._release()
                if self._finalize is not None:
                    self._finalize()
        return self._result

    def wait(self, timeout: float | None = None):
        """Block until complete and return the result (the output array, or None)."""
        if self._event is not None:
            if not self._event.wait(timeout):
                raise TimeoutError(f"{self.description} not complete after {timeout} s")
            if self._error is not None:
                raise self._error
        else:
            try:
                self._work.wait()
            except BaseException:
                self._release()
                raise
        return self._complete()

    def test(self) -> bool:
        """True once complete (then ``wait()`` returns at once); never blocks."""
        if self._event is not None:
            done = self._event.is_set()
            if done and self._error is not None:
                raise self._error
        else:
            done = self._work.test()
        if done:
            self._complete()
        return done

    def is_completed(self) -> bool:
        """torch-style alias of ``test()``."""
        return self.test()

    def __repr__(self):
        state = "done" if self._final or (self._event is not None and self._event.is_set()) \
            else "in flight"
        return f"<collectives.Request {self.description} {state}>"
