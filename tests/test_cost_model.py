"""The alpha-beta-gamma cost model (collectives.costmodel): closed-form cases, symmetry,
parameters."""
import json
import math

import pytest

from collectives import config, ring, sim, tree
from collectives import costmodel as cm
from collectives.schedule import IN, OUT, TMP, Schedule
from collectives.topology import simulated

ALPHA, BW, NET_ALPHA, NET_BW = 2e-6, 1e9, 5e-6, 4e9
RED_BW, COPY_BW, O = 2e9, 8e9, 1e-6


def model(call=0.0, overhead=O):
    return cm.CostModel({"numa": ALPHA, "node": ALPHA, "net": NET_ALPHA},
                         {"numa": BW, "node": BW, "net": NET_BW}, RED_BW, COPY_BW,
                         overhead, call)


def one_message(rank, nbytes, src=0, dst=1, size=2):
    s = Schedule(rank, size, nbytes)
    if rank == src:
        s.send(dst, (OUT, 0, nbytes))
    elif rank == dst:
        s.recv(src, (OUT, 0, nbytes))
    return s


def test_one_message_inside_a_node():
    m = 1000
    p = cm.critical_path([one_message(r, m) for r in range(2)], simulated(2), model(), 1)
    # issue the send, copy the bytes (both CPUs), latency, complete the receive
    assert p.time == pytest.approx(O + m / BW + ALPHA + O)
    assert p.path["transfer"] == pytest.approx(m / BW)
    assert p.path["latency"] == pytest.approx(ALPHA)
    assert p.path["overhead"] == pytest.approx(2 * O)
    assert p.hops == 1


def test_one_message_over_the_network_and_call_overhead():
    m = 4000
    topo = simulated(2, ranks_per_node=1)
    p = cm.critical_path([one_message(r, m) for r in range(2)], topo, model(call=7e-6), 1)
    assert p.time == pytest.approx(7e-6 + O + m / NET_BW + NET_ALPHA + O)


def test_pingpong_closed_form():
    m, trips = 64, 5
    scheds = []
    for r in range(2):
        s = Schedule(r, 2, m)
        for _ in range(trips):
            if r == 0:
                s.send(1, (OUT, 0, m))
                s.recv(1, (OUT, 0, m))
            else:
                s.recv(0, (OUT, 0, m))
                s.send(0, (OUT, 0, m))
        scheds.append(s)
    p = cm.critical_path(scheds, simulated(2), model(), 1)
    assert p.time == pytest.approx(2 * trips * (2 * O + ALPHA + m / BW))
    assert p.hops == 2 * trips


def test_reduce_and_copy_cost_and_oversubscription():
    n = 1 << 20
    s = Schedule(0, 1, n)
    t = s.scratch(n)
    s.reduce((OUT, 0, n), (OUT, 0, n), (TMP, t, t + n))
    s.copy((TMP, t, t + n), (OUT, 0, n))
    p = cm.critical_path([s], simulated(1), model(), 4)
    want = 2 * O + 4 * n / RED_BW + 4 * n / COPY_BW
    assert p.time == pytest.approx(want)
    assert p.path["compute"] == pytest.approx(want)
    # 4 ranks on a node of 2 cores: ranks 0 and 2 share core 0, 1 and 3 core 1. Two ranks with
    # that work: sharing a core they take twice as long, on two cores no longer than one.
    busy = simulated(4, cores_per_node=2)
    assert busy.oversubscription == 2
    assert simulated(3, cores_per_node=2).oversubscription == 2
    for pair, factor in (((0, 2), 2), ((0, 1), 1)):
        scheds = {r: s if r in pair else Schedule(r, 4, n) for r in range(4)}
        assert cm.critical_path(scheds, busy, model(), 4).time == pytest.approx(factor * want)


