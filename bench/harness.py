"""The timing loop shared by every collective's benchmark and the tuner: ``Sweep``.

For each size (``Sweep.run_size``):

1. buffers are allocated once and every call passes ``out=``, so the benchmark measures the
   collective, not the allocator;
2. check (``check``): one call of each algorithm and mode on exact rank-dependent data, wrong
   elements counted over ranks; in-place buffers are then zeroed, since a sum repeated in place
   would overflow to inf;
3. ``auto``'s pick is asked once per mode (``collectives.api.auto_pick``);
4. block length: ``warmup`` untimed calls, then one timed call (and, when that is far shorter
   than ``block`` seconds, a short timed block) give a per-call estimate; its maximum over
   ranks sets how many calls a block of about ``block`` seconds takes, the same on every rank
   (``iters`` fixes it instead);
5. ``rounds`` rounds: each times one block of every algorithm and mode, in an order shuffled
   each round (the same on every rank), so that none always runs first or last, nor always
   after the same other one (whose after-effects, a window in cache or ranks out of step,
   would then bias its row). A block
   starts with one untimed call (the algorithm's steady state, not the switch from the block
   before), then a barrier, then the timed calls; its time is every rank's per-call average,
   and the round's time the slowest rank's.

``stats.Result`` then gives the median over rounds and the spread. gloo's rows run after every
other size (``Sweep.run``), in rounds of their own.
"""
from __future__ import annotations

import math
import sys
import time
import traceback

import numpy as np

from bench.collective import AVG_BOUND, Collective, busbw_factor, rank_data
from bench.stats import Result
from bench.units import format_size

__all__ = ["ROUNDS", "BLOCK_S", "MAX_CALLS", "Sweep", "default_algorithms", "membw",
           "max_over_ranks", "per_call", "abort_on_error"]

ROUNDS = 7
# A timed block's length, seconds. Short: on a node with more ranks than cores, a block that the
# scheduler interrupts runs far slower, and the longer the block the more interruptions it
# catches; the median over rounds then leaves the unlucky blocks out.
BLOCK_S = 0.002
MAX_CALLS = 1000


def default_algorithms(collective: str, gloo: bool = True) -> list[str]:
    """Every registered algorithm (``native`` first: the ratio column's baseline), ``auto``,
    and ``gloo`` when torch is importable."""
    import importlib.util

    import collectives
    names = sorted(collectives.algorithms(collective), key=lambda a: (a != "native", a))
    names.append("auto")
    if gloo and importlib.util.find_spec("torch") is not None:
        names.append("gloo")
    return names


