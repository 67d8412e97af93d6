"""MPI tier: every collective x algorithm x dtype x op under mpiexec (any rank count).

Data are exact, rank-dependent small integers, so every result has a closed form computed
locally from all ranks' inputs; float results are also checked bitwise identical across ranks.
"""
import numpy as np
import pytest

import collectives as coll
from collectives.buffers import DTYPES
from collectives import api, config, select
from collectives.ops import NAMES, _ACCEPTS, dtype_kind
from tests import rounding
from tests.mpiutil import assert_all, op_inputs, refused_off_node, world

pytestmark = pytest.mark.mpi


def use_tuning(setting, tmp_path, name: str, rules: dict) -> None:
    """``COLLECTIVES_TUNING`` names a table of ``rules`` ({collective: rules}) for this
    communicator's size and every other, on one node and across nodes, one file a rank
    (``setting``: the conftest fixture)."""
    import json
    comm = world()
    size = comm.Get_size()
    table = tmp_path / f"{name}-{comm.Get_rank()}.json"
    table.write_text(json.dumps({"version": 1, "tables": {
        c: {"default": r, str(size): r, select.MULTI: {"default": r}}
        for c, r in rules.items()}}))
    setting("COLLECTIVES_TUNING", str(table))


LENGTHS = (0, 1, 5, 97)


@pytest.fixture(autouse=True, scope="module")
def small_segments():
    """Tiny segments so short arrays walk the multi-segment paths."""
    old = config.set("COLLECTIVES_SEGMENT_BYTES", 24)
    yield
    config.set("COLLECTIVES_SEGMENT_BYTES", old)


inputs = op_inputs


def reference(xs, op, dtype):
    dtype = np.dtype(dtype)
    stack = np.stack(xs) if xs[0].size else np.empty((len(xs), 0), dtype)
    if dtype.kind == "b":
        fn = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
              "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
              "bxor": np.logical_xor}[op]
        return fn.reduce(stack, axis=0)
    if op == "avg":
        return (stack.astype(np.complex128 if dtype.kind == "c" else np.float64).sum(0)
                / len(xs))
    fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    if dtype_kind(dtype) in "fc":  # exact small integers: reduce in float64
        return fn.reduce(stack.astype(np.complex128 if dtype.kind == "c" else np.float64),
                         axis=0)
    return fn.reduce(stack, axis=0, dtype=dtype)


def close(got, want, dtype, op="sum", xs=None):
    """``got`` equals the exact ``want``: to the bit, since the inputs are small integers whose
    sums, products, minima and maxima every dtype holds exactly; for ``avg`` (each input divided
    by the rank count, then summed: n + 1 roundings of terms of the inputs' mean magnitude),
    within ``rounding.average`` in the dtype's unit roundoff."""
    got = np.asarray(got)
    if got.shape != want.shape:
        return False
    if op != "avg":
        return bool(np.array_equal(got.astype(want.dtype), want))
    unit = float(np.finfo(dtype).eps) / 2
    wide = np.complex128 if np.dtype(dtype).kind == "c" else np.float64
    scale = np.abs(np.stack(xs).astype(wide)).mean(0) if len(xs[0]) else 0.0
    return bool((np.abs(got.astype(wide) - want) <= rounding.average(len(xs), scale, unit)).all())


def pairs():
    for dtype in DTYPES:
        for op in NAMES:
            if dtype_kind(dtype) in _ACCEPTS[op]:
                yield dtype, op


def identical(arr, comm) -> bool:
    """The same bytes on every rank."""
    mine = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    everyone = np.empty((comm.Get_size(), mine.size), np.uint8)
    comm.Allgather(mine, everyone)
    return bool((everyone == everyone[0]).all())


def _copier(collective: str, algorithm: str):
    """How a test makes a buffer ``algorithm`` takes: a copy, or a registered one where the
    algorithm runs on registered buffers only (collective: ``coll.empty``)."""
    if not select.get(collective, algorithm).registered:
        return np.copy

    def registered_copy(a):
        out = coll.empty(a.shape, a.dtype)
        out[...] = a
        return out
    return registered_copy


