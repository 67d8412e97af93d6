"""Topology: the table, simulation by rank blocks, NUMA from sysfs, discovery; the traffic
counters over it (``collectives.traffic``) and ``python -m bench topology``."""
import numpy as np
import pytest

from collectives import topology as T
from collectives import traffic


def test_simulated_even_and_uneven():
    t = T.simulated(4, 2)
    assert t.nodes == ((0, 1), (2, 3)) and t.numas == t.nodes and t.leaders == (0, 2)
    t = T.simulated(5, 3)
    assert t.nodes == ((0, 1, 2), (3, 4)) and [t.local_rank(r) for r in range(5)] == \
        [0, 1, 2, 0, 1]
    assert [t.local_size(r) for r in range(5)] == [3, 3, 3, 2, 2]
    t = T.simulated(6, 4, 2)  # 4 + 2 ranks; NUMA blocks restart on every node
    assert t.nodes == ((0, 1, 2, 3), (4, 5)) and t.numas == ((0, 1), (2, 3), (4, 5))
    assert t.has_numa and not t.single_node
    t = T.simulated(3)
    assert t.single_node and not t.has_numa and t.nodes == ((0, 1, 2),)


def test_links_and_kwargs():
    t = T.simulated(6, 3, 2)  # nodes (0 1 2) (3 4 5); numas (0 1) (2) (3 4) (5)
    assert t.link(0, 1) == T.SAME_NUMA and t.link(0, 2) == T.SAME_NODE
    assert t.link(0, 3) == T.OTHER_NODE and t.link(4, 3) == T.SAME_NUMA
    assert t.links(2) == (1, 1, 0, 2, 2, 2)
    assert dict(t.kwargs()) == {"nodes": ((0, 1, 2), (3, 4, 5)),
                                "numas": ((0, 1), (2,), (3, 4), (5,))}
    hash(t.kwargs())  # the API's schedule cache key


def test_immutable_and_value_semantics():
    t = T.simulated(4, 2)
    with pytest.raises(AttributeError):
        t.node = (0, 0, 0, 0)
    assert t == T.Topology([7, 7, 9, 9]) and hash(t) == hash(T.Topology((0, 0, 1, 1)))
    assert "node 1: ranks 2 3" in t.describe()


def test_numa_never_spans_nodes():
    t = T.Topology([0, 0, 1, 1], numa=[0, 0, 0, 0])
    assert t.numas == ((0, 1), (2, 3))


def test_simulated_rejects_nonsense():
    with pytest.raises(ValueError, match="at least 1"):
        T.simulated(4, 0)


def test_cpulist_and_numa_of_cpus(tmp_path):
    assert T._cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node directory
    assert T.numa_of_cpus({1, 2}, str(tmp_path)) == 0
    assert T.numa_of_cpus({5}, str(tmp_path)) == 1
    assert T.numa_of_cpus({3, 4}, str(tmp_path)) == -1        # unbound across domains
    assert T.numa_of_cpus({0}, str(tmp_path / "absent")) == -1


def test_link_traffic_counter():
    c = traffic.LinkTraffic((0, 2, 1))
    c.add(1, 100)
    c.add(2, 7)
    c.add(1, 1)
    assert c.nbytes == [0, 7, 101] and c.messages == [0, 1, 2]
    assert c.as_dict() == {"same_numa": 0, "same_node": 7, "other_node": 101}


def test_sim_traffic_split():
    from collectives import ring
    from collectives.sim import simulate
    t = T.simulated(4, 2)
    _, net = simulate(ring.allreduce, [np.ones(8, np.int64)] * 4, count=8)
    per = [traffic.sim_traffic(net.traffic, t, r) for r in range(4)]
    # the ring 0->1->2->3->0 crosses nodes on 1->2 and 3->0: 2 * 3/4 * 64 bytes each
    assert [p[T.OTHER_NODE] for p in per] == [0, 96, 0, 96]
    assert [p[T.SAME_NUMA] for p in per] == [96, 0, 96, 0]


# -- MPI tier --------------------------------------------------------------------------------
def _env(monkeypatch, k=None, j=None):
    """Simulate k ranks per node and j per NUMA domain (None: unset) through the environment,
    as ``mpiexec -env`` would; the settings are read again, and again after the test."""
    from collectives import config
    for name, v in (("COLLECTIVES_RANKS_PER_NODE", k), ("COLLECTIVES_RANKS_PER_NUMA", j)):
        if v is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(v))
    config.reload()


@pytest.fixture(autouse=True)
def _reread_settings():
    """After each test (and its monkeypatch), settings are read from the environment again."""
    from collectives import config
    yield
    config.reload()


