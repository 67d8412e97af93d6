"""torch's own clients on the "collectives" backend, against gloo and against one process.

Every test starts the default group on the toolkit's backend as a user does
(``cb.init_process_group()``, whose TCP store every rank reaches), so that a gloo group of the
same ranks can run beside it (``dist.new_group(backend="gloo")``) and give the reference
results. Training tests run 5 steps of SGD and compare every parameter with one process training
the same model on the whole batch, within float32's rounding (``rounding.sgd_parameters``);
ZeRO's AdamW compares bitwise with AdamW stepped on every rank.
"""
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from mpiutil import assert_all  # noqa: E402

import rounding  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def groups():
    """The default group on "collectives" and a gloo group of the same ranks."""
    import collectives.torch.backend as cb
    cb.init_process_group()
    gloo = dist.new_group(backend="gloo")
    yield gloo
    dist.destroy_process_group()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_default_store_is_shared(groups):
    """A key set on rank 0 in the default store is read on every rank, and a gloo group made
    after the backend's init (a rendezvous through that store) reduces."""
    from torch.distributed.distributed_c10d import _get_default_store
    r, p = dist.get_rank(), dist.get_world_size()
    store = _get_default_store()
    if r == 0:
        store.set("from-rank-0", "shared")
    got = store.get("from-rank-0")
    x = torch.full((3,), float(r + 1))
    dist.all_reduce(x, group=groups)
    sub = dist.new_group(backend="gloo")  # a second one, on the same store
    dist.barrier(group=sub)
    ok = got == b"shared" and torch.equal(x, torch.full((3,), p * (p + 1) / 2))
    assert_all(ok, f"read {got!r}, gloo's sum {x}")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_stores_side_by_side_and_a_taken_port():
    """Two stores at once (two jobs on one machine) get their own ports and keys; a
    ``MASTER_PORT`` rank 0 cannot bind is an error on every rank, not a wait."""
    import os
    import socket
    from datetime import timedelta

    import collectives.torch.backend as cb
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    one_host = len(set(comm.allgather(socket.gethostname()))) == 1
    a, b = cb.tcp_store(timeout=timedelta(seconds=20)), cb.tcp_store(timeout=timedelta(seconds=20))
    if r == 0:
        a.set("k", "a")
        b.set("k", "b")
    ports = (a.port, b.port)
    ok = ports[0] != ports[1] and (a.get("k"), b.get("k")) == (b"a", b"b")
    comm.Barrier()  # nobody still reading when rank 0 drops its servers
    del a, b
    error = None
    if one_host:
        taken = None
        if r == 0:
            taken = socket.socket()
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
        port = comm.bcast(taken.getsockname()[1] if taken else None, root=0)
        os.environ["MASTER_PORT"] = str(port)
        try:
            cb.tcp_store(timeout=timedelta(seconds=20))
        except RuntimeError as exc:
            error = str(exc)
        finally:
            del os.environ["MASTER_PORT"]
            if taken:
                taken.close()
        ok &= error is not None and f":{port}" in error
    assert_all(ok, f"ports {ports}; error for a taken port: {error}")


def _same_as_gloo(fn, gloo, what):
    ours, theirs = fn(None), fn(gloo)
    ok = len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert_all(ok, f"{what}: {ours} vs gloo's {theirs}")


