"""Hang detection: a collective that does not complete warns, then aborts the job, loudly.

Two settings (``collectives.config``) bound every collective, blocking or not, from the moment
it is called; neither needs setting:

- ``COLLECTIVES_STALL_WARNING`` (default 60 s; ``0``: never): a collective still running after
  this long prints a *stall warning* (below, steps 1-2 and the summary, without the abort), and
  again each time as long again passes;
- ``COLLECTIVES_TIMEOUT`` (default 600 s, torch's default; ``0``: never): a collective still
  running after this long ends the job:

1. the rank where it is late prints on stderr the collective, its algorithm, its sequence
   number on the communicator, the schedule step it reached and the peer it waits on (a
   schedule knows which receive or send is outstanding; the MPI library's own collectives do
   not, so for ``native`` it says so);
2. it asks every other rank of the communicator, over a side channel (point-to-point messages
   on the toolkit's private communicator, with a tag no collective uses), what it is doing;
   every rank still waiting prints its own line, and every rank answers: in that collective,
   finished it, not started it yet (the rank that skipped it), or failed it (and with what);
   a rank that answers nothing has exited, died, is finalizing MPI or is blocked outside the
   toolkit;
3. after the answers (at most a few seconds) it prints a summary naming the ranks that are not
   in the collective and calls ``MPI.COMM_WORLD.Abort(EXIT_CODE)``: ``mpiexec`` returns
   ``EXIT_CODE`` (124, like coreutils ``timeout``) and a scheduler frees the nodes.

The first collective on a communicator is special: it creates the toolkit's private
communicator (``MPI_Comm_dup``), which every rank must join, and there is no side channel yet.
It is watched all the same (``watch_setup``); the ranks waiting in it tell each other so over
the user's communicator, with the largest tag (only when the timeout has passed, just before
the abort), and the summary names the ranks that never arrived.

Nothing polls on the hot path. A collective is registered when it starts (``watch``: one small
object and a set insertion) and removed when it ends; one daemon thread wakes every
``min(1 s, limit / 8)`` to look at the collectives in flight and to answer the other ranks'
questions. A blocked MPI call cannot be interrupted from Python, but MPI is initialized with
``MPI_THREAD_MULTIPLE`` (mpi4py's default), so the thread can talk and abort while the main
thread stays blocked.

Waits of a rank's own outside collectives (``collectives.p2p``'s one wait: a pipeline stage's
receive, a parameter-server request; a server's queued pull) are registered with
``watch_local`` and bounded alike; each waiting rank prints its own line, naming its peer.

Labels: a layer above the toolkit can say *why* a collective runs, and the watchdog prints it::

    with collectives.watchdog.label("DDP bucket 3 of 7 (2.1 MB): fc1.weight, fc1.bias"):
        req = collectives.iallreduce(bucket, out=bucket)

The label is taken when the collective is called (a ``contextvars`` variable, so it follows
threads and tasks correctly); requests driven later by the progress thread keep it.
"""
from __future__ import annotations

from .. import config
from . import monitor
from .channel import Channel
from .registry import (COUNTS, EXIT_CODE, INFLIGHT, Entry, enabled, label, report,
                       set_timeout, stall_warning, timeout, unwatch)

__all__ = ["COUNTS", "EXIT_CODE", "Entry", "timeout", "stall_warning", "enabled", "set_timeout",
           "label", "enter", "watch", "watching", "watch_setup", "watch_local", "unwatch",
           "report"]


def watch(ctx, call=None, what: str = "", phase: str = "run") -> Entry:
    """Register a collective that starts now on ``ctx`` (``call``, or a description)."""
    monitor.launch()
    ctx.slot(Channel)
    entry = Entry.collective(ctx, call, what, phase)
    INFLIGHT.add(entry)
    return entry


class watching:
    """``with watching(ctx, what):`` a step that every rank of ``ctx``'s communicator must
    join (a count exchange, a header), bounded like a collective; nothing when the watchdog
    is off. ``comm`` instead of ``ctx``: the first call on a communicator (``watch_setup``)."""

    __slots__ = ("ctx", "what", "comm", "entry")

    def __init__(self, ctx=None, what: str = "", comm=None):
        self.ctx, self.what, self.comm, self.entry = ctx, what, comm, None

    def __enter__(self):
        if enabled():
            self.entry = watch(self.ctx, what=self.what) if self.ctx is not None else \
                watch_setup(self.comm, self.what)
        return self.entry

    def __exit__(self, kind, error, traceback):
        if self.entry is not None:
            unwatch(self.entry, error)
        return False


def enter(ctx, call, phase: str = "run") -> Entry | None:
    """A blocking collective ``call`` starts on ``ctx``: its entry, or None when the watchdog
    is off. The caller moves it on with its methods: ``entry.checked()`` after a cross-rank
    check, ``entry.attach(work)`` once the call runs, ``entry.release()`` when it returns
    (``entry.end(error)`` when it fails).

    The cheap form of ``watch``, for the calls that matter most per call (small blocking ones):
    blocking calls on one communicator come one at a time, so each communicator has one entry,
    reused, and the watchdog thread stamps its start when it first sees it running (to within
    a tick, which bounds the timeout's error) instead of every call reading the clock.
    """
    settings = config.current
    if settings.COLLECTIVES_TIMEOUT <= 0 and settings.COLLECTIVES_STALL_WARNING <= 0:
        return None
    channel = ctx.slots.get(Channel)
    if channel is None:
        monitor.launch()
        channel = ctx.slot(Channel)
    entry = channel.entry
    entry.begin(call, phase)
    return entry


def watch_setup(comm, collective: str | None = None) -> Entry:
    """Register the creation of ``comm``'s private communicator, by the first ``collective``
    called on it (a Dup every rank must join); ``unwatch`` it when done."""
    monitor.launch()
    name = f"{collective} #0" if collective else "the first collective"
    entry = Entry.first_call(comm, f"{name} (the first collective call on this communicator)")
    INFLIGHT.add(entry)
    return entry


def watch_local(comm, what: str, work=None, notes: list | None = None) -> Entry:
    """Register a wait of this rank's own on ``comm`` (a server's queued request, a
    point-to-point receive): bounded by the watchdog's settings from ``entry.start``, reported
    on this rank only (``what``, and ``work.waiting_for()`` where ``work`` is given; also
    appended to ``notes``), the job aborted past the timeout. Its owner moves it on
    (``entry.restart(what, start)``) and ends it (``entry.end()``)."""
    monitor.launch()
    entry = Entry.local(comm, what, work, notes)
    INFLIGHT.add(entry)
    return entry