@pytest.mark.parametrize("algorithm", coll.algorithms("allreduce"))
def test_allreduce(algorithm):
    comm = world()
    if refused_off_node("allreduce", algorithm):
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    if algorithm == "shm":
        pytest.skip("shm has its own suite")
    copy = _copier("allreduce", algorithm)
    bad = []
    for dtype, op in pairs():
        for n in LENGTHS:
            xs = inputs(size, n, dtype, op)
            x = copy(xs[rank])
            want = reference(xs, op, dtype)
            got = coll.allreduce(x, op, out=None if copy is np.copy else copy(x),
                                 algorithm=algorithm)
            if not (close(got, want, dtype, op, xs) and np.array_equal(x, xs[rank])
                    and got.dtype == x.dtype):
                bad.append(f"{dtype.name} {op} n={n} out-of-place")
            y = copy(x)
            res = coll.allreduce(y, op, out=y, algorithm=algorithm)
            if res is not y or not close(y, want, dtype, op, xs):
                bad.append(f"{dtype.name} {op} n={n} in place")
    assert_all(not bad, f"{algorithm}: {bad[:5]}")


@pytest.mark.parametrize("algorithm", coll.algorithms("allreduce"))
def test_allreduce_bitwise_identical_floats(algorithm):
    if algorithm == "shm":
        pytest.skip("shm has its own suite")
    comm = world()
    if refused_off_node("allreduce", algorithm):
        return
    copy = _copier("allreduce", algorithm)
    rng = np.random.default_rng(1234 + comm.Get_rank())
    ok = True
    for dtype in (np.float32, np.float64, np.float16, coll.buffers.bfloat16):
        for n in (1, 31, 1000):
            x = copy(rng.standard_normal(n).astype(dtype).reshape(-1, 1) if n > 1 else
                     rng.standard_normal(n).astype(dtype))
            for _ in range(2):  # also the same from run to run
                got = coll.allreduce(x, out=None if copy is np.copy else copy(x),
                                     algorithm=algorithm)
                ok &= identical(got, comm) and got.shape == x.shape
            ok &= identical(coll.allreduce(x, "avg", out=None if copy is np.copy else copy(x),
                                           algorithm=algorithm), comm)
    assert_all(ok, algorithm)


@pytest.mark.parametrize("algorithm", coll.algorithms("reduce"))
def test_reduce_every_root(algorithm):
    comm = world()
    if refused_off_node("reduce", algorithm):
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = []
    for root in range(size):
        for dtype, op in pairs():
            for n in (0, 1, 13):
                xs = inputs(size, n, dtype, op)
                x = xs[rank].copy()
                got = coll.reduce(x, op, root=root, algorithm=algorithm)
                if rank == root:
                    if not close(got, reference(xs, op, dtype), dtype, op, xs):
                        bad.append(f"root {root} {dtype.name} {op} n={n}")
                elif got is not None:
                    bad.append(f"root {root}: non-root got {type(got)}")
                if not np.array_equal(x, xs[rank]):
                    bad.append("input modified")
    assert_all(not bad, f"{algorithm}: {bad[:5]}")


@pytest.mark.parametrize("algorithm", coll.algorithms("broadcast"))
def test_broadcast_every_root(algorithm):
    comm = world()
    if refused_off_node("broadcast", algorithm):
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    ok = True
    for root in range(size):
        for dtype in DTYPES:
            for shape in ((0,), (1,), (7, 3), (101,)):
                n = int(np.prod(shape))
                want = inputs(size, n, dtype, "sum")[root].reshape(shape)
                x = want.copy() if rank == root else np.zeros(shape, dtype)
                res = coll.broadcast(x, root=root, algorithm=algorithm)
                ok &= res is x and np.array_equal(x, want)
    assert_all(ok, algorithm)


