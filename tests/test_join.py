"""DDP for real training loops: uneven inputs (``join``) and ``static_graph``.

``join``: ranks get different numbers of batches; after every step each training rank's
parameters equal one process that averages the gradients of the ranks that still had data, and
every rank leaves the context with the same parameters and buffers, those of the ranks that
trained to the end (each rank steps its optimizer only while it has data). ``static_graph``: two
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

import rounding  # noqa: E402

torch.set_num_threads(1)

IN, HIDDEN, OUT, SHARD = 7, 24, 3, 5

# (lr, momentum) of torch.optim.SGD. SGD's step is proportional to the gradient (with momentum,
# to a linear combination of them), so float32's rounding of the gradients bounds how far the
# ranks may drift from one process (``rounding.sgd_parameters``); Adam's lr-sized steps bound
# nothing below 2 lr a step, and momentum's buffers are the stateful optimizer stepped only by
# ranks with data.
OPTIMIZERS = {"sgd": (0.1, 0.0), "momentum": (0.05, 0.9)}


def _optimizer(name, params):
    lr, momentum = OPTIMIZERS[name]
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


class Small(nn.Module):
    """A 2-layer MLP with a constant buffer and one that counts training forwards."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN, HIDDEN)
        self.b = nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("forwards", torch.zeros(1, dtype=torch.int64))

    def forward(self, x):
        if self.training:
            self.forwards += 1
        return self.b(torch.tanh(self.a(x))) * self.scale


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(SHARD, IN, generator=gen), torch.randn(SHARD, OUT, generator=gen)


def _close(params, ref, bounds):
    """Each parameter within its bound of the reference's."""
    return all(float((p - q).abs().max()) <= b for p, q, b in zip(params, ref, bounds))


def _bounds(grads, params, optimizer, n):
    """Per step, each parameter's ``rounding.sgd_parameters`` bound after that step, from the
    reference's largest gradient of each step (``grads[i]``) and largest value
    (``params[i]``), for gradients of ``n`` terms."""
    lr, momentum = OPTIMIZERS[optimizer]
    return [[rounding.sgd_parameters(lr, n, g[:step + 1], p, momentum)
             for g, p in zip(grads, params)] for step in range(len(grads[0]) if grads else 0)]


def _reference(counts, accumulate, divide_initial, optimizer):
    """One process replays every rank's batches: at each step the summed loss of the ranks
    that still have data, divided by their number (by every rank with ``divide_initial``),
    one optimizer step. The parameters after each step, and each step's bound on how far the
    ranks' may lie from them (``_bounds``; terms: the layers' sums over IN + 1 and HIDDEN + 1,
    the loss's mean over SHARD x OUT, the sum over the ranks' accumulated losses; backward
    retraces them and a weight's gradient sums every rank's SHARD x accumulate rows)."""
    n = len(counts)
    torch.manual_seed(0)
    ref = Small()
    opt = _optimizer(optimizer, ref.parameters())
    after = []
    grads = [[] for _ in ref.parameters()]
    largest = [float(p.detach().abs().max()) for p in ref.parameters()]
    for step in range(max(counts)):
        live = [s for s in range(n) if counts[s] > step]
        opt.zero_grad()
        total = 0
        for s in live:
            for k in range(accumulate):
                x, y = _batch(s, accumulate * step + k)
                total = total + nn.functional.mse_loss(ref(x), y)
        (total / (n if divide_initial else len(live))).backward()
        for seen, p in zip(grads, ref.parameters()):
            seen.append(float(p.grad.abs().max()))
        opt.step()
        after.append([p.detach().clone() for p in ref.parameters()])
        largest = [max(m, float(p.detach().abs().max())) for m, p in zip(largest, ref.parameters())]
    terms = 2 * (IN + 1 + HIDDEN + 1 + SHARD * OUT + n * accumulate) + SHARD * accumulate * n
    return after, _bounds(grads, largest, optimizer, terms)


