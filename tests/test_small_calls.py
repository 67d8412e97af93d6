"""Small calls as a training loop makes them (MPI tier, n = 1..5).

Every call takes the one way through the API (check, wrap, choose, run): a call repeated on the
same arrays follows their data, notices what changed on the same objects, and keeps nothing of
them once it returns (a dropped array dies at once). The repeated case is explicit: persistent
requests (``coll.allreduce_init`` and its siblings) equal the ordinary call over many starts.
"""
import gc
import weakref

import numpy as np
import pytest

import collectives as coll
from tests.mpiutil import assert_all, world

COLLECTIVES = ["allreduce", "reduce", "broadcast", "reduce_scatter", "allgather", "gather",
               "alltoall", "scatter"]


def _cases(comm):
    """{collective: (call on (x, out), the answer as a function of the step, out's shape)} for
    rank-dependent int64 data of 3 elements per rank (``data(rank, step)``)."""
    n, r = comm.Get_size(), comm.Get_rank()

    def data(rank, step):
        return np.arange(3, dtype=np.int64) + 10 * rank + 100 * step

    def every(step):
        return np.stack([data(j, step) for j in range(n)])

    def tiled(x):  # x's 3 elements, once for each rank: block j of the reduce-scatter
        return np.tile(x, n)

    return {
        "allreduce": (lambda x, o: coll.allreduce(x, out=o), lambda s: every(s).sum(0), (3,)),
        "reduce": (lambda x, o: coll.reduce(x, out=o, root=n - 1),
                   lambda s: every(s).sum(0) if r == n - 1 else None, (3,)),
        "broadcast": (lambda x, o: coll.broadcast(x, root=n - 1), lambda s: data(n - 1, s),
                      None),
        "reduce_scatter": (lambda x, o: coll.reduce_scatter(tiled(x), out=o),
                           lambda s: every(s).sum(0), (3,)),
        "allgather": (lambda x, o: coll.allgather(x, out=o, counts=[3] * n),
                      lambda s: every(s).reshape(-1), (3 * n,)),
        "gather": (lambda x, o: coll.gather(x, out=o if r == 0 else None, counts=(3,) * n),
                   lambda s: every(s).reshape(-1) if r == 0 else None, (3 * n,)),
        "alltoall": (lambda x, o: coll.alltoall(np.repeat(x[:1], n), out=o),
                     lambda s: every(s)[:, 0], (n,)),
        "scatter": (lambda x, o: coll.scatter(tiled(x) + 1000 * np.repeat(np.arange(n), 3),
                                              root=n - 1, out=o),
                    lambda s: data(n - 1, s) + 1000 * r, (3,)),
    }, data


@pytest.mark.mpi
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_repeated_small_call_follows_the_data(collective):
    comm = world()
    cases, data = _cases(comm)
    call, answer, shape = cases[collective]
    x = np.zeros(3, np.int64)
    out = None if shape is None else np.zeros(shape, np.int64)
    bad = []
    for step in range(4):
        x[...] = data(comm.Get_rank(), step)
        got = call(x, out)
        want = answer(step)
        ok = got is None if want is None else got is not None and np.array_equal(got, want)
        if not ok:
            bad.append(f"step {step}: {got} != {want}")
    assert_all(not bad, f"{collective}: {bad[:2]}")


@pytest.mark.mpi
def test_the_same_objects_changed_are_checked_afresh():
    """A call repeated on the same objects sees their dtype, write flag and shape as they are
    now: nothing of the first call is taken on trust."""
    n = world().Get_size()
    x, out = np.ones(8, np.float32), np.zeros(8, np.float32)
    coll.allreduce(x, out=out)
    coll.broadcast(out)
    gathered = np.zeros((4 * n, 2), np.float32)
    rows = np.ones((4, 2), np.float32)
    coll.allgather(rows, counts=(4,) * n, out=gathered)
    x.dtype = np.int32  # the same object, another dtype
    x[...] = 2
    with pytest.raises(TypeError, match="out is"):
        coll.allreduce(x, out=out)
    rows.shape = (2, 4)  # the same object, another shape
    with pytest.raises(ValueError, match="counts\\[.*\\] is 4, but x has 2 rows"):
        coll.allgather(rows, counts=(4,) * n, out=gathered)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        coll.broadcast(out)
    assert_all(np.array_equal(gathered, np.ones((4 * n, 2))), "the first allgather")


