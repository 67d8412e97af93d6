"""Calls worked out once: a small blocking call repeated on the same arrays.

Calls repeat with the same arrays (a training loop's scalars and flags, a pipeline's headers,
a model-parallel layer's activations). Checking, wrapping and choosing cost several
microseconds of Python, most of a small call's time, so what a blocking call on numpy arrays
worked out is kept per (collective, its arrays, op, root, counts, communicator, algorithm),
holding the arrays and the communicator so that their ids stay theirs. A call whose arrays
hold more than KEEP_BYTES is not kept (there the Python is a few percent of the call), and
what the kept calls hold is bounded: at most KEPT_CALLS calls and KEPT_BYTES of arrays, the
oldest let go first. A hit checks what can change on the same objects: x's dtype, out's
write flag, the tuning table.
Only calls whose shapes are fixed by their arguments are kept: not those that learn counts
from the other ranks (ragged gathers without ``counts``, scatter's header), nor an algorithm
chosen for these buffers by agreement (``Algorithm.agree``), nor a call that returns an array
it allocated.
"""
from __future__ import annotations

import numpy as np

from . import config, native, select
from .dispatch import again, nothing_to_move, start

__all__ = ["KEEP_BYTES", "KEPT_CALLS", "KEPT_BYTES", "CALLS", "MISS", "NONE", "Kept", "repeat",
           "small", "keep", "forget"]

KEEP_BYTES = 4 << 20    # x and out of one call, at most
KEPT_CALLS = 64
KEPT_BYTES = 64 << 20   # of every kept call's arrays together
CALLS: dict = {}        # key -> Kept, oldest first
_HELD = [0]             # bytes of arrays the kept calls hold


class Kept:
    """A small blocking call, worked out: its Call (done with when the call returns),
    algorithm, finalizer, result, and the MPI call bound to its buffers (``native.bind``)."""

    __slots__ = ("held", "nbytes", "dtype", "tuning", "call", "algo", "finalize", "bound",
                 "result", "algorithm")


MISS = object()
NONE = type(None)


def repeat(key, x, out, check):
    """The result of the call ``key`` names if an earlier one was kept (``MISS`` otherwise).
    Only calls that ``small`` allows are kept, so a caller may look its key up before asking
    ``small``: a hit was allowed when it was kept, and holds the same arrays."""
    try:
        hit = CALLS.get(key)
    except TypeError:  # a key holding a list: never kept
        return MISS
    # what can change on the same objects: x's dtype, out's write flag, the tuning table
    if hit is None or x.dtype is not hit.dtype or (out is not None and not out.flags.writeable) \
            or hit.tuning is not config.get("COLLECTIVES_TUNING"):
        return MISS
    if hit.bound is not None:
        return again(hit.call, hit.bound, check, hit.result, hit.finalize)
    return start(hit.call, hit.algorithm, check, hit.result, hit.finalize, hit.algo)


def small(x, out, op, algorithm) -> bool:
    """Whether a call may be kept: numpy arrays of at most KEEP_BYTES together, plain names
    for op and algorithm (what a key holds)."""
    return type(x) is np.ndarray and type(algorithm) is str and (op is None or type(op) is str) \
        and (out is None or type(out) is np.ndarray) and \
        x.nbytes + (0 if out is None or out is x else out.nbytes) <= KEEP_BYTES


def keep(key, x, out, comm, call, result, finalize) -> None:
    """Remember a blocking call that succeeded, if it may be repeated from its record."""
    if key is None or call.algo is None or call.algo.agree is not None or \
            not (result is None or result is out or result is x) or \
            not (out is None or type(out) is np.ndarray):
        return
    ctx = call.ctx
    checked = object.__new__(Kept)
    checked.held, checked.dtype = (x, out, comm), call.x.dtype
    checked.tuning, checked.call, checked.finalize = config.get("COLLECTIVES_TUNING"), call, \
        finalize
    checked.result, checked.algorithm = result, key[-1]
    checked.algo = algo = call.algo
    # MPI's own on more than one rank: the call bound to its buffers once
    checked.bound = native.bind(call) if algo.kind is select.NATIVE and ctx.size > 1 and \
        not nothing_to_move(call) and not call.x.is_device else None
    checked.nbytes = x.nbytes + (0 if out is None or out is x else out.nbytes)
    old = CALLS.pop(key, None)
    if old is not None:
        _HELD[0] -= old.nbytes
    while CALLS and (len(CALLS) >= KEPT_CALLS or _HELD[0] + checked.nbytes > KEPT_BYTES):
        _HELD[0] -= CALLS.pop(next(iter(CALLS))).nbytes  # the oldest first
    CALLS[key] = checked
    _HELD[0] += checked.nbytes


def forget() -> None:
    """Let go of every kept call (and of the arrays it holds)."""
    CALLS.clear()
    _HELD[0] = 0


