"""``GlobalBatches``: the samples of each step, split over however many ranks are left.

The documented choice: the *global* batch is kept. Step ``s`` trains on the same ``global_batch``
samples whatever the rank count (a permutation of ``range(samples)`` per epoch, drawn from
``seed`` and the epoch); rank ``r`` of ``n`` takes its part of them (``numpy.array_split``
sizes, in rank order). After a shrink the survivors share the step's samples, so the data seen
does not depend on who failed, and the position in the data is the step alone: nothing to
commit besides ``state.step``. The per-rank batch grows (4 -> 3 ranks: 8 -> 11 or 10 samples of
a global 32).
"""
from __future__ import annotations

import numpy as np

__all__ = ["GlobalBatches"]


class GlobalBatches:
    """Sample indices of step ``s`` on rank ``r`` of ``n`` (``indices``)."""

    def __init__(self, samples: int, global_batch: int, seed: int = 0):
        if not 0 < global_batch <= samples:
            raise ValueError(f"global_batch must be in 1..samples={samples}, got "
                             f"{global_batch}")
        self.samples, self.global_batch, self.seed = samples, global_batch, seed
        self.per_epoch = samples // global_batch
        self._perm: dict = {}

    def step(self, step: int) -> np.ndarray:
        """The global batch of ``step``."""
        epoch, k = divmod(step, self.per_epoch)
        perm = self._perm.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.samples)
            self._perm = {epoch: perm}
        return perm[k * self.global_batch:(k + 1) * self.global_batch]

    def indices(self, step: int, rank: int, size: int) -> np.ndarray:
        """Rank ``rank``'s part of step ``step``'s global batch, of ``size`` ranks."""
        return np.array_split(self.step(step), size)[rank]
