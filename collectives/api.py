"""The public API: argument checks, buffer wrapping, algorithm selection, running.

Every collective goes through the same four steps:

1. *Check and wrap* (``_prepare``): the arguments are checked with the facts every rank has, so
   a bad call raises the same ``ValueError``/``TypeError`` on every rank before a byte moves;
   ``x`` and ``out`` become flat zero-copy views (``collectives.buffers``).
2. *Choose* the algorithm: by name, or ``auto`` from the tuning table (``collectives.select``).
3. *Validate across ranks* when ``COLLECTIVES_CHECK=1`` or ``check=True`` (``collectives.check``).
4. *Run*: a schedule algorithm is built once per shape (cached), bound to the buffers and run by
   the executor; a direct algorithm (``native``, ``shm``) is launched as it is. Blocking calls run
   in the caller's thread; ``i*`` calls return a ``Request`` driven by the progress thread.

Without ``out`` the input is never modified and a new array of x's kind is returned; ``out=x``
is in place, and an allreduce is in place on every rank or on none (as ``MPI_IN_PLACE``):
``auto`` has in-place rules of its own (``collectives.select``). On error the input is
untouched; ``out`` may be partly written if the error came from the network after the
collective started (checks happen before). Collectives on two or
more ranks are registered with the watchdog (``collectives.watchdog``) while they run.
"""
from __future__ import annotations

import functools
import math
from time import perf_counter

import numpy as np

from . import check as _check
from . import native, select
from . import watchdog as _watchdog
from .buffers import Buffer, wrap
from .errors import OFF_WORDS, env_raw, getenv, network_error
from .executor import Run, context, segment_elems
from .ops import resolve
from .progress import Done, Request, _cores
from .select import REGISTRY as _REGISTRY

__all__ = ["allreduce", "reduce", "broadcast", "reduce_scatter", "allgather",
           "iallreduce", "ireduce", "ibroadcast", "ireduce_scatter", "iallgather",
           "algorithms", "auto_pick", "auto_trial", "Call"]


def algorithms(collective: str) -> tuple[str, ...]:
    """Names that ``algorithm=`` accepts for ``collective`` (besides ``"auto"``)."""
    return select.algorithms(collective)


class Call:
    """One collective call, checked and wrapped: what an algorithm's ``launch`` receives.

    ``x``/``out`` are ``Buffer``s (``out`` is x itself when in place, scratch on non-root ranks
    of ``reduce``); ``counts`` are per-rank element counts (reduce_scatter, allgather).
    """

    __slots__ = ("collective", "ctx", "x", "out", "op", "root", "counts", "algorithm",
                 "inplace", "seq", "blocking")

    def __init__(self, collective, ctx, x, out, op=None, *, root=0, counts=None,
                 inplace=False):
        _fill(self, collective, ctx, x, out, op, root, counts, inplace)

    @property
    def count(self) -> int:
        """Elements of the per-rank input."""
        return self.x.count

    def describe(self) -> str:
        return (f"{self.collective} #{self.seq} ({self.algorithm}, {self.count} x "
                f"{self.x.dtype.name}{'' if self.op is None else ', ' + self.op.name})")


def _fill(call, collective, ctx, x, out, op, root, counts, inplace):
    call.collective, call.ctx, call.x, call.out, call.op = collective, ctx, x, out, op
    call.root, call.counts, call.inplace = root, counts, inplace
    call.algorithm, call.seq, call.blocking = None, -1, True
    return call


def _new_call(collective, ctx, x, out, op=None, root=0, counts=None, inplace=False) -> Call:
    """``Call(...)`` for the API's own hot path: positional, filled slot by slot (measured:
    0.2 us quicker per call than ``__init__`` with keywords)."""
    return _fill(_blank(Call), collective, ctx, x, out, op, root, counts, inplace)


_blank = object.__new__


# -- step 1: checks and buffers ---------------------------------------------------------------
_WORLD = []  # MPI.COMM_WORLD's Context, made on the first call (mpi4py is imported then)


def _context(comm):
    if comm is None:
        if _WORLD:
            return _WORLD[0]
        from mpi4py import MPI
        _WORLD.append(context(MPI.COMM_WORLD))  # lives until MPI_Finalize frees the world
        return _WORLD[0]
    try:
        return context(comm)
    except AttributeError:
        raise TypeError(f"comm must be an mpi4py.MPI.Comm, got {type(comm).__name__}") from None


def _address(buf: Buffer) -> tuple[int, int]:
    iface = getattr(buf.flat, "__cuda_array_interface__", None) or \
        buf.flat.__array_interface__
    start = iface["data"][0]
    return start, start + buf.flat.nbytes


def _output(x: Buffer, out, shape, what="out") -> tuple[Buffer, bool]:
    """Wrap ``out`` (or make one of ``shape``); returns ``(buffer, in_place)``."""
    if out is None:
        return x.new(shape), False
    if out is x.obj and shape is x.shape:  # in place, as allreduce/reduce call it: x is out
        if x.readonly:
            raise ValueError(f"{what} is read-only")
        return x, x.count > 0
    o = wrap(out, what)
    if o.kind != x.kind or o.dtype != x.dtype or o.device != x.device:
        raise TypeError(f"{what} is {o.describe()}, expected a {x.kind} {x.dtype.name} buffer "
                        f"on {x.device}")
    if o.shape != shape and o.shape != tuple(shape):
        raise ValueError(f"{what} has shape {list(o.shape)}, expected {list(shape)}")
    if o.readonly:
        raise ValueError(f"{what} is read-only")
    if o.obj is x.obj or (x.kind == "numpy" and not np.may_share_memory(x.flat, o.flat)):
        return o, o.obj is x.obj and x.count > 0  # the common cases, without address arithmetic
    xa, oa = _address(x), _address(o)
    same = xa == oa and x.count > 0
    if not same and x.count and o.count and xa[0] < oa[1] and oa[0] < xa[1]:
        raise ValueError(f"{what} partly overlaps x; pass out=x for in place or a separate "
                         f"buffer")
    return o, same


def _single_node(ctx) -> bool:
    """Whether ``ctx``'s ranks share one node (collective on first use, then cached)."""
    from .topology import topology
    return topology(ctx).single_node


def _root(root, size) -> int:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or \
            not 0 <= root < size:
        raise ValueError(f"root {root!r} out of range for a communicator of {size} ranks")
    return int(root)


# -- step 2-4: choose, validate, run ----------------------------------------------------------
@functools.lru_cache(maxsize=512)
def _schedule(collective, name, rank, size, count, counts, root, seg, extra):
    builder = select.get(collective, name)
    kwargs = dict(extra)
    if collective == "allreduce":
        s = builder(rank, size, count, seg=seg, **kwargs)
    elif collective in ("reduce", "broadcast"):
        s = builder(rank, size, count, root, seg=seg, **kwargs)
    else:
        s = builder(rank, size, counts, seg=seg, **kwargs)
    s.validate()
    s.plan()
    return s


def _transport(call: Call):
    if call.x.is_device:
        from . import cuda
        return cuda.transport(call.ctx, call.x)
    return call.ctx.transport


