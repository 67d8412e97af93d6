"""The parameter server (collectives.ps): storage, optimizers and clocks in one process; tables,
consistency (BSP against synchronous SGD, SSP's bound, ASP), bad input, the stall monitor and
shutdown under MPI; the hybrid example under mpiexec."""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from collectives.ps import clock, optim, store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- in process ------------------------------------------------------------------------------
def test_key_index_matches_a_dict():
    rng = np.random.default_rng(1)
    index, ref, next_slot = store.KeyIndex(), {}, 0
    for _ in range(40):
        q = np.unique(rng.integers(-2**62, 2**62, size=rng.integers(0, 400)))
        q = np.concatenate((q, np.array(list(ref)[:50], dtype=np.int64)))
        got = index.lookup(q)
        assert np.array_equal(got, [ref.get(int(k), -1) for k in q])
        new = np.unique(q[got < 0])
        slots = np.arange(next_slot, next_slot + len(new), dtype=np.int64)
        index.insert(new, slots)
        ref.update(zip(new.tolist(), slots.tolist()))
        next_slot += len(new)
    assert len(index) == len(ref)


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_sparse_ids_spread_evenly_and_dense_bounds_split(servers):
    ids = np.arange(100_000, dtype=np.int64)    # consecutive ids: the hash must still spread
    counts = np.bincount(store.shard_of(ids, servers), minlength=servers)
    assert counts.sum() == len(ids) and counts.min() > 0.95 * len(ids) / servers
    for rows in (1, 2, 7, 13):
        b = store.dense_bounds(rows, servers)
        sizes = np.diff(b)
        assert b[0] == 0 and b[-1] == rows
        assert list(sizes) == [len(a) for a in np.array_split(np.arange(rows), servers)]


def test_initial_rows_depend_on_id_and_seed_only():
    a = store.initial_rows(np.array([5, 9, 5]), 4, np.float32, "uniform", 0.5, 3)
    assert np.array_equal(a[0], a[2]) and not np.array_equal(a[0], a[1])
    assert np.all(np.abs(a) <= 0.5)
    b = store.initial_rows(np.array([9]), 4, np.float32, "uniform", 0.5, 3)
    assert np.array_equal(a[1], b[0])
    assert not np.array_equal(a, store.initial_rows(np.array([5, 9, 5]), 4, np.float32,
                                                    "uniform", 0.5, 4))
    assert not store.initial_rows(np.array([1, 2]), 3, np.float64, "zeros", 1, 0).any()


def test_sparse_shard_grows_and_keeps_rows_and_state():
    spec = {"dim": 3, "dtype": "float64", "optimizer": "adagrad", "lr": 0.5, "options": {},
            "init": "uniform", "init_scale": 1.0, "seed": 7}
    shard = store.SparseShard(spec, 0, 1)
    first = shard.rows(np.arange(0, 5000, 7, dtype=np.int64))   # past the first capacity
    g = np.ones((3, 3))
    keys = np.array([0, 7, 4991], dtype=np.int64)
    shard.apply(keys, g)
    more = shard.rows(np.arange(5000, 9000, dtype=np.int64))    # grows again
    assert len(more) == 4000
    after = shard.rows(np.arange(0, 5000, 7, dtype=np.int64))
    want = first.copy()
    want[[0, 1, -2]] -= 0.5 * 1 / (1 + 1e-10)
    np.testing.assert_allclose(after, want, rtol=0, atol=1e-12)
    assert np.array_equal(shard.optimizer.state["a"][shard.slots(keys)], np.ones((3, 3)))


def _reference_step(name, w, g, state, t, lr, **o):
    """One optimizer step in float64, straight from the formulas (torch's conventions)."""
    if name == "sgd":
        return w - lr * g
    if name == "momentum":
        state["m"] = o.get("momentum", 0.9) * state.get("m", 0) + g
        return w - lr * state["m"]
    if name == "adagrad":
        state["a"] = state.get("a", 0) + g * g
        return w - lr * g / (np.sqrt(state["a"]) + 1e-10)
    b1, b2 = 0.9, 0.999
    state["m"] = b1 * state.get("m", 0) + (1 - b1) * g
    state["v"] = b2 * state.get("v", 0) + (1 - b2) * g * g
    mhat, vhat = state["m"] / (1 - b1 ** t), state["v"] / (1 - b2 ** t)
    return w - lr * mhat / (np.sqrt(vhat) + 1e-8)


