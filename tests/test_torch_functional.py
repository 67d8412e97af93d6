"""collectives.torch's drop-in collectives, and the torch.distributed "collectives" backend.

Exact rank-dependent integer data: rank r holds (r + 1) * 3 + i % 5, so every result
has a closed form, for every dtype including float16 and bfloat16.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import collectives.torch as ct  # noqa: E402
from collectives.torch.functional import op_name  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16]


def _data(rank, n, dtype=torch.float32):
    return ((rank + 1) * 3 + torch.arange(n) % 5).to(dtype)


def _sum(size, n):
    return sum(_data(r, n, torch.float64) for r in range(size))


# -- in-process -----------------------------------------------------------------------------------
def test_op_names():
    assert op_name("max") == "max"
    assert op_name(dist.ReduceOp.SUM) == "sum"
    assert op_name(dist.ReduceOp(dist.ReduceOp.AVG)) == "avg"
    assert op_name(dist.ReduceOp.PRODUCT) == "prod"
    with pytest.raises(ValueError, match="PREMUL_SUM is not supported"):
        op_name(dist.ReduceOp.PREMUL_SUM)


def test_boundary_errors():
    t = torch.zeros(4)
    with pytest.raises(TypeError, match="expected a torch.Tensor, got ndarray"):
        ct.all_reduce(np.zeros(3))
    with pytest.raises(ValueError, match=r"output_tensor has 5 elements, expected 1 ranks x 4"):
        ct.all_gather_into_tensor(torch.zeros(5), t)
    with pytest.raises(ValueError, match=r"input_tensor has 4 elements, expected 1 ranks x 3"):
        ct.reduce_scatter_tensor(torch.zeros(3), t)
    with pytest.raises(TypeError, match="output_tensor is torch.float64"):
        ct.reduce_scatter_tensor(torch.zeros(4, dtype=torch.float64), t)
    with pytest.raises(ValueError, match="not C-contiguous"):
        ct.all_reduce(torch.zeros(4, 4).t())


def test_wait_future_without_work_fails_instead_of_hanging():
    with pytest.raises(RuntimeError, match="cannot complete"):
        ct.wait_future(torch.futures.Future())


# -- MPI -------------------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_all_reduce_in_place(dtype, n):
    comm = world()
    size, rank = comm.Get_size(), comm.Get_rank()
    t = _data(rank, n, dtype)
    ptr = t.data_ptr()
    assert ct.all_reduce(t) is None
    ok = t.data_ptr() == ptr and t.dtype == dtype and \
        torch.equal(t.double(), _sum(size, n))
    assert_all(ok, f"{dtype} n={n}: {t[:6]}")


@pytest.mark.mpi
@pytest.mark.parametrize("op, expect", [
    ("max", lambda s, n: _data(s - 1, n, torch.float64)),
    (dist.ReduceOp.MIN, lambda s, n: _data(0, n, torch.float64)),
    (dist.ReduceOp.AVG, lambda s, n: _sum(s, n) / s),
    (dist.ReduceOp(dist.ReduceOp.PRODUCT),
     lambda s, n: torch.stack([_data(r, n, torch.float64) for r in range(s)]).prod(0)),
])
def test_all_reduce_ops(op, expect):
    comm = world()
    t = _data(comm.Get_rank(), 11, torch.float64)
    ct.all_reduce(t, op=op)
    assert_all(torch.allclose(t, expect(comm.Get_size(), 11), rtol=1e-12), f"{op}: {t}")


@pytest.mark.mpi
def test_async_works_complete_in_any_wait_order_and_futures_chain():
    comm = world()
    size, rank = comm.Get_size(), comm.Get_rank()
    ts = [_data(rank, 50 + k) for k in range(4)]
    works = [ct.all_reduce(t, async_op=True) for t in ts]
    chained = works[1].get_future().then(lambda f: f.value()[0].sum().item())
    for w in reversed(works):
        assert w.wait() is True
    ok = all(w.is_completed() for w in works)
    ok &= all(torch.equal(t.double(), _sum(size, 50 + k)) for k, t in enumerate(ts))
    ok &= chained.wait() == float(_sum(size, 51).sum())
    ok &= works[2].result()[0] is ts[2]
    late = works[3].get_future()  # asked for after completion: already done
    ok &= late.done() and late.value()[0] is ts[3]
    assert_all(ok, "async all_reduce")


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
def test_broadcast(async_op):
    comm = world()
    size, rank = comm.Get_size(), comm.Get_rank()
    src = 1 % size
    t = _data(rank, 9, torch.bfloat16)
    w = ct.broadcast(t, src=src, async_op=async_op)
    if async_op:
        w.wait()
    assert_all(torch.equal(t, _data(src, 9, torch.bfloat16)), f"{t}")


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_into_tensor(async_op):
    comm = world()
    size, rank = comm.Get_size(), comm.Get_rank()
    inp = _data(rank, 6).view(2, 3)
    flat = torch.empty(size * 6)
    stacked = torch.empty(size, 2, 3)
    works = [ct.all_gather_into_tensor(out, inp, async_op=async_op) for out in (flat, stacked)]
    if async_op:
        for w in works:
            w.wait()
    expect = torch.stack([_data(r, 6).view(2, 3) for r in range(size)])
    assert_all(torch.equal(stacked, expect) and torch.equal(flat, expect.reshape(-1)),
               f"{stacked}")


@pytest.mark.mpi
@pytest.mark.parametrize("block", [0, 1, 5])
def test_reduce_scatter_tensor(block):
    comm = world()
    size, rank = comm.Get_size(), comm.Get_rank()
    inp = _data(rank, size * block, torch.int64)
    out = torch.empty(block, dtype=torch.int64)
    ct.reduce_scatter_tensor(out, inp)
    expect = _sum(size, size * block)[rank * block:(rank + 1) * block].long()
    assert_all(torch.equal(out, expect), f"block {block}: {out} != {expect}")
    w = ct.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.MAX, async_op=True)
    w.wait()
    expect = _data(size - 1, size * block, torch.int64)[rank * block:(rank + 1) * block]
    assert_all(torch.equal(out, expect), f"max block {block}: {out}")


@pytest.fixture
def process_group():
    import collectives.torch.backend as backend
    backend.init_process_group()
    yield
    dist.destroy_process_group()


@pytest.mark.mpi
def test_backend_collectives(process_group):
    """torch.distributed's own functions, run by the "collectives" backend."""
    size, rank = dist.get_world_size(), dist.get_rank()
    msgs = []
    t = _data(rank, 13)
    dist.all_reduce(t)
    if not torch.equal(t.double(), _sum(size, 13)):
        msgs.append(f"all_reduce {t}")
    t = _data(rank, 5, torch.float64)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    if not torch.equal(t, _data(size - 1, 5, torch.float64)):
        msgs.append(f"all_reduce max {t}")
    t = _data(rank, 4)
    dist.broadcast(t, src=size - 1)
    if not torch.equal(t, _data(size - 1, 4)):
        msgs.append(f"broadcast {t}")
    outs = [torch.empty(3) for _ in range(size)]
    dist.all_gather(outs, _data(rank, 3))
    if not all(torch.equal(o, _data(r, 3)) for r, o in enumerate(outs)):
        msgs.append(f"all_gather {outs}")
    out = torch.empty(size * 3)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, _data(rank, 3))
    if not torch.equal(out, torch.cat([_data(r, 3) for r in range(size)])):
        msgs.append(f"all_gather_into_tensor {out}")
    out = torch.empty(2)
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, _data(rank, 2 * size))
    if not torch.equal(out.double(), _sum(size, 2 * size)[2 * rank:2 * rank + 2]):
        msgs.append(f"reduce_scatter_tensor {out}")
    out = torch.empty(2)
    dist.reduce_scatter(out, list(_data(rank, 2 * size).chunk(size)))
    if not torch.equal(out.double(), _sum(size, 2 * size)[2 * rank:2 * rank + 2]):
        msgs.append(f"reduce_scatter {out}")
    t = _data(rank, 6)
    dist.reduce(t, dst=0)
    if rank == 0 and not torch.equal(t.double(), _sum(size, 6)):
        msgs.append(f"reduce {t}")
    dist.barrier()
    if size > 1:
        right, left = (rank + 1) % size, (rank - 1) % size
        got = torch.empty(4)
        reqs = [dist.isend(_data(rank, 4), right), dist.irecv(got, left)]
        for r in reqs:
            r.wait()
        if not torch.equal(got, _data(left, 4)):
            msgs.append(f"send/recv {got}")
    assert_all(not msgs, "; ".join(msgs))


