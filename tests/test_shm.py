"""The shm algorithm under mpiexec (n = 1..5): every dtype and op, lengths 0, 1 and primes,
in place and not, many rounds through tiny chunks, non-blocking ordering, and the errors; each
all-gathers through both paths: single-copy reads (``process_vm_readv``, where the node allows
them) and two copies through the window."""
import numpy as np
import pytest

import collectives as coll
from collectives import config
from collectives.buffers import DTYPES
from collectives.node import shm, window
from collectives.ops import NAMES, _ACCEPTS, dtype_kind
from tests.mpiutil import one_node_only, op_inputs

LENGTHS = (0, 1, 2, 3, 13, 97)


@pytest.fixture(autouse=True)
def _reread_settings():
    """After each test (and its monkeypatch), settings are read from the environment again."""
    yield
    config.reload()


def test_chunk_bytes_setting_validates():
    with pytest.raises(ValueError, match="at least 64"):
        config.set("COLLECTIVES_SHM_CHUNK_BYTES", 8)
    old = config.set("COLLECTIVES_SHM_CHUNK_BYTES", 4096)
    assert config.set("COLLECTIVES_SHM_CHUNK_BYTES", old) == 4096


def test_registered():
    for c in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        assert "shm" in coll.algorithms(c)


inputs = op_inputs


def reference(xs, op, dtype):
    """The result in rank order, in the dtype (integers wrap alike in any order)."""
    dtype = np.dtype(dtype)
    if op == "avg":
        wide = np.complex128 if dtype.kind == "c" else np.float64
        return (sum(x.astype(wide) for x in xs) / len(xs)).astype(dtype)
    if dtype.kind == "b":
        fn = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
              "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
              "bxor": np.logical_xor}[op]
    else:
        fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
              "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    acc = xs[0].copy()
    for x in xs[1:]:
        fn(acc, x, out=acc)
    return acc


def _parts(a):
    """``a`` in float64, a complex array as its real and imaginary parts side by side."""
    a = np.asarray(a)
    return a.astype(np.complex128).view(np.float64) if a.dtype.kind == "c" else \
        a.astype(np.float64)


def same(got, want, op="sum", xs=()):
    """``got`` is ``want``: exactly, since the inputs are small integers whose sums, products,
    minima and maxima every dtype holds exactly in any order; for ``op="avg"`` (``xs``: every
    rank's input) within its rounding, a component at a time (u = eps / 2): n inputs each
    divided by n (u max|x| in all) and then added (n - 1 additions of partial sums below
    max|x|), or added and then divided, come within n u max|x| of the exact mean, and ``want``
    within u |mean|: (n + 1) u max|x| bounds their distance, less than the 3 / n by which
    another rank's input in the place of one would move the mean here."""
    got = np.asarray(got)
    if got.shape != want.shape:
        return False
    if op != "avg" or dtype_kind(want.dtype) not in "fc":
        return np.array_equal(got, want)
    eps = float(np.finfo(want.dtype).eps)  # a complex dtype's: its parts'
    largest = max((float(np.abs(_parts(x)).max()) for x in xs if x.size), default=0.0)
    return bool(np.all(np.abs(_parts(got) - _parts(want)) <= (len(xs) + 1) * eps / 2 * largest))


def pairs():
    for dtype in DTYPES:
        for op in NAMES:
            if dtype_kind(dtype) in _ACCEPTS[op]:
                yield dtype, op


def cases(size):
    """Every dtype and op at every length: ``(dtype, op, n, every rank's input, reference)``."""
    for dtype, op in pairs():
        for n in LENGTHS:
            xs = inputs(size, n, dtype, op)
            yield dtype, op, n, xs, reference(xs, op, dtype)


@pytest.fixture(params=["cma", "window"])
def path(request, monkeypatch):
    """Both ways through a shm all-gather or broadcast, at every size: single-copy reads (where
    the window found them working) and the window's slots; the same on every rank."""
    monkeypatch.setattr(shm, "CMA_MIN_BYTES", 0)
    old = config.set("COLLECTIVES_SHM_CMA", request.param == "cma")
    yield request.param
    config.set("COLLECTIVES_SHM_CMA", old)


