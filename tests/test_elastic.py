"""``collectives.elastic``: commit and restore in one process; real jobs that lose ranks (DDP,
ZeRO-2 and ZeRO-3, whose lost shards come back from their copies).

The job tests launch ``examples/train_elastic.py`` under Open MPI's ``mpirun --with-ft ulfm``
from the venv of its own (``make .venv-ompi``: the Open MPI wheel, beside MPICH's ``.venv``) and
kill ranks with SIGKILL, from outside the job or by the failure injector. They check that the
survivors finish every step, hold bitwise-equal parameters (every rank's digest), lose at most
one committed step per failure, and equal a reference run that starts from the committed state
they went back to, on as many ranks, with the same data. Recovery times are printed by the
example, not asserted. They run in the in-process tier (the test process is the launcher) and
are skipped where the Open MPI venv is missing or under ``mpiexec``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from collectives import elastic  # noqa: E402
from tests.elastic_jobs import finish, kill_at  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_elastic.py"
OMPI = ROOT / ".venv-ompi" / "bin"
# Hard bound of one job's wall time (a hang fails the test, never blocks CI); generous, since
# four ranks that each import torch share two cores.
LIMIT = 300
UNDER_MPI = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))


# -- in one process ---------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_restore_returns_to_the_commit_bitwise():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = elastic.State(model=model, optimizer=opt, step=0, epoch=3)
    for state.step in range(0, 3):
        _train(model, opt, state.step)
        state.commit()
    assert state.committed_steps() == (2, 3)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    for s in (3, 4):                       # steps that a failure will discard
        _train(model, opt, s)
    state.epoch = 9
    state.restore(3)
    assert state.step == 3 and state.epoch == 3
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert list(model.parameters()) == params      # in place: the optimizer keeps them
    # Going on from the restored state is the run that never saw the discarded steps.
    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    for s in range(0, 4):
        _train(ref, ref_opt, s)
    _train(model, opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(),
                                                  model.state_dict().values()))


def test_a_commit_reuses_the_tensors_of_the_one_it_pushes_out():
    """The third commit copies into the first one's tensors (no allocation a step), unless a
    reader (a checkpoint being written) still holds the first; the copies stay exact."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.State(model=model, optimizer=opt, step=0)

    def ptrs(c):
        return {t.data_ptr() for t in list(c.model.values()) +
                [v for st in c.optimizer["state"].values() for v in st.values()]}

    for state.step in range(0, 2):
        _train(model, opt, state.step)
        state.commit()
    first, second = state.commits
    first_ptrs = ptrs(first)
    _train(model, opt, 2)
    state.step = 2
    state.commit()
    assert ptrs(state.commits[-1]) == first_ptrs and state.commits[0] is second
    assert all(torch.equal(a, b) for a, b in zip(state.commits[-1].model.values(),
                                                  model.state_dict().values()))
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    saved = [v["momentum_buffer"] for v in state.commits[-1].optimizer["state"].values()]
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr()
               for a, b in zip(momentum, saved))
    held = state.commits[0]
    held.readers += 1                      # a checkpoint of it is being written
    held_ptrs = ptrs(held)
    _train(model, opt, 3)
    state.step = 3
    state.commit()
    assert not ptrs(state.commits[-1]) & held_ptrs
    assert all(torch.equal(a, b) for a, b in zip(held.model.values(), second.model.values()))


def test_an_averager_kept_as_an_extra_goes_back_with_the_commit_and_is_rebuilt():
    """An object with a state of its own (an averager) is committed by its ``state_dict``,
    loaded back into the same object on a restore, and rebuilt on the new communicator."""
    from mpi4py import MPI

    from collectives.torch import averaging
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    avg = averaging.Periodic(model, period=2, comm=MPI.COMM_SELF)
    state = elastic.State(model=model, optimizer=opt, step=0, averager=avg)
    for state.step in range(0, 3):
        _train(model, opt, state.step)
        avg.step()
        state.commit()
    for s in (3, 4):
        _train(model, opt, s)
        avg.step()
    assert avg.step_count == 5
    new = MPI.COMM_SELF.Dup()
    state.rebuild(new)
    state.restore()
    assert state.averager is avg and avg.step_count == 3 and avg.comm is new
    assert avg.communicators() == [new]     # what a failure revokes with the communicator
    assert state.committed_steps() == (2, 3)
    new.Free()


