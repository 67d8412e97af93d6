"""Calls worked out once: a small blocking call repeated on the same arrays.

Small calls repeat with the same arrays (a training loop's scalars and flags, a pipeline's
headers). Checking, wrapping and choosing are most of a small call's Python, so what a
blocking call on numpy arrays of at most SMALL_BYTES worked out is kept per (collective, its
arrays, op, root, counts, communicator, algorithm), holding the arrays and the communicator
so that their ids stay theirs (small, and at most SMALL_CALLS of them: at most 8 MiB). A hit
checks what can change on the same objects: x's dtype, out's write flag, the tuning table.
Only calls whose shapes are fixed by their arguments are kept: not those that learn counts
from the other ranks (ragged gathers without ``counts``, scatter's header), nor an algorithm
chosen for these buffers by agreement (``Algorithm.agree``), nor a call that returns an array
it allocated.
"""
from __future__ import annotations

import numpy as np

from . import config, native, select
from .dispatch import nothing_to_move, start

__all__ = ["SMALL_BYTES", "SMALL_CALLS", "CALLS", "MISS", "NONE", "Kept", "repeat", "small",
           "keep"]

SMALL_BYTES = 64 << 10
SMALL_CALLS = 64
CALLS: dict = {}


class Kept:
    """A small blocking call, worked out: its Call (done with when the call returns),
    algorithm, finalizer, result, and the MPI call bound to its buffers (``native.bind``)."""

    __slots__ = ("held", "dtype", "tuning", "call", "algo", "finalize", "bound", "result",
                 "algorithm")

    def run(self, x, out, check):
        """The call again, if nothing it depends on changed; else ``MISS``."""
        if x.dtype is not self.dtype or (out is not None and not out.flags.writeable) or \
                self.tuning is not config.get("COLLECTIVES_TUNING"):
            return MISS
        return start(self.call, self.algorithm, check, self.result, self.finalize, self.algo,
                     self.bound)


MISS = object()
NONE = type(None)


def repeat(key, x, out, check):
    """The result of the call ``key`` names if an earlier one was kept (``MISS`` otherwise);
    ``key`` None: a call that is never kept."""
    if key is None:
        return MISS
    hit = CALLS.get(key)
    return MISS if hit is None else hit.run(x, out, check)


def small(x, out, op, algorithm) -> bool:
    """Whether a call may be kept: numpy arrays of at most SMALL_BYTES, plain names for op and
    algorithm (what a key holds)."""
    return type(x) is np.ndarray and x.nbytes <= SMALL_BYTES and type(algorithm) is str and \
        (out is None or type(out) is np.ndarray) and (op is None or type(op) is str)


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
    if len(CALLS) >= SMALL_CALLS:
        CALLS.clear()
    CALLS[key] = checked


