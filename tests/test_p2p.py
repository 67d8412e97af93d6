"""``collectives.p2p``: typed headers, zero-copy sends and receives, the one watched wait.

The MPI tier passes messages around a ring (rank r sends to r + 1, receives from r - 1; at
n = 1 a rank sends to itself), with exact rank-dependent data compared byte for byte: every
dtype of the one dtype table (bfloat16 included), numpy arrays and torch tensors, empty
arrays; then what a receiver refuses (another size, another dtype or shape) and that the
stream stays in step after a refusal. The in-process tier checks the header alone, refusals
that need no message, and, as real ``mpiexec -n 2`` jobs (tests/faults/p2p.py), that a wait
for a message no one sends is ended by the watchdog naming what it waits for.
"""
import re

import numpy as np
import pytest

from collectives import p2p
from collectives.buffers import DTYPES
from collectives.errors import MessageSizeError
from mpiutil import assert_all, rank_data, world

SHAPES = [(), (0,), (3, 0), (5,), (2, 3), (1, 2, 1, 3)]


def _ring():
    comm = world()
    r, n = comm.Get_rank(), comm.Get_size()
    return comm, r, (r + 1) % n, (r - 1) % n


def _data(rank, dtype, shape):
    return rank_data(rank, int(np.prod(shape)), dtype).reshape(shape)


def _same(a, b) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, -0.0-safe)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and \
        a.reshape(-1).view(np.uint8).tobytes() == b.reshape(-1).view(np.uint8).tobytes()


def _numpy(t):
    """A torch tensor's values as numpy (bfloat16 through its bytes)."""
    import torch
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(p2p.dtype_of(p2p.code_of(torch.bfloat16)))
    return t.numpy()


