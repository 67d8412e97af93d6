"""Small calls repeated on the same arrays (MPI tier, n = 1..5).

The API keeps what a small blocking call on numpy arrays worked out (``collectives.kept``) and
repeats it from that record. Every collective whose shapes its arguments fix is kept; a
repeated call must give the same results as a fresh one as the data change, and must notice
what can change on the same objects (dtype, write flag, the tuning table). ``allgather`` and
``gather`` with ``counts`` move no extra message to learn them.
"""
import numpy as np
import pytest

import collectives as coll
from collectives import kept
from tests.mpiutil import assert_all, world


def _fresh():
    kept.forget()


def _cases(comm):
    """{collective: (call on (x, out), the answer for x on every rank as a function of the
    rank's data, out shape)} for rank-dependent int64 data of 3 elements per rank."""
    n, r = comm.Get_size(), comm.Get_rank()

    def data(rank, step):
        return np.arange(3, dtype=np.int64) + 10 * rank + 100 * step
    every = lambda step: np.stack([data(j, step) for j in range(n)])  # noqa: E731
    return {
        "allreduce": (lambda x, o: coll.allreduce(x, out=o), lambda s: every(s).sum(0), (3,)),
        "reduce": (lambda x, o: coll.reduce(x, out=o, root=n - 1),
                   lambda s: every(s).sum(0) if r == n - 1 else None, (3,)),
        "broadcast": (lambda x, o: coll.broadcast(x, root=n - 1), lambda s: data(n - 1, s),
                      None),
        "reduce_scatter": (lambda x, o: coll.reduce_scatter(np.repeat(x, n)[:3 * n], out=o),
                           None, None),
        "allgather": (lambda x, o: coll.allgather(x, out=o, counts=(3,) * n),
                      lambda s: every(s).reshape(-1), (3 * n,)),
        "gather": (lambda x, o: coll.gather(x, out=o if r == 0 else None, counts=(3,) * n),
                   lambda s: every(s).reshape(-1) if r == 0 else None, (3 * n,)),
        "alltoall": (lambda x, o: coll.alltoall(np.repeat(x[:1], n), out=o),
                     lambda s: every(s)[:, 0], (n,)),
    }, data


@pytest.mark.mpi
@pytest.mark.parametrize("collective", ["allreduce", "reduce", "broadcast", "allgather",
                                        "gather", "alltoall"])
def test_repeated_small_call_follows_the_data(collective):
    comm = world()
    cases, data = _cases(comm)
    call, answer, shape = cases[collective]
    _fresh()
    x = np.zeros(3, np.int64)
    out = None if shape is None else np.zeros(shape, np.int64)
    bad = []
    for step in range(4):
        x[...] = data(comm.Get_rank(), step)
        got = call(x, out)
        want = answer(step)
        if want is None:
            ok = got is None
        else:
            ok = got is not None and np.array_equal(got, want)
        if not ok:
            bad.append(f"step {step}: {got} != {want}")
    remembered = any(k[0] == collective for k in kept.CALLS)
    assert_all(not bad and (remembered or collective == "alltoall"), f"{collective}: "
               f"{bad[:2]}, kept {remembered}")


@pytest.mark.mpi
def test_kept_call_is_kept_for_fixed_shapes_only():
    n = world().Get_size()
    _fresh()
    x, out = np.ones(4, np.float32), np.zeros(4 * n, np.float32)
    coll.allgather(x, out=out)  # counts learned from the others: never kept
    coll.allgather(x, out=out, counts=(4,) * n)
    coll.allreduce(x)  # returns an array it allocated: never kept
    coll.barrier()
    kinds = sorted(k[0] for k in kept.CALLS)
    assert_all(kinds == ["allgather", "barrier"] and np.array_equal(out, np.ones(4 * n)),
               f"kept {kinds}")


@pytest.mark.mpi
def test_kept_call_notices_dtype_and_write_flag():
    comm = world()
    n = comm.Get_size()
    _fresh()
    x, out = np.ones(4, np.float32), np.zeros(4, np.float32)
    coll.allreduce(x, out=out)
    coll.broadcast(out)
    x.dtype = np.int32  # the same object, another dtype: checked afresh
    x[...] = 2
    refused = False
    try:
        coll.allreduce(x, out=out)
    except TypeError:
        refused = True
    out.flags.writeable = False
    refused_ro = False
    try:
        coll.broadcast(out)
    except ValueError:
        refused_ro = True
    assert_all(refused and refused_ro, f"dtype change refused {refused}, read-only {refused_ro}")
    assert n >= 1