@pytest.fixture(params=["whole", "split"])
def form(request, monkeypatch):
    """Both forms of a shm allreduce, at every size: one meeting a round (every rank reduces
    the whole round) and two (each reduces a slice, then all copy every slice out)."""
    monkeypatch.setattr(shm, "WHOLE_MAX_BYTES", {None: (1 << 40) if request.param == "whole"
                                                 else -1})
    return request.param


@pytest.fixture(params=["root", "split"])
def reduce_form(request, monkeypatch):
    """Both forms of a shm reduce, at every size: the root combines every slot, or, from 3
    ranks, its child in the tree combines the others' in place first (``_reduce_split``)."""
    monkeypatch.setattr(shm, "SPLIT_MIN_BYTES", 0 if request.param == "split" else 1 << 62)
    return request.param


def test_reduce_split_combines_as_tree():
    """The child's plan (``_subtree``) and the root's last step give ``_combine``'s
    expression, operand for operand, for 3..33 ranks (in virtual ranks, so onto any root): the
    same bits as tree; it writes only the others' slots, never the child's own input or the
    root's slot."""
    from collectives.tree.pipelined import btree

    def tree(v, k):  # _combine's order: first child's subtree, the node's own, second child's
        _, first, second = btree(v, k)
        e = f"x{v}"
        if first is not None:
            e = f"({tree(first, k)}+{e})"
        if second is not None:
            e = f"({e}+{tree(second, k)})"
        return e

    for k in range(3, 34):
        c, ops, last = shm._subtree(k)
        assert btree(0, k)[2] == c
        val = {v: f"x{v}" for v in range(1, k)}
        val["x"] = f"x{c}"
        for dst, a, b in ops:
            assert dst != "x" and dst != 0
            val[dst] = f"({val[a]}+{val[b]})"
        assert f"(x0+{val[last]})" == tree(0, k), k


@pytest.fixture
def chunk():
    """A small chunk so that short arrays take many rounds."""
    old = config.set("COLLECTIVES_SHM_CHUNK_BYTES", 64)
    yield
    config.set("COLLECTIVES_SHM_CHUNK_BYTES", old)


@pytest.mark.mpi
def test_allreduce_every_dtype_and_op(chunk, form):
    one_node_only()
    from tests.mpiutil import assert_all, world
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = []
    for dtype, op, n, xs, want in cases(size):
        x = xs[rank].copy()
        got = coll.allreduce(x, op, algorithm="shm")
        if not (same(got, want, op, xs) and np.array_equal(x, xs[rank])):
            bad.append((dtype.name, op, n, "out of place"))
        y = xs[rank].copy()
        res = coll.allreduce(y, op, out=y, algorithm="shm")
        if not (res is y and same(y, want, op, xs)):
            bad.append((dtype.name, op, n, "in place"))
    assert_all(not bad, str(bad[:5]))


@pytest.mark.mpi
@pytest.mark.parametrize("nbytes", [64, 4096, 1 << 20])
def test_allreduce_lengths_and_chunks(nbytes, form):
    """Primes around chunk multiples, exact int64 closed form, bitwise-equal floats."""
    one_node_only()
    from tests.mpiutil import assert_all, world
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    old = config.set("COLLECTIVES_SHM_CHUNK_BYTES", nbytes)
    bad = []
    try:
        for n in (0, 1, 7, 8, 9, 127, 1009) + ((65537,) if nbytes > 64 else ()):
            x = ((rank + 1) * 1000 + np.arange(n)).astype(np.int64)
            got = coll.allreduce(x, algorithm="shm")
            want = 1000 * size * (size + 1) // 2 + size * np.arange(n)
            if not np.array_equal(got, want):
                bad.append(("int64", n))
            f = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
            g = coll.allreduce(f, algorithm="shm")
            first = comm.bcast(g.tobytes(), root=0)
            if g.tobytes() != first:
                bad.append(("float32 not identical", n))
    finally:
        config.set("COLLECTIVES_SHM_CHUNK_BYTES", old)
    assert_all(not bad, str(bad[:5]))


