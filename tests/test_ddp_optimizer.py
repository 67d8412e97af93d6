"""DistributedDataParallel.optimizer_in_backward: the optimizer stepped bucket by bucket inside
backward gives the parameters of stepping it after backward, bit for bit.

In-process tests (one rank) compare with the same model stepped after backward, and check
the refusals; MPI tests (``mpiexec -n 1..5``) compare with one process on the whole batch and
check the parameters are bitwise identical on every rank, with unused parameters, accumulation
and gradients that are not bucket views.
"""
import contextlib

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

torch.set_num_threads(1)

IN, HIDDEN, OUT, SHARD = 6, 40, 3, 4


class Net(nn.Module):
    def __init__(self, dead=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                                  nn.Tanh())
        self.head = nn.Linear(HIDDEN, OUT)
        self.dead = nn.Linear(HIDDEN, OUT) if dead else None

    def forward(self, x):
        return self.head(self.body(x))


def _net(seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


def _adam(model):
    """Two param groups with their own hyperparameters: the head's, and the rest."""
    head = [p for n, p in model.named_parameters() if n.startswith("head")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head")]
    return torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 3e-3}], lr=1e-2,
                             weight_decay=0.1)


# -- in-process -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [1e-4, 25])
def test_same_parameters_as_stepping_after_backward(cap):
    a, b = DDP(_net(), bucket_cap_mb=cap), DDP(_net(), bucket_cap_mb=cap)
    opt_a, opt_b = _adam(a.module), _adam(b.module)
    b.optimizer_in_backward(opt_b)
    groups = [list(g["params"]) for g in opt_b.param_groups]
    for step in range(4):
        x = torch.randn(5, IN, generator=torch.Generator().manual_seed(step))
        opt_a.zero_grad()
        opt_b.zero_grad()
        a(x).pow(2).mean().backward()
        opt_a.step()
        b(x).pow(2).mean().backward()
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    assert len(b.bucket_layout()) == (5 if cap < 1 else 1), b.bucket_layout()
    # Each group holds all its parameters again, and the state is per parameter as usual.
    assert [list(g["params"]) for g in opt_b.param_groups] == groups
    assert all(opt_b.state[p]["step"] == 4 for g in groups for p in g)


def test_no_sync_steps_nothing_and_none_stops():
    ddp = DDP(_net(), bucket_cap_mb=1e-3)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp.optimizer_in_backward(opt)
    before = [p.detach().clone() for p in ddp.parameters()]
    with ddp.no_sync():
        ddp(torch.randn(3, IN)).sum().backward()
    assert all(torch.equal(p, q) for p, q in zip(ddp.parameters(), before))
    ddp(torch.randn(3, IN)).sum().backward()   # the accumulated gradient, stepped
    assert not any(torch.equal(p, q) for p, q in zip(ddp.parameters(), before))
    ddp.optimizer_in_backward(None)
    after = [p.detach().clone() for p in ddp.parameters()]
    ddp(torch.randn(3, IN)).sum().backward()
    assert all(torch.equal(p, q) for p, q in zip(ddp.parameters(), after))


def test_refuses_an_optimizer_of_other_parameters():
    ddp = DDP(_net())
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="2 of the optimizer's parameters are not parameters"):
        ddp.optimizer_in_backward(torch.optim.SGD([*ddp.parameters(), *other.parameters()],
                                                  lr=0.1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp.optimizer_in_backward(opt)
    opt.add_param_group({"params": other.parameters()})
    with pytest.raises(RuntimeError, match="not one of this DistributedDataParallel's"):
        ddp(torch.randn(3, IN)).sum().backward()


# -- MPI: equivalence with one process on the whole batch -----------------------------------------
def _run(steps=3, accumulate=1, dead=False, **kw):
    """DDP with the optimizer in backward against one process stepping after backward; the
    parameters close to the reference and bitwise equal across ranks (agreed, then asserted)."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    ref = _net(0, dead=dead)
    ddp = DDP(_net(0 if r == 0 else 50 + r, dead=dead), **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    ddp.optimizer_in_backward(opt)
    msgs = []
    for step in range(steps):
        opt.zero_grad()
        opt_ref.zero_grad()
        gen = torch.Generator().manual_seed(step)
        for k in range(accumulate):
            X = torch.randn(n * SHARD, IN, generator=gen)
            Y = torch.randn(n * SHARD, OUT, generator=gen)
            mine = slice(r * SHARD, (r + 1) * SHARD)
            with contextlib.nullcontext() if k == accumulate - 1 else ddp.no_sync():
                nn.functional.mse_loss(ddp(X[mine]), Y[mine]).backward()
            total = sum(nn.functional.mse_loss(ref(X[s * SHARD:(s + 1) * SHARD]),
                                               Y[s * SHARD:(s + 1) * SHARD]) for s in range(n))
            (total / n).backward()
        opt_ref.step()
        for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters()):
            try:
                torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)
            except AssertionError as exc:
                msgs.append(f"step {step} {name}: {str(exc).splitlines()[:3]}")
    mine = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).numpy()
    root = comm.bcast(mine, root=0)
    if root.tobytes() != mine.tobytes():
        msgs.append("parameters differ bitwise from rank 0's")
    assert_all(not msgs, str(msgs[:3]))
    return ddp, ref


@pytest.mark.mpi
def test_matches_one_process():
    _run(bucket_cap_mb=1e-3)
    _run()


@pytest.mark.mpi
def test_accumulation_matches_one_process():
    _run(accumulate=3, bucket_cap_mb=2e-3)


@pytest.mark.mpi
def test_unused_parameters_are_not_stepped():
    ddp, ref = _run(dead=True, find_unused_parameters=True, bucket_cap_mb=2e-3)
    dead, dead_ref = ddp.module.dead, ref.dead
    ok = dead.weight.grad is None and torch.equal(dead.weight, dead_ref.weight) and \
        torch.equal(dead.bias, dead_ref.bias)
    assert_all(ok, "a parameter unused on every rank keeps grad None and is not stepped")


@pytest.mark.mpi
def test_without_bucket_views_matches_one_process():
    _run(gradient_as_bucket_view=False, bucket_cap_mb=2e-3)
