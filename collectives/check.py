"""Cross-rank argument validation (``COLLECTIVES_CHECK=1``, or ``check=True`` per call).

Before the collective, every rank reduces a fingerprint of its call (collective, element count,
dtype, op, root, algorithm, counts, sequence number, and whether its own argument checks
failed) with one small ``MPI_Allreduce`` of the field-wise maximum of ``(code, -code)``: the
fingerprints agree exactly when every field's maximum equals its minimum. Only when they do not
(the error path) is the readable form of each rank's call gathered, so every rank raises the
same ``MismatchError`` naming the fields and which ranks passed what::

    allreduce #0: arguments differ across ranks: rank 0 passed 10 elements, ranks 1 and 2
    passed 20 elements

A rank whose *own* checks failed (``out`` of the wrong shape on that rank only, say) joins the
exchange with its error instead of leaving the others waiting (``failed``): the others raise
``MismatchError`` naming that rank and its error; if every rank failed, each raises its own
error as it would without checking. With checking off nothing is exchanged: the cost is one
settings lookup per call.
"""
from __future__ import annotations

import zlib

import numpy as np

from . import config
from .errors import MismatchError

__all__ = ["enabled", "verify", "failed", "settle", "same", "FIELDS"]

FIELDS = ("collective", "elements", "dtype", "op", "root", "algorithm", "counts", "sequence")
_VERB = {"collective": "called", "algorithm": "chose", "sequence": "are at"}


def enabled(check=None) -> bool:
    """Per-call ``check`` wins; else ``COLLECTIVES_CHECK``."""
    return config.current.COLLECTIVES_CHECK if check is None else bool(check)


def _code(field: str, value) -> int:
    """A rank-independent integer for one field's value (crc32 of text: stable everywhere)."""
    if value is None:
        return -1
    if field == "counts":
        return zlib.crc32(np.asarray(value, np.int64).tobytes())
    if isinstance(value, (int, np.integer)):
        return int(value)
    return zlib.crc32(str(value).encode())


def _readable(field: str, value) -> str:
    if value is None:
        return f"no {field}"
    if field == "elements":
        return f"{value} elements"
    if field == "counts":
        value = list(value)
        shown = ", ".join(map(str, value[:8])) + (", ..." if len(value) > 8 else "")
        return f"counts [{shown}]"
    if field in ("op", "root", "algorithm"):
        return f"{field} {value}"
    if field == "sequence":
        return f"call #{value}"
    return str(value)


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def same(comm, codes) -> bool:
    """Whether every rank of ``comm`` passed the same integer ``codes`` (as many on every
    rank): one ``MPI_Allreduce`` of the element-wise maximum of ``(codes, -codes)``."""
    from mpi4py import MPI
    codes = np.asarray(codes, dtype=np.int64)
    both = np.concatenate([codes, -codes])
    comm.Allreduce(MPI.IN_PLACE, [both, MPI.INT64_T], MPI.MAX)
    return bool((both[:codes.size] == -both[codes.size:]).all())


def verify(comm, *, error: BaseException | None = None, **fields) -> None:
    """Compare this call's ``fields`` across ``comm``; raise on every rank if any differ.

    ``error``: this rank's own argument checks failed with it (see ``failed``).
    """
    codes = [_code(k, fields.get(k)) for k in FIELDS]
    agreed = same(comm, codes + [0 if error is None else 1])  # every rank takes part
    if agreed and error is None:
        return
    settle(comm, fields.get("collective", "collective"), error, fields)


def settle(comm, collective: str, error: BaseException | None, fields=None) -> None:
    """Every rank knows that something differs: gather the details and raise everywhere.

    Collective (every rank of ``comm`` must call it); it only runs on the error path, so it may
    pickle. Raises ``MismatchError`` (the same text on every rank), or, if every rank's own
    checks failed, each rank's own ``error``.
    """
    fields = fields or {}
    mine = ({k: fields.get(k) for k in FIELDS},
            None if error is None else f"{type(error).__name__}: {error}")
    rows = comm.allgather(mine)
    # Name the call the same way on every rank: the collective most ranks called.
    called = [r[0]["collective"] or collective for r in rows]
    collective = max(called, key=lambda c: (called.count(c), -called.index(c)))
    seq = next((r[0]["sequence"] for r in rows if r[0].get("sequence") is not None), None)
    where = collective if seq is None else f"{collective} #{seq}"
    errors = [(rank, text) for rank, (_, text) in enumerate(rows) if text is not None]
    if errors:
        if len(errors) == len(rows) and error is not None:
            raise error
        fine = [rank for rank, (_, text) in enumerate(rows) if text is None]
        told = errors[0][1] if len(errors) == 1 else \
            "; ".join(f"{_ranks([rank])}: {text}" for rank, text in errors)
        err = MismatchError(f"{where}: {_ranks(r for r, _ in errors)} failed "
                            f"{'its' if len(errors) == 1 else 'their'} own argument checks "
                            f"({told}); {_ranks(fine)} passed "
                            f"{'its' if len(fine) == 1 else 'theirs'}")
        err.__cause__ = error
        raise err
    problems = []
    for field in FIELDS:
        groups: dict[str, list[int]] = {}
        for rank, (values, _) in enumerate(rows):
            groups.setdefault(_readable(field, values.get(field)), []).append(rank)
        if len(groups) < 2:
            continue
        # The minority first: it is most likely the rank that went wrong.
        parts = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
        verb = _VERB.get(field, "passed")
        problems.append(", ".join(f"{_ranks(r)} {verb} {text}" for text, r in parts))
    raise MismatchError(f"{where}: arguments differ across ranks: " + "; ".join(problems))


def failed(ctx, collective: str, check, error: BaseException) -> BaseException:
    """This rank's own argument checks raised ``error``: the exception to raise.

    With checking off, ``error`` itself. With checking on, this rank takes the sequence number
    the call would have taken and joins the fingerprint exchange with its error, so the other
    ranks raise ``MismatchError`` instead of waiting; returns the ``MismatchError`` (or
    ``error`` if every rank failed).
    """
    if not enabled(check):
        return error
    seq = ctx.next_seq()
    try:
        verify(ctx.comm, error=error, collective=collective, sequence=seq)
    except MismatchError as exc:
        return exc
    except BaseException as exc:  # noqa: BLE001 - every rank failed: its own error
        return exc
    return error  # unreachable: verify always raises when error is set
