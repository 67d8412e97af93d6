"""The public API: argument checks, buffer wrapping, algorithm selection, running.

Every collective goes through the same four steps:

1. *Check and wrap*: the arguments are checked with the facts every rank has, so a bad call
   raises the same ``ValueError``/``TypeError`` on every rank before a byte moves; ``x`` and
   ``out`` become flat zero-copy views (``collectives.buffers``).
2. *Validate across ranks* when ``COLLECTIVES_CHECK`` is on or ``check=True``
   (``collectives.check``), before the choice: ranks whose arguments differ could choose
   differently.
3. *Choose* the algorithm record (``collectives.select``): by name, or ``auto``'s lookup in the
   tuning table, memoized per communicator.
4. *Run*, by the record's kind (``_run``, the one place that dispatches on it): a schedule is
   built once per shape and run by the executor; a direct algorithm (``shm``) or the MPI
   library's own collective (``native``) is launched as it is. Blocking calls run in the
   caller's thread; ``i*`` calls return a ``Request``.

Without ``out`` the input is never modified and a new array of x's kind is returned; ``out=x``
is in place, and an allreduce is in place on every rank or on none (as ``MPI_IN_PLACE``). On
error the input is untouched; ``out`` may be partly written if the error came from the network
after the collective started (checks happen before). Collectives on two or more ranks are
registered with the watchdog (``collectives.watchdog``) while they run.
"""
from __future__ import annotations

import math

import numpy as np

from . import check as _check
from . import config, native, select
from . import watchdog as _watchdog
from .buffers import Buffer, wrap
from .errors import network_error
from .executor import context, launch_schedule, schedule_for
from .ops import resolve
from .progress import Done, Request
from .select import NATIVE, ONE_NODE, REGISTRY, SCHEDULE, TOPOLOGY

__all__ = ["allreduce", "reduce", "broadcast", "reduce_scatter", "allgather",
           "iallreduce", "ireduce", "ibroadcast", "ireduce_scatter", "iallgather",
           "algorithms", "auto_pick", "Call"]


def algorithms(collective: str) -> tuple[str, ...]:
    """Names that ``algorithm=`` accepts for ``collective`` (besides ``"auto"``)."""
    return select.algorithms(collective)


class Call:
    """One collective call, checked and wrapped: what an algorithm's ``launch`` receives.

    ``x``/``out`` are ``Buffer``s (``out`` is x itself when in place, None on non-root ranks
    of ``reduce``); ``counts`` are per-rank element counts (reduce_scatter, allgather).
    """

    __slots__ = ("collective", "ctx", "x", "out", "op", "root", "counts", "algorithm",
                 "inplace", "seq", "blocking")

    def __init__(self, collective, ctx, x, out, op=None, *, root=0, counts=None,
                 inplace=False, blocking=True):
        _fill(self, collective, ctx, x, out, op, root, counts, inplace, blocking)

    @property
    def count(self) -> int:
        """Elements of the per-rank input."""
        return self.x.count

    def describe(self) -> str:
        return (f"{self.collective} #{self.seq} ({self.algorithm}, {self.count} x "
                f"{self.x.dtype.name}{'' if self.op is None else ', ' + self.op.name})")


def _fill(call, collective, ctx, x, out, op, root, counts, inplace, blocking):
    call.collective, call.ctx, call.x, call.out, call.op = collective, ctx, x, out, op
    call.root, call.counts, call.inplace, call.blocking = root, counts, inplace, blocking
    call.algorithm, call.seq = None, -1
    return call


_blank = object.__new__


# -- step 1: checks and buffers ---------------------------------------------------------------
_WORLD = []  # MPI.COMM_WORLD's Context, made on the first call (mpi4py is imported then)


