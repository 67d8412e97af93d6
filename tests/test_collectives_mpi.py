"""MPI tier: every collective x algorithm x dtype x op under mpiexec (any rank count).

Data are exact, rank-dependent small integers, so every result has a closed form computed
locally from all ranks' inputs; float results are also checked bitwise identical across ranks.
"""
import numpy as np
import pytest

import collectives as coll
from collectives.buffers import DTYPES
from collectives.executor import set_segment_bytes
from collectives.ops import NAMES, _ACCEPTS, dtype_kind
from tests.mpiutil import assert_all, world, op_inputs

pytestmark = pytest.mark.mpi


def use_tuning(monkeypatch, tmp_path, name: str, rules: dict) -> None:
    """``COLLECTIVES_TUNING`` names a table of ``rules`` ({collective: rules}) for this
    communicator's size and every other, one file a rank, with trials on."""
    import json
    comm = world()
    size = comm.Get_size()
    table = tmp_path / f"{name}-{comm.Get_rank()}.json"
    table.write_text(json.dumps({"version": 1, "tables": {
        c: {"default": r, str(size): r} for c, r in rules.items()}}))
    monkeypatch.setenv("COLLECTIVES_TUNING", str(table))
    monkeypatch.setenv("COLLECTIVES_AUTO_TRIAL", "1")

LENGTHS = (0, 1, 5, 97)


@pytest.fixture(autouse=True, scope="module")
def small_segments():
    """Tiny segments so short arrays walk the multi-segment paths (STYLE 13)."""
    old = set_segment_bytes(24)
    yield
    set_segment_bytes(old)


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


def close(got, want, dtype):
    got = np.asarray(got)
    if np.dtype(dtype).kind in "bui":
        return got.shape == want.shape and np.array_equal(got, want)
    g = got.astype(np.complex128 if np.dtype(dtype).kind == "c" else np.float64)
    tol = 1e-2 if np.dtype(dtype).itemsize <= 2 else 1e-6
    return g.shape == want.shape and np.allclose(g, want, rtol=tol, atol=tol)


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


@pytest.mark.parametrize("algorithm", coll.algorithms("allreduce"))
def test_allreduce(algorithm):
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    if algorithm == "shm":
        pytest.skip("shm has its own suite")
    bad = []
    for dtype, op in pairs():
        for n in LENGTHS:
            xs = inputs(size, n, dtype, op)
            x = xs[rank].copy()
            want = reference(xs, op, dtype)
            got = coll.allreduce(x, op, algorithm=algorithm)
            if not (close(got, want, dtype) and np.array_equal(x, xs[rank])
                    and got.dtype == x.dtype):
                bad.append(f"{dtype.name} {op} n={n} out-of-place")
            y = x.copy()
            res = coll.allreduce(y, op, out=y, algorithm=algorithm)
            if res is not y or not close(y, want, dtype):
                bad.append(f"{dtype.name} {op} n={n} in place")
    assert_all(not bad, f"{algorithm}: {bad[:5]}")


@pytest.mark.parametrize("algorithm", coll.algorithms("allreduce"))
def test_allreduce_bitwise_identical_floats(algorithm):
    if algorithm == "shm":
        pytest.skip("shm has its own suite")
    comm = world()
    rng = np.random.default_rng(1234 + comm.Get_rank())
    ok = True
    for dtype in (np.float32, np.float64, np.float16, coll.buffers.bfloat16):
        for n in (1, 31, 1000):
            x = rng.standard_normal(n).astype(dtype).reshape(-1, 1) if n > 1 else \
                rng.standard_normal(n).astype(dtype)
            for _ in range(2):  # also the same from run to run
                got = coll.allreduce(x, algorithm=algorithm)
                ok &= identical(got, comm) and got.shape == x.shape
            ok &= identical(coll.allreduce(x, "avg", algorithm=algorithm), comm)
    assert_all(ok, algorithm)


@pytest.mark.parametrize("algorithm", coll.algorithms("reduce"))
def test_reduce_every_root(algorithm):
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = []
    for root in range(size):
        for dtype, op in pairs():
            for n in (0, 1, 13):
                xs = inputs(size, n, dtype, op)
                x = xs[rank].copy()
                got = coll.reduce(x, op, root=root, algorithm=algorithm)
                if rank == root:
                    if not close(got, reference(xs, op, dtype), dtype):
                        bad.append(f"root {root} {dtype.name} {op} n={n}")
                elif got is not None:
                    bad.append(f"root {root}: non-root got {type(got)}")
                if not np.array_equal(x, xs[rank]):
                    bad.append("input modified")
    assert_all(not bad, f"{algorithm}: {bad[:5]}")


