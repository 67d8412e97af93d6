"""Registered buffers under mpiexec (n = 1..5): ``coll.empty``, ``coll.is_registered`` and the
one-pass collectives (``collectives.node.onepass``).

Every collective it implements runs on registered buffers for every dtype and op, lengths 0, 1
and primes, in place and out of place, through tiny chunks, and must give the bits MPI's own
collective gives on ordinary copies of the same data; a counter on the one-pass launch proves
the path was taken. The calls that must take the ordinary path (mixed registration, another
communicator's buffer, a released one, offsets that differ between ranks) give the same
results without it.
"""
import dataclasses
import gc

import numpy as np
import pytest

import collectives as coll
from collectives import select
from collectives.buffers import DTYPES
from collectives.node import onepass, registered
from collectives.ops import NAMES, _ACCEPTS, dtype_kind
from tests import rounding
from tests.mpiutil import assert_all, one_node_only, op_inputs, world

LENGTHS = (0, 1, 2, 13, 97)
_WIDEST = 16  # bytes: complex128


@pytest.fixture(autouse=True)
def launches(monkeypatch):
    """Every length takes the one-pass path, in chunks of 24 bytes; counts its launches."""
    monkeypatch.setattr(onepass, "THRESHOLD", 0)
    monkeypatch.setattr(onepass, "CHUNK", 24)
    seen = []

    def counted(call, plan=None):
        seen.append(call.collective)
        return onepass.launch(call, plan)
    select.register(dataclasses.replace(onepass.ALGORITHM, launch=counted, agree_above=0))
    yield seen
    select.register(onepass.ALGORITHM)


def _pairs():
    for dtype in DTYPES:
        for op in NAMES:
            if dtype_kind(dtype) in _ACCEPTS[op]:
                yield dtype, op


def _view(raw, dtype, n):
    return raw[:n * dtype.itemsize].view(dtype)


def _run(collective, x, out, op, root, inplace, algorithm="auto"):
    """``collective`` on x/out as a user calls it; the array that holds this rank's result."""
    if collective == "allreduce":
        return coll.allreduce(x, op, out=x if inplace else out, algorithm=algorithm)
    if collective == "reduce":
        mine = x if inplace else out
        got = coll.reduce(x, op, root, out=mine if world().Get_rank() == root else None,
                          algorithm=algorithm)
        return got if got is not None else np.zeros(0, x.dtype)
    if collective == "reduce_scatter":
        return coll.reduce_scatter(x, op, out=out, algorithm=algorithm)
    if collective == "allgather":
        return coll.allgather(x, out=out, algorithm=algorithm)
    return coll.broadcast(x, root, algorithm=algorithm)


def _out_count(collective, n, size, rank):
    if collective == "allgather":
        return n * size
    if collective == "reduce_scatter":
        return n // size + (rank < n % size)
    return n


@pytest.mark.mpi
@pytest.mark.parametrize("collective,inplace", [
    ("allreduce", False), ("allreduce", True), ("reduce", False), ("reduce", True),
    ("reduce_scatter", False), ("allgather", False), ("broadcast", True)])
def test_every_collective_on_registered_buffers(collective, inplace, launches):
    one_node_only()
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    top = max(LENGTHS) * _WIDEST
    xraw = coll.empty(top, np.uint8)
    oraw = coll.empty(top * size, np.uint8)
    bad, calls = [], 0
    for dtype, op in _pairs() if collective not in ("allgather", "broadcast") else \
            ((d, "sum") for d in DTYPES):
        for n in LENGTHS:
            root = n % size  # a root other than 0 walks reduce's private fold in place
            data = op_inputs(size, n, dtype, op)[rank]
            x = _view(xraw, dtype, n)
            x[...] = data
            out = _view(oraw, dtype, _out_count(collective, n, size, rank))
            got = _run(collective, x, out, op, root, inplace)
            calls += size > 1 and n > 0
            want_x = data.copy()
            want_out = np.zeros_like(out)
            want = _run(collective, want_x, want_out, op, root, inplace, "native")
            if op == "avg" and got.size:  # quotients summed in each algorithm's order
                every = np.stack(op_inputs(size, n, dtype, op)).astype(np.complex128)
                bound = rounding.average(size, np.abs(every).mean(0),
                                         float(np.finfo(dtype).eps) / 2)
                exact = every.mean(0)
                if collective == "reduce_scatter":
                    lo = sum(len(b) for b in np.array_split(exact, size)[:rank])
                    exact, bound = exact[lo:lo + len(got)], np.broadcast_to(bound, exact.shape)[
                        lo:lo + len(got)]
                ok = got.shape == want.shape and bool(
                    (np.abs(got.astype(np.complex128) - exact) <= bound).all())
            else:
                ok = np.array_equal(got.view(np.uint8), want.view(np.uint8))
            if not inplace and collective != "broadcast":
                ok &= np.array_equal(x, data)  # the input is left alone
            if not ok:
                bad.append(f"{dtype.name} {op} n={n}")
    took = len(launches)
    assert_all(not bad and took == calls, f"{collective} inplace={inplace}: "
               f"{bad[:5]}, one-pass launches {took} of {calls}")