def _context(comm):
    if comm is None:
        if _WORLD:
            ctx = _WORLD[0]
        else:
            from mpi4py import MPI
            ctx = context(MPI.COMM_WORLD)  # lives until MPI_Finalize frees the world
            _WORLD.append(ctx)
    else:
        try:
            ctx = context(comm)
        except AttributeError:
            raise TypeError(f"comm must be an mpi4py.MPI.Comm, got "
                            f"{type(comm).__name__}") from None
    try:
        if config.validate():  # the first call, or the first since config.reload/set
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


def _root(root, size) -> int:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or \
            not 0 <= root < size:
        raise ValueError(f"root {root!r} out of range for a communicator of {size} ranks")
    return int(root)


# -- step 3: choose ----------------------------------------------------------------------------
def _auto(ctx, collective: str, nbytes: int, inplace: bool) -> select.Algorithm:
    """The algorithm ``auto`` runs on ``ctx``'s communicator, memoized per communicator for
    the tuning table in force (``select.load_table`` reads it once)."""
    table = select.load_table()
    memo = ctx.stash.get("auto")
    if memo is None or memo[0] is not table:
        memo = ctx.stash["auto"] = (table, {})
    key = (collective, nbytes, inplace)
    algo = memo[1].get(key)
    if algo is None:
        name = select.auto(collective, nbytes, ctx.size, lambda: _single_node(ctx), inplace)
        if len(memo[1]) >= 1024:  # the sizes a program uses are few; a bound all the same
            memo[1].clear()
        algo = memo[1][key] = REGISTRY[collective][name]
    return algo


def _auto_bytes(call: Call) -> int:
    """``auto``'s message bytes (allgather: the mean over ranks, the same on every rank)."""
    if call.collective == "allgather":
        return sum(call.counts) * call.x.dtype.itemsize // call.ctx.size
    return call.x.flat.nbytes


def _single_node(ctx) -> bool:
    """Whether ``ctx``'s ranks share one node (collective on first use, then cached)."""
    from .topology import topology
    return topology(ctx).single_node


def auto_pick(collective: str, nbytes: int, comm=None, inplace: bool = False) -> str:
    """The algorithm ``algorithm="auto"`` runs on ``comm`` for ``nbytes`` of per-rank input
    (allgather: the mean over ranks; ``inplace``: a call with ``out=x``). Collective on a
    communicator's first use where the rule names a single-node algorithm."""
    ctx = _context(comm)
    return _auto(ctx, collective, nbytes, bool(inplace)).name


# -- steps 2 to 4: validate, choose, run ----------------------------------------------------------
def _start(call: Call, algorithm, check, result, finalize=None, algo=None, bound=None):
    """Validate across ranks where asked, choose (unless ``algo`` is given) and run ``call``
    (``bound``: the call bound to its buffers already, ``native.bind``); returns the result or
    a ``Request``. The check comes before the choice: ranks whose arguments differ may choose
    differently, and a choice may ask the topology (collective on first use)."""
    ctx, collective = call.ctx, call.collective
    named = algo is None and algorithm != "auto"
    if named:  # an unknown name is this rank's own error, told to the others by the check
        try:
            algo = select.get(collective, algorithm)
        except (TypeError, ValueError) as exc:
            raise _check.failed(ctx, collective, check, exc)
    call.algorithm = algorithm if algo is None else algo.name
    call.seq = seq = ctx.seq  # ctx.next_seq(), inline: this runs on every call
    ctx.seq = seq + 1
    if ctx.pending:
        _drain(ctx)
    checking = _check.enabled(check)
    entry = None
    if ctx.size > 1 and _watchdog.enabled():
        entry = _watchdog.watch(ctx, call, phase="check" if checking else "run")
    try:
        if checking:
            # allgather's ranks may differ in length: its counts (agreed already) are compared;
            # an allreduce is in place on every rank or on none
            asked = f"{algorithm} in place" if call.inplace and collective == "allreduce" \
                else algorithm
            _check.verify(ctx.comm, collective=collective,
                          elements=None if collective == "allgather" else call.x.count,
                          dtype=call.x.dtype.name, op=None if call.op is None else call.op.name,
                          root=call.root, algorithm=asked, counts=call.counts, sequence=seq)
            if entry is not None:
                entry.phase = "run"
        if algo is None:
            algo = _auto(ctx, collective, _auto_bytes(call), call.inplace)
            call.algorithm = algo.name
        elif named and algo.needs is ONE_NODE and ctx.size > 1 and not _single_node(ctx):
            raise ValueError(f"algorithm {algo.name!r} needs every rank on one node, but this "
                             f"communicator of {ctx.size} ranks spans nodes")
        # bound: MPI's own blocking call, done on return (work None, as the watchdog reads it)
        work = _run(call, algo) if bound is None else bound()
        if entry is not None:
            entry.work = work  # what the watchdog asks where this rank waits
        if call.blocking:
            if work is not _DONE and work is not None:
                work.wait()
        elif getattr(work, "needs_progress", False):
            ctx.pending.append(work)
    except BaseException as exc:
        if entry is not None:
            _watchdog.unwatch(entry, exc)
        raise network_error(exc, f"rank {ctx.rank}: {call.describe()}")
    if call.blocking:
        if entry is not None:
            _watchdog.unwatch(entry)
        if finalize is not None:
            finalize()
        return result
    return Request(work, result, finalize, description=call.describe())


