"""All-to-all, gather, scatter and barrier.

In-process tier: every schedule (pairwise, Bruck, two-level all-to-all, binomial gather and
scatter) for n = 1..33 virtual ranks, ragged and empty blocks, every root, with segments; the
two-level all-to-all's cross-node messages against flat pairwise's. MPI tier: the public API at
the job's rank count, every algorithm and dtype, equal and ragged, torch tensors, and the bad
inputs (an error on every rank, buffers untouched).
"""
import numpy as np
import pytest

from collectives.hierarchical_alltoall import hierarchical_alltoall
from collectives.ring.pairwise import pairwise_alltoall
from collectives.sim import simulate
from collectives.tree.bruck import bruck_alltoall
from collectives.tree.gather import binomial_gather, binomial_scatter
from mpiutil import DTYPES, assert_all

SIZES = list(range(1, 34))


def _blocks(matrix, r):
    """Rank r's input: block j is matrix[r][j] copies of 100 r + j."""
    p = len(matrix)
    return np.concatenate([np.full(matrix[r][j], 100 * r + j, np.int64) for j in range(p)]
                          + [np.zeros(0, np.int64)])


def _received(matrix, r):
    p = len(matrix)
    return np.concatenate([np.full(matrix[i][r], 100 * i + r, np.int64) for i in range(p)]
                          + [np.zeros(0, np.int64)])


def _run_alltoall(builder, matrix, **kw):
    p = len(matrix)
    ins = [_blocks(matrix, r) for r in range(p)]
    col = [tuple(matrix[i][r] for i in range(p)) for r in range(p)]
    outs, net = simulate(lambda r, n: builder(r, n, matrix[r], col[r], matrix=matrix, **kw), ins)
    for r in range(p):
        assert np.array_equal(outs[r], _received(matrix, r)), (builder.__name__, p, r)
    return net


def _nodes(p, k):
    return tuple(tuple(range(i, min(i + k, p))) for i in range(0, p, k))


@pytest.mark.parametrize("p", SIZES)
def test_alltoall_schedules_ragged(p):
    rng = np.random.default_rng(p)
    for seg in (None, 2):
        for high in (1, 5):  # all-empty blocks, then ragged ones (empty among them)
            m = tuple(tuple(int(v) for v in row) for row in rng.integers(0, high, (p, p)))
            _run_alltoall(pairwise_alltoall, m, seg=seg)
            for k in sorted({1, 2, 3, p}):
                _run_alltoall(hierarchical_alltoall, m, seg=seg, nodes=_nodes(p, k))


@pytest.mark.parametrize("p", SIZES)
def test_bruck_equal_blocks(p):
    for b in (0, 1, 3):
        m = tuple((b,) * p for _ in range(p))
        _run_alltoall(bruck_alltoall, m, seg=2)
        _run_alltoall(bruck_alltoall, m)


def test_bruck_refuses_ragged_blocks():
    with pytest.raises(ValueError, match="equal blocks"):
        bruck_alltoall(0, 2, (1, 2), (1, 2))


def test_two_level_alltoall_on_uneven_nodes():
    rng = np.random.default_rng(7)
    m = tuple(tuple(int(v) for v in row) for row in rng.integers(1, 4, (6, 6)))
    _run_alltoall(hierarchical_alltoall, m, nodes=((0, 3), (1, 4, 5), (2,)))


