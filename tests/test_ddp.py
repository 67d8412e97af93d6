"""DistributedDataParallel: N ranks on shards train exactly like one process on the whole batch.

In-process tests (one rank) cover bucket assignment, state_dict, weak references and errors;
MPI tests (``mpiexec -n 3``, also 2) compare every step's gradients with one process that sees
the whole batch (float32 tolerance) and check they are bitwise identical on every rank.
"""
import contextlib
import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from collectives.torch import DistributedDataParallel as DDP  # noqa: E402
from collectives.torch.buckets import assign  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

torch.set_num_threads(1)

IN, HIDDEN, OUT, SHARD = 12, 96, 5, 4


class Net(nn.Module):
    """The head is registered first but used last: the ready order differs from reverse order."""

    def __init__(self, hidden=HIDDEN, dead=False):
        super().__init__()
        self.head = nn.Linear(hidden, OUT)
        self.body = nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                  nn.Tanh())
        self.extra = nn.Linear(hidden, OUT)
        self.dead = nn.Linear(hidden, OUT) if dead else None

    def forward(self, x, extra=False):
        z = self.body(x)
        y = self.head(z)
        return y + self.extra(z) if extra else y


def _net(seed, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


# -- in-process -----------------------------------------------------------------------------------
def test_assign_reverse_order_small_first_bucket_and_cap():
    nbytes = [400, 400, 400, 400, 400]
    keys = ["f"] * 5
    assert assign(nbytes, keys, cap_bytes=1000, first_bytes=300) == [[4], [3, 2, 1], [0]]
    assert assign(nbytes, keys, cap_bytes=10_000) == [[4, 3, 2, 1, 0]]
    assert assign(nbytes, keys, cap_bytes=1) == [[4], [3], [2], [1], [0]]
    assert assign(nbytes, keys, cap_bytes=800, order=[2, 0, 4, 1, 3], first_bytes=400) == \
        [[2], [0, 4], [1, 3]]


def test_assign_separates_dtypes_and_orders_by_first_member():
    nbytes = [4, 8, 4, 8]
    keys = ["f32", "f64", "f32", "f64"]
    assert assign(nbytes, keys, cap_bytes=100) == [[3, 1], [2, 0]]
    assert assign([], [], cap_bytes=10) == []
    with pytest.raises(ValueError, match="each of the 2 parameter indices once"):
        assign([1, 1], ["a", "a"], 10, order=[0, 0])
    with pytest.raises(ValueError, match="positive"):
        assign([1], ["a"], 0)


def test_grads_are_bucket_views_and_one_rank_is_identity():
    net = _net(0)
    ref = _net(0)
    ddp = DDP(net, bucket_cap_mb=0.01)
    x = torch.randn(7, IN)
    ddp(x, extra=True).pow(2).mean().backward()
    ref(x, extra=True).pow(2).mean().backward()
    for name, p in net.named_parameters():
        q = dict(ref.named_parameters())[name]
        torch.testing.assert_close(p.grad, q.grad)
        flats = [b.flat for b in ddp._buckets]
        assert any(p.grad.data_ptr() >= f.data_ptr() and
                   p.grad.data_ptr() < f.data_ptr() + f.numel() * f.element_size()
                   for f in flats), name
    assert len(ddp.bucket_layout()) > 1


def test_missing_gradients_need_find_unused_parameters():
    ddp = DDP(_net(0))
    with pytest.raises(RuntimeError, match=r"got no gradient.*'extra.weight'.*"
                                           r"find_unused_parameters=True"):
        ddp(torch.randn(3, IN)).sum().backward()
    # The failed iteration does not poison the next one.
    ddp(torch.randn(3, IN), extra=True).sum().backward()


def test_state_dict_has_no_prefix_and_load_accepts_both():
    net = _net(0)
    ddp = DDP(net)
    sd = ddp.state_dict()
    assert list(sd) == list(net.state_dict())
    other = _net(1)
    ddp.load_state_dict(other.state_dict())
    assert torch.equal(net.head.weight, other.head.weight)
    ddp.load_state_dict({"module." + k: v for k, v in _net(2).state_dict().items()})
    assert torch.equal(net.head.weight, _net(2).head.weight)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ddp = ddp

    outer = Outer()
    keys = list(outer.state_dict())
    assert keys[0].startswith("ddp.") and not keys[0].startswith("ddp.module.")
    outer.load_state_dict(outer.state_dict())


def test_no_sync_restores_the_flag_on_error():
    ddp = DDP(_net(0))
    with pytest.raises(KeyError):
        with ddp.no_sync():
            assert not ddp.reducer.require_sync
            raise KeyError("x")
    assert ddp.reducer.require_sync


def test_hooks_hold_weak_references():
    net = _net(0)
    ddp = DDP(net)
    ref = weakref.ref(ddp)
    del ddp
    gc.collect()
    assert ref() is None
    net(torch.randn(2, IN)).sum().backward()  # no DDP left: plain local backward
    assert net.head.weight.grad is not None


def test_hook_must_return_a_future():
    ddp = DDP(_net(0), comm_hook=lambda state, bucket: bucket.buffer())
    with pytest.raises(TypeError, match="expected a torch.futures.Future"):
        ddp(torch.randn(2, IN), extra=True).sum().backward()


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        DDP(object())
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(_net(0), bucket_cap_mb=0)
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'nope'"):
        DDP(_net(0), algorithm="nope")


# -- MPI: equivalence with one process on the whole batch -----------------------------------------
def _compare(ddp, net, ref, comm, what):
    """Grads close to the reference and bitwise equal across ranks; agreed before asserting."""
    msgs = []
    flat = []
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        if (p.grad is None) != (q.grad is None):
            msgs.append(f"{name}: grad None here {p.grad is None}, reference {q.grad is None}")
            continue
        if p.grad is None:
            continue
        try:
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-5, atol=2e-6)
        except AssertionError as exc:
            msgs.append(f"{name}: {str(exc).splitlines()[0:4]}")
        flat.append(p.grad.reshape(-1))
    mine = torch.cat(flat).numpy() if flat else np.zeros(0, np.float32)
    root = comm.bcast(mine, root=0)
    if root.shape != mine.shape or root.tobytes() != mine.tobytes():
        msgs.append("gradients differ bitwise from rank 0's")
    assert_all(not msgs, f"{what}: {msgs[:3]}")


