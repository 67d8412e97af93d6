"""Replacement ranks under ULFM: the survivors of a failure start new processes and merge them
into their communicator, which is back to its size before the failure.

Vocabulary: a process's *name* is what ``Recovery`` records and ``FailureInjector`` kills: its
``COMM_WORLD`` rank for a process the launcher started, ``W + k`` for the ``k``-th replacement
of the job (``W`` the launcher's ``COMM_WORLD`` size). A replacement's own ``COMM_WORLD`` holds
itself alone, so names, not ``COMM_WORLD`` ranks, say who is who after a replacement.

1. ``spawn(comm, count, argv)`` (the survivors, collective over their shrunk communicator):
   ``MPI_Comm_spawn`` of ``count`` processes running ``argv`` (rank 0 of ``comm`` starts them),
   then ``MPI_Intercomm_merge`` with the survivors first: the merged communicator keeps the
   survivors' ranks and puts the replacements after them.
2. ``join()`` (a replacement, at the start of ``elastic.run``): its parent intercommunicator
   (``MPI_Comm_get_parent``) merged from the other side, or ``None`` in a process the launcher
   started.
3. What goes over the merged communicator then (``collectives.elastic.loop``): the names and the
   step to go on from, the rebuild of the model on it, and the committed state, broadcast from
   rank 0 (a survivor): a replacement receives it from a live peer, never from disk.

The intercommunicators are kept: ``MPI_Comm_disconnect`` waits for every process on both sides,
which a dead one never joins. ``MPI_Finalize`` does the same for every communicator that joins
processes of several launches (Open MPI's ``ompi_dpm_dyn_finalize``): once a process of such a
communicator has died, the survivors would wait there for ever (and freeing those communicators
first crashes it). So once a failure is recovered among processes that a spawn connected, every
process of the job ends without ``MPI_Finalize`` (``end_without_finalize``: the first of its
exit handlers flushes the output and calls ``os._exit(0)``; the others, registered before it,
are skipped); the survivors tell the replacements of that recovery to do the same. ``mpirun``
then exits 1 and says that processes exited without calling "finalize" ("exiting improperly", or
"LAUNCHER JOB OBJECT NOT FOUND" for the spawned ones) though every rank finished. A job whose
replacements never see another failure finalizes as usual.
"""
from __future__ import annotations

import sys

__all__ = ["name", "set_name", "spawn", "join", "command", "end_without_finalize",
           "ends_without_finalize"]

_NAME: list = []       # this process's name, once known
_INTER: list = []      # intercommunicators made here (kept: see the module doc)
_NO_FINALIZE: list = []


def _leave() -> None:
    import os
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def end_without_finalize() -> None:
    """End this process without ``MPI_Finalize`` (see the module doc); once."""
    if not _NO_FINALIZE:
        import atexit
        _NO_FINALIZE.append(True)
        atexit.register(_leave)


def ends_without_finalize() -> bool:
    """Whether ``end_without_finalize`` was asked for."""
    return bool(_NO_FINALIZE)


def name() -> int:
    """This process's name in the job (see the module doc)."""
    if not _NAME:
        from mpi4py import MPI
        _NAME.append(MPI.COMM_WORLD.Get_rank())
    return _NAME[0]


def command() -> list[str]:
    """The command line a replacement runs by default: this interpreter and this script's
    arguments (``sys.argv``)."""
    return [sys.executable, *sys.argv]


def spawn(comm, count: int, argv) -> object:
    """Start ``count`` processes running ``argv`` and merge them after ``comm``'s ranks
    (collective over ``comm``); the merged communicator."""
    from mpi4py import MPI
    if count < 1:
        raise ValueError(f"spawn: expected at least 1 process, got {count}")
    inter = comm.Spawn(argv[0], args=list(argv[1:]), maxprocs=count, root=0)
    _INTER.append(inter)
    merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


def join():
    """In a replacement: the communicator merged with the survivors that started it (they
    come first); ``None`` in a process the launcher started."""
    from mpi4py import MPI
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    _INTER.append(parent)
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


def set_name(value: int) -> None:
    """Name this process (a replacement, told by the survivors)."""
    _NAME[:] = [value]