@pytest.mark.parametrize("nodes", [2, 3, 4])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_two_level_alltoall_sends_a_kth_of_the_cross_node_messages(nodes, k, capsys):
    """At k ranks per node, no rank sends more than 1/k of the cross-node messages a rank of
    flat pairwise sends, and every byte still crosses once."""
    p = nodes * k
    m = tuple((16,) * p for _ in range(p))

    def cross(net):
        msgs = [sum(c for (s, d), c in net.traffic.messages.items()
                    if s == r and d // k != r // k) for r in range(p)]
        nbytes = sum(b for (s, d), b in net.traffic.bytes.items() if s // k != d // k)
        return msgs, nbytes

    two, two_bytes = cross(_run_alltoall(hierarchical_alltoall, m, nodes=_nodes(p, k)))
    flat, flat_bytes = cross(_run_alltoall(pairwise_alltoall, m))
    with capsys.disabled():
        print(f"\n{nodes} nodes x {k}: cross-node messages per rank, two-level max {max(two)}, "
              f"flat {max(flat)}; cross-node bytes {two_bytes} and {flat_bytes}")
    assert max(two) * k <= max(flat), (two, flat)
    assert two_bytes == flat_bytes


@pytest.mark.parametrize("p", SIZES)
def test_gather_and_scatter_schedules(p):
    rng = np.random.default_rng(100 + p)
    roots = range(p) if p <= 8 else sorted({0, 1, p // 2, p - 1})
    for root in roots:
        for seg in (None, 3):
            counts = [int(c) for c in rng.integers(0, 5, p)]
            ins = [np.arange(counts[r], dtype=np.int64) + 1000 * r for r in range(p)]
            outs, _ = simulate(lambda r, n: binomial_gather(r, n, counts, root, seg=seg), ins)
            assert np.array_equal(outs[root], np.concatenate(ins)), (p, root)
            full = np.concatenate(ins)
            sins = [full if r == root else np.zeros(0, np.int64) for r in range(p)]
            outs, _ = simulate(lambda r, n: binomial_scatter(r, n, counts, root, seg=seg), sins)
            for r in range(p):
                assert np.array_equal(outs[r], ins[r]), (p, root, r)


# -- MPI tier --------------------------------------------------------------------------------
def _world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _algorithms(collective):
    import collectives as coll
    return coll.algorithms(collective) + ("auto",)


def _rows(r, j, n, dtype, width=3):
    """Rank r's n rows for rank j: exact values that say where they came from."""
    v = (np.arange(n * width).reshape(n, width) % 7 + 10 * r + j) % 50
    return v.astype(dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alltoall_equal_blocks_every_algorithm(dtype):
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    for rows in (0, 1, 3):
        x = np.concatenate([_rows(r, j, rows, dtype) for j in range(p)])
        want = np.concatenate([_rows(i, r, rows, dtype) for i in range(p)])
        keep = x.copy()
        for alg in _algorithms("alltoall"):
            got = coll.alltoall(x, algorithm=alg)
            assert_all(got.dtype == x.dtype and np.array_equal(got, want), f"{alg} {rows}")
            out = np.zeros_like(want)
            assert_all(coll.ialltoall(x, out=out, algorithm=alg).wait() is out and
                       np.array_equal(out, want), f"i{alg} {rows}")
        assert_all(np.array_equal(x, keep), "x was modified")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float64], ids=str)
def test_alltoall_ragged_counts(dtype):
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    sends = [[(i * 7 + j * 3) % 4 for j in range(p)] for i in range(p)]  # some 0, prime-ish
    x = np.concatenate([_rows(r, j, sends[r][j], dtype) for j in range(p)])
    want = np.concatenate([_rows(i, r, sends[i][r], dtype) for i in range(p)])
    recv = [sends[i][r] for i in range(p)]
    for alg in _algorithms("alltoall"):
        if alg == "bruck":
            continue
        got = coll.alltoall(x, sends[r], algorithm=alg)
        assert_all(np.array_equal(got, want), alg)
    for alg in ("native", "pairwise", "auto"):
        got = coll.alltoall(x, sends[r], recv_counts=recv, algorithm=alg)
        assert_all(np.array_equal(got, want), f"{alg} with recv_counts")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_alltoall_ragged_where_some_ranks_counts_are_even():
    """Ranks whose own counts are all equal, among a rank whose are not: every rank takes the
    vector form (MPI_Alltoallv) alike, learned counts or recv_counts given, blocking or not,
    on a settled signature too."""
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    sends = [[2 if i == j == p - 1 else 1 for j in range(p)] for i in range(p)]
    x = np.concatenate([_rows(r, j, sends[r][j], np.int32) for j in range(p)])
    want = np.concatenate([_rows(i, r, sends[i][r], np.int32) for i in range(p)])
    recv = [sends[i][r] for i in range(p)]
    for alg in ("native", "auto", "pairwise"):
        for _ in range(2):
            got = coll.alltoall(x, sends[r], algorithm=alg)
            assert_all(np.array_equal(got, want), f"{alg}, counts learned")
            got = coll.alltoall(x, sends[r], recv_counts=recv, algorithm=alg)
            assert_all(np.array_equal(got, want), f"{alg}, recv_counts given")
            got = coll.ialltoall(x, sends[r], recv_counts=recv, algorithm=alg).wait()
            assert_all(np.array_equal(got, want), f"i{alg}, recv_counts given")


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_alltoall_random_count_matrices():
    """Count matrices drawn alike on every rank (rows of equal counts among ragged ones, zeros,
    whole rows of zeros), each through every algorithm that takes ragged blocks, learned and
    with recv_counts, blocking and not."""
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(2026)  # the same draws on every rank
    for draw in range(12):
        rows = [np.full(p, rng.integers(0, 3)) if rng.random() < 0.5 else
                rng.integers(0, 4, p) for _ in range(p)]
        sends = [[int(c) for c in row] for row in rows]
        x = np.concatenate([_rows(r, j, sends[r][j], np.float64) for j in range(p)])
        want = np.concatenate([_rows(i, r, sends[i][r], np.float64) for i in range(p)])
        recv = [sends[i][r] for i in range(p)]
        for alg in ("native", "pairwise", "auto"):
            got = coll.alltoall(x, sends[r], algorithm=alg)
            assert_all(np.array_equal(got, want), f"{alg} {sends}, learned")
            got = coll.ialltoall(x, sends[r], recv_counts=recv, algorithm=alg).wait()
            assert_all(np.array_equal(got, want), f"i{alg} {sends}, recv_counts given")


@pytest.mark.mpi
def test_alltoall_torch_and_trailing_shape():
    torch = pytest.importorskip("torch")
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    x = torch.arange(p * 2 * 4 * 5, dtype=torch.float32).reshape(p * 2, 4, 5) + 1000 * r
    got = coll.alltoall(x)
    want = torch.cat([(torch.arange(p * 2 * 4 * 5, dtype=torch.float32).reshape(p * 2, 4, 5)
                       + 1000 * i)[2 * r:2 * r + 2] for i in range(p)])
    assert_all(isinstance(got, torch.Tensor) and got.shape == want.shape and
               torch.equal(got, want), "torch alltoall")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_and_scatter_every_root_and_algorithm(dtype):
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    counts = [(i * 5 + 2) % 4 for i in range(p)]  # ragged, one rank may have none
    mine = _rows(r, 0, counts[r], dtype)
    everyone = np.concatenate([_rows(i, 0, counts[i], dtype) for i in range(p)])
    for alg in _algorithms("gather"):
        for root in range(p):
            got = coll.gather(mine, root, algorithm=alg)
            ok = np.array_equal(got, everyone) if r == root else got is None
            assert_all(ok, f"gather {alg} root {root}")
            x = everyone.copy() if r == root else None
            got = coll.scatter(x, root, counts=counts if r == root else None, algorithm=alg)
            assert_all(np.array_equal(got, mine) and got.dtype == mine.dtype,
                       f"scatter {alg} root {root}")
            if r == root:
                assert np.array_equal(x, everyone)
            equal = np.concatenate([_rows(i, 1, 2, dtype) for i in range(p)])
            out = np.zeros((2, 3), dtype)
            req = coll.iscatter(equal if r == root else np.empty((0, 3), dtype), root,
                                out=out, algorithm=alg)
            assert_all(req.wait() is out and np.array_equal(out, _rows(r, 1, 2, dtype)),
                       f"iscatter {alg} root {root}")
            gout = np.zeros((sum(counts), 3), dtype) if r == root else None
            res = coll.igather(mine, root, out=gout, algorithm=alg).wait()
            assert_all(res is gout and (r != root or np.array_equal(gout, everyone)),
                       f"igather {alg} root {root}")


@pytest.mark.mpi
def test_barrier():
    import time

    import collectives as coll
    comm = _world()
    r = comm.Get_rank()
    if r == 0:
        time.sleep(0.2)
    t = time.monotonic()
    coll.barrier()
    waited = comm.allgather(time.monotonic() - t)
    # every rank but 0 waited for rank 0's sleep (when there are others)
    assert_all(all(w > 0.1 for w in waited[1:]), f"barrier waited {waited}")
    assert coll.ibarrier().wait() is None
    sub = comm.Split(r % 2, r)
    coll.barrier(sub)
    sub.Free()


@pytest.mark.mpi
def test_two_level_alltoall_on_simulated_nodes(monkeypatch):
    from mpi4py import MPI

    import collectives as coll
    from collectives import config
    monkeypatch.setenv("COLLECTIVES_RANKS_PER_NODE", "2")
    config.reload()
    comm = MPI.COMM_WORLD.Dup()
    try:
        r, p = comm.Get_rank(), comm.Get_size()
        sends = [[(i + 2 * j) % 3 for j in range(p)] for i in range(p)]
        x = np.concatenate([_rows(r, j, sends[r][j], np.float32) for j in range(p)])
        want = np.concatenate([_rows(i, r, sends[i][r], np.float32) for i in range(p)])
        got = coll.alltoall(x, sends[r], comm=comm, algorithm="hierarchical")
        assert_all(np.array_equal(got, want), "hierarchical on 2 ranks per node")
    finally:
        comm.Free()


# -- bad input: the same error on every rank, nothing written --------------------------------
def _raises_everywhere(fn, error, match):
    try:
        fn()
    except error as exc:
        got = str(exc)
    else:
        got = None
    assert_all(got is not None and match in got, f"expected {error.__name__} ({match}), "
               f"got {got!r}")


@pytest.mark.mpi
def test_alltoall_bad_counts():
    import collectives as coll
    comm = _world()
    p = comm.Get_size()
    x = np.arange(p * 2 + 1, dtype=np.float32)
    keep = x.copy()
    if p > 1:
        _raises_everywhere(lambda: coll.alltoall(x), ValueError, "cannot share equally")
    _raises_everywhere(lambda: coll.alltoall(x, [1] * p), ValueError,
                       f"counts add up to {p}, but x has {p * 2 + 1} rows")
    _raises_everywhere(lambda: coll.alltoall(x, [-1] + [1] * (p - 1)), ValueError,
                       "non-negative integers")
    _raises_everywhere(lambda: coll.alltoall(x[:p], [1] * p, algorithm="bruck"), ValueError,
                       "equal blocks")
    assert_all(np.array_equal(x, keep), "x was modified")


@pytest.mark.mpi
def test_alltoall_one_rank_refused_tells_every_rank():
    """Ragged counts are exchanged, so one rank's bad counts are an error on every rank."""
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    x = np.ones(p, np.float32)
    counts = [1] * p if r != p - 1 else [2] * p
    try:
        coll.alltoall(x, counts)
        ok = False
    except ValueError as exc:
        ok = (r != p - 1) or "counts add up to" in str(exc)
    assert_all(ok, "every rank must raise")
    out = coll.alltoall(x, [1] * p)  # the ranks are still in step
    assert_all(np.array_equal(out, np.ones(p, np.float32)), "after the error")


@pytest.mark.mpi
def test_alltoall_trailing_shapes_differ():
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    if p == 1:
        pytest.skip("needs two ranks")
    x = np.ones((p, 3 if r == 0 else 4), np.float32)
    _raises_everywhere(lambda: coll.alltoall(x, [1] * p), ValueError,
                       "trailing axes must agree")


@pytest.mark.mpi
def test_gather_scatter_bad_input():
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    _raises_everywhere(lambda: coll.gather(np.ones(2), p), ValueError, "out of range")
    _raises_everywhere(lambda: coll.scatter(np.ones(2), -1), ValueError, "out of range")
    full = np.ones((p + 1, 2))
    if p > 1:
        _raises_everywhere(lambda: coll.scatter(full if r == 0 else None, 0), ValueError,
                           "refused" if r else "cannot share equally")
    _raises_everywhere(lambda: coll.scatter(full if r == 0 else None, 0,
                                            counts=[1] * p if r == 0 else None),
                       ValueError, "refused" if r else "counts add up to")
    if p > 1:
        x = np.ones((2, 3 if r == 0 else 2), np.float32)
        _raises_everywhere(lambda: coll.gather(x, 0), ValueError, "trailing axes must agree")


@pytest.mark.mpi
def test_mismatched_dtype_with_checking_is_a_mismatch_error(setting):
    import collectives as coll
    comm = _world()
    r, p = comm.Get_rank(), comm.Get_size()
    if p == 1:
        pytest.skip("needs two ranks")
    setting("COLLECTIVES_CHECK", "1")
    x = np.ones(p, np.float64 if r == 1 else np.float32)
    _raises_everywhere(lambda: coll.alltoall(x), coll.MismatchError, "rank 1 passed float64")
