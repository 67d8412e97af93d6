"""An exception that no code catches, on any rank of a multi-rank job, ends the whole job.

Started as ``mpiexec -n 3 python train.py``, a rank that raises leaves Python through
``MPI_Finalize``, and the other ranks wait in their next collective for a peer that will never
come. ``python -m mpi4py train.py`` avoids that with an abort on an unhandled exception; the
toolkit does the same for every way a job is started: ``import collectives`` installs a
``sys.excepthook`` that prints the traceback as Python would (once, on the rank that raised),
then calls ``MPI.COMM_WORLD.Abort(1)`` when the job has more than one rank, so ``mpiexec``
ends every rank and exits non-zero at once.

``COLLECTIVES_ABORT_ON_EXCEPTION=0`` turns it off, for programs that recover from their own
exceptions (the watchdog still bounds any collective the others are left waiting in). A hook
that the program sets itself replaces this one; one set before ``import collectives`` still
runs, before the abort.
"""
from __future__ import annotations

import os
import sys
import time

from . import config

__all__ = ["install", "job_size"]

_previous = None
# How a launcher tells a rank the job's size before MPI is initialized: MPICH's Hydra and
# Slurm (PMI), Open MPI, PMIx launchers.
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")


def install() -> None:
    """Make an uncaught exception abort the whole job (idempotent)."""
    global _previous
    if sys.excepthook is not _hook:
        _previous = sys.excepthook
        sys.excepthook = _hook


def job_size() -> int:
    """Ranks in this job: ``MPI.COMM_WORLD``'s size once MPI is initialized, else what the
    launcher's environment says (1 outside a launcher)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_size()
    for name in _SIZE_VARIABLES:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 1


def _hook(kind, value, tb) -> None:
    (_previous or sys.__excepthook__)(kind, value, tb)
    try:
        on = config.get("COLLECTIVES_ABORT_ON_EXCEPTION")
    except ValueError:  # a bad value: aborting is the safe reading
        on = True
    size = job_size()
    if not on or size < 2:
        return
    from mpi4py import MPI
    if MPI.Is_finalized():
        return
    # Initializes MPI where the exception came first: the others wait in MPI_Init for this rank.
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        sys.stderr.write(f"[collectives] rank {rank} of {size}: uncaught {kind.__name__}: "
                         f"aborting the job, MPI_Abort(COMM_WORLD, 1) "
                         f"(COLLECTIVES_ABORT_ON_EXCEPTION=0 turns this off)\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
        pass
    time.sleep(0.3)  # let the launcher forward the traceback before it ends the ranks
    MPI.COMM_WORLD.Abort(1)
