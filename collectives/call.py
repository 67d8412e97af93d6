"""The record of one collective call, checked and wrapped: what an algorithm's ``launch``
receives and what the executor binds a schedule to.

It sits below the engine that makes and runs calls (``collectives.dispatch``) and below the
algorithms, so that a composite which runs another algorithm inside its own work (the node
composite's ring across nodes) makes its inner call from here, never from the engine above it.
"""
from __future__ import annotations

__all__ = ["Call", "make_call"]


class Call:
    """One collective call, checked and wrapped: what an algorithm's ``launch`` receives.

    ``x``/``out`` are ``Buffer``s (``out`` is x itself when in place, None on non-root ranks
    of ``reduce``); ``counts`` are per-rank element counts (reduce_scatter, allgather);
    ``plan``: its signature's plan where it has one (``collectives.signature.Plan``).
    """

    __slots__ = ("collective", "ctx", "x", "out", "op", "root", "counts", "algorithm",
                 "inplace", "seq", "blocking", "algo", "plan")

    def __init__(self, collective, ctx, x, out, op=None, *, root=0, counts=None,
                 inplace=False, blocking=True):
        _fill(self, collective, ctx, x, out, op, root, counts, inplace, blocking)

    @property
    def count(self) -> int:
        """Elements of the per-rank input."""
        return self.x.count

    def describe(self) -> str:
        """The call in a few words, for the watchdog and errors."""
        return (f"{self.collective} #{self.seq} ({self.algorithm}, {self.count} x "
                f"{self.x.dtype.name}{'' if self.op is None else ', ' + self.op.name})")


def _fill(call, collective, ctx, x, out, op, root, counts, inplace, blocking):
    call.collective, call.ctx, call.x, call.out, call.op = collective, ctx, x, out, op
    call.root, call.counts, call.inplace, call.blocking = root, counts, inplace, blocking
    call.algorithm, call.seq, call.algo, call.plan = None, -1, None, None
    return call


def make_call(collective, ctx, x, out, op=None, root=0, counts=None, inplace=False,
              blocking=True) -> Call:
    """A ``Call`` (``Call(...)`` without the keyword handling: this runs on every call)."""
    call = _blank(Call)  # one store a statement: a tuple on the right would be built first
    call.collective = collective
    call.ctx = ctx
    call.x = x
    call.out = out
    call.op = op
    call.root = root
    call.counts = counts
    call.inplace = inplace
    call.blocking = blocking
    call.algorithm = None
    call.seq = -1
    call.algo = None
    call.plan = None
    return call


_blank = object.__new__
