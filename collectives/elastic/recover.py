"""After a process failure under ULFM: revoke, shrink, and name the ranks that are gone.

1. *Revoke* the communicator and every one the toolkit derived from it (its private ``Dup``,
   the node and cross communicators: ``collectives.topology.derived``) and those the caller
   names (a Mesh's): a survivor blocked on a live peer that itself saw the failure is
   interrupted with ``ERR_REVOKED`` instead of waiting for ever.
2. *Shrink* it: ULFM's shrink is an agreement among the survivors on who failed (a failure during
   the shrink is absorbed by it), and returns a communicator of the survivors, in their old
   order.
3. *Forget* the revoked communicators' caches (``collectives.topology.forget``, each of them:
   the watchdog then stops asking on their side channels, whose every use would fail): the
   next collective on the shrunk one makes a fresh private ``Dup`` and learns its topology
   again.
   Revoked communicators are never freed: Open MPI 5 crashes when a revoke notice from another
   rank reaches a communicator that is gone.
"""
from __future__ import annotations

__all__ = ["shrink"]

_REVOKED: list = []


def _revoke(c) -> None:
    from mpi4py import MPI
    try:
        c.Revoke()
    except MPI.Exception:  # already revoked, or freed by its owner
        pass
    _REVOKED.append(c)


def shrink(comm, others=()) -> tuple:
    """Revoke ``comm`` (and what was built on it, and ``others``), shrink it to the survivors:
    ``(shrunk, lost)``, ``lost`` the failed ranks as ranks of ``comm``."""
    from mpi4py import MPI
    from .. import topology
    for c in [comm, *others]:
        for d in [c, *topology.derived(c)]:
            _revoke(d)
    new = comm.Shrink()
    kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())),
                                     comm.Get_group())
    lost = sorted(set(range(comm.Get_size())) - set(kept))
    for c in [comm, *others]:
        topology.forget(c)
    return new, lost
