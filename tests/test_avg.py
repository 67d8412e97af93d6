"""``op="avg"``: a mean that the dtype can represent never overflows (MPI tier, n = 1..5).

Every rank holds values near its dtype's largest finite value, so a sum first would overflow in
float16 and bfloat16 (and in float32 near its own maximum). The core divides each input by the
rank count before summing (``collectives.dispatch.mean_first``): the result must be finite,
within the rounding of that arithmetic of the float64 mean, and the same bits on every rank.

The bound: each quotient x/n is rounded once (at most u |x|/n, u = eps/2) and the n quotients
are summed with n - 1 roundings of partial sums that never exceed max|x| in magnitude, so the
error is at most n * u * max|x| (plus the rounding of the result itself, within the same term
for n >= 1). The tests allow eps * n * max|x|: twice that, never tuned to one machine.
"""
import numpy as np
import pytest

import collectives as coll
from collectives.buffers import bfloat16
from tests.mpiutil import assert_all, refused_off_node, world

DTYPES = [np.dtype(np.float16), np.dtype(bfloat16), np.dtype(np.float32)]


def _inputs(dtype, count, size):
    """Every rank's input (rows: ranks): near the largest finite value, some of them negative,
    rank-dependent; the mean is representable (its magnitude is below every input's)."""
    big = float(np.finfo(dtype).max)
    i = np.arange(count)
    rows = []
    for r in range(size):
        scale = 0.97 - 0.05 * ((r + i) % 4) / 4
        sign = np.where((i + r) % 5 == 4, -1.0, 1.0) if size > 1 else 1.0
        rows.append((big * scale * sign).astype(dtype))
    return np.stack(rows)


def _bound(dtype, size, every):
    eps = float(np.finfo(dtype).eps)
    return eps * max(size, 1) * float(np.abs(every.astype(np.float64)).max())


def _same_everywhere(comm, result) -> bool:
    """Whether every rank holds the same bits."""
    raw = np.ascontiguousarray(result).view(np.uint8)
    first = raw.copy()
    comm.Bcast(first, root=0)
    return bool(np.array_equal(raw, first))


def _close(got, want, bound):
    """``(finite and within bound of want, the largest error or "inf")``."""
    got64 = np.asarray(got).astype(np.float64)
    if not np.isfinite(got64).all():
        return False, "inf"
    worst = float(np.abs(got64 - want).max(initial=0))
    return worst <= bound, worst