def _run(call: Call, algo: select.Algorithm):
    """Start ``call`` with ``algo``, by its kind: the one place that dispatches on it."""
    ctx = call.ctx
    if ctx.size == 1 or (call.x.count if call.counts is None else sum(call.counts)) == 0:
        return _trivial(call)
    if algo.kind is SCHEDULE:
        extra = _topology_kwargs(ctx) if algo.needs is TOPOLOGY else ()
        return launch_schedule(call, schedule_for(call, algo.build[call.collective], extra))
    if call.x.is_device:  # straight to a CUDA-aware MPI, or staged through host memory
        from . import cuda_transport
        return cuda_transport.native(call, algo.launch) if algo.kind is NATIVE else \
            cuda_transport.staged(call, algo.launch)
    return algo.launch(call)


def _topology_kwargs(ctx) -> tuple:
    from .topology import topology
    return topology(ctx).kwargs()


def _drain(ctx) -> None:
    """Run the earlier non-blocking calls on ``ctx`` that move only when a rank runs them
    (shm's) before a later call starts: every rank issued them in the same order, so every rank
    runs them here or in a wait, and none waits in a later collective for a peer that waits in
    an earlier one. An error stays with its call, for its ``wait`` to raise."""
    pending, ctx.pending = ctx.pending, []
    for work in pending:
        if not work.done:
            try:
                work.wait()
            except BaseException:  # noqa: BLE001 - raised again by the call's own wait
                pass


def _trivial(call: Call):
    """One rank, or nothing to move: the result is the input (or nothing)."""
    if call.collective != "broadcast" and not call.inplace and call.out is not None:
        n = min(call.out.count, call.x.count)
        if n:
            call.out.flat[:n] = call.x.flat[:n]
    return _DONE


_DONE = Done()


def _avg(call: Call):
    """The finalizer of ``op="avg"``: one division of the summed result by the rank count."""
    if call.op is None or not call.op.is_avg or call.out is None:
        return None
    size, flat = call.ctx.size, call.out.flat
    return lambda: np.divide(flat, size, out=flat) if size > 1 else None


# -- the collectives --------------------------------------------------------------------------
# Small calls repeat with the same arrays (a training loop's scalars and flags). Checking,
# wrapping and choosing for them is most of a small call's Python, so for numpy calls with
# ``out`` of at most SMALL_BYTES, what a blocking call that succeeded worked out is kept per
# (x, out, op, comm, algorithm), holding x, out and comm so that their ids stay theirs (small
# and at most SMALL_CALLS of them, so holding them costs at most 8 MiB). A hit checks what can
# change on the same objects: x's dtype, out's write flag, the tuning table.
SMALL_BYTES = 64 << 10
SMALL_CALLS = 64
_CHECKED: dict = {}


