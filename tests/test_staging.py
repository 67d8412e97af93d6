"""The CUDA staging path on the CPU: numpy memory stands in for device memory.

``FakeArray`` (a numpy subclass) is "device memory": its adaptor gives device ``"fake:0"``, so
the public API routes it through ``collectives.cuda_transport`` exactly as a cupy array. ``FakeDevice``
implements the device backend with *late* copies: every copy is queued on its stream and runs
only when someone waits for it or polls it (a poll runs at most one, at random), and pinned
blocks start filled with a poison byte. So a send posted before its device->host copy has run
sends poison, and a reduction that does not wait for its host->device copy reads stale bytes:
both show up as wrong sums (the two ``test_fake_catches_*`` tests prove that they do).

Tier 1 (plain pytest): every schedule algorithm of every collective, n = 1..5 and 8 virtual
ranks, through ``StagingTransport`` around the simulator's transport. Tier 2 (``-m mpi`` under
mpiexec): the public API on FakeArrays, every collective x algorithm (``native`` included),
staged and direct (``COLLECTIVES_CUDA_AWARE=0/1``), blocking and not, in place and not.
"""
import random
from collections import deque

import numpy as np
import pytest

from collectives import buffers, config, cuda, select
from collectives import cuda_transport as ct
from collectives.buffers import Buffer
from collectives.executor import Run
from collectives.sim import Deadlock, SimNetwork
from collectives.ops import resolve
from collectives.schedule import SEND, split
from tests import rounding

POISON = 0xA5
AWARE = "COLLECTIVES_CUDA_AWARE"


# -- the fake device ------------------------------------------------------------------------------
class FakeArray(np.ndarray):
    """numpy memory that the toolkit treats as device memory (device ``fake:0``)."""


def fake(a) -> FakeArray:
    """A fresh 'device' copy of ``a``."""
    return np.array(a, order="C").view(FakeArray)


def _fake_adaptor(x):
    if not isinstance(x, FakeArray):
        return None
    return Buffer(x, x.reshape(-1), x.shape, "fakedev", device="fake:0",
                  new=lambda shape: _fake_adaptor(np.empty(shape, x.dtype).view(FakeArray)))


class FakeStream:
    __slots__ = ("immediate", "queue", "issued", "executed")

    def __init__(self, immediate=False):
        self.immediate = immediate
        self.queue = deque()
        self.issued = self.executed = 0


class FakeEvent:
    __slots__ = ("stream", "seq")

    def __init__(self, stream, seq):
        self.stream, self.seq = stream, seq


class FakeDevice:
    """The device backend of ``collectives.cuda`` over numpy, with late copies (see above).

    The compute stream is immediate (the executor's numpy kernels run at once), so making it
    wait for an event means running the other stream up to that event. ``lie=True`` reports
    every copy as done at once; ``ignore_compute_waits=True`` drops the compute stream's waits:
    the two bugs the mutation tests plant.
    """

    def __init__(self, index=0, *, seed=0, lie=False, ignore_compute_waits=False):
        self.index = index
        self.compute = FakeStream(immediate=True)
        self.streams = []
        self.rng = random.Random(seed)
        self.lie = lie
        self.ignore_compute_waits = ignore_compute_waits
        self.d2h = self.h2d = self.pinned_bytes = 0

    def activate(self):
        pass

    def current_stream(self):
        return self.compute

    @staticmethod
    def key(stream):
        return id(stream)

    def new_stream(self):
        s = FakeStream()
        self.streams.append(s)
        return s

    def record(self, stream):
        return FakeEvent(stream, 0 if stream.immediate else stream.issued)

    def _enqueue(self, stream, fn):
        stream.queue.append(fn)
        stream.issued += 1

    def _run_one(self, stream) -> bool:
        if not stream.queue:
            return False
        stream.queue.popleft()()
        stream.executed += 1
        return True

    def wait(self, stream, event):
        if stream.immediate:
            if not self.ignore_compute_waits:
                self.synchronize(event)
        else:
            self._enqueue(stream, lambda: self.synchronize(event))

    def query(self, event):
        s = event.stream
        if self.lie or s.executed >= event.seq:
            return True
        if self.rng.random() < 0.5:
            self._run_one(s)
        return s.executed >= event.seq

    def synchronize(self, event):
        s = event.stream
        while s.executed < event.seq:
            self._run_one(s)

    def step(self) -> bool:
        """Run one queued item on every copy stream; False when all were idle."""
        return any([self._run_one(s) for s in self.streams])

    def pinned(self, nbytes):
        self.pinned_bytes += nbytes
        return np.full(nbytes, POISON, np.uint8)

    def to_host(self, host, dev, stream):
        self.d2h += 1
        self._enqueue(stream, lambda: host.__setitem__(Ellipsis, dev))

    def to_device(self, dev, host, stream):
        self.h2d += 1
        self._enqueue(stream, lambda: dev.__setitem__(Ellipsis, host))

    def caller_streams(self, buf):
        return []


