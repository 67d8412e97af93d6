"""ShardedDataParallel (ZeRO 1-3): N ranks on shards train exactly like one process.

MPI tests train with SGD (plain, and with momentum) and compare the full parameters after every
step with one process that sees the whole batch, within float32's rounding of the gradients
(``rounding.sgd_parameters``: SGD's step is linear in the gradients; AdamW's lr-sized steps
bound nothing below 2 lr a step, and its flat shards and the reference's separate tensors may
take different CPU kernels), and check they are bitwise identical on every rank, for stages
1-3, unused parameters and ``no_sync`` accumulation; then memory per parameter against ZeRO's
formulas, AdamW checkpoints that load exactly at another rank count, and bad input.
"""
import contextlib
import gc
import re
import weakref

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from collectives.torch import ShardedDataParallel as SDP  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

import rounding  # noqa: E402

torch.set_num_threads(1)

IN, HIDDEN, OUT, SHARD = 12, 37, 5, 4   # 37: parameters straddle shards at every N


class Net(nn.Module):
    """The head is registered first but used last; ``extra`` is used only when asked."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.head = nn.Linear(hidden, OUT)
        self.body = nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                  nn.Tanh())
        self.extra = nn.Linear(hidden, OUT)

    def forward(self, x, extra=False):
        z = self.body(x)
        y = self.head(z)
        return y + self.extra(z) if extra else y


def _net(seed, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


# (lr, momentum) of torch.optim.SGD, the kinds compared with one process within
# rounding.sgd_parameters; "adamw" trains only where the comparisons are exact.
SGD = {"sgd": (0.1, 0.0), "momentum": (0.05, 0.9)}


def _opt(kind, params):
    if kind in SGD:
        lr, momentum = SGD[kind]
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _terms(n, rows, accumulate=1):
    """The float32 reductions a gradient of Net runs through, for ``n`` ranks' losses of
    ``rows`` rows each, ``accumulate`` times: the layers' sums over IN + 1, HIDDEN + 1 and
    HIDDEN + 1, extra's addition, the loss's mean over rows x OUT, the sum over the ranks'
    accumulated losses (or their average); backward retraces them and a weight's gradient sums
    every rank's rows of every micro-batch."""
    return 2 * (IN + 1 + 2 * (HIDDEN + 1) + 1 + rows * OUT + n * accumulate) + \
        rows * n * accumulate


class _Bounds:
    """The reference's largest gradient of each step and largest value, per parameter, and
    from them each parameter's ``rounding.sgd_parameters`` bound after the last step."""

    def __init__(self, ref, kind, terms):
        self.ref, self.kind, self.terms = ref, kind, terms
        self.grads = {k: [] for k, _ in ref.named_parameters()}
        self.largest = {k: float(q.detach().abs().max()) for k, q in ref.named_parameters()}

    def gradients(self):
        """Record the reference's gradients, before its step."""
        for k, q in self.ref.named_parameters():
            self.grads[k].append(float(q.grad.abs().max()))

    def now(self):
        """Record the reference's parameters after its step; the bounds."""
        for k, q in self.ref.named_parameters():
            self.largest[k] = max(self.largest[k], float(q.detach().abs().max()))
        lr, momentum = SGD[self.kind]
        return {k: rounding.sgd_parameters(lr, self.terms, g, self.largest[k], momentum)
                for k, g in self.grads.items()}


def _within(got, ref, bounds):
    """The parameters of ``got`` that lie farther from ``ref``'s than their bounds, as
    (name, largest difference, bound)."""
    out = []
    for name, q in ref.named_parameters():
        worst = float((got[name] - q.detach()).abs().max())
        if not worst <= bounds[name]:
            out.append((name, worst, bounds[name]))
    return out


def _compare(model, ref, comm, what, bounds=None):
    """Full parameters within ``bounds`` of the reference (where given) and bitwise equal
    across ranks."""
    sd = model.full_state_dict()
    msgs = [] if bounds is None else _within(sd, ref, bounds)
    mine = torch.cat([v.reshape(-1) for v in sd.values()]).numpy()
    root = comm.bcast(mine, root=0)
    if root.tobytes() != mine.tobytes():
        msgs.append("parameters differ bitwise from rank 0's")
    assert_all(not msgs, f"{what}: {msgs[:3]}")


