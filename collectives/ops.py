"""Reduction operations: names, the dtypes each accepts, and in-place element-wise kernels.

An ``Op`` is resolved once per call from a name ("sum", "prod", "min", "max", "avg", "band",
"bor", "bxor") or the matching ``mpi4py.MPI.Op``, and checked against the buffer's dtype: a
meaningless pair (bxor on floats, min on complex, avg on integers) is a ``TypeError`` raised
identically on every rank.

``avg`` is computed once, in the core (``collectives.dispatch.mean_first``), as NCCL's
``ncclAvg`` does for floating types: every rank divides its input by the rank count
(``mean_first``), then the quotients are summed. Every partial sum of n quotients is at most
the largest input in magnitude, so a mean that the dtype can represent never overflows, in
float16 and bfloat16 too (a sum first would: two ranks holding 40000 in float16 sum to inf).
The division is correctly rounded (numpy computes 16-bit floats in float32 and rounds once), and
every rank sums the same quotients in the algorithm's fixed order: the same bits everywhere.

The kernels are ufuncs of the array's own module (numpy here; cupy arrays dispatch through
``__array_ufunc__``), always called with ``out=`` so no temporary is allocated.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Op", "resolve", "NAMES", "dtype_kind", "mean_first"]

NAMES = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")

_UFUNCS = {
    "sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}
# On bool, numpy's add and multiply are logical or/and; so are max/min.
_BOOL_UFUNCS = {
    "sum": np.logical_or, "prod": np.logical_and, "min": np.logical_and,
    "max": np.logical_or, "band": np.logical_and, "bor": np.logical_or, "bxor": np.logical_xor,
}
# Which dtype kinds each op accepts: b bool, i/u integers, f floats, c complex.
_ACCEPTS = {
    "sum": "biufc", "prod": "biufc", "min": "biuf", "max": "biuf", "avg": "fc",
    "band": "biu", "bor": "biu", "bxor": "biu",
}


def dtype_kind(dtype) -> str:
    """numpy's kind letter, with ml_dtypes' bfloat16 (kind 'V') counted as a float."""
    dtype = np.dtype(dtype)
    if dtype.kind == "V" and dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return "f"
    return dtype.kind


def _mpi_names():
    from mpi4py import MPI
    return {
        MPI.SUM: "sum", MPI.PROD: "prod", MPI.MIN: "min", MPI.MAX: "max",
        MPI.BAND: "band", MPI.BOR: "bor", MPI.BXOR: "bxor",
        MPI.LAND: "band", MPI.LOR: "bor", MPI.LXOR: "bxor",
    }


class Op:
    """A reduction resolved for one dtype: ``name`` and the kernel ``reduce(dst, a, b)``."""

    __slots__ = ("name", "dtype", "ufunc", "is_avg", "mpi")

    def __init__(self, name: str, dtype):
        self.name = name
        self.dtype = np.dtype(dtype)
        table = _BOOL_UFUNCS if self.dtype.kind == "b" else _UFUNCS
        self.ufunc = table[name]
        self.is_avg = name == "avg"
        self.mpi = None  # (MPI datatype, MPI.Op), filled by collectives.native on first use

    def reduce(self, dst, a, b) -> None:
        """``dst = a op b``, element-wise, without a temporary."""
        self.ufunc(a, b, out=dst)

    def __repr__(self):
        return f"Op({self.name!r}, {self.dtype})"


def mean_first(x, n: int, out) -> None:
    """``out = x / n``, element-wise (``out`` may be ``x``): an input of ``avg`` over ``n``
    ranks, ready to be summed."""
    np.divide(x, n, out=out)


_RESOLVED: dict = {}  # (name, dtype) -> Op: the per-call lookup of the common case


def resolve(op, dtype) -> Op:
    """The ``Op`` for ``op`` (a name or an ``MPI.Op``) on ``dtype``, or a clear error."""
    if type(op) is str:
        hit = _RESOLVED.get((op, dtype))
        if hit is not None:
            return hit
        result = _resolve(op, dtype)
        if len(_RESOLVED) < 1024:
            _RESOLVED[(op, dtype)] = result
        return result
    return _resolve(op, dtype)


def _resolve(op, dtype) -> Op:
    if isinstance(op, Op):
        op = op.name
    if not isinstance(op, str):
        try:
            name = _mpi_names().get(op)
        except TypeError:  # unhashable
            name = None
        if name is None:
            raise ValueError(f"unsupported reduction op {op!r}; expected one of {NAMES} "
                             f"or the matching MPI.Op")
        op = name
    name = op.lower()
    if name not in _ACCEPTS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {NAMES}")
    kind = dtype_kind(dtype)
    if kind not in _ACCEPTS[name]:
        raise TypeError(f"op {name!r} is not defined for dtype {np.dtype(dtype).name}")
    return Op(name, dtype)