@pytest.mark.parametrize("name", sorted(optim.OPTIMIZERS))
@pytest.mark.parametrize("rows", ["slice", "ids"])
def test_optimizers_match_their_formulas(name, rows):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 4))
    opt = optim.make(name, 6, 4, np.float64, 0.1, {})
    ref, state = w.copy(), {}
    idx = slice(None) if rows == "slice" else np.array([4, 0, 2, 5, 1, 3])
    for t in range(1, 6):
        g = rng.standard_normal((6, 4))
        opt.apply(w, idx, g[idx] if rows == "ids" else g)
        ref = _reference_step(name, ref, g, state, t, 0.1)
    np.testing.assert_allclose(w, ref, rtol=1e-12, atol=1e-12)


def test_optimizers_match_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    for name, cls, kw in (("momentum", torch.optim.SGD, {"momentum": 0.9}),
                          ("adagrad", torch.optim.Adagrad, {"eps": 1e-10}),
                          ("adam", torch.optim.Adam, {})):
        w = rng.standard_normal((5, 3))
        p = torch.nn.Parameter(torch.tensor(w))
        topt = cls([p], lr=0.05, **kw)
        opt = optim.make(name, 5, 3, np.float64, 0.05, {})
        for _ in range(4):
            g = rng.standard_normal((5, 3))
            p.grad = torch.tensor(g)
            topt.step()
            opt.apply(w, slice(None), g)
        np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_optimizer_rejects_unknown_names_options_and_rates():
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'; choose one of sgd"):
        optim.make("rmsprop", 1, 1, np.float32, 0.1, {})
    with pytest.raises(ValueError, match=r"optimizer 'sgd' takes options \[\], got \['beta1'\]"):
        optim.make("sgd", 1, 1, np.float32, 0.1, {"beta1": 0.5})
    with pytest.raises(ValueError, match="lr must be positive, got 0"):
        optim.make("adam", 1, 1, np.float32, 0, {})


def test_clock_ready_and_push_buffer_sums_in_worker_order():
    assert clock.ready(5, None, 0) and clock.ready(5, 3, 2) and not clock.ready(5, 3, 1)
    assert clock.ready(4, 0, 4) and not clock.ready(4, 0, 3)
    c = clock.Clocks(3)
    assert not c.advance(0, 1) and not c.advance(1, 1) and c.advance(2, 1)
    assert c.slowest() == 1 and c.finish(2) is False and not c.all_done()
    buf = clock.PushBuffer()
    buf.add(0, 2, np.array([3, 1]), np.array([[1.0], [2.0]]))
    buf.add(1, 0, np.array([1]), np.array([[10.0]]))
    buf.add(0, 0, np.array([1]), np.array([[4.0]]))
    assert buf.due(0) == []
    (keys, grads), = buf.due(1)
    assert keys.tolist() == [1, 3] and grads[:, 0].tolist() == [6.0, 1.0]
    (keys, grads), = buf.due(5)
    assert keys.tolist() == [1] and grads.tolist() == [[10.0]]
    whole = clock.PushBuffer(np.arange(2, 5))
    whole.add(0, 1, None, np.ones((3, 1)))
    whole.add(0, 0, np.array([3]), np.array([[5.0]]))
    (keys, grads), = whole.due(1)
    assert keys.tolist() == [2, 3, 4] and grads[:, 0].tolist() == [1.0, 6.0, 1.0]


# -- under MPI -------------------------------------------------------------------------------
def _job(servers, workers):
    """A job on the first servers + workers ranks of COMM_WORLD (None on the others), or a
    skip when the world is smaller."""
    from mpi4py import MPI
    from collectives import ps
    world = MPI.COMM_WORLD
    n = servers + workers
    if world.Get_size() < n:
        pytest.skip(f"needs {n} ranks ({servers} server(s) + {workers} workers), "
                    f"have {world.Get_size()}")
    sub = world.Split(0 if world.Get_rank() < n else MPI.UNDEFINED, world.Get_rank())
    if sub == MPI.COMM_NULL:
        return None
    return ps.init(sub, servers=servers)


def _agree(ok, message=""):
    from mpiutil import assert_all
    assert_all(ok, message)


def _ids(w, t, n=9):
    """Worker w's ids at step t: repeats included, overlapping the other workers'."""
    return (w * 7 + t * 3 + np.arange(n) * 5) % 23


