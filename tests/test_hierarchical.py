"""Hierarchical collectives: in-process over many simulated topologies, then under mpiexec.

In-process: every collective for n = 1..9 ranks cut into nodes of k and NUMA domains of j
consecutive ranks (even and uneven: 5 = 3 + 2), lengths 0, 1, primes, tiny segments; exact
integer data with closed forms. Traffic: under 2-node topologies the bytes a rank sends across
the node boundary in a hierarchical allreduce are at most 1/k of the most a flat ring rank sends.

MPI tier: the same collectives through the public API with ``COLLECTIVES_RANKS_PER_NODE`` (and
``_NUMA``) simulating topologies on a fresh communicator, plus the real single node, and the
traffic bound from the executor's counters (``collectives.traffic.count_traffic``).
"""
import numpy as np
import pytest

from collectives import hierarchical, ring
from collectives.schedule import offsets
from collectives.sim import simulate
from collectives.topology import OTHER_NODE, simulated
from collectives.traffic import sim_traffic

SHAPES = [(n, k, j) for n in range(1, 10) for k in sorted({1, 2, 3, n}) if k <= n
          for j in (None, 1, 2) if j is None or j < k]
LENGTHS = (0, 1, 2, 7, 13, 97)


def kw(n, k, j):
    return dict(simulated(n, k, j).kwargs())


def data(r, count):
    """Rank r, element i -> (r + 1) * 1000 + i: a wrong rank's contribution shows."""
    return ((r + 1) * 1000 + np.arange(count)).astype(np.int64)


def total(n, count):
    return 1000 * n * (n + 1) // 2 + n * np.arange(count, dtype=np.int64)


@pytest.mark.parametrize("n,k,j", SHAPES)
@pytest.mark.parametrize("seg", [None, 3])
def test_allreduce(n, k, j, seg):
    for count in LENGTHS:
        outs, _ = simulate(hierarchical.allreduce, [data(r, count) for r in range(n)],
                           count=count, seg=seg, **kw(n, k, j))
        for r, out in enumerate(outs):
            assert np.array_equal(out, total(n, count)), (n, k, j, count, seg, r)


@pytest.mark.parametrize("n,k,j", [(4, 2, None), (5, 3, None), (6, 4, 2), (7, 3, 2)])
def test_allreduce_in_place(n, k, j):
    for count in LENGTHS:
        ins = [data(r, count) for r in range(n)]
        outs, _ = simulate(hierarchical.allreduce, ins, count=count, seg=2, inplace=True,
                           **kw(n, k, j))
        assert all(np.array_equal(o, total(n, count)) for o in outs), (n, k, j, count)


@pytest.mark.parametrize("op,ref", [("max", np.maximum.reduce), ("min", np.minimum.reduce),
                                    ("bxor", np.bitwise_xor.reduce), ("prod", np.prod)])
def test_allreduce_ops(op, ref):
    n, count = 5, 37
    rng = np.random.default_rng(0)
    ins = [rng.integers(1, 4, count).astype(np.int64) for _ in range(n)]
    outs, _ = simulate(hierarchical.allreduce, ins, op, count=count, seg=5, **kw(5, 3, 2))
    assert all(np.array_equal(o, ref(np.stack(ins), axis=0)) for o in outs)


@pytest.mark.parametrize("n,k,j", [(4, 2, None), (5, 3, None), (6, 4, 2), (8, 3, 2)])
def test_allreduce_floats_bitwise_identical(n, k, j):
    rng = np.random.default_rng(n)
    ins = [rng.standard_normal(101).astype(np.float32) for _ in range(n)]
    outs, _ = simulate(hierarchical.allreduce, ins, count=101, seg=8, **kw(n, k, j))
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)
    assert np.allclose(outs[0], np.sum(np.stack(ins).astype(np.float64), 0), atol=1e-4)