def max_over_ranks(comm, value: float) -> float:
    """The largest ``value`` over the ranks of ``comm`` (collective)."""
    from mpi4py import MPI
    buf = np.array([value], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return float(buf[0])


def per_call(comm, fn, iters: int) -> float:
    """This rank's seconds per call over ``iters`` calls of ``fn``, from a barrier."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _gather(comm, value: float) -> list[float]:
    out = np.empty(comm.Get_size(), dtype=np.float64)
    comm.Allgather(np.array([value], dtype=np.float64), out)
    return out.tolist()


def _sum(comm, value: int) -> int:
    from mpi4py import MPI
    buf = np.array([value], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return int(buf[0])


def abort_on_error(comm) -> None:
    """Make an exception on one rank end the whole job instead of leaving the others waiting."""
    def hook(kind, value, tb):
        # To the process's own stderr: a hook that wraps this one (torch's init_process_group
        # installs one) may hold sys.stderr in a buffer until this returns, which it never does.
        traceback.print_exception(kind, value, tb, file=sys.__stderr__)
        sys.__stderr__.flush()
        comm.Abort(1)
    if comm.Get_size() > 1:
        sys.excepthook = hook


def membw(comm, nbytes: int = 32 << 20, reps: int = 10) -> float:
    """The machine's memory bandwidth (bytes/s) for a large ``numpy.copyto`` run by every rank
    at once: ranks x 2 x nbytes (read + write) over the slowest rank's best time of ``reps``
    (a bound is what the machine can do at its best)."""
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    best = math.inf
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return comm.Get_size() * 2 * a.nbytes / max_over_ranks(comm, best)


class _Progress:
    """A one-line progress bar on stderr, on rank 0 and only when stderr is a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = max(total, 1), 0
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            frac = self.done / self.total
            sys.stderr.write(f"\r[{'#' * int(30 * frac):<30}] {100 * frac:3.0f}% {label:<12} "
                             f"{time.perf_counter() - self.start:6.1f}s")
            sys.stderr.flush()

    def _start_gloo(self):
        """The gloo process group (``bench.gloo``), started on first use."""
        if self._gloo is None:
            from bench import gloo
            self._gloo = gloo.init(self.comm)
        return self._gloo

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


class Sweep:
    """A benchmark run: one collective over sizes and algorithms (see the module doc)."""

    def __init__(self, collective: Collective, comm, *, dtype="float32", op="sum", root=0,
                 algorithms=None, rounds=ROUNDS, iters=0, warmup=2, block=BLOCK_S, check=True,
                 modes=None, out=None, registered=False):
        self.spec, self.comm = collective, comm
        self.registered = registered  # a "registered" row: auto on ``collectives.empty``
        self.n, self.rank = comm.Get_size(), comm.Get_rank()
        self.dtype = np.dtype(dtype)
        self.op = op if collective.has_op else None
        self.root = root if collective.rooted else -1
        if collective.rooted and not 0 <= root < self.n:
            raise ValueError(f"root {root} out of range for {self.n} ranks")
        self.algorithms = list(algorithms or default_algorithms(collective.name))
        self.rounds, self.iters, self.warmup = max(1, rounds), iters, max(0, warmup)
        self.block, self.check = block, check
        self.modes = [m for m in (modes or collective.modes) if m in collective.modes]
        if not self.modes:
            raise ValueError(f"{collective.name} runs {'/'.join(collective.modes)} only")
        self.factor = busbw_factor(collective.name, self.n)
        self.out = out  # out(results of one size[, late=True]) as each size is done
        self.notes: list[str] = []
        if not algorithms:
            self._drop_one_node()
        self._gloo = None  # the process group, started after every other row (``run``)
        if "gloo" in self.algorithms:
            why = self._no_gloo()
            if why:
                self.notes.append(f"{why}, skipped")
                self.algorithms.remove("gloo")

    def _drop_one_node(self) -> None:
        """Leave out the algorithms that need every rank on one node where ranks span nodes."""
        from collectives.registry import ONE_NODE, get
        from collectives.topology import topology
        if topology(self.comm).single_node:
            return
        names = [a for a in self.algorithms if a not in ("auto", "gloo")
                 and get(self.spec.name, a).needs is ONE_NODE]
        if names:
            self.algorithms = [a for a in self.algorithms if a not in names]
            self.notes.append(f"{', '.join(names)}: one node only, and ranks span nodes; "
                              f"skipped")

    def _no_gloo(self) -> str | None:
        """Why gloo cannot run this sweep, or None."""
        import importlib.util

        from bench import gloo
        if self.dtype.name not in gloo.DTYPES:
            return f"gloo has no {self.dtype.name}"
        if self.op is not None and self.op not in gloo.OPS:
            return f"gloo has no {self.op!r}"
        if importlib.util.find_spec("torch") is None:
            return "gloo: torch is not importable"
        return None

    def run(self, sizes) -> list[Result]:
        """Every size in turn, then gloo's rows at every size; calls ``out(results)`` after
        each size, and ``out(results + gloo's, late=True)`` after each size's gloo rows.

        gloo goes last, its process group started only then: its collectives run over TCP
        loopback and its group keeps threads that wake many times a second, and the other rows'
        figures must not depend on whether a run has gloo in it.
        """
        progress = _Progress(len(sizes) * self.rounds, self.rank == 0)
        every, per_size = [], []
        try:
            for nbytes in sizes:
                res = self.run_size(nbytes, progress)
                every += res
                per_size.append(res)
                if self.out is not None:
                    self.out(res)
        finally:
            progress.close()
        if "gloo" in self.algorithms:
            for nbytes, res in zip(sizes, per_size):
                late = self.gloo_size(nbytes)
                every += late
                if self.out is not None and late:
                    self.out(res + late, late=True)
        return every

    def run_size(self, nbytes: int, progress=None) -> list[Result]:
        """Every algorithm and mode but gloo at one size (see the module doc)."""
        import collectives as coll
        calls, cin = self._callables(coll, self._count(nbytes))
        results = self._results(nbytes, calls)
        self._check(calls, results, cin)
        if "auto" in self.algorithms:
            self._pick(results, cin)
        self._time(calls, results, progress)
        return list(results.values())

    def gloo_size(self, nbytes: int) -> list[Result]:
        """gloo's rows at one size: check and rounds of its own."""
        self._start_gloo()
        calls, cin = self._callables(None, self._count(nbytes), ["gloo"])
        results = self._results(nbytes, calls)
        self._check(calls, results, cin)
        self._time(calls, results)
        return list(results.values())

    def _start_gloo(self):
        """The gloo process group (``bench.gloo``), started on first use."""
        if self._gloo is None:
            from bench import gloo
            self._gloo = gloo.init(self.comm)
        return self._gloo

    def close(self) -> None:
        """End the gloo process group, if one was started."""
        if self._gloo is not None:
            self._gloo.close()

    # -- one size ---------------------------------------------------------------------------
    def _count(self, nbytes: int) -> int:
        return max(1, nbytes // self.dtype.itemsize)

    def _callables(self, coll, count, algorithms=None):
        """{(algorithm, mode): (call, result array, reset)} for one size, of ``algorithms``
        (default: all but gloo), and the input's element count."""
        spec, dtype = self.spec, self.dtype
        cin, cout, _ = spec.counts(count, self.n)
        data = rank_data(self.rank, cin, dtype, self.op)
        x, buf = data.copy(), data.copy()  # the out-of-place input, the in-place buffer
        out = np.zeros(cout, dtype)
        root = max(self.root, 0)
        calls = {}
        names = [a for a in algorithms or self.algorithms if a != "gloo"]
        # an algorithm that runs on registered buffers only gets buffers in shared windows
        only = {a for a in names if coll is not None and a != "auto" and
                coll.select.get(spec.name, a).registered}
        shared = (coll.empty(cin, dtype), coll.empty(cin, dtype), coll.empty(cout, dtype)) \
            if coll is not None and (only or self.registered) else None
        if shared is not None:
            np.copyto(shared[0], data)
            np.copyto(shared[1], data)
        rows = [(a, a, *(shared if a in only else (x, buf, out))) for a in names]
        if algorithms and "gloo" in algorithms:
            rows.append(("gloo", "gloo", x, buf, out))
        if self.registered and coll is not None:  # auto on buffers in shared windows
            rows.append(("registered", "auto", *shared))
        for label, alg, x, buf, out in rows:
            for mode in self.modes:
                arr = buf if mode == "in" else x

                def reset(arr=arr, zero=False):
                    if zero:
                        arr.fill(0)
                    else:
                        np.copyto(arr, data)
                if alg == "gloo":
                    fn = self._gloo.call(spec, arr, out, mode, self.op, root)
                else:
                    fn = spec.call(coll, arr, out, mode, alg, self.op, root, self.comm)
                if fn is not None:
                    calls[(label, mode)] = (fn, spec.result(arr, out, mode), reset)
        return calls, cin

    def _results(self, nbytes: int, calls) -> dict:
        """An empty ``Result`` per key of ``calls`` at this size."""
        col = self.spec.counts(self._count(nbytes), self.n)[2]
        return {key: Result(self.spec.name, col * self.dtype.itemsize, col, self.dtype.name,
                            self.op or "none", self.root, key[0], key[1], self.n, self.factor)
                for key in calls}

    def _check(self, calls, results, cin: int) -> None:
        """One call of each on exact data, wrong elements counted over ranks; then in-place
        buffers zeroed for the timed calls."""
        want = bound = None
        if self.check:
            want = self.spec.expected(self.rank, self.n, cin, self.dtype, self.op,
                                      max(self.root, 0))
            if self.op == "avg" and want is not None:  # within the rounding of divide-then-sum
                bound = self.spec.expected(self.rank, self.n, cin, self.dtype, AVG_BOUND,
                                           max(self.root, 0))
        for key, (fn, res, reset) in calls.items():
            if self.check:
                reset()
                fn()
                bad = 0 if want is None else int(np.count_nonzero(res != want)) \
                    if bound is None else \
                    int(np.count_nonzero(np.abs(res.astype(np.float64) - want) > bound))
                results[key].wrong = _sum(self.comm, bad)
            reset(zero=key[1] == "in")

    def _pick(self, results, cin: int) -> None:
        """``auto``'s pick at this size, per mode: asked once, for the per-rank input bytes."""
        from collectives.api import auto_pick
        for (alg, mode), res in results.items():
            if alg == "auto":
                res.picked = auto_pick(self.spec.name,
                                       self.spec.auto_bytes(cin, self.n) * self.dtype.itemsize,
                                       self.comm, mode == "in")

    def _time(self, calls, results, progress=None) -> None:
        """Block lengths, then ``rounds`` rounds of one block per key in a shuffled order."""
        keys = list(calls)
        iters = {key: self._calls_per_block(calls[key][0]) for key in keys}
        rng = np.random.default_rng(len(keys))  # the same orders on every rank
        for r in range(self.rounds):
            for i in rng.permutation(len(keys)):
                key = keys[i]
                self._block(calls[key][0], iters[key], results[key])
            if progress is not None:
                progress.step(f"{format_size(next(iter(results.values())).nbytes)} "
                              f"{r + 1}/{self.rounds}")

    def _calls_per_block(self, fn) -> int:
        """Calls per block for ``fn``: ``iters``, or enough for ``block`` seconds at the
        slowest rank's pace (the same count on every rank)."""
        for _ in range(self.warmup):
            fn()
        if self.iters:
            return self.iters
        est = max_over_ranks(self.comm, self._measure(fn, 1))
        if est < self.block / 8:  # one call is a coarse estimate: refine it on a short block
            k = int(min(MAX_CALLS, self.block / 8 / max(est, 1e-9)))
            est = max_over_ranks(self.comm, self._measure(fn, k))
        return int(min(MAX_CALLS, max(1, round(self.block / max(est, 1e-9)))))

    def _measure(self, fn, iters: int) -> float:
        return per_call(self.comm, fn, iters)

    def _block(self, fn, iters: int, res: Result) -> None:
        """One round's block of ``fn`` into ``res``: an untimed call, then ``iters`` timed."""
        fn()
        ranks_t = _gather(self.comm, self._measure(fn, iters))
        res.rounds.append(max(ranks_t))
        res.ranks_t.append(ranks_t)
        res.iters = iters