def _start(call: Call, algorithm: str, check, blocking: bool, result, finalize=None):
    """Choose, validate and run ``call``; returns the result or a ``Request``."""
    ctx, collective, count = call.ctx, call.collective, call.x.count
    trial = None
    # ``auto`` must cost no more than naming its pick. A call like the last auto call on this
    # communicator (the same collective, bytes, in place or not, counts and
    # COLLECTIVES_TUNING) repeats its *plan*: the algorithm, and how it runs (``_runner``),
    # which the named path works out on every call; others go to ``_auto_plan``. Measured
    # with the benchmark (``native`` against ``auto`` running it, 8 B - 8 KiB, 12 sizes x
    # modes): repeating the pick alone and working out the rest on every call, ``auto`` was
    # 1-2% slower at n = 2 and 2-3% at n = 3 (~900 instructions a call more than ``native``,
    # callgrind); with the plan, 0-0.5% and ~1% (~700).
    try:
        if algorithm == "auto":
            last = ctx.auto_last
            if call.x.flat.nbytes == last[1] and collective is last[0] and \
                    call.inplace is last[2] and (call.counts is None or call.counts == last[3]) \
                    and env_raw(b"COLLECTIVES_TUNING") is last[4] and (last[6] or _exact(call)):
                if last[7] is None:
                    name, builder, run = last[5]
                elif last[5] is None:  # a race's calls: its next step while it runs
                    if last[7].decided is None and blocking:
                        name, builder, run = last[7].step(call)
                        trial = last[7]
                    else:
                        name, builder, run, trial = _auto_plan(call, blocking)
                elif last[7].tick():
                    name, builder, run = last[5]
                else:  # counted: a probe's call, or a race again
                    name, builder, run, trial = _auto_plan(call, blocking, ticked=True)
            else:
                name, builder, run, trial = _auto_plan(call, blocking)
        else:
            try:
                name, builder = algorithm, _REGISTRY[collective].get(algorithm)
            except TypeError:  # unhashable
                builder = None
            if builder is None:  # not loaded yet, or unknown: the error lists the names
                builder = select.get(collective, algorithm)
            if ctx.size == 1 or (sum(call.counts) if call.counts is not None else count) == 0:
                run = _trivial
            elif builder == select.NATIVE:
                run = _native
            elif hasattr(builder, "launch"):
                run = _launch
            else:
                run = _run_schedule
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, collective, check, exc)
    call.algorithm = name
    call.blocking = blocking
    call.seq = seq = ctx.next_seq()
    if ctx.pending:
        _drain(ctx)
    checking = _check.enabled(check)
    entry = None
    if _watchdog.LIMIT and ctx.size > 1 and (checking or run is not _trivial):
        entry = _watchdog.watch(ctx, call, phase="check" if checking else "run")
    try:
        if checking:
            # allgather's ranks may differ in length: its counts (agreed already) are compared.
            _check.verify(ctx.comm, collective=collective,
                          elements=None if collective == "allgather" else count,
                          dtype=call.x.dtype.name, op=None if call.op is None else call.op.name,
                          root=call.root, algorithm=name, counts=call.counts, sequence=seq)
            if entry is not None:
                entry.phase = "run"
        if trial is not None and trial.timing:
            # after the check: a mismatched call raises, not waits in a barrier; a block is
            # timed from that barrier, before its first timed call, to its last call's end
            trial.start()
        work = run(call, name, builder)
        if not blocking and getattr(work, "needs_progress", False):
            ctx.pending.append(work)
        if entry is not None:
            entry.work = work
        if blocking:
            work.wait()
    except BaseException as exc:
        if entry is not None:
            _watchdog.unwatch(entry, exc)
        raise _network_error(call, exc)
    if blocking:
        if entry is not None:
            _watchdog.unwatch(entry)
        if trial is not None and trial.timing:
            trial.record()
        if finalize is not None:
            finalize()
        return result
    return Request(work, result, finalize, description=call.describe())


def _drain(ctx) -> None:
    """Run the earlier non-blocking calls on ``ctx`` that move only when a rank runs them
    (shm's) before a later call starts: every rank issued them in the same order, so every rank
    runs them here or in a wait, and none waits in a later collective for a peer that waits in
    an earlier one (DDP, 3 ranks: a bucket's shm allreduce run by one rank's progress in a
    gradient hook, the other ranks already in the unused-parameter exchange, until the
    timeout). An error stays with its call, for its ``wait`` to raise."""
    pending, ctx.pending = ctx.pending, []
    for work in pending:
        if not work.done:
            try:
                work.wait()
            except BaseException:  # noqa: BLE001 - raised again by the call's own wait
                pass


def _auto_plan(call: Call, blocking: bool, ticked: bool = False):
    """``(name, builder, run, trial)`` for an ``auto`` call unlike the last one (``_start``):
    from the memo (``_auto``), or the next step of a trial (``_Trial``, returned so that the
    call is timed: a race's, or a probe's); a plan that every call like this one may repeat is
    kept in ``ctx.auto_last``. ``ticked``: the plan's trial has counted this call already."""
    ctx, collective = call.ctx, call.collective
    nbytes = own = call.x.flat.nbytes
    if call.counts is not None and collective == "allgather":
        # Its ranks may differ in length: the mean, so that every rank picks alike.
        nbytes = sum(call.counts) * call.x.dtype.itemsize // ctx.size
    # in place has rules of its own (allreduce: in place on every rank or none)
    key = ~nbytes if call.inplace and collective in _IN_PLACE else nbytes
    env = env_raw(b"COLLECTIVES_TUNING")
    hit, trial = _auto(ctx, collective, key, env), None
    if type(hit) is tuple:
        pick, anycall, hit = hit, True, None
    else:  # a rule of several algorithms, measured here
        exact = _exact(call)
        pick = hit.next(blocking, exact, ticked)
        if hit.decided is None or not exact or hit.timing:
            if hit.decided is None and blocking and exact:
                # the race's next calls like this one go straight to its next step (``_start``:
                # ``_Trial.step``); through here, a race's call cost ~1 us more than naming
                # the algorithm it ran
                ctx.auto_last = (collective, own, call.inplace, call.counts, env, None, False,
                                 hit)
            return pick + (_runner(call, pick[1]), hit)
        # decided: the same path as a rule of one; a pick other than the rule's first, only for
        # the calls whose result every algorithm gives alike (2 us less at n = 2)
        anycall = hit.decided[0] == hit.names[0]
    name, builder = pick
    run = _runner(call, builder)
    ctx.auto_last = (collective, own, call.inplace, call.counts, env, (name, builder, run),
                     anycall, hit)
    return name, builder, run, trial


def _runner(call: Call, builder):
    """How ``call`` runs with ``builder``, for a plan: ``_trivial`` (one rank, or nothing to
    move), ``_native``, ``_launch`` (a direct algorithm) or ``_scheduled``. (``_start``'s
    named path works it out inline, with ``_run_schedule`` itself: calling this costs ~360
    instructions, ~1% of an 8-byte allreduce, callgrind.)"""
    if call.ctx.size == 1 or \
            (sum(call.counts) if call.counts is not None else call.x.count) == 0:
        return _trivial
    return _native if builder == select.NATIVE else \
        _launch if hasattr(builder, "launch") else _scheduled


def _key_bytes(key: int) -> int:
    """The message bytes of an ``auto`` memo key (``~bytes`` for a call in place)."""
    return key if key >= 0 else ~key


def _auto(ctx, collective: str, key: int, env):
    """``(name, builder)`` that ``auto`` runs on ``ctx``'s communicator for ``key``: the
    message bytes, or ``~bytes`` (negative) for a call in place; ``env`` is the raw
    COLLECTIVES_TUNING.

    Memoized on the communicator (``ctx.auto[collective][key]``) for the tuning table in
    force: when COLLECTIVES_TUNING names another table than the picks were made with, they are
    forgotten.
    """
    if env != ctx.auto_env:  # another table: forget the picks made with the old one
        ctx.auto.clear()
        ctx.auto_trials.clear()
        ctx.auto_env = env
    memo = ctx.auto[collective]
    hit = memo.get(key)
    if hit is None:
        names = select.candidates(collective, _key_bytes(key), ctx.size,
                                  single_node=lambda: _single_node(ctx), inplace=key < 0)
        names = _trials(ctx, collective, names, _key_bytes(key))
        if len(names) > 1:
            hit = _Trial(ctx, collective, key, names)
        else:
            hit = (names[0], select.get(collective, names[0]))
        if len(memo) >= 1024:  # the sizes a program uses are few; a bound all the same
            memo.clear()
        memo[key] = hit
    return hit


