"""What DDP's reducer and ZeRO share, in one process: the launch order of ``backward.Launcher``,
the ``FlatBuffer`` layout, the reducer built by a DDP at one rank, and no algorithm named in
the torch layer (the one-pass choice is the core's dispatch's alone).
"""
import ast
import itertools
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import collectives as coll  # noqa: E402
from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from collectives.torch.backward import Launcher  # noqa: E402
from collectives.torch.flat import FlatBuffer  # noqa: E402
from collectives.torch.hooks import (DefaultState, PowerSGDState, allreduce_hook,  # noqa: E402
                                     powerSGD_hook)


# -- launch order -------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [(1,), (2, 1, 3), (1, 1, 1, 1), (3, 2)])
def test_groups_launch_in_order_whatever_order_members_are_ready(sizes):
    members = [k for k, n in enumerate(sizes) for _ in range(n)]
    for order in itertools.islice(itertools.permutations(members), 200):
        launcher = Launcher(sizes)
        launched, done = [], [0] * len(sizes)
        for k in order:
            done[k] += 1
            now = list(launcher.ready(k))
            launched += now
            # a group starts only when it and every group before it are complete
            for j in now:
                assert all(done[i] == sizes[i] for i in range(j + 1)), (order, now)
            assert launcher.complete(k) == (done[k] == sizes[k])
        assert launched == list(range(len(sizes))), order
        assert list(launcher.rest()) == []


def test_the_end_launches_the_rest_and_drains_in_launch_order():
    launcher = Launcher((2, 1, 1))
    assert list(launcher.ready(1)) == []          # group 0 is not complete: nothing starts
    assert list(launcher.rest()) == [0, 1, 2]
    for k in (0, 1, 2):
        launcher.started(k, f"work {k}")
    seen = []
    launcher.drain(lambda k, w: seen.append((k, w)), keep=1)
    assert seen == [(0, "work 0"), (1, "work 1")]
    launcher.drain(lambda k, w: seen.append((k, w)))
    assert seen[-1] == (2, "work 2") and launcher.inflight == []
    launcher.reset()
    assert launcher.pending == [2, 1, 1] and launcher.next == 0


# -- the flat layout ----------------------------------------------------------------------------
def test_a_flat_buffer_lays_tensors_end_to_end_with_padding():
    tensors = [torch.arange(6.).view(2, 3), torch.arange(4.) + 10, torch.tensor([7.])]
    fb = FlatBuffer.of(tensors, pad_to=4)
    assert fb.numel == 11 and fb.padded == 12 and fb.offsets == [0, 6, 10]
    assert fb.flat.shape == (12,) and fb.span(1) == (6, 10)
    fb.copy_in(tensors)
    assert torch.equal(fb.flat, torch.tensor([0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 7, 0.]))
    assert all(v.shape == t.shape for v, t in zip(fb.views, tensors))
    fb.flat.mul_(2)
    out = [torch.empty_like(t) for t in tensors]
    fb.copy_out(out)
    assert all(torch.equal(o, 2 * t) for o, t in zip(out, tensors))
    params = [nn.Parameter(t.clone()) for t in tensors]
    fb.alias(params)
    assert all(p.data_ptr() == v.data_ptr() for p, v in zip(params, fb.views))
    fb.release()
    assert fb.flat is None and fb.views == []
    with pytest.raises(TypeError, match="one dtype and device"):
        FlatBuffer.of([torch.zeros(2), torch.zeros(2, dtype=torch.float16)])
    with pytest.raises(ValueError, match="12 elements"):
        fb.bind(torch.zeros(11))


# -- the reducer at one rank ----------------------------------------------------------------------
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
    assert r.hook is allreduce_hook and type(r.state) is DefaultState
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting)
    x = torch.randn(3, 4)
    ddp(x).sum().backward()
    assert calls == list(range(len(r.buckets)))
    assert all(p.grad is not None for p in ddp.parameters())
    ddp.register_comm_hook(PowerSGDState(_self_comm(), matrix_approximation_rank=1), powerSGD_hook)
    assert r.hook is powerSGD_hook


def test_the_gradients_are_the_buckets_views():
    ddp = DDP(_Net(), comm=_self_comm(), bucket_cap_mb=1e-4)
    ddp(torch.randn(3, 4)).sum().backward()
    for b in ddp.reducer.buckets:
        assert isinstance(b, FlatBuffer)
        for i, view in zip(b.members, b.views):
            assert ddp.reducer.params[i].grad.data_ptr() == view.data_ptr()


# -- no algorithm named in the torch layer --------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent / "collectives" / "torch"
SHARED = ["ddp.py", "reducer.py", "join.py", "sharded.py", "agreement.py", "backward.py",
          "buckets.py", "flat.py", "hooks.py", "averaging.py"]


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


def test_the_torch_layer_never_names_the_one_pass_path():
    hits = [f"{p.relative_to(ROOT)}:{k}" for p in sorted(ROOT.rglob("*.py"))
            for k, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r'"onepass"|ONE_PASS', line)]
    assert not hits, f"the one-pass path is dispatch's choice, named here: {hits}"