# -- MPI tier ------------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_typed_messages_of_every_dtype_and_shape(dtype):
    comm, r, right, left = _ring()
    errors = []
    for i, shape in enumerate(SHAPES):
        sends = p2p.send_typed(comm, _data(r, dtype, shape), right, i)
        got = p2p.recv_typed(comm, left, i, what="test")
        if not _same(got, _data(left, dtype, shape)):
            errors.append(f"{shape}: received {got!r}")
        sends.wait("test sends", comm)
    assert_all(not errors, "; ".join(errors))


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_untyped_messages_land_in_the_receivers_array(dtype):
    comm, r, right, left = _ring()
    errors = []
    for i, shape in enumerate(SHAPES):
        x = _data(r, dtype, shape)
        req = p2p.isend(comm, x, right, 100 + i)
        out = np.empty(shape, dtype)
        back = p2p.recv(comm, out, left, 100 + i, what="test")
        p2p.wait_all([req], "test send", comm)
        if back is not out or not _same(out, _data(left, dtype, shape)):
            errors.append(f"{shape}: received {out!r}")
    assert_all(not errors, "; ".join(errors))


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_torch_tensors_of_every_dtype_zero_copy():
    torch = pytest.importorskip("torch")
    comm, r, right, left = _ring()
    dtypes = (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
              torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
              torch.complex128)
    errors = []
    for i, dt in enumerate(dtypes):
        for j, shape in enumerate([(0,), (4, 3)]):
            npdt = p2p.dtype_of(p2p.code_of(dt))
            mine = torch.from_numpy(_data(r, np.float64, shape)).to(dt) if dt != torch.bool \
                else torch.from_numpy(_data(r, np.bool_, shape))
            want = torch.from_numpy(_data(left, np.float64, shape)).to(dt) \
                if dt != torch.bool else torch.from_numpy(_data(left, np.bool_, shape))
            tag = 2 * i + j
            # typed: the receiver makes the tensor
            sends = p2p.send_typed(comm, mine, right, tag)
            got = p2p.recv_typed(comm, left, tag, kind="torch", what="test")
            sends.wait("test sends", comm)
            if not isinstance(got, torch.Tensor) or got.dtype != dt or \
                    not torch.equal(got, want):
                errors.append(f"typed {dt} {shape}: received {got!r}")
            # untyped into a tensor the caller made: its own memory is written (no copy)
            out = torch.empty(shape, dtype=dt)
            before = out.data_ptr()
            req = p2p.isend(comm, mine, right, 1000 + tag)
            p2p.recv(comm, out, left, 1000 + tag)
            p2p.wait_all([req], "test send", comm)
            if out.data_ptr() != before or not torch.equal(out, want) or \
                    _numpy(out).dtype != npdt:
                errors.append(f"untyped {dt} {shape}: received {out!r}")
    assert_all(not errors, "; ".join(errors))


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_a_receiver_refuses_another_size_dtype_or_shape_and_stays_in_step():
    comm, r, right, left = _ring()
    errors = []
    x = _data(r, np.float32, (4, 3))
    # 1. untyped, another size: the message is taken off the wire and named
    sends = p2p.Sends()
    sends.add(p2p.isend(comm, x, right, 1), x)
    try:
        p2p.recv(comm, np.empty(5, np.float32), left, 1, what="test receive")
        errors.append("no error for 48 bytes into 20")
    except MessageSizeError as exc:
        want = f"test receive: expected 20 bytes (float32 (5,)) from rank {left} (tag 1), " \
               f"received 48"
        if str(exc) != want:
            errors.append(f"{exc} != {want}")
    # 2. typed, another dtype, then another shape: named both ways
    for tag, expect, said in ((2, (np.float64, (4, 3)), "float64 (4, 3)"),
                              (3, (np.float32, (3, 4)), "float32 (3, 4)")):
        p2p.send_typed(comm, x, right, tag, sends)
        try:
            p2p.recv_typed(comm, left, tag, expect=expect, what="test receive")
            errors.append(f"no error for {said}")
        except p2p.MessageTypeError as exc:
            want = f"test receive: expected {said} from rank {left} (tag {tag}), received " \
                   f"float32 (4, 3)"
            if str(exc) != want:
                errors.append(f"{exc} != {want}")
    # 3. the stream is in step: the next message arrives whole
    p2p.send_typed(comm, x, right, 4, sends)
    got = p2p.recv_typed(comm, left, 4, expect=(np.float32, (4, 3)))
    if not _same(got, _data(left, np.float32, (4, 3))):
        errors.append(f"after the refusals: {got!r}")
    sends.wait("test sends", comm)
    if len(sends):
        errors.append(f"{len(sends)} sends still held after wait")
    assert_all(not errors, "; ".join(errors))


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_blocking_send_and_recv_around_the_ring():
    """Even ranks send first, odd ones receive first, so blocking calls complete at any
    message size (a rendezvous included) for n >= 2."""
    comm, r, right, left = _ring()
    if comm.Get_size() < 2:
        pytest.skip("a blocking send to oneself needs a receive posted first")
    x, out = _data(r, np.float64, (50_000,)), np.empty(50_000)
    if r % 2 == 0:
        p2p.send(comm, x, right, 9, what="test send")
        p2p.recv(comm, out, left, 9, what="test receive")
    else:
        p2p.recv(comm, out, left, 9, what="test receive")
        p2p.send(comm, x, right, 9, what="test send")
    assert_all(_same(out, _data(left, np.float64, (50_000,))), "wrong data")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_sends_release_their_buffers_once_complete():
    import gc
    import weakref
    comm, r, right, left = _ring()
    sends = p2p.Sends()
    x = _data(r, np.float64, (1000,))
    ref = weakref.ref(x)
    sends.add(p2p.isend(comm, x, right, 5), x)
    del x
    out = p2p.recv(comm, np.empty(1000), left, 5)
    sends.wait("test send", comm)
    gc.collect()
    assert_all(ref() is None and _same(out, _data(left, np.float64, (1000,))),
               "a completed send kept its buffer")


