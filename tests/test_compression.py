"""Compression hooks with error feedback: closed-form averages, exact bytes, conservation.

In-process (one rank): error feedback loses nothing (the sum of what was sent plus the residual
equals the sum of the inputs), bad settings. MPI tier (n = 1..5): each hook's average of
rank-dependent data with a closed form, the exact bytes per call, and DDP training with every
hook under ``join`` with uneven inputs (no hang, the same parameters on every rank).
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from collectives.torch.buckets import GradBucket  # noqa: E402
from collectives.torch.compression import (  # noqa: E402
    CHUNK,
    QSGDState,
    SignState,
    TopKState,
    qsgd_hook,
    sign_hook,
    topk_hook,
)
from mpiutil import assert_all, world  # noqa: E402

torch.set_num_threads(1)

HOOKS = {"topk": (TopKState, topk_hook, {"ratio": 0.1}), "sign": (SignState, sign_hook, {}),
         "qsgd": (QSGDState, qsgd_hook, {"bits": 4})}


def _self():
    from mpi4py import MPI
    return MPI.COMM_SELF


def _bucket(flat, shapes, index=0):
    params = [torch.empty(s) for s in shapes]
    return GradBucket(index, flat, params, True)


def _call(hook, state, flat, shapes):
    from collectives.torch import wait_future
    return wait_future(hook(state, _bucket(flat, shapes)))


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_error_feedback_loses_nothing(name):
    cls, hook, kw = HOOKS[name]
    state = cls(_self(), **kw)
    shapes = [(13,), (4, 5), (1,)]
    gen = torch.Generator().manual_seed(3)
    total_in = torch.zeros(34, dtype=torch.float64)
    total_out = torch.zeros(34, dtype=torch.float64)
    for _ in range(6):
        g = torch.randn(34, generator=gen, dtype=torch.float64)
        total_in += g
        total_out += _call(hook, state, g.clone(), shapes)
    torch.testing.assert_close(total_out + state.residuals[0], total_in, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_without_error_feedback_no_residual_is_kept(name):
    cls, hook, kw = HOOKS[name]
    state = cls(_self(), error_feedback=False, **kw)
    _call(hook, state, torch.randn(10), [(10,)])
    assert state.residuals == {}


def test_bad_settings():
    with pytest.raises(ValueError, match="ratio must be in"):
        TopKState(_self(), ratio=0)
    with pytest.raises(ValueError, match="bits must be an integer from 1 to 7"):
        QSGDState(_self(), bits=8)


def test_momentum_is_applied_before_compressing():
    # Lossless top-k (ratio 1): the output is this rank's momentum m = 0.5 m + g.
    state = TopKState(_self(), ratio=1.0, momentum=0.5)
    g = torch.tensor([1.0, -2.0, 4.0])
    outs = [_call(topk_hook, state, g.clone(), [(3,)]).clone() for _ in range(3)]
    for out, factor in zip(outs, (1.0, 1.5, 1.75)):
        torch.testing.assert_close(out, factor * g)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        SignState(_self(), momentum=1.0)


def test_sign_scale_never_spans_two_parameters():
    # A bias of large gradients beside a weight of small ones: each keeps its own scale.
    g = torch.cat([torch.tensor([8.0, -8.0, 8.0]), torch.full((40,), 0.01)])
    out = _call(sign_hook, SignState(_self(), error_feedback=False), g.clone(), [(3,), (40,)])
    torch.testing.assert_close(out, g)


def test_empty_bucket_is_returned_untouched():
    for cls, hook, kw in HOOKS.values():
        state = cls(_self(), **kw)
        assert _call(hook, state, torch.zeros(0), [(0,)]).numel() == 0
        assert state.wire_bytes == 0


# -- MPI: closed forms and bytes ------------------------------------------------------------------
def _pattern(m):
    return torch.tensor([1.0 if (i * 7) % 3 else -1.0 for i in range(m)])


@pytest.mark.mpi
@pytest.mark.parametrize("m", [1, 2, 7, 31])
def test_sign_average_closed_form_and_bytes(m):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    s = _pattern(m)
    state = SignState(comm)
    out = _call(sign_hook, state, (r + 1) * s.clone(), [(m,)])
    want = (n + 1) / 2 * s  # mean over ranks of (r + 1), times the common signs
    ok = torch.allclose(out, want, rtol=1e-6, atol=0)
    assert_all(ok, f"sign average {out[:4].tolist()} != {want[:4].tolist()}")
    assert_all(state.wire_bytes == 8 + math.ceil(math.ceil(m / 8) / 8) * 8,
               f"{state.wire_bytes} bytes")


@pytest.mark.mpi
@pytest.mark.parametrize("m", [1, 5, 100, 997])
def test_topk_average_closed_form_and_bytes(m):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    # Rank r's largest entries sit at its own positions: the average has each of them / n.
    g = torch.full((m,), 1e-3) * (torch.arange(m) % 3)
    k = max(1, math.ceil(0.05 * m))
    mine = (torch.arange(k) * n + r) % m
    g[mine] = 10.0 + r
    state = TopKState(comm, ratio=0.05, error_feedback=False)
    out = _call(topk_hook, state, g.clone(), [(m,)])
    want = torch.zeros(m, dtype=torch.float64)
    for q in range(n):
        want[(torch.arange(k) * n + q) % m] += 10.0 + q
    ok = torch.allclose(out.double(), want / n, rtol=1e-6, atol=0)
    assert_all(ok, f"top-k average {out[:6].tolist()} != {(want / n)[:6].tolist()}")
    assert_all(state.wire_bytes == math.ceil(4 * k / 8) * 8 * 2, f"{state.wire_bytes} bytes")


@pytest.mark.mpi
@pytest.mark.parametrize("bits", [1, 4, 7])
def test_qsgd_one_entry_per_chunk_is_exact(bits):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    # One non-zero per chunk: |g| / norm = 1, so the level is exactly the top one.
    m = CHUNK + 88
    g = torch.zeros(m)
    g[2] = -(r + 1.0)
    g[CHUNK + 38] = 2.0 * (r + 1)
    state = QSGDState(comm, bits=bits)
    out = _call(qsgd_hook, state, g.clone(), [(4,), (m - 4,)])
    want = torch.zeros(m)
    want[2] = -(n + 1) / 2
    want[CHUNK + 38] = float(n + 1)
    assert_all(torch.allclose(out, want, rtol=1e-6, atol=0), f"{out[[2, CHUNK + 38]].tolist()}")
    # 3 norms (chunks never span two parameters: 4 | 512 | 84), padded to 8 bytes
    assert_all(state.wire_bytes == 16 + m, f"{state.wire_bytes} bytes")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(HOOKS))
def test_ddp_trains_with_each_hook_under_join(name):
    comm = world()
    r = comm.Get_rank()
    cls, hook, kw = HOOKS[name]
    torch.manual_seed(0)
    ddp = DDP(_Net(), comm_hook=(cls(comm, **kw), hook), bucket_cap_mb=1e-3)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(r)
    snaps = []
    with ddp.join():
        for _ in range(6 - r % 3):
            x = torch.randn(8, 6, generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), (x[:, 0] > 0).long()).backward()
            opt.step()
            snaps.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).numpy())
    # After each step, the ranks that still trained hold the same parameters.
    every = comm.allgather(snaps)
    bad = [t for t in range(6) if len({e[t].tobytes() for e in every if len(e) > t}) > 1]
    bad += [t for t in range(len(snaps)) if not np.isfinite(snaps[t]).all()]
    assert_all(not bad, f"parameters differ across training ranks after steps {bad}")