buffers.register(_fake_adaptor, first=True)
ct.register_backend("fake", FakeDevice)


# -- tier 1: schedules on virtual ranks through StagingTransport -----------------------------------
def run_staged(schedules, ins, outs, op, dev):
    """``sim.run_schedules`` with every rank's transport staged through ``dev``."""
    net = SimNetwork(len(schedules))
    pool = ct.PinnedPool(dev)
    runs = []
    for r, s in enumerate(schedules):
        s.validate()
        tmp = fake(np.zeros(s.tmp, outs[r].dtype))
        t = ct.StagingTransport(net.transport(r), dev, pool)
        runs.append(Run(s.plan(), ins[r], outs[r], tmp, op, t, 0, on_done=t.close,
                        info=f"{s.name} rank {r}/{len(schedules)}"))
    for run in runs:
        run.start()
    idle = 0
    while not all(run.done for run in runs):
        progressed = net.match()
        for run in runs:
            if not run.done:
                before = run.left
                run.test()
                progressed |= run.left != before or run.done
        # A round may only post sends whose copies landed in the round before: two idle
        # rounds with idle copy streams are a deadlock.
        idle = 0 if progressed or dev.step() else idle + 1
        if idle == 2:
            stuck = [f"rank {r}: {run.waiting_for()}" for r, run in enumerate(runs)
                     if not run.done]
            raise Deadlock("staged schedules deadlock: " + "; ".join(stuck))
    return net


def schedule_algorithms():
    """(collective, name, builder) of every schedule algorithm the registry knows."""
    out = []
    for c in select.COLLECTIVES:
        for name in select.algorithms(c):
            record = select.get(c, name)
            if record.kind != select.SCHEDULE or record.needs == select.TOPOLOGY:
                continue  # native/direct need MPI; topology-aware builders need a topology
            out.append((c, name, record.build[c]))
    return out


def data(rank, n, dtype):
    return ((rank + 1) * 3 + np.arange(n) % 7).astype(dtype)


