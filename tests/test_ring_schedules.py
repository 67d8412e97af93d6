"""In-process tier: ring schedules and the Schedule model, for n = 1..33 virtual ranks."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives import ring
from collectives.schedule import IN, OUT, TMP, Schedule, split
from collectives.sim import Deadlock, simulate

SIZES = list(range(1, 34))


def lengths(n):
    return sorted({0, 1, max(0, n - 1), n + 1, 13, 97, 1000})


def data(r, count, dtype=np.int64):
    """Rank-dependent exact integers: rank r, element i -> (r + 1) * 1000 + i."""
    return ((r + 1) * 1000 + np.arange(count)).astype(dtype)


def expected_sum(n, count):
    # sum_r (r+1)*1000 + i  =  1000 n (n+1) / 2 + n i
    return 1000 * n * (n + 1) // 2 + n * np.arange(count, dtype=np.int64)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("seg", [None, 7])
def test_ring_allreduce_exact(n, seg):
    for count in lengths(n):
        outs, _ = simulate(ring.allreduce, [data(r, count) for r in range(n)], "sum",
                           count=count, seg=seg)
        for r, out in enumerate(outs):
            assert np.array_equal(out, expected_sum(n, count)), (n, count, seg, r)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16])
def test_ring_allreduce_in_place(n):
    for count in lengths(n):
        ins = [data(r, count) for r in range(n)]
        outs, _ = simulate(ring.allreduce, ins, "sum", count=count, seg=4, inplace=True)
        assert all(np.array_equal(o, expected_sum(n, count)) for o in outs)
        if count:  # the result is in the input arrays themselves
            assert all(np.shares_memory(o, x) for o, x in zip(outs, ins))


@pytest.mark.parametrize("op,ref", [("max", np.maximum.reduce), ("min", np.minimum.reduce),
                                    ("bxor", np.bitwise_xor.reduce), ("prod", np.prod)])
def test_ring_allreduce_ops(op, ref):
    n, count = 5, 37
    rng = np.random.default_rng(0)
    ins = [rng.integers(1, 4, count).astype(np.int64) for _ in range(n)]
    outs, _ = simulate(ring.allreduce, ins, op, count=count, seg=5)
    want = ref(np.stack(ins), axis=0)
    assert all(np.array_equal(o, want) for o in outs)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_allreduce_float_bitwise_identical(n):
    rng = np.random.default_rng(n)
    count = 1001
    ins = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    outs, _ = simulate(ring.allreduce, ins, "sum", count=count, seg=7)
    for o in outs[1:]:
        assert o.tobytes() == outs[0].tobytes()
    np.testing.assert_allclose(outs[0], np.sum(np.stack(ins).astype(np.float64), 0),
                               rtol=1e-5, atol=1e-5)


def ragged(n, rng):
    counts = [int(c) for c in rng.integers(0, 6, n)]
    if n > 1:
        counts[rng.integers(0, n)] = 0
    return counts


@pytest.mark.parametrize("n", SIZES)
def test_ring_reduce_scatter_ragged(n):
    rng = np.random.default_rng(n)
    for counts in ([1] * n, split_counts(97, n), ragged(n, rng)):
        total = sum(counts)
        outs, _ = simulate(ring.reduce_scatter, [data(r, total) for r in range(n)], "sum",
                           counts=tuple(counts), seg=2)
        want = expected_sum(n, total)
        bounds = np.cumsum([0] + counts)
        for r, out in enumerate(outs):
            assert np.array_equal(out, want[bounds[r]:bounds[r + 1]]), (n, counts, r)


def split_counts(count, n):
    b = split(count, n)
    return [b[k + 1] - b[k] for k in range(n)]


@pytest.mark.parametrize("n", SIZES)
def test_ring_allgather_ragged(n):
    rng = np.random.default_rng(100 + n)
    for counts in ([0] * n, [1] * n, ragged(n, rng), split_counts(101, n)):
        ins = [data(r, counts[r]) for r in range(n)]
        outs, _ = simulate(ring.allgather, ins, "sum", counts=tuple(counts), seg=2)
        want = np.concatenate(ins)
        assert all(np.array_equal(o, want) for o in outs), (n, counts)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("seg", [None, 4])
def test_ring_broadcast_every_root(n, seg):
    count = 23
    for root in sorted({0, n // 2, n - 1}):
        ins = [data(r, count) if r == root else np.zeros(count, np.int64) for r in range(n)]
        outs, _ = simulate(ring.broadcast, ins, "sum", count=count, root=root, seg=seg,
                           inplace=True)
        assert all(np.array_equal(o, data(root, count)) for o in outs)


def test_ring_traffic_is_bandwidth_optimal():
    n, count = 4, 4000
    _, net = simulate(ring.allreduce, [data(r, count) for r in range(n)], "sum", count=count,
                      seg=100)
    for r in range(n):  # 2 (n-1)/n of the buffer, in bytes
        assert net.traffic.sent_by(r) == 2 * (n - 1) * (count // n) * 8


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), count=st.integers(0, 200), seg=st.one_of(st.none(),
       st.integers(1, 50)), dtype=st.sampled_from([np.int32, np.int64, np.uint16]))
def test_ring_allreduce_property(n, count, seg, dtype):
    ins = [(data(r, count) % 100).astype(dtype) for r in range(n)]
    outs, _ = simulate(ring.allreduce, ins, "sum", count=count, seg=seg)
    want = np.sum(np.stack(ins).astype(np.int64), axis=0).astype(dtype) if count else ins[0]
    assert all(np.array_equal(o, want) for o in outs)


# -- the Schedule model ------------------------------------------------------------------------
def test_split_matches_numpy_array_split():
    for count in range(0, 40):
        for parts in range(1, 9):
            sizes = [len(a) for a in np.array_split(np.arange(count), parts)]
            b = split(count, parts)
            assert [b[k + 1] - b[k] for k in range(parts)] == sizes


def test_deps_follow_region_overlaps():
    s = Schedule(0, 2, 10)
    s.recv(1, (TMP, 0, 5))          # 0
    s.reduce((OUT, 0, 5), (IN, 0, 5), (TMP, 0, 5))   # 1: after 0 (reads TMP it wrote)
    s.send(1, (OUT, 5, 10))         # 2: independent
    s.recv(1, (TMP, 0, 5))          # 3: after 1 (overwrites TMP that 1 read)
    s.tmp = 5
    assert s.deps() == [(), (0,), (), (0, 1)]


def test_empty_regions_are_dropped_and_regions_checked():
    s = Schedule(0, 2, 4)
    s.send(1, (IN, 2, 2))
    assert len(s) == 0
    s.copy((OUT, 0, 4), (IN, 0, 4))
    s.copy((IN, 0, 4), (OUT, 0, 4))
    with pytest.raises(ValueError, match="writes the input"):
        s.validate()


def test_simulator_detects_deadlock():
    def bad(rank, size):
        s = Schedule(rank, size, 4)
        s.recv(1 - rank, (OUT, 0, 4))  # both receive first: never matched under rendezvous
        s.send(1 - rank, (IN, 0, 4))
        return s
    with pytest.raises(Deadlock, match="deadlock"):
        simulate(bad, [np.zeros(4), np.zeros(4)], "sum")