def test_rates_by_size():
    curves = {"reduce": [(1 << 20, 8e9), (64 << 20, 2e9)], "node": [(1 << 20, 4e9)]}
    m = cm.CostModel({"numa": ALPHA, "node": ALPHA, "net": NET_ALPHA},
                      {"numa": BW, "node": BW, "net": NET_BW}, RED_BW, COPY_BW, curves=curves)
    assert m.sized(1 << 10).reduce_bandwidth == 8e9          # flat below the first point
    assert m.sized(64 << 30).reduce_bandwidth == 2e9         # and beyond the last
    assert m.sized(8 << 20).reduce_bandwidth == pytest.approx(4e9)  # log-log: halfway
    assert m.sized(8 << 20).bandwidth["numa"] == 4e9 == m.sized(8 << 20).bandwidth["node"]
    assert m.sized(8 << 20).bandwidth["net"] == NET_BW
    assert m.sized(8 << 20).copy_bandwidth == COPY_BW        # no curve: the scalar
    assert model().sized(1 << 20) is not None and not model().curves
    back = cm.CostModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back.sized(8 << 20).reduce_bandwidth == pytest.approx(4e9)
    with pytest.raises(ValueError, match="unknown curve"):
        cm.CostModel(m.alpha, m.bandwidth, 1, 1, curves={"disk": [(1, 1)]})
    with pytest.raises(ValueError, match="rate > 0"):
        cm.CostModel(m.alpha, m.bandwidth, 1, 1, curves={"copy": [(1, 0)]})
    # predict reads the rates at the call's size: a reduction-bound binomial allreduce of 1 MiB
    # at 8 GB/s beats the same at the scalar 2 GB/s
    fast = cm.predict("allreduce", "binomial", 2, 1 << 20, model=m).time
    flat = cm.predict("allreduce", "binomial", 2, 1 << 20, model=model(overhead=0.0)).time
    assert fast < flat


def test_nic_is_shared_by_the_ranks_of_a_node():
    m = 8000
    topo = simulated(4, ranks_per_node=2)
    scheds = []
    for r in range(4):
        s = Schedule(r, 4, m)
        if r < 2:
            s.send(r + 2, (OUT, 0, m))
        else:
            s.recv(r - 2, (OUT, 0, m))
        scheds.append(s)
    p = cm.critical_path(scheds, topo, model(), 1)
    # the second message waits for the node's NIC
    assert p.time == pytest.approx(O + 2 * m / NET_BW + NET_ALPHA + O)


def test_deadlock_is_reported():
    s0 = Schedule(0, 2, 4)
    s0.recv(1, (OUT, 0, 4))
    s1 = Schedule(1, 2, 4)
    with pytest.raises(sim.Deadlock, match="never sent"):
        cm.critical_path([s0, s1], simulated(2), model(), 1)


def _closure(deps):
    anc = []
    for d in deps:
        a = set(d)
        for j in d:
            a |= anc[j]
        anc.append(a)
    return anc


def _conflicts(s):
    """The dependencies by definition, in O(ops^2): every earlier op that touches an overlapping
    region of the same buffer (IN is OUT when aliased), one of the two accesses a write."""
    def key(buf):
        return OUT if buf == IN and s.alias else buf

    accesses = []
    for _kind, _peer, dst, srcs in s.ops:
        acc = [(key(b), lo, hi, False) for b, lo, hi in srcs]
        if dst is not None:
            acc.append((key(dst[0]), dst[1], dst[2], True))
        accesses.append(acc)
    return [tuple(j for j in range(i) if any(
        b == c and lo < d and e < hi and (w or x)
        for b, lo, hi, w in accesses[i] for c, e, d, x in accesses[j]))
        for i in range(len(s.ops))]


@pytest.mark.parametrize("builder", [ring.allreduce, tree.allreduce, tree.binomial_allreduce,
                                     tree.rabenseifner_allreduce,
                                     tree.double_binary_tree_allreduce])
@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_deps_order_like_every_conflict(builder, size):
    """``Schedule.deps()`` (interval maps, O(log) per access) keeps exactly the ordering of
    every conflicting pair of accesses: the transitive closures are equal."""
    for count in (1, 7, 40):
        for r in range(size):
            s = builder(r, size, count, seg=3)
            assert _closure(s.deps()) == _closure(_conflicts(s))


def test_topology_links_and_period():
    t = simulated(16, ranks_per_node=8, ranks_per_numa=4)
    assert cm.LINKS[t.link(0, 3)] == "numa"
    assert cm.LINKS[t.link(0, 4)] == "node"
    assert cm.LINKS[t.link(7, 8)] == "net"
    assert t.period() == 8
    assert simulated(8).period() == 1
    assert simulated(8, ranks_per_numa=2).period() == 2
    assert simulated(12, ranks_per_node=8).period() is None
    assert t.nodes == (tuple(range(8)), tuple(range(8, 16)))
    ragged = simulated(16, ranks_per_node=8, ranks_per_numa=3)  # domains of 3, 3, 2 a node
    assert ragged.period() == 8 and cm.LINKS[cm.link_classes(ragged)(6, 7)] == "numa"
    assert cm.LINKS[cm.link_classes(simulated(8))(0, 7)] == "node"  # no NUMA split
    with pytest.raises(ValueError):
        simulated(0)