def case(collective, builder, size, n, root, seg, dtype, inplace):
    """Build every rank's schedule and buffers; return them with the expected OUTs."""
    xs = [data(r, n, dtype) for r in range(size)]
    total = np.sum(np.stack(xs).astype(np.int64), axis=0).astype(dtype) if n else \
        np.zeros(0, dtype)
    if collective == "allreduce":
        scheds = [builder(r, size, n, seg=seg) for r in range(size)]
        want = [total] * size
    elif collective == "reduce":
        scheds = [builder(r, size, n, root, seg=seg) for r in range(size)]
        want = [total if r == root else None for r in range(size)]
    elif collective == "broadcast":
        scheds = [builder(r, size, n, root, seg=seg) for r in range(size)]
        want = [xs[root]] * size
        inplace = True
    elif collective == "reduce_scatter":
        b = split(n, size)
        counts = tuple(b[k + 1] - b[k] for k in range(size))
        scheds = [builder(r, size, counts, seg=seg) for r in range(size)]
        want = [total[b[r]:b[r + 1]] for r in range(size)]
        inplace = False
    elif collective == "alltoall":  # block (i, j): m[i][j] elements, equal for Bruck
        equal = "bruck" in builder.__name__
        m = [[n // max(1, size) + (0 if equal else (i + j) % 3) for j in range(size)]
             for i in range(size)]
        blocks = [[data(i * size + j, m[i][j], dtype) for j in range(size)]
                  for i in range(size)]
        xs = [np.concatenate(b + [np.zeros(0, dtype)]) for b in blocks]
        matrix = tuple(map(tuple, m))
        scheds = [builder(r, size, matrix[r], tuple(m[i][r] for i in range(size)), seg=seg,
                          matrix=matrix) for r in range(size)]
        want = [np.concatenate([blocks[i][r] for i in range(size)] + [np.zeros(0, dtype)])
                for r in range(size)]
        inplace = False
    elif collective == "gather":
        counts = tuple(max(0, n - r % 3) for r in range(size))
        xs = [data(r, counts[r], dtype) for r in range(size)]
        scheds = [builder(r, size, counts, root, seg=seg) for r in range(size)]
        want = [np.concatenate(xs) if r == root else None for r in range(size)]
        inplace = False
    elif collective == "scatter":
        counts = tuple(max(0, n - r % 3) for r in range(size))
        parts = [data(r, counts[r], dtype) for r in range(size)]
        xs = [np.concatenate(parts) if r == root else np.zeros(0, dtype) for r in range(size)]
        scheds = [builder(r, size, counts, root, seg=seg) for r in range(size)]
        want = parts
        inplace = False
    else:  # allgather: ranks differ in length
        counts = tuple(max(0, n - r % 3) for r in range(size))
        xs = [data(r, counts[r], dtype) for r in range(size)]
        scheds = [builder(r, size, counts, seg=seg) for r in range(size)]
        want = [np.concatenate(xs)] * size
        inplace = False
    ins = [fake(x) for x in xs]
    if inplace:
        outs = ins
    else:
        outs = [fake(np.full(s.count_out, 99, dtype)) for s in scheds]
    return scheds, ins, outs, want


ALGOS = schedule_algorithms()


@pytest.mark.parametrize("collective,name,builder", ALGOS,
                         ids=[f"{c}-{n}" for c, n, _ in ALGOS])
def test_every_schedule_staged(collective, name, builder):
    """Every algorithm, staged, n = 1..5 and 8, short and multi-segment, in place and not."""
    checked = 0
    for size in (1, 2, 3, 4, 5, 8):
        for n in (0, 1, 7, 30):
            for inplace in (False, True):
                if inplace and collective not in ("allreduce", "reduce"):
                    continue
                root = (size - 1) // 2
                dev = FakeDevice(seed=size * 100 + n)
                scheds, ins, outs, want = case(collective, builder, size, n, root, 4,
                                               np.int32, inplace)
                run_staged(scheds, ins, outs, resolve("sum", np.int32), dev)
                for r in range(size):
                    if want[r] is None:
                        continue
                    got = np.asarray(outs[r])[:len(want[r])]
                    assert np.array_equal(got, want[r]), \
                        f"{collective}/{name} n={size} count={n} rank {r}: {got} != {want[r]}"
                if any(op[0] == SEND for sch in scheds for op in sch.ops):
                    assert dev.d2h and dev.h2d, "nothing was staged"
                checked += 1
    assert checked


def test_staged_traffic_equals_host_traffic():
    """Staging changes where bytes wait, not what goes on the wire."""
    from collectives import ring
    from collectives.sim import simulate
    size, n = 4, 50
    xs = [data(r, n, np.float32) for r in range(size)]
    _, host_net = simulate(ring.allreduce, xs, "sum", count=n, seg=8)
    scheds = [ring.allreduce(r, size, n, seg=8) for r in range(size)]
    outs = [fake(np.zeros(n, np.float32)) for _ in range(size)]
    net = run_staged(scheds, [fake(x) for x in xs], outs, resolve("sum", np.float32),
                     FakeDevice(seed=3))
    assert net.traffic.bytes == host_net.traffic.bytes
    assert net.traffic.messages == host_net.traffic.messages


@pytest.mark.parametrize("bug", ["lie", "ignore_compute_waits"])
def test_fake_catches_missing_waits(bug):
    """The fake device is strict enough: a transport that skips a wait gives wrong sums."""
    from collectives import ring
    size, n = 3, 40
    wrong = 0
    for seed in range(5):
        dev = FakeDevice(seed=seed, **{bug: True})
        scheds = [ring.allreduce(r, size, n, seg=4) for r in range(size)]
        ins = [fake(data(r, n, np.int32)) for r in range(size)]
        outs = [fake(np.zeros(n, np.int32)) for _ in range(size)]
        run_staged(scheds, ins, outs, resolve("sum", np.int32), dev)
        want = sum(data(r, n, np.int64) for r in range(size))
        wrong += sum(not np.array_equal(o, want) for o in outs)
    assert wrong, f"planting bug {bug!r} went unnoticed"


# -- the pinned pool ----------------------------------------------------------------------------
def test_pool_reuses_blocks_by_size_class():
    dev = FakeDevice()
    pool = ct.PinnedPool(dev)
    a = pool.take(5000)
    assert a.nbytes == 8192 and pool.size_class(0) == ct.MIN_BLOCK
    pool.give(a)
    b = pool.take(8000)
    assert b is a and pool.allocated == 8192
    c = pool.take(9000)
    assert c.nbytes == 16384 and pool.allocated == 8192 + 16384


def test_pool_waits_for_the_last_copy_before_reuse():
    dev = FakeDevice()
    pool = ct.PinnedPool(dev)
    stream = dev.new_stream()
    block = pool.take(100)
    dev.to_device(fake(np.zeros(100, np.uint8)), block[:100], stream)
    pool.give(block, dev.record(stream))
    dev.rng = random.Random(1)
    dev.lie = False
    dev.query = lambda e: e.stream.executed >= e.seq  # never progresses by itself
    assert pool.take(100) is not block  # the copy out of it has not run yet
    dev.synchronize(dev.record(stream))
    assert pool.take(100) is block


def test_pool_keeps_at_most_its_limit():
    dev = FakeDevice()
    pool = ct.PinnedPool(dev, limit=8192)
    blocks = [pool.take(4096) for _ in range(3)]
    for blk in blocks:
        pool.give(blk)
    assert pool.cached == 8192


# -- awareness --------------------------------------------------------------------------------
def test_awareness_override(monkeypatch):
    monkeypatch.setattr(cuda, "_DETECTED", (False, "test"))
    old = config.set(AWARE, "1")
    try:
        assert cuda.awareness() == (True, f"{AWARE}=1")
        config.set(AWARE, "off")
        assert cuda.aware() is False
        config.set(AWARE, "auto")
        assert cuda.awareness() == (False, "test")
        with pytest.raises(ValueError, match="COLLECTIVES_CUDA_AWARE='maybe'"):
            config.set(AWARE, "maybe")
    finally:
        config.set(AWARE, old)


def test_torch_cuda_tensor_without_cupy_is_a_clear_type_error(monkeypatch):
    """Without cupy a device buffer is refused up front (never a silent host copy)."""
    import builtins
    real = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    monkeypatch.setattr(buffers, "_CUPY", None)  # cupy is imported by the buffer adaptors
    with pytest.raises(TypeError, match="need cupy"):
        cuda.import_cupy()


def test_fake_buffers_are_device_buffers():
    b = buffers.wrap(fake(np.arange(6, dtype=np.float32).reshape(2, 3)))
    assert b.is_device and b.device == "fake:0" and b.count == 6
    assert isinstance(b.new((4,)).obj, FakeArray)


# -- tier 2: the public API under MPI ----------------------------------------------------------
MPI_LENGTHS = (1, 5, 37)


@pytest.fixture
def small_segments():
    old = config.set("COLLECTIVES_SEGMENT_BYTES", 32)
    yield
    config.set("COLLECTIVES_SEGMENT_BYTES", old)


def _all_algorithms(collective):
    """auto and every name, but those that run on registered buffers only (host memory), and
    where the ranks span nodes those that need one node (refused there: test_collectives_mpi)."""
    from tests.mpiutil import spans_nodes
    one_node = not spans_nodes()
    return ("auto",) + tuple(name for name in select.algorithms(collective)
                             if not select.get(collective, name).registered and
                             (one_node or select.get(collective, name).needs != select.ONE_NODE))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["0", "1"], ids=["staged", "direct"])