def _trials(ctx, collective: str, names: tuple, nbytes: int) -> tuple:
    """The algorithms of a rule for ``nbytes`` (``names``, its first first) that ``auto`` may
    choose among by measuring them here: only where the choice cannot change a result, so that
    results stay the same from run to run (DESIGN): data movement; or 2 ranks, where every
    algorithm reduces an element once and a + b = b + a (``_exact`` says which calls); on more
    ranks the association order differs, and float sums round differently, except among the
    algorithms that combine in the rule's first's order (``select.bits``: tree's, or ring's,
    shared by shm at some sizes and hierarchical on one node). One name: no trial.
    ``COLLECTIVES_AUTO_TRIAL=0`` turns trials off.

    Also where a node runs more of the ranks than it has cores (3 ranks on 2 here), since the
    benchmark and the tuner time 2 ms blocks, as the trial does (when they timed 10 ms blocks
    there, the trial's shorter ones disagreed with them, and trials were off by default). With
    them on, 3 ranks, allgather and broadcast from 32 KiB (two launches each way, the same
    tuning table): allgather ran the best of the row or within 3% of it at every size with
    trials, where the rule's first alone (shm at 512 KiB and 2 MiB, the tuner's pick) was
    0.73-0.85 of ``native`` at four of eight cells; shm runs in two modes minutes apart here.
    Broadcast: two cells of twelve below 0.95 of the best with trials (0.90, 0.91), one
    without (0.92).
    """
    if ctx.size < 2 or len(names) < 2:
        return names[:1]
    ask = (getenv("COLLECTIVES_AUTO_TRIAL") or "").strip().lower()
    if ask in OFF_WORDS:
        return names[:1]
    first = names[0]
    # every rank asks at the same call: collective the first time
    where = _placement(ctx) if any(m.startswith("hierarchical") for m in names) else {}
    # one of two names for the same code (on one node: a race's block less)
    return select.distinct((first,) + tuple(
        m for m in names[1:] if select.races(collective, ctx.size, first, m, nbytes, **where)),
        where.get("single_node", True))


def _placement(ctx) -> dict:
    """``select.bits``' topology keywords for ``ctx``'s communicator (collective on first
    use, as ``topology``)."""
    from .topology import topology
    topo = topology(ctx)
    return {"single_node": topo.single_node, "numa": topo.has_numa}


def _exact(call: Call) -> bool:
    """Whether every algorithm gives ``call`` the same bits (given ``_trials``)."""
    return _exact_op(None if call.op is None else call.op.name, call.x.dtype.kind)


def _exact_op(op: str | None, kind: str) -> bool:
    """Not a float min/max, whose result for -0.0 against +0.0 depends on the operands'
    order."""
    return op not in ("min", "max") or kind in "biu"