@pytest.mark.mpi
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_an_array_passed_and_dropped_is_freed(collective):
    """Nothing between calls holds a caller's array: blocking, non-blocking (after wait) and
    persistent (after free) calls let go of x and out as soon as the caller does."""
    comm = world()
    cases, data = _cases(comm)
    call, answer, shape = cases[collective]
    refs = []
    for _ in range(3):
        x = data(comm.Get_rank(), 0)
        out = None if shape is None else np.zeros(shape, np.int64)
        call(x, out)
        refs += [weakref.ref(x)] + ([] if out is None else [weakref.ref(out)])
        del x, out
    x, out = np.ones(6, np.float32), np.zeros(6, np.float32)
    coll.iallreduce(x, out=out).wait()
    refs += [weakref.ref(x), weakref.ref(out)]
    del x, out
    x, out = np.ones(6, np.float32), np.zeros(6, np.float32)
    req = coll.allreduce_init(x, out=out)
    req.start()
    req.wait()
    req.free()
    refs += [weakref.ref(x), weakref.ref(out)]
    del x, out, req
    alive = [i for i, ref in enumerate(refs) if ref() is not None]
    if alive:
        gc.collect()  # the answer does not depend on a cycle: tell it apart in the message
    still = [i for i, ref in enumerate(refs) if ref() is not None]
    assert_all(not alive, f"{collective}: arrays {alive} alive after the calls "
                          f"({still} after a garbage collection)")


