"""Fuzzing: random (n, counts, dtype, op, algorithm, segment size) against exact references.

In-process (hypothesis): every schedule algorithm registered for each collective, run by the
simulator for n = 2..9 virtual ranks, compared element for element with a reference computed
in float64 (exact: the data are small integers) or, for integer dtypes, in the dtype itself
(wrap-around arithmetic is exact and order-free). MPI tier: ``FUZZ_CALLS`` random calls of the
public API at n = 3 (any n works), drawn from an RNG seeded identically on every rank, over every
algorithm that ``collectives.algorithms`` lists (``shm`` only when the communicator is one
node), blocking and not, in place and not::

    mpiexec -n 3 python -m pytest --with-mpi -m mpi tests/test_fuzz.py
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives as coll
from collectives import select
from collectives.buffers import bfloat16
from collectives.ops import dtype_kind
from collectives.sim import simulate

from mpiutil import assert_all, world

DTYPES = [np.dtype(t) for t in (np.bool_, np.int8, np.uint8, np.int32, np.uint64, np.int64,
                                np.float16, np.float32, np.float64, np.complex64)]
if bfloat16 is not None:
    DTYPES.append(np.dtype(bfloat16))
OPS = {"b": ("sum", "prod", "min", "max", "band", "bor", "bxor"),
       "i": ("sum", "prod", "min", "max", "band", "bor", "bxor"),
       "f": ("sum", "prod", "min", "max"),
       "c": ("sum", "prod")}
SEGMENTS = (1, 2, 3, 5, 8, 64, 1 << 20)
_NP = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
       "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
_BOOL = {"sum": np.logical_or, "prod": np.logical_and, "min": np.logical_and,
         "max": np.logical_or, "band": np.logical_and, "bor": np.logical_or,
         "bxor": np.logical_xor}


def _kind(dtype) -> str:
    kind = dtype_kind(dtype)
    return "i" if kind == "u" else kind


def schedule_algorithms(collective: str) -> list[str]:
    """The algorithms that are schedules needing nothing of the communicator (the simulator
    runs those; the hierarchical ones, which take its topology, have their own tests)."""
    names = []
    for name in coll.algorithms(collective):
        algo = select.get(collective, name)
        if algo.kind == select.SCHEDULE and algo.needs != select.TOPOLOGY:
            names.append(name)
    return names


def make_input(rng, dtype, op, count) -> np.ndarray:
    """Data whose reduction is exact in ``dtype`` (and in float64)."""
    kind = _kind(dtype)
    if kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if kind == "i":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    if op == "prod":  # products of +-1 and 2: powers of two, exact in every float type
        vals = rng.choice(np.array([-1.0, 1.0, 2.0]), count)
    else:
        vals = rng.integers(-4, 5, count).astype(np.float64)
    if kind == "c":
        imag = rng.integers(-4, 5, count) if op != "prod" else np.zeros(count)
        return (vals + 1j * imag).astype(dtype)
    return vals.astype(dtype)


def reference(inputs, dtype, op) -> np.ndarray:
    """The reduction of ``inputs`` over ranks, exactly."""
    kind = _kind(dtype)
    if kind == "b":
        return functools.reduce(_BOOL[op], inputs)
    if kind == "i":
        with np.errstate(over="ignore"):
            return functools.reduce(_NP[op], inputs)
    wide = np.complex128 if kind == "c" else np.float64
    return functools.reduce(_NP[op], [x.astype(wide) for x in inputs]).astype(dtype)


def same(a, b) -> bool:
    """Equal values and shapes (-0.0 equals 0.0: the sign of a complex product's zero part
    depends on the order of the factors)."""
    return a.shape == b.shape and bool(np.array_equal(a, b))


def identical(arrays) -> bool:
    """Bitwise identical: every rank gets the very same bytes."""
    return len({np.ascontiguousarray(a).tobytes() for a in arrays}) <= 1


@st.composite
def cases(draw, collective):
    names = schedule_algorithms(collective)
    if not names:
        return None
    name = draw(st.sampled_from(names))
    n = draw(st.integers(2, 9))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(OPS[_kind(dtype)]))
    seg = draw(st.sampled_from(SEGMENTS))
    if collective in ("reduce_scatter", "allgather"):
        counts = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)
                      .filter(lambda c: sum(c) > 0))
    else:
        counts = draw(st.integers(1, 60))
    root = draw(st.integers(0, n - 1))
    inplace = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return name, n, dtype, op, seg, counts, root, inplace, seed


FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 120)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow], derandomize=True)


# The reducing and all-gather family; all-to-all, gather and scatter are fuzzed over random
# count matrices and every root in tests/test_alltoall.py.
FUZZED = ("allreduce", "reduce", "broadcast", "reduce_scatter", "allgather")


@pytest.mark.parametrize("collective", FUZZED)
@FUZZ
@given(data=st.data())
def test_fuzz_schedules(collective, data):
    case = data.draw(cases(collective))
    if case is None:
        pytest.skip(f"no schedule algorithm for {collective}")
    name, n, dtype, op, seg, counts, root, inplace, seed = case
    builder = select.get(collective, name).build[collective]
    rng = np.random.default_rng(seed)
    where = f"{collective}/{name} n={n} {dtype.name} {op} seg={seg} counts={counts} " \
            f"root={root} inplace={inplace}"
    if collective == "allreduce":
        ins = [make_input(rng, dtype, op, counts) for _ in range(n)]
        keep = [x.copy() for x in ins]
        want = reference(keep, dtype, op)
        outs, _ = simulate(builder, ins, op, count=counts, seg=seg, inplace=inplace)
        assert all(same(o, want) for o in outs), where
        assert identical(outs), f"{where}: ranks differ bitwise"
        if not inplace:
            assert all(same(x, k) for x, k in zip(ins, keep)), f"{where}: input modified"
    elif collective == "reduce":
        ins = [make_input(rng, dtype, op, counts) for _ in range(n)]
        keep = [x.copy() for x in ins]
        outs, _ = simulate(builder, ins, op, count=counts, root=root, seg=seg)
        assert same(outs[root], reference(keep, dtype, op)), where
        assert all(same(x, k) for x, k in zip(ins, keep)), f"{where}: input modified"
    elif collective == "broadcast":
        ins = [make_input(rng, dtype, "sum", counts) for _ in range(n)]
        want = ins[root].copy()
        outs, _ = simulate(builder, ins, op, count=counts, root=root, seg=seg, inplace=True)
        assert all(same(o, want) for o in outs), where
    elif collective == "reduce_scatter":
        total = sum(counts)
        ins = [make_input(rng, dtype, op, total) for _ in range(n)]
        keep = [x.copy() for x in ins]
        want = reference(keep, dtype, op)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        outs, _ = simulate(builder, ins, op, counts=tuple(counts), seg=seg)
        for r in range(n):
            assert same(outs[r], want[bounds[r]:bounds[r + 1]]), f"{where}: rank {r}"
        assert all(same(x, k) for x, k in zip(ins, keep)), f"{where}: input modified"
    else:
        ins = [make_input(rng, dtype, "sum", c) for c in counts]
        want = np.concatenate(ins)
        outs, _ = simulate(builder, ins, op, counts=tuple(counts), seg=seg)
        assert all(same(o, want) for o in outs), where


# -- MPI tier: the public API, every algorithm, random calls --------------------------------------
FUZZ_CALLS = int(os.environ.get("FUZZ_CALLS", 60))
FUZZ_SEED = int(os.environ.get("FUZZ_SEED", 2024))
ONE_NODE = {"shm"}   # algorithms that refuse a communicator spanning nodes (real or simulated)


def _rank_input(seed, rank, dtype, op, count):
    return make_input(np.random.default_rng([seed, rank]), dtype, op, count)


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_fuzz_mpi():
    from collectives import config
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(FUZZ_SEED)   # the same draws on every rank
    seen = set()
    from collectives.topology import topology
    skip = set() if topology(comm).single_node else ONE_NODE
    old = config.set("COLLECTIVES_SEGMENT_BYTES", 1 << 22)
    try:
        for i in range(FUZZ_CALLS):
            collective = str(rng.choice(FUZZED))
            # registered-only algorithms (one-pass) are fuzzed on registered buffers in
            # tests/test_registered.py
            name = str(rng.choice([a for a in ("auto",) + coll.algorithms(collective)
                                   if a not in skip and
                                   (a == "auto" or not select.get(collective, a).registered)]))
            dtype = DTYPES[rng.integers(len(DTYPES))]
            op = str(rng.choice(OPS[_kind(dtype)]))
            if rng.random() < 0.3 and _kind(dtype) in "fc":
                op = "avg" if op == "sum" else op
            seg = int(rng.choice((1, 3, 8, 64, 4096, 1 << 22)))
            count = int(rng.choice((0, 1, size - 1, size + 1, 7, 97, 1000)))
            counts = [int(c) for c in rng.integers(0, 6, size)]
            root = int(rng.integers(size))
            inplace = bool(rng.random() < 0.3)
            blocking = bool(rng.random() < 0.6)
            seed = int(rng.integers(2**31))
            where = f"call {i}: {collective}/{name} n={size} {dtype.name} {op} seg={seg} " \
                    f"count={count} counts={counts} root={root} inplace={inplace} " \
                    f"blocking={blocking}"
            seen.add((collective, name))
            config.set("COLLECTIVES_SEGMENT_BYTES", seg * dtype.itemsize)
            ok = _one_call(collective, name, dtype, "sum" if op == "avg" else op, op, count,
                           counts, root, inplace, blocking, seed, rank, size)
            assert_all(ok is True, f"{where}: {ok}")
    finally:
        config.set("COLLECTIVES_SEGMENT_BYTES", old)
    # Every algorithm of every collective ran at least once over the seeds we use in CI.
    assert_all(len(seen) > 10, f"only {len(seen)} (collective, algorithm) pairs drawn")


def _one_call(collective, name, dtype, ref_op, op, count, counts, root, inplace, blocking,
              seed, rank, size):
    """One random call; True or a description of what went wrong on this rank."""
    prefix = "" if blocking else "i"
    fn = getattr(coll, prefix + collective)

    def finish(result):
        return result if blocking else result.wait()

    if collective == "allgather":
        x = _rank_input(seed, rank, dtype, "sum", counts[rank])
        got = finish(fn(x, algorithm=name))
        want = np.concatenate([_rank_input(seed, r, dtype, "sum", counts[r])
                               for r in range(size)])
        return True if same(got, want) else f"got {got[:8]}, want {want[:8]}"
    if collective == "broadcast":
        x = _rank_input(seed, rank, dtype, "sum", count)
        want = _rank_input(seed, root, dtype, "sum", count)
        got = finish(fn(x, root=root, algorithm=name))
        return True if same(got, want) and got is x else f"got {got[:8]}, want {want[:8]}"
    total = sum(counts) if collective == "reduce_scatter" else count
    ins = [_rank_input(seed, r, dtype, ref_op, total) for r in range(size)]
    want = reference(ins, dtype, ref_op)
    if op != "avg":
        match = same
    else:
        # every input divided by the rank count, then summed (ops.mean_first): each quotient
        # and each of the n - 1 partial sums rounded once, so within n * eps * max|x| of the
        # exact mean (a bound on the arithmetic, not on one machine's rounding)
        wide = np.complex128 if _kind(dtype) == "c" else np.float64
        exact = sum(x.astype(wide) for x in ins) / size
        bound = float(np.finfo(dtype).eps) * size * max(
            [float(np.abs(x.astype(wide)).max(initial=0)) for x in ins])

        def match(got, want):
            return got.shape == want.shape and bool(
                (np.abs(got.astype(wide) - want) <= bound).all())
        want = exact
    x = ins[rank].copy()
    keep = x.copy()
    if collective == "allreduce":
        got = finish(fn(x, op, out=x if inplace else None, algorithm=name))
    elif collective == "reduce":
        got = finish(fn(x, op, root=root, out=x if inplace else None, algorithm=name))
        if rank != root:
            return True if got is None and same(x, keep) else f"got {got}, x {x[:8]}"
    else:
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        got = finish(fn(x, op, counts=counts, algorithm=name))
        want = want[bounds[rank]:bounds[rank + 1]]
    if not inplace and not same(x, keep):
        return "the input was modified"
    return True if match(got, want) else f"got {got[:8]}, want {want[:8]}"
