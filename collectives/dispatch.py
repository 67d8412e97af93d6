"""One collective call, from checked arguments to a result: validate, choose, run.

``collectives.api`` checks a call's arguments and wraps its buffers into a ``Call``; this
module does the rest, the same for every collective:

1. *Validate across ranks* when ``COLLECTIVES_CHECK`` is on or ``check=True``
   (``collectives.check``), before the choice: ranks whose arguments differ could choose
   differently.
2. *Choose* the algorithm record (``collectives.select``): by name, or ``auto``'s lookup in the
   tuning table, memoized per communicator.
3. *Run*, by the record's kind (``_run``, the one place that dispatches on it): a schedule is
   built once per shape and run by the executor; a direct algorithm (``shm``) or the MPI
   library's own collective (``native``) is launched as it is. Blocking calls run in the
   caller's thread; ``i*`` calls return a ``Request``.

Collectives on two or more ranks are registered with the watchdog (``collectives.watchdog``)
while they run.
"""
from __future__ import annotations

from . import check as _check
from . import config, native, ops, select
from . import timeline as _timeline
from . import watchdog as _watchdog
from .call import Call, make_call
from .errors import network_error
from .executor import cached_context, context, launch_schedule, schedule_for
from .ops import resolve
from .progress import DONE, Request
from .signature import Changed, Plan, keep
from .select import NATIVE, ONE_NODE, PREFERENCES, REGISTRY, SCHEDULE, TOPOLOGY

__all__ = ["Call", "make_call", "comm_context", "start", "auto_pick",
           "mean_first", "verify", "preferred", "auto_algorithm", "drain", "RAGGED",
           "nothing_to_move"]


_WORLD = []  # MPI.COMM_WORLD's Context, made on the first call (mpi4py is imported then)


def comm_context(comm, collective: str | None = None):
    """The executor's ``Context`` of ``comm`` (``MPI.COMM_WORLD`` when None), with every
    setting and the tuning table validated on the first call after ``config.reload/set``.
    Made by the first ``collective`` called on ``comm``: a Dup that every rank must join."""
    if comm is None:
        if _WORLD:
            ctx = _WORLD[0]
        else:
            from mpi4py import MPI
            ctx = _create(MPI.COMM_WORLD, collective)  # lives until MPI_Finalize frees it
            _WORLD.append(ctx)
    else:
        try:
            ctx = cached_context(comm) or _create(comm, collective)
        except AttributeError:
            raise TypeError(f"comm must be an mpi4py.MPI.Comm, got "
                            f"{type(comm).__name__}") from None
    try:
        if not config.validated and config.validate():  # the first call since reload/set
            select.load_table()  # a named tuning file must exist and parse
    except ValueError as exc:
        # Every rank raises here at once (the ranks met in the context's Dup); each says so
        # on stderr too, since the first rank to exit may end the job before the others'
        # tracebacks are printed.
        import sys
        print(f"[collectives] rank {ctx.rank} of {ctx.size}: ValueError: {exc}", file=sys.stderr,
              flush=True)
        raise
    return ctx


def _create(comm, collective):
    """``comm``'s Context, made under the watchdog: a rank that never makes a collective call
    on ``comm`` (it raised, it exited, it computes) leaves the others in this Dup."""
    if comm.Get_size() == 1:
        return context(comm)
    with _watchdog.watching(what=collective, comm=comm):
        return context(comm)


# -- choose --------------------------------------------------------------------------------------
def _auto(ctx, collective: str, nbytes: int, inplace: bool) -> select.Algorithm:
    """The algorithm ``auto`` runs on ``ctx``'s communicator, memoized per communicator for
    the tuning table in force (``select.load_table`` reads it once)."""
    memo = ctx.slots.get(_AutoMemo) or ctx.slot(_AutoMemo)
    key = (collective, nbytes, inplace)
    algo = memo.picks.get(key)
    if algo is not None and memo.setting is config.get("COLLECTIVES_TUNING"):
        return algo
    table = select.load_table()
    if memo.table is not table:
        memo.table, memo.picks = table, {}
    memo.setting = config.get("COLLECTIVES_TUNING")
    algo = memo.picks.get(key)
    if algo is None:
        name = select.auto(collective, nbytes, ctx.size, lambda: _single_node(ctx), inplace,
                           lambda: _alone(ctx))
        if len(memo.picks) >= 1024:  # the sizes a program uses are few; a bound all the same
            memo.picks.clear()
        algo = memo.picks[key] = REGISTRY[collective][name]
    return algo