@pytest.mark.parametrize("algorithm", coll.algorithms("reduce_scatter"))
def test_reduce_scatter(algorithm):
    comm = world()
    if refused_off_node("reduce_scatter", algorithm):
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = []
    for dtype, op in pairs():
        for n in LENGTHS:
            xs = inputs(size, n, dtype, op)
            want = reference(xs, op, dtype)
            blocks = np.array_split(want, size)
            got = coll.reduce_scatter(xs[rank].copy(), op, algorithm=algorithm)
            if not close(got, blocks[rank], dtype, op,
                         [np.array_split(x, size)[rank] for x in xs]):
                bad.append(f"{dtype.name} {op} n={n}")
    # ragged counts with empty blocks; out= given
    counts = [(3 * r) % 4 for r in range(size)]
    xs = inputs(size, sum(counts), np.int64, "sum")
    out = np.empty(counts[rank], np.int64)
    res = coll.reduce_scatter(xs[rank], counts=counts, out=out, algorithm=algorithm)
    start = sum(counts[:rank])
    if res is not out or not np.array_equal(out, sum(xs)[start:start + counts[rank]]):
        bad.append(f"ragged {counts}")
    assert_all(not bad, f"{algorithm}: {bad[:5]}")


@pytest.mark.parametrize("algorithm", coll.algorithms("allgather"))
def test_allgather_ragged(algorithm):
    comm = world()
    if refused_off_node("allgather", algorithm):
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    ok = True
    for dtype in DTYPES:
        rows = [(r * 2 + 1) % 3 for r in range(size)]  # includes ranks with no rows
        xs = [inputs(size, rows[r] * 2, dtype, "sum")[r].reshape(rows[r], 2)
              for r in range(size)]
        got = coll.allgather(xs[rank].copy(), algorithm=algorithm)
        ok &= got.shape == (sum(rows), 2) and np.array_equal(got, np.concatenate(xs))
        one = coll.allgather(np.full(5, rank, dtype=np.int32), algorithm=algorithm)
        ok &= np.array_equal(one, np.repeat(np.arange(size, dtype=np.int32), 5))
    assert_all(ok, algorithm)