@pytest.mark.parametrize("collective", select.COLLECTIVES)
def test_public_api_on_fake_device(collective, mode, small_segments, monkeypatch):
    """Every algorithm of ``collective`` on 'device' buffers: results, kind, device."""
    from collectives import api as coll  # ireduce is not re-exported by the package (yet)
    from tests.mpiutil import assert_all, world
    old = config.set(AWARE, mode)
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    dev = ct.device("fake:0")
    errors = []
    for name in _all_algorithms(collective):
        before = dev.d2h + dev.h2d
        for n in MPI_LENGTHS:
            for blocking in (True, False):
                try:
                    _check_one(coll, collective, name, n, blocking, rank, size, errors)
                except Exception as exc:  # noqa: BLE001 - reported after agreeing
                    errors.append(f"{name} n={n} blocking={blocking}: {exc!r}")
        # Direct mode stages nothing, except algorithms that only work on host memory.
        host_only = name == "auto" or select.get(collective, name).kind == select.DIRECT
        staged = dev.d2h + dev.h2d > before
        if size > 1 and name != "auto" and collective != "barrier" and \
                staged != (mode == "0" or host_only):  # a barrier has no buffer to stage
            errors.append(f"{name}: mode {mode} staged={staged}")
    config.set(AWARE, old)
    assert_all(not errors, "; ".join(errors[:5]))