@pytest.mark.mpi
def test_nonblocking_forms_take_the_path(launches):
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    n = 1009
    ins = op_inputs(size, n, "float64", "sum")
    x = coll.empty(n, "float64")
    y = coll.empty(n, "float64")
    x[...] = ins[rank]
    y[...] = ins[rank]
    first = coll.iallreduce(x, "avg", out=x)
    second = coll.iallreduce(y, "max", out=y)
    second.wait()
    first.wait()
    ok = np.array_equal(x, np.mean(ins, axis=0)) and np.array_equal(y, np.max(ins, axis=0))
    assert_all(ok and len(launches) == (2 if size > 1 else 0),
               f"iallreduce on registered buffers ({len(launches)} one-pass launches)")


@pytest.mark.mpi
def test_ragged_allgather(launches):
    one_node_only()
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = [3 * r + 1 for r in range(size)]
    x = coll.empty(counts[rank], "int32")  # ranks ask for different sizes
    x[...] = rank * 100 + np.arange(counts[rank])
    out = np.empty(sum(counts), np.int32)
    coll.allgather(x, out=out)
    want = np.concatenate([r * 100 + np.arange(c) for r, c in enumerate(counts)])
    assert_all(np.array_equal(out, want) and len(launches) == (size > 1), "ragged allgather")


@pytest.mark.mpi
def test_mixed_foreign_and_misaligned_take_the_ordinary_path(launches):
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    n = 101
    ins = op_inputs(size, n, "int64", "sum")
    ref = np.sum(ins, axis=0)
    # mixed: registered on even ranks only
    reg = coll.empty(n, "int64")  # collective: every rank allocates
    x = reg if rank % 2 == 0 else np.empty(n, np.int64)
    x[...] = ins[rank]
    coll.allreduce(x, out=x)
    ok = bool(np.array_equal(x, ref)) and coll.is_registered(x) == (rank % 2 == 0)
    # offsets that differ between ranks
    wide = coll.empty(n + size, "int64")
    z = wide[rank:rank + n]
    z[...] = ins[rank]
    coll.allreduce(z, out=z)
    ok &= bool(np.array_equal(z, ref))
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
    coll.empty(1, "int8", comm=dup)  # pools the released window collectively
    dup.Free()
    assert_all(ok and (size == 1 or len(launches) == 0), "mixed, misaligned or foreign "
               f"registration ({len(launches)} one-pass launches)")


@pytest.mark.mpi
def test_released_buffer_is_unregistered_and_reused():
    comm = world()
    x = coll.empty(64, "float64")
    view = x[:8]
    addr = view.ctypes.data
    seq = registered.lookup(x)[0].seq
    del x
    gc.collect()
    ok = coll.is_registered(view) and view.ctypes.data == addr  # the view keeps it alive
    del view
    gc.collect()
    again = coll.empty(32, "float64")  # fits the released window: a pooled one, not a new one
    ok &= registered.lookup(again)[0].seq <= seq
    bigger = coll.empty(1 << 16, "float64")  # does not fit x's window
    ok &= registered.lookup(bigger)[0].seq != seq
    assert_all(ok, "released windows are pooled and reused", comm)


