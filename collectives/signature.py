"""A blocking call's signature, and the plan that its first call settles.

A blocking call on numpy arrays has a signature: every value that its argument checks and the
choice of algorithm read (the collective, dtype, shapes, op, root, counts, algorithm, where out
is), never an array. The first call of a signature takes the full path (``collectives.api``'s
checks, then ``collectives.dispatch.start``'s choice) and leaves a ``Plan``: what the checks
derived from those values, the record chosen and how it runs. A later call of the same
signature repeats only the checks that read the arrays themselves (``bound``: layout,
writability, overlap) and runs at once, inside the same lifecycle (``dispatch.start``). A
value the signature cannot hold exactly (a float among counts, a bool root, a numpy array of
counts) keeps the call on the full path, whose checks tell it apart. Plans are kept per
communicator, bounded, and forgotten when the tuning table's setting or the registry
changes; nothing in them refers to a caller's array.
"""
from __future__ import annotations

import numpy as np

from . import config
from .buffers import numpy_buffer
from .call import Call, make_call
from .registry import CHANGES

__all__ = ["Plan", "Plans", "Changed", "planned", "keep", "bound", "result_of", "where",
           "counts_key", "NEW", "SAME", "APART", "NONE"]

class Plan:
    """What one signature of a blocking call settled, kept by its communicator: the API's
    checks passed for it, the choice is made, and it runs at once.

    ``key`` is the signature: the collective and every value that the API's checks and the
    choice read (dtype, shapes, op, root, counts, algorithm, where out is), never an array, so
    nothing of a caller's arrays outlives a call. ``derived`` is what the API worked out from
    those values (the op's record, counts in elements, the output's shape); ``algo`` the
    record chosen and ``run(call) -> work`` how the record runs a call of this signature.
    A plan is made unsettled (``algo`` and ``run`` None) by the API for a call whose
    signature has none yet; ``start`` settles and keeps it where the choice depended on the
    signature alone (not on the buffers, as a preference's agreement does).

    ``x`` and ``out``: the ``Buffer``s that its calls fill with the caller's arrays
    (``bound``) and ``empty`` drops them from when the call returns; ``call``: the ``Call``
    made of them, reused by every call of the signature (blocking calls on a communicator
    come one at a time), but where a call changes its own record (``op="avg"``, summed
    after dividing first). So a call wraps its arrays without making objects.

    ``learned``: for a signature whose counts every rank learns with one exchange (an
    allgather or gather without counts, a ragged all-to-all), what that exchange was when the
    plan was settled (``shapes.Learned``): each call makes it again as its first step, under
    its own watchdog entry, and runs as planned where every rank's counts are what they were
    (``Changed`` where not)."""

    __slots__ = ("key", "derived", "algo", "run", "x", "out", "call", "learned")

    def __init__(self, key, derived=None, learned=None):
        self.key, self.derived, self.algo, self.run = key, derived, None, None
        self.x = self.out = self.call = None
        self.learned = learned

    def empty(self) -> None:
        """A call of this plan returned: its Buffers hold none of the caller's arrays."""
        x, out = self.x, self.out
        if x is not None:
            x.obj = x.flat = None
        if out is not None:
            out.obj = out.flat = None


class Changed(Exception):
    """A settled plan's call whose learned counts differ on some rank now (``Plan.learned``):
    raised by its first step, before anything else is done, for the full path to take the
    call with ``table``, every rank's counts as just exchanged."""

    def __init__(self, table):
        super().__init__("counts changed")
        self.table = table


# Where a call's out is: not given (the API makes it), x itself, an array apart from x, or
# nothing to check (ignored on this rank).
NEW, SAME, APART, NONE = "new", "same", "apart", "none"
_INT = frozenset((int,))


def where(x, out) -> str:
    """Where ``out`` is, for a signature: ``NEW``, ``SAME`` or ``APART``."""
    return NEW if out is None else SAME if out is x else APART


def counts_key(counts):
    """``counts`` as part of a signature: None, a tuple of plain ints, or False where it cannot
    be one (floats, bools and numpy arrays take the full path, whose checks tell them apart)."""
    if counts is None:
        return None
    if type(counts) is tuple or type(counts) is list:
        if len(counts) > 16:  # many ranks: one pass in C
            return tuple(counts) if _INT.issuperset(map(type, counts)) else False
        for count in counts:  # a few: quicker than the set that issuperset makes of them
            if type(count) is not int:
                return False
        return tuple(counts)
    return False


