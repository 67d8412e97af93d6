"""Registered buffers under mpiexec (n = 1..5): ``coll.empty`` and ``coll.is_registered``, the
one-pass allreduce in place and out of place for dtypes, ops and lengths 0, 1 and primes through
tiny chunks, and the calls that must take the ordinary path with the same results (mixed
registration, another communicator's buffer, a released one)."""
import gc

import numpy as np
import pytest

import collectives as coll
from collectives import onepass
from tests.mpiutil import assert_all, op_inputs

LENGTHS = (0, 1, 2, 13, 97, 1009)


@pytest.fixture(autouse=True)
def _deep_paths(monkeypatch):
    """Every length takes the one-pass path, walked in chunks of 24 bytes."""
    monkeypatch.setattr(onepass, "THRESHOLD", 0)
    monkeypatch.setattr(onepass, "CHUNK", 24)


def _reference(size, n, dtype, op):
    ins = op_inputs(size, n, dtype, op)
    fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    ref = ins[0].copy()
    for a in ins[1:]:
        ref = fn(ref, a).astype(dtype)
    return ins, ref


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["int32", "int64", "float32", "float64", "uint8"])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
@pytest.mark.parametrize("inplace", [True, False])
def test_allreduce_registered(dtype, op, inplace):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ok = True
    for n in LENGTHS:
        ins, ref = _reference(size, n, dtype, op)
        x = coll.empty(n, dtype)
        x[...] = ins[rank]
        out = x if inplace else coll.empty(n, dtype)
        got = coll.allreduce(x, op, out=out)
        ok &= got is out and bool(np.array_equal(out, ref))
        if not inplace:
            ok &= bool(np.array_equal(x, ins[rank]))
    assert_all(ok and coll.is_registered(x), f"{dtype} {op} inplace={inplace}")


@pytest.mark.mpi
def test_mixed_and_foreign_take_the_ordinary_path():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = 101
    ins, ref = _reference(size, n, "int64", "sum")
    # mixed: registered on even ranks only
    reg = coll.empty(n, "int64")  # collective: every rank allocates
    x = reg if rank % 2 == 0 else np.empty(n, np.int64)
    x[...] = ins[rank]
    coll.allreduce(x, out=x)
    ok = bool(np.array_equal(x, ref)) and coll.is_registered(x) == (rank % 2 == 0)
    # another communicator's registered buffer
    dup = comm.Dup()
    y = coll.empty(n, "int64", comm=dup)
    y[...] = ins[rank]
    coll.allreduce(y, out=y, comm=comm)
    ok &= bool(np.array_equal(y, ref))
    # an ordinary array is not registered, a view into a registered one is
    ok &= not coll.is_registered(np.zeros(4)) and coll.is_registered(y[3:7])
    del y
    gc.collect()
    coll.empty(1, "int8", comm=dup)  # frees the released window collectively
    dup.Free()
    assert_all(ok, "mixed or foreign registration")


@pytest.mark.mpi
def test_released_buffer_is_unregistered():
    x = coll.empty(64, "float64")
    view = x[:8]
    addr = view.ctypes.data
    del x
    gc.collect()
    # the view keeps the base alive: still registered
    ok = coll.is_registered(view) and view.ctypes.data == addr
    assert_all(ok, "a live view of a registered array")


@pytest.mark.mpi
def test_torch_tensor_on_registered_memory():
    torch = pytest.importorskip("torch")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ins, ref = _reference(size, 37, "float32", "sum")
    t = torch.from_numpy(coll.empty(37, "float32"))
    t.copy_(torch.from_numpy(ins[rank]))
    coll.allreduce(t, out=t)
    assert_all(coll.is_registered(t) and bool(np.array_equal(t.numpy(), ref)), "torch")


def test_empty_rejects_negative_shape():
    with pytest.raises(ValueError, match="negative"):
        coll.empty((2, -1), "float32")
