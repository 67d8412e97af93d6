"""Error types raised by the toolkit."""
from __future__ import annotations

__all__ = ["CollectiveError", "MismatchError", "MessageSizeError", "CollectiveTimeout",
           "network_error"]


class CollectiveError(RuntimeError):
    """A collective failed while running (after argument checks passed)."""


class MismatchError(CollectiveError, ValueError):
    """Ranks called a collective with arguments that do not agree (raised on every rank)."""


class MessageSizeError(CollectiveError):
    """A received message did not have the size the schedule expected."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within ``COLLECTIVES_TIMEOUT`` seconds."""


def network_error(exc: BaseException, where: str) -> BaseException:
    """``exc`` in words when it is MPI's truncation error (a length mismatch across ranks)."""
    import sys
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(exc, mpi.Exception):
        return exc
    kind = exc.Get_error_class()
    # MPICH may also report a truncation inside another class (ERR_OTHER, with the error
    # stack saying "Message truncated"), depending on the protocol the message took.
    if kind not in (mpi.ERR_TRUNCATE, mpi.ERR_IN_STATUS) and "truncat" not in str(exc).lower():
        return exc
    said = "an error in a message's status, most likely a truncation" \
        if kind == mpi.ERR_IN_STATUS else "message truncated"
    err = MessageSizeError(
        f"{where}: a message from another rank was longer than this rank expected (MPI: "
        f"{said}); do all ranks pass the same length and dtype? COLLECTIVES_CHECK=1 names the "
        f"ranks that differ")
    err.__cause__ = exc
    return err
