"""DDP comm hooks: bytes on the wire (counted), accuracy, PowerSGD's error feedback, convergence."""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from collectives.torch import hooks  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

torch.set_num_threads(1)

IN, HIDDEN, OUT, SHARD = 16, 64, 8, 8


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def _batch(step, n):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n * SHARD, IN, generator=gen)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(IN, OUT, generator=teacher) / IN ** 0.5
    return x, torch.tanh(x @ w) * 2


def _shard(t, r):
    return t[r * SHARD:(r + 1) * SHARD]


def _grads(net):
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


# -- in-process ---------------------------------------------------------------------------------
def test_wrappers_compose_and_states_have_slots():
    h = hooks.fp16_compress_wrapper(hooks.allreduce_hook)
    assert h.__name__ == "fp16_compress_allreduce_hook"
    assert hooks.bf16_compress_wrapper(hooks.powerSGD_hook).__name__ == \
        "bf16_compress_powerSGD_hook"
    for state in (hooks.DefaultState(), hooks.PowerSGDState()):
        assert not hasattr(state, "__dict__")
    with pytest.raises(ValueError, match="matrix_approximation_rank must be at least 1, got 0"):
        hooks.PowerSGDState(matrix_approximation_rank=0)
    s = hooks.PowerSGDState(matrix_approximation_rank=2)
    assert s.compresses(64, 64) and not s.compresses(8, 4)


def test_hook_result_copied_into_bucket_when_not_the_buffer():
    def cloning_hook(state, bucket):
        return hooks.allreduce_hook(state, bucket).then(lambda f: f.value().clone() * 1)

    net, ref = _net(), _net()
    ddp = DDP(net, comm_hook=cloning_hook, bucket_cap_mb=0.005)
    x, y = _batch(0, 1)
    nn.functional.mse_loss(ddp(x), y).backward()
    nn.functional.mse_loss(ref(x), y).backward()
    torch.testing.assert_close(_grads(net), _grads(ref))


# -- MPI ------------------------------------------------------------------------------------------
def _step(hook, state_factory=None, steps=1, cap=0.01):
    """Train ``steps`` steps with ``hook``; returns the DDP and the per-step losses."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    net = _net()
    state = state_factory() if state_factory else None
    ddp = DDP(net, bucket_cap_mb=cap, comm_hook=(state, hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step % 4, n)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(_shard(x, r)), _shard(y, r))
        loss.backward()
        losses.append(comm.allreduce(loss.item()) / n)
        if step < steps - 1:
            opt.step()
    return ddp, losses


def _same_everywhere(t):
    mine = t.numpy().tobytes()
    return all(b == mine for b in world().allgather(mine))


@pytest.mark.mpi
@pytest.mark.parametrize("hook, rtol", [(hooks.fp16_compress_hook, 1e-3),   # u = 2^-11
                                        (hooks.bf16_compress_hook, 8e-3)])  # u = 2^-8
def test_low_precision_halves_the_bytes(hook, rtol):
    full, _ = _step(hooks.allreduce_hook)
    half, _ = _step(hook)
    g_full, g_half = _grads(full.module), _grads(half.module)
    ok = half.comm_state.wire_bytes * 2 == full.comm_state.wire_bytes
    err = (torch.linalg.vector_norm(g_half - g_full) / torch.linalg.vector_norm(g_full)).item()
    ok &= err < rtol and _same_everywhere(g_half)
    assert_all(ok, f"{hook.__name__}: bytes {half.comm_state.wire_bytes} vs "
                   f"{full.comm_state.wire_bytes}, relative error {err:.2e}")


def _powersgd_bytes(net, rank, itemsize=4):
    """Closed form: r (rows + cols) per compressed matrix, every element of everything else."""
    state = hooks.PowerSGDState(matrix_approximation_rank=rank)
    total = 0
    for p in net.parameters():
        rows, cols = (p.shape[0], p[0].numel()) if p.dim() >= 2 else (0, 0)
        if p.dim() >= 2 and state.compresses(rows, cols):
            total += min(rank, rows, cols) * (rows + cols)
        else:
            total += p.numel()
    return total * itemsize


@pytest.mark.mpi
@pytest.mark.parametrize("rank", [1, 4])
def test_powersgd_bytes_and_error_feedback(rank):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()

    def state():
        return hooks.PowerSGDState(matrix_approximation_rank=rank, start_powerSGD_iter=0)

    ddp, _ = _step(hooks.powerSGD_hook, state, cap=1.0)  # one bucket
    net = ddp.module
    st = ddp.comm_state
    expect = _powersgd_bytes(net, rank)
    full = sum(p.numel() for p in net.parameters()) * 4
    ok = st.wire_bytes == expect
    msg = f"bytes {st.wire_bytes}, expected {expect} (uncompressed {full})"
    # Error feedback: mean over ranks of each local gradient == approximation + mean error
    # (all in the bucket's order: the reverse of the parameters', one bucket).
    assert ddp.bucket_layout() == [[n for n, _ in reversed(list(net.named_parameters()))]]
    local = _net()
    x, y = _batch(0, n)
    nn.functional.mse_loss(local(_shard(x, r)), _shard(y, r)).backward()

    def in_bucket_order(module):
        return torch.cat([p.grad.reshape(-1) for p in reversed(list(module.parameters()))])

    mean_grad = torch.tensor(comm.allreduce(in_bucket_order(local).numpy())) / n
    mean_err = torch.tensor(comm.allreduce(st.errors[0].numpy())) / n
    try:
        torch.testing.assert_close(in_bucket_order(net) + mean_err, mean_grad, rtol=1e-4,
                                   atol=1e-6)
    except AssertionError as exc:
        ok, msg = False, f"{msg}; error feedback: {str(exc).splitlines()[:4]}"
    # A compressed matrix comes back with rank <= r.
    w = net[2].weight.grad
    ok &= int(torch.linalg.matrix_rank(w)) <= rank and _same_everywhere(_grads(net))
    assert_all(ok, msg)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "fp16", "bf16", "powerSGD", "fp16_powerSGD"])
def test_hooks_converge(name):
    def psgd():
        return hooks.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=3)

    hook, factory = {
        "allreduce": (hooks.allreduce_hook, None),
        "fp16": (hooks.fp16_compress_hook, None),
        "bf16": (hooks.bf16_compress_hook, None),
        "powerSGD": (hooks.powerSGD_hook, psgd),
        "fp16_powerSGD": (hooks.fp16_compress_wrapper(hooks.powerSGD_hook), psgd),
    }[name]
    _, losses = _step(hook, factory, steps=40)
    ok = losses[-1] < 0.25 * losses[0]
    assert_all(ok, f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
