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

Labels: a layer above the toolkit can say *why* a collective runs, and the watchdog prints it::

    with collectives.watchdog.label("DDP bucket 3 of 7 (2.1 MB): fc1.weight, fc1.bias"):
        req = collectives.iallreduce(bucket, out=bucket)

The label is taken when the collective is called (a ``contextvars`` variable, so it follows
threads and tasks correctly); requests driven later by the progress thread keep it.
"""
from __future__ import annotations

import atexit
import sys
import threading
import time
from contextvars import ContextVar
from time import monotonic as _monotonic

from . import config
from .schedule import SEND

__all__ = ["EXIT_CODE", "timeout", "stall_warning", "enabled", "set_timeout", "label",
           "enter", "watch", "watch_setup", "unwatch", "report"]

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
_INFLIGHT: set = set()


class _Entry:
    """One collective in flight on this rank (``active``: for a communicator's reused entry of
    blocking calls, whether one runs now)."""

    __slots__ = ("ctx", "call", "what", "seq", "start", "work", "phase", "label", "warned",
                 "active")

    def __init__(self, ctx, call, what, phase):
        self.ctx, self.call, self.what, self.phase = ctx, call, what, phase
        self.seq = call.seq if call is not None else ctx.seq
        self.start, self.work, self.label = _monotonic(), None, _LABEL.get()
        self.warned = 0  # stall warnings printed
        self.active = True

    def finished(self, work) -> None:
        """``work``, this entry's non-blocking collective, has ended: forget it (and with it
        the call's buffers), recording its error if it failed."""
        unwatch(self, getattr(work, "error", None))

    def describe(self) -> str:
        text = self.call.describe() if self.call is not None else self.what
        return text if self.label is None else f"{text} [{self.label}]"

    def waiting_for(self) -> str:
        """What this rank waits on in this collective, and how far its schedule got."""
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
            return f"{_posted(plan, list(work.hops))}; {len(plan.ops) - left} of " \
                   f"{len(plan.ops)} schedule ops done"
        except Exception as exc:  # noqa: BLE001 - the report must never fail
            return f"(cannot tell: {exc!r})"