def _run(steps=3, accumulate=1, dead=False, extra_on_rank0=False, set_to_none=True,
         hidden=HIDDEN, **kw):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    ref = _net(0, hidden=hidden, dead=dead)
    net = _net(0 if r == 0 else 100 + r, hidden=hidden, dead=dead)  # DDP brings rank 0's
    ddp = DDP(net, **kw)
    same = all(torch.equal(p, q) for p, q in zip(net.parameters(), ref.parameters()))
    assert_all(same, "parameters not broadcast from rank 0")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    def extra(s):  # which shards use the extra layer
        return s == 0 if extra_on_rank0 else True

    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        opt_ref.zero_grad(set_to_none=set_to_none)
        gen = torch.Generator().manual_seed(step)
        for k in range(accumulate):
            X = torch.randn(n * SHARD, IN, generator=gen)
            Y = torch.randn(n * SHARD, OUT, generator=gen)
            mine = slice(r * SHARD, (r + 1) * SHARD)
            sync = contextlib.nullcontext() if k == accumulate - 1 else ddp.no_sync()
            with sync:
                out = ddp(X[mine], extra=extra(r))
                nn.functional.mse_loss(out, Y[mine]).backward()
            # One process, whole batch: the mean over shards of each shard's loss.
            total = sum(nn.functional.mse_loss(ref(X[s * SHARD:(s + 1) * SHARD],
                                                   extra=extra(s)),
                                               Y[s * SHARD:(s + 1) * SHARD]) for s in range(n))
            (total / n).backward()
        _compare(ddp, net, ref, comm, f"step {step}")
        opt.step()
        opt_ref.step()
    return ddp


