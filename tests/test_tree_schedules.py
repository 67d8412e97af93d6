"""In-process tier: tree and butterfly schedules (collectives.tree) for n = 1..33 virtual ranks.

Every schedule runs in the simulator (rendezvous sends, so a schedule that needs buffering
deadlocks here). Data is exact and rank-dependent (rank r, element i -> (r + 1) * 1000 + i) with
closed-form sums; floats check that every rank gets the same bits; a non-commutative,
non-associative op checks the reduction order itself.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives import select, tree
from collectives.ops import Op
from collectives.schedule import split
from collectives.sim import simulate
from collectives.tree.double_binary import double_binary_trees
from collectives.tree.fold import Fold
from collectives.tree.pipelined import binary_tree

SIZES = list(range(1, 34))
SOME_SIZES = [1, 2, 3, 4, 5, 7, 8, 16, 17, 33]

ALLREDUCE = {
    "tree": tree.allreduce,
    "binomial": tree.binomial_allreduce,
    "double_binary_tree": tree.double_binary_tree_allreduce,
    "recursive_doubling": tree.recursive_doubling_allreduce,
    "rabenseifner": tree.rabenseifner_allreduce,
}
REDUCE = {"tree": tree.reduce, "binomial": tree.binomial_reduce}
BROADCAST = {"tree": tree.broadcast, "binomial": tree.binomial_broadcast}


def lengths(n):
    return sorted({0, 1, max(0, n - 1), n + 1, 13, 97, 1000})


def small_seg(count):
    """A segment size that cuts ``count`` into several segments (3 for short buffers)."""
    return max(3, count // 6)


def data(r, count, dtype=np.int64):
    """Rank-dependent exact integers: rank r, element i -> (r + 1) * 1000 + i."""
    return ((r + 1) * 1000 + np.arange(count)).astype(dtype)


def expected_sum(n, count):
    # sum_r (r+1)*1000 + i  =  1000 n (n+1) / 2 + n i
    return 1000 * n * (n + 1) // 2 + n * np.arange(count, dtype=np.int64)


def counts_of(count, n):
    b = split(count, n)
    return [b[k + 1] - b[k] for k in range(n)]


def ragged(n, rng):
    counts = [int(c) for c in rng.integers(0, 6, n)]
    if n > 1:
        counts[rng.integers(0, n)] = 0
    return counts


class Runs(Op):
    """A non-commutative, non-associative op that checks the order of combination.

    An element encodes a run of ranks lo..hi as ``lo * 4096 + hi``; ``a op b`` is the run
    lo(a)..hi(b) if b's run starts right after a's ends, else -1 (sticky). Rank r starts with
    the run r..r, so a result of 0..n-1 proves every reduction joined adjacent groups, the
    lower-rank group first.
    """

    def __init__(self):
        super().__init__("sum", np.int64)

    def reduce(self, dst, a, b):
        ok = (a >= 0) & (b >= 0) & (a % 4096 + 1 == b // 4096)
        dst[...] = np.where(ok, a // 4096 * 4096 + b % 4096, -1)


# -- allreduce ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ALLREDUCE)
def test_allreduce_exact(name, n):
    for count in lengths(n):
        for seg in (None, small_seg(count)):
            outs, _ = simulate(ALLREDUCE[name], [data(r, count) for r in range(n)], "sum",
                               count=count, seg=seg)
            for r, out in enumerate(outs):
                assert np.array_equal(out, expected_sum(n, count)), (name, n, count, seg, r)


@pytest.mark.parametrize("n", SOME_SIZES)
@pytest.mark.parametrize("name", ALLREDUCE)
def test_allreduce_in_place(name, n):
    for count in (0, 1, n + 1, 97):
        for seg in (None, 3):
            ins = [data(r, count) for r in range(n)]
            outs, _ = simulate(ALLREDUCE[name], ins, "sum", count=count, seg=seg,
                               inplace=True)
            for out, x in zip(outs, ins):
                assert np.shares_memory(out, x) or count == 0
                assert np.array_equal(out, expected_sum(n, count)), (name, n, count, seg)


@pytest.mark.parametrize("op,ref", [("prod", np.prod), ("min", np.minimum.reduce),
                                    ("max", np.maximum.reduce), ("bxor", np.bitwise_xor.reduce),
                                    ("band", np.bitwise_and.reduce),
                                    ("bor", np.bitwise_or.reduce)])
@pytest.mark.parametrize("name", ALLREDUCE)
def test_allreduce_ops(name, op, ref):
    rng = np.random.default_rng(7)
    for n in (5, 6, 8):
        count = 37
        lo, hi = (1, 4) if op == "prod" else (0, 1 << 20)
        ins = [rng.integers(lo, hi, count).astype(np.int64) for _ in range(n)]
        outs, _ = simulate(ALLREDUCE[name], ins, op, count=count, seg=5)
        want = ref(np.stack(ins), axis=0)
        assert all(np.array_equal(o, want) for o in outs), (name, op, n)


@pytest.mark.parametrize("name", ALLREDUCE)
def test_allreduce_float_bitwise_identical_and_deterministic(name):
    for n in (2, 3, 5, 6, 8, 13):
        rng = np.random.default_rng(n)
        count = 301
        ins = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
        outs, _ = simulate(ALLREDUCE[name], ins, "sum", count=count, seg=7)
        for o in outs[1:]:
            assert o.tobytes() == outs[0].tobytes(), (name, n)
        np.testing.assert_allclose(outs[0], np.sum(np.stack(ins).astype(np.float64), 0),
                                   rtol=1e-5, atol=1e-5)
        # The same bits run to run, in place, and with another segmentation.
        again, _ = simulate(ALLREDUCE[name], [x.copy() for x in ins], "sum", count=count,
                            seg=None, inplace=True)
        assert all(o.tobytes() == outs[0].tobytes() for o in again), (name, n)


@pytest.mark.parametrize("name", ALLREDUCE)
def test_allreduce_combines_lower_ranks_first(name):
    for n in SIZES:
        for seg in (None, 2):
            ins = [np.full(5, r * 4096 + r, np.int64) for r in range(n)]
            outs, _ = simulate(ALLREDUCE[name], ins, Runs(), count=5, seg=seg)
            for r, out in enumerate(outs):
                assert np.array_equal(out, np.full(5, n - 1)), (name, n, seg, r, out)


def test_rabenseifner_matches_recursive_doubling_bitwise():
    rng = np.random.default_rng(3)
    for n in SIZES:
        ins = [rng.standard_normal(53).astype(np.float32) for _ in range(n)]
        a, _ = simulate(tree.rabenseifner_allreduce, ins, "sum", count=53, seg=4)
        b, _ = simulate(tree.recursive_doubling_allreduce, ins, "sum", count=53)
        assert a[0].tobytes() == b[0].tobytes(), n


@pytest.mark.parametrize("name", ALLREDUCE)
def test_allreduce_64_ranks(name):
    n, count = 64, 150
    outs, _ = simulate(ALLREDUCE[name], [data(r, count) for r in range(n)], "sum",
                       count=count, seg=40)
    assert all(np.array_equal(o, expected_sum(n, count)) for o in outs)


# -- reduce and broadcast -----------------------------------------------------------------------
def roots(n):
    return range(n) if n <= 9 else sorted({0, 1, n // 2, n - 1})


@pytest.mark.parametrize("n", list(range(1, 13)) + [16, 17, 33])
@pytest.mark.parametrize("name", REDUCE)
def test_reduce_every_root(name, n):
    for root in roots(n):
        for count in (0, 1, 13, n + 1):
            for seg, inplace in ((None, False), (3, True), (3, False)):
                ins = [data(r, count) for r in range(n)]
                outs, _ = simulate(REDUCE[name], ins, "sum", count=count, root=root, seg=seg,
                                   inplace=inplace)
                assert np.array_equal(outs[root], expected_sum(n, count)), \
                    (name, n, root, count, seg, inplace)


@pytest.mark.parametrize("name", REDUCE)
def test_reduce_order_and_ops(name):
    for n in (3, 6, 8):
        for root in (0, n - 1):
            ins = [np.full(4, ((r - root) % n) * 4097, np.int64) for r in range(n)]
            outs, _ = simulate(REDUCE[name], ins, Runs(), count=4, root=root, seg=2)
            # Runs are in ranks renumbered from the root: 0..n-1 in that numbering.
            assert np.array_equal(outs[root], np.full(4, n - 1)), (name, n, root)
            rng = np.random.default_rng(n)
            ins = [rng.integers(0, 1 << 30, 11).astype(np.int64) for _ in range(n)]
            outs, _ = simulate(REDUCE[name], ins, "max", count=11, root=root, seg=4)
            assert np.array_equal(outs[root], np.maximum.reduce(np.stack(ins)))


@pytest.mark.parametrize("n", list(range(1, 13)) + [16, 17, 33])
@pytest.mark.parametrize("name", BROADCAST)
def test_broadcast_every_root(name, n):
    for root in roots(n):
        for count in (0, 1, 13, n + 1, 100):
            for seg in (None, small_seg(count)):
                ins = [data(r, count) if r == root else np.zeros(count, np.int64)
                       for r in range(n)]
                outs, _ = simulate(BROADCAST[name], ins, "sum", count=count, root=root,
                                   seg=seg, inplace=True)
                assert all(np.array_equal(o, data(root, count)) for o in outs), \
                    (name, n, root, count, seg)


# -- reduce-scatter and all-gather -------------------------------------------------------------
def count_sets(n, rng):
    big = [0] * n
    big[n // 2] = 50
    return ([0] * n, [1] * n, counts_of(97, n), ragged(n, rng), big, counts_of(n - 1, n))


@pytest.mark.parametrize("n", SIZES)
def test_recursive_halving_reduce_scatter_ragged(n):
    rng = np.random.default_rng(n)
    for counts in count_sets(n, rng):
        total = sum(counts)
        bounds = np.cumsum([0] + counts)
        for seg in (None, 2):
            outs, _ = simulate(tree.recursive_halving_reduce_scatter,
                               [data(r, total) for r in range(n)], "sum",
                               counts=tuple(counts), seg=seg)
            want = expected_sum(n, total)
            for r, out in enumerate(outs):
                assert np.array_equal(out, want[bounds[r]:bounds[r + 1]]), (n, counts, seg, r)


def test_recursive_halving_reduce_scatter_ops_and_floats():
    rng = np.random.default_rng(11)
    for n in (3, 5, 8):
        counts = ragged(n, rng)
        ins = [rng.integers(0, 1 << 20, sum(counts)).astype(np.int64) for _ in range(n)]
        bounds = np.cumsum([0] + counts)
        for op, ref in (("bxor", np.bitwise_xor.reduce), ("min", np.minimum.reduce)):
            outs, _ = simulate(tree.recursive_halving_reduce_scatter, ins, op,
                               counts=tuple(counts), seg=2)
            want = ref(np.stack(ins), axis=0)
            assert all(np.array_equal(outs[r], want[bounds[r]:bounds[r + 1]])
                       for r in range(n))
        ins = [x.astype(np.float32) / 7 for x in ins]
        outs, _ = simulate(tree.recursive_halving_reduce_scatter, ins, "sum",
                           counts=tuple(counts), seg=3)
        whole = np.concatenate(outs)
        np.testing.assert_allclose(whole, np.sum(np.stack(ins).astype(np.float64), 0),
                                   rtol=1e-5)


@pytest.mark.parametrize("n", SIZES)
def test_recursive_doubling_allgather_ragged(n):
    rng = np.random.default_rng(100 + n)
    for counts in count_sets(n, rng):
        ins = [data(r, counts[r]) for r in range(n)]
        want = np.concatenate(ins)
        for seg in (None, 2):
            outs, _ = simulate(tree.recursive_doubling_allgather, ins, "sum",
                               counts=tuple(counts), seg=seg)
            assert all(np.array_equal(o, want) for o in outs), (n, counts, seg)


# -- structure, traffic, scratch ----------------------------------------------------------------
def test_binary_trees_are_trees():
    for p in range(1, 65):
        for root in sorted({0, p // 2, p - 1}):
            nodes = [binary_tree(r, p, shift=root) for r in range(p)]
            check_tree(nodes, p, root)
        one_two = [double_binary_trees(r, p) for r in range(p)]
        for t in (0, 1):
            check_tree([x[t] for x in one_two], p, None)
        if p > 1:  # complementary: every rank is inner in exactly one tree
            for r in range(p):
                inner = [one_two[r][t][1:] != (None, None) for t in (0, 1)]
                assert inner.count(True) == 1, (p, r, one_two[r])


def check_tree(nodes, p, root):
    """Parent and child links agree, one root, in-order sides, depth <= ceil(log2 p) + 1."""
    roots_ = [r for r in range(p) if nodes[r][0] is None]
    assert len(roots_) == 1 and (root is None or roots_ == [root])
    for r, (parent, first, second) in enumerate(nodes):
        if parent is not None:
            assert r in nodes[parent][1:]
        for child in (first, second):
            if child is not None:
                assert nodes[child][0] == r
        depth, x = 0, r
        while nodes[x][0] is not None:
            x, depth = nodes[x][0], depth + 1
        assert depth <= max(1, (p - 1).bit_length()) + 1, (p, r, depth)


def test_fold():
    for p in range(1, 65):
        f = Fold(p)
        assert f.pp & (f.pp - 1) == 0 and f.pp <= p < 2 * f.pp
        vs = [f.vrank(r) for r in range(p)]
        assert sorted(v for v in vs if v is not None) == list(range(f.pp))
        assert all(f.real(vs[r]) == r for r in range(p) if vs[r] is not None)
        assert [f.first(v) for v in range(f.pp + 1)] == sorted(
            [f.first(v) for v in range(f.pp + 1)]) and f.first(f.pp) == p


def test_traffic():
    count = 4096
    # Rabenseifner on 8 ranks: 2 (p-1)/p of the buffer per rank; recursive doubling: log2 p.
    _, net = simulate(tree.rabenseifner_allreduce, [data(r, count) for r in range(8)],
                      "sum", count=count, seg=100)
    assert all(net.traffic.sent_by(r) == 2 * 7 * (count // 8) * 8 for r in range(8))
    _, net = simulate(tree.recursive_doubling_allreduce, [data(r, count) for r in range(8)],
                      "sum", count=count)
    assert all(net.traffic.sent_by(r) == 3 * count * 8 for r in range(8))
    # Double binary tree: every rank sends at most twice the buffer (the ring's bandwidth).
    for n in (4, 7, 16):
        _, net = simulate(tree.double_binary_tree_allreduce,
                          [data(r, count) for r in range(n)], "sum", count=count, seg=256)
        assert max(net.traffic.sent_by(r) for r in range(n)) <= 2 * count * 8
    # Binomial reduce: the root receives ceil(log2 p) messages (unsegmented).
    for n in (5, 8, 13):
        _, net = simulate(tree.binomial_reduce, [data(r, 10) for r in range(n)], "sum",
                          count=10, root=2)
        assert sum(m for (s, d), m in net.traffic.messages.items() if d == 2) == \
            (n - 1).bit_length()


def test_scratch_is_linear_and_input_read_only():
    builders = dict(ALLREDUCE)
    builders.update({f"reduce_{k}": v for k, v in REDUCE.items()})
    for n in (2, 3, 5, 8, 33):
        for seg in (None, 16):
            for name, build in builders.items():
                for r in range(n):
                    s = build(r, n, 1000, seg=seg)
                    s.validate()  # regions in bounds, IN never written
                    assert s.tmp <= 4 * 1000, (name, n, seg, r, s.tmp)
            for build in (tree.recursive_halving_reduce_scatter,
                          tree.recursive_doubling_allgather):
                counts = counts_of(1000, n)
                for r in range(n):
                    s = build(r, n, tuple(counts), seg=seg)
                    s.validate()
                    assert not s.alias and s.tmp <= 3 * 1000


def test_registered():
    def build(collective, name):
        algo = select.get(collective, name)
        assert algo.kind == select.SCHEDULE and algo.needs == select.ANY, algo
        return algo.build[collective]

    for name, fn in ALLREDUCE.items():
        assert build("allreduce", name) is fn
    for name in REDUCE:
        assert build("reduce", name) is REDUCE[name]
        assert build("broadcast", name) is BROADCAST[name]
    assert build("reduce_scatter", "recursive_halving") is tree.recursive_halving_reduce_scatter
    assert build("allgather", "recursive_doubling") is tree.recursive_doubling_allgather


# -- property -----------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 20), count=st.integers(0, 150),
       seg=st.one_of(st.none(), st.integers(1, 40)),
       name=st.sampled_from(sorted(ALLREDUCE) + ["reduce", "broadcast", "reduce_scatter",
                                                  "allgather"]),
       inplace=st.booleans(), root=st.integers(0, 19))
def test_tree_property(n, count, seg, name, inplace, root):
    root %= n
    ins = [data(r, count) for r in range(n)]
    if name in ALLREDUCE:
        outs, _ = simulate(ALLREDUCE[name], ins, "sum", count=count, seg=seg, inplace=inplace)
        assert all(np.array_equal(o, expected_sum(n, count)) for o in outs)
    elif name == "reduce":
        for build in REDUCE.values():
            ins = [data(r, count) for r in range(n)]
            outs, _ = simulate(build, ins, "sum", count=count, root=root, seg=seg,
                               inplace=inplace)
            assert np.array_equal(outs[root], expected_sum(n, count))
    elif name == "broadcast":
        for build in BROADCAST.values():
            ins = [data(r, count) if r == root else np.zeros(count, np.int64)
                   for r in range(n)]
            outs, _ = simulate(build, ins, "sum", count=count, root=root, seg=seg,
                               inplace=True)
            assert all(np.array_equal(o, data(root, count)) for o in outs)
    else:
        counts = counts_of(count, n) if inplace else \
            [int(c) for c in np.random.default_rng(count).integers(0, 8, n)]
        bounds = np.cumsum([0] + counts)
        if name == "reduce_scatter":
            total = bounds[-1]
            outs, _ = simulate(tree.recursive_halving_reduce_scatter,
                               [data(r, total) for r in range(n)], "sum",
                               counts=tuple(counts), seg=seg)
            want = expected_sum(n, total)
            assert all(np.array_equal(outs[r], want[bounds[r]:bounds[r + 1]])
                       for r in range(n))
        else:
            ins = [data(r, counts[r]) for r in range(n)]
            outs, _ = simulate(tree.recursive_doubling_allgather, ins, "sum",
                               counts=tuple(counts), seg=seg)
            assert all(np.array_equal(o, np.concatenate(ins)) for o in outs)