@pytest.mark.parametrize("algorithm", coll.algorithms("broadcast"))
def test_broadcast_every_root(algorithm):
    comm = world()
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
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = []
    for dtype, op in pairs():
        for n in LENGTHS:
            xs = inputs(size, n, dtype, op)
            want = reference(xs, op, dtype)
            blocks = np.array_split(want, size)
            got = coll.reduce_scatter(xs[rank].copy(), op, algorithm=algorithm)
            if not close(got, blocks[rank], dtype):
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
    old = set_segment_bytes(4 << 20)  # this module's 24-byte segments: 10^5 steps a call
    try:
        got = coll.allgather(x)
    finally:
        set_segment_bytes(old)
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


def test_auto_follows_the_table_in_force(monkeypatch, tmp_path):
    """auto runs what the tuning table says for the size, and a table named afterwards takes
    effect on the next call (auto's picks are memoized per communicator and table)."""
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    ran = []
    for name in ("tree", "ring", "tree"):
        use_tuning(monkeypatch, tmp_path, name, {"allreduce": [[64, "native"], [None, name]]})
        small = coll.iallreduce(np.ones(4, np.float32))        # 16 bytes: native
        req = coll.iallreduce(np.full(100, rank + 1, np.int64))   # 800 bytes: the table's
        ran.append((small.description, req.description))
        assert_all(np.array_equal(req.wait(), np.full(100, size * (size + 1) // 2))
                   and np.array_equal(small.wait(), np.full(4, size, np.float32)), name)
    ok = all("(native," in a and f"({name}," in b
             for (a, b), name in zip(ran, ("tree", "ring", "tree")))
    assert_all(ok, f"auto ran {ran}")


def test_auto_repeats_a_plan_only_for_a_call_like_it(monkeypatch, tmp_path):
    """An auto call repeats the last auto call's plan only when nothing its pick depends on
    changed: an allgather whose rank 0 passes the same length again, while the others pass
    more, picks from the new mean (a plan keyed by rank 0's own bytes ran native there while
    the others ran ring: a hang), and the same with every length as before picks as before."""
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    use_tuning(monkeypatch, tmp_path, "plan", {"allgather": [[64, "native"], [None, "ring"]]})
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


def test_auto_in_place_has_rules_of_its_own(monkeypatch, tmp_path):
    """An allreduce in place on every rank runs the table's in-place rule for its size, out of
    place the other; both give the right sum."""
    import json
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    table = tmp_path / f"inplace-{rank}.json"
    table.write_text(json.dumps({"version": 1, "tables": {"allreduce": {
        "default": [[None, "ring"]], str(size): [[None, "ring"]],
        "in-place": {"default": [[None, "tree"]], str(size): [[None, "tree"]]}}}}))
    monkeypatch.setenv("COLLECTIVES_TUNING", str(table))
    want = np.full(100, size * (size + 1) // 2)
    x = np.full(100, rank + 1, np.int64)
    out = coll.iallreduce(x)
    x2 = x.copy()
    inplace = coll.iallreduce(x2, out=x2)
    ok = np.array_equal(out.wait(), want) and np.array_equal(inplace.wait(), want)
    ok &= "(ring," in out.description and "(tree," in inplace.description
    assert_all(ok, f"auto ran {out.description} / {inplace.description}")


@pytest.mark.parametrize("trials", ["on", "off", "default"])
def test_auto_measures_the_algorithms_of_a_rule(monkeypatch, tmp_path, trials):
    """A rule naming several algorithms: where the choice cannot change a result (2 ranks, or a
    collective that only moves data) auto runs them in blocks, in turn, in a race of 5 to 30
    rounds, then every rank runs the winner by the slowest rank's times (by default too where
    a node runs more of the ranks than it has cores); elsewhere, and with
    COLLECTIVES_AUTO_TRIAL=0, the rule's first. Non-blocking
    calls run the first meanwhile and do not count; a float min/max always runs the first.
    Results are right all along."""
    import json

    from collectives import api
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    names = ["ring", "recursive_doubling", "native"]
    table = tmp_path / f"trial-{rank}.json"
    table.write_text(json.dumps({"version": 1, "tables": {
        "allreduce": {"default": [[None] + names], str(size): [[None] + names]},
        "allgather": {"default": [[None, "ring", "native"]],
                      str(size): [[None, "ring", "native"]]}}}))
    monkeypatch.setenv("COLLECTIVES_TUNING", str(table))
    if trials == "default":
        monkeypatch.delenv("COLLECTIVES_AUTO_TRIAL", raising=False)
    else:
        monkeypatch.setenv("COLLECTIVES_AUTO_TRIAL", "1" if trials == "on" else "0")
    allowed = trials != "off"
    x = np.full(1000, rank + 1, np.float32)
    want = size * (size + 1) // 2
    bad = []
    for collective, rule, exact in (("allreduce", names, size == 2),
                                    ("allgather", ["ring", "native"], True)):
        measured = allowed and size > 1 and exact
        if collective == "allreduce":
            call, check = (lambda: coll.allreduce(x, comm=comm)), (lambda y: (y == want).all())
            req = coll.iallreduce(x, comm=comm)
            if "(ring, 1000" not in req.description or not (req.wait() == want).all():
                bad.append(f"non-blocking: {req.description}")
        else:
            call = lambda: coll.allgather(x, comm=comm)  # noqa: E731
            check = lambda y: np.array_equal(y, np.repeat(np.arange(1, size + 1), 1000))  # noqa
        calls = 0
        while calls < 20000 and (calls == 0 or api.auto_pick(collective, x.nbytes, comm) is None):
            if calls < len(rule) * (2 + 3 * api._Trial.MIN_ROUNDS) and \
                    (api.auto_pick(collective, x.nbytes, comm) is None) != measured:
                bad.append(f"{collective} call {calls}: "
                           f"{api.auto_pick(collective, x.nbytes, comm)}")
            if not check(call()):
                bad.append(f"{collective} call {calls}: wrong result")
            calls += 1
        pick = api.auto_pick(collective, x.nbytes, comm)
        picks = comm.allgather(pick)
        if pick not in rule or len(set(picks)) > 1 or not (measured or pick == rule[0]):
            bad.append(f"{collective}: picks {picks}")
        trial = api.auto_trial(collective, x.nbytes, comm)
        if (sorted(trial or ()) != sorted(rule)) if measured else trial is not None:
            bad.append(f"{collective}: measured {trial}")
        if not check(call()):
            bad.append(f"{collective} after: wrong result")
        if collective == "allreduce":
            # after the trial, a non-blocking call runs the pick too; a float max, whose -0.0
            # against +0.0 depends on the operands' order, the rule's first
            after, peak = coll.iallreduce(x, comm=comm), coll.iallreduce(x, "max", comm=comm)
            if f"({pick}, " not in after.description or "(ring, " not in peak.description \
                    or not (after.wait() == want).all() or not (peak.wait() == size).all():
                bad.append(f"after: {after.description} / {peak.description}")
            # and blocking: a float max right after a sum that ran the pick runs the rule's
            # first (auto's plan path repeats a pick other than the first only for calls
            # that every algorithm gives alike, _exact; on one rank every call is a copy, and
            # no schedule runs)
            ran, real = [], api._run_schedule
            monkeypatch.setattr(api, "_run_schedule",
                                lambda c, name, b: (ran.append(name), real(c, name, b))[1])
            sums, peaks = call(), coll.allreduce(x, "max", comm=comm)
            monkeypatch.setattr(api, "_run_schedule", real)
            if not check(sums) or not (peaks == size).all() or size > 1 and (
                    ran[-1:] != ["ring"] or (pick != "native") != (len(ran) == 2)):
                bad.append(f"blocking after: ran {ran}, pick {pick}")
    assert_all(not bad, f"trials {trials}: {bad[:4]}")


@pytest.mark.parametrize("order", ["tree", "ring"])
def test_auto_races_the_algorithms_that_give_the_same_bits(monkeypatch, tmp_path, order):
    """On 3 ranks and more a reduction's rule races only the algorithms that combine in its
    first's order (select.bits): tree and shm (its allreduce up to shm.WHOLE_MAX_BYTES, and
    its reduce); ring and shm (its allreduce above that bound, lowered here, and its
    reduce-scatter); a rule led by another runs its first; hierarchical_shm, shm itself on
    one node, does not race shm. Every call gives the rule's first's bits, the same on every
    rank."""
    from collectives import api, shm
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 3:
        pytest.skip("at 2 ranks every algorithm gives the same bits")
    if order == "ring":
        monkeypatch.setattr(shm, "WHOLE_MAX_BYTES", {None: 1024})
    rules = {"allreduce": [[4000, "native", "shm", "tree"],
                           [None, "shm", "hierarchical_shm", "ring", "tree"]],
             "reduce": [[4000, "native", "shm", "tree"], [None, "tree", "native", "shm"]],
             "reduce_scatter": [[4000, "native", "shm", "ring"],
                                [None, "ring", "tree", "shm", "native"]]}
    use_tuning(monkeypatch, tmp_path, "same" + order, rules)
    raced_by = {"allreduce": {"tree", "shm"} if order == "tree" else {"ring", "shm"},
                "reduce": {"tree", "shm"}, "reduce_scatter": {"ring", "shm"}}
    bad = []
    for n, raced in ((501, False), (5001, True)):
        n -= n % size  # a reduce-scatter's blocks alike
        x = (np.random.default_rng(rank).standard_normal(n) * 10.0 ** rank).astype(np.float32)
        for c in rules:
            first = rules[c][raced][1]  # its bits, and when raced its partners' alike
            want = getattr(coll, c)(x, comm=comm, algorithm=first)
            for call in range(20000):
                got = getattr(coll, c)(x, comm=comm)
                if (rank == 0 or c != "reduce") and got.tobytes() != want.tobytes():
                    bad.append(f"{c} {n}: call {call} not {first}'s bits")
                    break
                if api.auto_pick(c, x.nbytes, comm) is not None:
                    break
            trial = api.auto_trial(c, x.nbytes, comm)
            if (set(trial or ()) != raced_by[c]) if raced else trial is not None:
                bad.append(f"{c} {n}: measured {trial}")
            if c == "allreduce" and len({bytes(b) for b in comm.allgather(got.tobytes())}) > 1:
                bad.append(f"{c} {n}: ranks differ")
    assert_all(not bad, str(bad[:4]))


def test_a_race_steps_straight_through_calls_like_the_last(monkeypatch, tmp_path):
    """While a race runs, a blocking call like the last goes straight to the race's next step
    (``_Trial.step``), not through ``_auto_plan`` again; a call unlike it (another length, a
    non-blocking one) takes the full path and runs what it would have; after the race, calls
    like the last run the pick from the plan kept for them. Results right all along."""
    from collectives import api
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        pytest.skip("no race on one rank")
    use_tuning(monkeypatch, tmp_path, "step", {"allgather": [[None, "ring", "native"]]})
    planned, stepped = [], []
    plan, step = api._auto_plan, api._Trial.step
    monkeypatch.setattr(api, "_auto_plan",
                        lambda call, *a, **k: (planned.append(call.x.count), plan(call, *a, **k))[1])
    monkeypatch.setattr(api._Trial, "step",
                        lambda self, call: (stepped.append(call.x.count), step(self, call))[1])
    x, y = np.full(64, rank, np.int32), np.full(3, rank, np.int32)
    want = np.repeat(np.arange(size, dtype=np.int32), 64)
    bad, calls = [], 0
    while api.auto_pick("allgather", x.nbytes, comm) is None and calls < 20000:
        if not np.array_equal(coll.allgather(x, comm=comm), want):
            bad.append(f"call {calls}: wrong")
        calls += 1
        if calls == 7:  # unlike the last: a non-blocking call, another length, then back
            other = planned[:]
            req = coll.iallgather(x, comm=comm)
            if "(ring, " not in req.description or not np.array_equal(req.wait(), want):
                bad.append(f"non-blocking in the race: {req.description}")
            if not np.array_equal(coll.allgather(y, comm=comm),
                                  np.repeat(np.arange(size, dtype=np.int32), 3)):
                bad.append("another length: wrong")
            if len(planned) != len(other) + 2:
                bad.append(f"unlike calls planned {len(planned) - len(other)}, not 2")
    races = [n for n in planned if n == 64]
    # the first call and the one after the two unlike it; and once more where the race's
    # ending call is the last one in the loop (the next call would take the plan's pick)
    if calls < 20 or len(races) > 3 or len(stepped) < calls - 3 or set(stepped) != {64}:
        bad.append(f"{calls} calls: {len(races)} planned, {len(stepped)} stepped")
    before = len(stepped)
    for _ in range(50):
        if not np.array_equal(coll.allgather(x, comm=comm), want):
            bad.append("after the race: wrong")
    last = api._context(comm).auto_last
    pick = api.auto_pick("allgather", x.nbytes, comm)
    if len(stepped) != before or last[5] is None or last[5][0] != pick:
        bad.append(f"after the race: stepped {len(stepped) - before}, plan {last[5]}")
    assert_all(not bad, str(bad[:4]))


def test_auto_measures_again_as_the_machine_changes(monkeypatch, tmp_path):
    """A decided trial races again after its calls are used up (seconds at the pick's pace):
    every rank at the same call, results right all along, the picks the same on every rank;
    while the pick stays, the wait doubles; COLLECTIVES_AUTO_RETRIAL=0 races once."""
    from collectives import api
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("one rank has nothing to choose")
    use_tuning(monkeypatch, tmp_path, "retrial", {"allgather": [[None, "ring", "native"]],
                                                   "reduce": [[None, "tree", "shm"]]})
    monkeypatch.setattr(api._Trial, "RETRIAL_SHARE", 0)
    monkeypatch.setattr(api._Trial, "RETRIAL_S", 2e-3)  # a few calls after each race
    x = np.full(100, rank + 1, np.float32)
    want = np.repeat(np.arange(1, size + 1, dtype=np.float32), 100)
    bad, races, waits, deciding = [], 0, [], True
    for call in range(200000):  # a race takes 1000-6000 calls here
        if not np.array_equal(coll.allgather(x, comm=comm), want):
            bad.append(f"call {call}: wrong result")
        undecided = api.auto_pick("allgather", x.nbytes, comm) is None
        if deciding and not undecided:
            races += 1
            hit = api._context(comm).auto["allgather"][x.nbytes]
            waits.append((hit.decided[0], hit.every))
        deciding = undecided
        if races == 4:
            break
    seen = comm.allgather(waits)
    if races < 4 or any(w != waits for w in seen):
        bad.append(f"{races} races, waits {seen}")
    for (p0, e0), (p1, e1) in zip(waits, waits[1:]):
        if e1 != (2 * e0 if p1 == p0 else api._Trial.RETRIAL_S):
            bad.append(f"waits {waits}")
    from mpi4py import MPI

    # A race that picks another algorithm: every call after it runs the new pick, on every
    # rank, whichever way its calls take (rank 0 alternates in place and not, which breaks
    # the plan kept for calls like the last; the others repeat one kind of call).
    decide, turns = api._Trial._decide, [0]

    def alternate(self):
        done = decide(self)
        if done:
            turns[0] += 1
            i = turns[0] % len(self.names)
            self.decided = (self.names[i], self.builders[i])
        return done
    monkeypatch.setattr(api._Trial, "_decide", alternate)
    z = np.full(300, rank + 1, np.float32)
    hit, races, stale = None, 0, []
    for call in range(200000):
        if rank == 0 and call % 2:
            w = z.copy()
            coll.reduce(w, out=w)
        else:
            coll.reduce(z)
        hit = hit or api._context(comm).auto["reduce"].get(z.nbytes)
        last = api._context(comm).auto_last
        if hit is not None and hit.decided and last[7] is hit and last[5][0] != hit.decided[0]:
            stale.append((call, last[5][0], hit.decided[0]))
        races = comm.allreduce(turns[0], op=MPI.MIN) if call % 100 == 0 else races
        if races >= 3:
            break
    if stale or races < 3:
        bad.append(f"after {races} races, calls ran a stale plan: {stale[:3]}")
    monkeypatch.setattr(api._Trial, "_decide", decide)
    monkeypatch.setattr(api._Trial, "RETRIAL_S", 0.0)
    y = np.full(50, rank + 1, np.float32)
    for call in range(20000):  # the race
        coll.allgather(y, comm=comm)
        if api.auto_pick("allgather", y.nbytes, comm) is not None:
            break
    picked = 0
    for call in range(3000):
        coll.allgather(y, comm=comm)
        picked += api.auto_pick("allgather", y.nbytes, comm) is not None
    if picked < 3000:
        bad.append(f"COLLECTIVES_AUTO_RETRIAL=0: decided at {picked} calls of 3000 after")
    assert_all(not bad, str(bad[:4]))


def race_on_a_test_clock(monkeypatch, tmp_path, name: str, seconds) -> None:
    """allgather's rule races ring and recursive doubling, once (no races again but the
    probes'), on the test's clock: every call of algorithm ``a`` takes ``seconds(a)``."""
    from collectives import api
    use_tuning(monkeypatch, tmp_path, name,
               {"allgather": [[None, "ring", "recursive_doubling"]]})
    monkeypatch.setattr(api._Trial, "RETRIAL_S", 1e6)
    clock, real = [0.0], api._run_schedule

    def run(call, algorithm, builder):
        clock[0] += seconds(algorithm)
        return real(call, algorithm, builder)
    monkeypatch.setattr(api, "_run_schedule", run)
    monkeypatch.setattr(api, "perf_counter", lambda: clock[0])


@pytest.mark.parametrize("when", ["later", "at once", "stale", "crowded", "everyone",
                                  "still the fastest"])
def test_auto_races_again_when_its_pick_slows_down(monkeypatch, tmp_path, when):
    """After a race, probes time a block of the pick's calls every so often; when they find it
    slower than its reference (its race time, or the first probe's if lower) by more than TRIP,
    TRIP_PROBES times in a row, a duel times the race's runner-up against the pick, and where
    the runner-up now runs faster against it than in the race, by more than DUEL, a race
    starts at the next call, on every rank at the same call, and picks the runner-up; a pick
    that holds its pace never races again (regular races off here). The clock is the test's:
    every call of an algorithm takes ``dt[name]``, in the race and after it; the pick (ring:
    the two tie, and the rule's first stays) slows down 20000 calls in, or right after the
    race (before any probe). "stale": the race ran in a slow phase of the machine (every call
    3x), which ends before the first probe, and the pick slows down later to 2x, still faster
    than the others' race times: the duel still finds the runner-up faster now, and the race
    follows. Where a node runs more ranks than it has cores ("crowded"), the first probe is
    the last, and nothing races again. Where every algorithm slows down alike ("everyone": the
    machine), the duel finds the runner-up as slow: no race, and the pick's reference becomes
    its new pace. "still the fastest": the runner-up ran 3x the pick's time in the race, and
    the pick slows down past TRIP but stays faster than it: no race (it would keep the pick),
    the pick's reference becomes its new pace."""
    from collectives import api
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("one rank has nothing to choose")
    dt = {"ring": 1e-5, "recursive_doubling": 1e-5}
    if when == "still the fastest":
        dt["recursive_doubling"] = 3e-5
    if when == "stale":
        dt = {name: 3 * t for name, t in dt.items()}
    race_on_a_test_clock(monkeypatch, tmp_path, "probe", lambda name: dt[name])
    monkeypatch.setattr(api._Trial, "PROBE_S", 1e-9)  # a probe every 2 blocks' calls
    crowded = float(when == "crowded" and rank == size - 1)  # one crowded node is enough
    monkeypatch.setattr(api._Trial, "_crowded", lambda self: crowded)
    monkeypatch.setattr(api._Trial, "CROWDED_MIN", 0)  # small calls race there too
    x = np.full(10, rank + 1, np.float32)
    want = np.repeat(np.arange(1, size + 1, dtype=np.float32), 10)
    bad, races, deciding, slow = [], [], True, None
    for call in range(40000):
        if when == "stale" and not deciding and call < 20000:
            dt.update(ring=1e-5, recursive_doubling=1e-5)  # the slow phase ended
        if when == "stale" and call == 20000:
            dt["ring"] *= 2  # the pick slows down, still faster than the race timed the other
            slow = call
        if slow is None and (call == 20000 or when == "at once" and not deciding):
            dt["ring"] *= api._Trial.TRIP * 1.5  # the pick slows down for good
            if when == "everyone":
                dt["recursive_doubling"] *= api._Trial.TRIP * 1.5  # and so does the other
            slow = call
        if not np.array_equal(coll.allgather(x, comm=comm), want):
            bad.append(f"call {call}: wrong result")
        undecided = api.auto_pick("allgather", x.nbytes, comm) is None
        if undecided and not deciding:
            races.append(call)
        deciding = undecided
    hit = api._context(comm).auto["allgather"][x.nbytes]
    pick = api.auto_pick("allgather", x.nbytes, comm)
    # one race (the first, at call 0, is not counted), soon after the slow-down: TRIP_PROBES
    # probes find it slower, and the duel's blocks find the runner-up faster
    if when == "crowded":
        if races or hit.probe < 10 ** 11:
            bad.append(f"crowded: races at calls {races}, next probe in {hit.probe} calls")
    elif when in ("everyone", "still the fastest"):
        if races or hit._over or hit.probe > 10 ** 11 or pick != "ring":
            bad.append(f"{when}: races at calls {races}, {hit._over} probes over, next "
                       f"probe in {hit.probe} calls, running {pick}")
        if hit._ref < api._Trial.TRIP * 1e-5:
            bad.append(f"{when}: the pick's reference stayed at {hit._ref}")
    else:
        duel = 2 * api._Trial.DUEL_BLOCKS * hit._probe_len
        soon = slow + (api._Trial.TRIP_PROBES + 1) * (hit._probe_every + hit._probe_len) + duel
        if len(races) != 1 or not slow <= races[0] <= soon:
            bad.append(f"races at calls {races}, expected one in {slow}-{soon}")
        if pick != "recursive_doubling" or hit._need != api._Trial.TRIP_PROBES:
            bad.append(f"after a race that changed the pick: {pick}, {hit._need} probes needed")
    seen = comm.allgather(races)
    if any(r != races for r in seen):
        bad.append(f"ranks raced at different calls: {seen}")
    assert_all(not bad, str(bad[:4]))


@pytest.mark.parametrize("crowded", [False, True])
def test_auto_keeps_the_rule_on_a_crowded_node_for_small_calls(monkeypatch, tmp_path, crowded):
    """Where a node runs more ranks than it has cores, calls under CROWDED_MIN bytes run the
    rule's first once the race's first round has shown it, and never race again; elsewhere the
    race picks the faster. The clock is the test's: ring's calls take twice as long as
    recursive doubling's."""
    from collectives import api
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("one rank has nothing to choose")
    race_on_a_test_clock(monkeypatch, tmp_path, "crowded",
                         lambda name: 2e-5 if name == "ring" else 1e-5)
    flag = float(crowded and rank == 0)  # one crowded node is enough
    monkeypatch.setattr(api._Trial, "_crowded", lambda self: flag)
    x = np.full(10, rank + 1, np.float32)
    want = np.repeat(np.arange(1, size + 1, dtype=np.float32), 10)
    bad, picks, first = [], set(), None
    for call in range(6000):
        if not np.array_equal(coll.allgather(x, comm=comm), want):
            bad.append(f"call {call}: wrong result")
        pick = api.auto_pick("allgather", x.nbytes, comm)
        if pick is not None:
            first = call if first is None else first
            picks.add(pick)
    if crowded:
        # the first round: two calls of each algorithm
        if first != 3 or picks != {"ring"} or api.auto_trial("allgather", x.nbytes, comm):
            bad.append(f"crowded: decided at call {first}, picks {picks}")
    elif first is None or first <= 3 or picks != {"recursive_doubling"}:
        bad.append(f"not crowded: decided at call {first}, picks {picks}")
    seen = comm.allgather((first, sorted(picks)))
    if any(s != seen[0] for s in seen):
        bad.append(f"ranks decided differently: {seen}")
    assert_all(not bad, str(bad[:4]))


def test_a_mismatched_call_in_a_trial_raises_on_every_rank(monkeypatch, tmp_path):
    """A call whose lengths differ across ranks, made at a trial's timed step with the check on:
    every rank raises MismatchError (the trial's barrier waits until after the check; before it
    did not, and one rank sat in the barrier while the other checked, until the watchdog)."""
    from collectives import api
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    use_tuning(monkeypatch, tmp_path, "mismatch",
               {"broadcast": [[100, "native"], [None, "binomial", "native"]]})
    x = np.ones(1000, np.float32)
    for _ in range(3):  # binomial's call, timed; native's first: the next is timed, a barrier
        coll.broadcast(x, comm=comm)
    assert api.auto_pick("broadcast", x.nbytes, comm) is None
    y = np.ones(1000 if rank == 0 else 10, np.float32)
    try:
        coll.broadcast(y, comm=comm, check=True)
        got = "no error"
    except coll.MismatchError as e:
        got = "mismatch" if "1000" in str(e) and "10 elements" in str(e) else str(e)
    assert_all(got == "mismatch", f"rank {rank}: {got}")


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