@pytest.mark.mpi
def test_default_buckets_match_one_process():
    ddp = _run(hidden=600)  # ~1.5 MB of parameters: a small first bucket, then the rest
    layouts = world().allgather(ddp.bucket_layout())
    assert_all(all(lay == layouts[0] for lay in layouts), f"bucket layouts differ: {layouts}")
    assert_all(len(layouts[0]) >= 2, f"expected several buckets, got {layouts[0]}")


@pytest.mark.mpi
def test_tiny_buckets_match_one_process():
    ddp = _run(bucket_cap_mb=1e-4)
    # A bucket closes at 104 bytes: each parameter alone, but a 5-float bias joins the next.
    assert_all(len(ddp.bucket_layout()) == 6, f"tiny buckets: {ddp.bucket_layout()}")


@pytest.mark.mpi
def test_buckets_rebuilt_in_ready_order_same_on_every_rank():
    comm = world()
    ddp = DDP(_net(0), bucket_cap_mb=0.05)
    before = ddp.bucket_layout()
    ddp(torch.randn(SHARD, IN), extra=True).sum().backward()
    after = ddp.bucket_layout()
    layouts = comm.allgather(after)
    assert_all(all(lay == layouts[0] for lay in layouts), f"layouts differ: {layouts}")
    # Backward reaches head/extra first, then the body from its last layer down.
    assert_all(after != before and after[-1][-1] in ("body.0.weight", "body.0.bias"),
               f"before {before}, after {after}")


@pytest.mark.mpi
def test_rebuilt_registered_buckets_take_the_old_windows():
    """The rebuild in ready order maps no second set of windows: the old buckets go before
    the new ones are made, and these take the old windows from the pool, so a rank keeps one
    window a bucket resident."""
    from collectives.executor import cached_context
    from collectives.node import registered
    from collectives.node.registered import _Node
    comm = world().Dup()   # a communicator of its own: no other test's windows
    if not registered.single_node(comm):
        pytest.skip("registered buckets need one node")
    ddp = DDP(_net(0, hidden=600), comm=comm, registered_buckets=True)
    before = ddp.bucket_layout()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for _ in range(2):
        ddp(torch.randn(SHARD, IN), extra=True).sum().backward()
        opt.step()
        opt.zero_grad()
    node = cached_context(comm).slots[_Node]
    windows = len(node.live) + len(node.released) + len(node.pool)
    buckets = len(ddp.bucket_layout())
    layout = ddp.bucket_layout()
    del ddp, opt
    comm.Free()
    assert_all(layout != before and windows == buckets,
               f"{windows} registered windows for {buckets} buckets (layout {before} rebuilt "
               f"as {layout})")


@pytest.mark.mpi
def test_no_sync_accumulation_matches_one_process():
    _run(accumulate=3, bucket_cap_mb=0.01)
    _run(accumulate=2, set_to_none=False)


@pytest.mark.mpi
def test_unused_parameters_match_one_process():
    ddp = _run(dead=True, extra_on_rank0=True, find_unused_parameters=True, bucket_cap_mb=0.01)
    dead = ddp.module.dead
    assert_all(dead.weight.grad is None and dead.bias.grad is None,
               "a parameter unused on every rank must keep grad None")
    _run(dead=True, extra_on_rank0=True, find_unused_parameters=True, accumulate=2)


@pytest.mark.mpi
def test_without_bucket_views_matches_one_process():
    _run(gradient_as_bucket_view=False, bucket_cap_mb=0.02, set_to_none=False)
    _run(gradient_as_bucket_view=False, extra_on_rank0=True, find_unused_parameters=True)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_algorithms(algorithm):
    _run(steps=2, algorithm=algorithm, bucket_cap_mb=0.01)


