"""Consistency on a server: the workers' clocks and when a pull may be answered.

Each worker counts its iterations (``Job.clock``) and tells every server. A table's
``staleness`` s bounds how far the slowest worker may lag behind a reader:

- ``s = 0``, bulk synchronous (BSP): a pull at clock c waits until every worker has reached
  clock c, and sees exactly the pushes of clocks < c. Pushes are held back, summed per
  clock, and applied once per clock in clock order when the slowest worker passes it
  (``PushBuffer``), so the result is that of synchronous data-parallel training whose
  gradient is the sum of the workers' pushes, whatever the order of arrival;
- ``s = k`` (stale synchronous, SSP, Ho et al. 2013): a pull at clock c waits only while the
  slowest worker is below c - k; it sees every push of clocks < c - k, and perhaps later
  ones, since pushes are applied on arrival;
- ``s = None`` (asynchronous, ASP): pulls never wait.

A worker that has finished counts as infinitely far ahead, so nobody waits for it.
"""
from __future__ import annotations

import time

import numpy as np

__all__ = ["Clocks", "PushBuffer", "ready"]

_DONE = np.iinfo(np.int64).max


def ready(clock: int, staleness, slowest: int) -> bool:
    """Whether a pull at ``clock`` may be answered when the slowest worker is at ``slowest``."""
    return staleness is None or slowest >= clock - staleness


class Clocks:
    """Every worker's clock as this server last heard it, and when it last heard from each."""

    def __init__(self, workers: int):
        self.clock = np.zeros(workers, dtype=np.int64)
        self.seen = np.full(workers, time.monotonic())
        self.done = np.zeros(workers, dtype=bool)

    def slowest(self) -> int:
        """The smallest clock among the workers still running (a huge number when none)."""
        return int(self.clock.min())

    def advance(self, worker: int, clock: int) -> bool:
        """Record ``worker`` at ``clock``; whether the slowest clock moved."""
        before = self.slowest()
        self.clock[worker] = max(self.clock[worker], clock)
        return self.slowest() > before

    def finish(self, worker: int) -> bool:
        """Record that ``worker`` is done; whether the slowest clock moved."""
        before = self.slowest()
        self.done[worker] = True
        self.clock[worker] = _DONE
        return self.slowest() > before

    def heard(self, worker: int) -> None:
        """Stamp a message from ``worker``."""
        self.seen[worker] = time.monotonic()

    def all_done(self) -> bool:
        """Whether every worker has finished."""
        return bool(self.done.all())


class PushBuffer:
    """A BSP table's pushes held until the slowest worker passes their clock.

    ``add`` keeps a push's keys and gradient rows under its clock; ``due`` returns, for each
    clock below the slowest worker's, in order, the pushes summed per key: one (keys, grads)
    pair per clock with distinct keys (None keys: a dense table's whole shard)."""

    def __init__(self, whole=None):
        self.pending: dict = {}
        self.whole = whole   # a dense shard's keys, for a clock mixing whole and keyed pushes

    def add(self, clock: int, worker: int, keys, grads) -> None:
        """Hold a push from ``worker`` at ``clock``."""
        self.pending.setdefault(clock, []).append((worker, keys, grads))

    def due(self, slowest: int) -> list:
        """Pop the clocks below ``slowest``, each as one summed (keys, grads) pair."""
        out = []
        for clock in sorted(c for c in self.pending if c < slowest):
            # Summed in worker order, so the result does not depend on arrival order.
            pushes = sorted(self.pending.pop(clock), key=lambda p: p[0])
            out.append(_sum(pushes, self.whole))
        return out


def _sum(pushes: list, whole):
    if len(pushes) == 1:
        return pushes[0][1], pushes[0][2]
    if all(k is None for _, k, _ in pushes):
        total = pushes[0][2].copy()
        for _, _, g in pushes[1:]:
            total += g
        return None, total
    keys = np.concatenate([whole if k is None else k for _, k, _ in pushes])
    grads = np.concatenate([g for _, _, g in pushes])
    uniq, inv = np.unique(keys, return_inverse=True)
    total = np.zeros((len(uniq), grads.shape[1]), dtype=grads.dtype)
    np.add.at(total, inv, grads)
    return uniq, total