def test_restore_goes_back_to_the_older_commit():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.State(model=model, optimizer=opt)
    state.commit()                     # next step 1
    first = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 1)
    state.step = 1
    state.commit()                     # next step 2
    state.restore(1)
    assert state.step == 1 and state.committed_steps() == (1,)
    assert all(torch.equal(first[k], v) for k, v in model.state_dict().items())
    with pytest.raises(LookupError, match="no commit with next step 7"):
        state.restore(7)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_state_put_back_after_a_rebuild_is_the_run_without_it(stage):
    from mpi4py import MPI
    from collectives.torch import ShardedDataParallel

    def make():
        sdp = ShardedDataParallel(_model(), stage=stage, comm=MPI.COMM_SELF, algorithm="ring",
                                  registered_buffers=False)
        return sdp, torch.optim.Adam(sdp.parameters(), lr=0.1)

    def step(sdp, opt, i):
        g = torch.Generator().manual_seed(i)
        opt.zero_grad()
        sdp(torch.randn(5, 4, generator=g)).square().mean().backward()
        opt.step()

    sdp, opt = make()
    for i in range(2):
        step(sdp, opt, i)
    part = sdp.shard_state(opt)
    step(sdp, opt, 2)                    # discarded by the failure
    sdp.rebuild(MPI.COMM_SELF)
    sdp.load_shards(opt, [part])
    step(sdp, opt, 2)
    ref, ref_opt = make()
    for i in range(3):
        step(ref, ref_opt, i)
    a, b = sdp.full_state_dict(), ref.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_failure_injector_parse():
    assert elastic.FailureInjector.parse("2:5, 1:9").plan == {(2, 5), (1, 9)}
    assert elastic.FailureInjector.parse("").plan == set()
    with pytest.raises(ValueError, match="expected RANK:STEP"):
        elastic.FailureInjector.parse("2-5")


def test_run_refuses_what_it_cannot_do():
    state = elastic.State(model=_model())
    with pytest.raises(ValueError, match="exclude each other"):
        elastic.run(state, select=lambda c: c, replace=True)
    with pytest.raises(ValueError, match="replace must be True or"):
        elastic.run(state, replace="python train.py")
    with pytest.raises(ValueError, match="min_ranks must be a positive integer"):
        elastic.run(state, min_ranks=0)


def test_rebind_keeps_the_shards_or_refuses():
    from mpi4py import MPI
    from collectives.torch import tensor_parallel as tp
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    tp.parallelize(module, MPI.COMM_SELF, {"0": "colwise", "1": "rowwise"})
    other = MPI.COMM_SELF.Dup()
    tp.rebind(module, other)
    assert all(m.comm is other for m in module if getattr(m, "tp_split", None))
    two = MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None
    if two is not None:
        with pytest.raises(ValueError, match="the shards would not match"):
            tp.rebind(module, two)
    other.Free()


def test_global_batches_keep_the_global_batch():
    b = elastic.GlobalBatches(100, 12, seed=1)
    for size in (1, 3, 4):
        parts = [b.indices(5, r, size) for r in range(size)]
        assert sorted(int(i) for p in parts for i in p) == sorted(int(i) for i in b.step(5))
    assert len(set(int(i) for i in b.step(0)) & set(int(i) for i in b.step(1))) == 0


