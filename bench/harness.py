"""The benchmark harness shared by every collective (nccl-tests' ``testColl``): byte counts,
init data, the bus-bandwidth factor, the timed sweep, the table, and JSON/CSV/PNG reports.

A collective module (``bench/allreduce.py``, ...) is a small ``Collective`` subclass: how many
elements go in and out for a size, how to call it (out of place / in place, ours / gloo) and
what the exact result is. ``main(collective, argv)`` does the rest:

- sizes from ``-b`` to ``-e`` by a factor ``-f`` (``64M`` = 64 MiB); the *size* column is the
  per-rank buffer for allreduce/reduce/broadcast and the whole buffer for reduce-scatter and
  all-gather, as nccl-tests prints it; ``algbw = size / time`` and ``busbw = algbw x factor``
  with factor 2(n-1)/n for allreduce, (n-1)/n for reduce-scatter and all-gather, 1 otherwise.
- for each size, every algorithm and mode (out-of-place, in-place) runs interleaved
  (``Sweep.run_size``; gloo after every size of the others, ``Sweep.run``): check
  (``-c``: exact rank-dependent data, wrong elements counted), warm-up (``-w``), then ``--rounds``
  rounds of ``-n`` back-to-back calls each (auto: enough calls for ``--budget`` ms), in a new
  random order every round, each block after one untimed call; then the
  algorithms within 1.5x of the fastest, and auto, race on: more rounds, the slower dropping out
  (the fastest of the row other than auto always among them: it rejoins if it left),
  until each median, and auto's gap to the best, is known to ``--target`` (1%),
  ``--max-rounds`` (60 x ``--rounds``) or
  ``--settle`` seconds per size (20), since they are the ones a reader compares
  (``Sweep._settle``). A round's per-iteration time is each rank's average, then the *max over
  ranks* (nccl-tests); the table shows the median over rounds, each round first divided by the
  machine's drift in that round (``correct_drift``), and the spread (max - min) / median.
  ``--latency`` adds OSU's min/avg/max over ranks.
- buffers are allocated once per size and every call passes ``out=``, so the benchmark measures
  the collective, not the allocator. In-place calls are timed on zeros (after the check), since
  a sum repeated in place would overflow to inf.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import random
import re
import socket
import sys
import time

import numpy as np

try:
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, so -d bfloat16 works
except ImportError:  # pragma: no cover - a dependency of the toolkit
    pass

__all__ = [
    "parse_size", "parse_time", "parse_rate", "format_size", "byte_sizes", "BUSBW",
    "busbw_factor", "rank_data", "expected_reduce", "Collective", "Result", "Sweep",
    "format_table", "write_json", "write_csv", "membw", "default_algorithms", "parser", "main",
    "median_error", "noise", "code", "twins",
]

_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text) -> int:
    """Bytes from ``"64M"``, ``"1KiB"``, ``"8"``, ``"256MB"`` (K, M, G are powers of 1024)."""
    if isinstance(text, (int, np.integer)):
        return int(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read a byte size from {text!r}; expected e.g. 8, 64K, 256M, "
                         f"1G")
    value = float(m.group(1)) * _BINARY[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def parse_time(text) -> float:
    """Seconds from ``"5us"``, ``"1.5ms"``, ``"2e-6"`` (a bare number is seconds)."""
    m = re.fullmatch(r"\s*([\d.]+(?:[eE][-+]?\d+)?)\s*(s|ms|us|µs|ns)?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read a time from {text!r}; expected e.g. 5us, 1.5ms, 2e-6")
    scale = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[m.group(2)]
    return float(m.group(1)) * scale


def parse_rate(text) -> float:
    """Bytes per second from ``"25GB/s"`` (decimal), ``"10GiB/s"`` (binary), ``"100Gb/s"``
    (bits)."""
    m = re.fullmatch(r"\s*([\d.]+(?:[eE][-+]?\d+)?)\s*([kKmMgGtT]?)(i?)([bB])(?:/s|ps)\s*",
                     str(text))
    if not m:
        raise ValueError(f"cannot read a bandwidth from {text!r}; expected e.g. 25GB/s, "
                         f"100Gb/s, 10GiB/s")
    prefix = m.group(2).lower()
    scale = _BINARY[prefix] if m.group(3) else 1000 ** "_kmgt".index(prefix or "_")
    bits = m.group(4) == "b"
    return float(m.group(1)) * scale / (8 if bits else 1)


def format_size(nbytes: int) -> str:
    """``65536 -> "64K"``: the largest binary unit that divides ``nbytes``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def byte_sizes(begin: int, end: int, factor: float) -> list[int]:
    """``begin, begin*factor, ...`` up to ``end`` (nccl-tests ``-b -e -f``)."""
    if begin < 1 or end < begin:
        raise ValueError(f"need 1 <= -b ({begin}) <= -e ({end})")
    if factor <= 1:
        raise ValueError(f"the step factor -f must be > 1, got {factor}")
    out, size = [], begin
    while size <= end:
        out.append(int(size))
        size = max(int(size * factor), int(size) + 1)
    return out


BUSBW = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor."""
    try:
        return BUSBW[collective](n)
    except KeyError:
        raise ValueError(f"unknown collective {collective!r}; expected one of "
                         f"{', '.join(BUSBW)}") from None


# -- exact data --------------------------------------------------------------------------------
def rank_data(rank: int, count: int, dtype, op: str | None = "sum") -> np.ndarray:
    """Exact rank-dependent values for which every reduction order gives the same result: small
    integers (sums), 1 or 2 (products), bits (bitwise ops, bool)."""
    dtype = np.dtype(dtype)
    i = np.arange(count, dtype=np.int64)
    if dtype.kind == "b":
        return (i + rank) % 3 == 0
    if op == "prod":
        vals = 1 + (i + rank) % 2
    elif op in ("band", "bor", "bxor"):
        vals = (i * 7 + rank * 13) % 64
    elif op in ("min", "max"):
        vals = (i * 7 + rank * 3) % 11
    else:
        vals = (i + 3 * rank) % 5
    return vals.astype(dtype)


def expected_reduce(n: int, count: int, dtype, op: str) -> np.ndarray:
    """The reduction of ``rank_data`` over ``n`` ranks, as the toolkit computes it (``avg`` is
    the sum divided by n in the dtype)."""
    from collectives.ops import resolve
    opr = resolve(op, dtype)
    acc = rank_data(0, count, dtype, op)
    for r in range(1, n):
        opr.reduce(acc, acc, rank_data(r, count, dtype, op))
    if op == "avg":
        np.divide(acc, n, out=acc)
    return acc


# -- collectives --------------------------------------------------------------------------------
class Collective:
    """What a benchmark module says about its collective (see the module doc)."""

    name = ""
    has_op = True
    rooted = False
    modes = ("out", "in")

    def counts(self, count: int, n: int) -> tuple[int, int, int]:
        """``(input elements, output elements, elements of the size column)`` for a size
        column of ``count`` elements on ``n`` ranks."""
        return count, count, count

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        """A zero-argument callable running one collective on preallocated buffers."""
        raise NotImplementedError

    def expected(self, rank, n, x_count, dtype, op, root):
        """The exact output on ``rank`` (None: nothing to check there)."""
        raise NotImplementedError

    def gloo(self, dist, tx, tout, mode, op, root):
        """A callable running torch.distributed's collective, or None if gloo has none."""
        return None

    def result(self, x, out, mode):
        """The array holding the result after a call."""
        return x if mode == "in" else out