_UNSET = object()


class _AutoMemo:
    """``auto``'s picks on one communicator, for the tuning table in force (read for the
    setting ``COLLECTIVES_TUNING`` had then: a pick holds while the setting is the same)."""

    __slots__ = ("table", "picks", "setting")

    def __init__(self, ctx):
        self.table, self.picks, self.setting = None, {}, _UNSET


# Collectives whose ranks may differ in their input's length (their counts are agreed instead).
RAGGED = ("allgather", "alltoall", "gather", "scatter")


def _auto_bytes(call: Call) -> int:
    """``auto``'s message bytes, the same on every rank: the per-rank input, or where ranks
    may differ (``RAGGED``), the mean over ranks of what they agreed to move."""
    collective = call.collective
    if collective in ("allgather", "gather", "scatter"):
        return sum(call.counts) * call.x.dtype.itemsize // call.ctx.size
    if collective == "alltoall":
        return sum(map(sum, call.counts[2])) * call.x.dtype.itemsize // call.ctx.size
    return call.x.flat.nbytes


def nothing_to_move(call: Call) -> bool:
    """Whether no rank has a byte to move (known alike on every rank)."""
    collective, counts = call.collective, call.counts
    if collective == "barrier" or collective == "scatter":
        # scatter: a rank given out knows only its own block (api._scatter), not the others'
        return False
    if collective == "alltoall":
        return counts[2] is not None and not any(map(any, counts[2]))
    return (call.x.count if counts is None else sum(counts)) == 0


def _single_node(ctx) -> bool:
    """Whether ``ctx``'s ranks share one node (collective on first use, then cached)."""
    from .topology import topology
    return topology(ctx).single_node


def _alone(ctx) -> bool:
    """Whether every node holds one rank of ``ctx`` (cached with the topology)."""
    from .topology import topology
    return max(map(len, topology(ctx).nodes)) == 1


def auto_pick(collective: str, nbytes: int, comm=None, inplace: bool = False) -> str:
    """The algorithm ``algorithm="auto"`` runs on ``comm`` for ``nbytes`` of per-rank input
    (allgather: the mean over ranks; ``inplace``: a call with ``out=x``). Collective on a
    communicator's first use where the rule names a single-node algorithm."""
    ctx = comm_context(comm)
    return _auto(ctx, collective, nbytes, bool(inplace)).name


# -- validate, choose, run ---------------------------------------------------------------------
def start(call: Call, algorithm, check, result, algo=None):
    """Validate across ranks where asked, choose (unless ``algo`` is given) and run ``call``;
    returns the result, or a ``Request`` for a non-blocking call. The one lifecycle of every
    call: number it, let the watchdog see it, check, average first (``op="avg"``), choose, run,
    release. The check comes before the choice: ranks whose arguments differ may choose
    differently, and a choice may ask the topology (collective on first use). ``call.plan``:
    its signature's (``signature.Plan``); a settled one has made the choice already, an
    unsettled one is settled here and kept where the choice depended on the signature alone."""
    ctx, collective = call.ctx, call.collective
    finalize = _traced(call, _timeline.now()) if _timeline.on else None
    plan = call.plan
    run = None if plan is None else plan.run
    if run is not None:
        algo = plan.algo
    named = algo is None and algorithm != "auto"
    if named:  # an unknown name is this rank's own error, told to the others by the check
        try:
            algo = select.get(collective, algorithm)
        except (TypeError, ValueError) as exc:
            raise _check.failed(ctx, collective, check, exc)
    call.algorithm = algorithm if algo is None else algo.name
    call.algo = algo
    call.seq = seq = ctx.seq  # ctx.next_seq(), inline: this runs on every call
    ctx.seq = seq + 1
    entry = None
    if run is not None and plan.learned is not None:  # its counts exchanged again, first
        entry = _again(call, plan, seq)
    if ctx.pending:
        drain(ctx)
    checking = check if check is not None else config.current.COLLECTIVES_CHECK
    if ctx.size > 1:
        phase = "check" if checking else "run"
        if entry is not None:
            entry.counted(phase)
        elif call.blocking:
            entry = _watchdog.enter(ctx, call, phase)
        elif _watchdog.enabled():
            entry = _watchdog.watch(ctx, call, phase=phase)
    try:
        if checking:
            verify(call, algorithm, seq)
            if entry is not None:
                entry.checked()
        if run is not None:  # the signature's choice, made
            op = call.op
            if op is not None and op.is_avg and ctx.size > 1 and not algo.averages:
                mean_first(call)
            work = run(call)
        else:
            work = _choose_and_run(call, algo, named, plan)
        if entry is not None and work is not DONE:
            entry.attach(work)  # what the watchdog asks where this rank waits
        if call.blocking:
            if work is not DONE and work is not None:
                work.wait()
        elif getattr(work, "needs_progress", False):
            ctx.pending.append((work, entry))
    except BaseException as exc:
        if entry is not None:
            _watchdog.unwatch(entry, exc)
        if run is not None:
            plan.empty()
        raise network_error(exc, f"rank {ctx.rank}: {call.describe()}")
    if call.blocking:
        if entry is not None:  # the communicator's reused entry keeps no buffer until next time
            entry.release()
        if run is not None:  # nor do the plan's Buffers
            plan.empty()
        if finalize is not None:
            finalize()
        return result
    return Request(work, result, finalize, description=call.describe(),
                   release=None if entry is None else entry.finished)