def _check_one(coll, collective, name, n, blocking, rank, size, errors):
    dtype = np.float32
    xs = [data(r, n, dtype) for r in range(size)]
    total = np.sum(np.stack(xs), axis=0)
    x = fake(xs[rank])
    kw = dict(algorithm=name)
    where = f"{collective}/{name} n={n} blocking={blocking}"
    if collective == "allreduce":
        for inplace in (False, True):
            xi = fake(xs[rank]) if inplace else x
            if blocking:
                got = coll.allreduce(xi, out=xi if inplace else None, **kw)
            else:
                got = coll.iallreduce(xi, out=xi if inplace else None, **kw).wait()
            _expect(got, total, f"{where} inplace={inplace}", errors)
            if not inplace:
                _expect(x, xs[rank], f"{where}: input modified", errors)
        got = coll.allreduce(x, op="avg", **kw)
        # each input divided by the ranks, then summed: within float32's rounding of the mean
        inputs = np.stack(xs).astype(np.float64)
        _expect(got, inputs.mean(0), f"{where} avg", errors,
                bound=rounding.average(size, np.abs(inputs).mean(0)))
    elif collective == "reduce":
        root = size - 1
        got = coll.reduce(x, root=root, **kw) if blocking else \
            coll.ireduce(x, root=root, **kw).wait()
        if rank == root:
            _expect(got, total, where, errors)
        elif got is not None:
            errors.append(f"{where}: non-root got {type(got).__name__}")
    elif collective == "broadcast":
        root = size // 2
        buf = fake(xs[rank])
        got = coll.broadcast(buf, root=root, **kw) if blocking else \
            coll.ibroadcast(buf, root=root, **kw).wait()
        _expect(got, xs[root], where, errors)
        if got is not buf:
            errors.append(f"{where}: broadcast did not return x")
    elif collective == "reduce_scatter":
        b = split(n, size)
        got = coll.reduce_scatter(x, **kw) if blocking else \
            coll.ireduce_scatter(x, **kw).wait()
        _expect(got, total[b[rank]:b[rank + 1]], where, errors)
    elif collective == "allgather":
        counts = [max(1, n - r % 2) for r in range(size)]
        xs = [data(r, counts[r], dtype) for r in range(size)]
        xa = fake(xs[rank])
        got = coll.allgather(xa, **kw) if blocking else coll.iallgather(xa, **kw).wait()
        _expect(got, np.concatenate(xs), where, errors)
    elif collective == "alltoall":  # block (i, j) of m[i][j] elements
        m = [[n // size + (0 if name == "bruck" else (i + j) % 3) for j in range(size)]
             for i in range(size)]
        blocks = [[data(i * size + j, m[i][j], dtype) for j in range(size)] for i in range(size)]
        xa = fake(np.concatenate(blocks[rank]))
        counts = None if name == "bruck" else m[rank]
        got = coll.alltoall(xa, counts, **kw) if blocking else \
            coll.ialltoall(xa, counts, **kw).wait()
        _expect(got, np.concatenate([blocks[i][rank] for i in range(size)]), where, errors)
    elif collective == "gather":
        root = size - 1
        xs = [data(r, n + r % 2, dtype) for r in range(size)]
        got = coll.gather(fake(xs[rank]), root, **kw) if blocking else \
            coll.igather(fake(xs[rank]), root, **kw).wait()
        if rank == root:
            _expect(got, np.concatenate(xs), where, errors)
        elif got is not None:
            errors.append(f"{where}: non-root got {type(got).__name__}")
    elif collective == "scatter":
        counts = [n + r % 2 for r in range(size)]
        xs = [data(r, counts[r], dtype) for r in range(size)]
        for out in (None, fake(np.zeros(counts[rank], dtype))):  # a header, or out everywhere
            # without out, an empty x of the kind tells the other ranks what to return
            src = fake(np.concatenate(xs)) if rank == 0 else \
                None if out is not None else fake(np.zeros(0, dtype))
            got = coll.scatter(src, 0, counts=counts if rank == 0 else None, out=out, **kw) \
                if blocking else coll.iscatter(src, 0, counts=counts if rank == 0 else None,
                                               out=out, **kw).wait()
            _expect(got, xs[rank], where, errors)
    else:
        got = coll.barrier(**kw) if blocking else coll.ibarrier(**kw).wait()
        if got is not None:
            errors.append(f"{where}: barrier returned {got!r}")


def _expect(got, want, where, errors, bound=None):
    """``got`` is of the input's kind and equals ``want`` (within ``bound``, element-wise,
    where given)."""
    if not isinstance(got, FakeArray):
        errors.append(f"{where}: result is {type(got).__name__}, not the input's kind")
    elif not (np.array_equal(np.asarray(got), want) if bound is None else
              bool((np.abs(np.asarray(got, np.float64) - want) <= bound).all())):
        errors.append(f"{where}: {np.asarray(got)[:6]} != {np.asarray(want)[:6]}")


@pytest.mark.mpi
def test_detected_awareness_of_this_mpi():
    """MPICH from the package index is not CUDA-aware: detection says so, and how it knows."""
    from mpi4py import MPI
    if config.get(AWARE) is not None:
        pytest.skip(f"{AWARE} is set")
    ok, how = cuda.awareness()
    if MPI.get_vendor()[0] == "MPICH":
        assert (ok, how) == (False, "MPIX_Query_cuda_support()")
    assert isinstance(ok, bool) and how