def ragged(n, count):
    """Per-rank counts that differ, with empty blocks when count < n."""
    return [(count + r) // n if r % 2 else max(0, (count - r) // n) for r in range(n)]


@pytest.mark.parametrize("n,k,j", SHAPES)
def test_reduce_scatter(n, k, j):
    for count in LENGTHS:
        for counts in ({tuple((count + r) // n for r in range(n)), tuple(ragged(n, count))}):
            b = offsets(counts)
            want = total(n, b[-1])
            outs, _ = simulate(hierarchical.reduce_scatter, [data(r, b[-1]) for r in range(n)],
                               counts=counts, seg=3, **kw(n, k, j))
            for r, out in enumerate(outs):
                assert np.array_equal(out, want[b[r]:b[r + 1]]), (n, k, j, counts, r)


@pytest.mark.parametrize("n,k,j", SHAPES)
def test_allgather(n, k, j):
    for count in LENGTHS:
        for counts in ({tuple((count + r) // n for r in range(n)), tuple(ragged(n, count))}):
            b = offsets(counts)
            ins = [np.arange(b[r], b[r + 1], dtype=np.int64) * 7 + 1 for r in range(n)]
            outs, _ = simulate(hierarchical.allgather, ins, counts=counts, seg=3, **kw(n, k, j))
            for r, out in enumerate(outs):
                assert np.array_equal(out, np.arange(b[-1]) * 7 + 1), (n, k, j, counts, r)


@pytest.mark.parametrize("n,k,j", SHAPES)
def test_reduce_every_root(n, k, j):
    for count in (0, 1, 13):
        ins = [data(r, count) for r in range(n)]
        for root in range(n):
            outs, _ = simulate(hierarchical.reduce, ins, count=count, root=root, seg=3,
                               **kw(n, k, j))
            assert np.array_equal(outs[root], total(n, count)), (n, k, j, count, root)


@pytest.mark.parametrize("n,k,j", SHAPES)
def test_broadcast_every_root(n, k, j):
    for count in (0, 1, 13):
        for root in range(n):
            bufs = [np.arange(count) + 5 if r == root else np.zeros(count, np.int64)
                    for r in range(n)]
            outs, _ = simulate(hierarchical.broadcast, bufs, count=count, root=root, seg=3,
                               inplace=True, **kw(n, k, j))
            assert all(np.array_equal(o, np.arange(count) + 5) for o in outs), (n, k, j, root)


def test_default_topology_is_one_node():
    outs, _ = simulate(hierarchical.allreduce, [data(r, 11) for r in range(4)], count=11)
    assert all(np.array_equal(o, total(4, 11)) for o in outs)


def test_levels_drop_repeats_and_validate():
    assert hierarchical.levels(4, ((0, 1), (2, 3)), ((0, 1), (2, 3))) == \
        (((0, 1), (2, 3)), ((0, 1, 2, 3),))
    assert hierarchical.levels(4, ((0, 1, 2, 3),), ((0,), (1,), (2,), (3,))) == \
        (((0, 1, 2, 3),),)
    assert len(hierarchical.levels(6, ((0, 1, 2, 3), (4, 5)), ((0, 1), (2, 3), (4, 5)))) == 3
    with pytest.raises(ValueError, match="partition"):
        hierarchical.levels(4, ((0, 1), (2,)), None)
    with pytest.raises(ValueError, match="spans several nodes"):
        hierarchical.levels(4, ((0, 1), (2, 3)), ((0,), (1, 2), (3,)))


@pytest.mark.parametrize("n,k,j", SHAPES)
def test_plan_owners_partition_the_buffer(n, k, j):
    """Each level's jobs cover every element once per group; blocks lie inside [0, count)."""
    count = 29
    lv = hierarchical.levels(n, **kw(n, k, j))
    for level, jobs in zip(lv, hierarchical.plan(n, count, lv)):
        covered = {g: np.zeros(count, int) for g in level}
        for members, blocks in jobs:
            group = next(g for g in level if members[0] in g)
            assert set(members) <= set(group) and len(set(members)) == len(members) > 1
            for blk in blocks:
                for a, b in blk:
                    covered[group][a:b] += 1
        for g, c in covered.items():
            assert (c == 1).all() or (not jobs_of(jobs, g) and (c == 0).all()), (level, g)


def jobs_of(jobs, group):
    return [job for job in jobs if job[0][0] in group]


# -- traffic ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,j", [(4, 2, None), (5, 3, None), (6, 3, None), (8, 4, None),
                                   (6, 3, 1), (8, 4, 2), (12, 6, 3)])
def test_cross_node_bytes_at_most_one_kth_of_ring(n, k, j):
    topo = simulated(n, k, j)
    count = 7 * 360
    ins = [np.ones(count, np.float32) for _ in range(n)]
    _, hier = simulate(hierarchical.allreduce, ins, count=count, **dict(topo.kwargs()))
    _, flat = simulate(ring.allreduce, ins, count=count)
    h = max(sim_traffic(hier.traffic, topo, r)[OTHER_NODE] for r in range(n))
    f = max(sim_traffic(flat.traffic, topo, r)[OTHER_NODE] for r in range(n))
    # The bound: 2 (P - 1) / P * N / k per rank against up to 2 (n - 1) / n * N for a ring rank.
    nodes = len(topo.nodes)
    assert h == pytest.approx(2 * (nodes - 1) / nodes * count * 4 / k, rel=0.02) or n % k
    assert h * min(len(g) for g in topo.nodes) <= f, (h, f, k)


# -- MPI tier --------------------------------------------------------------------------------
def _fresh_comm(monkeypatch, k=None, j=None):
    """A new communicator on k ranks per node and j per NUMA domain (None: unset), set through
    the environment as ``mpiexec -env`` would (the settings are read again)."""
    from mpi4py import MPI

    from collectives import config
    for name, v in (("COLLECTIVES_RANKS_PER_NODE", k), ("COLLECTIVES_RANKS_PER_NUMA", j)):
        if v is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(v))
    config.reload()
    return MPI.COMM_WORLD.Dup()


@pytest.fixture(autouse=True)
def _reread_settings():
    """After each test (and its monkeypatch), settings are read from the environment again."""
    from collectives import config
    yield
    config.reload()


MPI_SHAPES = [(None, None), (2, None), (3, None), (4, 2), (3, 1)]


@pytest.mark.mpi
@pytest.mark.parametrize("k,j", MPI_SHAPES)
def test_mpi_every_collective(monkeypatch, k, j):
    import collectives as coll
    from collectives import config
    from tests.mpiutil import assert_all
    comm = _fresh_comm(monkeypatch, k, j)
    rank, size = comm.Get_rank(), comm.Get_size()
    old = config.set("COLLECTIVES_SEGMENT_BYTES", 40)
    bad = []
    try:
        for count in (0, 1, 7, 97):
            for dtype in (np.int64, np.float32, np.int8):
                xs = [((r + 1) * 3 + np.arange(count) % 5).astype(dtype) for r in range(size)]
                want = sum(x.astype(np.int64) for x in xs).astype(dtype) if count else xs[0]
                got = coll.allreduce(xs[rank], comm=comm, algorithm="hierarchical")
                if not np.array_equal(got, want):
                    bad.append(("allreduce", count, dtype))
                y = xs[rank].copy()
                coll.allreduce(y, out=y, comm=comm, algorithm="hierarchical")
                if not np.array_equal(y, want):
                    bad.append(("allreduce in place", count, dtype))
                rs = coll.reduce_scatter(xs[rank], comm=comm, algorithm="hierarchical")
                b = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(count), size)])
                if not np.array_equal(rs, want[b[rank]:b[rank + 1]]):
                    bad.append(("reduce_scatter", count, dtype))
                ag = coll.allgather(xs[rank][:count - rank if count > rank else 0], comm=comm,
                                    algorithm="hierarchical")
                wag = np.concatenate([xs[r][:max(0, count - r)] for r in range(size)])
                if not np.array_equal(ag, wag):
                    bad.append(("allgather", count, dtype))
                for root in range(size):
                    bc = xs[rank].copy()
                    coll.broadcast(bc, root=root, comm=comm, algorithm="hierarchical")
                    if not np.array_equal(bc, xs[root]):
                        bad.append(("broadcast", count, dtype, root))
                    red = coll.reduce(xs[rank], root=root, comm=comm, algorithm="hierarchical")
                    if rank == root and not np.array_equal(red, want):
                        bad.append(("reduce", count, dtype, root))
        req = coll.iallreduce(np.full(33, rank, np.int64), comm=comm, algorithm="hierarchical")
        if not (req.wait() == size * (size - 1) // 2).all():
            bad.append(("iallreduce",))
    finally:
        config.set("COLLECTIVES_SEGMENT_BYTES", old)
        comm.Free()
    assert_all(not bad, f"k={k} j={j}: {bad[:5]}")


@pytest.mark.mpi
@pytest.mark.parametrize("k", [2, 3])
def test_mpi_cross_node_bytes_from_executor_counters(monkeypatch, k):
    """The executor's per-link counters: hierarchical <= ring / k across the node boundary.

    With uneven nodes k is the smallest node's size (a rank alone on its node must export all
    of its data, whatever the algorithm).
    """
    import collectives as coll
    from collectives.topology import topology
    from collectives.traffic import count_traffic
    from tests.mpiutil import assert_all
    comm = _fresh_comm(monkeypatch, k)
    size = comm.Get_size()
    try:
        topo = topology(comm)
        if len(topo.nodes) < 2:
            pytest.skip(f"{size} ranks make a single node of {k}")
        k = min(len(g) for g in topo.nodes)
        x = np.ones(1 << 14, np.float32)
        sent = {}
        for algorithm in ("ring", "hierarchical"):
            with count_traffic(comm) as t:
                coll.allreduce(x, comm=comm, algorithm=algorithm)
            sent[algorithm] = comm.allreduce(t.nbytes[OTHER_NODE], op=_max())
    finally:
        comm.Free()
    assert_all(sent["hierarchical"] * k <= sent["ring"] and sent["ring"] > 0, str(sent))


def _max():
    from mpi4py import MPI
    return MPI.MAX


@pytest.mark.mpi
@pytest.mark.parametrize("k", [None, 1, 2, 3])
def test_mpi_hierarchical_shm(monkeypatch, k):
    """shm node stages: 2 x 2 at n = 4; uneven nodes (3 + 2) fall back to the schedule."""
    import collectives as coll
    from collectives import config
    from tests.mpiutil import assert_all
    comm = _fresh_comm(monkeypatch, k)
    rank, size = comm.Get_rank(), comm.Get_size()
    old = config.set("COLLECTIVES_SHM_CHUNK_BYTES", 128)
    bad = []
    try:
        for count in (0, 1, 7, 97, 1000):
            for dtype in (np.int64, np.float64, np.bool_):
                xs = [((r + 1) * 3 + np.arange(count) % 5).astype(dtype) for r in range(size)]
                want = xs[0].copy()
                for x in xs[1:]:
                    want = want + x if dtype != np.bool_ else want | x
                got = coll.allreduce(xs[rank], comm=comm, algorithm="hierarchical_shm")
                y = xs[rank].copy()
                coll.allreduce(y, out=y, comm=comm, algorithm="hierarchical_shm")
                if not (np.array_equal(got, want) and np.array_equal(y, want)):
                    bad.append((count, np.dtype(dtype).name))
        avg = coll.allreduce(np.full(10, float(rank)), "avg", comm=comm,
                             algorithm="hierarchical_shm")
        if not np.allclose(avg, (size - 1) / 2):
            bad.append(("avg", avg[0]))
        reqs = [coll.iallreduce(np.full(50, rank + i, np.int64), comm=comm,
                                algorithm="hierarchical_shm") for i in range(3)]
        if not all((q.wait() == size * (size - 1) // 2 + size * i).all()
                   for i, q in enumerate(reqs)):
            bad.append(("iallreduce",))
    finally:
        config.set("COLLECTIVES_SHM_CHUNK_BYTES", old)
        comm.Free()
    assert_all(not bad, f"k={k}: {bad[:5]}")
