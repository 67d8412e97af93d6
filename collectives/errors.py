"""Error types raised by the toolkit."""
from __future__ import annotations

import os

__all__ = ["CollectiveError", "MismatchError", "MessageSizeError", "CollectiveTimeout",
           "network_error", "getenv", "OFF_WORDS"]

_ENVIRON = getattr(os.environ, "_data", None)  # CPython's own store: bytes keys on POSIX


# The raw value of an environment variable by its bytes name (a bound dict.get, ~40 ns): for
# keys of memos that must follow the variable, on the hottest paths.
env_raw = _ENVIRON.get if _ENVIRON is not None and os.name == "posix" else \
    (lambda key: os.environ.get(key.decode()))


# The values of an on/off environment variable that turn it off (after .strip().lower()).
OFF_WORDS = ("0", "false", "no", "off")


def getenv(name: str, key: bytes | None = None) -> str | None:
    """``os.environ.get(name)`` in ~0.1 us (it is read on every collective call)."""
    if _ENVIRON is not None and os.name == "posix":
        value = _ENVIRON.get(key or name.encode())
        return None if value is None else value.decode()
    return os.environ.get(name)


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
    if mpi is None or not isinstance(exc, mpi.Exception) or exc.Get_error_class() not in (
            mpi.ERR_TRUNCATE, mpi.ERR_IN_STATUS):
        return exc
    said = "message truncated" if exc.Get_error_class() == mpi.ERR_TRUNCATE else \
        "an error in a message's status, most likely a truncation"
    err = MessageSizeError(
        f"{where}: a message from another rank was longer than this rank expected (MPI: "
        f"{said}); do all ranks pass the same length and dtype? COLLECTIVES_CHECK=1 names the "
        f"ranks that differ")
    err.__cause__ = exc
    return err
