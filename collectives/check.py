"""Cross-rank argument validation (``COLLECTIVES_CHECK=1``, or ``check=True`` per call).

Before the collective, every rank contributes a fingerprint of its call (collective, element
count, dtype, op, root, algorithm, counts, sequence number) to one small ``Allgather``; if any
field differs, every rank raises the same ``MismatchError`` naming the field and which ranks
passed what ("rank 1 passed 12 elements, ranks 0 and 2 passed 10"). With checking off nothing
is exchanged: the cost is one environment lookup per call.
"""
from __future__ import annotations

import os
import zlib

import numpy as np

from .errors import MismatchError

__all__ = ["enabled", "verify", "FIELDS"]

FIELDS = ("collective", "elements", "dtype", "op", "root", "algorithm", "counts", "sequence")
_NAMES: dict[int, str] = {}


def enabled(check=None) -> bool:
    """Per-call ``check`` wins; else ``COLLECTIVES_CHECK``."""
    if check is not None:
        return bool(check)
    return os.environ.get("COLLECTIVES_CHECK", "0") not in ("0", "", "false", "no")


def _code(value) -> int:
    if value is None:
        return -1
    if isinstance(value, (int, np.integer)):
        return int(value)
    text = str(value)
    code = zlib.crc32(text.encode()) & 0x7FFFFFFF
    _NAMES[code] = text
    return code


def _show(field: str, code: int) -> str:
    if field == "elements":
        return f"{code} elements"
    if field == "counts":
        return f"counts #{code:08x}"
    if code == -1:
        return f"no {field}"
    if field in ("root", "sequence"):
        return f"{field} {code}"
    return f"{field} {_NAMES.get(code, f'#{code:08x}')}"


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def verify(comm, **fields) -> None:
    """Compare this call's fields across ``comm``; ``MismatchError`` on every rank if any differ."""
    from mpi4py import MPI
    values = {k: fields.get(k) for k in FIELDS}
    if values["counts"] is not None:
        values["counts"] = zlib.crc32(np.asarray(values["counts"], np.int64).tobytes()) \
            & 0x7FFFFFFF
    mine = np.array([_code(values[k]) for k in FIELDS], dtype=np.int64)
    table = np.empty((comm.Get_size(), len(FIELDS)), dtype=np.int64)
    comm.Allgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
    problems = []
    for j, field in enumerate(FIELDS):
        column = table[:, j]
        if (column == column[0]).all():
            continue
        groups: dict[int, list[int]] = {}
        for rank, code in enumerate(column.tolist()):
            groups.setdefault(code, []).append(rank)
        # The minority first: it is most likely the rank that went wrong.
        parts = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
        verb = "passed" if field in ("elements", "dtype", "op", "root", "counts") else "called"
        problems.append(", ".join(f"{_ranks(r)} {verb} {_show(field, c)}" for c, r in parts))
    if problems:
        what = fields.get("collective", "collective")
        raise MismatchError(f"{what}: arguments differ across ranks: " + "; ".join(problems))