def _again(call: Call, plan: Plan, seq: int):
    """The first step of a settled plan's call whose counts are learned: the plan's exchange
    made again (``shapes.Learned.again``), under the call's own watchdog entry (returned;
    None where there is none), where the full path makes it before the call. ``Changed``
    where a rank's counts differ now, the call given back first (its number, its plan's
    buffers, its entry) for the full path to make it again."""
    ctx = call.ctx
    entry = _watchdog.enter(ctx, call, _watchdog.COUNTS) if ctx.size > 1 else None
    try:
        table = plan.learned.again(ctx)
    except BaseException as exc:
        if entry is not None:
            _watchdog.unwatch(entry, exc)
        plan.empty()
        raise network_error(exc, f"rank {ctx.rank}: {call.describe()}")
    if table is not None:
        ctx.seq = seq
        if entry is not None:
            entry.release()
        plan.empty()
        raise Changed(table)
    return entry


def _choose_and_run(call: Call, algo, named: bool, plan: Plan | None):
    """``start``'s steps from averaging to running, for a call without a settled plan: average
    first, choose (``algo`` where given or named), run; settle ``plan`` where the choice read
    the signature only."""
    ctx, collective = call.ctx, call.collective
    agreed = None
    nbytes = -1 if algo is not None else _auto_bytes(call)
    prefs = PREFERENCES[collective]
    settles = plan is not None and call.blocking
    if prefs and nbytes >= 0:  # buffer-dependent: they see the call as the caller made it
        above = _AGREE_ABOVE.get(collective)
        if above is None or above[0] is not prefs:
            above = _AGREE_ABOVE[collective] = (prefs, min(r.agree_above for r in prefs))
        if nbytes > above[1]:
            settles = False
            algo, agreed = preferred(call, nbytes) or (None, None)
    if call.op is not None and call.op.is_avg and ctx.size > 1 and \
            not (algo is not None and algo.averages):
        mean_first(call)
    if algo is None:
        memo = ctx.slots.get(_AutoMemo)  # the memo's hit, inline
        algo = memo.picks.get((collective, nbytes, call.inplace)) if memo is not None and \
            memo.setting is config.current.COLLECTIVES_TUNING else None
        if algo is None:
            algo = _auto(ctx, collective, nbytes, call.inplace)
    call.algorithm, call.algo = algo.name, algo
    if named and algo.needs is ONE_NODE and ctx.size > 1 and not _single_node(ctx):
        raise ValueError(f"algorithm {algo.name!r} needs every rank on one node, but this "
                         f"communicator of {ctx.size} ranks spans nodes")
    work = _run(call, algo, agreed)
    if settles:
        plan.algo, plan.run = algo, _launcher(call, algo)
        keep(ctx, plan)
    return work


def verify(call: Call, algorithm, seq: int) -> None:
    """The cross-rank check of ``call`` (``collectives.check``): ragged collectives' ranks may
    differ in length, so their counts (agreed already) are compared, except scatter's (a rank
    given out may know only its own block); an allreduce is in place on every rank or on
    none."""
    collective = call.collective
    counts = call.counts[2] if collective == "alltoall" else \
        None if collective == "scatter" else call.counts
    asked = f"{algorithm} in place" if call.inplace and collective == "allreduce" else algorithm
    _check.verify(call.ctx.comm, collective=collective,
                  elements=None if collective in RAGGED else call.x.count,
                  dtype=call.x.dtype.name, op=None if call.op is None else call.op.name,
                  root=call.root, algorithm=asked, sequence=seq, counts=counts)