@pytest.mark.mpi
def test_clients_give_gloos_results(groups):
    r, p = dist.get_rank(), dist.get_world_size()

    def even(g):
        x = torch.arange(p * 2, dtype=torch.float32) + 100 * r
        o = torch.empty_like(x)
        dist.all_to_all_single(o, x, group=g)
        return [o]

    def uneven(g):
        ins, outs = [(r + j) % 3 for j in range(p)], [(i + r) % 3 for i in range(p)]
        x = torch.arange(sum(ins) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r
        o = torch.empty(sum(outs), 2)
        dist.all_to_all_single(o, x, outs, ins, group=g)
        return [o]

    def a2a(g):
        ins = [torch.full((2,), float(r * 10 + j)) for j in range(p)]
        outs = [torch.empty(2) for _ in range(p)]
        dist.all_to_all(outs, ins, group=g)
        return outs

    def gather(g):
        x = torch.full((3,), float(r))
        rows = [torch.empty(3) for _ in range(p)] if r == 0 else None
        dist.gather(x, rows, dst=0, group=g)
        return rows or [x]

    def scatter(g):
        src = p - 1
        o = torch.empty(2)
        rows = [torch.full((2,), float(i * 7)) for i in range(p)] if r == src else None
        dist.scatter(o, rows, src=src, group=g)
        return [o]

    def reduce(g):
        x = torch.full((4,), float(r + 1))
        dist.reduce(x, dst=0, group=g, async_op=True).wait()
        return [x] if r == 0 else []

    def objects(g):
        out = [None] * p
        dist.all_gather_object(out, {"rank": r, "name": f"r{r}"}, group=g)
        got = [None]
        dist.broadcast_object_list(got if r else [("from", 0)], src=0, group=g)
        return [torch.tensor([o["rank"] for o in out])]

    def into_tensor(g):
        # FSDP2's calls: all-gather in place (the input is this rank's slot) and not, then a
        # reduce-scatter, blocking and async (a blocking one completes in the caller's thread)
        out = torch.empty(p * 5)
        out[r * 5:(r + 1) * 5] = torch.arange(5.0) + 10 * r
        dist.all_gather_into_tensor(out, out[r * 5:(r + 1) * 5], group=g)
        apart = torch.empty(p * 3)
        dist.all_gather_into_tensor(apart, torch.full((3,), float(r)), group=g,
                                    async_op=True).wait()
        shard = torch.empty(4)
        dist.reduce_scatter_tensor(shard, torch.arange(4.0 * p) * (r + 1), group=g)
        return [out, apart, shard]

    def p2p(g):
        if p < 2:
            return []
        t, o = torch.full((3,), float(r)), torch.empty(3)
        ops = [dist.P2POp(dist.isend, t, (r + 1) % p, group=g),
               dist.P2POp(dist.irecv, o, (r - 1) % p, group=g)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return [o]

    for fn in (even, uneven, a2a, gather, scatter, reduce, objects, into_tensor, p2p):
        _same_as_gloo(fn, groups, fn.__name__)
    dist.barrier()


@pytest.mark.mpi
def test_ragged_all_to_all_beyond_gloo(groups):
    """gloo's all_to_all wants one size; the toolkit's takes any (mixture of experts)."""
    r, p = dist.get_rank(), dist.get_world_size()
    ins = [torch.full((r + j + 1,), float(10 * r + j)) for j in range(p)]
    outs = [torch.empty(i + r + 1) for i in range(p)]
    dist.all_to_all(outs, ins)
    ok = all(torch.equal(o, torch.full((i + r + 1,), float(10 * i + r)))
             for i, o in enumerate(outs))
    assert_all(ok, f"{outs}")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _batches(p, steps=5, per_rank=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(p * per_rank, 6, generator=g), torch.randn(p * per_rank, 3, generator=g))
            for _ in range(steps)]


def _reference(p, lr, momentum=0.0):
    """One process on the whole batch with SGD: the parameters after each step, and how far
    ``p`` ranks' may lie from them (``rounding.sgd_parameters``: SGD's step is proportional
    to the gradient; Adam's lr-sized steps would bound nothing below 2 lr a step). Terms: the
    layers' sums over 6 + 1 and 12 + 1, the loss's mean over p x 4 x 3, the ranks' partial
    sums; backward retraces them and a weight's gradient sums the p x 4 rows."""
    n = 2 * (7 + 13 + 12 * p + p) + 4 * p
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    after, grads = [], [[] for _ in model.parameters()]
    largest = [float(q.detach().abs().max()) for q in model.parameters()]
    for x, y in _batches(p):
        torch.nn.functional.mse_loss(model(x), y).backward()
        for seen, q in zip(grads, model.parameters()):
            seen.append(float(q.grad.abs().max()))
        opt.step()
        opt.zero_grad()
        after.append([q.detach().clone() for q in model.parameters()])
        largest = [max(m, float(q.detach().abs().max()))
                   for m, q in zip(largest, model.parameters())]
    bounds = [[rounding.sgd_parameters(lr, n, g[:step + 1], m, momentum)
               for g, m in zip(grads, largest)] for step in range(len(after))]
    return list(zip(after, bounds))


def _mine(x, r, per_rank=4):
    return x[r * per_rank:(r + 1) * per_rank]


def _close(params, reference, what):
    """Each parameter within its bound of the reference's (``_reference``)."""
    want, bounds = reference
    worst = [(float((a - b).abs().max()), bound) for a, b, bound in zip(params, want, bounds)]
    assert_all(all(w <= bound for w, bound in worst), f"{what}: (largest difference, bound) "
                                                     f"{worst}")


@pytest.mark.mpi
@pytest.mark.parametrize("opt", ["sgd", "momentum"])
def test_fsdp2_fully_shard_trains_like_one_process(groups, opt):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    r, p = dist.get_rank(), dist.get_world_size()
    kw = {"lr": 0.1} if opt == "sgd" else {"lr": 0.05, "momentum": 0.9}
    reference = _reference(p, **kw)
    model = _model()
    mesh = init_device_mesh("cpu", (p,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), **kw)
    for step, (x, y) in enumerate(_batches(p)):
        torch.nn.functional.mse_loss(model(_mine(x, r)), _mine(y, r)).backward()
        optim.step()
        optim.zero_grad()
        full = [q.full_tensor().detach() for q in model.parameters()]
        _close(full, reference[step], f"FSDP2 {opt} step {step}")


@pytest.mark.mpi
def test_zero_redundancy_optimizer_steps_like_adamw_on_every_rank(groups):
    """ZeRO's AdamW (each rank steps its partition, then broadcasts it) equals AdamW stepped on
    every rank, bitwise: both models' DDP reduces the same gradients on the same buckets, and
    AdamW's elementwise arithmetic on the same tensors is the same whoever runs it. (Trained
    against one process, AdamW's lr-sized steps would bound nothing below 2 lr a step: the
    average itself is test_torch_ddp_trains_like_one_process's.)"""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    r, p = dist.get_rank(), dist.get_world_size()
    plain = torch.nn.parallel.DistributedDataParallel(_model())
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=0.01, foreach=False)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                    lr=0.01, foreach=False)
    for step, (x, y) in enumerate(_batches(p)):
        for net, opt in ((model, optim), (plain, plain_optim)):
            torch.nn.functional.mse_loss(net(_mine(x, r)), _mine(y, r)).backward()
            opt.step()
            opt.zero_grad()
        worst = max(float((a - b).abs().max())
                    for a, b in zip(model.parameters(), plain.parameters()))
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
        assert_all(same, f"ZeroRedundancyOptimizer step {step}: largest difference {worst} "
                         f"from AdamW on every rank")