@pytest.mark.mpi
def test_reduce_every_dtype_and_op_and_root(chunk, reduce_form):
    """Onto every root, in place and not: the result there (the input untouched out of place),
    None elsewhere with the input untouched; many rounds, so that ranks run rounds ahead."""
    one_node_only()
    from tests.mpiutil import assert_all, world
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = []
    for dtype, op, n, xs, want in cases(size):
        for root in range(size):
            x = xs[rank].copy()
            got = coll.reduce(x, op, root=root, algorithm="shm")
            if not np.array_equal(x, xs[rank]) or \
                    (rank == root and not same(got, want, op, xs)) or \
                    (rank != root and got is not None):
                bad.append((dtype.name, op, n, root, "out of place"))
            y = xs[rank].copy()
            res = coll.reduce(y, op, root=root, out=y if rank == root else None,
                              algorithm="shm")
            if (rank == root and not (res is y and same(y, want, op, xs))) or \
                    (rank != root and not np.array_equal(y, xs[rank])):
                bad.append((dtype.name, op, n, root, "in place"))
    assert_all(not bad, str(bad[:5]))


@pytest.mark.mpi
@pytest.mark.parametrize("nbytes", [64, 4096])
def test_same_bits_as_tree_or_ring(nbytes, form, reduce_form):
    """shm's allreduce and reduce (both forms of each; onto every root, in place and not) give
    algorithm="tree"'s bits on any number of ranks, but for the allreduce in two meetings a
    round (above WHOLE_MAX_BYTES), which gives ring's (shm.bits):
    float sums of magnitudes 1 to 10^4, where the order of the additions shows in the last
    bits."""
    one_node_only()
    from tests.mpiutil import assert_all, world
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    old = config.set("COLLECTIVES_SHM_CHUNK_BYTES", nbytes)
    bad = []
    try:
        for n in (0, 1, 7, 97, 1009):
            for dtype in (np.float32, np.float64):
                rng = np.random.default_rng(1000 * rank + n)
                x = (rng.standard_normal(n) * 10.0 ** rank).astype(dtype)
                like = shm.bits("allreduce", x.nbytes, size)
                assert like == ("tree" if form == "whole" else "ring")
                assert shm.bits("reduce", x.nbytes, size) == "tree"
                a = coll.allreduce(x, algorithm="shm")
                if a.tobytes() != coll.allreduce(x, algorithm=like).tobytes():
                    bad.append(("allreduce", n, dtype.__name__))
                for root in range(size):
                    want = coll.reduce(x, root=root, algorithm="tree")
                    got = coll.reduce(x, root=root, algorithm="shm")
                    y = x.copy()
                    coll.reduce(y, root=root, out=y if rank == root else None, algorithm="shm")
                    if rank == root and not (got.tobytes() == y.tobytes() == want.tobytes()):
                        bad.append(("reduce", n, dtype.__name__, root))
    finally:
        config.set("COLLECTIVES_SHM_CHUNK_BYTES", old)
    assert_all(not bad, str(bad[:5]))


