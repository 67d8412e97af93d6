"""Argument checks: every bad call raises a clear ValueError/TypeError before a byte moves, the
buffers stay untouched, and (MPI tier) every rank raises, with checking on or off.

In-process: ``python -m pytest tests/test_validation.py -m "not mpi"`` (one rank: the checks run
before the one-rank shortcut). MPI: ``mpiexec -n 3 python -m pytest --with-mpi -m mpi
tests/test_validation.py``.
"""
import zlib

import numpy as np
import pytest

import collectives as coll
from collectives import check as _check
from collectives import config
from collectives.errors import MismatchError

from mpiutil import assert_all, world

torch = pytest.importorskip("torch")


def _x(n=12, dtype=np.float32):
    return np.arange(n, dtype=dtype) + 1


def _readonly(a):
    a.flags.writeable = False
    return a


# Each case: (name, function(x, out) -> call, exception type, fragment of the message).
# ``x`` is a fresh float32 array of 12 elements, ``out`` a float32 array of 12 filled with -7.
CASES = [
    ("unknown op", lambda x, o: coll.allreduce(x, "median", out=o), ValueError,
     "unknown reduction op 'median'"),
    ("op object", lambda x, o: coll.allreduce(x, object(), out=o), ValueError,
     "unsupported reduction op"),
    ("unknown algorithm", lambda x, o: coll.allreduce(x, out=o, algorithm="nope"), ValueError,
     "unknown algorithm 'nope' for allreduce"),
    ("algorithm None", lambda x, o: coll.allreduce(x, out=o, algorithm=None), ValueError,
     "unknown algorithm None"),
    ("bxor on floats", lambda x, o: coll.allreduce(x, "bxor", out=o), TypeError,
     "op 'bxor' is not defined for dtype float32"),
    ("avg on ints", lambda x, o: coll.allreduce(x.astype(np.int32), "avg"), TypeError,
     "op 'avg' is not defined for dtype int32"),
    ("min on complex", lambda x, o: coll.allreduce(x.astype(np.complex64), "min"), TypeError,
     "op 'min' is not defined for dtype complex64"),
    ("root too large", lambda x, o: coll.reduce(x, root=1, out=o), ValueError,
     "root 1 out of range for a communicator of 1 ranks"),
    ("root negative", lambda x, o: coll.reduce(x, root=-1, out=o), ValueError,
     "root -1 out of range"),
    ("root bool", lambda x, o: coll.reduce(x, root=True, out=o), ValueError,
     "root True out of range"),
    ("root float", lambda x, o: coll.broadcast(x, root=0.0), ValueError, "root 0.0 out of range"),
    ("broadcast root", lambda x, o: coll.broadcast(x, root=5), ValueError, "root 5 out of range"),
    ("counts length", lambda x, o: coll.reduce_scatter(x, counts=[6, 6]), ValueError,
     "counts must be 1 non-negative integers (one per rank), got [6, 6]"),
    ("counts sum", lambda x, o: coll.reduce_scatter(x, counts=[11]), ValueError,
     "counts add up to 11, but x has 12 elements"),
    ("counts negative", lambda x, o: coll.reduce_scatter(x, counts=[-12]), ValueError,
     "non-negative integers"),
    ("counts fractional", lambda x, o: coll.reduce_scatter(x, counts=[12.5]), ValueError,
     "non-negative integers"),
    ("counts not a list", lambda x, o: coll.reduce_scatter(x, counts="12"), ValueError,
     "non-negative integers"),
    ("out shape", lambda x, o: coll.allreduce(x, out=o[:11]), ValueError,
     "out has shape [11], expected [12]"),
    ("out reshaped", lambda x, o: coll.allreduce(x, out=o.reshape(3, 4)), ValueError,
     "out has shape [3, 4], expected [12]"),
    ("out dtype", lambda x, o: coll.allreduce(x, out=o.astype(np.float64)), TypeError,
     "out is numpy float64[12] on cpu, expected a numpy float32 buffer on cpu"),
    ("out kind", lambda x, o: coll.allreduce(x, out=torch.from_numpy(o.copy())), TypeError,
     "out is torch float32[12] on cpu, expected a numpy float32 buffer"),
    ("out device", lambda x, o: coll.allreduce(torch.from_numpy(x),
                                               out=torch.empty(12, device="meta")), TypeError,
     "meta"),
    ("out read-only", lambda x, o: coll.allreduce(x, out=_readonly(o)), ValueError,
     "out is read-only"),
    ("in place read-only", lambda x, o: coll.allreduce(_readonly(x), out=x), ValueError,
     "out is read-only"),
    ("reduce in place read-only", lambda x, o: coll.reduce(_readonly(x), out=x), ValueError,
     "out is read-only"),
    ("out overlaps x", lambda x, o: coll.allreduce(x[:8], out=x[4:]), ValueError,
     "out partly overlaps x"),
    ("reduce out shape", lambda x, o: coll.reduce(x, out=o[:5]), ValueError,
     "out has shape [5], expected [12]"),
    ("reduce_scatter out", lambda x, o: coll.reduce_scatter(x, out=o[:5]), ValueError,
     "out has shape [5], expected [12]"),
    ("reduce_scatter in place", lambda x, o: coll.reduce_scatter(x, out=x), ValueError,
     "reduce_scatter cannot run in place"),
    ("allgather out", lambda x, o: coll.allgather(x, out=o[:6]), ValueError,
     "out has shape [6], expected [12]"),
    ("allgather in place", lambda x, o: coll.allgather(x, out=x), ValueError,
     "allgather cannot run in place"),
    ("broadcast read-only", lambda x, o: coll.broadcast(_readonly(x)), ValueError,
     "x is read-only: broadcast fills it in place"),
    ("x strided", lambda x, o: coll.allreduce(x[::2]), ValueError,
     "numpy array of shape (6,) is not C-contiguous"),
    ("x Fortran", lambda x, o: coll.allreduce(np.asfortranarray(x.reshape(3, 4))), ValueError,
     "is not C-contiguous"),
    ("out strided", lambda x, o: coll.allreduce(x[:6], out=o[::2]), ValueError,
     "is not C-contiguous"),
    ("tensor transposed", lambda x, o: coll.allreduce(torch.from_numpy(x).view(3, 4).t()),
     ValueError, "torch tensor of shape (4, 3) is not C-contiguous"),
    ("x a list", lambda x, o: coll.allreduce([1.0, 2.0]), TypeError,
     "x: expected a numpy array, torch tensor or cupy array, got list"),
    ("x object dtype", lambda x, o: coll.allreduce(np.array([1, None])), TypeError,
     "unsupported dtype object"),
    ("x float128", lambda x, o: coll.allreduce(x.astype(np.longdouble)), TypeError,
     "unsupported dtype"),
    ("comm not a comm", lambda x, o: coll.allreduce(x, out=o, comm="world"), TypeError,
     "comm must be an mpi4py.MPI.Comm, got str"),
    ("allgather x", lambda x, o: coll.allgather("abc"), TypeError, "got str"),
]