def _join_run(counts, accumulate=1, divide_initial=False, optimizer="sgd", **kw):
    """Train under ``join`` with ``counts[r]`` steps on rank r (each rank steps its optimizer
    only while it has data); check every step against the one-process reference, then that
    every rank leaves the context with the same parameters and buffers: the reference's."""
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    ref, bounds = _reference(counts, accumulate, divide_initial, optimizer)
    torch.manual_seed(0 if r == 0 else 1 + r)  # DDP brings rank 0's
    net = Small()
    ddp = DDP(net, **kw)
    opt = _optimizer(optimizer, ddp.parameters())
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
            if not _close(net.parameters(), ref[step], bounds[step]):
                bad.append(step)
    assert_all(not bad, f"parameters differ from the reference after steps {bad[:5]}")
    # Leaving the context: every rank holds the model of the ranks that trained to the end.
    assert_all(_close(net.parameters(), ref[-1], bounds[-1]) if ref else True,
               f"a rank left join() with parameters other than the reference's after the "
               f"last step (steps per rank {counts})")
    synced = kw.get("broadcast_buffers", True)  # else every rank keeps its own buffers
    state = torch.cat([t.detach().reshape(-1).double() for t in list(net.parameters())
                       + (list(net.buffers()) if synced else [])]).numpy()
    every = comm.allgather(state.tobytes())
    assert_all(len(set(every)) == 1, f"parameters and buffers differ across ranks after "
                                     f"join(): ranks {[s for s in range(n) if every[s] != every[0]]}"
                                     f" differ from rank 0")
    assert_all(not synced or int(net.forwards) == max(counts) * accumulate,
               f"buffer 'forwards' after join() is not {max(counts) * accumulate}, the "
               f"forwards of the ranks that trained to the end")
    return ddp


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_join_one_rank_ten_percent_fewer_batches(optimizer):
    n = world().Get_size()
    _join_run([10] * (n - 1) + [9], optimizer=optimizer)


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_join_rank0_ten_percent_fewer_batches(optimizer):
    # Rank 0, the one a checkpoint is usually saved from, runs out first.
    n = world().Get_size()
    _join_run([9] + [10] * (n - 1), optimizer=optimizer)


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
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_join_divide_by_initial_world_size(optimizer):
    n = world().Get_size()
    _join_run([3] + [5] * (n - 1), divide_initial=True, optimizer=optimizer)


@pytest.mark.mpi
def test_join_rank_without_any_batch():
    n = world().Get_size()
    if n < 2:
        pytest.skip("needs 2 ranks: one without data, one with")
    _join_run([0] + [3] * (n - 1))


@pytest.mark.mpi
def test_join_without_buffer_broadcast_still_leaves_one_model():
    n = world().Get_size()
    _join_run([10] * (n - 1) + [9], broadcast_buffers=False)


@pytest.mark.mpi
def test_join_every_rank_even():
    n = world().Get_size()
    _join_run([4] * n, optimizer="momentum")


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
    opt = _optimizer("momentum", ddp.parameters())
    opt_ref = _optimizer("momentum", ref.parameters())
    # terms: the tied input layer over IN, block 1 over HIDDEN + 1, the tied layer over IN,
    # block 2 over HIDDEN + 1, the tied transpose over HIDDEN, the head over IN + 1, the loss's
    # mean over SHARD x OUT and the sum over the ranks; backward retraces them and the tied
    # weight's gradient sums its three uses' SHARD rows of every rank
    terms = 2 * (3 * IN + 3 * HIDDEN + 3 + SHARD * OUT + n) + 3 * SHARD * n
    grads = [[] for _ in ref.parameters()]
    largest = [float(p.detach().abs().max()) for p in ref.parameters()]
    bad = []
    for step in range(4):
        opt.zero_grad()
        opt_ref.zero_grad()
        x, y = _batch(r, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        total = sum(nn.functional.mse_loss(ref(_batch(s, step)[0]), _batch(s, step)[1])
                    for s in range(n))
        (total / n).backward()
        for seen, p in zip(grads, ref.parameters()):
            seen.append(float(p.grad.abs().max()))
        opt.step()
        opt_ref.step()
        largest = [max(m, float(p.detach().abs().max()))
                   for m, p in zip(largest, ref.parameters())]
        if not _close(ddp.module.parameters(), ref.parameters(),
                      _bounds(grads, largest, "momentum", terms)[-1]):
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