def _torch_ddp_trains_like_one_process(what):
    """torch's DDP on the default group, 5 SGD steps, each step's parameters within their
    bound of one process's on the whole batch."""
    r, p = dist.get_rank(), dist.get_world_size()
    reference = _reference(p, lr=0.1)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_batches(p)):
        torch.nn.functional.mse_loss(model(_mine(x, r)), _mine(y, r)).backward()
        optim.step()
        optim.zero_grad()
        _close([q.detach() for q in model.parameters()], reference[step], f"{what} {step}")


@pytest.mark.mpi
def test_torch_ddp_trains_like_one_process(groups):
    _torch_ddp_trains_like_one_process("DDP step")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_default_group_rebuilt_on_another_communicator():
    """``cb.rebuild(old, new)`` (what elastic training does after a shrink) makes the default
    group again on ``new``: torch's ranks and size are ``new``'s (here in reverse order), the
    subgroups' ranks are its ranks, torch's DDP trains on it like one process, a group runs on
    a communicator given as ``pg_options``; nothing is done for a group that does not run on
    ``old``; ``new=None`` only destroys it."""
    from mpi4py import MPI

    import collectives.torch.backend as cb
    world = MPI.COMM_WORLD
    r = world.Get_rank()
    cb.init_process_group()
    sub = world.Split(0, world.Get_size() - 1 - r)
    try:
        ok = not cb.rebuild(sub, world) and cb.rebuild(world, sub)
        q, p = dist.get_rank(), dist.get_world_size()
        ok &= (q, p) == (sub.Get_rank(), sub.Get_size()) and not cb.rebuild(world, sub)
        x = torch.full((2,), float(q))
        dist.all_reduce(x)
        ok &= bool((x == p * (p - 1) / 2).all())
        last = dist.new_group([p - 1])                      # ranks of sub
        if q == p - 1:
            y = torch.ones(1)
            dist.all_reduce(y, group=last)
            ok &= float(y) == 1 and dist.get_rank(last) == 0
        own = dist.new_group(list(range(p)), pg_options=sub.Dup())
        z = torch.ones(1)
        dist.all_reduce(z, group=own)
        ok &= float(z) == p
        _torch_ddp_trains_like_one_process("DDP on the rebuilt group, step")
        with pytest.raises(TypeError, match="MPI communicator"):
            dist.new_group(list(range(p)), pg_options="not a communicator")
        ok &= cb.rebuild(sub, None) and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert_all(ok, f"rank {r}: the rebuilt default group ({ok})")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_a_failed_bucket_is_raised_by_torch_ddps_backward(groups, monkeypatch):
    """A collective that fails under torch's DDP (a dead peer, a revoked communicator) is
    raised by ``backward`` on every rank, its own error: torch's Reducer reads its buckets'
    futures without asking whether they failed, and crashed the process on one that had."""
    import collectives as coll

    class Failed:
        def wait(self):
            raise RuntimeError("the bucket's allreduce failed")

    model = torch.nn.parallel.DistributedDataParallel(_model())
    model(torch.ones(2, 6)).sum().backward()              # a good step first
    monkeypatch.setattr(coll, "iallreduce", lambda *a, **k: Failed())
    error = None
    try:
        model(torch.ones(2, 6)).sum().backward()
    except RuntimeError as exc:
        error = str(exc)
    monkeypatch.undo()
    assert_all(error == "the bucket's allreduce failed", f"backward raised {error!r}")
    # Inside a backward, the call's own wait raises it too (and the backward as it ends).
    seen = []

    class Waits(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 1

        @staticmethod
        def backward(ctx, g):
            work = dist.all_reduce(g.clone(), async_op=True)
            try:
                work.wait()
            except RuntimeError as exc:
                seen.append(str(exc))
            return g

    monkeypatch.setattr(coll, "iallreduce", lambda *a, **k: Failed())
    with pytest.raises(RuntimeError, match="allreduce failed"):
        Waits.apply(torch.ones(2, requires_grad=True)).sum().backward()
    monkeypatch.undo()
    assert seen == ["the bucket's allreduce failed"]
    # A future of a call outside backward still carries its error.
    x = torch.ones(3)
    monkeypatch.setattr(coll, "iallreduce", lambda *a, **k: Failed())
    work = dist.all_reduce(x, async_op=True)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="allreduce failed"):
        work.wait()