class _Trial:
    """``auto``'s measurement of a rule's algorithms on one communicator for one message size
    (STAR-MPI's *delayed finalization*, Faraj, Yuan and Lowenthal, ICS 2006), run as a race.

    The blocking calls of this size run the algorithms in turn. First one round of two calls
    each, the second timed; one ``MPI_Allreduce(MAX)`` of those times sets every algorithm's
    block length, the same on every rank: about ``BLOCK_S`` seconds (3 to 100 calls). Then
    rounds of one block of each algorithm still in the race, in an order that rotates from
    round to round, the block's first call untimed (the switch from the algorithm before) and
    its time the mean of the others; one ``MPI_Allreduce(MAX)`` per round gives every rank the
    slowest rank's block times, so every rank holds the same figures and takes the same
    decisions at the same call. From ``MIN_ROUNDS`` rounds on, an algorithm whose median block
    is clearly slower than the fastest's (by more than ``NOISE`` standard errors of the log of
    their ratio, from the spread of the blocks) leaves the race; the rule's first (the one the
    table measured best) never does. The race ends when the medians of those left are known to
    ``PRECISION``, when the first is the only one left, or after ``MAX_ROUNDS``; the pick is
    the fastest left if it beats the first by more than ``SWITCH``, else the first. The first
    stays to the end so that it is judged on the same rounds as the finalists: when it could
    leave, a slow phase of the machine early in the race put it out and froze its median, and
    the finalists' medians, taken over the later rounds too, ended above it (reduce-scatter, 2
    ranks, 128 KiB: ``native`` out at 29.2 us, recursive halving picked at 33.9). Why a race:
    short blocks of the same code differ by 5-20% here, and a fixed 4-8 rounds decided between
    algorithms within 10% at random (allgather, 2 ranks, 256 KiB: hierarchical by the trial,
    0.89 of ring in the benchmark that followed). Non-blocking calls
    during the trial run the rule's first algorithm and are not timed (a start-to-wait time is
    the caller's); calls whose result could depend on the algorithm (``_exact``) always run the
    first. Once decided, the trial stays in the memo for those; the others repeat the plan kept
    in ``ctx.auto_last``, as the calls of a rule of one do (``_start``).

    A decided trial races again after a while (``RETRIAL_S``, see ``next``), and sooner when its
    pick slows down (``_probe``): about every ``PROBE_S`` seconds (of the program's time, between
    the calls too), the next block of blocking calls is timed, call by call (the time inside the
    calls, not the caller's between them), and one ``MPI_Allreduce(MAX)`` gives every rank the
    slowest rank's median call and the longest time since the last probe (which sets the calls until
    the next); the pick's reference is its race time, or the first probe after the race where that
    ran faster (a probe times less than a race's block, whose barrier and gaps between calls it
    leaves out), and ``TRIP_PROBES`` probes running slower than ``TRIP`` times it start a *duel*
    (``_duel_block``): blocks of the race's runner-up and of the pick in turn, ``DUEL_BLOCKS``
    pairs; only where the runner-up now runs faster against the pick than it did in the race, by
    more than ``DUEL`` (the median pair), and faster than the pick, does a race start at the next
    call. Else the whole machine slowed down, not the pick alone (or the pick is still the faster of
    the two), and the pick's reference becomes its pace now (it comes back down, to the race's, as
    later probes run faster). A race the probes started that kept the same pick doubles the probes
    needed for the next. A probe costs its block's timing and one small allreduce, once in
    ``PROBE_S``; a duel, its blocks and one small allreduce.
    No probes after the first where a node runs more of the ranks than the cores it gives a
    process (``_crowded``, 3 ranks on this machine's 2): a 2 ms block there is the
    scheduler's, and races as well time what it did (allreduce of 128 KiB at 3 ranks: the
    race timed shm at 249 us and tree at 244, the benchmark's rounds 165 and 228; probes
    started races there that put tree in for shm, 0.82 of it, and ring for native in
    allgather, 0.65). There, too, calls under ``CROWDED_MIN`` bytes run the rule's first once
    the race's first round has shown the node crowded, and never race.
    """

    BLOCK_S = 2e-3
    MIN_ROUNDS = 5
    MAX_ROUNDS = 30
    NOISE = 3.0
    PRECISION = 0.015
    # Measured: over five full runs of the benchmark after a tune (F0-F4, docs/bench.md), the
    # races that left the rule's first for an algorithm 3-6% faster in the race did it 16
    # times; the benchmark's rounds after ran the new pick slower than the first in 9 of them
    # (0.79-0.95 of the best where the first was 0.98-1.00: allreduce of 128 KiB at 2 ranks in
    # four runs, broadcast of 8 MiB at 3), faster in 2. Of the 13 switches for 6-10%, 8 were
    # right and 2 wrong.
    SWITCH = 1.06
    # A block's calls are timed from its barrier to its last call's end, the time between them
    # too (``record``), but not a gap of more than GAP_S between two of them: that is the
    # caller's own work. A race again during the benchmark's rows ran its blocks across the
    # rows' blocks of the other algorithms (at 8 MiB a row's block is one or two calls, a
    # race's three), timed those as its own, and took tree for shm at 8 and 32 MiB (reduce, 2
    # and 3 ranks: `auto` 0.82-0.93 of shm's row, four misses of six in run F7).
    GAP_S = 5e-4
    # Again after this many seconds of calls at the pick's measured pace, then after twice as
    # many while the pick stays, up to RETRIAL_MAX (back to the first when it changes), and
    # never before RETRIAL_SHARE times what the race itself took: see ``next``.
    # COLLECTIVES_AUTO_RETRIAL=0: one race only.
    RETRIAL_S = float(getenv("COLLECTIVES_AUTO_RETRIAL") or 1.0)
    RETRIAL_MAX = 64.0
    RETRIAL_SHARE = 20
    # The probes (``_probe``): one about every PROBE_S seconds; a race after TRIP_PROBES of
    # them running at more than TRIP times the pick's reference (its slow modes here: shm's
    # reduce of 512 KiB at 2 ranks went from 50 to 175 us a call after ten rounds of a
    # benchmark and ran there for the next 380, tree at 85 throughout; double binary tree's
    # allreduce of 2 MiB from 460 to 980 us). In seconds of the program's time, not of the
    # calls at the raced pace: at 3 ranks on 2 cores the race timed broadcast's 512 B calls at
    # 125 us where they ran at 19, a probe came every 8 ms, and its allreduces cost the calls
    # 7% (the benchmark, two launches each way). No probes with COLLECTIVES_AUTO_RETRIAL=0
    # or COLLECTIVES_AUTO_PROBE=0 (seconds between probes, 0.25 by default).
    PROBE_S = float(getenv("COLLECTIVES_AUTO_PROBE") or 0.25)
    # 1.5: at 3 ranks on 2 cores a probe of 2 ms scatters (allgather of 32 KiB: native's
    # 30-round medians 116-171 us), and with 1.3 a probe there started a race that put ring in
    # (the benchmark's next rounds 0.65 of native), and at 8 MiB races that ran for a third of
    # the benchmark's rounds. (A trip also had to be past the others' race times, until the
    # duel (below) asked the runner-up itself: a race in a slow phase of the machine timed
    # every algorithm slow, and a pick that slowed down later, past the others' pace then,
    # stayed under those stale figures: broadcast of 32 MiB in place at 2 ranks, shm at
    # 6000-7000 us a call, native at 4200, `auto` ran shm at 0.83 of native.)
    TRIP = 1.5
    TRIP_PROBES = 2
    # The duel (``_duel_block``) before a race the probes would start: DUEL_BLOCKS pairs of
    # blocks, the race's runner-up's then the pick's, and a race only where the median pair's
    # ratio has fallen below the race's by more than DUEL. DUEL: halfway, in log, between
    # both slowed alike (the ratio stays) and the pick alone slowed by TRIP (it falls by 1.5).
    # Why: at 2 MiB and more every algorithm here runs in slow phases about 2x apart, which
    # trip the probes; a race in a program's steady calls runs every algorithm of the rule,
    # the slow ones too, for MIN_ROUNDS rounds or more. In the benchmark's rows of an
    # allreduce of 8 MiB in place at 2 ranks (a rule of six, native and shm 1.4-1.6x the
    # pick), probes started three races in 20 s, each running for 9 s of the rows (one block
    # of `auto` a round), and `auto`'s blocks ran 1.05-1.28x ring's in those stretches, 1.0
    # between them: 0.93 of its own pick's row (two launches). Before the duel, a local copy
    # of 1 MiB (three, timed at every probe) told the machine's slow phases from the pick's
    # (the session's runs I0-J3), and cost more than the probes' races: 0.45 ms a probe at
    # 8 MiB (the allreduce alone 0.07), in every fifth of `auto`'s blocks of those rows, and
    # `auto` ran 0.92-0.94 of ring's row where it ran ring (0.98-1.00 without probes). The
    # duel times what the copy stood for, and only when the probes trip.
    DUEL = math.sqrt(TRIP)
    DUEL_BLOCKS = 3
    # Where a node is crowded (``_crowded``), calls of fewer bytes than this run the rule's
    # first after the race's first round, and never race: their blocks of 15-40 us calls time
    # the scheduler. At 3 ranks on 2 cores, in the benchmark's runs with races below 32 KiB
    # (55 cells of allgather and broadcast, 39 launches), the race changed the pick twice, both
    # broadcast of 512 B, both times to 0.45-0.58 of native (it timed native at 37 us a call,
    # the benchmark's rounds after at 14-16); the rule's first was within 5% of the best in 54
    # of the 55.
    # From 32 KiB the race's changes of pick made 84 cells 0.97 of the best on average, where
    # the rule's first ran 0.79.
    CROWDED_MIN = 32 << 10

    __slots__ = ("ctx", "collective", "key", "names", "builders", "blocks", "timing",
                 "decided", "plan", "alive", "_step", "_t0", "_first", "_lengths", "_round",
                 "_sync", "_end", "left", "every", "_last", "_spent", "probe", "_probe_every",
                 "_probe_len", "_probe_t", "_ref", "_over", "_need", "_tripped",
                 "_buf", "_probe_wall", "_probed", "_crowd", "_fast", "_fast0",
                 "runs", "_rival", "_rival_ratio", "_duel_left", "_duel_t", "_now", "_ref0")

    def __init__(self, ctx, collective, key, names):
        self.ctx, self.collective, self.key, self.names = ctx, collective, key, names
        self.builders = [select.get(collective, name) for name in names]
        self.runs = [None] * len(names)  # how each runs (``_runner``), for ``step``
        self.every, self._last = self.RETRIAL_S, None
        self._need, self._tripped = self.TRIP_PROBES, False
        self._buf = np.zeros(2)
        self._reset()

    def _reset(self) -> None:
        """A race from the start (the first trial, and each one after)."""
        names = self.names
        # the plan kept for calls like the last would run the old pick after the race
        # decides (on the ranks whose calls take that path: a reduce's root in place and
        # the others not, and the two ranks ran tree and shm in one call, until the watchdog)
        self._forget_plan()
        self.blocks: list[list[float]] = [[] for _ in names]  # mean seconds per call
        self.timing = False
        self.decided = None  # (name, builder) once measured
        self.left = 0  # calls until the next trial, once decided
        self.probe = 0  # calls until the next probe, once decided (<= 0: probing)
        self._fast = self._fast0 = 0  # calls tick() lets through uncounted (``_arm``)
        self._spent = 0.0  # seconds of timed blocks in this race (the slowest rank's)
        self.alive = list(range(len(names)))  # those still in the race
        # the calls to come, as (algorithm, timed, block ends); then rounds of blocks
        self.plan = [(i, k == 1, k == 1) for i in self.alive for k in range(2)]
        self._sync = True  # the next timed call starts a block's timing: a barrier first
        self._step = 0
        self._t0 = 0.0  # when the current block's timed calls began (after its barrier)
        self._end = 0.0  # when the race's last timed call ended
        self._first = True  # still in the first round (single timed calls)
        # this round's block times, agreed at its end; after the first round, whether some
        # node is crowded (``_crowded``)
        self._round = np.zeros(len(names) + 1)
        # the duel (``_duel_block``): the blocks still to time, as indices (the runner-up's,
        # then the pick's, in turn), and the times of those timed
        self._duel_left: list[int] = []
        self._duel_t: list[float] = []

    def _forget_plan(self) -> None:
        """Drop the plan kept for calls like the last (``ctx.auto_last``) if it is this
        trial's: when a race starts (the old pick's) and when it ends (the race's steps)."""
        if self.ctx.auto_last[7] is self:
            self.ctx.auto_last = (None,) * 8

    def next(self, blocking: bool, exact: bool = True, ticked: bool = False):
        """``(name, builder)`` for this call; sets ``timing`` (record its time). ``ticked``:
        ``tick`` has counted this call already (and said no).

        A decided trial counts the calls that run its pick (``tick``: every rank makes the same
        calls, so every rank counts alike, whichever path a call takes) and races again when
        they are used up, or when its probes found the pick slower (``_probe``): the machine
        changes under a process (here shm's reduce of 512 KiB at 2 ranks ran 260-300 us a call
        for a minute, then 45-60, while binomial and tree ran 80-140 throughout), and a pick
        made in one phase of it is wrong in the next.
        """
        self.timing = False
        if not exact:
            return self.names[0], self.builders[0]
        if self.decided is not None:
            if not ticked and self.tick():
                return self.decided
            if self.left >= 0 or not self.RETRIAL_S:  # a probe's call, or a duel's
                self.timing = blocking
                if self._duel_left and blocking:
                    i = self._duel_left[0]
                    return self.names[i], self.builders[i]
                return self.decided
            self._reset()
        if not blocking:
            return self.names[0], self.builders[0]
        i = self._race_step()
        return self.names[i], self.builders[i]

    def step(self, call):
        """``next`` for a blocking, exact call while the race runs, as ``(name, builder,
        run)`` (``_start``'s path for calls like the last): the same step, its runner kept."""
        i = self._race_step()
        run = self.runs[i]
        if run is None:
            run = self.runs[i] = _runner(call, self.builders[i])
        return self.names[i], self.builders[i], run

    def _race_step(self) -> int:
        """The algorithm of the race's next call (an index); sets ``timing``."""
        i, timed, _ = self.plan[self._step]
        self.timing = timed
        if not timed:  # (a timed call's step is taken by ``record``)
            self._step += 1
        return i

    def tick(self) -> bool:
        """One call of the decided pick: False when it is time to measure again (or the race
        runs now).

        Every call of a decided trial comes here (``_start``'s plan path included), so it
        costs one counter: the calls that ``_arm`` knows will run the pick count down
        ``_fast``, and the call after them settles ``left`` and ``probe`` (``_tick``). Counting
        both on every call cost ~0.2 us a call more than naming the pick (an 8-byte
        allreduce at n = 2, its rule native then tree, decided for native: 5.59 against
        5.38 us, 4%); with the one counter, 0.07-0.15 us (four launches: 1.3-2.9%)."""
        fast = self._fast
        if fast:
            self._fast = fast - 1
            return True
        return self._tick()

    def _tick(self) -> bool:
        """``tick`` once ``_fast`` is used up: ``left`` and ``probe`` count the calls it
        took and this one; True while neither a probe nor a race is due."""
        if self.decided is None:
            return False
        taken = self._fast0 + 1
        self.left -= taken
        self.probe -= taken
        due = self.probe <= 0 or (self.left < 0 and self.RETRIAL_S)
        self._arm()
        return not due

    def _arm(self) -> None:
        """After ``left`` or ``probe`` is set: the calls to come that run the pick whatever
        happens (the probe's call and the race's are the ones after them)."""
        fast = self.probe - 1
        if self.RETRIAL_S:
            fast = min(fast, self.left)
        self._fast = self._fast0 = max(0, fast)

    def start(self) -> None:
        """Just before a timed call runs (after its checks): at a block's first, a barrier,
        and the block's time starts.

        Every rank starts the block's timed calls together, as the benchmark's blocks do:
        without it a rooted collective's ranks ran their calls skewed by the block before, and
        broadcast at 3 ranks, 2 MiB, timed native at 660-760 us in the trial and 510-540 in the
        benchmark (binomial 470-510 against 600-630), and the trial picked binomial.
        A probe's calls are timed alone, without barriers. Within a block, a gap of more
        than ``GAP_S`` since the last timed call ended is left out of the block's time.
        """
        if self.decided is not None:
            self._t0 = perf_counter()
        elif self._sync:
            self._sync = False
            self.ctx.comm.Barrier()
            self._t0 = perf_counter()
        else:
            gap = perf_counter() - self._end
            if gap > self.GAP_S:  # the caller's own time between two calls: left out
                self._t0 += gap

    def record(self) -> None:
        """A timed call that ``next`` chose has returned; at a block's end, the block's time a
        call, from its barrier to now (the time between its calls too, but a gap of more than
        ``GAP_S``, which is the caller's: see ``start``; allgather's count
        exchanges among them, as the benchmark's blocks: timing the calls alone, the trial
        measured every reduce at 2 ranks, 128 KiB, at 28-31 us, the benchmark's blocks right
        after at 36-41, and it left out more of some algorithms than of others, those whose
        messages move between calls: it picked tree at 28.5 against shm's 31.0, where the
        blocks ran tree at 40.8 and shm at 36.0; run M); at a round's end, the next round or
        the decision; at a probe's last call, its verdict (``_probe``)."""
        self.timing = False
        if self.decided is not None:
            self._probe_t.append(perf_counter() - self._t0)
            if len(self._probe_t) >= self._probe_len:
                if self._duel_left:
                    self._duel_block()
                else:
                    self._probe()
            return
        i, _, ends = self.plan[self._step]
        self._step += 1
        self._end = end = perf_counter()
        if ends:
            self._round[i] = (end - self._t0) / (1 if self._first else self._lengths[i] - 1)
            self._sync = True
        if self._step < len(self.plan):
            return
        from mpi4py import MPI
        # every rank the slowest rank's block times (the same figures everywhere)
        last = len(self.names)
        self._round[last] = self._crowded() if self._first else 0.0
        self.ctx.comm.Allreduce(MPI.IN_PLACE, self._round, op=MPI.MAX)
        if self._first:  # block lengths from the single calls
            self._crowd = bool(self._round[last])  # some node crowded (every rank alike)
            if self._crowd and _key_bytes(self.key) < self.CROWDED_MIN:
                self._keep_first()
                return
            self._lengths = [self._length(t) for t in self._round[:last]]
            self._first = False
        else:
            for i in self.alive:
                self.blocks[i].append(float(self._round[i]))
                self._spent += float(self._round[i]) * self._lengths[i]
            if self._decide():
                return
            # and again from each round's blocks: a size's first calls may pay what later ones
            # do not (shm's first calls at 512 KiB faulted its window's pages in, 0.5-1.6 ms a
            # call against 60, and its blocks were 3 calls long, two timed, where tree's were
            # 13-15: shm's timed calls, still filling its pipeline, measured 85-115 us where
            # its 10-call blocks ran 52-64, and the trial picked tree, 0.5-0.63 of shm)
            for i in self.alive:
                self._lengths[i] = self._length(self._round[i])
        rnd = len(self.blocks[0])
        m = len(self.alive)
        self.plan = [(i, k > 0, k == self._lengths[i] - 1)
                     for i in (self.alive[(slot + rnd) % m] for slot in range(m))
                     for k in range(self._lengths[i])]
        self._step = 0

    def _keep_first(self) -> None:
        """Decided for the rule's first, with no race again (``CROWDED_MIN``)."""
        self.decided = (self.names[0], self.builders[0])
        self._forget_plan()
        self.left = self.probe = 10 ** 12
        self._arm()
        self.ctx.auto_trials[(self.collective, self.key)] = {}

    def _length(self, seconds: float) -> int:
        """Calls in a block of about ``BLOCK_S`` at ``seconds`` a call (3 to 100)."""
        return int(min(100, max(3, round(self.BLOCK_S / max(seconds, 1e-9)))))

    def _decide(self) -> bool:
        """After a round: who leaves the race, and whether it is over (``decided`` set)."""
        rounds = len(self.blocks[self.alive[0]])
        if rounds < self.MIN_ROUNDS:
            return False
        med, err = {}, {}
        for i in self.alive:
            logs = np.log(np.maximum(self.blocks[i], 1e-12))
            med[i] = float(np.median(logs))
            # the median's standard error: 1.2533 sigma / sqrt(k), sigma from the MAD
            err[i] = 1.8581 * float(np.median(np.abs(logs - med[i]))) / math.sqrt(len(logs))
        best = min(self.alive, key=med.__getitem__)
        out = [i for i in self.alive if i != best and i != 0 and
               med[i] - med[best] > self.NOISE * math.hypot(err[i], err[best])]
        self.alive = [i for i in self.alive if i not in out]
        tied = all(math.hypot(err[i], err[best]) <= self.PRECISION for i in self.alive)
        if len(self.alive) > 1 and not tied and rounds < self.MAX_ROUNDS:
            return False
        # the fastest, where it beats the rule's first by more than SWITCH: tied medians known
        # to 1.5% may still be 4% apart (binomial against tree, 2 ranks, 512 KiB in place:
        # kept binomial, 0.92 of tree in the benchmark after)
        pick = best if med[0] - med[best] > math.log(self.SWITCH) else 0
        self.decided = (self.names[pick], self.builders[pick])
        self._forget_plan()
        # the next race: after ``every`` seconds at the pick's pace, and at least RETRIAL_SHARE
        # times this one's length (at most 5% of the time in races), from figures every rank
        # holds
        spent = self._spent
        self.every = self.every * 2 if pick == self._last else self.RETRIAL_S
        self.every = min(self.every, self.RETRIAL_MAX)
        if self._tripped:  # a race the probes started: kept the pick, or followed the machine
            self._need = self._need * 2 if pick == self._last else self.TRIP_PROBES
            self._tripped = False
        self._last = pick
        pace = max(math.exp(med[pick]), 1e-7)
        self.left = int(min(1e12, max(self.every, self.RETRIAL_SHARE * spent) / pace))
        # the probes: blocks as long as the race's; the first after a quarter of PROBE_S
        # seconds of calls at the pick's pace, the others as their time apart says
        # (``_probe``). A quarter: where the program makes other calls between these, the
        # calls at the pick's pace come slower than that, and PROBE_S of them was more than
        # the benchmark's rows made (allreduce of 128 KiB in place at 2 ranks: 36 calls a
        # block, 69 blocks; native went from 38 to 83 us a call in the ninth and stayed there,
        # shm at 50, no probe came, and `auto` ran native at 0.61 of shm, run J0)
        self._probe_len = self._lengths[pick]
        self._probe_every = self.probe = int(min(1e12, max(
            2 * self._probe_len, self.PROBE_S / (4 * pace)) if self._probing() else 1e12))
        self._arm()
        self._probe_t, self._ref, self._over = [], pace, 0
        self._probe_wall, self._probed = perf_counter(), False
        others = {i: float(np.median(b)) for i, b in enumerate(self.blocks) if i != pick and b}
        # the duel's runner-up, and how it ran against the pick in this race
        self._rival = min(others, key=others.__getitem__) if others else None
        self._rival_ratio = others[self._rival] / math.exp(med[pick]) if others else math.inf
        self.ctx.auto_trials[(self.collective, self.key)] = {
            name: float(np.median(b)) for name, b in zip(self.names, self.blocks)}
        return True

    def _probe(self) -> None:
        """A probe's verdict (see the class doc): every rank the slowest rank's median time a
        call, and the longest time since the last probe, the same figures everywhere;
        ``_need`` probes in a row above ``TRIP`` times the reference (the race's time, or the
        first probe's if lower; after a duel that found the machine slower, the pace then,
        back down towards the race's as the probes run faster) start a duel with the race's
        runner-up at the next call (``_duel_block``; a race where there is none). The calls
        until the next probe: as many as took ``PROBE_S`` seconds this time (a quarter to four
        times as many as before)."""
        from mpi4py import MPI
        buf = self._buf
        buf[0] = self._call_time()
        buf[1] = perf_counter() - self._probe_wall
        self.ctx.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        self._probe_wall = perf_counter()
        now, apart = float(buf[0]), float(buf[1])
        if self._crowd:  # some node crowded: no more probes (see the class doc)
            self._probe_every = self.probe = 10 ** 12
            self._arm()
            return
        calls = self._probe_every + self._probe_len
        self._probe_every = self.probe = int(max(2 * self._probe_len, min(
            4 * calls, max(calls / 4, calls * self.PROBE_S / max(apart, 1e-9))) -
            self._probe_len))
        if not self._probed:  # the first probe after the race
            self._ref = self._ref0 = min(self._ref, now)
            self._probed = True
        if now > self.TRIP * self._ref:
            self._over += 1
        else:
            self._over = 0
            self._ref = max(self._ref0, min(self._ref, now))
        self._now = now
        if self._over >= self._need:
            if self._rival is None:
                self.left, self._tripped = -1, True  # a race at the next call
            else:  # first a duel, from the next call on
                self._duel_left = [self._rival, self._last] * self.DUEL_BLOCKS
                self._duel_t = []
                self.probe = 0
        self._arm()

    def _call_time(self) -> float:
        """A probe's or duel block's time a call: the median of its calls' (and a new block
        begins). The median, not the mean: a block's first call waits for the ranks the call
        before left behind (a probe's calls have no barrier before them), and single calls
        here run several times their pace; with the mean, duel blocks of recursive doubling's
        allreduce of 2 MiB at 2 ranks timed 448-2249 us a call where its rows ran 480, and
        the duel's pairs came out 0.28-3.3 (instrumented, ``docs/bench.md``)."""
        t = sorted(self._probe_t)
        self._probe_t = []
        return t[len(t) // 2]

    def _duel_block(self) -> None:
        """A duel's block has ended (``DUEL``); after the last, one ``MPI_Allreduce(MAX)``
        gives every rank the slowest rank's block times, and the verdict: a race at the next
        call where the runner-up's time over the pick's, pair by pair (the median pair), has
        fallen below its race ratio by more than ``DUEL`` and below 1 (the runner-up runs
        faster than the pick now); else the pick's reference becomes the tripping probe's
        time: the machine slowed down, not the pick alone, or the pick slowed down and is still
        the fastest of the two, and a race would keep it. Why below 1: a race times the pick
        faster than the rows after it (its figures are the fastest of a few noisy medians), so
        its runner-up's ratio starts high, and a duel then found it fallen where nothing had
        changed. Instrumented (allreduce of 2 MiB at 2 ranks, ``docs/bench.md``): the race
        timed recursive doubling at 514 us a call, double binary tree at 750 (1.46); the
        duel's pairs came out 1.25, 0.67 and 1.17 (median 1.17, fallen by more than DUEL but
        still slower than the pick); the race that followed kept recursive doubling and ran
        the rule's others through ``auto``'s blocks: ``auto`` 0.896 of its own pick's row."""
        self._duel_left.pop(0)
        self._duel_t.append(self._call_time())
        if self._duel_left:
            self.probe = 0  # the next call is the duel's too
            self._arm()
            return
        from mpi4py import MPI
        t = np.array(self._duel_t)
        self.ctx.comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        ratio = float(np.median(t[0::2] / np.maximum(t[1::2], 1e-12)))
        self._over, self._probe_wall = 0, perf_counter()
        if ratio < 1 and ratio * self.DUEL < self._rival_ratio:
            self.left, self._tripped = -1, True  # a race at the next call
        else:
            self._ref = max(self._ref, self._now)
        self.probe = self._probe_every
        self._arm()

    def _probing(self) -> bool:
        """Whether a decided trial probes its pick (``PROBE_S``)."""
        return bool(self.RETRIAL_S and self.PROBE_S)

    def _crowded(self) -> float:
        """1.0 where this rank's node runs more of the communicator's ranks than the cores
        this process may use, else 0.0 (asked once per communicator, at the end of its first
        race's first round: a collective call, made by every rank at the same call)."""
        stash = self.ctx.stash
        crowded = stash.get("crowded")
        if crowded is None:
            from mpi4py import MPI
            node = self.ctx.comm.Split_type(MPI.COMM_TYPE_SHARED)
            try:
                crowded = stash["crowded"] = float(node.Get_size() > _cores())
            finally:
                node.Free()
        return crowded


def auto_pick(collective: str, nbytes: int, comm=None, inplace: bool = False, op=None,
              dtype=None) -> str | None:
    """What ``algorithm="auto"`` runs now on ``comm`` for ``nbytes`` of per-rank input (for
    allgather, the mean over ranks; ``inplace``: a call with ``out=x``; ``op`` name and
    ``dtype``: of the call), or None while it is still measuring its rule's algorithms
    (``_Trial``). Collective on a communicator's first use where the rule names ``shm`` (the
    topology is asked)."""
    ctx = _context(comm)
    key = ~nbytes if inplace and collective in _IN_PLACE else nbytes
    hit = _auto(ctx, collective, key, env_raw(b"COLLECTIVES_TUNING"))
    if type(hit) is tuple:
        return hit[0]
    if not _exact_op(op, np.dtype(dtype or "float32").kind):
        return hit.names[0]
    return hit.decided[0] if hit.decided is not None else None


def auto_trial(collective: str, nbytes: int, comm=None, inplace: bool = False) -> dict | None:
    """What ``auto``'s trial (``_Trial``) measured on ``comm`` for ``nbytes`` of per-rank input
    (``inplace``: calls with ``out=x``) once it has decided: ``{algorithm: median seconds per
    call}``, the slowest rank's, the same on every rank; ``{}`` where it kept the rule's first
    without a race (small calls on a crowded node, ``_Trial.CROWDED_MIN``); None if it ran none
    (yet)."""
    ctx = _context(comm)
    key = ~nbytes if inplace and collective in _IN_PLACE else nbytes
    return ctx.auto_trials.get((collective, key))


# The collectives whose in-place calls have rules (and picks) of their own.
_IN_PLACE = frozenset(select.IN_PLACE_RULES)


def _network_error(call: Call, exc: BaseException) -> BaseException:
    """An MPI error while running, in words: a truncated message means a length mismatch."""
    return network_error(exc, f"rank {call.ctx.rank}: {call.describe()}")


def _trivial(call: Call, name, builder):
    """One rank, or nothing to move: the result is the input (or nothing)."""
    if call.collective != "broadcast" and not call.inplace and call.out is not None:
        n = min(call.out.count, call.x.count)
        if n:
            call.out.flat[:n] = call.x.flat[:n]
    return Done()


def _run_schedule(call: Call, name, builder):
    ctx = call.ctx
    x, out = call.x, call.out
    seg = segment_elems(x.dtype.itemsize)
    extra = builder.context_kwargs(call) if hasattr(builder, "context_kwargs") else ()
    counts = None if call.counts is None else tuple(call.counts)
    schedule = _schedule(call.collective, name, ctx.rank, ctx.size, x.count, counts,
                         call.root, seg, extra)
    # Out of place, receives land straight in the reduction that consumes them (see
    # Schedule.direct); in place, IN is OUT and they must go through scratch.
    plan = schedule.plan(direct=not call.inplace)
    key = (x.kind, x.device, x.dtype)
    taken = []  # scratch to give back: none for a plan without TMP and with an OUT (~2 us)
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

    transport = _transport(call)
    close = getattr(transport, "close", None)  # device transports: wait for queued GPU work
    release = None
    if close is not None or taken:
        def release():
            if close is not None:
                close()
            for arr in taken:
                ctx.give_scratch(key, arr)

    run = Run(plan, in_flat, out_flat, tmp, call.op, transport,
              ctx.tag(call.seq), info=call.describe, on_done=release)
    # a blocking call waits at once (_start): its first advance may block
    return run if call.blocking else run.start()


def _scheduled(call: Call, name, builder):
    """A schedule algorithm's run in a plan: ``_run_schedule`` looked up on each call, as on
    the named path (a plan outlives a replaced ``_run_schedule``: the tests spy on it)."""
    return _run_schedule(call, name, builder)


def _launch(call: Call, name, builder):
    """A direct algorithm's ``launch``; on device buffers, staged through host memory."""
    if call.x.is_device:
        from . import cuda
        return cuda.staged(call, builder.launch)
    return builder.launch(call)


def _native(call: Call, name, builder):
    if call.x.is_device:  # straight to a CUDA-aware MPI, or staged through host memory
        from . import cuda
        return cuda.native(call, _native_mpi)
    return _native_mpi(call)


def _native_mpi(call: Call):
    comm, x, blocking = call.ctx.comm, call.x.flat, call.blocking
    out = None if call.out is None else call.out.flat
    if call.collective == "allreduce":
        return native.allreduce(comm, out if call.inplace else x, out, call.op, blocking)
    if call.collective == "reduce":
        if out is None:
            out = x
        return native.reduce(comm, out if call.inplace else x, out, call.op, call.root,
                             blocking)
    if call.collective == "broadcast":
        return native.broadcast(comm, out, call.root, blocking)
    if call.collective == "reduce_scatter":
        return native.reduce_scatter(comm, x, out, call.counts, call.op, blocking)
    return native.allgather(comm, x, out, call.counts, blocking)


def _avg(call: Call):
    """The finalizer of ``op="avg"``: one division of the summed result by the rank count."""
    if call.op is None or not call.op.is_avg or call.out is None:
        return None
    size, flat = call.ctx.size, call.out.flat
    return lambda: np.divide(flat, size, out=flat) if size > 1 else None


# -- the collectives --------------------------------------------------------------------------
def _allreduce(x, op, out, comm, algorithm, check, blocking):
    ctx = _context(comm)
    try:
        xb = wrap(x, "x")
        opr = resolve(op, xb.dtype)
        outb, inplace = _output(xb, out, xb.shape)
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "allreduce", check, exc)
    call = _new_call("allreduce", ctx, xb, outb, opr, 0, None, inplace)
    return _start(call, algorithm, check, blocking, outb.obj, _avg(call) if opr.is_avg else None)