def bound(ctx, key, x, out) -> Call | None:
    """The ``Call`` of a blocking call whose signature ``key`` has a settled plan on ``ctx``
    (its ``plan``), with the checks that read the arrays themselves made again (x
    C-contiguous; out writable, C-contiguous and apart from x); None where there is no plan or
    a check fails: the full path then takes the call, and says why.
    ``plan.derived``: the collective, op, root, counts, the output's shape, in place, where
    out is (``NEW``, ``SAME``, ``APART``, ``NONE``), whether this rank receives into it, and
    the Buffer standing for x where x is not read on this rank (or None). The call and its
    Buffers are the plan's own, filled (``Plan.empty`` drops the arrays when the call
    returns)."""
    plans = ctx.slots.get(Plans)  # planned(ctx, key), inline: this runs on every call
    if plans is None or plans.version != CHANGES[0] or \
            plans.setting is not config.current.COLLECTIVES_TUNING:
        return None
    try:
        plan = plans.table.get(key)
    except TypeError:
        return None
    if plan is None:
        return None
    collective, op, root, counts, shape, inplace, placed, receives, stand_in = plan.derived
    if x is not None:  # x's layout is checked where it is not read, as the full path does
        flags = x.flags
        if not flags.c_contiguous:
            return None
    if stand_in is None:
        xb = plan.x
        if xb is None:
            xb = plan.x = numpy_buffer(x, not flags.writeable)
        else:  # numpy_buffer(x, ..., into=xb), inline
            xb.obj = x
            xb.flat = x if len(xb.shape) == 1 else x.reshape(-1)
            xb.readonly = not flags.writeable
    else:
        xb = stand_in
    if placed is APART:
        if type(out) is not np.ndarray or out.shape != shape or \
                (out.dtype is not xb.dtype and out.dtype != xb.dtype):
            return plan.empty()  # x's Buffer may hold x: the full path takes the call
        flags = out.flags
        if not (flags.c_contiguous and flags.writeable) or not (
                (out.base is None and xb.obj.base is None) or
                not np.may_share_memory(xb.flat, out)):
            return plan.empty()
        outb = plan.out
        if outb is None:
            outb = plan.out = numpy_buffer(out)
        else:
            outb.obj = out
            outb.flat = out if len(shape) == 1 else out.reshape(-1)
    elif placed is NEW:
        outb = plan.out = numpy_buffer(np.empty(shape, xb.dtype), False, plan.out)
    elif placed is SAME:
        if xb.readonly:
            return plan.empty()
        outb = xb
    else:
        outb = None
    call = plan.call
    if call is None:
        call = make_call(collective, ctx, xb, outb if receives else None, op, root, counts,
                         inplace, True)
        call.plan = plan
        if op is None or not op.is_avg:  # an average divided first changes its call's record
            plan.call = call
    return call


def result_of(call: Call):
    """What a call returns on this rank: its output, or None where it has none."""
    return None if call.out is None else call.out.obj


_UNREAD = object()  # a setting not read yet


class Plans:
    """One communicator's settled plans, by key, for the tuning table and the registry they
    were chosen under (a change of either forgets them)."""

    __slots__ = ("table", "setting", "version")

    def __init__(self, ctx):
        self.table, self.setting, self.version = {}, _UNREAD, -1


def planned(ctx, key) -> Plan | None:
    """The settled plan of signature ``key`` on ``ctx``, or None (also where a value of the
    key cannot be hashed: such a call has no plan)."""
    plans = ctx.slots.get(Plans)
    if plans is None or plans.version != CHANGES[0] or \
            plans.setting is not config.current.COLLECTIVES_TUNING:
        return None
    try:
        return plans.table.get(key)
    except TypeError:
        return None


def keep(ctx, plan: Plan) -> None:
    """Keep ``plan``, settled, on ``ctx`` for the calls of its signature."""
    plans = ctx.slot(Plans)
    setting, version = config.get("COLLECTIVES_TUNING"), CHANGES[0]
    if plans.setting is not setting or plans.version != version or len(plans.table) >= 1024:
        # a program's signatures are few; a bound all the same
        plans.table, plans.setting, plans.version = {}, setting, version
    plans.table[plan.key] = plan
