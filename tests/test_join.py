"""DDP for real training loops: uneven inputs (``join``) and ``static_graph``.

``join``: ranks get different numbers of batches; after every step each rank's parameters equal
one process that averages the gradients of the ranks that still had data. ``static_graph``: two
checkpointed blocks (reentrant and not) and a weight used twice train to the parameters of one
process on the whole batch; without it, the error names the parameter and the flag.
"""
import contextlib

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

torch.set_num_threads(1)

IN, HIDDEN, OUT, SHARD = 7, 24, 3, 5


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN, HIDDEN)
        self.b = nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(SHARD, IN, generator=gen), torch.randn(SHARD, OUT, generator=gen)


def _close(net, ref):
    return all(torch.allclose(p, q, rtol=1e-5, atol=1e-6)
               for p, q in zip(net.parameters(), ref.parameters()))


def _join_run(counts, accumulate=1, divide_initial=False, **kw):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    ref = Small()
    torch.manual_seed(0 if r == 0 else 1 + r)  # DDP brings rank 0's
    net = Small()
    ddp = DDP(net, **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    bad = []
    with ddp.join(divide_by_initial_world_size=divide_initial):
        for step in range(counts[r]):
            opt.zero_grad()
            for k in range(accumulate):
                x, y = _batch(r, accumulate * step + k)
                ctx = contextlib.nullcontext() if k == accumulate - 1 else ddp.no_sync()
                with ctx:
                    nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            # One process: the ranks that had data at this step, each shard's loss averaged.
            opt_ref.zero_grad()
            live = [s for s in range(n) if counts[s] > step]
            total = 0
            for s in live:
                for k in range(accumulate):
                    x, y = _batch(s, accumulate * step + k)
                    total = total + nn.functional.mse_loss(ref(x), y)
            (total / (n if divide_initial else len(live))).backward()
            opt_ref.step()
            if not _close(net, ref):
                bad.append(step)
    assert_all(not bad, f"parameters differ from the reference after steps {bad[:5]}")
    return ddp


@pytest.mark.mpi
def test_join_one_rank_ten_percent_fewer_batches():
    n = world().Get_size()
    _join_run([10] * (n - 1) + [9])


@pytest.mark.mpi
def test_join_staggered_rank0_leaves_first_with_small_buckets():
    n = world().Get_size()
    # Rank 0 leaves first: the buffers come from the lowest rank still training.
    _join_run([4 + k for k in range(n)], bucket_cap_mb=1e-4)


@pytest.mark.mpi
def test_join_with_no_sync_and_unused_parameter_flags():
    n = world().Get_size()
    _join_run([5 - (k % 3) for k in range(n)], accumulate=2, find_unused_parameters=True)


@pytest.mark.mpi
def test_join_divide_by_initial_world_size():
    n = world().Get_size()
    _join_run([3] + [5] * (n - 1), divide_initial=True)


@pytest.mark.mpi
def test_join_rank_without_any_batch():
    n = world().Get_size()
    if n < 2:
        pytest.skip("needs 2 ranks: one without data, one with")
    _join_run([0] + [3] * (n - 1))


# -- static_graph ---------------------------------------------------------------------------------
class Tied(nn.Module):
    """``embed.weight`` is used at the input, inside checkpointed block 1, and at the output."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Linear(IN, HIDDEN, bias=False)
        self.block1 = nn.Sequential(nn.Linear(HIDDEN, IN), nn.Tanh())
        self.block2 = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.out = nn.Linear(IN, OUT)

    def _one(self, z):
        return nn.functional.linear(self.block1(z), self.embed.weight)  # tied: IN -> HIDDEN

    def forward(self, x):
        z = torch.tanh(self.embed(x))
        z = checkpoint(self._one, z, use_reentrant=self.reentrant)
        z = checkpoint(self.block2, z, use_reentrant=self.reentrant)
        return self.out(nn.functional.linear(z, self.embed.weight.t()))  # tied: HIDDEN -> IN


@pytest.mark.mpi
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("cap", [25, 1e-4])
def test_static_graph_checkpointing_and_tied_weights_match_one_process(reentrant, cap):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    ref = Tied(reentrant)
    torch.manual_seed(0 if r == 0 else 5 + r)
    ddp = DDP(Tied(reentrant), static_graph=True, bucket_cap_mb=cap)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    bad = []
    for step in range(4):
        opt.zero_grad()
        opt_ref.zero_grad()
        x, y = _batch(r, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        total = sum(nn.functional.mse_loss(ref(_batch(s, step)[0]), _batch(s, step)[1])
                    for s in range(n))
        (total / n).backward()
        opt.step()
        opt_ref.step()
        if not _close(ddp.module, ref):
            bad.append(step)
    assert_all(not bad, f"parameters differ from one process after steps {bad}")


def test_without_static_graph_the_error_names_the_parameter_and_the_flag():
    ddp = DDP(Tied(True), comm=_self_comm())
    x, y = _batch(0, 0)
    with pytest.raises(RuntimeError, match=r"'embed.weight'.*static_graph=True"):
        nn.functional.mse_loss(ddp(x), y).backward()


def test_static_graph_refuses_a_changed_graph():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(IN, IN)

        def forward(self, x, times):
            for _ in range(times):
                x = checkpoint(self.lin, x, use_reentrant=True)
            return x

    ddp = DDP(Twice(), comm=_self_comm(), static_graph=True)
    x = torch.randn(2, IN, requires_grad=True)
    ddp(x, 1).sum().backward()
    with pytest.raises(RuntimeError, match=r"'lin.(weight|bias)' got a gradient 2 times.*1 in the"):
        ddp(x, 2).sum().backward()


def test_join_at_one_rank_is_plain_training():
    ddp = DDP(Small(), comm=_self_comm())
    with ddp.join():
        x, y = _batch(0, 0)
        nn.functional.mse_loss(ddp(x), y).backward()
    assert all(p.grad is not None for p in ddp.parameters())


def _self_comm():
    from mpi4py import MPI
    return MPI.COMM_SELF