def test_native_takes_the_block_calls_for_equal_counts():
    """MPI's own allgather and reduce-scatter: ``MPI_Allgather`` / ``Reduce_scatter_block``
    when every rank has as many elements, the vector calls when not; blocking and not."""
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = []
    for rows in ([3] * size, [(r * 2 + 1) % 3 for r in range(size)]):
        x = np.full((rows[rank], 2), rank, np.int32)
        want = np.concatenate([np.full((rows[r], 2), r, np.int32) for r in range(size)])
        for got in (coll.allgather(x, algorithm="native"),
                    coll.iallgather(x, algorithm="native").wait()):
            if got.shape != want.shape or not np.array_equal(got, want):
                bad.append(f"allgather {rows}")
    for counts in ([4] * size, [(3 * r) % 4 for r in range(size)]):
        x = np.arange(sum(counts), dtype=np.int64) * (rank + 1)
        total = np.arange(sum(counts), dtype=np.int64) * (size * (size + 1) // 2)
        start = sum(counts[:rank])
        for got in (coll.reduce_scatter(x, counts=counts, algorithm="native"),
                    coll.ireduce_scatter(x, counts=counts, algorithm="native").wait()):
            if not np.array_equal(got, total[start:start + counts[rank]]):
                bad.append(f"reduce_scatter {counts}")
    assert_all(not bad, f"native: {bad}")


def test_allgather_auto_agrees_on_ragged_lengths():
    """Ranks of very different lengths (0 B to 4 MiB each, across the tuning table's rules):
    ``auto`` picks from the agreed mean, so every rank runs the same algorithm (a pick from
    each rank's own length left rank 0 in native and rank 1 in recursive doubling: a hang)."""
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    lengths = [(1 << 20, 0, 300_000, 1, 7)[r % 5] for r in range(size)]
    x = np.full(lengths[rank], rank + 1, np.float32)
    old = config.set("COLLECTIVES_SEGMENT_BYTES", 4 << 20)  # 24-byte segments: 10^5 steps a call
    try:
        got = coll.allgather(x)
    finally:
        config.set("COLLECTIVES_SEGMENT_BYTES", old)
    want = np.concatenate([np.full(n, r + 1, np.float32) for r, n in enumerate(lengths)])
    assert_all(got.shape == want.shape and np.array_equal(got, want), "ragged auto")


@pytest.mark.parametrize("algorithm", ["auto", "ring", "native"])
def test_sub_communicators(algorithm):
    comm = world()
    rank = comm.Get_rank()
    sub = comm.Split(rank % 2, rank)
    try:
        members = [r for r in range(comm.Get_size()) if r % 2 == rank % 2]
        x = np.full(11, rank + 1, np.int64)
        got = coll.allreduce(x, comm=sub, algorithm=algorithm)
        g = coll.allgather(np.array([rank]), comm=sub, algorithm="auto")
        assert_all(np.array_equal(got, np.full(11, sum(m + 1 for m in members)))
                   and np.array_equal(g, members), f"sub-communicator {algorithm}")
    finally:
        sub.Free()


def test_non_blocking_out_of_order():
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    total = size * (size + 1) // 2
    reqs = [coll.iallreduce(np.full(1000 + k, rank + 1 + k, np.int64),
                            algorithm=("ring", "native")[k % 2]) for k in range(6)]
    rs = coll.ireduce_scatter(np.full(10 * size, rank, np.int64))
    ag = coll.iallgather(np.array([rank, rank]))
    b = np.arange(4.0) if rank == 0 else np.zeros(4)
    bc = coll.ibroadcast(b)
    ok = all(np.array_equal(reqs[k].wait(), np.full(1000 + k, total + size * k))
             for k in reversed(range(6)))
    ok &= np.array_equal(bc.wait(), np.arange(4.0)) and bc.test()
    ok &= np.array_equal(ag.wait(), np.repeat(np.arange(size), 2))
    ok &= np.array_equal(rs.wait(), np.full(10, size * (size - 1) // 2))
    assert_all(ok, "non-blocking")


def test_auto_follows_the_table_in_force(setting, tmp_path):
    """auto runs what the tuning table says for the size, and a table named afterwards takes
    effect on the next call (auto's picks are memoized per communicator and table)."""
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    ran = []
    for name in ("tree", "ring", "tree"):
        use_tuning(setting, tmp_path, name, {"allreduce": [[64, "native"], [None, name]]})
        small = coll.iallreduce(np.ones(4, np.float32))        # 16 bytes: native
        req = coll.iallreduce(np.full(100, rank + 1, np.int64))   # 800 bytes: the table's
        ran.append((small.description, req.description))
        assert_all(np.array_equal(req.wait(), np.full(100, size * (size + 1) // 2))
                   and np.array_equal(small.wait(), np.full(4, size, np.float32)), name)
    ok = all("(native," in a and f"({name}," in b
             for (a, b), name in zip(ran, ("tree", "ring", "tree")))
    assert_all(ok, f"auto ran {ran}")


def test_auto_repeats_a_plan_only_for_a_call_like_it(setting, tmp_path):
    """An auto call repeats the last auto call's plan only when nothing its pick depends on
    changed: an allgather whose rank 0 passes the same length again, while the others pass
    more, picks from the new mean (a plan keyed by rank 0's own bytes ran native there while
    the others ran ring: a hang), and the same with every length as before picks as before."""
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    use_tuning(setting, tmp_path, "plan", {"allgather": [[64, "native"], [None, "ring"]]})
    ran, ok = [], True
    for others in (4, 100, 100, 4):  # float32 elements of ranks > 0; rank 0 passes 4
        n = 4 if rank == 0 else others
        req = coll.iallgather(np.full(n, rank, np.float32))
        ran.append(req.description)
        want = np.concatenate([np.full(4 if r == 0 else others, r, np.float32)
                               for r in range(size)])
        ok &= np.array_equal(req.wait(), want)
    mean_small = [(16 + 4 * others * (size - 1)) // size <= 64 for others in (4, 100, 100, 4)]
    ok &= all(f"({'native' if small else 'ring'}," in d for d, small in zip(ran, mean_small))
    assert_all(ok, f"auto ran {ran}")


def test_auto_in_place_has_rules_of_its_own(setting, tmp_path):
    """An allreduce in place on every rank runs the table's in-place rule for its size, out of
    place the other; both give the right sum. Across nodes of several ranks the multi-node
    rules hold for both."""
    import json

    from collectives.topology import topology
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    table = tmp_path / f"inplace-{rank}.json"
    table.write_text(json.dumps({"version": 1, "tables": {"allreduce": {
        "default": [[None, "ring"]], str(size): [[None, "ring"]],
        "in-place": {"default": [[None, "tree"]], str(size): [[None, "tree"]]},
        select.MULTI: {"default": [[None, "ring"]]}}}}))
    setting("COLLECTIVES_TUNING", str(table))
    nodes = topology(comm).nodes
    in_place = "ring" if len(nodes) > 1 and max(map(len, nodes)) > 1 else "tree"
    want = np.full(100, size * (size + 1) // 2)
    x = np.full(100, rank + 1, np.int64)
    out = coll.iallreduce(x)
    x2 = x.copy()
    inplace = coll.iallreduce(x2, out=x2)
    ok = np.array_equal(out.wait(), want) and np.array_equal(inplace.wait(), want)
    ok &= "(ring," in out.description and f"({in_place}," in inplace.description
    assert_all(ok, f"auto ran {out.description} / {inplace.description}")


def _single_node(comm) -> bool:
    from collectives.topology import topology
    return topology(comm).single_node


# Collectives whose result is the same on every rank (or on the root): all-to-all, gather and
# scatter run auto in tests/test_alltoall.py.
@pytest.mark.parametrize("collective", ["allreduce", "reduce", "broadcast", "reduce_scatter",
                                        "allgather"])
def test_auto_runs_the_tables_pick(collective):
    """``auto`` runs what ``select.auto`` reads from the tuning table in force (the default
    table here) for every rule's sizes, out of place and in place, and ``api.auto_pick`` names
    it; the result is the one the named pick gives, run the same way (non-blocking), the same
    on every rank. Bitwise for our algorithms, whose order of operations is fixed; MPI's own
    reductions (``native``) to float32 rounding: MPI does not promise that two calls sum in the
    same order (Open MPI's MPI_Iallreduce and MPI_Allreduce do not at 4-64 KiB)."""
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    rules = select.load_table()[collective]
    limits = sorted({limit for rule in rules.values() if isinstance(rule, list)
                     for limit, _ in rule if limit is not None and limit <= 4 << 20})
    nbytes = sorted({4 * size} | {max(4 * size, limit - limit % (4 * size)) for limit in limits}
                    | {limit + 4 * size for limit in limits})
    old = config.set("COLLECTIVES_SEGMENT_BYTES", 1 << 20)  # this module's 24 B: too slow here
    bad = []
    try:
        for n in nbytes:
            x = (np.random.default_rng(rank).standard_normal(n // 4) * 10.0 ** rank
                 ).astype(np.float32)
            for inplace in ((False, True) if collective == "allreduce" else (False,)):
                pick = api.auto_pick(collective, x.nbytes, comm, inplace=inplace)
                want = select.auto(collective, x.nbytes, size, lambda: _single_node(comm),
                                   inplace)
                if pick != want or pick not in coll.algorithms(collective):
                    bad.append(f"{n} B in place {inplace}: auto_pick {pick}, select.auto {want}")
                    continue
                run = getattr(coll, "i" + collective)
                if inplace:  # in place on every rank: out is x
                    y = x.copy()
                    req = run(y, out=y, comm=comm)
                else:
                    req = run(x, comm=comm)
                got = req.wait()
                if f"({pick}, " not in req.description:
                    bad.append(f"{n} B in place {inplace}: ran {req.description}, not {pick}")
                y = x.copy()
                named = run(y, comm=comm, algorithm=pick, **(
                    dict(out=y) if inplace else {})).wait()
                if got is None or named is None:  # reduce off the root
                    if (got is None) != (named is None) or (rank == 0) == (got is None):
                        bad.append(f"{n} B: reduce gave {type(got)} / {type(named)}")
                    continue
                got, named = np.asarray(got), np.asarray(named)
                if pick == "native" and collective in ("allreduce", "reduce",
                                                       "reduce_scatter"):
                    # |x| <= ~5 * 10**(size-1): float32 sums in any order agree to this
                    same = got.shape == named.shape and np.allclose(
                        got, named, rtol=1e-5, atol=1e-5 * 10.0 ** (size - 1))
                else:
                    same = got.tobytes() == named.tobytes()
                if not same:
                    bad.append(f"{n} B in place {inplace}: not {pick}'s result")
                if collective not in ("reduce", "reduce_scatter") and \
                        not identical(np.asarray(got), comm):
                    bad.append(f"{n} B in place {inplace}: ranks differ")
    finally:
        config.set("COLLECTIVES_SEGMENT_BYTES", old)
    assert_all(not bad, f"{collective}: {bad[:4]}")


def test_auto_pick_is_the_same_on_every_rank_and_never_none():
    """``api.auto_pick`` names a registered algorithm for every collective and size, the same
    on every rank, and agrees with ``select.auto``."""
    comm = world()
    size = comm.Get_size()
    picks, bad = [], []
    for collective in select.COLLECTIVES:
        for nbytes in (0, 8, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 1 << 30):
            pick = api.auto_pick(collective, nbytes, comm)
            picks.append(pick)
            if pick is None or pick not in coll.algorithms(collective) or pick != \
                    select.auto(collective, nbytes, size, lambda: _single_node(comm)):
                bad.append(f"{collective} {nbytes}: {pick}")
    seen = comm.allgather(picks)
    assert_all(not bad and all(p == picks for p in seen), f"{bad[:4]} {seen[0] != picks}")


@pytest.mark.timeout(30)
def test_a_mismatched_auto_call_raises_on_every_rank():
    """Lengths that differ across ranks, with ``algorithm="auto"`` (whose pick each rank makes
    from its own length: with the default table, native on the short ranks and a single-node
    algorithm on rank 0, which asks the topology, collective on a communicator's first use)
    and the check on: every rank raises MismatchError, none waits for the others. On a new
    communicator, so that its topology is not known yet."""
    comm = world().Dup()
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        if size == 1:
            pytest.skip("needs two ranks to disagree")
        y = np.ones((16 << 20) // 4 if rank == 0 else 10, np.float32)
        try:
            coll.broadcast(y, comm=comm, check=True)
            got = "no error"
        except coll.MismatchError as e:
            got = "mismatch" if "elements" in str(e) else str(e)
        assert_all(got == "mismatch", f"rank {rank}: {got}")
    finally:
        comm.Free()


def test_torch_tensors_round_trip():
    torch = pytest.importorskip("torch")
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        t = torch.full((3, 4), rank + 1, dtype=dtype)
        got = coll.allreduce(t, algorithm="ring")
        ok &= isinstance(got, torch.Tensor) and got.dtype == dtype and got.shape == t.shape
        ok &= bool((got == size * (size + 1) // 2).all())
        coll.allreduce(t, out=t, op="max")
        ok &= bool((t == size).all())
    assert_all(ok, "torch")
