"""A signature's plan (``collectives.dispatch.Plan``) changes no answer (MPI tier, n = 1..5).

A blocking numpy call whose signature (dtype, shapes, op, root, counts, algorithm, where out
is) was checked and chosen before runs without taking that path again. Every call after it
must still give exactly what the same call gives on a communicator that has never seen the
signature: the same result, or the same error, word for word. Each case settles a plan on a
communicator, then makes a call that differs in something the signature does not hold (a
value of another type that compares equal, a flag, a view, a layout), once there and once on
a fresh communicator, and compares.
"""
import dataclasses
import re

import numpy as np
import pytest

import collectives as coll
from collectives import dispatch, native, select, signature
from tests.mpiutil import assert_all, world


def _outcome(fn):
    """``fn()``'s result as plain data, or its error's type and text (a call's number on its
    communicator aside: the settled one has made more calls)."""
    try:
        got = fn()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, re.sub(r" #\d+", " #N", str(exc))
    return "result", None if got is None else np.asarray(got).tolist()


def _cases(n, r):
    """{name: (the call that settles a plan, the probe)}, each a function of ``comm``."""
    f4 = np.float32

    def x4():
        return np.arange(4, dtype=f4) + r

    def readonly(a):
        a.flags.writeable = False
        return a

    rows = 4 * n
    return {
        "allreduce out read-only": (
            lambda c: coll.allreduce(x4(), out=np.zeros(4, f4), comm=c),
            lambda c: coll.allreduce(x4(), out=readonly(np.zeros(4, f4)), comm=c)),
        "allreduce out of another dtype": (
            lambda c: coll.allreduce(x4(), out=np.zeros(4, f4), comm=c),
            lambda c: coll.allreduce(x4(), out=np.zeros(4, np.float64), comm=c)),
        "allreduce out is a view of x": (
            lambda c: coll.allreduce(x4(), out=np.zeros(4, f4), comm=c),
            lambda c: (lambda x: coll.allreduce(x, out=x.view(), comm=c))(x4())),
        "allreduce out partly over x": (
            lambda c: coll.allreduce(x4(), out=np.zeros(4, f4), comm=c),
            lambda c: (lambda b: coll.allreduce(b[:4], out=b[2:], comm=c))(
                np.arange(6, dtype=f4))),
        "allreduce x not contiguous": (
            lambda c: coll.allreduce(x4(), out=np.zeros(4, f4), comm=c),
            lambda c: coll.allreduce(np.arange(8, dtype=f4)[::2], out=np.zeros(4, f4),
                                     comm=c)),
        "allreduce in place on read-only x": (
            lambda c: (lambda x: coll.allreduce(x, out=x, comm=c))(x4()),
            lambda c: (lambda x: coll.allreduce(x, out=x, comm=c))(readonly(x4()))),
        "reduce root False": (
            lambda c: coll.reduce(x4(), root=0, out=np.zeros(4, f4), comm=c),
            lambda c: coll.reduce(x4(), root=False, out=np.zeros(4, f4), comm=c)),
        "broadcast root 0.0": (
            lambda c: coll.broadcast(x4(), root=0, comm=c),
            lambda c: coll.broadcast(x4(), root=0.0, comm=c)),
        "broadcast read-only": (
            lambda c: coll.broadcast(x4(), comm=c),
            lambda c: coll.broadcast(readonly(x4()), comm=c)),
        "reduce_scatter counts as floats": (
            lambda c: coll.reduce_scatter(np.ones(rows, f4), counts=[4] * n, comm=c),
            lambda c: coll.reduce_scatter(np.ones(rows, f4), counts=[4.0] * n, comm=c)),
        "reduce_scatter counts as bools": (
            lambda c: coll.reduce_scatter(np.ones(n, f4), counts=[1] * n, comm=c),
            lambda c: coll.reduce_scatter(np.ones(n, f4), counts=[True] * n, comm=c)),
        "reduce_scatter counts as an array": (
            lambda c: coll.reduce_scatter(np.ones(rows, f4), counts=[4] * n, comm=c),
            lambda c: coll.reduce_scatter(np.ones(rows, f4), counts=np.full(n, 4), comm=c)),
        "allgather a changed shape": (
            lambda c: coll.allgather(np.ones((4, 2), f4), counts=(4,) * n,
                                     out=np.zeros((rows, 2), f4), comm=c),
            lambda c: (lambda x: (setattr(x, "shape", (2, 4)),
                                  coll.allgather(x, counts=(4,) * n,
                                                 out=np.zeros((rows, 2), f4), comm=c))[1])(
                np.ones((4, 2), f4))),
        "allgather counts as floats": (
            lambda c: coll.allgather(x4(), counts=[4] * n, comm=c),
            lambda c: coll.allgather(x4(), counts=[4.0] * n, comm=c)),
        "allgather learned, another rank's rows changed": (
            lambda c: coll.allgather(x4(), comm=c),
            lambda c: coll.allgather(np.ones(5 if r == n - 1 else 4, f4) * r, comm=c)),
        "allgather learned, x not contiguous": (
            lambda c: coll.allgather(x4(), comm=c),
            lambda c: coll.allgather(np.arange(8, dtype=f4)[::2], comm=c)),
        "allgather learned, out of another dtype on rank 0, checked": (
            lambda c: coll.allgather(x4(), out=np.zeros(rows, f4), comm=c, check=True),
            lambda c: coll.allgather(x4(), out=np.zeros(rows, np.float64 if r == 0 else f4),
                                     comm=c, check=True)),
        "alltoall learned, out of another shape on rank 0, checked": (
            lambda c: coll.alltoall(np.arange(n, dtype=f4) + r, [1] * n,
                                    out=np.zeros(n, f4), comm=c, check=True),
            lambda c: coll.alltoall(np.arange(n, dtype=f4) + r, [1] * n,
                                    out=np.zeros(n + (r == 0), f4), comm=c, check=True)),
        "gather learned, another rank's rows changed": (
            lambda c: coll.gather(x4(), comm=c),
            lambda c: coll.gather(np.ones((5 if r == n - 1 else 4, 1), f4)[:, 0] * r, comm=c)),
        "alltoall learned, another rank's counts changed": (
            lambda c: coll.alltoall(np.arange(n, dtype=f4) + r, [1] * n, comm=c),
            lambda c: coll.alltoall(np.arange(n, dtype=f4) + r,
                                    [1] * n if r != n - 1 or n == 1 else [2] + [1] * (n - 2) + [0],
                                    comm=c)),
        "gather out of another shape": (
            lambda c: coll.gather(x4(), counts=[4] * n,
                                  out=np.zeros(rows, f4) if r == 0 else None, comm=c),
            lambda c: coll.gather(x4(), counts=[4] * n,
                                  out=np.zeros(rows + 1, f4) if r == 0 else None, comm=c)),
        "alltoall recv_counts as floats": (
            lambda c: coll.alltoall(np.ones(rows, f4), [4] * n, recv_counts=[4] * n, comm=c),
            lambda c: coll.alltoall(np.ones(rows, f4), [4] * n, recv_counts=[4.0] * n,
                                    comm=c)),
        "scatter out read-only": (
            lambda c: coll.scatter(np.ones(rows, f4), out=np.zeros(4, f4), comm=c),
            lambda c: coll.scatter(np.ones(rows, f4), out=readonly(np.zeros(4, f4)), comm=c)),
        "scatter x not contiguous": (
            lambda c: coll.scatter(np.ones(rows, f4), out=np.zeros(4, f4), comm=c),
            lambda c: coll.scatter(np.ones(2 * rows, f4)[::2], out=np.zeros(4, f4), comm=c)),
        "scatter x of another dtype off the root": (
            lambda c: coll.scatter(np.ones(rows, f4), out=np.zeros(4, f4), comm=c),
            lambda c: coll.scatter(np.ones(rows, f4 if r == 0 else np.float64),
                                   out=np.zeros(4, f4), comm=c)),
    }