def _run(stage, kind="sgd", steps=5, accumulate=1, extra_on_rank0=False, never_extra=False,
         **kw):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    ref = _net(0)
    net = _net(0 if r == 0 else 100 + r)  # the wrapper brings rank 0's parameters
    model = SDP(net, stage=stage, **kw)
    opt, opt_ref = _opt(kind, model.parameters()), _opt(kind, ref.parameters())
    bounds = _Bounds(ref, kind, _terms(n, SHARD, accumulate)) if kind in SGD else None

    def extra(s):
        return False if never_extra else s == 0 if extra_on_rank0 else True
    for step in range(steps):
        opt.zero_grad()
        opt_ref.zero_grad()
        gen = torch.Generator().manual_seed(step)
        for k in range(accumulate):
            X = torch.randn(n * SHARD, IN, generator=gen)
            Y = torch.randn(n * SHARD, OUT, generator=gen)
            mine = slice(r * SHARD, (r + 1) * SHARD)
            sync = contextlib.nullcontext() if k == accumulate - 1 else model.no_sync()
            with sync:
                nn.functional.mse_loss(model(X[mine], extra=extra(r)), Y[mine]).backward()
            total = sum(nn.functional.mse_loss(ref(X[s * SHARD:(s + 1) * SHARD],
                                                   extra=extra(s)),
                                               Y[s * SHARD:(s + 1) * SHARD]) for s in range(n))
            (total / n).backward()
        for q in ref.parameters():  # a flat shard steps a parameter no rank used with zeros
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        if bounds is not None:
            bounds.gradients()
        opt.step()
        opt_ref.step()
        # AdamW (kind "adamw"): only the ranks' bitwise agreement; its lr-sized steps make any
        # comparison with one process pass or fail by the CPU's kernels.
        _compare(model, ref, comm, f"stage {stage} {kind} step {step}",
                 bounds.now() if bounds is not None else None)
    return model, opt


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["sgd", "momentum"])
def test_matches_one_process(stage, kind):
    _run(stage, kind)


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tiny_buckets_unused_parameters_and_no_sync(stage):
    # Stage 3 gathers a layer when it runs, so every rank must run the same layers: there the
    # unused layer is unused on every rank; stages 1 and 2 let it differ between ranks.
    _run(stage, "momentum", steps=3, accumulate=2, extra_on_rank0=stage != 3,
         never_extra=stage == 3, bucket_cap_mb=0.002)