def preferred(call: Call, nbytes: int | None = None):
    """``(record, plan)`` of the first of ``auto``'s buffer-dependent preferences that every
    rank agrees to run ``call`` with (``Algorithm.agree``), or None (``nbytes``: ``auto``'s
    bytes of the call, the same on every rank)."""
    if nbytes is None:
        nbytes = _auto_bytes(call)
    for record in PREFERENCES[call.collective]:
        if nbytes > record.agree_above:
            plan = record.agree(call, nbytes)
            if plan is not None:
                return record, plan
    return None


# Per collective: (its preferences, the fewest bytes above which one of them may agree).
_AGREE_ABOVE: dict = {}


def auto_algorithm(call: Call) -> select.Algorithm:
    """The record ``auto``'s table names for ``call`` (the same on every rank)."""
    return _auto(call.ctx, call.collective, _auto_bytes(call), call.inplace)


def mean_first(call: Call) -> None:
    """Turn ``call``'s ``op="avg"`` into a sum of inputs already divided by the rank count
    (``ops.mean_first``), so that no partial sum of a mean the dtype can represent overflows:
    an allreduce or a root's reduce divides x into its output and then sums in place; the
    others divide into a scratch copy and send that (x itself is never modified)."""
    size = call.ctx.size
    x, out = call.x, call.out
    if out is not None and call.collective != "reduce_scatter":
        ops.mean_first(x.flat, size, out.flat)
        call.x, call.inplace = out, out.count > 0
    else:
        scratch = x.new(x.shape)
        ops.mean_first(x.flat, size, scratch.flat)
        call.x = scratch
    call.op = resolve("sum", call.op.dtype)


def _traced(call: Call, t0: float):
    """A finalizer that records ``call`` on the timeline, from ``t0`` to now."""
    def record():
        x = call.x
        _timeline.span_event(call.collective, "collective", t0, _timeline.now(), {
            "algorithm": call.algorithm, "bytes": 0 if x is None else x.count * x.dtype.itemsize,
            "blocking": call.blocking, "seq": call.seq})
    return record


def _run(call: Call, algo: select.Algorithm, agreed=None):
    """Start ``call`` with ``algo`` (``agreed``: what ``algo.agree`` agreed, for a record that
    agrees)."""
    return _launcher(call, algo, agreed)(call)


def _launcher(call: Call, algo: select.Algorithm, agreed=None):
    """How ``algo`` starts ``call``, and every call of the same signature
    (``Plan``): ``run(call) -> work``, by the record's kind, the one place that dispatches on
    it. The MPI library's own collectives, blocking on host memory, have the method, datatypes
    and layouts worked out once (``native.prepare``)."""
    ctx = call.ctx
    if ctx.size == 1 or ((call.counts is not None or not call.x.count) and
                         nothing_to_move(call)):
        return _trivial
    if algo.kind is SCHEDULE:
        build = algo.build[call.collective]
        extra = _topology_kwargs(ctx) if algo.needs is TOPOLOGY else ()
        return lambda call: launch_schedule(call, schedule_for(call, build, extra))
    if call.x.device != "cpu":  # straight to a CUDA-aware MPI, or staged through host memory
        from . import cuda_transport
        if algo.kind is NATIVE:
            return lambda call: cuda_transport.native(call, algo.launch)
        return lambda call: cuda_transport.staged(call, algo.launch)
    if algo.kind is NATIVE and algo.launch is native.launch and call.blocking:
        return native.prepare(call)
    return algo.launch if algo.agree is None else lambda call: algo.launch(call, agreed)


def _topology_kwargs(ctx) -> tuple:
    from .topology import topology
    return topology(ctx).kwargs()


def drain(ctx) -> None:
    """Run the earlier non-blocking calls on ``ctx`` that move only when a rank runs them
    (shm's) before a later call starts: every rank issued them in the same order, so every rank
    runs them here or in a wait, and none waits in a later collective for a peer that waits in
    an earlier one. An error stays with its call, for its ``wait`` to raise."""
    pending, ctx.pending = ctx.pending, []
    for work, entry in pending:
        if not work.done:
            try:
                work.wait()
            except BaseException:  # noqa: BLE001 - raised again by the call's own wait
                pass
        if entry is not None:
            entry.finished(work)


def _trivial(call: Call):
    """One rank, or nothing to move: the result is the input (or nothing)."""
    if call.collective != "broadcast" and not call.inplace and call.out is not None:
        n = min(call.out.count, call.x.count)
        if n:
            call.out.flat[:n] = call.x.flat[:n]
    return DONE