def _grads(rows, w, t):
    """A gradient that depends on the rows pulled, so reading a wrong version shows."""
    return (0.25 * rows + (w + 1) * 0.125 - 0.01 * t).astype(rows.dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("servers,workers", [(1, 2), (2, 3)])
def test_bsp_is_synchronous_sgd(servers, workers):
    job = _job(servers, workers)
    ok, msg = True, ""
    if job is not None and job.is_server:
        job.serve()
    elif job is not None:
        w = job.rank
        emb = job.sparse_table("emb", 4, "float32", optimizer="sgd", lr=0.5, staleness=0,
                               init="uniform", init_scale=1.0, seed=11)
        dense = job.dense_table("dense", (7, 2), "float32", optimizer="sgd", lr=0.5,
                                staleness=0, init="uniform", init_scale=1.0, seed=12)
        # The reference: synchronous SGD on the summed gradient, in float64.
        ref_e = {int(i): r.astype(np.float64) for i, r in
                 zip(range(23), emb.pull(np.arange(23)))}
        ref_d = dense.pull().astype(np.float64)
        job.workers.Barrier()     # every worker read the initial values before any push
        steps = 6
        for t in range(steps):
            ids = _ids(w, t)
            rows = emb.pull(ids)
            d = dense.pull()
            reqs = [emb.ipush(ids, _grads(rows, w, t)), dense.ipush(_grads(d, w, t))]
            job.clock()
            for r in reqs:
                r.wait()
            ge, gd = {}, np.zeros_like(ref_d)
            for v in range(workers):
                vid = _ids(v, t)
                g = _grads(np.stack([ref_e[int(i)] for i in vid]), v, t)
                for i, gi in zip(vid, g):
                    ge[int(i)] = ge.get(int(i), 0) + gi
                gd += _grads(ref_d, v, t)
            for i, gi in ge.items():
                ref_e[i] = ref_e[i] - 0.5 * gi
            ref_d -= 0.5 * gd
        job.workers.Barrier()
        job.clock()
        got_e = emb.pull(np.arange(23))
        got_d = dense.pull()
        want_e = np.stack([ref_e[i] for i in range(23)])
        ok = (np.allclose(got_e, want_e, rtol=2e-5, atol=2e-5)
              and np.allclose(got_d, ref_d, rtol=2e-5, atol=2e-5))
        msg = f"max error {np.abs(got_e - want_e).max()}, {np.abs(got_d - ref_d).max()}"
        job.finish()
    _agree(ok, msg)


@pytest.mark.mpi
@pytest.mark.parametrize("staleness", [0, 2, None])
def test_staleness_bounds_how_far_a_fast_worker_runs(staleness):
    """Worker 1 holds its first clock until worker 0 tells it to go: worker 0 must get through
    exactly the clocks the bound allows without waiting, and then see worker 1's pushes."""
    job = _job(1, 2)
    ok, msg = True, ""
    if job is not None and job.is_server:
        job.serve()
    elif job is not None:
        tab = job.dense_table("count", (1,), "float64", optimizer="sgd", lr=1.0,
                              staleness=staleness)
        one = np.array([-1.0])            # each push adds 1
        ahead = {0: 0, 2: 2, None: 6}[staleness]
        if job.rank == 0:
            seen = []
            for t in range(ahead + 1):
                seen.append(float(tab.pull()[0]))   # must not wait: worker 1 is at clock 0
                tab.push(one)
                job.clock()
            job.workers.Send(np.zeros(1), dest=1, tag=5)
            if staleness is not None:
                late = float(tab.pull()[0])          # clock ahead + 1: waits for worker 1
                ok = late >= ahead + 2 and all(s <= t for t, s in enumerate(seen))
                msg = f"seen {seen}, then {late}"
            else:
                ok = seen == [float(t) for t in range(ahead + 1)]
                msg = f"seen {seen}"
        else:
            job.workers.Recv(np.zeros(1), source=0, tag=5)
            tab.push(one)
            job.clock()
        job.finish()
    _agree(ok, msg)


@pytest.mark.mpi
def test_many_outstanding_requests_complete_in_any_order():
    job = _job(2, 2) if _world_size() >= 4 else _job(1, 2)
    ok, msg = True, ""
    if job is not None and job.is_server:
        job.serve()
    elif job is not None:
        emb = job.sparse_table("e", 3, "float64", optimizer="sgd", lr=1.0, staleness=None)
        w = job.rank
        n = 200
        reqs = [emb.ipush(np.array([k, 10**15 + k]), np.full((2, 3), -1.0)) for k in range(n)]
        pulls = [emb.ipull(np.array([k])) for k in range(0, n, 10)]
        for r in reversed(reqs):
            r.wait()
        rows = [p.wait() for p in pulls]
        job.flush()
        job.workers.Barrier()
        got = emb.pull(np.concatenate((np.arange(n), 10**15 + np.arange(n))))
        ok = np.array_equal(got, np.full((2 * n, 3), float(job.num_workers))) and all(
            r.shape == (1, 3) and 1 <= r[0, 0] <= job.num_workers for r in rows)
        msg = f"worker {w}: {got[:3]} {[r[0, 0] for r in rows[:3]]}"
        job.finish()
    _agree(ok, msg)


def _world_size():
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_size()


@pytest.mark.mpi
def test_bad_requests_leave_the_tables_unchanged_and_the_servers_serving():
    from collectives import ps
    job = _job(2, 1) if _world_size() >= 3 else _job(1, 1)
    ok, msg = True, ""
    if job is not None and job.is_server:
        job.serve()
        ok = job.server.requests > 0
    elif job is not None:
        dense = job.dense_table("w", (5, 3), "float32", optimizer="sgd", lr=1.0,
                                init="uniform", init_scale=1.0)
        emb = job.sparse_table("emb", 4, "float32", optimizer="adam", lr=0.1, init="uniform",
                               init_scale=1.0)
        before = dense.pull(), emb.pull(np.arange(10))
        f32 = np.ones((1, 3), np.float32)
        errors = []
        cases = [
            (lambda: dense.push([5], f32), r"table 'w': push of key 5, outside rows \[0, 5\)"),
            (lambda: dense.pull([-1]), r"table 'w': pull of key -1, outside rows \[0, 5\)"),
            (lambda: dense.push([1], np.ones((1, 4), np.float32)),
             r"table 'w': push of rows shaped \(1, 4\) for 1 keys, expected \(1, 3\) \(key 1\)"),
            (lambda: emb.push([3], np.ones((1, 4), np.float64)),
             r"table 'emb': push of float64 rows, the table holds float32 \(key 3\)"),
            (lambda: dense.push(np.ones((5, 2), np.float32)),
             r"table 'w': push of shape \(5, 2\), the table is \(5, 3\)"),
            (lambda: emb.pull(np.array([1.5])), "table 'emb': pull ids must be integers"),
            # past the worker's checks: what the servers refuse
            (lambda: ps.DenseTable(job, dict(dense.spec, rows=9, shape=[9, 3]),
                                   dense.server_ids).push([8], f32),
             r"table 'w': push refused by server rank \d: key 8 is outside the table"),
            (lambda: ps.SparseTable(job, dict(emb.spec, dtype="float64"),
                                    emb.server_ids).push([2], np.ones((1, 4))),
             r"table 'emb': push refused by server rank \d: the table holds float32, this "
             r"handle float64"),
            (lambda: ps.SparseTable(job, dict(emb.spec, dim=5),
                                    emb.server_ids).push([2], np.ones((1, 5), np.float32)),
             r"table 'emb': push refused by server rank \d: 20 bytes do not match"),
            (lambda: ps.SparseTable(job, emb.spec, [99] * job.servers).pull([2]),
             r"table 'emb': pull refused by server rank \d: the server has no table with id 99"),
        ]
        import re
        for call, pattern in cases:
            try:
                call()
                errors.append(f"no error for {pattern}")
            except ps.TableError as exc:
                if not re.search(pattern, str(exc)):
                    errors.append(f"{exc!r} does not match {pattern!r}")
        try:
            job.table("nope")
            errors.append("no error for an unknown table")
        except KeyError as exc:
            if "no table 'nope' on the servers; tables: emb, w" not in str(exc):
                errors.append(repr(exc))
        try:
            job.dense_table("w", (5, 4), "float32")
            errors.append("no error for a conflicting spec")
        except ValueError as exc:
            if "table 'w' exists with other settings" not in str(exc):
                errors.append(repr(exc))
        after = dense.pull(), emb.pull(np.arange(10))
        unchanged = all(np.array_equal(a, b) for a, b in zip(before, after))
        dense.push([0, 0], np.ones((2, 3), np.float32))          # still serving
        job.clock()                                               # BSP: applied at the clock
        served = np.allclose(dense.pull([0])[0], before[0][0] - 2)
        same = job.table("emb") is emb and job.table("w").shape == (5, 3)
        ok = not errors and unchanged and served and same
        msg = f"{errors} unchanged={unchanged} served={served} same={same}"
        job.finish()
    _agree(ok, msg)


@pytest.mark.mpi
def test_stall_monitor_names_the_late_worker(setting):
    setting("COLLECTIVES_STALL_WARNING", "0.3")
    job = _job(1, 2)
    ok, msg = True, ""
    if job is not None and job.is_server:
        job.serve()
        named = [w for w in job.warnings if "worker rank 1 (at clock 0" in w]
        ok = bool(named) and "in a pull of table 'bsp' at clock 1 (staleness 0)" in named[0]
        msg = repr(job.warnings)
    elif job is not None:
        tab = job.dense_table("bsp", (2,), "float32", staleness=0)
        if job.rank == 1:
            time.sleep(1.5)
        job.clock()
        tab.pull()
        job.finish()
    _agree(ok, msg)


@pytest.mark.mpi
def test_init_refuses_a_job_without_workers():
    from mpi4py import MPI
    from collectives import ps
    size = MPI.COMM_WORLD.Get_size()
    for bad in (0, size, -1, 1.5):
        with pytest.raises(ValueError, match=f"servers must be an integer from 1 to {size - 1}"):
            ps.init(MPI.COMM_WORLD, servers=bad)


# -- the example under mpiexec ----------------------------------------------------------------
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep +
                       os.environ.get("PATH", ""))


