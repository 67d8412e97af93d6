"""Averages near the largest finite value, through every torch-side caller (MPI tier, n = 1..5).

Every rank holds float16 or bfloat16 values near the dtype's largest finite value, so a sum of
two ranks' values overflows while their mean is representable. Each torch-side average -- the
drop-in ``all_reduce(op="avg")``, the backend's ``dist.all_reduce(op=ReduceOp.AVG)`` and
``reduce_scatter_tensor(op=AVG)``, DDP's gradient buckets and ZeRO 1/2/3's gradient
all-reduce and reduce-scatter -- uses the core's ``op="avg"``: the result must be finite,
within the rounding of that arithmetic of the float64 mean, and the same bits on every rank.

The bound: the core divides each input by n (one rounding, at most u |x| / n with u = eps / 2)
and sums the n quotients (n - 1 roundings of partial sums no larger than max |x|), so the
error is at most n u max |x|; the tests allow eps n max |x|, twice that.
"""
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import collectives.torch as ct  # noqa: E402
from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from collectives.torch import ShardedDataParallel as SDP  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]
COUNT = 37   # elements per rank: not a multiple of any rank count, so shards are ragged


def _inputs(dtype, size, count=COUNT):
    """Every rank's values (rows: ranks), near the largest finite value, some negative,
    rank-dependent; every mean is representable (no larger than the largest input)."""
    big = torch.finfo(dtype).max
    i = torch.arange(count, dtype=torch.float64)
    rows = []
    for r in range(size):
        scale = 0.97 - 0.05 * ((r + i) % 4) / 4
        sign = torch.where((i + r) % 5 == 4, -1.0, 1.0) if size > 1 else torch.ones(count)
        rows.append((big * scale * sign).to(dtype))
    return torch.stack(rows)


def _check(got, want, every, comm, what, same=True):
    """``got``: finite and within the bound of ``want`` (the float64 mean of ``every``'s rows
    or a block of it); with ``same``, the same bits on every rank of ``comm``."""
    n = every.shape[0]
    bound = torch.finfo(got.dtype).eps * n * every.double().abs().max().item()
    finite = bool(torch.isfinite(got).all())
    err = (got.double() - want).abs().max().item()
    assert_all(finite and err <= bound,
               f"{what}: finite={finite}, largest error {err:.4g}, bound {bound:.4g}", comm)
    if same:
        raw = got.detach().contiguous().view(torch.uint8).numpy().tobytes()
        assert_all(len(set(comm.allgather(raw))) == 1, f"{what}: results differ across ranks",
                   comm)


def _mean(every):
    return every.double().mean(0)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("async_op", [False, True])
def test_drop_in_all_reduce_avg(dtype, async_op):
    comm = world()
    every = _inputs(dtype, comm.Get_size())
    t = every[comm.Get_rank()].clone()
    work = ct.all_reduce(t, op="avg", comm=comm, async_op=async_op)
    if async_op:
        work.wait()
    _check(t, _mean(every), every, comm, f"all_reduce avg {dtype}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_drop_in_reduce_scatter_avg(dtype):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    every = _inputs(dtype, n, COUNT * n)
    out = torch.empty(COUNT, dtype=dtype)
    ct.reduce_scatter_tensor(out, every[r].clone(), op="avg", comm=comm)
    _check(out, _mean(every)[r * COUNT:(r + 1) * COUNT], every, comm,
           f"reduce_scatter_tensor avg {dtype}", same=False)


@pytest.fixture
def group():
    import collectives.torch.backend as cb
    cb.init_process_group()
    yield
    dist.destroy_process_group()


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backend_avg(group, dtype):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    every = _inputs(dtype, n)
    t = every[r].clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    _check(t, _mean(every), every, comm, f"dist.all_reduce AVG {dtype}")
    every = _inputs(dtype, n, COUNT * n)
    out = torch.empty(COUNT, dtype=dtype)
    dist.reduce_scatter_tensor(out, every[r].clone(), op=dist.ReduceOp.AVG)
    _check(out, _mean(every)[r * COUNT:(r + 1) * COUNT], every, comm,
           f"dist.reduce_scatter_tensor AVG {dtype}", same=False)


class _Scale(nn.Module):
    """loss = sum(w * x): the gradient of ``w`` is ``x`` exactly, in any dtype."""

    def __init__(self, dtype, count=COUNT):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(count, dtype=dtype))

    def forward(self, x):
        return (self.w * x).sum()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("registered", [False, True], ids=["ordinary", "registered"])
def test_ddp_average_near_the_largest_value(dtype, registered):
    comm = world()
    every = _inputs(dtype, comm.Get_size())
    model = DDP(_Scale(dtype), comm=comm, registered_buckets=registered)
    for step in range(2):   # the second backward runs on the rebuilt buckets
        model.module.w.grad = None
        model(every[comm.Get_rank()]).backward()
        _check(model.module.w.grad, _mean(every), every, comm, f"DDP step {step} {dtype}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_step_near_the_largest_value(dtype, stage):
    """SGD at lr 1 from zero parameters: after one step the parameters are minus the average
    gradient, with no rounding of the step's own (0 - g is exact)."""
    comm = world()
    every = _inputs(dtype, comm.Get_size())
    model = SDP(_Scale(dtype), stage=stage, comm=comm)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(every[comm.Get_rank()]).backward()
    opt.step()
    w = model.full_state_dict()["w"]
    _check(-w, _mean(every), every, comm, f"ZeRO-{stage} {dtype}")