@pytest.mark.mpi
def test_subcommunicator(launches):
    comm = world()
    rank = comm.Get_rank()
    sub = comm.Split(rank % 2, rank)
    n = 97
    x = coll.empty(n, "float32", comm=sub)
    x[...] = rank + 1
    coll.allreduce(x, out=x, comm=sub)
    mates = [r for r in range(comm.Get_size()) if r % 2 == rank % 2]
    ok = np.array_equal(x, np.full(n, sum(mates) + len(mates), np.float32))
    took = len(launches)
    del x
    gc.collect()
    sub.Free()
    assert_all(ok and took == (len(mates) > 1), f"sub-communicator ({took} launches)")


@pytest.mark.mpi
def test_torch_tensors_on_registered_memory(launches):
    torch = pytest.importorskip("torch")
    from collectives.torch import empty
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = empty((5, 7), dtype=dtype)
        t.fill_(rank + 1)
        coll.allreduce(t, out=t)
        want = torch.full((5, 7), size * (size + 1) // 2, dtype=dtype)
        ok &= coll.is_registered(t) and t.shape == (5, 7) and bool(torch.equal(t, want))
    assert_all(ok and len(launches) == 3 * (size > 1), "torch tensors")


def test_empty_rejects_negative_shape():
    with pytest.raises(ValueError, match="negative"):
        coll.empty((2, -1), "float32")


@pytest.mark.mpi
def test_polling_never_waits_for_a_peer(launches):
    """A polled one-pass call returns at once while a peer has not arrived, and completes in
    ``wait`` once it has (every rank starts the call, then rank 0 polls before it lets the
    others go on)."""
    from collectives import config
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    old = config.set("COLLECTIVES_PROGRESS_THREAD", False)
    side = comm.Dup()
    try:
        x = coll.empty(4099, "float64")
        x[...] = rank + 1
        req = coll.iallreduce(x, out=x)
        if rank == 0:
            early = req.test()  # the others have not polled yet
            for peer in range(1, size):
                side.send(None, dest=peer)
        else:
            side.recv(source=0)
            early = False
        req.wait()
        ok = np.array_equal(x, np.full(4099, size * (size + 1) / 2)) and \
            (size == 1 or not early)
    finally:
        side.Free()
        config.set("COLLECTIVES_PROGRESS_THREAD", old)
    assert_all(ok and len(launches) == (size > 1), f"polled one-pass (early={early})")


@pytest.mark.mpi
@pytest.mark.parametrize("registered_buckets", [True, False])
def test_ddp_buckets_are_registered(registered_buckets, launches):
    """DDP's buckets live in shared windows and every step's allreduce is one-pass; the
    gradients match one process on the whole batch either way (``test_ddp._run``)."""
    pytest.importorskip("torch")
    from tests.test_ddp import _run
    size = world().Get_size()
    ddp = _run(hidden=40, registered_buckets=registered_buckets)
    mine = all(coll.is_registered(b.flat) for b in ddp._buckets)
    want = registered_buckets and size > 1
    assert_all(mine == registered_buckets and (len(launches) > 0) == want,
               f"registered={mine}, {len(launches)} one-pass launches")


@pytest.mark.mpi
@pytest.mark.parametrize("k", [1, 2])
def test_allreduce_node_by_node(monkeypatch, k, launches):
    """On simulated nodes of k ranks (``COLLECTIVES_RANKS_PER_NODE``) an allreduce on registered
    buffers is one-pass inside each node and ring across nodes; nodes of unequal sizes take the
    ordinary path. Both give the exact sums and maxima, and means within the rounding of
    dividing first and summing (``rounding.average``)."""
    from collectives import config
    monkeypatch.setenv("COLLECTIVES_RANKS_PER_NODE", str(k))
    config.reload()
    comm = world().Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = []
    try:
        for n in LENGTHS:
            for op in ("sum", "avg", "max"):
                ins = op_inputs(size, n, "float64", op)
                x = coll.empty(n, "float64", comm=comm)
                out = coll.empty(n, "float64", comm=comm)
                for inplace in (True, False):
                    x[...] = ins[rank]
                    got = coll.allreduce(x, op, out=x if inplace else out, comm=comm)
                    want = {"sum": np.sum, "avg": np.mean, "max": np.max}[op](ins, axis=0)
                    ok = np.array_equal(got, want) if op != "avg" else bool((np.abs(
                        got - want) <= rounding.average(size, np.abs(ins).mean(0),
                                                        2.0 ** -53)).all())
                    if not ok:
                        bad.append((n, op, inplace))
        even = size % k == 0 and size > 1
        took = len(launches)
        want_launches = even * sum(2 * 3 for n in LENGTHS if n)
    finally:
        gc.collect()
        coll.empty(1, "int8", comm=comm)
        comm.Free()
        monkeypatch.delenv("COLLECTIVES_RANKS_PER_NODE")
        config.reload()
    assert_all(not bad and took == want_launches,
               f"k={k}: wrong {bad[:4]}, {took} one-pass launches of {want_launches}")


@pytest.mark.mpi
def test_onepass_by_name_checks_in_the_window(launches):
    """``algorithm="onepass"`` skips the agreement; every rank's buffers are checked in the
    window, and a rank with an ordinary buffer makes it a ValueError on every rank."""
    one_node_only()
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    x = coll.empty(1000, "float32")
    x[...] = rank + 1
    coll.allreduce(x, out=x, algorithm="onepass")
    ok = np.array_equal(x, np.full(1000, size * (size + 1) / 2, np.float32))
    y = x if rank != size - 1 else np.ones(1000, np.float32)
    if size > 1:
        with pytest.raises(ValueError, match=rf"onepass.*rank\(s\) \[{size - 1}\]"):
            coll.allreduce(y, out=y, algorithm="onepass")
        with pytest.raises(ValueError, match="unknown algorithm 'onepass' for reduce_scatter"):
            coll.reduce_scatter(x, out=np.empty(1000 // size + 1, np.float32)[:len(
                np.array_split(np.arange(1000), size)[rank])], algorithm="onepass")
    coll.allreduce(x, out=x, algorithm="onepass")  # the window is in step after a refusal
    ok &= np.array_equal(x, np.full(1000, (size * (size + 1) / 2) * size, np.float32))
    assert_all(ok, "onepass by name")


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_buffers_are_registered(stage, launches):
    """ZeRO's flat buffers are registered on one node and its collectives run one-pass; it
    still trains like one process on the whole batch (``test_sharded._run``)."""
    one_node_only()
    pytest.importorskip("torch")
    from tests.test_sharded import _run
    size = world().Get_size()
    model, _ = _run(stage, steps=3)
    kinds = set(launches)
    want = {1: {"broadcast", "allreduce"}, 2: {"broadcast", "reduce_scatter", "allgather"},
            3: {"broadcast", "reduce_scatter", "allgather"}}[stage] if size > 1 else set()
    assert_all(want <= kinds and (size > 1 or not kinds),
               f"stage {stage}: one-pass ran {sorted(kinds)}, expected {sorted(want)}")