@pytest.mark.mpi
def test_parameter_mismatch_names_parameter_and_ranks():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        pytest.skip("needs two ranks")
    net = _net(0, hidden=HIDDEN + (1 if r == n - 1 else 0))
    with pytest.raises(ValueError) as info:
        DDP(net)
    msg = str(info.value)
    ok = "parameter 0 ('head.weight') differs across ranks" in msg and \
        f"rank {n - 1} has 'head.weight' of shape [{OUT}, {HIDDEN + 1}]" in msg
    assert_all(ok, msg)


@pytest.mark.mpi
def test_buffers_broadcast_from_rank0():
    comm = world()
    r = comm.Get_rank()
    torch.manual_seed(r)
    net = nn.Sequential(nn.Linear(IN, 8), nn.BatchNorm1d(8))
    net[1].running_mean.fill_(r)
    ddp = DDP(net)
    assert_all(bool((net[1].running_mean == 0).all()), "buffers not broadcast at construction")
    ddp(torch.randn(SHARD, IN) + r)  # each rank updates its running stats on its own data
    # The next forward starts from rank 0's buffers again: on the same data, the same result.
    ddp(torch.randn(SHARD, IN, generator=torch.Generator().manual_seed(5)))
    means = comm.allgather(net[1].running_mean.numpy().copy())
    assert_all(all(np.array_equal(m, means[0]) for m in means), "buffers differ")


@pytest.mark.mpi
def test_overlap_stats_are_recorded():
    ddp = _run(steps=2, bucket_cap_mb=0.01)
    s = ddp.stats
    assert_all(s.steps == 2 and s.wire_bytes > 0 and 0.0 <= s.hidden_fraction() <= 1.0, repr(s))


@pytest.mark.mpi
def test_torch_ddp_on_the_collectives_backend():
    """torch's own DDP over ``dist.init_process_group("collectives")`` matches one process."""
    import torch.distributed as dist

    import collectives.torch.backend as backend
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    backend.init_process_group()
    try:
        ref = _net(0)
        net = _net(0 if r == 0 else 7 + r)
        ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01)
        gen = torch.Generator().manual_seed(3)
        X = torch.randn(n * SHARD, IN, generator=gen)
        Y = torch.randn(n * SHARD, OUT, generator=gen)
        mine = slice(r * SHARD, (r + 1) * SHARD)
        nn.functional.mse_loss(ddp(X[mine], extra=True), Y[mine]).backward()
        nn.functional.mse_loss(ref(X, extra=True), Y).backward()
        msgs = []
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            try:
                torch.testing.assert_close(p.grad, q.grad, rtol=2e-5, atol=2e-6)
            except AssertionError as exc:
                msgs.append(f"{name}: {str(exc).splitlines()[:3]}")
        assert_all(not msgs, str(msgs))
        assert_all(dist.get_backend() == "collectives", dist.get_backend())
        # torch's own fp16 compression hook, on our backend.
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        net16 = _net(0)
        ddp16 = nn.parallel.DistributedDataParallel(net16, bucket_cap_mb=0.01)
        ddp16.register_comm_hook(None, default_hooks.fp16_compress_hook)
        nn.functional.mse_loss(ddp16(X[mine], extra=True), Y[mine]).backward()
        err = max(((p.grad - q.grad).norm() / q.grad.norm()).item()
                  for p, q in zip(net16.parameters(), ref.parameters()))
        assert_all(err < 2e-3, f"fp16 hook on the collectives backend: relative error {err}")
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi
def test_watchdog_names_the_bucket_and_its_parameters(monkeypatch):
    """A bucket's allreduce is registered with the watchdog under its bucket and parameters."""
    from collectives import watchdog
    seen = []
    watch = watchdog.watch

    def spy(ctx, call=None, what="", phase="run"):
        entry = watch(ctx, call, what, phase)
        seen.append(entry.describe())
        return entry

    monkeypatch.setattr(watchdog, "watch", spy)
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    ddp(torch.randn(4, 8)).sum().backward()
    labelled = [s for s in seen if "[DDP bucket 0 of 1: " in s]
    ok = world().Get_size() == 1 or (labelled and "0.weight" in labelled[0])
    assert_all(bool(ok), f"watchdog descriptions: {seen}")