@pytest.mark.mpi
def test_reduce_scatter_allgather_broadcast(chunk, path):
    one_node_only()
    from tests.mpiutil import assert_all, world
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = []
    for dtype in (np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.bool_),
                  np.dtype(np.complex128), np.dtype(np.int8)):
        for n in LENGTHS:
            for counts in (None, [max(0, n - r) // size + (r % 2) for r in range(size)]):
                total = n if counts is None else sum(counts)
                xs = inputs(size, total, dtype, "sum")
                want = reference(xs, "sum", dtype)
                b = np.cumsum([0] + ([len(a) for a in np.array_split(np.arange(total), size)]
                                     if counts is None else counts))
                got = coll.reduce_scatter(xs[rank], counts=counts, algorithm="shm")
                if not same(got, want[b[rank]:b[rank + 1]]):
                    bad.append(("reduce_scatter", dtype.name, n, counts))
            mine = xs[rank][:max(0, n - rank)]
            got = coll.allgather(mine, algorithm="shm")
            want = np.concatenate([xs[r][:max(0, n - r)] for r in range(size)])
            if not same(got, want):
                bad.append(("allgather", dtype.name, n))
            for root in range(size):
                buf = xs[rank].copy()
                coll.broadcast(buf, root=root, algorithm="shm")
                if not same(buf, xs[root]):
                    bad.append(("broadcast", dtype.name, n, root))
    assert_all(not bad, str(bad[:5]))


@pytest.mark.mpi
def test_torch_and_shapes():
    one_node_only()
    torch = pytest.importorskip("torch")
    from tests.mpiutil import assert_all, world
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    t = torch.full((3, 5), float(rank + 1), dtype=torch.bfloat16)
    got = coll.allreduce(t, algorithm="shm")
    ok = isinstance(got, torch.Tensor) and got.shape == (3, 5) and \
        bool((got == size * (size + 1) / 2).all())
    assert_all(ok, str(got))


@pytest.mark.mpi
def test_nonblocking_in_order_with_blocking(path):
    """Non-blocking calls queue on the window; a blocking call runs after the earlier ones."""
    one_node_only()
    from tests.mpiutil import assert_all, world
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    old = config.set("COLLECTIVES_SHM_CHUNK_BYTES", 256)
    try:
        reqs = [coll.iallreduce(np.full(1000 + i, rank + i, np.int64), algorithm="shm")
                for i in range(4)]
        mid = coll.allreduce(np.full(10, 1, np.int64), algorithm="shm")
        more = coll.iallgather(np.full(3, rank, np.int64), algorithm="shm")
        ok = all((req.wait() == size * (size - 1) // 2 + size * i).all()
                 for i, req in enumerate(reqs))
        ok = ok and (mid == size).all() and (more.wait() == np.repeat(np.arange(size), 3)).all()
    finally:
        config.set("COLLECTIVES_SHM_CHUNK_BYTES", old)
    assert_all(bool(ok))


@pytest.mark.mpi
def test_paths_interleave(monkeypatch):
    """Calls through either path share the window's counters: alternate them."""
    one_node_only()
    from tests.mpiutil import assert_all, world
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    monkeypatch.setattr(shm, "CMA_MIN_BYTES", 0)
    old, chunk = config.get("COLLECTIVES_SHM_CMA"), config.set("COLLECTIVES_SHM_CHUNK_BYTES", 128)
    ok = True
    try:
        for i in range(12):
            config.set("COLLECTIVES_SHM_CMA", i % 3 != 0)
            n = 50 + 37 * i
            x = np.arange(n, dtype=np.int64) + rank * i
            want = size * np.arange(n) + i * size * (size - 1) // 2
            got = coll.allreduce(x, algorithm="shm") if i % 2 else \
                coll.allreduce(x, out=x, algorithm="shm")
            ok = ok and np.array_equal(got, want)
            g = coll.allgather(np.full(i + 1, rank, np.int16), algorithm="shm")
            ok = ok and np.array_equal(g, np.repeat(np.arange(size), i + 1).astype(np.int16))
            b = coll.broadcast(np.full(n, rank, np.float64), root=i % size, algorithm="shm")
            ok = ok and bool((b == i % size).all())
    finally:
        config.set("COLLECTIVES_SHM_CMA", old)
        config.set("COLLECTIVES_SHM_CHUNK_BYTES", chunk)
    assert_all(bool(ok))


@pytest.mark.mpi
def test_cma_agreed_on_every_rank():
    """The window's choice of single-copy reads is collective (one answer on every rank), and
    on Linux between processes of one user it is on unless the kernel forbids it."""
    one_node_only()
    from collectives.executor import context
    from collectives.node import cma
    from tests.mpiutil import assert_all, world
    comm = world()
    coll.allreduce(np.ones(10), algorithm="shm")
    wins = list(context(comm).slot(window._Windows).by_chunk.values())
    flags = comm.allgather(tuple(w.cma for w in wins))
    ok = len(set(flags)) == 1
    if comm.Get_size() > 1 and cma.available() and not wins[0].cma:
        print("note: process_vm_readv is not allowed between the ranks here; shm uses the window")
    assert_all(ok, str(flags))


@pytest.mark.mpi
def test_window_reused():
    one_node_only()
    from collectives.executor import context
    from tests.mpiutil import assert_all, world
    comm = world()
    coll.allreduce(np.ones(100), algorithm="shm")
    ctx = context(comm)

    def windows():
        return list(ctx.slot(window._Windows).by_chunk.values())

    before = windows()
    coll.allreduce(np.ones(100000), algorithm="shm")
    coll.allgather(np.ones(3), algorithm="shm")
    coll.reduce_scatter(np.ones(30000), algorithm="shm")
    assert_all(comm.Get_size() == 1 or (before and windows() == before))


@pytest.mark.mpi
def test_several_nodes_is_a_clear_error(monkeypatch):
    from mpi4py import MPI
    from tests.mpiutil import assert_all
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("one rank never spans nodes")
    monkeypatch.setenv("COLLECTIVES_RANKS_PER_NODE", "1")
    config.reload()  # read the environment again (and again after the test)
    comm = MPI.COMM_WORLD.Dup()
    try:
        with pytest.raises(ValueError, match="needs every rank on one node"):
            coll.allreduce(np.ones(10), comm=comm, algorithm="shm")
        # hierarchical still runs there (its node level is a ring)
        ok = (coll.allreduce(np.ones(10), comm=comm, algorithm="hierarchical")
              == comm.Get_size()).all()
    finally:
        comm.Free()
    assert_all(bool(ok))


@pytest.mark.mpi
def test_auto_swaps_shm_off_node(monkeypatch, tmp_path):
    """Where the table says shm and the ranks span nodes, auto runs the hierarchical
    counterpart (allreduce: hierarchical_shm; others: hierarchical), and where every node holds
    one rank (2 ranks here) the part across nodes (allreduce: ring; others: MPI's own),
    correctly."""
    import json

    from mpi4py import MPI

    from collectives import select
    from tests.mpiutil import assert_all
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("one rank never spans nodes")
    comm = MPI.COMM_WORLD.Dup()
    size, rank = comm.Get_size(), comm.Get_rank()
    table = tmp_path / f"tuning-{rank}.json"  # a table that says shm above 1 MiB
    rules = [[1 << 20, "native"], [None, "shm"]]
    table.write_text(json.dumps({"version": 1, "tables": {
        c: {"default": rules, str(size): rules, select.MULTI: {"default": rules}}
        for c in ("allreduce", "reduce_scatter")}}))
    monkeypatch.setenv("COLLECTIVES_TUNING", str(table))
    alone = size == 2  # nodes of one rank; at 3 ranks and more, nodes of two
    monkeypatch.setenv("COLLECTIVES_RANKS_PER_NODE", "1" if alone else "2")
    config.reload()  # read the environment again (and again after the test)
    n = 1 << 20  # 4 MiB of float32 per rank
    from collectives.api import auto_pick
    picked = select.auto("allreduce", 4 * n, size)  # the table's word, before the topology
    try:
        chose = (auto_pick("allreduce", 4 * n, comm),
                 auto_pick("reduce_scatter", 8 * size * (1 << 17), comm))
        got = coll.allreduce(np.full(n, rank + 1, np.float32), comm=comm)
        block = coll.reduce_scatter(np.ones(size * (1 << 17), np.int64), comm=comm)
    finally:
        comm.Free()
    want = ("ring", "native") if alone else ("hierarchical_shm", "hierarchical")
    ok = picked == "shm" and chose == want and \
        bool((got == size * (size + 1) / 2).all()) and bool((block == size).all())
    assert_all(ok, f"table {picked}, auto {chose}")


@pytest.mark.mpi
def test_a_call_keeps_no_output_alive():
    """A caller's output goes when the caller drops it, with the cyclic collector off: no
    reference cycle of the combining code keeps it (a training loop would hold every step's
    activations until the collector ran)."""
    import gc
    import weakref

    from mpi4py import MPI
    from tests.mpiutil import assert_all
    one_node_only()
    world = MPI.COMM_WORLD
    kept = []
    gc.collect()
    gc.disable()
    try:
        for count in (1, 1 << 10, 1 << 17):
            for run in (lambda x: coll.allreduce(x, algorithm="shm"),
                        lambda x: coll.reduce(x, root=0, algorithm="shm")):
                out = run(np.ones(count, np.float32))
                if out is not None:
                    ref = weakref.ref(out)
                    del out
                    if ref() is not None:
                        kept.append(count)
    finally:
        gc.enable()
    assert_all(not kept, f"rank {world.Get_rank()}: outputs of {kept} elements still alive")
