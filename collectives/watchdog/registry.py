"""What the watchdog bounds: settings, labels, and the entries of what is in flight on this rank.

One entry type (``Entry``), one constructor per kind: a collective (``Entry.collective``;
blocking calls reuse their communicator's ``Entry.blocking``), a communicator's first call
(``Entry.first_call``), or a wait of this rank's own (``Entry.local``). Its methods are its
transitions; no caller writes a field. ``unwatch`` (``Entry.end``) ends one. The thread that
looks at them is ``collectives.watchdog.monitor``; the side channel
``collectives.watchdog.channel``.
"""
from __future__ import annotations

import time
from contextvars import ContextVar
from time import monotonic as _monotonic

from .. import config
from ..schedule import SEND

__all__ = ["EXIT_CODE", "timeout", "stall_warning", "enabled", "set_timeout", "label",
           "current_label", "COLLECTIVE", "SETUP", "LOCAL", "COUNTS", "Entry",
           "INFLIGHT", "CHANNELS", "Failure", "unwatch", "inflight", "failed", "state", "report",
           "posted", "spans"]

EXIT_CODE = 124


def timeout() -> float:
    """The timeout in force, in seconds (0: disabled): ``COLLECTIVES_TIMEOUT``."""
    return config.get("COLLECTIVES_TIMEOUT")


def stall_warning() -> float:
    """The stall warning's interval in seconds (0: none): ``COLLECTIVES_STALL_WARNING``."""
    return config.get("COLLECTIVES_STALL_WARNING")


def enabled() -> bool:
    """Whether collectives are watched (a timeout or a stall warning is set)."""
    return config.get("COLLECTIVES_TIMEOUT") > 0 or config.get("COLLECTIVES_STALL_WARNING") > 0


def set_timeout(seconds) -> float:
    """Set the timeout for collectives started from now on; returns the previous value."""
    return config.set("COLLECTIVES_TIMEOUT", seconds)


# -- labels --------------------------------------------------------------------------------------
_LABEL: ContextVar[str | None] = ContextVar("collectives_label", default=None)


# current_label() -> str | None: the label in force where it is called (``label``). The context
# variable's own method: every blocking call reads it, and a Python function around it costs
# as much again.
current_label = _LABEL.get


class label:
    """Context manager: collectives called inside are reported with ``text`` (nestable)."""

    __slots__ = ("text", "_token")

    def __init__(self, text: str):
        self.text = str(text)
        self._token = None

    def __enter__(self):
        outer = _LABEL.get()
        self._token = _LABEL.set(self.text if outer is None else f"{outer} / {self.text}")
        return self

    def __exit__(self, *exc):
        _LABEL.reset(self._token)
        return False


# -- collectives in flight -------------------------------------------------------------------------
INFLIGHT: set = set()          # the entries in flight (each communicator's reused one aside)
CHANNELS: list = []            # every side channel (its reused entry of blocking calls)


# What an entry bounds, which says how the monitor reports it.
COLLECTIVE = "collective"  # a collective on a context: the other ranks are asked (side channel)
SETUP = "setup"            # a communicator's first call: its Dup, no side channel yet
LOCAL = "local"            # a wait of this rank's own (a server's queued request): said here
COUNTS = "counts"  # the phase of a call whose plan exchanges every rank's counts first


