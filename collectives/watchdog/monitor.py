"""The watchdog's thread: wakes every tick, warns of stalled collectives, asks the other ranks
what they are doing, prints the summary and aborts the job past the timeout."""
from __future__ import annotations

import atexit
import threading
import time

from . import channel as chan
from . import registry

__all__ = ["launch", "summary"]

# -- the watchdog thread -----------------------------------------------------------------------
_THREAD = None
_THREAD_LOCK = threading.Lock()
_WAKE = threading.Event()
_FIRED = False


def _tick() -> float:
    limits = [t for t in (registry.timeout(), registry.stall_warning()) if t > 0]
    return min(1.0, max(0.05, min(limits, default=8.0) / 8))


def launch() -> None:
    """Start the watchdog's thread, once."""
    global _THREAD
    if _THREAD is not None:
        return
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
    chan.stop()
    _WAKE.set()
    thread = _THREAD
    if thread is not None and thread is not threading.current_thread():
        thread.join(5.0)


def _loop() -> None:
    while not chan.stopping():
        _WAKE.wait(_tick())
        try:
            _round()
        except Exception as exc:  # noqa: BLE001 - the watchdog must outlive its own bugs
            chan.write(f"[collectives watchdog] internal error: {exc!r}")


def _round() -> None:
    now = time.monotonic()
    limit, every = registry.timeout(), registry.stall_warning()
    late = stalled = None
    for entry in registry.inflight():
        work = entry.work
        if work is not None and work.done and entry in registry.INFLIGHT:
            registry.INFLIGHT.discard(entry)
            if getattr(work, "error", None) is not None:
                registry.failed(entry, work.error)
            continue
        age = now - entry.start
        if limit > 0 and age > limit and (late is None or entry.start < late.start):
            late = entry
        elif every > 0 and age > every * (entry.warned + 1) and stalled is None:
            stalled = entry
    for channel in list(registry.CHANNELS):
        try:
            channel.serve()
        except Exception as exc:  # noqa: BLE001 - one broken channel must not stop the round
            channel.fail(exc)
    for entry in _setups():
        _serve_setup(entry)
    if late is not None:
        _fire(late)
    elif stalled is not None:
        stalled.warn(int((now - stalled.start) // every))
        _inquire(stalled, stalled.warned)


def _setups() -> list:
    return [entry for entry in list(registry.INFLIGHT) if entry.setup]


def _grace() -> float:
    """How long the late rank waits for the others' answers."""
    limits = (registry.timeout(), registry.stall_warning(), 20.0)
    return min(10.0, max(1.5, min(t for t in limits if t > 0) / 2))


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
        head = f"did not complete in {elapsed:.1f} s (COLLECTIVES_TIMEOUT={registry.timeout():g})"
    else:
        head = (f"has not completed after {elapsed:.0f} s (stall warning {n}, "
                f"COLLECTIVES_STALL_WARNING={registry.stall_warning():g}; the job is aborted at "
                f"COLLECTIVES_TIMEOUT={registry.timeout():g} s)")
    if entry.setup:
        return _inquire_setup(entry, head, n)
    if entry.kind is registry.LOCAL:
        text = (f"[collectives watchdog] rank {entry.rank}: {entry.describe()} {head}; waiting "
                f"for: {entry.waiting_for()}")
        if entry.notes is not None:
            entry.notes.append(text)
        chan.write(text if n >= 0 else text + f"\n[collectives watchdog] aborting the job: "
                   f"MPI_Abort(COMM_WORLD, {registry.EXIT_CODE})")
        return
    ctx = entry.ctx
    channel = ctx.slots.get(chan.Channel)
    chan.write(f"[collectives watchdog] rank {ctx.rank}: {entry.describe()} {head}; waiting "
                f"for: {entry.waiting_for()}")
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
    chan.write(summary(entry, registry.state(ctx), answers, n))


# -- the first collective on a communicator: its Dup ----------------------------------------------
def _setup_tag(comm) -> int:
    from mpi4py import MPI
    return int(comm.Get_attr(MPI.TAG_UB) or 32767)


def _serve_setup(entry: registry.Entry) -> None:
    """Note the ranks that say they wait in this setup too (something is sent on the user's
    communicator only once a rank's timeout has passed, just before the job is aborted)."""
    from mpi4py import MPI
    with chan.MPI_LOCK:
        if chan.stopping() or MPI.Is_finalized():
            return
        while True:
            msg = entry.comm.improbe(MPI.ANY_SOURCE, _setup_tag(entry.comm))
            if msg is None:
                return
            entry.told.add(msg.recv())


def _inquire_setup(entry: registry.Entry, head: str, n: int) -> None:
    """Tell the other ranks this one waits in the setup, hear which wait too, summarize."""
    from mpi4py import MPI
    chan.write(f"[collectives watchdog] rank {entry.rank}: {entry.describe()} {head}; waiting "
                f"for: {entry.waiting_for()}")
    if n >= 0:
        # A warning only: nothing is sent on the user's communicator, where a message left
        # unmatched could meet one of the program's own receives once the job goes on.
        return
    tag, sends = _setup_tag(entry.comm), []
    with chan.MPI_LOCK:
        if chan.stopping() or MPI.Is_finalized():
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
    lines.append(f"[collectives watchdog] aborting the job: MPI_Abort(COMM_WORLD, "
                 f"{registry.EXIT_CODE})")
    chan.write("\n".join(lines))


def summary(entry: registry.Entry, mine: dict, answers: dict, n: int = -1) -> str:
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
                     f"{registry.EXIT_CODE})")
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
    MPI.COMM_WORLD.Abort(registry.EXIT_CODE)