@pytest.mark.parametrize("check", [False, True], ids=["check-off", "check-on"])
@pytest.mark.parametrize("name,call,exc,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_call_raises_and_leaves_buffers_intact(name, call, exc, fragment, check, setting):
    setting("COLLECTIVES_CHECK", "1" if check else "0")
    x = _x()
    out = np.full(12, -7, np.float32)
    with pytest.raises(exc) as info:
        call(x, out)
    assert fragment in str(info.value)
    assert not isinstance(info.value, MismatchError)  # one rank: no one to disagree with
    assert np.array_equal(x, _x()), "x was modified"
    assert (out == -7).all(), "out was written"


def test_error_types_are_importable_from_the_package():
    assert issubclass(coll.MismatchError, ValueError)
    assert issubclass(coll.MismatchError, coll.CollectiveError)
    assert issubclass(coll.MessageSizeError, coll.CollectiveError)
    assert issubclass(coll.CollectiveTimeout, RuntimeError)


def test_valid_calls_after_errors_still_work():
    x = _x()
    with pytest.raises(ValueError):
        coll.allreduce(x, "median")
    assert np.array_equal(coll.allreduce(x), x)
    out = np.empty_like(x)
    assert coll.allreduce(x, out=out) is out and np.array_equal(out, x)


def test_reduce_ignores_a_valid_out_off_the_root_but_checks_it():
    # One rank is the root here: out is written. A bad out is refused (see CASES).
    x, out = _x(), np.zeros(12, np.float32)
    assert coll.reduce(x, out=out) is out and np.array_equal(out, x)


@pytest.mark.parametrize("env,expected", [("0", False), ("", False), ("no", False),
                                          ("off", False), ("OFF", False), (" False ", False),
                                          ("1", True), ("yes", True), ("on", True)])
def test_check_enabled(env, expected, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_CHECK", env)
    config.reload()  # settings are read once: read the environment again
    try:
        assert _check.enabled() is expected
        assert _check.enabled(True) is True and _check.enabled(False) is False
    finally:
        monkeypatch.undo()
        config.reload()


def test_fingerprint_codes_are_rank_independent():
    # crc32, not hash(): the same text gives the same code in every process.
    assert _check._code("dtype", "float32") == zlib.crc32(b"float32")
    assert _check._code("counts", (1, 2, 3)) == _check._code("counts", [1, 2, 3])
    assert _check._code("counts", (1, 2, 3)) != _check._code("counts", (3, 2, 1))
    assert _check._code("root", None) == -1


# -- MPI tier ----------------------------------------------------------------------------------
def _all_raise(fn, exc_type, comm=None):
    """Run ``fn`` on every rank; every rank must raise ``exc_type``; return the messages."""
    comm = comm or world()
    try:
        fn()
    except exc_type as exc:
        msg = str(exc)
    else:
        msg = None
    got = comm.allgather(msg)
    assert_all(msg is not None, f"not every rank raised {exc_type.__name__}: {got}")
    return got


@pytest.mark.mpi
@pytest.mark.parametrize("check", [None, True], ids=["check-off", "check-on"])
@pytest.mark.parametrize("name,call,exc,fragment",
                         [c for c in CASES if c[0] not in ("root too large",)],
                         ids=[c[0] for c in CASES if c[0] not in ("root too large",)])
def test_symmetric_bad_call_raises_on_every_rank(name, call, exc, fragment, check, setting):
    # The same mistake on every rank: the same local verdict everywhere, before any message.
    setting("COLLECTIVES_CHECK", "1" if check else "0")
    comm = world()
    size = comm.Get_size()
    x = _x(12 * size if name.startswith("counts") else 12)
    out = np.full(12, -7, np.float32)
    try:
        call(x, out)
    except exc as e:
        ok = not isinstance(e, MismatchError)
    except Exception as e:  # noqa: BLE001
        ok = f"{type(e).__name__}: {e}"
    else:
        ok = "no error"
    assert_all(ok is True, f"{name}: {ok}")
    assert_all(np.array_equal(x, _x(x.size)) and (out == -7).all(), f"{name}: buffers written")
    # The communicator is still usable and in step.
    y = coll.allreduce(np.ones(3, np.int64))
    assert_all(int(y[0]) == size, "a collective after the error failed")


@pytest.mark.mpi
def test_root_out_of_range_on_every_rank():
    size = world().Get_size()
    msgs = _all_raise(lambda: coll.reduce(_x(), root=size), ValueError)
    assert_all(all(f"root {size} out of range for a communicator of {size} ranks" in m
                   for m in msgs), str(msgs))


def _mismatch_case(kind, rank):
    odd = rank == 1
    x = _x(12, np.float32)
    out = np.full(12, -7, np.float32)
    if kind == "elements":
        x, out = _x(13 if odd else 12), np.full(13 if odd else 12, -7, np.float32)
        return x, out, lambda: coll.allreduce(x, out=out, check=True)
    if kind == "dtype":
        x, out = x.astype(np.int32 if odd else np.float32), out.astype(
            np.int32 if odd else np.float32)
        return x, out, lambda: coll.allreduce(x, out=out, check=True)
    if kind == "op":
        return x, out, lambda: coll.allreduce(x, "min" if odd else "max", out=out, check=True)
    if kind == "root":
        return x, out, lambda: coll.reduce(x, root=1 if odd else 0, out=out, check=True)
    if kind == "algorithm":
        return x, out, lambda: coll.allreduce(x, out=out, check=True,
                                              algorithm="native" if odd else "ring")
    if kind == "collective":
        return x, out, (lambda: coll.broadcast(out, check=True)) if odd else \
            (lambda: coll.allreduce(x, out=out, check=True))
    if kind == "zero-length":  # rank 1 has nothing: it would return at once without the check
        x, out = _x(0 if odd else 12), np.full(0 if odd else 12, -7, np.float32)
        return x, out, lambda: coll.allreduce(x, out=out, check=True)
    if kind == "counts":
        counts = [12] + [0] * (world().Get_size() - 1)
        if odd:
            counts = counts[::-1]
        out = np.full(counts[rank], -7, np.float32)
        return x, out, lambda: coll.reduce_scatter(x, counts=counts, out=out, check=True)
    if kind == "local-error":  # rank 1's own out is wrong: the others must not wait for it
        out = np.full(11 if odd else 12, -7, np.float32)
        return x, out, lambda: coll.allreduce(x, out=out, check=True)
    if kind == "local-error-prep":  # rank 1 passes an unknown algorithm
        return x, out, lambda: coll.allreduce(x, out=out, check=True,
                                              algorithm="bogus" if odd else "ring")
    if kind == "allgather-x":  # rank 1's x is refused before allgather's count exchange
        return x, out, lambda: coll.allgather(x[::2] if odd else x, check=False)
    if kind == "allgather-out":
        out = np.full(11 if odd else 12 * world().Get_size(), -7, np.float32)
        return x, out, lambda: coll.allgather(x, out=out, check=True)
    raise AssertionError(kind)


FRAGMENTS = {
    "elements": "rank 1 passed 13 elements, ranks 0 and 2 passed 12 elements",
    "dtype": "rank 1 passed int32, ranks 0 and 2 passed float32",
    "op": "rank 1 passed op min, ranks 0 and 2 passed op max",
    "root": "rank 1 passed root 1, ranks 0 and 2 passed root 0",
    "algorithm": "rank 1 chose algorithm native, ranks 0 and 2 chose algorithm ring",
    "collective": "rank 1 called broadcast, ranks 0 and 2 called allreduce",
    "zero-length": "rank 1 passed 0 elements, ranks 0 and 2 passed 12 elements",
    "counts": "rank 1 passed counts [0, 0, 12], ranks 0 and 2 passed counts [12, 0, 0]",
    "local-error": "rank 1 failed its own argument checks (ValueError: out has shape [11], "
                   "expected [12])",
    "local-error-prep": "rank 1 failed its own argument checks (ValueError: unknown algorithm "
                        "'bogus' for allreduce",
    "allgather-x": "allgather: rank 1 failed its own argument checks (ValueError: numpy array "
                   "of shape (6,) is not C-contiguous",
    "allgather-out": "rank 1 failed its own argument checks (ValueError: out has shape [11], "
                     "expected [36])",
}


@pytest.mark.mpi
@pytest.mark.parametrize("kind", sorted(FRAGMENTS))
def test_mismatch_raises_the_same_error_on_every_rank(kind):
    comm = world()
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    rank, size = comm.Get_rank(), comm.Get_size()
    x, out, fn = _mismatch_case(kind, rank)
    x0 = x.copy()
    msgs = _all_raise(fn, MismatchError)
    assert_all(len(set(msgs)) == 1, f"ranks disagree: {msgs}")
    if size == 3:
        assert_all(FRAGMENTS[kind] in msgs[0], f"{msgs[0]!r} lacks {FRAGMENTS[kind]!r}")
    else:
        assert_all("rank 1" in msgs[0], msgs[0])
    assert_all(np.array_equal(x, x0) and (out == -7).all(), "buffers written")
    y = coll.allreduce(np.ones(3, np.int64), check=True)
    assert_all(int(y[0]) == size, "a collective after the mismatch failed")


@pytest.mark.mpi
def test_ragged_allgather_is_not_a_mismatch():
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.full((rank + 1, 2), rank, np.int32)
    y = coll.allgather(x, check=True)
    want = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)])
    assert_all(np.array_equal(y, want), "ragged allgather with check=True")


@pytest.mark.mpi
def test_every_rank_fails_its_own_check_gives_the_local_error():
    # With checking on, a mistake every rank makes is still the plain local error.
    msgs = _all_raise(lambda: coll.allreduce(_x(), out=np.zeros(3, np.float32), check=True),
                      ValueError)
    assert_all(all("out has shape [3], expected [12]" in m for m in msgs), str(msgs))
