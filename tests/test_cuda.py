"""GPU tier: cupy arrays and CUDA tensors through every collective, algorithm and the DDP layer.

Skips, with the reason, where cupy or a CUDA device is missing (the CPU machines of CI); the
staging logic itself is covered on the CPU by ``tests/test_staging.py``. On a GPU machine:

    python -m pytest tests/test_cuda.py -m "not mpi"                          # adaptors
    mpiexec -n 2 python -m pytest --with-mpi -m mpi tests/test_cuda.py        # collectives

Ranks may share one GPU (rank r uses device r % count). ``tests/gpu/run_on_device.sh`` runs both
and the GPU benchmark. The staged path always runs; the direct path runs where the MPI library
says it is CUDA-aware (forcing it on a library that is not would hand it device pointers).
"""
import copy
import os

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="cupy is not installed: the CUDA tests need cupy "
                                          "and a CUDA device (tests/test_staging.py covers the "
                                          "staging logic on the CPU)")
try:
    _NDEV = cupy.cuda.runtime.getDeviceCount()
    _WHY = "no CUDA device"
except Exception as exc:  # noqa: BLE001 - no driver, no device
    _NDEV, _WHY = 0, f"no usable CUDA device ({exc})"
if not _NDEV:
    pytest.skip(_WHY, allow_module_level=True)

from collectives import buffers, config, cuda, select  # noqa: E402
from collectives.buffers import bfloat16  # noqa: E402
from collectives.ops import resolve  # noqa: E402
from collectives.schedule import split  # noqa: E402

try:  # the torch cases skip on their own where torch or its CUDA build is missing
    import torch
    if not torch.cuda.is_available():
        torch = None
except ImportError:
    torch = None

KINDS = ("cupy", "torch")
BF16 = np.dtype(bfloat16)


def _rank_device():
    """This process's GPU: rank % count (two ranks on one GPU is fine for correctness)."""
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    return rank % _NDEV


DEV = _rank_device()
cupy.cuda.Device(DEV).use()
if torch is not None:
    torch.cuda.set_device(DEV)


def to_device(a: np.ndarray, kind: str):
    """A device copy of host array ``a`` as a cupy array or a CUDA tensor."""
    if kind == "cupy":
        return cupy.asarray(a)
    if a.dtype == BF16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(f"cuda:{DEV}")


def to_host(x) -> np.ndarray:
    if isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x)
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).cpu().numpy().view(BF16)
    return x.cpu().numpy()


def need(kind):
    if kind == "torch" and torch is None:
        pytest.skip("torch with CUDA is not available")


# -- buffers (one process) -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int8", "int32", "int64",
                                   "uint8", "complex64", "bool", "bfloat16"])
def test_wrap_is_zero_copy_on_the_same_device(kind, dtype):
    need(kind)
    host = (np.arange(12) % 3).astype(BF16 if dtype == "bfloat16" else dtype).reshape(3, 4)
    if dtype == "bfloat16" and not cuda.bf16_supported(cupy):
        if kind == "cupy":
            pytest.skip(f"cupy {cupy.__version__} has no bfloat16 arrays")
        with pytest.raises(TypeError, match="bfloat16"):  # refused, never a host round trip
            buffers.wrap(to_device(host, kind))
        return
    x = to_device(host, kind)
    b = buffers.wrap(x)
    ptr = x.data.ptr if kind == "cupy" else x.data_ptr()
    assert isinstance(b.flat, cupy.ndarray) and b.flat.data.ptr == ptr
    assert b.is_device and b.device == f"cuda:{DEV}" and b.kind == kind
    assert b.count == 12 and b.shape == (3, 4) and b.dtype == host.dtype
    assert np.array_equal(cupy.asnumpy(b.flat.view(np.uint8)),
                          np.ascontiguousarray(host).reshape(-1).view(np.uint8))
    b.flat[:1] = b.flat[1:2]  # writes land in the caller's array
    assert np.array_equal(to_host(x).reshape(-1)[:1], host.reshape(-1)[1:2])
    n = b.new((5,))
    assert n.kind == kind and n.device == b.device and n.dtype == b.dtype and n.count == 5