class Result:
    """One measured (size, algorithm, mode): seconds per round (max over ranks), each round's
    per-rank times and the machine's drift factor, iterations, wrong elements."""

    __slots__ = ("collective", "nbytes", "count", "dtype", "op", "root", "algorithm", "mode",
                 "rounds", "ranks_t", "drift", "iters", "wrong", "n", "factor", "picked",
                 "round_ids", "extra_iters", "trial", "then")

    def __init__(self, collective, nbytes, count, dtype, op, root, algorithm, mode, n, factor):
        self.collective, self.nbytes, self.count, self.dtype = collective, nbytes, count, dtype
        self.op, self.root, self.algorithm, self.mode = op, root, algorithm, mode
        self.n, self.factor = n, factor
        self.rounds: list[float] = []
        self.ranks_t: list[list[float]] = []
        self.round_ids: list[int] | None = None  # which sweep rounds (None: 0, 1, 2, ...)
        self.drift: list[float] | None = None
        self.iters = 0
        self.extra_iters = 0  # calls per block in the contenders' extra rounds (Sweep._settle)
        self.wrong: int | None = None
        self.picked: str | None = None  # for "auto": the algorithm it ran
        self.trial: dict | None = None  # for "auto": what its trial measured (s per call)
        self.then: str | None = None  # for "auto": its pick after the rounds, if another

    def ids(self) -> list[int]:
        """The sweep rounds this result took part in."""
        return self.round_ids if self.round_ids is not None else list(range(len(self.rounds)))

    def corrected(self) -> np.ndarray:
        """Per-round times divided by the round's drift factor (see ``correct_drift``)."""
        t = np.asarray(self.rounds, dtype=float)
        return t / np.asarray(self.drift) if self.drift is not None else t

    @property
    def time(self) -> float:
        """Median over rounds of the per-iteration time (max over ranks), each round corrected
        for the machine's drift, seconds."""
        return float(np.median(self.corrected())) if self.rounds else math.nan

    @property
    def spread(self) -> float:
        """(max - min) / median over the corrected rounds."""
        if len(self.rounds) < 2:
            return 0.0
        t = self.corrected()
        return float(t.max() - t.min()) / self.time

    @property
    def algbw(self) -> float:
        """Bytes per second (GB/s x 1e9) of the size column."""
        return self.nbytes / self.time if self.time > 0 else 0.0

    @property
    def busbw(self) -> float:
        """algbw x the collective's bus-bandwidth factor (bytes per second)."""
        return self.algbw * self.factor

    def latency(self) -> tuple[float, float, float]:
        """OSU min/avg/max over ranks of the median round, seconds."""
        if not self.rounds:
            return (math.nan,) * 3
        k = int(np.argsort(self.corrected())[len(self.rounds) // 2])
        t = self.ranks_t[k]
        return min(t), sum(t) / len(t), max(t)

    def to_dict(self) -> dict:
        """One JSON/CSV row (times in us, bandwidths in GB/s)."""
        lat = self.latency()
        return {"collective": self.collective, "size": self.nbytes, "count": self.count,
                "type": self.dtype, "redop": self.op, "root": self.root,
                "algorithm": self.algorithm, "mode": self.mode, "ranks": self.n,
                "time_us": self.time * 1e6, "rounds_us": [t * 1e6 for t in self.rounds],
                "round_ids": self.ids(), "extra_iters": self.extra_iters,
                "drift": list(self.drift) if self.drift is not None else None,
                "spread": self.spread, "algbw_GBps": self.algbw / 1e9,
                "busbw_GBps": self.busbw / 1e9, "wrong": self.wrong, "iterations": self.iters,
                "lat_min_us": lat[0] * 1e6, "lat_avg_us": lat[1] * 1e6,
                "lat_max_us": lat[2] * 1e6, "picked": self.picked,
                "trial_us": None if self.trial is None else
                {name: t * 1e6 for name, t in self.trial.items()}, "then": self.then}


def correct_drift(results: list[Result]) -> None:
    """Take the machine's drift between rounds out of every result of one size.

    Every algorithm runs once per round, so all of them see the same machine in a round. On a
    shared machine that machine drifts: here whole runs of rounds ran 1.5x slower for every
    algorithm alike (a neighbour's load), and the medians of two algorithms running the same
    code then differed by up to 15-19% depending on which of them caught more slow rounds. A
    round's *drift factor* is the median, over the algorithms that ran in it, of its time
    relative to that algorithm's median round (a ratio of medians, so one erratic algorithm
    does not move it); each round's time is divided by it before the median is taken. The raw
    rounds and the factors are both in the JSON output. A round that fewer than two algorithms
    ran in, or a result with one round, keeps the factor 1.
    """
    full = [r for r in results if len(r.rounds) >= 2 and min(r.rounds) > 0]
    if len(full) < 2:
        return
    rel: dict[int, list[float]] = {}  # round -> log(time / that algorithm's median)
    for r in full:
        logs = np.log(np.asarray(r.rounds, dtype=float))
        for i, v in zip(r.ids(), logs - np.median(logs)):
            rel.setdefault(i, []).append(float(v))
    factor = {i: math.exp(float(np.median(v))) if len(v) >= 2 else 1.0 for i, v in rel.items()}
    for r in full:
        r.drift = [factor[i] for i in r.ids()]


# A timed block's length, when -n is not given (ms). Short blocks: at 3 ranks on 2 cores a block
# that the scheduler interrupts runs far slower, and the longer the block the more of them it
# catches; measured, two blocks in a row of MPICH's 8-byte reduce (the same code) differed by
# 7% (sd, ~4 ms blocks), 10% (~10 ms) and 32% (~30 ms). With 2 ms instead of 10, the reduce
# sweep 8 B - 2 KiB at n = 3 knew each median to 0.5-0.8% in 4 s instead of 0.7-1.1% in 49 s,
# and the allreduce sweep 8 B - 64 MiB took 41 s at n = 2 and 60 s at n = 3 instead of 79 and
# 108. It is also the length of ``auto``'s trial blocks (collectives.api._Trial), so that the
# two measure the same thing.
BUDGET_MS = 2.0

# An algorithm within this factor of the fastest median after the first rounds may still
# turn out the fastest: it gets the extra rounds (Sweep._settle), and so does ``auto``, whose
# time is the one compared with the best. 1.5: at n = 3 on 2 cores the rounds of one
# algorithm can fall in two modes 1.5x apart (how the scheduler placed three ranks on two
# cores), and the median of 7 of them in either.
CONTEND = 1.5


def median_error(res: Result) -> float:
    """Relative standard error of ``res.time``: 1.2533 x sigma / sqrt(k) for the median of k
    rounds, sigma estimated robustly (1.4826 x the median absolute deviation of the
    drift-corrected log times)."""
    logs = np.log(res.corrected())
    if len(logs) < 3:
        return math.inf
    sigma = 1.4826 * float(np.median(np.abs(logs - np.median(logs))))
    return 1.2533 * sigma / math.sqrt(len(logs))


def noise(a: Result, b: Result) -> float:
    """Three standard errors of ``log(a.time / b.time)``: a gap beyond it is not the noise."""
    return 3 * math.hypot(median_error(a), median_error(b))


def _race(keys, results, kept=()) -> list:
    """The contenders that stay in the race (``Sweep._settle``): per mode, the best, ``auto``,
    those in ``kept``, and those not clearly slower than the best (by more than ``noise``)."""
    stay = []
    for mode in dict.fromkeys(key[1] for key in keys):
        mine = [key for key in keys if key[1] == mode]
        best = results[min(mine, key=lambda k: results[k].time)]
        for key in mine:
            res = results[key]
            if res is best or key[0] == "auto" or key in kept or \
                    math.log(res.time / best.time) <= noise(res, best):
                stay.append(key)
    return stay


def _rejoin(keys, results) -> list:
    """``keys`` and, per mode racing, the fastest algorithm of the row other than ``auto``
    when it is not among them (``Sweep._settle``): the one a reader compares ``auto`` with.
    Two ways it had left: out after a few rounds, its drift-corrected median later came out
    first, and the table's best was a median of 8-12 rounds known to 3-11% (reduce-scatter,
    2 ranks, 2 and 8 MiB: hierarchical, out after 9 rounds, 8-20% ahead of ``auto``'s pick at
    the end); or clearly slower than ``auto`` (the same code, caught in slower rounds), and
    ``auto`` raced on alone, its rounds with no drift correction (a round one algorithm ran in
    keeps the factor 1): broadcast, 3 ranks, 128 B, the machine went from ~50 to ~11 µs a call
    after 20 rounds, ``auto`` ran 400 more, and came out 0.34 of ``native``'s time."""
    keys = list(keys)
    for mode in dict.fromkeys(key[1] for key in keys):
        mine = [key for key in results
                if key[1] == mode and key[0] != "auto" and results[key].rounds]
        if mine:
            best = min(mine, key=lambda k: results[k].time)
            if best not in keys:
                keys.append(best)
    return keys


def _resolved(keys, results, target: float) -> bool:
    """Whether the race (``Sweep._settle``) may end: every median left is known to ``target``,
    and so is, per mode, the gap between ``auto`` and the best (the standard error of the log
    of their ratio: the figure a reader takes from the table)."""
    if any(median_error(results[key]) > target for key in keys):
        return False
    for mode in dict.fromkeys(key[1] for key in keys):
        best = min((key for key in keys if key[1] == mode), key=lambda k: results[k].time)
        auto = ("auto", mode)
        if auto != best and auto in results and auto in keys and \
                math.hypot(median_error(results[auto]), median_error(results[best])) > target:
            return False
    return True


def default_algorithms(collective: str, gloo: bool = True) -> list[str]:
    """Every registered algorithm, ``auto``, and ``gloo`` when torch is importable."""
    import importlib.util

    import collectives
    names = list(collectives.algorithms(collective))
    # native first: the baseline the ratio column divides by.
    names.sort(key=lambda a: (a != "native", a))
    names.append("auto")
    if gloo and importlib.util.find_spec("torch") is not None:
        names.append("gloo")
    return names


# The rows ``twins`` gives no twin: auto (a second trial of its own, not a second row of one
# code) and gloo (not this toolkit's code).
UNTWINNED = ("auto", "gloo")


def code(algorithm: str) -> str:
    """The algorithm a row runs: ``ring#2`` is a second row of ring's code (``twins``)."""
    return algorithm.partition("#")[0]


def twins(algorithms: list[str]) -> list[str]:
    """``algorithms`` and a *twin* row ``NAME#2`` of each (not of ``auto`` or ``gloo``): the
    same code timed as a row of its own, interleaved with the others, to measure the
    benchmark's own floor: how far two rows of one code fall apart, and how close an ``auto``
    that ran the best algorithm's code every time could come to the best row
    (``python -m bench verdict`` reports both when the rows are there)."""
    return algorithms + [f"{a}#2" for a in algorithms
                         if a not in UNTWINNED and "#" not in a
                         and f"{a}#2" not in algorithms]


def membw(comm, nbytes: int = 32 << 20, reps: int = 10) -> float:
    """The machine's memory bandwidth (bytes/s) for a large ``numpy.copyto`` run by every rank
    at once: ranks x 2 x nbytes (read + write) over the slowest rank's best time of ``reps``
    (a bound is what the machine can do: best of 3 read 16-35 GB/s here, run to run)."""
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    best = math.inf
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    slowest = _max(comm, best)
    return comm.Get_size() * 2 * a.nbytes / slowest


def _max(comm, value: float) -> float:
    from mpi4py import MPI
    buf = np.array([value], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return float(buf[0])


def _gather(comm, value: float) -> list[float]:
    out = np.empty(comm.Get_size(), dtype=np.float64)
    comm.Allgather(np.array([value], dtype=np.float64), out)
    return out.tolist()


def _sum(comm, value: int) -> int:
    from mpi4py import MPI
    buf = np.array([value], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return int(buf[0])


class _Progress:
    """A one-line progress bar on stderr, on rank 0 and only when stderr is a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = max(total, 1), 0
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r[{bar:<30}] {100 * frac:3.0f}% {label:<24} "
                         f"{time.perf_counter() - self.start:6.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 78 + "\r")
            sys.stderr.flush()


class Sweep:
    """A benchmark run: one collective over sizes and algorithms (see the module doc)."""

    def __init__(self, collective: Collective, comm, *, dtype="float32", op="sum", root=0,
                 algorithms=None, iters=0, warmup=2, rounds=3, budget=BUDGET_MS / 1e3, check=True,
                 modes=None, gloo_comm=None, out=None, max_rounds=None, target=0.01,
                 settle=20.0, incumbent=None):
        self.spec, self.comm = collective, comm
        self.n, self.rank = comm.Get_size(), comm.Get_rank()
        self.dtype = np.dtype(dtype)
        self.op = op if collective.has_op else None
        self.root = root if collective.rooted else -1
        if collective.rooted and not 0 <= root < self.n:
            raise ValueError(f"root {root} out of range for {self.n} ranks")
        self.algorithms = list(algorithms or default_algorithms(collective.name))
        self.iters, self.warmup, self.rounds = iters, warmup, max(1, rounds)
        # The contenders' extra rounds (``_settle``): up to max_rounds in all and ``settle``
        # seconds of blocks per size, until the median of each is known to ``target``.
        self.max_rounds = max(self.rounds, 60 * self.rounds if max_rounds is None else max_rounds)
        self.target, self.settle = target, settle
        # incumbent(input bytes, mode) -> the algorithm auto runs now there (``tune``): a
        # contender of the race like ``auto``, whatever its first rounds said.
        self.incumbent = incumbent
        self.budget, self.check = budget, check
        self.modes = [m for m in (modes or collective.modes) if m in collective.modes]
        if not self.modes:
            raise ValueError(f"{collective.name} runs {'/'.join(collective.modes)} only")
        self.factor = busbw_factor(collective.name, self.n)
        self.out = out  # callback(results of one size) for streaming output
        self.notes: list[str] = []
        self._gloo = None  # the process group, started after every other row (``run``)
        if "gloo" in self.algorithms:
            import importlib.util

            from bench import gloo
            why = None
            if self.dtype.name not in gloo.DTYPES:
                why = f"gloo has no {self.dtype.name}"
            elif self.op is not None and self.op not in gloo.OPS:
                why = f"gloo has no {self.op!r}"
            elif importlib.util.find_spec("torch") is None:
                why = "gloo: torch is not importable"
            if why:
                self.notes.append(f"{why}, skipped")
                self.algorithms.remove("gloo")

    def _callables(self, coll, count, algorithms=None):
        """{(algorithm, mode): (call, result array, reset)} for one size, of ``algorithms``
        (default: all but gloo)."""
        spec, dtype, n, rank = self.spec, self.dtype, self.n, self.rank
        cin, cout, _ = spec.counts(count, n)
        data = rank_data(rank, cin, dtype, self.op)
        x = data.copy()
        out = np.zeros(cout, dtype)
        buf = data.copy()  # the in-place buffer
        root = max(self.root, 0)
        calls = {}
        for alg in algorithms or [a for a in self.algorithms if a != "gloo"]:
            for mode in self.modes:
                arr_x = buf if mode == "in" else x

                def reset(arr_x=arr_x, zero=False):
                    if zero:
                        arr_x.fill(0)
                    else:
                        np.copyto(arr_x, data)
                if alg == "gloo":
                    fn = self._gloo.call(spec, arr_x, out, mode, self.op, root)
                    if fn is None:
                        continue
                else:
                    fn = spec.call(coll, arr_x, out, mode, code(alg), self.op, root, self.comm)
                calls[(alg, mode)] = (fn, spec.result(arr_x, out, mode), reset)
        return calls, cin

    def _one_pick(self, mode: str, other: str) -> bool:
        """Whether ``auto`` makes one pick for the calls of both modes (``mode`` is
        ``other``, or in place has no rules of its own: ``collectives.select.IN_PLACE_RULES``)."""
        from collectives import select
        return mode == other or self.spec.name not in select.IN_PLACE_RULES

    def _auto_trial(self, nbytes: int, inplace: bool = False) -> dict | None:
        """What ``auto``'s trial measured at this size, if it ran one
        (``collectives.api.auto_trial``)."""
        from collectives.api import auto_trial
        return auto_trial(self.spec.name, nbytes, self.comm, inplace)

    def _measure(self, fn, iters: int) -> float:
        self.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    def _auto_pick(self, nbytes: int, inplace: bool = False) -> str | None:
        """What ``algorithm="auto"`` runs for ``nbytes`` of per-rank input on this
        communicator, out of place or in place; None while it still measures its rule's
        algorithms (``collectives.api.auto_pick``)."""
        from collectives.api import auto_pick
        return auto_pick(self.spec.name, nbytes, self.comm, inplace, self.op, self.dtype)

    def _results(self, count: int, calls) -> tuple[dict, int]:
        """Empty results for ``calls`` at a size of ``count`` elements, and the size column
        (bytes)."""
        spec, n = self.spec, self.n
        ccol = spec.counts(count, n)[2]
        size_col = ccol * self.dtype.itemsize
        return {key: Result(spec.name, size_col, ccol, self.dtype.name, self.op or "none",
                            self.root, key[0], key[1], n, self.factor) for key in calls}, size_col

    def run_size(self, nbytes: int, progress=None) -> list[Result]:
        """Measure every algorithm and mode at one size, interleaved (gloo apart: ``run``)."""
        import collectives as coll
        count = max(1, nbytes // self.dtype.itemsize)
        calls, cin = self._callables(coll, count)
        results, size_col = self._results(count, calls)
        order = random.Random(nbytes)  # the same on every rank
        self._phase(calls, results, cin, order, progress, size_col)
        self._settle(calls, results, order, cin * self.dtype.itemsize)
        for key in calls:
            if key[0] == "auto":  # a race again may have changed it (collectives.api._Trial)
                now = self._auto_pick(cin * self.dtype.itemsize, key[1] == "in")
                results[key].then = now if now != results[key].picked else None
        return list(results.values())

    def _start_gloo(self):
        """The gloo process group (``bench.gloo``), started on first use."""
        if self._gloo is None:
            from bench import gloo
            self._gloo = gloo.init(self.comm)
        return self._gloo

    def gloo_size(self, nbytes: int) -> list[Result]:
        """gloo's rows at one size: check, warm-up and ``rounds`` rounds of its own (ids past
        the others', so that the drift correction compares gloo's modes only)."""
        count = max(1, nbytes // self.dtype.itemsize)
        self._start_gloo()
        calls, cin = self._callables(None, count, ["gloo"])
        if not calls:  # no gloo collective for this dtype or mode
            return []
        results, size_col = self._results(count, calls)
        for res in results.values():
            res.round_ids = []
        self._phase(calls, results, cin, random.Random(nbytes), None, size_col,
                    first_id=self.max_rounds)
        return list(results.values())

    def _phase(self, calls, results, cin, order, progress, size_col, first_id=None) -> None:
        """``calls``' check, warm-up and ``rounds`` timed rounds at one size (``run_size``)."""
        if self.check:
            want = self.spec.expected(self.rank, self.n, cin, self.dtype, self.op,
                                      max(self.root, 0))
            for key, (fn, res, reset) in calls.items():
                reset()
                fn()
                bad = 0 if want is None else int(np.count_nonzero(res != want))
                results[key].wrong = _sum(self.comm, bad)
                reset()
        for key, (fn, res, reset) in calls.items():
            if key[1] == "in":
                # Repeated in-place sums would overflow to inf: time on zeros, which stay put.
                reset(zero=True)
        ests = {}
        for key, (fn, _res, _reset) in calls.items():
            # Warm-up: one call, then as many more (up to -w) as fit in the budget; the same
            # number on every rank, from the slowest rank's time. Then the time per call from
            # a block of an eighth of the budget.
            est = _max(self.comm, self._measure(fn, 1))
            more = min(self.warmup - 1, int(self.budget / max(est, 1e-9)))
            if more > 0:
                est = _max(self.comm, self._measure(fn, more))
            k = int(min(1000, self.budget / 8 / max(est, 1e-9)))
            if k > 1 and not self.iters:
                est = _max(self.comm, self._measure(fn, k))
            if key[0] == "auto":
                # auto may still be measuring the algorithms of its rule (a few calls of each):
                # run it until it has chosen, so that its timed rounds are of its choice. Its
                # calls back to back, as in the timed blocks: every rank decides at the same
                # call (collectives.api._Trial), and is asked once after. An allreduce after
                # every call (to agree on whether to go on) ran inside the trial's timed blocks:
                # 2 ranks, reduce of 32-128 KiB, the trial timed every algorithm 1.4-1.7x the
                # benchmark's rounds after it, shm most (its ranks no longer ran ahead of each
                # other), and picked tree or binomial, 0.73-0.93 of shm, in every run.
                # Where the modes share one pick (a reduce: only its root knows it is in
                # place), the race runs them in turn, as the rows will: on the first mode's
                # calls alone it saw only what out of place ranks (2 ranks, 128 KiB: shm
                # and binomial within 1%, picked binomial, and in place shm ran at 0.81 of
                # it, the best of the row; run F0, docs/bench.md).
                mine = (cin * self.dtype.itemsize, key[1] == "in")  # input bytes, in place
                turns = [calls[k][0] for k in calls if k[0] == "auto" and
                         self._one_pick(k[1], key[1])]
                pick = self._auto_pick(*mine)
                for i in range(40000):  # a trial: at most 31 rounds of 100 calls of 5
                    if pick is not None:
                        break
                    turns[i % len(turns)]()
                    pick = self._auto_pick(*mine)
                picks = self.comm.allgather(pick)
                if len(set(picks)) > 1:
                    raise RuntimeError(f"auto's ranks picked differently: {picks}")
                results[key].picked = pick
                results[key].trial = self._auto_trial(*mine)
            ests[key] = est
        # One call count for every algorithm at this size (enough for the budget at the median
        # algorithm's pace): algorithms of about the same speed, the ones a reader compares,
        # then run blocks of the same length. With a count per algorithm, noisy estimates gave
        # one algorithm blocks 1.5-2x as long as another's, and a longer block more often
        # takes a preemption: its median was 4-5% slower for the same code.
        iters = self.iters or int(min(1000, max(1, math.ceil(
            self.budget / max(float(np.median(list(ests.values()))), 1e-9)))))
        for key in calls:
            results[key].iters = iters
        keys = list(calls)
        for r in range(self.rounds):
            # A fresh order each round, so that no algorithm always runs first, last or after
            # the same one.
            order.shuffle(keys)
            for key in keys:
                self._block(calls[key][0], iters, results[key], ests[key],
                            None if first_id is None else first_id + r)
            if progress is not None:
                progress.step(f"{format_size(size_col)} round {r + 1}/{self.rounds}")
        correct_drift([results[key] for key in calls])

    def _block(self, fn, iters: int, res: Result, est: float, round_id=None) -> float:
        """One timed block of ``iters`` calls into ``res``; returns the seconds it took.

        One untimed call first, so that the block starts in the algorithm's own steady state,
        not in what the one before left. Measured: an algorithm timed right after itself ran
        4-6% faster at small sizes. At 8 MiB, 3 ranks, native's broadcast, timed in one- and
        two-call blocks right after another algorithm's, took 1423-1780 us, and binomial's
        1119-1160. With the untimed call first they took 935-1222 and 933-1225, even. Without
        it, a row at that size timed MPI's switch, where a program calling one algorithm again
        and again pays it once; `auto`'s race, which leaves each block's first call out, picked
        native there in run after run, and the rows put it at 0.83-0.90 of binomial
        (docs/bench.md, "A seventeenth session"). Until then only calls under a millisecond had
        it: the extra call doubles the cost of a one-call block.
        """
        fn()
        ranks_t = _gather(self.comm, self._measure(fn, iters))
        res.rounds.append(max(ranks_t))
        res.ranks_t.append(ranks_t)
        if round_id is not None:
            res.round_ids.append(round_id)
        return max(ranks_t) * iters + est

    def _settle(self, calls, results, order, nbytes: int = 0) -> None:
        """Extra rounds for the algorithms that could be the fastest at this size (a race).

        After ``rounds`` rounds of everything, the *contenders* of each mode are the algorithms
        within ``CONTEND`` of the fastest median, ``auto``, and the ``incumbent`` (what ``auto``
        runs now, for ``tune``: an algorithm in its fast mode for the first rounds made every
        other look 1.5x slower, and alone, it raced no one: binomial reduce at 3 ranks, 3 fast
        rounds of 5, median 192 us against tree's 293, where the next run measured 444 against
        327). They alone run more rounds; after each, a contender whose median is clearly
        slower than the best's (by more than three standard errors of the difference) leaves
        the race (``auto``, the incumbent and the current best never do), and the fastest
        of the row other than ``auto`` rejoins it if it is not running (``_rejoin``). The race
        ends when
        every median left is known to ``target`` (its standard error, from the spread of its
        drift-corrected rounds) and so is the gap between ``auto`` and the best
        (``_resolved``), after ``max_rounds`` rounds, or when its blocks have taken ``settle``
        seconds. Why: who is fastest, and whether
        ``auto`` is as fast as the best, is decided between close medians, and on a shared
        2-core machine running 3 ranks the corrected rounds of one algorithm scatter by 4-6%
        (sd) at best and fall in two modes 1.5x apart at worst, so the medians of 7 rounds of
        two runs of the same code differed by more than 5% at about one size in six. The extra
        blocks are at least ``budget`` long (one call count for every contender), and the
        drift correction spans all rounds.
        """
        if self.max_rounds <= self.rounds or self.settle <= 0:
            return
        keys = []
        for mode in self.modes:
            mine = [key for key in calls if key[1] == mode and results[key].rounds]
            if not mine:
                continue
            best = min(results[key].time for key in mine)
            keep = self._kept(nbytes, mode)
            # and the row's fastest other than auto, which auto is compared with (_rejoin):
            # at 3 ranks, 32 B, 7 rounds in two states (7-12 us and 26-38 us a call) put auto,
            # native's code, at 9 us and native at 24, past 1.5x, and nothing raced
            close = _rejoin([key for key in mine
                             if results[key].time <= CONTEND * best or key[0] in keep], results)
            if len(close) >= 2:
                keys += close
        if not keys:
            return
        fastest = min(results[key].time for key in keys)
        iters = self.iters or max(results[keys[0]].iters,
                                  int(min(1000, math.ceil(self.budget / max(fastest, 1e-9)))))
        for res in results.values():  # every one may run extra rounds (_rejoin)
            res.round_ids = res.ids()
        kept = {key for key in keys if key[0] in self._kept(nbytes, key[1])}
        spent = 0.0  # block time (max over ranks): the same on every rank, so is every verdict
        for r in range(self.rounds, self.max_rounds):
            order.shuffle(keys)
            for key in keys:
                res = results[key]
                res.extra_iters = iters
                spent += self._block(calls[key][0], iters, res, res.time, r)
            correct_drift(list(results.values()))
            keys = _rejoin(_race(keys, results, kept), results)
            if spent >= self.settle or _resolved(keys, results, self.target):
                break

    def _kept(self, nbytes: int, mode: str) -> set:
        """The algorithms that stay in the race whatever their times: ``auto``, and the
        incumbent."""
        kept = {"auto"}
        if self.incumbent is not None:
            kept.add(self.incumbent(nbytes, mode))
        return kept

    def run(self, sizes) -> list[Result]:
        """Every size in turn, then gloo's rows at every size; calls ``out(results)`` after
        each size, and ``out(results, late=True)`` with each size's gloo rows and the others'.

        gloo runs after every other row of the sweep, and its process group starts only then:
        a row's figures must not depend on which other rows a run has, and neither gloo's
        collectives nor its process group left them alone. Its collectives go through the
        kernel's TCP loopback, and blocks that followed them ran disturbed (reduce-scatter, 2
        ranks, four alternating launches each: with gloo's blocks among the others', ring took
        0.91-0.98x native's time at 128 KiB, 1.02-1.10 without; every row at 32 KiB 7-10%
        slower). Its group, started, keeps threads that sleep between collectives, one of them
        (``gloo_tcp_loop``) waking a hundred times a second; where a node runs more ranks than
        cores they changed how the scheduler placed the ranks: 3 ranks, allreduce of 512 KiB
        in place, three launches each way, double binary tree 411-419 us a call without the
        group and 408-519 with it, tree 627-636 without and 421-551 with, Rabenseifner
        427-458 and 445-650 (``docs/bench.md``, "A sixteenth session"). tune and ``auto``'s
        races run no gloo: the benchmark's other rows now see the machine they saw.
        """
        progress = _Progress(len(sizes) * self.rounds, self.rank == 0)
        allres, per_size = [], []
        try:
            for nbytes in sizes:
                res = self.run_size(nbytes, progress)
                allres.extend(res)
                per_size.append((nbytes, res))
                if self.out is not None:
                    self.out(res)
        finally:
            progress.close()
        if "gloo" in self.algorithms:
            for nbytes, res in per_size:
                late = self.gloo_size(nbytes)
                allres.extend(late)
                if self.out is not None and late:
                    self.out(res + late, late=True)
        return allres

    def close(self):
        """End the gloo process group, if one was started."""
        if self._gloo is not None:
            self._gloo.close()


# -- reports ------------------------------------------------------------------------------------
_MODE_HEAD = {"out": "out-of-place", "in": "in-place"}


def _fmt_time(t: float) -> str:
    return f"{t * 1e6:10.2f}" if t < 1e4 else f"{t * 1e6:10.0f}"


def header(spec: Collective, modes, *, latency=False, ratio=True, bound=False) -> list[str]:
    """The column header lines of the nccl-tests table."""
    left = f"{'size':>10} {'count':>11} {'type':>9} {'redop':>6} {'root':>5} {'algorithm':<19}"
    units = f"{'(B)':>10} {'(elements)':>11} {'':>9} {'':>6} {'':>5} {'':<19}"
    group = " " * len(left)
    mid, mid_u = "", ""
    for mode in modes:
        block = f" {'time':>10} {'±%':>4} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        unit = f" {'(us)':>10} {'':>4} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
        group += f"{_MODE_HEAD[mode]:^{len(block)}}"
        mid += block
        mid_u += unit
    tail, tail_u = "", ""
    if latency:
        tail += f" {'lat-min':>9} {'lat-avg':>9} {'lat-max':>9} {'iters':>6}"
        tail_u += f" {'(us)':>9} {'(us)':>9} {'(us)':>9} {'':>6}"
    if ratio:
        tail += f" {'xnative':>7}"
        tail_u += f" {'':>7}"
    if bound:
        tail += f" {'%bound':>6}"
        tail_u += f" {'':>6}"
    return ["#" + group[1:], "#" + (left + mid + tail)[1:], "#" + (units + mid_u + tail_u)[1:]]


def rows(results: list[Result], modes, *, latency=False, ratio=True, membw_Bps=None,
         only=None) -> list[str]:
    """Table lines for the results of one size: one per algorithm (those in ``only``, if
    given; the ratio column still divides by ``native``'s time among ``results``)."""
    by = {(r.algorithm, r.mode): r for r in results}
    lines = []
    algs = [a for a in dict.fromkeys(r.algorithm for r in results) if only is None or a in only]
    for alg in algs:
        first = next(by[(alg, m)] for m in modes if (alg, m) in by)
        line = (f"{first.nbytes:>10} {first.count:>11} {first.dtype:>9} {first.op:>6} "
                f"{first.root:>5} {alg:<19}")
        for mode in modes:
            r = by.get((alg, mode))
            if r is None:
                line += f" {'-':>10} {'':>4} {'-':>7} {'-':>7} {'-':>6}"
                continue
            wrong = "N/A" if r.wrong is None else str(r.wrong)
            line += (f" {_fmt_time(r.time)} {100 * r.spread:4.0f} {r.algbw / 1e9:7.2f} "
                     f"{r.busbw / 1e9:7.2f} {wrong:>6}")
        main = by.get((alg, modes[0])) or first
        if latency:
            lo, avg, hi = main.latency()
            line += f" {lo * 1e6:9.2f} {avg * 1e6:9.2f} {hi * 1e6:9.2f} {main.iters:>6}"
        if ratio:
            base = by.get(("native", main.mode))
            line += (f" {base.time / main.time:7.2f}" if base is not None and main.time > 0
                     else f" {'-':>7}")
        if membw_Bps:
            bound = 2 * main.n * main.nbytes / membw_Bps
            line += f" {100 * bound / main.time:6.1f}"
        lines.append(line)
    return lines


def footer(results: list[Result], modes) -> list[str]:
    """nccl-tests' closing lines: average busbw of each algorithm over the sweep."""
    lines = ["#", "# Avg bus bandwidth (GB/s, over sizes; first mode):"]
    for alg in dict.fromkeys(r.algorithm for r in results):
        bw = [r.busbw for r in results if r.algorithm == alg and r.mode == modes[0]]
        wrong = [r.wrong for r in results if r.algorithm == alg and r.wrong is not None]
        if bw:
            lines.append(f"#   {alg:<19} {np.mean(bw) / 1e9:8.3f}"
                         + (f"   #wrong {sum(wrong)}" if wrong else ""))
    said = None
    for mode in modes:
        picks = [(r.nbytes, r.picked + (f", then {r.then}" if r.then else ""))
                 for r in results if r.picked and r.mode == mode]
        if not picks or picks == said:
            continue
        spans: list[list] = []  # runs of consecutive sizes with the same pick
        for nbytes, name in picks:
            if spans and spans[-1][2] == name:
                spans[-1][1] = nbytes
            else:
                spans.append([nbytes, nbytes, name])
        lines.append(f"# auto ran{' in place' if said else ''}: " + ", ".join(
            f"{name} ({format_size(a)}" + (f" - {format_size(b)})" if b != a else ")")
            for a, b, name in spans))
        said = picks
    return lines


def format_table(spec: Collective, results: list[Result], modes=None, **kw) -> str:
    """The whole table for ``results`` (any number of sizes) as one string."""
    modes = list(modes or spec.modes)
    lines = header(spec, modes, latency=kw.get("latency", False), ratio=kw.get("ratio", True),
                   bound=bool(kw.get("membw_Bps")))
    for nbytes in dict.fromkeys(r.nbytes for r in results):
        lines += rows([r for r in results if r.nbytes == nbytes], modes, **kw)
    return "\n".join(lines)


def write_json(path, results: list[Result], meta: dict) -> None:
    """Results and run metadata as JSON (what ``bench plot`` reads back)."""
    with open(path, "w") as f:
        json.dump(dict(meta, results=[r.to_dict() for r in results]), f, indent=1)
        f.write("\n")


def write_csv(path, results: list[Result]) -> None:
    """One CSV row per (size, algorithm, mode)."""
    dicts = [r.to_dict() for r in results]
    if not dicts:
        return
    fields = [k for k in dicts[0] if k not in ("rounds_us", "drift", "trial_us")]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(dicts)


# -- command line -------------------------------------------------------------------------------
def parser(spec: Collective) -> argparse.ArgumentParser:
    """The nccl-tests/OSU options of ``python -m bench <collective>``."""
    p = argparse.ArgumentParser(
        prog=f"python -m bench {spec.name}",
        description=f"{spec.name} bandwidth and latency, every algorithm beside MPI's own "
                    f"(run under mpiexec -n N)")
    p.add_argument("-b", "--minbytes", default="8", help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", default="32M", help="largest size (default 32M)")
    p.add_argument("-f", "--stepfactor", type=float, default=4, help="size factor (default 4)")
    p.add_argument("-d", "--datatype", default="float32", help="numpy dtype (default float32)")
    if spec.has_op:
        p.add_argument("-o", "--op", default="sum",
                       help="sum, prod, min, max, avg, band, bor, bxor (default sum)")
    if spec.rooted:
        p.add_argument("-r", "--root", type=int, default=0, help="root rank (default 0)")
    p.add_argument("-n", "--iters", type=int, default=0,
                   help="calls per round (default: enough for --budget ms)")
    p.add_argument("-w", "--warmup_iters", type=int, default=2, help="warm-up calls (default 2)")
    p.add_argument("-c", "--check", type=int, default=1, help="check results (default 1)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--max-rounds", type=int, default=None,
                   help="rounds for auto and the algorithms within 1.5x of the fastest at a "
                        "size, until --target is met (default 60 x --rounds)")
    p.add_argument("--target", type=float, default=1.0,
                   help="stop those extra rounds when each median, and auto's gap to the "
                        "best, is known to this many percent (standard error; default 1)")
    p.add_argument("--settle", type=float, default=20.0,
                   help="at most this many seconds of extra rounds per size (default 20; 0: "
                        "none)")
    p.add_argument("--budget", type=float, default=BUDGET_MS,
                   help=f"ms per round when -n is not given (default {BUDGET_MS:g})")
    p.add_argument("--algorithms", default=None,
                   help="comma-separated (default: every registered one, auto, gloo); "
                        "NAME#2 is a second row of NAME's code")
    p.add_argument("--twin", action="store_true",
                   help="a second row (NAME#2) of every algorithm but auto and gloo: the "
                        "benchmark's own floor, which `python -m bench verdict` reports")
    p.add_argument("--modes", default=None, help=f"out,in (default: {','.join(spec.modes)})")
    p.add_argument("--latency", action="store_true", help="OSU min/avg/max latency columns")
    p.add_argument("--json", default=None, help="write the results as JSON")
    p.add_argument("--csv", default=None, help="write the results as CSV")
    p.add_argument("--plot", default=None, help="draw busbw vs size into this PNG")
    return p


def _abort_on_error(comm):
    """An exception on one rank must end the whole job, not leave the others waiting."""
    def hook(kind, value, tb):
        sys.__excepthook__(kind, value, tb)
        sys.stderr.flush()
        comm.Abort(1)
    if comm.Get_size() > 1:
        sys.excepthook = hook


def run_info(comm, sweep: Sweep) -> dict:
    """Metadata of a run: ranks, host, MPI library, dtype, op."""
    from mpi4py import MPI
    return {"collective": sweep.spec.name, "ranks": sweep.n, "host": socket.gethostname(),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "dtype": sweep.dtype.name, "op": sweep.op, "root": sweep.root,
            "rounds": sweep.rounds, "max_rounds": sweep.max_rounds,
            "target": sweep.target, "settle_s": sweep.settle, "notes": sweep.notes}


def main(spec: Collective, argv=None) -> int:
    """``python -m bench <collective> [options]`` (see ``parser``)."""
    args = parser(spec).parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    _abort_on_error(comm)
    sizes = byte_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    algorithms = args.algorithms.split(",") if args.algorithms else None
    if algorithms:
        import collectives
        known = set(collectives.algorithms(spec.name)) | {"auto", "gloo"}
        unknown = [a for a in algorithms if code(a) not in known or
                   ("#" in a and code(a) in UNTWINNED)]
        if unknown:
            raise SystemExit(f"unknown algorithm(s) {', '.join(unknown)} for {spec.name}; "
                             f"expected some of {', '.join(sorted(known))}")
    if args.twin:
        algorithms = twins(algorithms or default_algorithms(spec.name))
    modes = args.modes.split(",") if args.modes else None
    rank0 = comm.Get_rank() == 0
    bw = membw(comm) if spec.name == "allreduce" else None
    lines_kw = dict(latency=args.latency, membw_Bps=bw)

    gloo_head = True  # the line before gloo's rows, once

    def show(res, late=False):
        nonlocal gloo_head
        if not rank0:
            return
        if late and gloo_head:
            gloo_head = False
            print("# gloo, timed after every size above (Sweep.run); xnative against the "
                  "native row of its size")
        print("\n".join(rows(res, sweep.modes, only={"gloo"} if late else None, **lines_kw)),
              flush=True)

    sweep = Sweep(spec, comm, dtype=args.datatype, op=getattr(args, "op", None),
                  root=getattr(args, "root", 0), algorithms=algorithms, iters=args.iters,
                  warmup=args.warmup_iters, rounds=args.rounds, budget=args.budget / 1e3,
                  check=bool(args.check), modes=modes, out=show, max_rounds=args.max_rounds,
                  target=args.target / 100, settle=args.settle)
    info = run_info(comm, sweep)
    if rank0:
        print(f"# collectives benchmark: {spec.name}, {sweep.n} ranks on {info['host']}, "
              f"{sweep.dtype.name}" + (f" {sweep.op}" if sweep.op else "")
              + (f", root {sweep.root}" if spec.rooted else ""))
        print(f"# {info['mpi']}")
        print(f"# {sweep.rounds} rounds per size, interleaved over algorithms, then a race of "
              f"up to {sweep.max_rounds} rounds ({sweep.settle:g} s) for auto and those within "
              f"{CONTEND:g}x of the fastest, until each median is known to "
              f"{100 * sweep.target:g}%; time = per-call time, max over ranks, median of "
              f"rounds corrected for the machine's drift between rounds; ±% = (max - min) / "
              f"median")
        print(f"# algorithms: {', '.join(sweep.algorithms)}"
              + "".join(f"\n# note: {n}" for n in sweep.notes))
        print("#")
        print("\n".join(header(spec, sweep.modes, latency=args.latency, bound=bool(bw))),
              flush=True)
    try:
        results = sweep.run(sizes)
    finally:
        sweep.close()
    if rank0:
        print("\n".join(footer(results, sweep.modes)))
        if bw:
            print(f"# memory bandwidth: {bw / 1e9:.2f} GB/s (numpy.copyto of 32 MiB on every "
                  f"rank at once, read + write); %bound = time to move 2 n N bytes at that "
                  f"bandwidth / time")
        info["membw_GBps"] = bw / 1e9 if bw else None
        if args.json:
            write_json(args.json, results, info)
        if args.csv:
            write_csv(args.csv, results)
        if args.plot:
            from bench import plot
            plot.plot([r.to_dict() for r in results], args.plot, info)
            print(f"# plot: {args.plot}")
    return 0