def test_process_failure_reads_the_error_through_torch():
    from mpi4py import MPI
    text = MPI.Get_error_string(MPI.ERR_PROC_FAILED)
    assert elastic.process_failure(RuntimeError(f"Got the following error when running the "
                                                f"callback: Exception: {text}"))
    assert not elastic.process_failure(RuntimeError("something else"))


def test_under_ulfm_the_transport_tests_one_request_at_a_time():
    """Waitany, Testany and Testsome free every request of their array that ULFM marked
    failed, a send still in flight included (collectives.executor): none may be called."""
    from types import SimpleNamespace

    import numpy as np
    from mpi4py import MPI

    from collectives.executor import MPITransport
    t = MPITransport(MPI.COMM_SELF.Dup())
    t.singly = True
    t._mpi = SimpleNamespace(Status=MPI.Status, BYTE=MPI.BYTE, Exception=MPI.Exception)
    for wait in (True, False):
        got = np.zeros(6, np.uint8)
        handles = [t.irecv(got, 0, 5), t.isend(np.arange(6, dtype=np.uint8), 0, 5)]
        counts, left = {}, list(range(len(handles)))
        while left:
            done = [t.waitany(handles)] if wait else t.testsome(handles)
            for k, status in sorted(done, key=lambda d: -d[0]):
                counts[left.pop(k)] = status.Get_count(MPI.BYTE)
                handles.pop(k)
        assert list(got) == list(range(6)) and counts[0] == 6


def test_under_ulfm_point_to_point_waits_test_one_request_at_a_time(monkeypatch):
    """The same for collectives.p2p (the pipeline's messages, torch's send/recv on the
    backend): its reap and its wait never call Testsome or Testall under ULFM."""
    from types import SimpleNamespace

    import numpy as np
    from mpi4py import MPI

    from collectives import p2p
    comm = MPI.COMM_SELF.Dup()
    monkeypatch.setattr(p2p, "ulfm_launched", lambda: True)
    monkeypatch.setattr(p2p, "_mpi", lambda: SimpleNamespace())   # no Testsome, no Testall
    got = np.zeros(6, np.uint8)
    sends = p2p.Sends()
    recv = comm.Irecv(got, 0, 5)
    sends.add(comm.Isend(np.arange(6, dtype=np.uint8), 0, 5))
    p2p.wait_all([recv], "a receive", comm)
    sends.reap()
    assert list(got) == list(range(6)) and len(sends) == 0
    comm.Free()


def test_testsome_raises_the_error_the_status_holds():
    import numpy as np
    from mpi4py import MPI

    from collectives.executor import MPITransport
    if "Open MPI" in MPI.Get_library_version():
        pytest.skip("Open MPI reports no truncation of a message a rank sends itself")
    t = MPITransport(MPI.COMM_SELF.Dup())
    t.singly = False
    handles = [t.irecv(np.zeros(4, np.uint8), 0, 3), t.isend(np.ones(8, np.uint8), 0, 3)]
    with pytest.raises(MPI.Exception) as err:
        for _ in range(100000):
            t.testsome(handles)
    # Not ERR_IN_STATUS: elastic training tells a revoked communicator apart by its class.
    assert err.value.Get_error_class() == MPI.ERR_TRUNCATE