def allreduce(x, op="sum", *, out=None, comm=None, algorithm="auto", check=None):
    """Reduce ``x`` over all ranks of ``comm``; every rank gets the result (like x)."""
    return _allreduce(x, op, out, comm, algorithm, check, True)


def iallreduce(x, op="sum", *, out=None, comm=None, algorithm="auto", check=None) -> Request:
    """Non-blocking ``allreduce``: ``Request.wait()`` returns the result."""
    return _allreduce(x, op, out, comm, algorithm, check, False)


def _reduce(x, op, root, out, comm, algorithm, check, blocking):
    ctx = _context(comm)
    try:
        root = _root(root, ctx.size)
        xb = wrap(x, "x")
        opr = resolve(op, xb.dtype)
        if ctx.rank == root or out is not None:  # a given out is checked everywhere
            outb, inplace = _output(xb, out, xb.shape)
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "reduce", check, exc)
    if ctx.rank == root:
        result = outb.obj
    else:  # out is ignored (never written) off the root
        outb, inplace, result = None, False, None
    call = _new_call("reduce", ctx, xb, outb, opr, root, None, inplace)
    return _start(call, algorithm, check, blocking, result, _avg(call))


def reduce(x, op="sum", root=0, *, out=None, comm=None, algorithm="auto", check=None):
    """Reduce ``x`` over all ranks onto ``root``: the result there, None elsewhere."""
    return _reduce(x, op, root, out, comm, algorithm, check, True)


