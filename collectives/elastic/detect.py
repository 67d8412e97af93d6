"""Which path a job's MPI library supports, and which errors mean "a process of the job died".

``fault_tolerant(comm)`` answers by behaviour, once per process, collectively over ``comm``:

1. a private one-rank communicator (a ``Dup`` of ``COMM_SELF``: no other rank is involved, so
   no revoke notice travels) is revoked and then used in a barrier. Under ULFM (Open MPI 5)
   the barrier fails with ``ERR_REVOKED``. Without it the revoke is refused
   (mpi4py raises ``NotImplementedError`` where the library has no ``MPIX_Comm_revoke``) or has
   no effect (the barrier succeeds). MPICH's mpi4py still has ``Comm.Shrink`` and ``Comm.Agree``
   (as a plain duplicate and an allreduce), so their presence proves nothing;
2. the launcher must keep the job running when a process dies: Open MPI's ``mpirun`` does so
   only with ``--with-ft ulfm``, which sets ``OMPI_MCA_mpi_ft_enable`` in every rank (without it
   the revoke of step 1 works but a dead process ends the whole job);
3. the ranks agree (an allreduce of the verdicts): one answer for the job.

``process_failure(exc, comm)`` is true for ``ERR_PROC_FAILED``, ``ERR_PROC_FAILED_PENDING`` and
``ERR_REVOKED`` (a survivor that revoked a communicator tells the others so), also when the MPI
error is the cause of another error, or its text is (torch's ``Future`` passes on an error raised
in a callback as a ``RuntimeError`` with its message only). ``ERR_IN_STATUS`` counts too where
``comm`` knows a failed process (``Comm.Get_failed``): a test or wait on several requests
reports a dead peer's request that way, its own class hidden in a status the caller may not
keep (``collectives.p2p``'s; the executor raises the class its status holds, and under ULFM
tests one request at a time).
"""
from __future__ import annotations

from ..progress import ulfm_launched

__all__ = ["fault_tolerant", "process_failure", "failure_classes"]

_VERDICT: dict = {}
_KEPT: list = []


def failure_classes() -> tuple[int, ...]:
    """The MPI error classes that mean a process of the communicator failed."""
    from mpi4py import MPI
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    return tuple(getattr(MPI, n) for n in names if getattr(MPI, n, None) is not None)


def _knows_failed(comm) -> bool:
    """Whether ``comm`` has a process this one knows to have failed (local)."""
    try:
        group = comm.Get_failed()
    except (NotImplementedError, Exception):  # noqa: BLE001 - no ULFM: no such knowledge
        return False
    try:
        return group.Get_size() > 0
    finally:
        group.Free()


def process_failure(exc: BaseException | None, comm=None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is MPI reporting a failed process
    (of ``comm``, for an error in a status: see the module doc)."""
    import sys
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    classes = failure_classes()
    if comm is not None and getattr(mpi, "ERR_IN_STATUS", None) is not None:
        in_status = mpi.ERR_IN_STATUS
    else:
        in_status = None
    # torch's Future carries an error raised in a callback over as a RuntimeError holding only
    # its text: MPI's own string for the class is what is left of it.
    texts = [mpi.Get_error_string(c).split(":")[0] for c in classes]
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, mpi.Exception):
            if exc.Get_error_class() in classes:
                return True
            if exc.Get_error_class() == in_status and _knows_failed(comm):
                return True
        elif any(t and t in str(exc) for t in texts):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _revoke_interrupts() -> bool:
    """Revoke a private one-rank communicator and use it: ``ERR_REVOKED`` under ULFM."""
    from mpi4py import MPI
    own = MPI.COMM_SELF.Dup()
    _KEPT.append(own)  # never freed: a revoked communicator stays revoked
    try:
        own.Revoke()
    except (NotImplementedError, MPI.Exception):
        return False
    try:
        own.Barrier()
    except MPI.Exception as exc:
        return exc.Get_error_class() == getattr(MPI, "ERR_REVOKED", None)
    return False


def fault_tolerant(comm=None) -> bool:
    """Whether the job can survive a dead process (ULFM, launched to keep going): collective
    over ``comm`` (default ``COMM_WORLD``) on first use, then cached."""
    from mpi4py import MPI
    if "ulfm" in _VERDICT:
        return _VERDICT["ulfm"]
    comm = MPI.COMM_WORLD if comm is None else comm
    mine = 1 if (_revoke_interrupts() and ulfm_launched()) else 0
    _VERDICT["ulfm"] = bool(comm.allreduce(mine, op=MPI.MIN))
    return _VERDICT["ulfm"]