def _mpi_nodes(comm) -> tuple:
    """The node groups MPI itself gives (``Split_type(COMM_TYPE_SHARED)``), each by rank."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    lowest = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    node.Free()
    leaders = comm.allgather(lowest)
    return tuple(tuple(r for r in range(len(leaders)) if leaders[r] == lead)
                 for lead in sorted(set(leaders)))


@pytest.mark.mpi
def test_mpi_real_node(monkeypatch):
    from mpi4py import MPI
    from tests.mpiutil import assert_all
    _env(monkeypatch)
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    try:
        nodes = _mpi_nodes(comm)
        t = T.topology(comm)
        again = T.topology(comm)
        comms = T.communicators(comm)
        mine = t.nodes[t.node[rank]]
        ok = (t is again and t.nodes == nodes and t.single_node == (len(nodes) == 1)
              and t.size == comm.Get_size() and comms.node.Get_size() == len(mine)
              and comms.cross.Get_size() == sum(len(g) > t.local_rank(rank) for g in nodes)
              and (comms.leaders != MPI.COMM_NULL) == (rank == mine[0]))
    finally:
        comm.Free()
    assert_all(ok, repr(t))


@pytest.mark.mpi
@pytest.mark.parametrize("k,j", [(2, None), (3, None), (2, 1), (None, 1)])
def test_mpi_simulated(monkeypatch, k, j):
    from mpi4py import MPI
    from tests.mpiutil import assert_all
    _env(monkeypatch, k, j)
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        t = T.topology(comm)
        want = T.simulated(size, k, j)
        if k is None:  # the real nodes, each cut into NUMA domains of j ranks
            nodes = _mpi_nodes(comm)
            numas = tuple(g[a:a + (j or len(g))] for g in nodes
                          for a in range(0, len(g), j or len(g)))
            want = T.Topology([next(n for n, g in enumerate(nodes) if r in g)
                               for r in range(size)],
                              [next(n for n, g in enumerate(numas) if r in g)
                               for r in range(size)])
        comms = T.communicators(comm)
        node = t.nodes[t.node[rank]]
        ok = (t == want and comms.node.Get_size() == len(node)
              and comms.cross.Get_size() == sum(len(g) > t.local_rank(rank) for g in t.nodes)
              and comms.numa.Get_size() == len(t.numas[t.numa[rank]]))
    finally:
        comm.Free()
    assert_all(ok, f"{t!r} != {want!r}")


@pytest.mark.mpi
def test_mpi_env_must_agree(monkeypatch):
    from mpi4py import MPI
    from tests.mpiutil import assert_all
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_size() == 1:
        comm.Free()
        pytest.skip("needs two ranks to disagree")
    _env(monkeypatch, 1 + comm.Get_rank() % 2)
    try:
        with pytest.raises(ValueError, match="disagree"):
            T.discover(comm)
        _env(monkeypatch, "x")
        with pytest.raises(ValueError, match="positive integers.*expected an integer"):
            T.discover(comm)
        ok = True
    finally:
        comm.Free()
    assert_all(ok)


@pytest.mark.mpi
def test_mpi_bench_topology_prints_topology_and_traffic(monkeypatch, capsys):
    from mpi4py import MPI

    from bench import topology as cli
    _env(monkeypatch, 2)
    comm = MPI.COMM_WORLD.Dup()
    try:
        assert cli.main([], comm) == 0
        assert cli.main(["--traffic", "0.01"], comm) == 0
    finally:
        comm.Free()
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "node 0: ranks 0" in out and "rank 0: host" in out
        assert "hierarchical_shm  other_node" in out
    else:
        assert out == ""


@pytest.mark.mpi
def test_mpi_count_traffic_only_inside_block(monkeypatch):
    import collectives as coll
    from mpi4py import MPI
    from tests.mpiutil import assert_all
    _env(monkeypatch, 1)  # every rank its own node: every byte crosses
    comm = MPI.COMM_WORLD.Dup()
    size = comm.Get_size()
    try:
        x = np.ones(1000, np.int64)
        coll.allreduce(x, comm=comm, algorithm="ring")
        with traffic.count_traffic(comm) as t:
            coll.allreduce(x, comm=comm, algorithm="ring")
        coll.allreduce(x, comm=comm, algorithm="ring")
        # a ring rank sends 2 (n - 1) / n of the buffer (balanced blocks: within one block)
        want = 2 * (size - 1) * 8000 / size
        ok = (abs(t.nbytes[T.OTHER_NODE] - want) <= 2 * 8 * size and t.nbytes[0] == 0
              and context_counter_cleared(comm))
    finally:
        comm.Free()
    assert_all(ok, repr(t))


def context_counter_cleared(comm) -> bool:
    from collectives.executor import context
    return context(comm).transport.counter is None