@pytest.mark.mpi
def test_drop_in_functions():
    import collectives.torch as ct
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    r, p = comm.Get_rank(), comm.Get_size()
    ins, outs = [(r + j) % 3 for j in range(p)], [(i + r) % 3 for i in range(p)]
    x = torch.arange(sum(ins), dtype=torch.float64) + 100 * r
    o = torch.empty(sum(outs), dtype=torch.float64)
    ct.all_to_all_single(o, x, outs, ins)
    want = torch.cat([torch.arange(sum((i + j) % 3 for j in range(p)), dtype=torch.float64)
                      [sum((i + j) % 3 for j in range(r)):][:outs[i]] + 100 * i
                      for i in range(p)])
    ok = torch.equal(o, want)
    o2 = torch.empty(sum(outs), dtype=torch.float64)
    ct.all_to_all_single(o2, x, None, ins, async_op=True).wait()  # splits learned
    ok &= torch.equal(o2, want)
    rows = [torch.empty(2) for _ in range(p)]
    ct.all_to_all(rows, [torch.full((2,), float(10 * r + j)) for j in range(p)])
    ok &= all(torch.equal(t, torch.full((2,), float(10 * i + r))) for i, t in enumerate(rows))
    lst = [torch.empty(3) for _ in range(p)] if r == 0 else None
    work = ct.gather(torch.full((3,), float(r)), lst, dst=0, async_op=True)
    work.wait()
    ok &= r != 0 or all(torch.equal(t, torch.full((3,), float(i))) for i, t in enumerate(lst))
    t = torch.empty(2)
    ct.scatter(t, [torch.full((2,), float(i)) for i in range(p)] if r == 0 else None, src=0)
    ok &= torch.equal(t, torch.full((2,), float(r)))
    assert_all(bool(ok), "drop-in all_to_all_single / all_to_all / gather / scatter")