@pytest.mark.mpi
def test_registrations_on_a_subcommunicator_do_not_change_other_calls(launches):
    """Only the even ranks register buffers (on their own sub-communicator); an allreduce on
    a communicator without registrations runs the ordinary path on every rank, no agreement."""
    comm = world().Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    sub = comm.Split(rank % 2, rank)
    if rank % 2 == 0:
        keep = coll.empty(4096, "float64", comm=sub)
        keep[...] = 1
    x = np.full(1 << 15, rank + 1, np.float64)
    coll.allreduce(x, out=x, comm=comm)
    ok = np.array_equal(x, np.full(1 << 15, size * (size + 1) / 2))
    took = len(launches)
    gc.collect()
    sub.Free()
    comm.Free()
    assert_all(ok and took == 0, f"ordinary path on a communicator without registrations "
               f"({took} one-pass launches)")


@pytest.mark.mpi
def test_asking_for_the_node_registers_nothing(launches):
    """``single_node`` (what DDP's and ZeRO's ``"auto"`` ask) makes the communicator's entry
    but no registration: its large calls make no agreement round (on several hosts a small
    message that waits behind a bucket's bytes in the same TCP stream: it held each launch of
    DDP's buckets up to 0.27 s) until ``empty`` is called there."""
    comm = world().Dup()
    try:
        registered.single_node(comm)
        before = registered.on(comm)
        x = np.ones(1 << 12, np.float64)
        coll.allreduce(x, out=x, comm=comm)
        took = len(launches)
        keep = coll.empty(16, "float64", comm=comm)
        after = registered.on(comm)
        del keep
        gc.collect()
    finally:
        comm.Free()
    size = world().Get_size()
    assert_all(not before and after and took == 0 and np.all(x == size),
               f"on() before empty {before}, after {after}; {took} one-pass launches")
