"""``run``: call a training function again on the survivors after a process failure.

    @elastic.run(state, comm=MPI.COMM_WORLD, min_ranks=2)
    def train(state, comm):
        for state.step in range(state.step, steps):
            ...; state.commit()
    train()

Where the job can survive a dead process (``detect.fault_tolerant``: ULFM, launched with
``mpirun --with-ft ulfm``), an MPI error that means a failed process, raised anywhere in
``train`` (``detect.process_failure``), is recovered from:

1. every survivor revokes the communicator (and what was built on it), so each one's next or
   current MPI call fails as well: all of them arrive here, none waits for ever;
2. shrink: the survivors agree on who failed and get a communicator of their own
   (``recover.shrink``); fewer than ``min_ranks`` left is a ``RanksLost`` on every survivor;
3. the survivors agree on the commit to return to: the oldest newest commit among them (they
   differ by at most one step; each keeps two);
4. ``state.rebuild(comm)``: the objects built on the old communicator are rebuilt on the new one
   (the model's own ``rebuild``, then ``state.on_rebuild`` callables);
5. ``state.restore(step)`` loads that commit, and ``train(state, comm)`` is called again with the
   shrunk communicator, from ``state.step``.

A failure during steps 2-4 (another rank dies) starts them again from the shrunk communicator.
Anything else raised in ``train`` propagates as usual (and, uncaught, ends the job by name). Each
recovery is recorded in ``state.recoveries`` (``Recovery``). Without fault tolerance the function
runs once, as without the decorator; the supervisor (``python -m collectives.elastic run``)
restarts such a job from its newest checkpoint.
"""
from __future__ import annotations

import functools
import time

from ..errors import CollectiveError
from .detect import fault_tolerant, process_failure
from .recover import shrink

__all__ = ["run", "Recovery", "RanksLost"]


class RanksLost(CollectiveError):
    """Fewer ranks survive than the job's ``min_ranks``."""


class Recovery:
    """One failure survived: the ``COMM_WORLD`` ranks ``lost``, the ``ranks`` left, the step
    in progress when it was seen (``failed_step``), the step training went on from
    (``restored``), the committed steps given up (``steps_lost``: the newest commit of any
    survivor minus ``restored``), ``seconds`` from the error to the restored state and
    ``since_commit`` from the newest commit to the restored state (failure detection, the
    step it interrupted and the recovery: a bound of the time the failure cost), each the
    largest over the survivors."""

    __slots__ = ("lost", "ranks", "failed_step", "restored", "steps_lost", "seconds",
                 "since_commit")

    def __init__(self, lost, ranks, failed_step, restored, steps_lost, seconds, since_commit):
        self.lost, self.ranks, self.failed_step = lost, ranks, failed_step
        self.restored, self.steps_lost = restored, steps_lost
        self.seconds, self.since_commit = seconds, since_commit

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self):
        return (f"Recovery(lost={self.lost}, ranks={self.ranks}, failed_step="
                f"{self.failed_step}, restored={self.restored}, steps_lost={self.steps_lost}, "
                f"seconds={self.seconds:.3f})")


def run(state, comm=None, min_ranks: int = 1, revoke=None):
    """Decorate ``train(state, comm)`` (see the module doc); ``revoke()``: more communicators
    to revoke with ``comm`` on a failure (a Mesh's)."""
    if isinstance(min_ranks, bool) or not isinstance(min_ranks, int) or min_ranks < 1:
        raise ValueError(f"min_ranks must be a positive integer, got {min_ranks!r}")

    def decorate(fn):
        @functools.wraps(fn)
        def train():
            return _Loop(state, comm, min_ranks, revoke).run(fn)
        return train
    return decorate


class _Loop:
    def __init__(self, state, comm, min_ranks, revoke):
        from mpi4py import MPI
        self.state = state
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.min_ranks = min_ranks
        self.revoke = revoke

    def run(self, fn):
        state, comm = self.state, self.comm
        ft = fault_tolerant(comm)
        state.comm = comm
        if not state.commits:
            state.keep(state.snapshot(state.step))
        while True:
            try:
                return fn(state, comm)
            except Exception as exc:  # noqa: BLE001 - only a process failure is handled
                if not ft or not process_failure(exc):
                    raise
            comm = self.recover(comm)

    def recover(self, comm):
        from mpi4py import MPI
        state = self.state
        t0 = time.monotonic()
        failed_step, lost = state.step, []
        while True:
            others = list(self.revoke()) if self.revoke is not None else []
            new, gone = shrink(comm, others)
            lost += gone
            try:
                if new.Get_size() < self.min_ranks:
                    raise RanksLost(
                        f"ranks {sorted(lost)} of COMM_WORLD failed: {new.Get_size()} left, "
                        f"fewer than min_ranks={self.min_ranks}")
                low = new.allreduce(state.committed, op=MPI.MIN)
                high = new.allreduce(state.committed, op=MPI.MAX)
                state.rebuild(new)
                state.restore(low)
                t1 = time.monotonic()
                times = new.allgather((t1 - t0, t1 - state.committed_at))
                seconds, since = max(t[0] for t in times), max(t[1] for t in times)
                break
            except RanksLost:
                raise
            except Exception as exc:  # noqa: BLE001
                if not process_failure(exc):
                    raise
                comm = new
        state.recoveries.append(Recovery(sorted(lost), new.Get_size(), failed_step, low,
                                         high - low, seconds, since))
        return new
