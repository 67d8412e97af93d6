"""DDP and ShardedDataParallel on a simulated topology (MPI tier, n = 2..5).

``COLLECTIVES_RANKS_PER_NODE=k`` makes blocks of k consecutive ranks act as nodes. Every layer
that asks "is this communicator on one node" (dispatch, the registered buffers behind DDP's
buckets and ZeRO's flat buffers) must hear the topology's answer: a route chosen from the real
node and refused by dispatch from the simulated one ended a training job. Each case trains on
a fresh communicator (the setting is read when a communicator's topology is discovered) and
must match one process that sees the whole batch.
"""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from collectives.topology import topology  # noqa: E402
from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from collectives.torch import ShardedDataParallel as SDP  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

torch.set_num_threads(1)

BATCH, IN, HIDDEN, OUT, STEPS = 6, 10, 33, 4, 3


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def _train(wrap, comm):
    n, r = comm.Get_size(), comm.Get_rank()
    ref, net = _net(0), _net(0 if r == 0 else 50 + r)  # the wrapper brings rank 0's weights
    model = wrap(net, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH * n, IN, generator=g), torch.randn(BATCH * n, OUT, generator=g)
        mine = slice(r * BATCH, (r + 1) * BATCH)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt_ref.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt_ref.step()
    return model, ref


def _state(model):
    if isinstance(model, SDP):
        return model.full_state_dict()
    return model.module.state_dict()


WRAPS = {
    "ddp": lambda net, comm: DDP(net, comm=comm),
    "ddp registered": lambda net, comm: DDP(net, comm=comm, registered_buckets=True),
    "ddp ring": lambda net, comm: DDP(net, comm=comm, algorithm="ring"),
    "zero1": lambda net, comm: SDP(net, stage=1, comm=comm),
    "zero2": lambda net, comm: SDP(net, stage=2, comm=comm),
    "zero3": lambda net, comm: SDP(net, stage=3, comm=comm),
}


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("case", list(WRAPS))
def test_trains_as_one_process_on_simulated_nodes(case, per_node, setting):
    n = world().Get_size()
    if n < 2 or per_node >= n:
        pytest.skip(f"{per_node} rank(s) a node at n = {n} is one node")
    setting("COLLECTIVES_RANKS_PER_NODE", per_node)
    comm = world().Dup()
    try:
        nodes = len(topology(comm).nodes)
        model, ref = _train(WRAPS[case], comm)
        got, want = _state(model), ref.state_dict()
        bad = []
        for name, value in want.items():
            if not torch.allclose(got[name], value, rtol=2e-5, atol=2e-6):
                bad.append(f"{name}: largest difference "
                           f"{(got[name] - value).abs().max().item():.3g}")
        flat = torch.cat([v.reshape(-1) for v in got.values()]).numpy()
        same = comm.bcast(flat, root=0).tobytes() == flat.tobytes()
        assert_all(nodes == -(-n // per_node) and not bad and same,
                   f"{case}, {per_node} rank(s) a node ({nodes} nodes): {bad[:3]}, "
                   f"bitwise equal to rank 0: {same}", comm=comm)
        del model
    finally:
        comm.Free()
