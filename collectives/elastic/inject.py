"""``FailureInjector``: kill chosen ranks at chosen steps, by SIGKILL, for tests and examples.

    inject = FailureInjector.parse("2:5,1:9")   # COMM_WORLD rank 2 at step 5, rank 1 at step 9
    for state.step in range(state.step, steps):
        inject(state.step)                      # before the step's work
        ...

A rank is killed as a node failure or the kernel's out-of-memory killer would: SIGKILL, with no
chance to say goodbye (a rank that *exits* is another case: Open MPI's launcher ends the whole
job for it). Ranks are names (``collectives.elastic.replace``): ``COMM_WORLD`` ranks, which stay
a process's name after a shrink, and past them the replacements (``W + k`` for the ``k``-th
replacement of a job of ``W`` ranks).
"""
from __future__ import annotations

import os
import signal
import sys

__all__ = ["FailureInjector"]


class FailureInjector:
    """A set of (name, step) at which that process kills itself (names: ``COMM_WORLD`` ranks,
    then replacements)."""

    def __init__(self, plan=()):
        self.plan: set[tuple[int, int]] = set()
        for rank, step in plan:
            self.fail_at(rank, step)

    def fail_at(self, rank: int, step: int) -> "FailureInjector":
        """Kill ``rank`` when it reaches ``step`` (may be given several times)."""
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (rank, step)):
            raise ValueError(f"rank and step must be non-negative integers, got {rank!r}, "
                             f"{step!r}")
        self.plan.add((rank, step))
        return self

    @classmethod
    def parse(cls, text: str | None) -> "FailureInjector":
        """From ``"rank:step,rank:step"`` (empty or None: no failures)."""
        out = cls()
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            try:
                rank, step = (int(v) for v in part.split(":"))
            except ValueError:
                raise ValueError(f"failure {part!r}: expected RANK:STEP (e.g. 2:5)") from None
            out.fail_at(rank, step)
        return out

    def __call__(self, step: int) -> None:
        """Kill this process now if its name is to fail at ``step``."""
        if not self.plan:
            return
        from .replace import name
        if (name(), step) in self.plan:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
