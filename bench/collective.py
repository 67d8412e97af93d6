"""What a benchmark knows about a collective (nccl-tests' ``testColl``): element counts per
size, exact rank-dependent data and the result it must give, and the bus-bandwidth factor.

A collective module (``bench/allreduce.py``, ...) is a small ``Collective`` subclass: how many
elements go in and out for a size, how to call it (out of place / in place, ours / gloo) and what
the exact result is. The *size* column is the per-rank buffer for allreduce, reduce and
broadcast, the whole buffer for reduce-scatter, all-gather, gather and scatter (the root's), and
the per-rank send buffer for all-to-all, as nccl-tests prints it; ``busbw = algbw x factor``
with factor 2(n-1)/n for allreduce, (n-1)/n for reduce-scatter, all-gather, all-to-all, gather
and scatter, 1 otherwise.
"""
from __future__ import annotations

import numpy as np

try:
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, so -d bfloat16 works
except ImportError:  # pragma: no cover - a dependency of the toolkit
    pass

__all__ = ["Collective", "BUSBW", "busbw_factor", "rank_data", "expected_reduce", "AVG_BOUND"]

BUSBW = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "alltoall": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
}


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor."""
    try:
        return BUSBW[collective](n)
    except KeyError:
        raise ValueError(f"unknown collective {collective!r}; expected one of "
                         f"{', '.join(BUSBW)}") from None


def rank_data(rank: int, count: int, dtype, op: str | None = "sum") -> np.ndarray:
    """Exact rank-dependent values for which every reduction order gives the same result: small
    integers (sums), 1 or 2 (products), bits (bitwise ops, bool)."""
    dtype = np.dtype(dtype)
    i = np.arange(count, dtype=np.int64)
    if dtype.kind == "b":
        return (i + rank) % 3 == 0
    if op == "prod":
        vals = 1 + (i + rank) % 2
    elif op in ("band", "bor", "bxor"):
        vals = (i * 7 + rank * 13) % 64
    elif op in ("min", "max"):
        vals = (i * 7 + rank * 3) % 11
    else:
        vals = (i + 3 * rank) % 5
    return vals.astype(dtype)


AVG_BOUND = "avg bound"  # expected_reduce's op for how far an avg may lie from the exact mean


def expected_reduce(n: int, count: int, dtype, op: str) -> np.ndarray:
    """The reduction of ``rank_data`` over ``n`` ranks, exactly: in the dtype for every op but
    ``avg``, whose result is the float64 mean (the toolkit divides each input by n, then sums in
    its algorithm's order, so an avg is checked within ``AVG_BOUND``: (n + 1) roundings of
    terms of the inputs' mean magnitude, in the dtype's unit roundoff)."""
    if op in ("avg", AVG_BOUND):
        data = np.stack([rank_data(r, count, dtype, "avg").astype(np.float64)
                         for r in range(n)])
        if op == "avg":
            return data.mean(0)
        k = (n + 1) * float(np.finfo(dtype).eps) / 2
        return k / (1 - k) * np.abs(data).mean(0)
    from collectives.ops import resolve
    opr = resolve(op, dtype)
    acc = rank_data(0, count, dtype, op)
    for r in range(1, n):
        opr.reduce(acc, acc, rank_data(r, count, dtype, op))
    return acc


class Collective:
    """What a benchmark module says about its collective (see the module doc)."""

    name = ""
    has_op = True
    rooted = False
    modes = ("out", "in")

    def counts(self, count: int, n: int) -> tuple[int, int, int]:
        """``(input elements, output elements, elements of the size column)`` for a size
        column of ``count`` elements on ``n`` ranks."""
        return count, count, count

    def call(self, coll, x, out, mode, algorithm, op, root, comm):
        """A zero-argument callable running one collective on preallocated buffers."""
        raise NotImplementedError

    def expected(self, rank, n, x_count, dtype, op, root):
        """The exact output on ``rank`` (None: nothing to check there)."""
        raise NotImplementedError

    def gloo(self, dist, tx, tout, mode, op, root):
        """A callable running torch.distributed's collective, or None if gloo has none."""
        return None

    def auto_bytes(self, x_count: int, n: int) -> int:
        """The elements ``auto`` sizes a call by, for ``x_count`` input elements per rank."""
        return x_count

    def result(self, x, out, mode):
        """The array holding the result after a call."""
        return x if mode == "in" else out