@pytest.mark.mpi
@pytest.mark.parametrize("collective", ["allgather", "gather"])
def test_counts_given(collective):
    """Ragged rows given as ``counts`` (list or tuple; no exchange), and a count that is not
    x's rows: an error on that rank, with ``check=True`` on every rank."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    rows = [j + 1 for j in range(n)]
    x = np.full((r + 1, 2), r, np.int32)
    want = np.concatenate([np.full((j + 1, 2), j, np.int32) for j in range(n)])
    call = coll.allgather if collective == "allgather" else coll.gather
    got = [call(x, counts=c) for c in (rows, tuple(rows), np.array(rows))]
    ok = all(np.array_equal(g, want) if collective == "allgather" or r == 0 else g is None
             for g in got)
    wrong = tuple(c + 1 if j == n - 1 else c for j, c in enumerate(rows))
    with pytest.raises((ValueError, coll.MismatchError), match="counts|rank"):
        call(x, counts=wrong, check=True)
    assert_all(ok, f"{collective} with counts: {got}")


@pytest.mark.mpi
def test_counts_given_move_no_extra_message(monkeypatch):
    """With ``counts`` (any sequence), allgather and gather learn nothing from the others."""
    from collectives import shapes
    n = world().Get_size()
    learned = []
    real = shapes.allgather_counts
    monkeypatch.setattr(shapes, "allgather_counts",
                        lambda *a, **k: (learned.append(1), real(*a, **k))[1])
    x = np.ones(2, np.int32)
    coll.allgather(x, counts=[2] * n)
    coll.gather(x, counts=np.full(n, 2))
    coll.allgather(x)  # learns them
    assert_all(len(learned) == 1, f"{len(learned)} exchanges")


@pytest.mark.mpi
@pytest.mark.parametrize("ragged", [False, True])
def test_scatter_with_out_moves_no_header(monkeypatch, ragged):
    """``out`` on every rank: each rank receives out's rows, no header moves (as
    ``MPI_Scatterv``); counts may be given on the root only. Without out, the header tells."""
    from collectives import shapes
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    headers = []
    real = shapes.scatter_header
    monkeypatch.setattr(shapes, "scatter_header",
                        lambda *a, **k: (headers.append(1), real(*a, **k))[1])
    rows = tuple(j + 1 for j in range(n)) if ragged else (2,) * n
    root = n - 1
    x = np.zeros((sum(rows), 3), np.int64) if r == root else None
    out = np.zeros((rows[r], 3), np.int64)
    bad = []
    for step in range(3):
        if x is not None:
            x[...] = np.arange(x.size).reshape(x.shape) + 100 * step
        counts = rows if ragged and (r == root or step == 2) else None
        got = coll.scatter(x, root=root, out=out, counts=counts)
        start = sum(rows[:r]) * 3
        want = (np.arange(start, start + rows[r] * 3) + 100 * step).reshape(rows[r], 3)
        if got is not out or not np.array_equal(out, want):
            bad.append(f"step {step}: {got}")
    sent = len(headers)
    got = coll.scatter(x, root=root, counts=rows if r == root and ragged else None)
    ok = np.array_equal(got, out) and len(headers) == sent + 1
    assert_all(not bad and sent == 0 and ok, f"scatter with out: {bad[:2]}, {sent} headers")


@pytest.mark.mpi
def test_every_call_is_numbered_checked_and_traced_when_asked(monkeypatch):
    """A check asked for (per call or by ``COLLECTIVES_CHECK``) runs on a repeated call, the
    timeline records it, and every call is numbered, as the watchdog and the check read it."""
    from collectives import check as _check
    from collectives import config, timeline
    from collectives.api import comm_context
    comm = world()
    x, out = np.full(5, comm.Get_rank(), np.float64), np.zeros(5)
    coll.allreduce(x, out=out)
    ctx = comm_context(comm, "allreduce")
    seq = ctx.seq
    verified = []
    real = _check.verify
    monkeypatch.setattr(_check, "verify", lambda *a, **k: (verified.append(k), real(*a, **k)))
    coll.allreduce(x, out=out)
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


def _persistent_cases(comm):
    """{case: (make the persistent request on (x, out), the ordinary call on x's data, x's
    length, out's shape)} for float64 data."""
    n, r = comm.Get_size(), comm.Get_rank()
    block = len(np.array_split(np.empty(4), n)[r])
    return {
        "allreduce": (lambda x, o: coll.allreduce_init(x, "sum", out=o),
                      lambda x: coll.allreduce(x), 4, (4,)),
        "allreduce avg": (lambda x, o: coll.allreduce_init(x, "avg", out=o),
                          lambda x: coll.allreduce(x, "avg"), 4, (4,)),
        "allreduce in place": (lambda x, o: coll.allreduce_init(o, "max", out=o),
                               lambda x: coll.allreduce(x, "max"), 4, (4,)),
        "reduce": (lambda x, o: coll.reduce_init(x, root=n - 1, out=o),
                   lambda x: coll.reduce(x, root=n - 1), 4, (4,)),
        "broadcast": (lambda x, o: coll.broadcast_init(o, root=n - 1),
                      lambda x: coll.broadcast(x.copy(), root=n - 1), 4, (4,)),
        "reduce_scatter": (lambda x, o: coll.reduce_scatter_init(x, out=o),
                           lambda x: coll.reduce_scatter(x), 4, (block,)),
        "allgather": (lambda x, o: coll.allgather_init(x, out=o),
                      lambda x: coll.allgather(x), 4, (4 * n,)),
        "alltoall": (lambda x, o: coll.alltoall_init(x, out=o),
                     lambda x: coll.alltoall(x), 2 * n, (2 * n,)),
        "gather": (lambda x, o: coll.gather_init(x, out=o if r == 0 else None),
                   lambda x: coll.gather(x), 4, (4 * n,)),
        "scatter": (lambda x, o: coll.scatter_init(x, root=0, out=o),
                    lambda x: coll.scatter(x, root=0, out=np.zeros(3)), 3 * n, (3,)),
    }


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["allreduce", "allreduce avg", "allreduce in place", "reduce",
                                  "broadcast", "reduce_scatter", "allgather", "alltoall",
                                  "gather", "scatter"])
@pytest.mark.parametrize("algorithm", ["auto", "named"])
def test_persistent_equals_the_ordinary_call(case, algorithm):
    """Over many starts on changing data, a persistent request gives what the ordinary call
    gives; the same with an algorithm of the toolkit's own named where the collective has one
    (ring where it has a ring)."""
    comm = world()
    r = comm.Get_rank()
    make, ordinary, length, shape = _persistent_cases(comm)[case]
    x, out = np.zeros(length), np.zeros(shape)
    if algorithm != "auto":
        collective = case.split()[0]
        names = [a for a in coll.algorithms(collective) if a not in ("native", "onepass")]
        if not names:
            pytest.skip(f"{collective}: MPI's own only")
        name = "ring" if "ring" in names else names[0]
        made = make
        make = lambda x, o: _named(made, x, o, name)  # noqa: E731
    req = make(x, out)
    bad = []
    for step in range(6):
        data = np.arange(float(length)) + 10 * r + 100 * step
        if case == "allreduce avg":  # quotients exact: MPI's persistent collective may add
            data *= comm.Get_size()  # them in another order than its blocking one
        x[...] = data
        if case in ("allreduce in place", "broadcast"):
            out[...] = data
        req.start()
        got = req.wait()
        want = ordinary(data)
        if (want is None) != (got is None) or (want is not None and
                                                not np.array_equal(got, want)):
            bad.append(f"start {step}: {got} != {want}")
    req.free()
    assert_all(not bad, f"{case}: {bad[:2]}")


def _named(make, x, o, name):
    """``make`` with ``algorithm=name`` passed to the ``*_init`` it calls."""
    import functools
    real = {f: getattr(coll, f) for f in dir(coll) if f.endswith("_init")}
    try:
        for f, fn in real.items():
            setattr(coll, f, functools.partial(fn, algorithm=name))
        return make(x, o)
    finally:
        for f, fn in real.items():
            setattr(coll, f, fn)


@pytest.mark.mpi
def test_persistent_request_misuse_is_refused():
    x, out = np.ones(3), np.zeros(3)
    req = coll.allreduce_init(x, out=out)
    with pytest.raises(RuntimeError, match="without start"):
        req.wait()
    req.start()
    with pytest.raises(RuntimeError, match="started again"):
        req.start()
    got = req.wait()
    with pytest.raises(RuntimeError, match="without start"):
        req.test()
    req.free()
    assert_all(np.array_equal(got, np.full(3, float(world().Get_size()))), f"{got}")


@pytest.mark.mpi
def test_persistent_request_bad_arguments_raise_on_every_rank():
    with pytest.raises(TypeError, match="out is"):
        coll.allreduce_init(np.ones(3), out=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="unknown algorithm|algorithm"):
        coll.allreduce_init(np.ones(3), out=np.zeros(3), algorithm="nonesuch")


@pytest.mark.mpi
def test_scatter_with_out_on_some_ranks_only_is_named_when_checked():
    """``out`` given on some ranks only: with ``check=True`` a ``MismatchError`` on every rank
    (no rank waits for a header the others do not send)."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        pytest.skip("needs two ranks")
    x = np.arange(2.0 * n) if r == 0 else None
    with pytest.raises(coll.MismatchError, match="out"):
        coll.scatter(x, root=0, out=None if r == 0 else np.zeros(2), check=True)
    got = coll.scatter(x, root=0, out=np.zeros(2), check=True)  # and the call goes on
    assert_all(np.array_equal(got, np.arange(2.0 * r, 2.0 * r + 2)), f"{got}")
