"""The side channel between the watchdogs of one communicator's ranks: questions and answers
over the toolkit's private communicator, with a tag no collective uses."""
from __future__ import annotations

import sys
import threading

from . import registry

__all__ = ["Channel", "MPI_LOCK", "stopping", "stop", "write"]

# -- the side channel: one per communicator context ----------------------------------------------
MPI_LOCK = threading.Lock()   # the thread's MPI calls vs communicator teardown and exit
_STOPPED: list = []           # non-empty once the process exits: no more MPI calls


def stopping() -> bool:
    """Whether the process is exiting (no more MPI calls from the watchdog)."""
    return bool(_STOPPED)


def stop() -> None:
    """At exit: the watchdog makes no MPI call from now on."""
    with MPI_LOCK:
        _STOPPED.append(True)


class Channel:
    """Questions and answers between the watchdogs of one communicator's ranks.

    Messages are pickled tuples on the private communicator with tag ``TAG_UB``: collectives
    use tags ``seq % TAG_UB``, so they never match these.
    """

    def __init__(self, ctx):
        self.ctx = ctx
        self.comm = ctx.comm
        self.rank, self.size = ctx.rank, ctx.size
        self.tag = ctx.tag_ub
        self.sends: list = []
        self.told: set = set()       # (asker, seq) already printed
        self.closed = False
        self.entry = registry.Entry.blocking(ctx)  # the blocking calls' (``enter``)
        registry.CHANNELS.append(self)

    def close(self) -> None:
        """Called by ``Context.free`` before the communicator is freed."""
        with MPI_LOCK:
            self.closed = True
            if self in registry.CHANNELS:
                registry.CHANNELS.remove(self)

    def poll(self):
        """The next message for this rank's watchdog, or None (also once the channel has
        failed: ``fail``)."""
        from mpi4py import MPI
        with MPI_LOCK:
            if self.closed or stopping() or MPI.Is_finalized():
                return None
            try:
                msg = self.comm.improbe(MPI.ANY_SOURCE, self.tag)
                return None if msg is None else msg.recv()
            except Exception as exc:  # noqa: BLE001 - a dead peer, a revoked communicator
                self.fail(exc)
                return None

    def fail(self, error: BaseException) -> None:
        """The channel cannot be used (its communicator has a dead or unreachable peer): it
        is closed, said once, and the watchdog goes on without it (its timeouts still end the
        job; questions to this communicator's ranks go unanswered)."""
        self.closed = True
        if self in registry.CHANNELS:
            registry.CHANNELS.remove(self)
        write(f"[collectives watchdog] rank {self.rank}: the side channel of a communicator of "
              f"{self.size} ranks failed ({error!r}); its ranks' questions go unanswered")

    def send(self, obj, peer: int) -> None:
        from mpi4py import MPI
        with MPI_LOCK:
            if self.closed or stopping() or MPI.Is_finalized():
                return
            try:
                self.sends.append(self.comm.isend(obj, peer, self.tag))
            except Exception:  # noqa: BLE001 - a dead peer must not stop the report
                pass
            self.sends = [r for r in self.sends if not _done(r)]

    def answer(self, query) -> None:
        """Tell the asking rank what this rank is doing; print it if this rank waits too."""
        _, seq, asker, n = query
        state = registry.state(self.ctx)
        if state["inflight"] and (seq, n) not in self.told:  # once per warning and abort
            self.told.add((seq, n))
            write("\n".join(f"[collectives watchdog] rank {self.rank} (asked by rank {asker}): "
                             f"in {d} for {t} s, waiting for: {w}"
                             for _, d, t, w in state["inflight"]))
        self.send(("answer", seq, self.rank, state), asker)

    def serve(self) -> None:
        while True:
            msg = self.poll()
            if msg is None:
                return
            if msg[0] == "query":
                self.answer(msg)


def _done(request) -> bool:
    try:
        return bool(request.Test())
    except Exception:  # noqa: BLE001
        return True


def write(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr closed: nothing to say it with
        pass