CASES = sorted(_cases(1, 0))


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES)
def test_a_settled_signature_answers_as_a_fresh_call(case):
    comm = world()
    settle, probe = _cases(comm.Get_size(), comm.Get_rank())[case]
    warm, fresh = comm.Dup(), comm.Dup()
    try:
        settle(warm)
        settle(warm)  # the second call runs on the settled plan
        got, want = _outcome(lambda: probe(warm)), _outcome(lambda: probe(fresh))
        plans = dispatch.comm_context(warm).slots[signature.Plans].table.values()
        held = [p.key[0] for p in plans for b in (p.x, p.out) if b is not None and
                (b.obj is not None or b.flat is not None)]
    finally:
        warm.Free()
        fresh.Free()
    assert_all(got == want, f"{case}: {got} after a settled plan, {want} on a fresh "
                            f"communicator")
    assert_all(not held, f"{case}: the plans of {held} hold an array after the call")


@pytest.mark.mpi
def test_a_registered_record_replaces_a_settled_choice():
    """``select.register`` forgets every plan: the next call runs the new record."""
    comm = world()
    record = select.get("allreduce", "native")
    seen = []

    def counted(call):
        seen.append(call.collective)
        return native.launch(call)
    x, out = np.ones(4, np.float32), np.zeros(4, np.float32)
    coll.allreduce(x, out=out, algorithm="native")
    coll.allreduce(x, out=out, algorithm="native")
    select.register(dataclasses.replace(record, launch=counted))
    try:
        coll.allreduce(x, out=out, algorithm="native")
        coll.allreduce(x, out=out, algorithm="native")
    finally:
        select.register(record)
    launched = ["allreduce"] * 2 if comm.Get_size() > 1 else []  # one rank: nothing to launch
    assert_all(seen == launched and np.array_equal(out, np.full(4, comm.Get_size())),
               f"launches after register: {seen}")


@pytest.mark.mpi
def test_plans_hold_no_array_and_stay_bounded():
    """A plan's key and what it derived hold values only; many signatures keep at most a
    bounded number of plans."""
    comm = world()
    for length in range(1, 1100):
        coll.allreduce(np.ones(length, np.float32), comm=comm)
    plans = dispatch.comm_context(comm).slots.get(signature.Plans)
    held = [] if plans is None else list(plans.table.values())
    arrays = [p.key for p in held if any(isinstance(v, np.ndarray) for v in p.key)]
    assert_all(len(held) <= 1024 and not arrays, f"{len(held)} plans; arrays in {arrays[:2]}")