def _check(comm, got, want, bound, what):
    """Finite, within ``bound`` of ``want`` and the same bits on every rank."""
    ok, worst = _close(got, want, bound)
    same = _same_everywhere(comm, got)
    assert_all(ok and same, f"{what}: largest error {worst} against {bound}; same bits on "
                            f"every rank: {same}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("algorithm", ["auto"] + list(coll.algorithms("allreduce")))
def test_allreduce_avg_near_the_largest_value(dtype, algorithm):
    if algorithm == "onepass":
        pytest.skip("onepass runs on registered buffers only: tests/test_registered.py")
    comm = world()
    if algorithm != "auto" and refused_off_node("allreduce", algorithm):
        return
    n, r = comm.Get_size(), comm.Get_rank()
    every = _inputs(dtype, 37, n)
    want = every.astype(np.float64).mean(0)
    x = every[r].copy()
    got = coll.allreduce(x, "avg", algorithm=algorithm)
    assert_all(np.array_equal(x, every[r]), "x was modified")
    _check(comm, got, want, _bound(dtype, n, every), f"allreduce {algorithm}")
    coll.allreduce(x, "avg", out=x, algorithm=algorithm)  # in place
    _check(comm, x, want, _bound(dtype, n, every), f"allreduce {algorithm} in place")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("algorithm", ["auto"] + list(coll.algorithms("reduce_scatter")))
def test_reduce_scatter_avg_near_the_largest_value(dtype, algorithm):
    comm = world()
    if algorithm != "auto" and refused_off_node("reduce_scatter", algorithm):
        return
    n, r = comm.Get_size(), comm.Get_rank()
    counts = [5 + (j < 2) for j in range(n)]
    every = _inputs(dtype, sum(counts), n)
    want = every.astype(np.float64).mean(0)
    lo = sum(counts[:r])
    x = every[r].copy()
    got = coll.reduce_scatter(x, "avg", counts=counts, algorithm=algorithm)
    assert_all(np.array_equal(x, every[r]), "x was modified")
    ok, worst = _close(got, want[lo:lo + counts[r]], _bound(dtype, n, every))
    assert_all(ok, f"reduce_scatter {algorithm}: largest error {worst}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("algorithm", ["auto"] + list(coll.algorithms("reduce")))
def test_reduce_avg_near_the_largest_value(dtype, algorithm):
    comm = world()
    if algorithm != "auto" and refused_off_node("reduce", algorithm):
        return
    n, r = comm.Get_size(), comm.Get_rank()
    every = _inputs(dtype, 11, n)
    want = every.astype(np.float64).mean(0)
    x = every[r].copy()
    got = coll.reduce(x, "avg", root=n - 1, algorithm=algorithm)
    assert_all(np.array_equal(x, every[r]), "x was modified")
    ok, worst = _close(got, want, _bound(dtype, n, every)) if r == n - 1 else (got is None, got)
    assert_all(ok, f"reduce {algorithm}: largest error {worst}")


@pytest.mark.mpi
@pytest.mark.parametrize("k", [1, 2])
def test_avg_on_simulated_nodes(monkeypatch, k):
    """Nodes of k ranks (``COLLECTIVES_RANKS_PER_NODE``): the node-aware composites too."""
    from collectives import config
    monkeypatch.setenv("COLLECTIVES_RANKS_PER_NODE", str(k))
    config.reload()
    try:
        comm = world().Dup()  # a new communicator: its topology is read with the setting
        n, r = comm.Get_size(), comm.Get_rank()
        every = _inputs(np.dtype(np.float16), 29, n)
        want = every.astype(np.float64).mean(0)
        for algorithm in ("auto", "hierarchical", "hierarchical_shm", "ring"):
            got = coll.allreduce(every[r].copy(), "avg", comm=comm, algorithm=algorithm)
            _check(comm, got, want, _bound(np.float16, n, every), f"{algorithm}, k = {k}")
        got = coll.reduce_scatter(every[r].copy(), "avg", comm=comm, algorithm="hierarchical")
        assert_all(bool(np.isfinite(got.astype(np.float64)).all()), f"reduce_scatter {got}")
        comm.Free()
    finally:
        monkeypatch.delenv("COLLECTIVES_RANKS_PER_NODE")
        config.reload()


@pytest.mark.mpi
def test_avg_non_blocking_and_persistent_equal_the_blocking_call():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    every = _inputs(np.dtype(np.float16), 17, n)
    x = every[r].copy()
    want = coll.allreduce(x, "avg")
    got = coll.iallreduce(x, "avg").wait()
    out = np.empty_like(x)
    req = coll.allreduce_init(x, "avg", out=out)
    same = []
    for _ in range(4):
        req.start()
        same.append(np.array_equal(req.wait(), want))
    req.free()
    assert_all(np.array_equal(got, want) and all(same) and np.array_equal(x, every[r]),
               f"non-blocking {np.array_equal(got, want)}, persistent {same}")


@pytest.mark.mpi
def test_avg_of_integers_is_refused_on_every_rank():
    with pytest.raises(TypeError, match="avg"):
        coll.allreduce(np.ones(3, np.int32), "avg")


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["auto", "onepass"])
def test_avg_on_registered_buffers(algorithm):
    """Registered buffers (``coll.empty``) above the one-pass threshold: the one-pass path."""
    comm = world()
    if algorithm != "auto" and refused_off_node("allreduce", algorithm):
        return
    n, r = comm.Get_size(), comm.Get_rank()
    count = (1 << 16) // 2 + 3  # float16: just above 64 KiB
    every = _inputs(np.dtype(np.float16), count, n)
    want = every.astype(np.float64).mean(0)
    x = coll.empty(count, np.float16)
    out = coll.empty(count, np.float16)
    x[...] = every[r]
    got = coll.allreduce(x, "avg", out=out, algorithm=algorithm)
    assert_all(got is out and np.array_equal(x, every[r]), "out of place")
    _check(comm, out, want, _bound(np.float16, n, every), f"{algorithm} out of place")
    coll.allreduce(x, "avg", out=x, algorithm=algorithm)
    _check(comm, x, want, _bound(np.float16, n, every), f"{algorithm} in place")