class Entry:
    """One thing in flight on this rank that the watchdog bounds (``kind``): a collective on a
    communicator's context (``ctx``); the first call on a communicator, while its private
    communicator is created (an ``MPI_Comm_dup`` of ``comm`` that every rank must join, with
    no side channel yet); or a wait of this rank's own (a server's queued request, a
    point-to-point receive), which its owner keeps up to date (``what``, ``start``, and
    ``work.waiting_for()``). ``active``: for a communicator's reused entry of blocking calls,
    whether one runs now. ``told``: the ranks heard from waiting in the same setup. ``notes``:
    a list that also receives what the watchdog says of it.

    The watchdog owns the fields: callers read them, make an entry with one constructor per
    kind (``collective``, ``blocking``, ``first_call``, ``local``) and move it on with its
    methods (``begin``, ``checked``, ``attach``, ``release``, ``restart``, ``finished``,
    ``end``), so the monitor thread never sees a half-made transition.
    """

    __slots__ = ("kind", "ctx", "comm", "rank", "size", "call", "what", "seq", "start", "work",
                 "phase", "label", "warned", "active", "told", "notes")

    def __init__(self, ctx=None, call=None, what: str = "", phase: str = "run", comm=None,
                 kind: str = COLLECTIVE):
        self.kind = kind if ctx is None else COLLECTIVE
        self.notes = None
        self.ctx, self.call, self.what, self.phase = ctx, call, what, phase
        if ctx is not None:
            self.comm, self.rank, self.size = ctx.comm, ctx.rank, ctx.size
            self.seq = call.seq if call is not None else ctx.seq
        else:
            self.comm, self.rank, self.size, self.seq = comm, comm.Get_rank(), \
                comm.Get_size(), 0
        self.start, self.work, self.label = _monotonic(), None, _LABEL.get()
        self.warned = 0  # stall warnings printed
        self.active = True
        self.told: set = set()

    # -- one constructor per kind (none registers: ``watch``, ``watch_setup``, ``watch_local``
    # and ``enter`` do) --------------------------------------------------------------------------
    @classmethod
    def collective(cls, ctx, call=None, what: str = "", phase: str = "run") -> "Entry":
        """A collective starting now on ``ctx`` (``call``, or ``what`` in words)."""
        return cls(ctx, call, what, phase)

    @classmethod
    def blocking(cls, ctx) -> "Entry":
        """A communicator's one reused entry of blocking calls, idle until ``begin``."""
        entry = cls(ctx)
        entry.active = False
        return entry

    @classmethod
    def first_call(cls, comm, what: str) -> "Entry":
        """The creation of ``comm``'s private communicator by its first collective call."""
        return cls(None, None, what, comm=comm, kind=SETUP)

    @classmethod
    def local(cls, comm, what: str, work=None, notes: list | None = None) -> "Entry":
        """A wait of this rank's own on ``comm``, said here only: ``what``, and where
        ``work`` is given, ``work.waiting_for()``; ``notes`` also receives the reports."""
        entry = cls(None, None, what, comm=comm, kind=LOCAL)
        entry.work, entry.notes = work, notes
        return entry

    # -- transitions ------------------------------------------------------------------------------
    def begin(self, call, phase: str = "run") -> None:
        """A reused entry: the blocking ``call`` starts now (in ``phase``). Its start is
        stamped by the watchdog thread when it first sees it (``inflight``), to within a
        tick, so a small call reads no clock."""
        self.call = call
        self.seq = call.seq
        self.phase = phase
        self.work = None
        self.label = _LABEL.get()
        self.warned = 0
        self.start = 0.0
        self.active = True

    def counted(self, phase: str) -> None:
        """The call's count exchange is done (phase ``COUNTS`` -> ``phase``)."""
        self.phase = phase

    def checked(self) -> None:
        """The cross-rank argument check passed: the call runs now (phase ``check`` ->
        ``run``)."""
        self.phase = "run"

    def attach(self, work) -> None:
        """``work`` runs this entry's call: the watchdog asks it where this rank waits (a
        schedule's outstanding ops, ``work.waiting_for()``) and, for a registered entry,
        forgets the entry once ``work.done``."""
        self.work = work

    def release(self) -> None:
        """A reused entry's blocking call returned: idle again, holding neither the call nor
        its work (so none of the caller's buffers outlives the call)."""
        self.active, self.call, self.work = False, None, None

    def restart(self, what: str, start: float) -> None:
        """A local wait now waits for ``what``, since ``start`` (``time.monotonic()``): its
        stall warnings count afresh."""
        self.what, self.start, self.warned = what, start, 0

    def stamp(self, now: float) -> None:
        """The watchdog thread: a reused entry's call is seen running for the first time."""
        if not self.start:
            self.start = now

    def warn(self, count: int) -> None:
        """The watchdog thread: ``count`` stall warnings have been printed for this entry."""
        self.warned = count

    def end(self, error: BaseException | None = None) -> None:
        """This entry's wait or call ended (with ``error``, if it failed): unregistered."""
        unwatch(self, error)

    @property
    def setup(self) -> bool:
        """Whether this is a communicator's first call, creating its private communicator."""
        return self.kind is SETUP

    def finished(self, work) -> None:
        """``work``, this entry's non-blocking collective, has ended: forget it (and with it
        the call's buffers), recording its error if it failed."""
        unwatch(self, getattr(work, "error", None))

    def describe(self) -> str:
        text = self.call.describe() if self.call is not None else self.what
        return text if self.label is None else f"{text} [{self.label}]"

    def waiting_for(self) -> str:
        """What this rank waits on in this collective, and how far its schedule got."""
        if self.setup:
            return ("every rank of the communicator to make its first collective call on it "
                    "(MPI_Comm_dup of the communicator, for the toolkit's private one)")
        if self.kind is LOCAL:
            return self.what if self.work is None else self.work.waiting_for()
        if self.phase is COUNTS:
            return ("the exchange of every rank's counts before the data moves: an "
                    "MPI_Allgather that every rank of the communicator must join")
        if self.phase == "check":
            return ("the cross-rank argument check (COLLECTIVES_CHECK): an MPI_Allreduce that "
                    "every rank of the communicator must join")
        work = self.work
        if work is None:
            return ("inside one of the MPI library's own blocking collectives (MPI does not "
                    "say which peer it waits for)")
        try:
            plan, left = getattr(work, "plan", None), getattr(work, "left", None)
            if plan is None or left is None:
                return work.waiting_for()
            return f"{posted(plan, list(work.hops))}; {len(plan.ops) - left} of " \
                   f"{len(plan.ops)} schedule ops done"
        except Exception as exc:  # noqa: BLE001 - the report must never fail
            return f"(cannot tell: {exc!r})"