def ireduce(x, op="sum", root=0, *, out=None, comm=None, algorithm="auto",
            check=None) -> Request:
    """Non-blocking ``reduce``."""
    return _reduce(x, op, root, out, comm, algorithm, check, False)


def _broadcast(x, root, comm, algorithm, check, blocking):
    ctx = _context(comm)
    try:
        root = _root(root, ctx.size)
        xb = wrap(x, "x")
        if xb.readonly:  # refused on the root too, so that every rank gives the same verdict
            raise ValueError("x is read-only: broadcast fills it in place on every rank but "
                             "the root; pass a writable array on every rank")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "broadcast", check, exc)
    call = _new_call("broadcast", ctx, xb, xb, None, root, None, True)
    return _start(call, algorithm, check, blocking, xb.obj)


def broadcast(x, root=0, *, comm=None, algorithm="auto", check=None):
    """Fill ``x`` on every rank with root's ``x``, in place; returns x."""
    return _broadcast(x, root, comm, algorithm, check, True)


def ibroadcast(x, root=0, *, comm=None, algorithm="auto", check=None) -> Request:
    """Non-blocking ``broadcast``."""
    return _broadcast(x, root, comm, algorithm, check, False)


def _balanced(count: int, size: int) -> tuple[int, ...]:
    q, r = divmod(count, size)
    return tuple(q + 1 if k < r else q for k in range(size))


