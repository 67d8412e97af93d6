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
   (torch's default group where it is the toolkit's backend, the model's own ``rebuild``, then
   ``state.on_rebuild`` callables); torch's groups on that backend are revoked in step 1 too;
5. ``state.restore(step)`` loads that commit, and ``train(state, comm)`` is called again with the
   shrunk communicator, from ``state.step``.

Two more rules may decide who goes on after step 3:

- ``select(comm)``: the survivors that go on (``collectives.elastic.mesh``: the complete
  tensor-parallel groups of a mesh); a survivor it leaves out takes part in the recovery to its
  end and then returns ``None`` from ``train()`` instead of calling the function again;
- ``replace``: as many new processes as were lost are started and merged after the survivors
  (``collectives.elastic.replace``), so the communicator is back to its size. Rank 0 broadcasts
  the names, the step and then its commit over the merged communicator: a replacement receives
  the state from a live peer, rebuilds the model with the others and enters ``train`` at the
  restored step. A replacement runs the same command line (``replace=True``: this interpreter
  and ``sys.argv``; or the argument list given) and so the same ``elastic.run``, which joins
  instead of starting. A ZeRO model's state is pooled and cut again for the merged
  communicator, as after a shrink (``collectives.elastic.zero``): a replacement's shard comes
  from its peers.

A failure during steps 2-4 (another rank dies) starts them again from the shrunk communicator (a
replacement that was being handed the state then sees its merged communicator revoked: its
error ends the job by name).
Anything else raised in ``train`` propagates as usual (and, uncaught, ends the job by name).
Each recovery is recorded in ``state.recoveries`` (``Recovery``). Processes are named as
``collectives.elastic.replace`` names them: ``COMM_WORLD`` ranks, and past them the
replacements. Without fault tolerance the function runs once, as without the decorator; the
supervisor (``python -m collectives.elastic run``) restarts such a job from its newest
checkpoint.
"""
from __future__ import annotations

import functools
import time

from ..errors import CollectiveError
from . import replace as replacing
from .detect import fault_tolerant, process_failure
from .recover import shrink
from .state import torch_backend

__all__ = ["run", "Recovery", "RanksLost"]


class RanksLost(CollectiveError):
    """Fewer ranks survive than the job's ``min_ranks`` (or than its rule to go on needs)."""


class Recovery:
    """One failure survived: the processes ``lost`` (names: ``COMM_WORLD`` ranks, then
    replacements), the ``ranks`` that go on, the survivors that ``left`` (a ``select`` rule) and
    the replacements that ``joined``, the step in progress when it was seen (``failed_step``),
    the step training went on from (``restored``), the committed steps given up
    (``steps_lost``: the newest commit of any survivor minus ``restored``), ``seconds`` from
    the error to the restored state and ``since_commit`` from the newest commit to the restored
    state (failure detection, the step it interrupted and the recovery: a bound of the time the
    failure cost), each the largest over the ranks."""

    __slots__ = ("lost", "ranks", "left", "joined", "failed_step", "restored", "steps_lost",
                 "seconds", "since_commit")

    def __init__(self, lost, ranks, failed_step, restored, steps_lost, seconds, since_commit,
                 left=(), joined=()):
        self.lost, self.ranks, self.failed_step = list(lost), ranks, failed_step
        self.left, self.joined = list(left), list(joined)
        self.restored, self.steps_lost = restored, steps_lost
        self.seconds, self.since_commit = seconds, since_commit

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self):
        return (f"Recovery(lost={self.lost}, ranks={self.ranks}, left={self.left}, joined="
                f"{self.joined}, failed_step={self.failed_step}, restored={self.restored}, "
                f"steps_lost={self.steps_lost}, seconds={self.seconds:.3f})")


def _settle() -> None:
    """Complete the torch layer's abandoned async collectives (now failed: their communicators
    are revoked), so that none fails a later step (``collectives.torch.functional.settle``)."""
    import sys
    functional = sys.modules.get("collectives.torch.functional")
    if functional is not None:
        functional.settle()


def run(state, comm=None, min_ranks: int = 1, revoke=None, select=None, replace=False):
    """Decorate ``train(state, comm)`` (see the module doc); ``revoke()``: more communicators
    to revoke with ``comm`` on a failure (a Mesh's); ``select(comm)``: the communicator of the
    survivors that go on, ``None`` on one that leaves; ``replace``: start replacements (True:
    this command line; or the argument list to run)."""
    if isinstance(min_ranks, bool) or not isinstance(min_ranks, int) or min_ranks < 1:
        raise ValueError(f"min_ranks must be a positive integer, got {min_ranks!r}")
    if select is not None and replace:
        raise ValueError("select and replace exclude each other: survivors that leave are "
                         "not replaced")
    if replace and not (replace is True or (isinstance(replace, (list, tuple)) and replace
                                             and all(isinstance(a, str) for a in replace))):
        raise ValueError(f"replace must be True or a non-empty list of strings (the command "
                         f"line), got {replace!r}")

    def decorate(fn):
        @functools.wraps(fn)
        def train():
            return _Loop(state, comm, min_ranks, revoke, select, replace).run(fn)
        return train
    return decorate