def _posted(plan, hops) -> str:
    """A running schedule's outstanding messages, grouped by peer: 'recv from rank 2 (ops 1,
    4)'."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in sorted(hops):
        kind, peer = plan.ops[i][0], plan.ops[i][1]
        groups.setdefault((kind, peer), []).append(i)
    if not groups:
        return "nothing posted (a local step)"
    return "; ".join(f"{'send to' if kind == SEND else 'recv from'} rank {peer} "
                     f"(op{'s' if len(ops) > 1 else ''} {_spans(ops)})"
                     for (kind, peer), ops in groups.items())


def _spans(ops: list[int], most: int = 6) -> str:
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


def watch(ctx, call=None, what: str = "", phase: str = "run") -> _Entry:
    """Register a collective that starts now on ``ctx`` (``call``, or a description)."""
    if _THREAD is None:
        _launch()
    if _KEY not in ctx.stash:
        _Channel(ctx)
    # ``_Entry(...)`` filled slot by slot, inline (as ``__init__`` does): this runs on every
    # collective call, and is 0.2 us quicker so
    entry = _blank(_Entry)
    entry.ctx, entry.call, entry.what, entry.phase = ctx, call, what, phase
    entry.seq = call.seq if call is not None else ctx.seq
    entry.start, entry.work, entry.label = _monotonic(), None, _LABEL.get()
    entry.warned, entry.active = 0, True
    _INFLIGHT.add(entry)
    return entry


def enter(ctx, call, phase: str = "run") -> _Entry | None:
    """A blocking collective ``call`` starts on ``ctx``: its entry, or None when the watchdog
    is off. The caller sets ``entry.work`` once the call runs and ``entry.active = False`` when
    it returns (``unwatch(entry, error)`` when it fails).

    The cheap form of ``watch``, for the calls that matter most per call (small blocking ones):
    blocking calls on one communicator come one at a time, so each communicator has one entry,
    reused, and the watchdog thread stamps its start when it first sees it running (to within
    a tick, which bounds the timeout's error) instead of every call reading the clock.
    """
    if config.get("COLLECTIVES_TIMEOUT") <= 0 and config.get("COLLECTIVES_STALL_WARNING") <= 0:
        return None
    try:
        entry = ctx.stash[_KEY].entry
    except KeyError:
        if _THREAD is None:
            _launch()
        entry = _Channel(ctx).entry
    entry.call = call
    entry.seq = call.seq
    entry.phase = phase
    entry.work = None
    entry.label = _LABEL.get()
    entry.warned = 0
    entry.start = 0.0  # not seen yet: stamped by the watchdog thread (``_inflight``)
    entry.active = True
    return entry


class _Setup:
    """The first collective on a communicator, while its private communicator is created: an
    ``MPI_Comm_dup`` of the user's, which every rank must join (``watch_setup``)."""

    __slots__ = ("comm", "rank", "size", "what", "start", "label", "warned", "work", "told",
                 "active")

    def __init__(self, comm, what):
        self.comm, self.what = comm, what
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.start, self.label, self.warned, self.work = _monotonic(), _LABEL.get(), 0, None
        self.active = True
        self.told: set = set()  # ranks heard from: waiting in this setup too

    def describe(self) -> str:
        return self.what if self.label is None else f"{self.what} [{self.label}]"

    def waiting_for(self) -> str:
        return ("every rank of the communicator to make its first collective call on it "
                "(MPI_Comm_dup of the communicator, for the toolkit's private one)")


def watch_setup(comm, collective: str | None = None) -> _Setup:
    """Register the creation of ``comm``'s private communicator, by the first ``collective``
    called on it (a Dup every rank must join); ``unwatch`` it when done."""
    if _THREAD is None:
        _launch()
    name = f"{collective} #0" if collective else "the first collective"
    entry = _Setup(comm, f"{name} (the first collective call on this communicator)")
    _INFLIGHT.add(entry)
    return entry


_blank = object.__new__


def unwatch(entry: _Entry, error: BaseException | None = None) -> None:
    """The collective of ``entry`` ended (with ``error``, if it failed)."""
    _INFLIGHT.discard(entry)
    entry.active = False
    if error is not None:
        _failed(entry, error)


def _inflight() -> list:
    """Every collective in flight on this rank: the watched ones, and each communicator's
    blocking call if one runs (stamped now if not seen before)."""
    entries = list(_INFLIGHT)
    for channel in list(_CHANNELS):
        entry = channel.entry
        if entry.active:
            if not entry.start:
                entry.start = _monotonic()
            entries.append(entry)
    return entries


def _failed(entry: _Entry, error) -> None:
    if type(entry) is _Setup:
        return
    channel = entry.ctx.stash.get(_KEY)
    if channel is not None:
        channel.last_error = f"{entry.describe()} failed: {type(error).__name__}: {error}"


def _state(ctx) -> dict:
    """This rank's answer about ``ctx``: what is in flight, how many started, the last failure."""
    now = time.monotonic()
    inflight = sorted((e for e in _inflight() if getattr(e, "ctx", None) is ctx and
                       not (e.work is not None and e.work.done)), key=lambda e: e.start)
    channel = ctx.stash.get(_KEY)
    return {
        "started": ctx.seq,
        "inflight": [(e.seq, e.describe(), round(now - e.start, 1), e.waiting_for())
                     for e in inflight],
        "last_error": None if channel is None else channel.last_error,
    }


def report(ctx=None) -> str:
    """What this rank has in flight (on ``ctx``, or on every communicator), one line each."""
    now = time.monotonic()
    lines = [f"{e.describe()} for {now - e.start:.1f} s, waiting for: {e.waiting_for()}"
             for e in sorted(_inflight(), key=lambda e: e.start)
             if (ctx is None or getattr(e, "ctx", None) is ctx) and
             not (e.work is not None and e.work.done)]
    return "\n".join(lines) or "nothing in flight"


# -- the side channel: one per communicator context ----------------------------------------------
_KEY = "watchdog"
_CHANNELS: list = []
_MPI_LOCK = threading.Lock()   # the thread's MPI calls vs communicator teardown and exit
_STOPPING = False


class _Channel:
    """Questions and answers between the watchdogs of one communicator's ranks.

    Messages are pickled tuples on the private communicator with tag ``TAG_UB``: collectives
    use tags ``seq % TAG_UB``, so they never match these.
    """

    def __init__(self, ctx):
        self.ctx = ctx
        self.comm = ctx.comm
        self.rank, self.size = ctx.rank, ctx.size
        self.tag = ctx.tag_ub
        self.last_error = None
        self.sends: list = []
        self.told: set = set()       # (asker, seq) already printed
        self.closed = False
        self.entry = _Entry(ctx, None, "", "run")  # the blocking calls' (``enter``)
        self.entry.active = False
        ctx.stash[_KEY] = self
        _CHANNELS.append(self)

    def close(self) -> None:
        """Called by ``Context.free`` before the communicator is freed."""
        with _MPI_LOCK:
            self.closed = True
            if self in _CHANNELS:
                _CHANNELS.remove(self)

    def poll(self):
        """The next message for this rank's watchdog, or None."""
        from mpi4py import MPI
        with _MPI_LOCK:
            if self.closed or _STOPPING or MPI.Is_finalized():
                return None
            msg = self.comm.improbe(MPI.ANY_SOURCE, self.tag)
            return None if msg is None else msg.recv()

    def send(self, obj, peer: int) -> None:
        from mpi4py import MPI
        with _MPI_LOCK:
            if self.closed or _STOPPING or MPI.Is_finalized():
                return
            try:
                self.sends.append(self.comm.isend(obj, peer, self.tag))
            except Exception:  # noqa: BLE001 - a dead peer must not stop the report
                pass
            self.sends = [r for r in self.sends if not _done(r)]

    def answer(self, query) -> None:
        """Tell the asking rank what this rank is doing; print it if this rank waits too."""
        _, seq, asker, n = query
        state = _state(self.ctx)
        if state["inflight"] and (seq, n) not in self.told:  # once per warning and abort
            self.told.add((seq, n))
            _write("\n".join(f"[collectives watchdog] rank {self.rank} (asked by rank {asker}): "
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


def _write(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr closed: nothing to say it with
        pass


# -- the watchdog thread -----------------------------------------------------------------------
_THREAD = None
_THREAD_LOCK = threading.Lock()
_WAKE = threading.Event()
_FIRED = False


def _tick() -> float:
    limits = [t for t in (timeout(), stall_warning()) if t > 0]
    return min(1.0, max(0.05, min(limits, default=8.0) / 8))


def _launch() -> None:
    global _THREAD
    with _THREAD_LOCK:
        if _THREAD is None:
            atexit.register(_stop)
            thread = threading.Thread(target=_loop, name="collectives-watchdog", daemon=True)
            thread.start()
            _THREAD = thread


def _stop() -> None:
    """At exit, before MPI is finalized: the thread makes no more MPI calls, and ends.

    Joined, not left to die with the interpreter: the thread drops the last reference to the
    work it watched (a torch tensor's, say), which must not happen while the interpreter
    finalizes (see ``progress.Worker``).
    """
    global _STOPPING
    with _MPI_LOCK:
        _STOPPING = True
    _WAKE.set()
    thread = _THREAD
    if thread is not None and thread is not threading.current_thread():
        thread.join(5.0)


def _loop() -> None:
    while not _STOPPING:
        _WAKE.wait(_tick())
        try:
            _round()
        except Exception as exc:  # noqa: BLE001 - the watchdog must outlive its own bugs
            _write(f"[collectives watchdog] internal error: {exc!r}")


def _round() -> None:
    now = time.monotonic()
    limit, every = timeout(), stall_warning()
    late = stalled = None
    for entry in _inflight():
        work = entry.work
        if work is not None and work.done and entry in _INFLIGHT:
            _INFLIGHT.discard(entry)
            if getattr(work, "error", None) is not None:
                _failed(entry, work.error)
            continue
        age = now - entry.start
        if limit > 0 and age > limit and (late is None or entry.start < late.start):
            late = entry
        elif every > 0 and age > every * (entry.warned + 1) and stalled is None:
            stalled = entry
    for channel in list(_CHANNELS):
        channel.serve()
    for entry in _setups():
        _serve_setup(entry)
    if late is not None:
        _fire(late)
    elif stalled is not None:
        stalled.warned = int((now - stalled.start) // every)
        _inquire(stalled, stalled.warned)


def _setups() -> list:
    return [entry for entry in list(_INFLIGHT) if type(entry) is _Setup]


def _grace() -> float:
    """How long the late rank waits for the others' answers."""
    return min(10.0, max(1.5, min(t for t in (timeout(), stall_warning(), 20.0) if t > 0) / 2))


def _fire(entry) -> None:
    """``entry`` is late: report here, ask the others, summarize, abort the job."""
    global _FIRED
    if _FIRED:
        return
    _FIRED = True
    _inquire(entry, -1)
    _abort()


def _inquire(entry, n: int) -> None:
    """Report ``entry`` here, ask the other ranks, and print the summary: stall warning ``n``
    (1, 2, ...), or the timeout (``n`` = -1, the job is aborted after)."""
    elapsed = time.monotonic() - entry.start
    if n < 0:
        head = f"did not complete in {elapsed:.1f} s (COLLECTIVES_TIMEOUT={timeout():g})"
    else:
        head = (f"has not completed after {elapsed:.0f} s (stall warning {n}, "
                f"COLLECTIVES_STALL_WARNING={stall_warning():g}; the job is aborted at "
                f"COLLECTIVES_TIMEOUT={timeout():g} s)")
    if type(entry) is _Setup:
        return _inquire_setup(entry, head, n)
    ctx = entry.ctx
    channel = ctx.stash.get(_KEY)
    _write(f"[collectives watchdog] rank {ctx.rank}: {entry.describe()} {head}; waiting for: "
           f"{entry.waiting_for()}")
    answers: dict[int, dict] = {}
    lower_asked = False
    if channel is not None and ctx.size > 1:
        for peer in range(ctx.size):
            if peer != ctx.rank:
                channel.send(("query", entry.seq, ctx.rank, n), peer)
        deadline = time.monotonic() + _grace()
        while len(answers) < ctx.size - 1 and time.monotonic() < deadline:
            msg = channel.poll()
            if msg is None:
                time.sleep(0.02)
            elif msg[0] == "query":
                channel.answer(msg)
                # Another late rank asked too: let the lowest one print the summary.
                lower_asked |= msg[1] == entry.seq and msg[2] < ctx.rank
            elif msg[0] == "answer" and msg[1] == entry.seq:
                answers[msg[2]] = msg[3]
    if lower_asked:
        if n >= 0:
            return  # the lower rank prints this warning's summary
        # The lower rank prints the summary and aborts the job meanwhile; if not, we do.
        time.sleep(2 * _grace() + 1)
    _write(_summary(entry, _state(ctx), answers, n))


# -- the first collective on a communicator: its Dup ----------------------------------------------
def _setup_tag(comm) -> int:
    from mpi4py import MPI
    return int(comm.Get_attr(MPI.TAG_UB) or 32767)


def _serve_setup(entry: _Setup) -> None:
    """Note the ranks that say they wait in this setup too (something is sent on the user's
    communicator only once a rank's timeout has passed, just before the job is aborted)."""
    from mpi4py import MPI
    with _MPI_LOCK:
        if _STOPPING or MPI.Is_finalized():
            return
        while True:
            msg = entry.comm.improbe(MPI.ANY_SOURCE, _setup_tag(entry.comm))
            if msg is None:
                return
            entry.told.add(msg.recv())


def _inquire_setup(entry: _Setup, head: str, n: int) -> None:
    """Tell the other ranks this one waits in the setup, hear which wait too, summarize."""
    from mpi4py import MPI
    _write(f"[collectives watchdog] rank {entry.rank}: {entry.describe()} {head}; waiting for: "
           f"{entry.waiting_for()}")
    if n >= 0:
        # A warning only: nothing is sent on the user's communicator, where a message left
        # unmatched could meet one of the program's own receives once the job goes on.
        return
    tag, sends = _setup_tag(entry.comm), []
    with _MPI_LOCK:
        if _STOPPING or MPI.Is_finalized():
            return
        for peer in range(entry.size):
            if peer != entry.rank:
                try:
                    sends.append(entry.comm.isend(entry.rank, peer, tag))
                except Exception:  # noqa: BLE001 - a dead peer must not stop the report
                    pass
    deadline = time.monotonic() + _grace()
    while len(entry.told) < entry.size - 1 and time.monotonic() < deadline:
        _serve_setup(entry)
        time.sleep(0.02)
    there = sorted(entry.told | {entry.rank})
    if there[0] != entry.rank:  # the lowest waiting rank prints the summary and aborts
        time.sleep(2 * _grace() + 1)
    away = [r for r in range(entry.size) if r not in there]
    lines = [f"[collectives watchdog] rank {entry.rank}: {entry.describe().split(' (')[0]} on "
             f"a communicator of {entry.size} ranks did not complete: {_ranks(there)} "
             f"{'is' if len(there) == 1 else 'are'} in it, waiting for the others"]
    if away:
        lines.append(f"=> {_ranks(away)} never joined: no collective call on this communicator "
                     f"yet (an exception before it, a branch that skips it, still computing, "
                     f"finalizing MPI, or exited)")
    lines.append(f"[collectives watchdog] aborting the job: MPI_Abort(COMM_WORLD, {EXIT_CODE})")
    _write("\n".join(lines))


def _summary(entry: _Entry, mine: dict, answers: dict, n: int = -1) -> str:
    ctx, seq = entry.ctx, entry.seq
    name = entry.describe()
    short = name.split(" (")[0]
    lines = [f"[collectives watchdog] rank {ctx.rank}: {short} on a communicator of "
             f"{ctx.size} ranks {'did not complete' if n < 0 else 'is stalled'}; what each "
             f"rank says:"]
    missing, silent, failed = [], [], []
    for rank in range(ctx.size):
        state = mine if rank == ctx.rank else answers.get(rank)
        if state is None:
            lines.append(f"  rank {rank}: no answer (it exited, is finalizing MPI, or is "
                         f"blocked outside the toolkit)")
            silent.append(rank)
            continue
        inside = [i for i in state["inflight"] if i[0] == seq]
        others = [i for i in state["inflight"] if i[0] != seq]
        doing = "; ".join(f"in {d} for {t} s, waiting for: {w}" for _, d, t, w in others)
        if inside:
            _, d, t, w = inside[0]
            lines.append(f"  rank {rank}: in {d} for {t} s, waiting for: {w}")
        elif state["started"] <= seq:
            lines.append(f"  rank {rank}: has NOT started #{seq} (it started "
                         f"{_plural(state['started'], 'collective')} on this communicator); "
                         f"{doing or 'not in any collective of this communicator'}")
            missing.append(rank)
        else:
            lines.append(f"  rank {rank}: finished #{seq}; {doing or 'now idle'}")
        if state["last_error"] is not None and not inside:
            lines.append(f"    its last failure: {state['last_error']}")
            failed.append(rank)
    if missing:
        lines.append(f"=> {_ranks(missing)} never joined #{seq}: a branch that skips it "
                     f"there, or still computing before it")
    if silent:
        lines.append(f"=> {_ranks(silent)} did not answer: exited (an exception?), died, or "
                     f"blocked outside the toolkit")
    if failed and not (missing or silent):
        lines.append(f"=> {_ranks(failed)} failed a collective and moved on (see above)")
    elif not (failed or missing or silent):
        lines.append("=> every rank is in it: one waits for a message no one sends "
                     "(ranks passed different arguments? run with COLLECTIVES_CHECK=1)")
    if n < 0:
        lines.append(f"[collectives watchdog] aborting the job: MPI_Abort(COMM_WORLD, "
                     f"{EXIT_CODE})")
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _abort() -> None:
    from mpi4py import MPI
    time.sleep(0.5)  # let the launcher forward what was just written before it kills us
    MPI.COMM_WORLD.Abort(EXIT_CODE)