@pytest.mark.mpi
def test_backend_subgroup(process_group):
    size, rank = dist.get_world_size(), dist.get_rank()
    members = list(range(0, size, 2))  # the even ranks
    group = dist.new_group(members)
    if rank in members:
        t = _data(rank, 5)
        dist.all_reduce(t, group=group)
        expect = sum(_data(r, 5, torch.float64) for r in members)
        ok = torch.equal(t.double(), expect)
    else:
        ok = True
    assert_all(ok, "subgroup all_reduce")


@pytest.mark.mpi
def test_destroyed_group_ends_its_thread():
    """Each group completes its work on a thread of its own; destroying the group ends it (a
    job that creates and destroys groups must not collect threads)."""
    import gc
    import threading
    import time

    from mpi4py import MPI

    import collectives.torch.backend as backend
    from tests.mpiutil import assert_all

    def completers():
        return sum(t.name == "collectives-torch-completer" for t in threading.enumerate())

    gc.collect()  # an earlier test's group may still be waiting for collection
    before = completers()
    for _ in range(3):
        backend.init_process_group()
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.destroy_process_group()
    gc.collect()
    deadline = time.monotonic() + 5
    while completers() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_all(completers() <= before and bool((t == MPI.COMM_WORLD.Get_size()).all()),
               f"{completers()} completer threads, {before} before; {t}")