class _Loop:
    def __init__(self, state, comm, min_ranks, revoke, select, replace):
        from mpi4py import MPI
        self.state = state
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.min_ranks = min_ranks
        self.revoke, self.select = revoke, select
        self.argv = (list(replace) if isinstance(replace, (list, tuple))
                     else replacing.command() if replace else None)
        self.names: list = []
        self.next_name = MPI.COMM_WORLD.Get_size()
        self.spawned = False     # a spawn connected this process to others (replace)

    def run(self, fn):
        state, comm = self.state, self.comm
        ft = fault_tolerant(comm)
        state.comm = comm
        if not state.commits:
            state.keep(state.snapshot(state.step))
        merged = replacing.join() if self.argv is not None else None
        if merged is not None:
            comm = self.arrive(merged)
        else:   # a process the launcher started: names are COMM_WORLD ranks (no communication)
            from mpi4py import MPI
            here, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
            self.names = list(MPI.Group.Translate_ranks(here, list(range(comm.Get_size())),
                                                        world))
            here.Free()
            world.Free()
        while True:
            try:
                return fn(state, comm)
            except Exception as exc:  # noqa: BLE001 - only a process failure is handled
                if not ft or not process_failure(exc, comm):
                    raise
            comm = self.recover(comm)
            if comm is None:    # this rank left (select)
                backend = torch_backend()
                if backend is not None:
                    backend.rebuild(state.comm, None)
                return None

    def recover(self, comm):
        from mpi4py import MPI
        state = self.state
        t0 = time.monotonic()
        failed_step, lost, size0 = state.step, [], comm.Get_size()
        names, made = self.names, []
        if self.spawned:    # a process a spawn connected died: see collectives.elastic.replace
            replacing.end_without_finalize()
        while True:
            others = list(self.revoke()) if self.revoke is not None else []
            backend = torch_backend()
            if backend is not None:     # torch's groups on the toolkit's backend
                others += backend.communicators()
            for value in state.extra.values():      # an averager's levels
                if callable(getattr(value, "communicators", None)):
                    others += value.communicators()
            new, gone = shrink(comm, others + made)
            _settle()
            lost += [names[r] for r in gone]
            names = [n for r, n in enumerate(names) if r not in gone]
            try:
                low = new.allreduce(state.committed, op=MPI.MIN)
                high = new.allreduce(state.committed, op=MPI.MAX)
                go, everyone, left, joined = new, new, [], []
                if self.select is not None:
                    go = self.select(new)
                    on = new.allgather(go is not None)
                    left = [n for n, keep in zip(names, on) if not keep]
                    going = [n for n, keep in zip(names, on) if keep]
                else:
                    going = names
                if len(going) < self.min_ranks and not (self.argv and going):
                    raise RanksLost(
                        f"ranks {sorted(lost)} failed: {len(going)} left to go on, fewer than "
                        f"min_ranks={self.min_ranks}")
                if self.argv is not None and size0 > new.Get_size():
                    go = everyone = replacing.spawn(new, size0 - new.Get_size(), self.argv)
                    made.append(go)
                    self.spawned = True
                    joined = list(range(self.next_name, self.next_name + size0 -
                                        new.Get_size()))
                    going = names + joined
                    info = {"names": going, "next_name": self.next_name + len(joined),
                            "failed_step": failed_step, "restored": low, "steps_lost":
                            high - low, "lost": sorted(lost), "joined": joined,
                            "recoveries": [r.as_dict() for r in state.recoveries],
                            "no_finalize": replacing.ends_without_finalize()}
                    go.bcast(info if go.Get_rank() == 0 else None, root=0)
                if go is not None:
                    state.rebuild(go)
                    if joined:   # the commit from a live peer, to the replacements
                        go.bcast(state.find(low) if go.Get_rank() == 0 else None, root=0)
                    state.restore(low)
                t1 = time.monotonic()
                times = everyone.allgather((t1 - t0, t1 - state.committed_at))
                seconds, since = max(t[0] for t in times), max(t[1] for t in times)
                break
            except RanksLost:
                raise
            except Exception as exc:  # noqa: BLE001
                if not process_failure(exc, new):
                    raise
                comm = new
        self.names, self.next_name = going, self.next_name + len(joined)
        state.recoveries.append(Recovery(sorted(lost), len(going), failed_step, low,
                                         high - low, seconds, since, left, joined))
        return go

    def arrive(self, merged):
        """A replacement's side of ``recover``: the names and the step, the rebuild, the
        commit from rank 0, the times; the merged communicator to train on."""
        state = self.state
        t0 = time.monotonic()
        info = merged.bcast(None, root=0)
        self.spawned = True
        if info["no_finalize"]:
            replacing.end_without_finalize()
        self.names, self.next_name = info["names"], info["next_name"]
        replacing.set_name(self.names[merged.Get_rank()])
        state.recoveries[:] = [Recovery(**d) for d in info["recoveries"]]
        state.rebuild(merged)
        commit = merged.bcast(None, root=0)
        state.keep(commit)
        state.restore(commit.next_step)
        t1 = time.monotonic()
        times = merged.allgather((t1 - t0, t1 - t0))
        state.recoveries.append(Recovery(
            info["lost"], len(self.names), info["failed_step"], info["restored"],
            info["steps_lost"], max(t[0] for t in times), max(t[1] for t in times),
            (), info["joined"]))
        return merged