# -- real jobs ----------------------------------------------------------------------------------
def _ompi_job(n, *args, ft=True):
    if UNDER_MPI:
        pytest.skip("launches its own mpirun jobs: run the test without mpiexec")
    if not (OMPI / "mpirun").exists():
        pytest.skip("no Open MPI venv (make .venv-ompi)")
    cmd = [str(OMPI / "mpirun"), "--oversubscribe", "-n", str(n)]
    if ft:
        cmd[1:1] = ["--with-ft", "ulfm"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLLECTIVES_", "OMPI_",
                                                                   "PMIX_", "PRTE_"))}
    # A failure must never leave a survivor waiting: the watchdog bounds any hang.
    env.update(PYTHONUNBUFFERED="1", COLLECTIVES_TIMEOUT="30")
    return subprocess.Popen(cmd + [str(OMPI / "python"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _finish(proc, limit=LIMIT):
    return finish(proc, limit)


def _summary(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, out
    return json.loads(lines[-1])


def _steps(out: str) -> list[tuple[int, int]]:
    return [(int(w[1]), int(w[3])) for w in (ln.split() for ln in out.splitlines())
            if len(w) == 6 and w[0] == "step"]


def _reference(tmp_path, restored, n, steps):
    rc, out, err = _finish(_ompi_job(n, EXAMPLE, "--steps", steps, "--quiet", "--resume",
                                     restored))
    assert rc == 0, err[-3000:]
    return _summary(out)


@pytest.mark.timeout(3 * LIMIT)
def test_sigkill_from_outside_survivors_finish_and_match_a_reference(tmp_path):
    steps, victim, at = 16, 2, 7
    restored = tmp_path / "restored.pt"
    proc = _ompi_job(4, EXAMPLE, "--steps", steps, "--announce", "--save-restored", restored)
    read = kill_at(proc, victim, at, LIMIT)
    rc, out, err = _finish(proc)
    out = read + out
    assert rc == 0, err[-3000:]
    s = _summary(out)
    assert s["path"] == "ulfm" and s["ranks_end"] == 3 and s["digests_equal"], s
    assert [r["lost"] for r in s["recoveries"]] == [[victim]]
    assert s["recoveries"][0]["steps_lost"] <= 1
    done = [st for st, _ in _steps(out)]
    assert set(range(steps)) <= set(done)  # every step was finished by the survivors
    ref = _reference(tmp_path, restored, 3, steps)
    assert ref["started_at"] == s["recoveries"][0]["restored"]
    assert ref["digest"] == s["digest"]


@pytest.mark.timeout(3 * LIMIT)
def test_three_failures_down_to_one_rank(tmp_path):
    restored = tmp_path / "restored.pt"
    rc, out, err = _finish(_ompi_job(4, EXAMPLE, "--steps", 14, "--kill", "1:3,3:6,2:10",
                                     "--save-restored", restored))
    assert rc == 0, err[-3000:]
    s = _summary(out)
    assert [r["lost"] for r in s["recoveries"]] == [[1], [3], [2]], s
    assert [r["ranks"] for r in s["recoveries"]] == [3, 2, 1]
    assert all(r["steps_lost"] <= 1 for r in s["recoveries"])
    assert s["ranks_end"] == 1 and s["digests_equal"]
    assert [size for st, size in _steps(out) if st in (2, 5, 9, 13)] == [4, 3, 2, 1]


@pytest.mark.timeout(3 * LIMIT)
def test_detects_no_fault_tolerance_without_with_ft(tmp_path):
    script = tmp_path / "ft.py"
    script.write_text("from collectives import elastic\nprint('ft', elastic.fault_tolerant())\n")
    rc, out, err = _finish(_ompi_job(2, script, ft=False))
    assert rc == 0, err[-3000:]
    assert out.split().count("False") == 2 and "True" not in out
    rc, out, err = _finish(_ompi_job(2, script, ft=True))
    assert rc == 0, err[-3000:]
    assert out.split().count("True") == 2


def test_detects_no_fault_tolerance_under_mpich(tmp_path):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if UNDER_MPI or not mpiexec.exists():
        pytest.skip("needs MPICH's mpiexec beside this python, outside mpiexec")
    script = tmp_path / "ft.py"
    script.write_text("from collectives import elastic\nprint('ft', elastic.fault_tolerant())\n")
    proc = subprocess.run([str(mpiexec), "-n", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=LIMIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split().count("False") == 2


@pytest.mark.timeout(3 * LIMIT)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_shards_rebuilt_from_their_copies(tmp_path, stage):
    steps, restored = 10, tmp_path / "restored.pt"
    rc, out, err = _finish(_ompi_job(4, EXAMPLE, "--steps", steps, "--zero", stage, "--kill",
                                     "1:5", "--save-restored", restored))
    assert rc == 0, err[-3000:]
    s = _summary(out)
    assert [r["lost"] for r in s["recoveries"]] == [[1]] and s["digests_equal"], s
    assert s["recoveries"][0]["steps_lost"] <= 1 and s["ranks_end"] == 3
    assert set(range(steps)) <= {st for st, _ in _steps(out)}
    rc, out, err = _finish(_ompi_job(3, EXAMPLE, "--steps", steps, "--zero", stage, "--quiet",
                                     "--resume", restored))
    assert rc == 0, err[-3000:]
    ref = _summary(out)
    assert ref["started_at"] == s["recoveries"][0]["restored"]
    assert ref["digest"] == s["digest"]


@pytest.mark.timeout(3 * LIMIT)
def test_torch_ddp_on_the_backend_goes_on_over_the_rebuilt_group(tmp_path):
    """torch's own DDP over the toolkit's backend of torch.distributed: elastic training
    rebuilds torch's default group on the survivors (the example wraps the model again on it),
    and the run equals a 3-rank job started from the commit."""
    steps, restored = 12, tmp_path / "restored.pt"
    rc, out, err = _finish(_ompi_job(4, EXAMPLE, "--torch-ddp", "--steps", steps, "--kill", "1:5",
                                     "--save-restored", restored))
    assert rc == 0, err[-3000:]
    s = _summary(out)
    assert [r["lost"] for r in s["recoveries"]] == [[1]] and s["digests_equal"], s
    assert s["recoveries"][0]["steps_lost"] <= 1 and s["ranks_end"] == 3
    assert [size for st, size in _steps(out) if st in (4, 11)] == [4, 3]
    rc, out, err = _finish(_ompi_job(3, EXAMPLE, "--torch-ddp", "--steps", steps, "--quiet",
                                     "--resume", restored))
    assert rc == 0, err[-3000:]
    ref = _summary(out)
    assert ref["started_at"] == s["recoveries"][0]["restored"]
    assert ref["digest"] == s["digest"]


# -- a dp x tp mesh, and replacements ---------------------------------------------------------
def _mesh_drops_a_group(tmp_path, n, dp, *more):
    """Rank 2 of an (n / 2) x 2 mesh (dp x tp, or dp x pp: ``more``) killed at step 5: its
    replica [2, 3] is dropped, the others go on as a ``dp`` x 2 mesh, equal bitwise to such a
    job started from their commit."""
    steps, restored = 10, tmp_path / "restored.pt"
    rc, out, err = _finish(_ompi_job(n, EXAMPLE, "--steps", steps, "--kill", "2:5",
                                     "--save-restored", restored, *more))
    assert rc == 0, err[-3000:]
    s = _summary(out)
    assert s["mesh"] == [dp, 2] and s["ranks_end"] == 2 * dp and s["digests_equal"], s
    (r,) = s["recoveries"]
    assert (r["lost"], r["left"], r["ranks"]) == ([2], [3], 2 * dp) and r["steps_lost"] <= 1
    assert "rank 3 left at step" in out
    assert set(range(steps)) <= {st for st, _ in _steps(out)}
    assert [size for st, size in _steps(out) if st in (4, 9)] == [n, 2 * dp]
    rc, out, err = _finish(_ompi_job(2 * dp, EXAMPLE, "--steps", steps, "--quiet",
                                     "--resume", restored, *more))
    assert rc == 0, err[-3000:]
    ref = _summary(out)
    assert ref["started_at"] == r["restored"] and ref["mesh"] == [dp, 2]
    assert ref["digest"] == s["digest"]


@pytest.mark.timeout(3 * LIMIT)
@pytest.mark.parametrize("job", [["--tp", "2"], ["--tp", "2", "--zero", "2"],
                                 ["--tp", "2", "--sequence-parallel"], ["--pp", "2"]],
                         ids=["tp", "tp_zero2", "tp_sp", "pp"])
def test_mesh_drops_the_replica_of_the_dead_rank(tmp_path, job):
    """A tp group dropped; with ZeRO-2 over dp as well (the survivor's dp axis pools its part
    and the dropped rank's, its copy, and cuts them for one rank); with sequence parallelism
    (the hooks that sum the norms' gradients follow the new tp group); and a pipeline of two
    stages dropped (the runner, DDP per stage and the tied pair rebuilt on the survivors)."""
    _mesh_drops_a_group(tmp_path, 4, 1, *job)


@pytest.mark.timeout(3 * LIMIT)
def test_a_3_by_2_mesh_goes_on_as_2_by_2(tmp_path):
    """Two complete groups survive: DDP goes on over the new dp axis of 2 ranks."""
    _mesh_drops_a_group(tmp_path, 6, 2, "--tp", "2")


def _uninterrupted(steps, *more):
    rc, out, err = _finish(_ompi_job(4, EXAMPLE, "--steps", steps, "--quiet", *more))
    assert rc == 0, err[-3000:]
    return _summary(out)["digest"]


@pytest.mark.timeout(3 * LIMIT)
@pytest.mark.parametrize("ddp", [[], ["--torch-ddp"], ["--zero", "2"]],
                         ids=["ddp", "torch_ddp", "zero2"])
def test_a_replacement_receives_the_state_from_a_peer(tmp_path, ddp):
    """Also under torch's DDP over the toolkit's backend (the replacement's default group, its
    own launch's, and the survivors' are made again on the merged communicator) and under
    ZeRO-2 (the survivors' parts, the lost one's from its copy, cut again for the full size:
    the replacement's shard comes from its peers)."""
    steps = 12
    rc, out, err = _finish(_ompi_job(4, EXAMPLE, "--steps", steps, "--kill", "2:5",
                                     "--replace", *ddp))
    assert rc == 0, err[-3000:]     # no later failure: every process finalizes
    s = _summary(out)
    (r,) = s["recoveries"]
    assert (r["lost"], r["joined"], r["ranks"]) == ([2], [4], 4) and r["steps_lost"] <= 1
    assert s["ranks_end"] == 4 and s["digests_equal"]     # the replacement's digest too
    assert {size for _, size in _steps(out)} == {4}
    # The restored commit and the global batch are kept: the run equals one that never failed.
    assert _uninterrupted(steps, *ddp) == s["digest"]


@pytest.mark.timeout(3 * LIMIT)
def test_replacements_bring_the_job_back_to_four_ranks(tmp_path):
    steps = 12
    rc, out, err = _finish(_ompi_job(4, EXAMPLE, "--steps", steps, "--kill", "1:3,3:6,2:9",
                                     "--replace"))
    # After a failure among processes a spawn connected, they end without MPI_Finalize (it
    # would wait for the dead ones), and mpirun exits 1 though every rank finished.
    said = " ".join((out + err).split())
    ended = ("exiting improperly" in said or "LAUNCHER JOB OBJECT NOT FOUND" in said)
    assert rc == 0 or (rc == 1 and ended), err[-3000:]
    s = _summary(out)
    rs = s["recoveries"]
    assert [r["lost"] for r in rs] == [[1], [3], [2]], s
    assert [r["joined"] for r in rs] == [[4], [5], [6]]
    assert [r["ranks"] for r in rs] == [4, 4, 4] and all(r["steps_lost"] <= 1 for r in rs)
    assert s["ranks_end"] == 4 and s["digests_equal"]     # the replacements' digests too
    assert set(range(steps)) <= {st for st, _ in _steps(out)}
    assert {size for _, size in _steps(out)} == {4}
    assert _uninterrupted(steps) == s["digest"]