@pytest.mark.mpi
def test_bad_splits_raise_on_every_rank_untouched(groups):
    """Splits that do not add up to the input's rows, or a negative one: torch's call raises
    on every rank before anything moves, and the output keeps its contents."""
    p = dist.get_world_size()
    x = torch.arange(2 * p, dtype=torch.float32)
    o = torch.full((2 * p,), -1.0)
    msgs = []
    for ins in [2] * (p - 1) + [3], [-1] + [2] * (p - 1):
        try:
            dist.all_to_all_single(o, x, [2] * p, ins)
            msgs.append(None)
        except (ValueError, RuntimeError) as e:
            msgs.append(str(e))
    ok = all(m is not None for m in msgs) and bool((o == -1).all())
    assert_all(ok, f"errors {msgs}, output {o}")
    dist.barrier()


@pytest.mark.timeout(300)
def test_bench_fsdp_prints_the_table():
    """``python -m bench fsdp`` at its smallest (in-process tier: it launches its own mpiexec
    jobs): a row per job, gloo's then the backend's, and the backend's parameters bitwise
    gloo's."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    if any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
        pytest.skip("launches its own mpiexec jobs: run the test without mpiexec")
    if not (Path(sys.executable).parent / "mpiexec").exists():
        pytest.skip("mpiexec not found beside the interpreter")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(MPIEXEC_TIMEOUT="120")
    done = subprocess.run([sys.executable, "-m", "bench", "fsdp", "--pairs", "1", "--rounds",
                           "2", "--steps", "1", "--warmup", "1", "--layers", "2", "--width",
                           "64", "--batch", "4"], capture_output=True, text=True, timeout=280,
                          env=env, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if not line.startswith("#")]
    assert [row[1] for row in rows] == ["gloo", "collectives"], done.stdout
    assert len(rows[0]) == 7 + 2 and rows[0][4] == "1.00x", done.stdout  # 2 rounds
    assert "collectives vs gloo: bitwise equal" in done.stdout, done.stdout


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_sizes_torch_passes_move_no_extra_message(groups, monkeypatch):
    """``all_gather`` (uneven too), ``gather`` and ``scatter`` take the sizes torch passes them:
    no rank exchanges counts or a header. A root whose list does not fit torch's equal blocks
    gets a ValueError once the call is done; the other ranks complete, and the next call works."""
    from collectives import shapes
    r, p = dist.get_rank(), dist.get_world_size()
    exchanged = []
    for name in ("allgather_counts", "scatter_header"):
        real = getattr(shapes, name)
        monkeypatch.setattr(shapes, name,
                            lambda *a, _real=real, _name=name, **k: (exchanged.append(_name),
                                                                     _real(*a, **k))[1])
    outs = [torch.empty(j + 1) for j in range(p)]
    dist.all_gather(outs, torch.full((r + 1,), float(r)))
    ok = all(torch.equal(o, torch.full((j + 1,), float(j))) for j, o in enumerate(outs))
    rows = [torch.empty(3) for _ in range(p)] if r == 0 else None
    dist.gather(torch.full((3,), float(r)), rows, dst=0)
    ok &= r != 0 or all(torch.equal(t, torch.full((3,), float(j))) for j, t in enumerate(rows))
    got = torch.empty(2)
    dist.scatter(got, [torch.full((2,), float(j)) for j in range(p)] if r == p - 1 else None,
                 src=p - 1)
    ok &= torch.equal(got, torch.full((2,), float(r)))
    misfit = None
    try:
        dist.gather(torch.full((3,), 1.0), [torch.empty(4) for _ in range(p)] if r == 0 else None,
                    dst=0)
    except (ValueError, RuntimeError) as exc:
        misfit = str(exc)
    after = torch.full((2,), 1.0)
    dist.all_reduce(after)
    ok &= torch.equal(after, torch.full((2,), float(p)))
    assert_all(ok and not exchanged and (misfit is not None) == (r == 0)
               and (misfit is None or "equal" in misfit or "block" in misfit),
               f"results {ok}, exchanged {exchanged}, misfit {misfit!r}")
