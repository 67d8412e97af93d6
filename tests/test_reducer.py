"""DDP's reducer in one process: ``choose_hook``, the one function that decides which hook
reduces a backward's buckets, against every combination of its inputs; the reducer built by a
DDP at one rank; and no algorithm name tested in DDP's modules.
"""
import ast
import itertools
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import collectives as coll  # noqa: E402
from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from collectives.torch.hooks import (DefaultState, PowerSGDState, allreduce_hook,  # noqa: E402
                                     fp16_compress_hook, powerSGD_hook)
from collectives.torch.reducer import (HookChoice, choose_hook, onepass_avg_hook,  # noqa: E402
                                       onepass_sum_hook, sum_hook)

FLAGS = ("ddp_average", "one_pass", "averages", "everyone", "joined", "overlap")


def _user_hook(state, bucket):
    raise AssertionError("never called here")


def _expected(hook, ddp_average, one_pass, averages, everyone, joined, overlap):
    """The rules, spelled out case by case."""
    if not ddp_average:                      # the registered hook averages by itself
        return hook, False
    if joined:                               # zeros: the training ranks' sum, no division
        return sum_hook, False
    if one_pass and everyone and averages and not overlap:
        return onepass_avg_hook, False       # the one-pass allreduce averages in cache
    if one_pass and everyone:
        return onepass_sum_hook, True
    return sum_hook, True                    # join() without every rank, or no route


@pytest.mark.parametrize("values", list(itertools.product([False, True], repeat=len(FLAGS))))
def test_every_combination(values):
    kw = dict(zip(FLAGS, values))
    got = choose_hook(_user_hook, **kw)
    assert isinstance(got, HookChoice)
    assert (got.hook, got.divide) == _expected(_user_hook, *values), kw


def test_the_named_cases():
    # DDP's own average on the one-pass route, every rank training: one pass, no division
    assert choose_hook(allreduce_hook, ddp_average=True, one_pass=True, averages=True) == \
        HookChoice(onepass_avg_hook, False)
    # float16 buckets on the route: DDP divides, the one-pass sums
    assert choose_hook(allreduce_hook, ddp_average=True, one_pass=True, averages=False) == \
        HookChoice(onepass_sum_hook, True)
    # join(): a rank stands in, so the route (which needs every rank's bucket) is left
    for joined in (False, True):
        got = choose_hook(allreduce_hook, ddp_average=True, one_pass=True, averages=True,
                          everyone=False, joined=joined)
        assert got.hook is sum_hook and got.divide is not joined
    # a user's hook is called as registered, whatever the route
    for hook in (fp16_compress_hook, powerSGD_hook, _user_hook):
        assert choose_hook(hook, ddp_average=False, one_pass=True, averages=True,
                           joined=True) == HookChoice(hook, False)


def test_a_choice_is_pure():
    kw = dict(ddp_average=True, one_pass=False, averages=True, everyone=True)
    assert choose_hook(allreduce_hook, **kw) == choose_hook(allreduce_hook, **kw)


class _Net(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = nn.Linear(4, 6).to(dtype)
        self.b = nn.Linear(6, 2).to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _self_comm():
    from mpi4py import MPI
    return MPI.COMM_SELF


def test_the_reducer_of_one_rank_runs_the_hook_as_registered():
    ddp = DDP(_Net(), comm=_self_comm())
    r = ddp.reducer
    assert not r.ddp_average and not r.one_pass      # one rank: nothing to divide
    assert r.choice == HookChoice(allreduce_hook, False)
    ddp.register_comm_hook(PowerSGDState(_self_comm(), matrix_approximation_rank=1), powerSGD_hook)
    assert r.choice == HookChoice(powerSGD_hook, False)
    ddp.register_comm_hook(None, allreduce_hook)
    assert type(ddp.comm_state) is DefaultState and r.choice.hook is allreduce_hook
    x = torch.randn(3, 4)
    ddp(x).sum().backward()
    assert all(p.grad is not None for p in ddp.parameters())


def test_the_route_is_fixed_by_the_parameters():
    assert DDP(_Net(), comm=_self_comm()).reducer.averages
    assert not DDP(_Net(torch.float16), comm=_self_comm()).reducer.averages


# -- no algorithm name tested in shared code ------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent / "collectives" / "torch"
SHARED = ["ddp.py", "reducer.py", "join.py", "sharded.py", "overlap.py", "agreement.py"]


@pytest.mark.parametrize("name", SHARED)
def test_no_algorithm_name_is_compared(name):
    names = set(coll.algorithms("allreduce")) | {"onepass"}
    bad = []
    for node in ast.walk(ast.parse((ROOT / name).read_text())):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Constant) and side.value in names:
                    bad.append(f"line {node.lineno}: {side.value!r}")
    assert not bad, f"{name} tests an algorithm's name: {bad}"
