"""What a benchmark row's timed rounds say: the median, the spread, and the ``Result`` record.

A *round* is one timed block of back-to-back calls; its time is the per-call time of the
slowest rank (nccl-tests takes the max over ranks). A row's time is the median over its rounds,
and its spread the interquartile range over the median: how far apart the middle half of the
rounds fell (0.05 = the middle half within 5% of the median's size).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["median", "quartiles", "spread", "median_round", "Result"]


def median(values) -> float:
    """The median of ``values`` (nan for none)."""
    return float(np.median(np.asarray(values, dtype=float))) if len(values) else math.nan


def quartiles(values) -> tuple[float, float]:
    """The lower and upper quartiles (linear interpolation between the sorted values)."""
    if not len(values):
        return math.nan, math.nan
    q1, q3 = np.percentile(np.asarray(values, dtype=float), [25, 75])
    return float(q1), float(q3)


def spread(values) -> float:
    """(upper quartile - lower quartile) / median; 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    q1, q3 = quartiles(values)
    mid = median(values)
    return (q3 - q1) / mid if mid > 0 else 0.0


def median_round(values) -> int:
    """The index of the median value (the lower of the two middle ones for an even count)."""
    return int(np.argsort(np.asarray(values, dtype=float), kind="stable")[(len(values) - 1) // 2])


class Result:
    """One measured (size, algorithm, mode): each round's per-call seconds (max over ranks) and
    every rank's, calls per block, wrong elements, and for ``auto`` the algorithm it ran."""

    __slots__ = ("collective", "nbytes", "count", "dtype", "op", "root", "algorithm", "mode",
                 "n", "factor", "rounds", "ranks_t", "iters", "wrong", "picked")

    def __init__(self, collective, nbytes, count, dtype, op, root, algorithm, mode, n, factor):
        self.collective, self.nbytes, self.count, self.dtype = collective, nbytes, count, dtype
        self.op, self.root, self.algorithm, self.mode = op, root, algorithm, mode
        self.n, self.factor = n, factor
        self.rounds: list[float] = []
        self.ranks_t: list[list[float]] = []
        self.iters = 0
        self.wrong: int | None = None
        self.picked: str | None = None

    @property
    def time(self) -> float:
        """Median over rounds of the slowest rank's per-call time, seconds."""
        return median(self.rounds)

    @property
    def spread(self) -> float:
        """Interquartile range of the rounds over their median."""
        return spread(self.rounds)

    @property
    def algbw(self) -> float:
        """Bytes per second of the size column."""
        return self.nbytes / self.time if self.time > 0 else 0.0

    @property
    def busbw(self) -> float:
        """algbw x the collective's bus-bandwidth factor (bytes per second)."""
        return self.algbw * self.factor

    def latency(self) -> tuple[float, float, float]:
        """OSU's min/avg/max over ranks of the median round, seconds."""
        if not self.rounds:
            return (math.nan,) * 3
        t = self.ranks_t[median_round(self.rounds)]
        return min(t), sum(t) / len(t), max(t)

    def to_dict(self) -> dict:
        """One JSON/CSV row (times in us, bandwidths in GB/s)."""
        lat = self.latency()
        return {"collective": self.collective, "size": self.nbytes, "count": self.count,
                "type": self.dtype, "redop": self.op, "root": self.root,
                "algorithm": self.algorithm, "mode": self.mode, "ranks": self.n,
                "time_us": self.time * 1e6, "spread": self.spread,
                "min_us": min(self.rounds, default=math.nan) * 1e6,
                "max_us": max(self.rounds, default=math.nan) * 1e6,
                "algbw_GBps": self.algbw / 1e9, "busbw_GBps": self.busbw / 1e9,
                "wrong": self.wrong, "iterations": self.iters, "lat_min_us": lat[0] * 1e6,
                "lat_avg_us": lat[1] * 1e6, "lat_max_us": lat[2] * 1e6, "picked": self.picked,
                "rounds_us": [t * 1e6 for t in self.rounds]}
