"""``DistributedDataParallel(overlap_forward=True)``: communication carried into the next forward.

N ranks on shards train like one process on the whole batch (parameters compared at every
next forward, before any ``synchronize``, and at the end); the first layer's forward runs
while the last layer's piece is still unfinished; bad use is a clear error.
"""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from collectives.torch.overlap import pieces  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

torch.set_num_threads(1)

IN, HIDDEN, OUT, SHARD = 10, 48, 4, 3


class Net(nn.Module):
    """Three layers and a scale used through torch.nn.functional by the parent (no submodule
    of its own: its piece is finished when the forward starts)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(IN, HIDDEN)
        self.mid = nn.Sequential(nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.last = nn.Linear(HIDDEN, OUT)
        self.gain = nn.Parameter(torch.ones(OUT))

    def forward(self, x):
        return self.last(self.mid(self.first(x))) * self.gain


def _net(seed):
    torch.manual_seed(seed)
    return Net()


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=1e-2)


# -- in-process ---------------------------------------------------------------------------------
def test_pieces_cut_buckets_at_parameter_boundaries():
    net = _net(0)
    params = list(net.parameters())
    ddp = DDP(net, overlap_forward=True, bucket_cap_mb=1.0)
    # One bucket; a piece closes once it holds the limit.
    assert len(ddp._buckets) == 1
    cut = pieces(ddp._buckets, params, piece_bytes=HIDDEN * 4)
    for pc in cut:
        assert pc.stop - pc.start == sum(params[i].numel() for i in pc.members)
        assert pc.nbytes - params[pc.members[-1]].numel() * 4 < HIDDEN * 4
    assert sorted(i for pc in cut for i in pc.members) == list(range(len(params)))
    one = pieces(ddp._buckets, params, piece_bytes=1)
    assert [pc.members for pc in one] == [[i] for b in ddp._buckets for i in b.members]
    # ... and never spans two modules: a piece per Linear (weight and bias) and one for gain.
    owner = [id(m) for m in ddp._overlap.owner]
    whole = pieces(ddp._buckets, params, piece_bytes=1 << 30, owner=owner)
    assert sorted(len(pc.members) for pc in whole) == [1, 2, 2, 2]
    assert len(ddp._overlap.pieces) == 4


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_one_process_equals_plain_training():
    net, ref = _net(0), _net(0)
    ddp = DDP(net, overlap_forward=True, bucket_cap_mb=0.005)
    opt = _optimizer("sgd", ddp.parameters())
    ddp.attach_optimizer(opt)
    opt_ref = _optimizer("sgd", ref.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, 1, gamma=0.5)
    for step in range(4):
        x, y = torch.randn(5, IN), torch.randn(5, OUT)
        nn.functional.mse_loss(ddp(x), y).backward()
        # Harmless either way: the reduced gradients wait in the buckets, .grad is None.
        opt.zero_grad(set_to_none=step % 2 == 0)
        assert all(p.grad is None for p in net.parameters())
        opt_ref.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt_ref.step()
        sched.step()
        sched_ref.step()
    ddp.synchronize()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    # The attached optimizer's state is the one the pieces' optimizers update.
    assert len(opt.state_dict()["state"]) == len(list(net.parameters()))


def test_a_second_backward_before_a_forward_is_refused():
    ddp = DDP(_net(0), overlap_forward=True, bucket_cap_mb=0.005)
    ddp.attach_optimizer(_optimizer("sgd", ddp.parameters()))
    x = torch.randn(5, IN)
    ddp(x).sum().backward()   # rebuilds: nothing left pending
    a, b = ddp(x), ddp(2 * x)
    a.sum().backward()
    with pytest.raises(RuntimeError, match="updates are pending"):
        b.sum().backward()
    ddp.synchronize()
    ddp(x).sum().backward()   # and the model goes on


def test_bad_use_is_a_clear_error():
    ddp = DDP(_net(0), overlap_forward=True)
    with pytest.raises(RuntimeError, match=r"attach_optimizer\(optimizer\) before the first"):
        ddp(torch.randn(2, IN))
    with torch.no_grad():
        ddp(torch.randn(2, IN))   # evaluation needs no optimizer
    with pytest.raises(ValueError, match="not a parameter of this model"):
        ddp.attach_optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp.attach_optimizer(opt)
    with pytest.raises(RuntimeError, match="already attached"):
        ddp.attach_optimizer(opt)
    with pytest.raises(RuntimeError, match=r"do not call step\(\)"):
        opt.step()
    with pytest.raises(RuntimeError, match="join"):
        with ddp.join():
            pass
    with pytest.raises(ValueError, match="takes no comm hook"):
        from collectives.torch.hooks import fp16_compress_hook
        ddp.register_comm_hook(None, fp16_compress_hook)
    with pytest.raises(ValueError, match="does not combine with comm_hook, "
                                         "find_unused_parameters=True"):
        DDP(_net(0), overlap_forward=True, comm_hook=lambda s, b: None,
            find_unused_parameters=True)
    plain = DDP(_net(0))
    with pytest.raises(RuntimeError, match="needs DistributedDataParallel"):
        plain.attach_optimizer(torch.optim.SGD(plain.parameters(), lr=0.1))
    plain.synchronize()   # nothing pending: a no-op


# -- MPI: equivalence with one process on the whole batch ---------------------------------------
def _close(net, ref, what, rtol=1e-5, atol=1e-6):
    msgs = []
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        try:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol)
        except AssertionError as exc:
            msgs.append(f"{name}: {str(exc).splitlines()[:4]}")
    assert_all(not msgs, f"{what}: {msgs[:3]}")


@pytest.mark.mpi
@pytest.mark.parametrize("kind,cap,share", [("sgd", 0.005, 0.5), ("adam", 25, 0.5),
                                            ("sgd", 0.002, 0.0), ("sgd", 0.002, 1.0)])
def test_parameters_match_one_process_at_every_step(kind, cap, share):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    ref = _net(0)
    net = _net(0 if r == 0 else 50 + r)   # DDP brings rank 0's
    ddp = DDP(net, overlap_forward=True, bucket_cap_mb=cap)
    ddp._overlap.backward_share = share
    opt = _optimizer(kind, ddp.parameters())
    ddp.attach_optimizer(opt)
    opt_ref = _optimizer(kind, ref.parameters())
    steps = 5
    for step in range(steps + 1):
        gen = torch.Generator().manual_seed(step)
        X = torch.randn(n * SHARD, IN, generator=gen)
        Y = torch.randn(n * SHARD, OUT, generator=gen)
        out = ddp(X[r * SHARD:(r + 1) * SHARD])
        # The forward has applied every earlier step's update, piece by piece.
        _close(net, ref, f"{kind}: parameters at the forward of step {step}")
        if step == steps:
            break
        nn.functional.mse_loss(out, Y[r * SHARD:(r + 1) * SHARD]).backward()
        opt_ref.zero_grad()
        total = sum(nn.functional.mse_loss(ref(X[s * SHARD:(s + 1) * SHARD]),
                                           Y[s * SHARD:(s + 1) * SHARD]) for s in range(n))
        (total / n).backward()
        opt_ref.step()
    ddp.synchronize()
    ref_state = opt_ref.state_dict()["state"]
    mine = opt.state_dict()["state"]
    ok = len(mine) == len(ref_state)
    assert_all(ok, f"optimizer state for {len(mine)} parameters, expected {len(ref_state)}")
    s = ddp.stats
    assert_all(s.steps == steps and 0.0 <= s.forward_hidden_fraction() <= 1.0, repr(s))


@pytest.mark.mpi
def test_no_sync_accumulation_matches_one_process():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    ref = _net(0)
    net = _net(0)
    ddp = DDP(net, overlap_forward=True, bucket_cap_mb=0.004)
    ddp.attach_optimizer(_optimizer("sgd", ddp.parameters()))
    opt_ref = _optimizer("sgd", ref.parameters())
    for step in range(4):
        opt_ref.zero_grad()
        for k in range(2):
            gen = torch.Generator().manual_seed(100 * step + k)
            X = torch.randn(n * SHARD, IN, generator=gen)
            Y = torch.randn(n * SHARD, OUT, generator=gen)
            mine = slice(r * SHARD, (r + 1) * SHARD)
            if k == 0:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(X[mine]), Y[mine]).backward()
            else:
                nn.functional.mse_loss(ddp(X[mine]), Y[mine]).backward()
            nn.functional.mse_loss(ref(X), Y).backward()
        opt_ref.step()
    ddp.synchronize()
    _close(net, ref, "no_sync then a synchronized backward, four steps")


@pytest.mark.mpi
def test_synchronize_then_checkpoint_and_evaluate():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    ref = _net(0)
    ddp = DDP(_net(0), overlap_forward=True, bucket_cap_mb=0.003)
    opt = _optimizer("sgd", ddp.parameters())
    ddp.attach_optimizer(opt)
    opt_ref = _optimizer("sgd", ref.parameters())
    for step in range(3):
        gen = torch.Generator().manual_seed(10 + step)
        X = torch.randn(n * SHARD, IN, generator=gen)
        Y = torch.randn(n * SHARD, OUT, generator=gen)
        nn.functional.mse_loss(ddp(X[r * SHARD:(r + 1) * SHARD]),
                               Y[r * SHARD:(r + 1) * SHARD]).backward()
        opt_ref.zero_grad()
        nn.functional.mse_loss(ref(X), Y).backward()
        opt_ref.step()
    sd = ddp.state_dict()   # waits for the pending pieces first
    ok = all(torch.allclose(sd[k], v, rtol=1e-5, atol=1e-6) for k, v in ref.state_dict().items())
    assert_all(ok, "state_dict() before synchronize has stale parameters")
    ddp.eval()
    with torch.no_grad():
        x = torch.randn(4, IN, generator=torch.Generator().manual_seed(99))
        ok = torch.allclose(ddp(x), ref(x), rtol=1e-5, atol=1e-6)
    assert_all(ok, "evaluation differs")


@pytest.mark.mpi
def test_first_layer_runs_before_the_last_layer_is_updated():
    """With every piece held to the end of backward, the first layer's forward finds its own
    piece finished and the last layer's still unfinished, its parameters not yet updated."""
    comm = world()
    if comm.Get_size() == 1:
        pytest.skip("one rank communicates nothing")
    r = comm.Get_rank()
    net = _net(0)
    ddp = DDP(net, overlap_forward=True, bucket_cap_mb=1e-4)  # a bucket per parameter
    ddp._overlap.backward_share = 0.0
    ddp.attach_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1))
    seen = []

    def look(module, args):   # runs after DDP's own pre-hook on the same module
        ov = ddp._overlap
        first = {ov.piece_of[i] for i, p in enumerate(ddp._params)
                 if any(p is q for q in net.first.parameters())}
        last = {ov.piece_of[i] for i, p in enumerate(ddp._params)
                if any(p is q for q in net.last.parameters())}
        seen.append((all(ov.pieces[k].work is None for k in first),
                     all(ov.pieces[k].work is not None for k in last),
                     net.last.weight.detach().clone()))

    net.first.register_forward_pre_hook(look)
    x = torch.randn(SHARD, IN, generator=torch.Generator().manual_seed(r))
    for _ in range(3):
        ddp(x).square().mean().backward()
    ddp(x)
    # Forwards 2 and 3 follow a rebuilt, overlapped backward (the first one synchronizes).
    ok = all(first_done and last_pending for first_done, last_pending, _ in seen[2:])
    stale = torch.equal(seen[3][2], seen[2][2]) is False and \
        not torch.equal(seen[3][2], net.last.weight.detach())
    assert_all(ok and stale, f"at the first layer's forward: "
                             f"{[(a, b) for a, b, _ in seen]}, last layer stale {stale}")