def test_reductions_run_on_the_gpu():
    """numpy's ufuncs with out= dispatch to cupy: the executor's kernels never touch the host."""
    a = cupy.arange(10, dtype=cupy.float32)
    b = cupy.ones(10, dtype=cupy.float32)
    op = resolve("sum", np.float32)
    op.reduce(a, a, b)
    assert isinstance(a, cupy.ndarray) and float(a[3].get()) == 4.0
    flags = cupy.zeros(4, dtype=bool)
    resolve("sum", np.bool_).reduce(flags, flags, cupy.array([True, False, True, False]))
    assert cupy.asnumpy(flags).tolist() == [True, False, True, False]


def test_strided_device_buffers_are_refused():
    x = cupy.zeros((4, 4), dtype=cupy.float32)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        buffers.wrap(x)


# -- collectives under MPI -----------------------------------------------------------------------
def data(rank, n, dtype):
    dtype = np.dtype(dtype)
    v = (rank + 1) * 3 + np.arange(n) % 5
    if dtype.kind == "b":
        return (v + rank) % 3 == 0
    return v.astype(dtype)


def reference(xs, op, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return np.logical_or.reduce(np.stack(xs), axis=0)
    stack = np.stack(xs).astype(np.float64)
    if op == "max":
        return stack.max(0)
    total = stack.sum(0)
    return total / len(xs) if op == "avg" else total


def same(got, want, dtype) -> bool:
    g = to_host(got)
    if np.dtype(dtype) == BF16 or np.dtype(dtype).kind in "fiu":
        return g.shape == want.shape and np.array_equal(g.astype(np.float64), want)
    return np.array_equal(g, want)


AWARE = "COLLECTIVES_CUDA_AWARE"


@pytest.fixture(autouse=True)
def _restore_awareness():
    old = config.get(AWARE)
    yield
    config.set(AWARE, old)


def _mode(mode, monkeypatch):
    if mode == "direct":
        config.set(AWARE, None)  # what the library says
        if not cuda.aware():
            pytest.skip(f"the MPI library is not CUDA-aware ({cuda.awareness()[1]})")
    config.set(AWARE, "1" if mode == "direct" else "0")


@pytest.fixture
def segments():
    old = config.set("COLLECTIVES_SEGMENT_BYTES", 1 << 14)  # 16 KiB: many segments
    yield
    config.set("COLLECTIVES_SEGMENT_BYTES", old)


def dtypes_for(kind):
    out = ["float32", "float16", "int64", "bool"]
    if cuda.bf16_supported(cupy):
        out.append("bfloat16")
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_collective_and_algorithm(kind, mode, segments, monkeypatch):
    """Results, kind and device of every collective x algorithm on device buffers."""
    from collectives import api as coll
    from tests.mpiutil import assert_all, world
    need(kind)
    _mode(mode, monkeypatch)
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    errors = []

    def check(got, want, dtype, where, like):
        if kind == "cupy" and not isinstance(got, cupy.ndarray) or \
                kind == "torch" and not isinstance(got, torch.Tensor):
            errors.append(f"{where}: result is {type(got).__name__}")
        elif kind == "torch" and got.device != like.device:
            errors.append(f"{where}: result on {got.device}, input on {like.device}")
        elif not same(got, want, dtype):
            errors.append(f"{where}: {to_host(got).reshape(-1)[:5]} != {want.reshape(-1)[:5]}")

    for collective in select.COLLECTIVES:
        for name in ("auto",) + tuple(n for n in select.algorithms(collective)
                                      if not select.get(collective, n).registered):
            kinds = dtypes_for(kind) if collective == "allreduce" else ["float32", "int64"]
            for dtype in kinds:
                for n in (1, 7, 4099, 100_003):
                    for blocking in ((True, False) if n == 4099 else (True,)):
                        where = f"{kind}/{mode} {collective}/{name} {dtype} n={n} " \
                                f"blocking={blocking}"
                        try:
                            _one(coll, collective, name, dtype, n, blocking, rank, size,
                                 kind, check, where)
                        except Exception as exc:  # noqa: BLE001 - agreed on below
                            errors.append(f"{where}: {exc!r}")
    assert_all(not errors, f"{len(errors)} failures: " + "; ".join(errors[:6]))


def _one(coll, collective, name, dtype, n, blocking, rank, size, kind, check, where):
    xs = [data(r, n, dtype) for r in range(size)]
    x = to_device(xs[rank], kind)
    kw = dict(algorithm=name)

    def run(fn, ifn, *args, **kwargs):
        return fn(*args, **kwargs, **kw) if blocking else ifn(*args, **kwargs, **kw).wait()

    if collective == "allreduce":
        ops = ["sum"] + (["avg"] if dtype == "float32" else []) + \
            (["max"] if dtype == "int64" else [])
        for op in ops:
            got = run(coll.allreduce, coll.iallreduce, x, op)
            check(got, reference(xs, op, dtype), dtype, f"{where} {op}", x)
        y = to_device(xs[rank], kind)
        got = run(coll.allreduce, coll.iallreduce, y, out=y)
        check(got, reference(xs, "sum", dtype), dtype, f"{where} in place", x)
        check(x, xs[rank].astype(np.float64) if np.dtype(dtype).kind != "b" else xs[rank],
              dtype, f"{where} input untouched", x)
    elif collective == "reduce":
        root = size - 1
        got = run(coll.reduce, coll.ireduce, x, root=root)
        if rank == root:
            check(got, reference(xs, "sum", dtype), dtype, where, x)
    elif collective == "broadcast":
        root = size // 2
        got = run(coll.broadcast, coll.ibroadcast, x, root=root)
        check(got, xs[root].astype(np.float64), dtype, where, x)
    elif collective == "reduce_scatter":
        b = split(n, size)
        got = run(coll.reduce_scatter, coll.ireduce_scatter, x)
        check(got, reference(xs, "sum", dtype)[b[rank]:b[rank + 1]], dtype, where, x)
    elif collective == "allgather":
        counts = [n + r % 2 for r in range(size)]
        parts = [data(r, counts[r], dtype) for r in range(size)]
        got = run(coll.allgather, coll.iallgather, to_device(parts[rank], kind))
        check(got, np.concatenate(parts).astype(np.float64), dtype, where, x)
    elif collective == "alltoall":  # block (i, j) of m[i][j] elements from rank i to rank j
        m = [[n // size + (0 if name == "bruck" else (i + j) % 3) for j in range(size)]
             for i in range(size)]
        blocks = [[data(i * size + j, m[i][j], dtype) for j in range(size)] for i in range(size)]
        mine = to_device(np.concatenate(blocks[rank]), kind)
        counts = None if name == "bruck" else m[rank]
        got = run(coll.alltoall, coll.ialltoall, mine, counts)
        want = np.concatenate([blocks[i][rank] for i in range(size)])
        check(got, want.astype(np.float64), dtype, where, x)
    elif collective == "gather":
        root = size - 1
        parts = [data(r, n + r % 2, dtype) for r in range(size)]
        got = run(coll.gather, coll.igather, to_device(parts[rank], kind), root)
        if rank == root:
            check(got, np.concatenate(parts).astype(np.float64), dtype, where, x)
    elif collective == "scatter":
        counts = [n + r % 2 for r in range(size)]
        parts = [data(r, counts[r], dtype) for r in range(size)]
        src = to_device(np.concatenate(parts), kind) if rank == 0 else None
        like = to_device(parts[rank][:0], kind)
        got = run(coll.scatter, coll.iscatter, src, 0, counts=counts if rank == 0 else None,
                  out=to_device(np.zeros_like(parts[rank]), kind) if rank else None)
        check(got, parts[rank].astype(np.float64), dtype, where, like)
    else:
        run(coll.barrier, coll.ibarrier)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("kind", KINDS)
def test_callers_stream_work_comes_first(kind, mode, monkeypatch):
    """Work queued on the caller's current stream is complete before any byte leaves."""
    import collectives as coll
    from tests.mpiutil import assert_all, world
    need(kind)
    _mode(mode, monkeypatch)
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    n = 1 << 20
    want = sum(r + 1 for r in range(size))
    ok = []
    for name in ("ring", "native"):
        if kind == "torch":
            x = torch.zeros(n, device=f"cuda:{DEV}")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # torch's stream, not cupy's: caller_streams
                torch.cuda._sleep(100_000_000)  # ~50 ms of spinning before the fill
                x.fill_(rank + 1)
                got = coll.allreduce(x, algorithm=name)
            check = got.cpu().numpy()
        else:
            x = cupy.zeros(n, dtype=cupy.float32)
            big = cupy.zeros(1 << 26, dtype=cupy.float32)
            side = cupy.cuda.Stream(non_blocking=True)
            cupy.cuda.get_current_stream().synchronize()
            with side:
                for _ in range(40):  # a few ms of queued kernels before the fill
                    big += 1
                x.fill(rank + 1)
                got = coll.allreduce(x, algorithm=name)
            check = cupy.asnumpy(got)  # on the null stream: complete on return
        ok.append(bool((check == want).all()))
    assert_all(all(ok), f"{kind}/{mode}: results per algorithm {ok}")


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_nonblocking_overlaps_caller_work(kind, monkeypatch):
    """iallreduce on device buffers while the caller keeps queuing kernels."""
    import collectives as coll
    from tests.mpiutil import assert_all, world
    need(kind)
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    xs = [data(r, 200_001, "float32") for r in range(size)]
    x = to_device(xs[rank], kind)
    reqs = [coll.iallreduce(x, algorithm=name) for name in ("ring", "native", "auto")]
    busy = cupy.ones(1 << 24, dtype=cupy.float32)
    for _ in range(10):
        busy *= 1.0
    outs = [r.wait() for r in reqs]
    want = reference(xs, "sum", "float32")
    assert_all(all(same(o, want, "float32") for o in outs), f"{kind}: iallreduce")


@pytest.mark.mpi
def test_ddp_on_cuda():
    """DDP on a CUDA model: gradients are the mean of every rank's local gradients."""
    from tests.mpiutil import assert_all, world
    if torch is None:
        pytest.skip("torch with CUDA is not available")
    ddp_mod = pytest.importorskip("collectives.torch")
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    dev = torch.device("cuda", DEV)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4)).to(dev)
    ref = copy.deepcopy(model)
    ddp = ddp_mod.DistributedDataParallel(model, bucket_cap_mb=0.004)  # several buckets

    def batch(r):
        g = torch.Generator().manual_seed(100 + r)
        return (torch.randn(8, 16, generator=g).to(dev), torch.randn(8, 4, generator=g).to(dev))

    ok = True
    for step in range(2):
        ddp.zero_grad(set_to_none=False)
        xb, yb = batch(rank + step * size)
        ((ddp(xb) - yb) ** 2).sum().backward()
        want = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(size):
            ref.zero_grad()
            xr, yr = batch(r + step * size)
            ((ref(xr) - yr) ** 2).sum().backward()
            for w, p in zip(want, ref.parameters()):
                w += p.grad / size
        for p, w in zip(model.parameters(), want):
            ok &= p.grad is not None and p.grad.device == dev and \
                bool(torch.allclose(p.grad, w, rtol=1e-4, atol=1e-5))
    assert_all(ok, "DDP gradients on CUDA differ from the mean of local gradients")


@pytest.mark.mpi
def test_awareness_is_reported():
    from tests.mpiutil import assert_all
    aware, how = cuda.awareness()
    print(f"\nCUDA-aware MPI: {aware} ({how})")
    assert_all(isinstance(aware, bool) and bool(how), "awareness")