class _Checked:
    """A small blocking allreduce, worked out: its Call (done with when the call returns),
    algorithm, finalizer, and the MPI call bound to its buffers (``native.bind``) if any."""

    __slots__ = ("x", "out", "comm", "dtype", "tuning", "call", "algo", "finalize", "bound")


def _keep(x, out, comm, op, algorithm, call: Call) -> None:
    ctx = call.ctx
    checked = _blank(_Checked)
    checked.x, checked.out, checked.comm, checked.dtype = x, out, comm, call.x.dtype
    checked.tuning, checked.call, checked.finalize = config.get("COLLECTIVES_TUNING"), call, \
        _avg(call)
    checked.algo = algo = REGISTRY["allreduce"][call.algorithm]
    # MPI's own on more than one rank: the call bound to its buffers once
    checked.bound = native.bind(call) if algo.kind is NATIVE and ctx.size > 1 and \
        call.x.count else None
    if len(_CHECKED) >= SMALL_CALLS:
        _CHECKED.clear()
    _CHECKED[(id(x), id(out), op, id(comm), algorithm)] = checked


def _allreduce(x, op, out, comm, algorithm, check, blocking):
    ctx = _context(comm)
    try:
        xb = wrap(x, "x")
        opr = resolve(op, xb.dtype)
        outb, inplace = _output(xb, out, xb.shape)
    except (TypeError, ValueError) as exc:
        raise _check.failed(ctx, "allreduce", check, exc)
    call = _fill(_blank(Call), "allreduce", ctx, xb, outb, opr, 0, None, inplace, blocking)
    result = _start(call, algorithm, check, outb.obj, _avg(call) if opr.is_avg else None)
    if blocking and type(op) is str and type(algorithm) is str and type(x) is np.ndarray and \
            type(out) is np.ndarray and xb.flat.nbytes <= SMALL_BYTES:
        _keep(x, out, comm, op, algorithm, call)
    return result


def allreduce(x, op="sum", *, out=None, comm=None, algorithm="auto", check=None):
    """Reduce ``x`` over all ranks of ``comm``; every rank gets the result (like x)."""
    if type(op) is str and type(algorithm) is str:  # a small call like an earlier one?
        # (the record holds x, out and comm: while it lives, their ids are theirs alone)
        hit = _CHECKED.get((id(x), id(out), op, id(comm), algorithm))
        if hit is not None and x.dtype is hit.dtype and out.flags.writeable and \
                hit.tuning is config.get("COLLECTIVES_TUNING"):
            return _start(hit.call, algorithm, check, out, hit.finalize, hit.algo, hit.bound)
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
    call = _fill(_blank(Call), "reduce", ctx, xb, outb, opr, root, None, inplace, blocking)
    return _start(call, algorithm, check, result, _avg(call))


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
    call = _fill(_blank(Call), "broadcast", ctx, xb, xb, None, root, None, True, blocking)
    return _start(call, algorithm, check, xb.obj)


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
    call = _fill(_blank(Call), "reduce_scatter", ctx, xb, outb, opr, 0, counts, False,
                 blocking)
    return _start(call, algorithm, check, outb.obj, _avg(call))


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
                                      f"MPI_Allgather)") if _watchdog.enabled() else None
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
    call = _fill(_blank(Call), "allgather", ctx, xb, outb, None, 0, counts, False, blocking)
    return _start(call, algorithm, check, outb.obj)


def allgather(x, *, out=None, comm=None, algorithm="auto", check=None):
    """Concatenate every rank's ``x`` along axis 0 (ranks may differ in that axis' length)."""
    return _allgather(x, out, comm, algorithm, check, True)


def iallgather(x, *, out=None, comm=None, algorithm="auto", check=None) -> Request:
    """Non-blocking ``allgather``."""
    return _allgather(x, out, comm, algorithm, check, False)