def _example(n, *args, timeout=150):
    cmd = ["timeout", str(timeout), MPIEXEC, "-n", str(n), sys.executable,
           os.path.join(ROOT, "examples", "train_ps.py"), "--quiet", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 20)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
@pytest.mark.timeout(400)
def test_hybrid_example_moves_fewer_bytes_than_allreduce():
    common = ["--ids", "200000", "--steps", "12", "--compute", "0", "--seed", "3"]
    hybrid = _example(3, *common, "--staleness", "1")
    dense = _example(2, *common, "--mode", "allreduce")
    assert hybrid["mode"] == "ps" and hybrid["servers"] == 1 and hybrid["workers"] == 2
    assert hybrid["staleness"] == 1 and dense["workers"] == 2 and dense["staleness"] == 0
    assert hybrid["bytes_per_step"] * 10 <= dense["bytes_per_step"], (hybrid, dense)
    assert abs(hybrid["final_loss"] - dense["final_loss"]) < 0.5 * dense["final_loss"]
    for r in (hybrid, dense):
        assert r["steps"] == 12 and r["wall_s"] > 0 and r["final_loss"] > 0


@pytest.mark.mpi
def test_empty_and_one_row_tables_with_more_servers_than_rows():
    job = _job(2, 2) if _world_size() >= 4 else _job(1, 1)
    ok, msg = True, ""
    if job is not None and job.is_server:
        job.serve()
    elif job is not None:
        e = job.sparse_table("e", 3, staleness=None)
        d = job.dense_table("d", (1,), "float64", staleness=None, optimizer="momentum", lr=1.0,
                            momentum=0.5)
        shapes = [e.pull(np.array([], np.int64)).shape, e.pull(np.zeros((2, 0), int)).shape]
        e.push(np.array([], np.int64), np.zeros((0, 3), np.float32))
        d.push(np.ones(1))
        d.push(np.array([0]), np.ones(1))
        job.flush()
        job.workers.Barrier()
        pushes = 2 * job.num_workers
        want = -sum(sum(0.5 ** j for j in range(k + 1)) for k in range(pushes))
        got = d.pull(), d.pull([0, 0]), d.pull(np.array([[0]]))
        ok = (shapes == [(0, 3), (2, 0, 3)] and got[0].tolist() == [want]
              and got[1].tolist() == [want, want] and got[2].shape == (1, 1))
        msg = f"{shapes} {got} want {want}"
        job.finish()
    _agree(ok, msg)


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
@pytest.mark.timeout(300)
def test_bench_ps_prints_the_bytes_table(tmp_path):
    out = tmp_path / "runs.json"
    p = subprocess.run([sys.executable, "-m", "bench", "ps", "--no-stragglers", "--workers", "2",
                        "--ids", "50000", "--bytes-steps", "3", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "hybrid (1 server, MLP allreduce)" in p.stdout and "x fewer bytes" in p.stdout
    runs = json.loads(out.read_text())
    assert [r["mode"] for r in runs] == ["ps", "allreduce"]
    assert runs[0]["bytes_per_step"] * 10 <= runs[1]["bytes_per_step"]