def _counts(counts, size: int) -> tuple[int, ...]:
    """``counts`` as a tuple of ``size`` non-negative ints, or a ValueError saying why not."""
    try:
        values = np.asarray(counts)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is not a counts list
        values = np.asarray([None])
    if values.ndim != 1 or len(values) != size or values.dtype.kind not in "iu" or \
            (values < 0).any():
        raise ValueError(f"counts must be {size} non-negative integers (one per rank), got "
                         f"{counts!r}")
    return tuple(int(c) for c in values)


def _reduce_scatter(x, op, counts, out, comm, algorithm, check, blocking):
    ctx = _context(comm)
    try:
        xb = wrap(x, "x")
        opr = resolve(op, xb.dtype)
        if counts is None:
            counts = _balanced(xb.count, ctx.size)
        else:
            counts = _counts(counts, ctx.size)
            if sum(counts) != xb.count:
                raise ValueError(f"counts add up to {sum(counts)}, but x has {xb.count} "
                                 f"elements")
        outb, inplace = _output(xb, out, (counts[ctx.rank],))
        if inplace:
            raise ValueError("reduce_scatter cannot run in place: out must not be x")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "reduce_scatter", check, exc)
    call = _new_call("reduce_scatter", ctx, xb, outb, opr, 0, counts)
    return _start(call, algorithm, check, blocking, outb.obj, _avg(call))