# -- in-process tier -----------------------------------------------------------------------------
def test_header_round_trips_every_dtype_and_up_to_maxdim_axes():
    for dtype in DTYPES:
        for shape in SHAPES + [(2,) * p2p.MAXDIM]:
            hdr = p2p.header(dtype, shape)
            assert hdr.dtype == np.int64 and hdr.shape == (p2p.HEADER,)
            assert p2p.parse(hdr) == (dtype, shape)
            assert p2p.code_of(dtype) == DTYPES.index(dtype)   # the one dtype table
    with pytest.raises(ValueError, match="8 axes at most, got 9"):
        p2p.header(np.float32, (1,) * 9)
    with pytest.raises(TypeError, match="unsupported dtype"):
        p2p.code_of(np.dtype("U3"))
    with pytest.raises(p2p.MessageTypeError, match="dtype code 99"):
        p2p.parse(np.array([99, 1, 3] + [0] * 7))
    with pytest.raises(p2p.MessageTypeError, match="header of 12 axes"):
        p2p.parse(np.array([0, 12] + [0] * 8))


def test_torch_dtypes_share_the_numpy_codes():
    torch = pytest.importorskip("torch")
    from ml_dtypes import bfloat16
    pairs = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
             torch.bfloat16: bfloat16, torch.int64: np.int64, torch.int8: np.int8,
             torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64}
    for t, n in pairs.items():
        assert p2p.code_of(t) == p2p.code_of(np.dtype(n))
        assert p2p.empty(np.dtype(n), (2, 1), kind="torch").dtype == t
    with pytest.raises(p2p.MessageTypeError, match="torch has no dtype for uint32"):
        p2p.empty(np.uint32, (1,), kind="torch")


def test_a_strided_array_is_refused_before_anything_is_sent():
    from mpi4py import MPI
    x = np.arange(12.0).reshape(3, 4)
    for bad in (x[:, ::2], x.T):
        with pytest.raises(ValueError, match="not C-contiguous"):
            p2p.isend(MPI.COMM_SELF, bad, 0, 0)
        with pytest.raises(ValueError, match="not C-contiguous"):
            p2p.send_typed(MPI.COMM_SELF, bad, 0, 0)
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="not C-contiguous"):
        p2p.isend(MPI.COMM_SELF, torch.zeros(3, 4).t(), 0, 0)
    assert MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG) is False  # nothing went out


def test_the_wait_is_watched_and_ends_its_entry(monkeypatch):
    """A wait that does not end at its first poll is in the watchdog's report while it
    lasts (what, and what it waits for), and gone after."""
    from mpi4py import MPI

    from collectives import watchdog
    seen = []
    polls = iter(range(3))

    def test():
        if next(polls, None) == 1:
            seen.append(watchdog.registry.report())
        return len(seen) > 0
    old = watchdog.set_timeout(30)
    try:
        p2p.wait(test, "stage 3's receive", lambda: "the activation from rank 2", MPI.COMM_SELF)
    finally:
        watchdog.set_timeout(old)
    assert len(seen) == 1 and "stage 3's receive for " in seen[0], seen
    assert "waiting for: the activation from rank 2" in seen[0], seen
    assert "stage 3's receive" not in watchdog.registry.report()


def test_a_wait_that_ends_at_once_registers_nothing(monkeypatch):
    from mpi4py import MPI

    from collectives import watchdog
    made = []
    monkeypatch.setattr(watchdog, "watch_local", lambda *a, **k: made.append(a))
    p2p.wait(lambda: True, "x", "y", MPI.COMM_SELF)
    p2p.wait_all([], "x", MPI.COMM_SELF)
    assert not made


@pytest.mark.timeout(90)
def test_a_wait_for_a_message_no_one_sends_ends_the_job_naming_it():
    from test_faults import WATCHDOG_EXIT, launch
    job = launch("p2p.py", n=2, timeout=2)
    assert job.rc == WATCHDOG_EXIT, job
    assert job.seconds < 2 + 15, job
    assert re.search(r"rank \d: p2p fault test: rank (\d)'s receive did not complete in "
                     r"[\d.]+ s \(COLLECTIVES_TIMEOUT=2\); waiting for: a message from rank "
                     r"\d \(tag \d\)", job.err), job
    rank = int(re.search(r"p2p fault test: rank (\d)'s receive did not", job.err).group(1))
    assert f"a message from rank {1 - rank} (tag {7 + rank})" in job.err, job
    assert "aborting the job: MPI_Abort(COMM_WORLD, 124)" in job.err, job