def _big(hidden):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden))


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_parameter_match_zero_formulas(stage):
    """fp32 AdamW after one step: 8 + 8/N, 4 + 12/N, 16/N bytes per parameter (within 5%)."""
    comm = world()
    n = comm.Get_size()
    model = SDP(_big(512), stage=stage, bucket_cap_mb=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    rep = model.memory_report(opt)
    want = {1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]
    got = rep["bytes_per_parameter"]
    assert_all(abs(got - want) <= 0.05 * want, f"stage {stage} n={n}: {got:.3f} B/param, "
               f"formula {want:.3f}")


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_loads_at_another_rank_count(stage, tmp_path_factory):
    """Save full state (AdamW's: a step count and two moments per element) on all ranks,
    reload into a model split over a sub-communicator: its consolidated parameters and
    optimizer state are the saved ones, bitwise (slicing and gathering copy; no arithmetic)."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    model, opt = _run(stage, "adamw", steps=2)
    sd, osd = model.full_state_dict(), model.full_optim_state_dict(opt)
    # A model over the first max(1, n-1) ranks (and one over the last rank) from sd and osd.
    sub = comm.Split(0 if r < max(1, n - 1) else 1, r)
    fresh = SDP(_net(7), stage=stage, comm=sub)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.01, weight_decay=0.01)
    fresh.load_full_state_dict(sd)
    fopt.step()  # creates state tensors of the shard shapes, then overwritten
    fresh.load_full_optim_state_dict(fopt, osd)
    got, gosd = fresh.full_state_dict(), fresh.full_optim_state_dict(fopt)
    sub.Free()

    def same(a, b):
        return torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else a == b
    bad = [k for k, v in sd.items() if not torch.equal(got[k], v)]
    bad += [f"{k}[{key!r}]" for k, st in osd.items() for key, v in st.items()
            if key not in gosd[k] or not same(gosd[k][key], v)]
    bad += [f"{k}: keys {sorted(gosd[k])}" for k in osd if sorted(gosd[k]) != sorted(osd[k])]
    assert_all(sorted(osd) == sorted(gosd) and sorted(sd) == sorted(got) and not bad,
               f"stage {stage}: checkpoint from {n} ranks loads at {max(1, n - 1)} with "
               f"{bad[:5]} other than saved")


@pytest.mark.mpi
def test_bad_inputs_fail_on_every_rank():
    comm = world()
    r = comm.Get_rank()
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        SDP(_net(0), stage=4)
    if comm.Get_size() > 1:
        net = _net(0, hidden=HIDDEN + (r == 1))
        with pytest.raises(ValueError) as info:
            SDP(net)
        # DDP's check, shared: the first differing parameter and the ranks, on every rank
        msg = str(info.value)
        ok = "ShardedDataParallel: parameter 0 ('head.weight') differs across ranks [0, 1]" \
            in msg and f"rank 1 has 'head.weight' of shape [{OUT}, {HIDDEN + 1}]" in msg
        assert_all(ok, msg)
    model = SDP(_net(0), stage=2)
    with pytest.raises(ValueError, match="not one of this model's shards"):
        model.memory_report(torch.optim.SGD(_net(0).parameters(), lr=0.1))
    before = {k: v.clone() for k, v in model.full_state_dict().items()}
    bad = dict(before)
    bad["head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="head.weight"):
        model.load_full_state_dict(bad)
    bad = dict(before)
    del bad["head.bias"]
    with pytest.raises(KeyError, match="head.bias"):
        model.load_full_state_dict(bad)
    after = model.full_state_dict()
    assert_all(all(torch.equal(after[k], v) for k, v in before.items()), "state changed")


# -- in-process (one rank) ------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_is_plain_training_and_units_cover_every_parameter(stage):
    model = SDP(_net(0), stage=stage, bucket_cap_mb=0.002)
    ref = _net(0)
    names = sorted(n for unit in model.units() for n in unit)
    assert names == sorted(n for n, _ in ref.named_parameters())
    # Momentum SGD within rounding.sgd_parameters of the plain model (AdamW's lr-sized steps
    # bound nothing below 2 lr a step, and its flat shards may take other CPU kernels).
    opt, opt_ref = _opt("momentum", model.parameters()), _opt("momentum", ref.parameters())
    bounds = _Bounds(ref, "momentum", _terms(1, 6))
    X = torch.randn(6, IN, generator=torch.Generator().manual_seed(3))
    for step in range(3):
        opt.zero_grad()
        opt_ref.zero_grad()
        model(X, extra=True).pow(2).mean().backward()
        ref(X, extra=True).pow(2).mean().backward()
        bounds.gradients()
        opt.step()
        opt_ref.step()
        far = _within(model.full_state_dict(), ref, bounds.now())
        assert not far, f"step {step}: (name, largest difference, bound) {far}"
    # One AdamW step for the memory: fp32 AdamW's 16 bytes a parameter.
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt.step()
    rep = model.memory_report(opt)
    assert rep["numel"] == sum(q.numel() for q in ref.parameters())
    assert rep["bytes_per_parameter"] == pytest.approx(16.0, rel=0.05)  # N = 1: all formulas 16


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hooks_hold_weak_references(stage):
    net = _net(0)
    model = SDP(net, stage=stage)
    X = torch.randn(3, IN)
    model(X).sum().backward()   # every hook has fired once
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the module's hooks keep the wrapper alive"
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())


def test_stage_outside_one_to_three():
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3, got 0"):
        SDP(_net(0), stage=0)


def _launch(n, *argv, limit=240):
    """Run ``argv`` under ``mpiexec -n n`` from the repository root; its stdout."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    if any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
        pytest.skip("launches its own mpiexec jobs: run the test without mpiexec")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("mpiexec not found beside the interpreter")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(PYTHONUNBUFFERED="1", MPIEXEC_TIMEOUT=str(limit))
    done = subprocess.run([str(mpiexec), "-n", str(n), sys.executable, *argv],
                          capture_output=True, text=True, timeout=limit + 30, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.timeout(300)
def test_example_trains_saves_at_three_ranks_and_resumes_at_two(tmp_path):
    ck = str(tmp_path / "zero.pt")
    out = _launch(3, "examples/train_zero.py", "--stage", "3", "--epochs", "2",
                  "--samples", "1536", "--checkpoint", ck)
    assert "5.33 bytes/parameter (ZeRO's formula 5.33)" in out, out
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out
    out = _launch(2, "examples/train_zero.py", "--stage", "1", "--epochs", "1",
                  "--samples", "1536", "--resume", ck)
    assert "12.00 bytes/parameter (ZeRO's formula 12.00)" in out, out
    assert float(re.findall(r"loss ([0-9.]+)", out)[0]) < losses[0], out


@pytest.mark.timeout(300)
def test_bench_zero_prints_every_variant_at_the_formula():
    out = _launch(2, "-m", "bench", "zero", "--params-m", "2", "--rounds", "1", "--steps", "1")
    for v, want in (("ddp", 16.0), ("z1", 12.0), ("z2", 10.0), ("z3", 8.0)):
        row = re.search(rf"^{v}\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)", out, re.M)
        assert row, out
        assert float(row.group(3)) == pytest.approx(want, rel=0.05), out
        assert float(row.group(4)) == want
    assert "peak RSS" in out