def posted(plan, hops) -> str:
    """A running schedule's outstanding messages, grouped by peer: 'recv from rank 2 (ops 1,
    4)'."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in sorted(hops):
        kind, peer = plan.ops[i][0], plan.ops[i][1]
        groups.setdefault((kind, peer), []).append(i)
    if not groups:
        return "nothing posted (a local step)"
    return "; ".join(f"{'send to' if kind == SEND else 'recv from'} rank {peer} "
                     f"(op{'s' if len(ops) > 1 else ''} {spans(ops)})"
                     for (kind, peer), ops in groups.items())


def spans(ops: list[int], most: int = 6) -> str:
    """Sorted op numbers as runs, ``"1, 4-9, 12"``; past ``most`` runs, the count of the rest
    (a large message in small segments posts 10^5 receives at once)."""
    runs: list[list[int]] = []
    for i in ops:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:most])
    rest = sum(b - a + 1 for a, b in runs[most:])
    return text + (f" and {rest} more" if rest else "")


def unwatch(entry: Entry, error: BaseException | None = None) -> None:
    """The collective of ``entry`` ended (with ``error``, if it failed)."""
    INFLIGHT.discard(entry)
    entry.active = False
    if error is not None:
        failed(entry, error)


def inflight() -> list:
    """Every collective in flight on this rank: the watched ones, and each communicator's
    blocking call if one runs (stamped now if not seen before)."""
    entries = list(INFLIGHT)
    for channel in list(CHANNELS):
        entry = channel.entry
        if entry.active:
            entry.stamp(_monotonic())
            entries.append(entry)
    return entries


class Failure:
    """A communicator's last failed collective on this rank, in words (``failed``)."""

    __slots__ = ("text",)

    def __init__(self, ctx):
        self.text = None


def failed(entry: Entry, error) -> None:
    if entry.ctx is None:
        return
    entry.ctx.slot(Failure).text = f"{entry.describe()} failed: {type(error).__name__}: {error}"


def state(ctx) -> dict:
    """This rank's answer about ``ctx``: what is in flight, how many started, the last failure."""
    now = time.monotonic()
    running = sorted((e for e in inflight() if e.ctx is ctx and
                      not (e.work is not None and e.work.done)), key=lambda e: e.start)
    failure = ctx.slots.get(Failure)
    return {
        "started": ctx.seq,
        "inflight": [(e.seq, e.describe(), round(now - e.start, 1), e.waiting_for())
                     for e in running],
        "last_error": None if failure is None else failure.text,
    }


def report(ctx=None) -> str:
    """What this rank has in flight (on ``ctx``, or on every communicator), one line each."""
    now = time.monotonic()
    lines = [f"{e.describe()} for {now - e.start:.1f} s, waiting for: {e.waiting_for()}"
             for e in sorted(inflight(), key=lambda e: e.start)
             if (ctx is None or e.ctx is ctx) and
             not (e.work is not None and e.work.done)]
    return "\n".join(lines) or "nothing in flight"