def test_cost_model_file_round_trip(tmp_path):
    m = model(call=3e-5)
    path = m.save(tmp_path / "cm.json")
    back = cm.CostModel.load(path)
    assert back.to_dict() == m.to_dict()
    assert json.loads(path.read_text())["links"]["net"]["bandwidth"] == NET_BW
    faster = m.replace(net=(1e-6, None))
    assert faster.alpha["net"] == 1e-6 and faster.bandwidth["net"] == NET_BW
    with pytest.raises(ValueError, match="bandwidth"):
        m.replace(node=(None, 0))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a cost model"):
        cm.CostModel.load(tmp_path / "bad.json")


def test_default_path_and_fallback(tmp_path, monkeypatch):
    old = config.set("COLLECTIVES_COST_MODEL", str(tmp_path / "none.json"))
    try:
        with pytest.raises(ValueError, match="COLLECTIVES_COST_MODEL=.*no such file.*calibrate"):
            cm.CostModel.load()
        with pytest.raises(FileNotFoundError, match="calibrate"):
            cm.CostModel.load(tmp_path / "other.json")
        config.set("COLLECTIVES_COST_MODEL", None)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        assert cm.CostModel.load() is cm.DEFAULT_MODEL
    finally:
        config.set("COLLECTIVES_COST_MODEL", old)


@pytest.mark.parametrize("name, kind", [("ring", "shift"), ("recursive_doubling", "xor"),
                                        ("rabenseifner", "xor")])
def test_symmetry_matches_simulating_every_rank(name, kind):
    topo = simulated(64, ranks_per_node=8)
    fast = cm.predict("allreduce", name, 64, 1 << 20, topology=topo, model=model())
    full = cm.predict("allreduce", name, 64, 1 << 20, topology=topo, model=model(),
                       symmetry="none")
    assert fast.method == f"{kind} symmetry" and fast.simulated == 8
    assert full.method == "all ranks" and full.simulated == 64
    assert fast.time == pytest.approx(full.time, rel=1e-9)


def test_no_symmetry_for_rooted_trees():
    topo = simulated(32, ranks_per_node=4)
    p = cm.predict("allreduce", "tree", 32, 1 << 16, topology=topo, model=model())
    assert p.method == "all ranks"


def test_extrapolation_close_to_full_simulation():
    topo = simulated(16, ranks_per_node=4)
    kw = dict(topology=topo, model=model(), seg_bytes=4096)
    full = cm.predict("broadcast", "tree", 16, 1 << 20, **kw)
    est = cm.predict("broadcast", "tree", 16, 1 << 20, max_ops=1500, **kw)
    assert est.method.startswith("extrapolated")
    assert est.time == pytest.approx(full.time, rel=0.05)


def test_predict_scales_like_alpha_beta():
    topo = simulated(4)
    small = cm.predict("allreduce", "ring", 4, 1024, topology=topo, model=model())
    big = cm.predict("allreduce", "ring", 4, 64 << 20, topology=topo, model=model())
    bigger = cm.predict("allreduce", "ring", 4, 128 << 20, topology=topo, model=model())
    assert small.time < big.time < bigger.time
    # large messages are bandwidth-bound: twice the bytes, about twice the time
    assert bigger.time / big.time == pytest.approx(2, rel=0.05)
    assert cm.predict("allreduce", "ring", 1, 1024, model=model()).time == 0


def test_predict_refuses_what_is_not_a_schedule():
    with pytest.raises(ValueError, match="not a schedule"):
        cm.predict("allreduce", "native", 4, 1024, model=model())
    with pytest.raises(ValueError, match="symmetry"):
        cm.predict("allreduce", "ring", 4, 1024, model=model(), symmetry="maybe")
    with pytest.raises(ValueError, match="unknown algorithm"):
        cm.predict("allreduce", "nope", 4, 1024, model=model())


def test_every_registered_schedule_algorithm_can_be_modelled():
    from collectives import select
    topo = simulated(6, ranks_per_node=3)
    for collective in select.COLLECTIVES:
        for name in select.algorithms(collective):
            if select.get(collective, name).kind != select.SCHEDULE:
                continue
            p = cm.predict(collective, name, 6, 3 * 6 * 1000, topology=topo, model=model())
            assert p.time > 0 and math.isfinite(p.time), (collective, name)


def test_simulate_still_moves_the_data():
    import numpy as np
    ins = [np.arange(10, dtype=np.int64) * (r + 1) for r in range(3)]
    outs, net = sim.simulate(ring.allreduce, ins, "sum", count=10)
    for o in outs:
        assert (o == np.arange(10) * 6).all()
    assert net.traffic.sent_by(0) > 0