def reduce_scatter(x, op="sum", *, counts=None, out=None, comm=None, algorithm="auto",
                   check=None):
    """Reduce flat ``x`` over all ranks; rank r gets block r (``counts[r]`` elements, 1-D)."""
    return _reduce_scatter(x, op, counts, out, comm, algorithm, check, True)


def ireduce_scatter(x, op="sum", *, counts=None, out=None, comm=None, algorithm="auto",
                    check=None) -> Request:
    """Non-blocking ``reduce_scatter``."""
    return _reduce_scatter(x, op, counts, out, comm, algorithm, check, False)


def _allgather_counts(ctx, xb: Buffer | None, error=None) -> tuple[tuple[int, ...], int]:
    """Every rank's element count, from one small Allgather of (rows, elements per row).

    A rank whose ``x`` was refused (``xb`` None, ``error`` set) still joins, with rows -1, so
    that every rank raises (``check.settle``) instead of the others waiting.
    """
    shape = None if xb is None else xb.shape
    # Plain ints (math.prod, tolist) and buffers kept on the communicator: this runs on every
    # allgather, and numpy's reductions on two-element arrays made it 25 us at 8 B, n = 2,
    # against 3 us for the MPI_Allgather.
    rows = -1 if xb is None else shape[0] if shape else 1
    row = -1 if xb is None else math.prod(shape[1:]) if shape else 1
    bufs = ctx.stash.get("allgather_counts")
    if bufs is None:
        from mpi4py import MPI
        mine, table = np.empty(2, np.int64), np.empty((ctx.size, 2), np.int64)
        bufs = ctx.stash["allgather_counts"] = (mine, table, [mine, MPI.INT64_T],
                                                [table, MPI.INT64_T])
    mine, table, send, recv = bufs
    mine[0] = rows
    mine[1] = row
    entry = _watchdog.watch(ctx, what=f"allgather #{ctx.seq} (exchanging row counts: "
                                      f"MPI_Allgather)") if _watchdog.LIMIT else None
    ctx.comm.Allgather(send, recv)
    if entry is not None:
        _watchdog.unwatch(entry)
    every_rows, every_row = table.T.tolist()
    if min(every_rows) < 0:
        _check.settle(ctx.comm, "allgather", error)
    if every_row.count(row) != ctx.size:
        shapes = ", ".join(f"rank {r}: {e} per row" for r, e in enumerate(every_row))
        raise ValueError(f"allgather: x's trailing axes must agree on every rank ({shapes})")
    if row == 1:
        return tuple(every_rows), sum(every_rows)
    return tuple(r * row for r in every_rows), sum(every_rows)


def _allgather(x, out, comm, algorithm, check, blocking):
    ctx = _context(comm)
    try:
        xb, error = wrap(x, "x"), None
    except (TypeError, ValueError) as exc:
        xb, error = None, exc
    counts, rows = _allgather_counts(ctx, xb, error)
    shape = (rows,) + tuple(xb.shape[1:]) if xb.shape else (rows,)
    try:
        outb, inplace = _output(xb, out, shape)
        if inplace:
            raise ValueError("allgather cannot run in place: out must not be x")
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "allgather", check, exc)
    call = _new_call("allgather", ctx, xb, outb, None, 0, counts)
    return _start(call, algorithm, check, blocking, outb.obj)


def allgather(x, *, out=None, comm=None, algorithm="auto", check=None):
    """Concatenate every rank's ``x`` along axis 0 (ranks may differ in that axis' length)."""
    return _allgather(x, out, comm, algorithm, check, True)


def iallgather(x, *, out=None, comm=None, algorithm="auto", check=None) -> Request:
    """Non-blocking ``allgather``."""
    return _allgather(x, out, comm, algorithm, check, False)