@pytest.mark.mpi
@pytest.mark.parametrize("collective", ["allgather", "gather"])
def test_counts_given(collective):
    """Ragged rows given as ``counts`` (no exchange), and a count that is not x's rows: an
    error on that rank, with ``COLLECTIVES_CHECK`` on every rank."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    rows = tuple(j + 1 for j in range(n))
    x = np.full((r + 1, 2), r, np.int32)
    want = np.concatenate([np.full((j + 1, 2), j, np.int32) for j in range(n)])
    call = coll.allgather if collective == "allgather" else coll.gather
    got = call(x, counts=rows)
    ok = np.array_equal(got, want) if collective == "allgather" or r == 0 else got is None
    wrong = tuple(c + 1 if j == n - 1 else c for j, c in enumerate(rows))
    with pytest.raises((ValueError, coll.MismatchError), match="counts|rank"):
        call(x, counts=wrong, check=True)
    assert_all(ok, f"{collective} with counts: {got}")


@pytest.mark.mpi
def test_kept_calls_hold_a_bounded_number_of_bytes():
    """Fresh arrays every call: the oldest kept calls let go of theirs, so what the records hold
    stays under the bound, and an array the caller dropped is freed once its record goes."""
    import gc
    import weakref
    _fresh()
    refs = []
    per_call = 2 * (1 << 20)  # x and out, 1 MiB each
    for _ in range(kept.KEPT_BYTES // per_call + 8):
        x, out = np.ones(1 << 18, np.float32), np.empty(1 << 18, np.float32)
        coll.allreduce(x, out=out)
        refs.append(weakref.ref(x))
        del x, out
    gc.collect()
    held = sum(k.nbytes for k in kept.CALLS.values())
    alive = sum(r() is not None for r in refs)
    assert_all(held <= kept.KEPT_BYTES and alive == len(kept.CALLS) and refs[0]() is None,
               f"kept {len(kept.CALLS)} calls holding {held} bytes; {alive} inputs alive")
    _fresh()


@pytest.mark.mpi
@pytest.mark.parametrize("ragged", [False, True])
def test_scatter_without_header(ragged):
    """``header=False``: every rank passes out (and, if ragged, counts), no header moves; the
    call is kept and follows the data; a rank without out is an error on every rank (checked)."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    _fresh()
    rows = tuple(j + 1 for j in range(n)) if ragged else (2,) * n
    counts = rows if ragged else None
    x = np.zeros((sum(rows), 3), np.int64) if r == n - 1 else None
    out = np.zeros((rows[r], 3), np.int64)
    bad = []
    for step in range(3):
        if x is not None:
            x[...] = np.arange(x.size).reshape(x.shape) + 100 * step
        got = coll.scatter(x, root=n - 1, out=out, counts=counts, header=False)
        start = sum(rows[:r]) * 3
        want = (np.arange(start, start + rows[r] * 3) + 100 * step).reshape(rows[r], 3)
        if got is not out or not np.array_equal(out, want):
            bad.append(f"step {step}: {got}")
    remembered = any(k[0] == "scatter" for k in kept.CALLS)
    with pytest.raises((ValueError, coll.MismatchError), match="out|rank"):
        coll.scatter(x, root=n - 1, out=None if r == 0 else out, counts=counts, header=False,
                     check=True)
    assert_all(not bad and remembered, f"scatter header=False: {bad[:2]}, kept {remembered}")


@pytest.mark.mpi
def test_kept_call_takes_the_whole_way_when_checked_or_traced(monkeypatch):
    """A kept call bound to MPI's own collective skips what its first run worked out, but a
    check asked for (per call or by ``COLLECTIVES_CHECK``) still runs, and the timeline still
    records it; every repeat is numbered, as the watchdog and the check read it."""
    from collectives import check as _check
    from collectives import config, timeline
    from collectives.api import comm_context
    comm = world()
    _fresh()
    x, out = np.full(5, comm.Get_rank(), np.float64), np.zeros(5)
    coll.allreduce(x, out=out)
    ctx = comm_context(comm, "allreduce")
    seq = ctx.seq
    verified = []
    real = _check.verify
    monkeypatch.setattr(_check, "verify", lambda *a, **k: (verified.append(k), real(*a, **k)))
    coll.allreduce(x, out=out)  # the lean repeat: no check
    coll.allreduce(x, out=out, check=True)
    old = config.set("COLLECTIVES_CHECK", True)
    try:
        coll.allreduce(x, out=out)
    finally:
        config.set("COLLECTIVES_CHECK", old)
    before = len(timeline.events())
    timeline.on = True
    try:
        coll.allreduce(x, out=out)
    finally:
        timeline.on = False
    traced = [e for e in timeline.events()[before:] if e.get("name") == "allreduce"]
    want = np.full(5, sum(range(comm.Get_size())), np.float64)
    assert_all(len(verified) == 2 and [v["sequence"] for v in verified] == [seq + 1, seq + 2]
               and ctx.seq == seq + 4 and len(traced) == 1 and np.array_equal(out, want),
               f"checked {len(verified)}, numbered {ctx.seq - seq}, traced {len(traced)}")


@pytest.mark.mpi
def test_counts_as_a_list_are_never_kept():
    """Counts given as a list (unhashable) run, every time, and are not kept."""
    n = world().Get_size()
    _fresh()
    x, out = np.ones(2, np.int32), np.zeros(2 * n, np.int32)
    for _ in range(2):
        coll.allgather(x, out=out, counts=[2] * n)
    assert_all(not kept.CALLS and np.array_equal(out, np.ones(2 * n)), f"kept {len(kept.CALLS)}")
