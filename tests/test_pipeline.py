"""``pp.Pipeline`` under MPI: every schedule trains exactly as one process on the whole batch.

Each case runs on a sub-communicator of the first p ranks (the others wait at the agreement),
so the tests run at any n >= 2 and skip below. After 3 SGD steps every rank's stage parameters
are compared with one process that took the same steps on the whole batch (float32 tolerance),
and the loss every rank returns with the reference's. Then shapes: learned once, learned again
when the batch changes. The in-process tier runs ``split`` and, as real ``mpiexec -n 2`` jobs
(tests/faults/pipeline.py), a stage that raises and a gradient of the wrong shape: each ends
the job, naming the stages.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from collectives.torch import pipeline as pp  # noqa: E402
from mpiutil import assert_all, world  # noqa: E402

torch.set_num_threads(1)

WIDTH, BATCH, STEPS, LR = 6, 10, 3, 0.1   # 10 rows: micro-batches of unequal sizes at m = 4


def _model(pieces, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(pieces):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _data(step, rows=BATCH):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def _sub(p):
    """The communicator of ranks 0..p-1 (None on the others)."""
    from mpi4py import MPI
    comm = world()
    if comm.Get_size() < p:
        pytest.skip(f"needs {p} ranks")
    sub = comm.Split(0 if comm.Get_rank() < p else MPI.UNDEFINED, comm.Get_rank())
    return None if sub == MPI.COMM_NULL else sub


CASES = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zero_bubble")
         for p in (2, 3, 4) for m in (1, 4)] + \
        [("interleaved", p, m, 2) for p in (2, 3) for m in (1, 2, 4)]


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,p,m,v", CASES)
def test_pipeline_equals_one_process(name, p, m, v):
    comm = _sub(p)
    ok, msg = True, ""
    if comm is not None:
        r = comm.Get_rank()
        sched = pp.schedule(name, p, m, v)
        model = _model(p * v)
        stages = pp.split(model, [str(2 * k) for k in range(1, p * v)])
        runner = pp.Pipeline([stages[s] for s in sched.local_stages(r)], comm=comm,
                             schedule=sched, loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(list(runner.parameters()), lr=LR)
        ref = _model(p * v)
        ropt = torch.optim.SGD(ref.parameters(), lr=LR)
        for step in range(STEPS):
            x, y = _data(step)
            opt.zero_grad()
            loss = runner.step(x if r == 0 else None, y if r == p - 1 else None)
            opt.step()
            ropt.zero_grad()
            want = nn.functional.mse_loss(ref(x), y)
            want.backward()
            ropt.step()
            if abs(loss.item() - want.item()) > 1e-5 * max(1.0, abs(want.item())):
                ok, msg = False, f"step {step}: loss {loss.item()} != {want.item()}"
        # activations held, counted on the runner's graphs, as predicted (gpipe: m, 1f1b:
        # min(p - r, m))
        want = pp.simulate(sched).peak[r]
        if runner.peak != want or (r == 0 and name in ("gpipe", "1f1b") and
                                   runner.peak != (m if name == "gpipe" else min(p, m))):
            ok, msg = False, f"rank {r} held {runner.peak} activations, predicted {want}"
        ours = dict(model.named_parameters())   # the stages share model's parameters
        mine = {n for s in sched.local_stages(r) for n in (f"{2 * s}.weight", f"{2 * s}.bias")}
        for n, q in ref.named_parameters():
            if n in mine and not torch.allclose(ours[n], q, rtol=1e-4, atol=1e-6):
                ok, msg = False, f"{n}: {(ours[n] - q).abs().max().item()} off after {STEPS} steps"
        comm.Free()
    assert_all(ok, f"{name} p={p} m={m} v={v}: {msg}")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_shapes_are_learned_once_and_again_when_they_change():
    comm = _sub(2)
    ok, msg = True, ""
    if comm is not None:
        r = comm.Get_rank()
        sched = pp.schedule("1f1b", 2, 2)
        stages = pp.split(_model(2), ["2"])
        runner = pp.Pipeline(stages[r], comm=comm, schedule=sched,
                             loss_fn=nn.functional.mse_loss)
        counts = []
        for rows in (8, 8, 8, 12, 12, 8):
            x, y = _data(0, rows)
            runner.step(x, y)
            counts.append(runner.headers_sent)
        # one header per message name (2 micro-batches, one direction per rank) at first,
        # none while the shapes hold, then again at each change
        want = [2, 2, 2, 4, 4, 6]
        if counts != want:
            ok, msg = False, f"headers sent after each step {counts}, expected {want}"
        comm.Free()
    assert_all(ok, msg)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_rebind_goes_on_over_another_group_of_the_same_ranks():
    """``Pipeline.rebind`` (a survivors' pipeline after a failure): the step over the new
    communicator gives the loss it gave before, its shapes announced again; a group of
    another size is refused."""
    from mpi4py import MPI
    comm = _sub(2)
    ok, msg = True, ""
    if comm is not None:
        r = comm.Get_rank()
        runner = pp.Pipeline(pp.split(_model(2), ["2"])[r], comm=comm,
                             schedule=pp.schedule("1f1b", 2, 2), loss_fn=nn.functional.mse_loss)
        x, y = _data(0)
        before = runner.step(x, y).item()
        runner.rebind(comm.Dup())
        after = runner.step(x, y).item()
        ok = before == after and runner.headers_sent == 4 and runner.communicators()[0] != comm
        msg = f"loss {before} then {after}, {runner.headers_sent} headers"
        with pytest.raises(ValueError, match="the stages would not match"):
            runner.rebind(MPI.COMM_SELF)
        comm.Free()
    assert_all(ok, msg)


# -- in-process tier -------------------------------------------------------------------------

def test_split_by_names():
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)),
                          nn.Linear(4, 2))
    names = [n for n, _ in pp.split.__globals__["pieces"](model)]
    assert names == ["0", "1.0", "1.1", "2"]
    stages = pp.split(model, ["1.1", "2"])
    assert [len(s) for s in stages] == [2, 1, 1]
    x = torch.randn(5, 3)
    y = x
    for s in stages:
        y = s(y)
    assert torch.equal(y, model(x))
    assert stages[1][0].weight is model[1][1].weight
    with pytest.raises(ValueError, match="no piece named 'body'"):
        pp.split(model, ["body"])
    with pytest.raises(ValueError, match="in model order"):
        pp.split(model, ["2", "1.1"])
    with pytest.raises(ValueError, match="has its own forward"):
        pp.split(nn.Linear(2, 2), ["0"])


FAULT = Path(__file__).resolve().parent / "faults" / "pipeline.py"
UNDER_MPI = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))


def _job(mode, timeout=10):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    if mpiexec is None or UNDER_MPI:
        pytest.skip("launches its own mpiexec -n 2 job: run without mpiexec")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(COLLECTIVES_TIMEOUT=str(timeout), PYTHONPATH=str(FAULT.parents[2]))
    return subprocess.run([mpiexec, "-n", "2", sys.executable, str(FAULT), mode],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.timeout(90)
def test_a_stage_that_raises_ends_the_job_naming_it():
    job = _job("raise")
    text = job.stdout + job.stderr
    assert job.returncode != 0, text
    assert "pipeline stage 1 (rank 1 of 2) raised RuntimeError in action" in text, text
    assert "stage one is broken" in text


@pytest.mark.timeout(90)
def test_a_gradient_of_the_wrong_shape_names_both_stages():
    job = _job("mismatch")
    text = job.stdout + job.stderr
    assert job.returncode != 0, text
    assert "stage 1 (rank 1) sent a gradient of torch.float32 (2, 5)" in text, text
    assert "but stage 0 (rank 0) produced an output of torch.float32 (2, 6)" in text, text


@pytest.mark.timeout(90)
def test_a_stage_that_never_answers_is_named_by_the_watchdog():
    """Stage 1 never starts its step: stage 0's receive is p2p's watched wait, so the watchdog
    names the stage, the gradient it waits for and the rank, and ends the job (exit 124)."""
    job = _job("stall", timeout=3)
    text = job.stdout + job.stderr
    assert job.returncode == 124, text
    assert "pipeline stage 0 (rank 0 of 2, 1f1b) did not complete in" in text, text
    assert "waiting for: the gradient of micro-batch 0 from rank 1" in text, text
    assert "aborting the job: MPI_Abort(COMM_WORLD, 124)" in text, text


# -- pipeline x data (x tensor): the GPT of examples/train_gpt.py ----------------------------

def _example():
    from bench.tp import train_gpt_module
    return train_gpt_module()


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape,schedule,zero", [((2, 2, 1), "1f1b", 0),
                                                 ((2, 2, 1), "zero_bubble", 1),
                                                 ((2, 2, 2), "1f1b", 0)])
def test_gpt_3d_equals_one_process(shape, schedule, zero):
    """pp x dp (x tp) on the first prod(shape) ranks, DDP or ZeRO-1 over dp: full parameters
    after 3 steps (the tied embedding included) equal one process on the whole batch."""
    import math
    from mpi4py import MPI

    from collectives import Mesh
    from collectives.torch import tensor_parallel as tp
    from collectives.torch.pipeline import gpt as pgpt
    n = math.prod(shape)
    comm = world()
    if comm.Get_size() < n:
        pytest.skip(f"needs {n} ranks")
    sub = comm.Split(0 if comm.Get_rank() < n else MPI.UNDEFINED, comm.Get_rank())
    ok, msg = True, ""
    if sub != MPI.COMM_NULL:
        ex = _example()
        args = ex.parser().parse_args(["--dim", "16", "--heads", "2", "--layers", "2",
                                       "--seq", "8", "--batch", "8", "--vocab", "24"])
        text = torch.arange(400) % 24
        mesh = Mesh(shape, ("pp", "dp", "tp"), comm=sub)
        tp_comm, dp = mesh.comm("tp"), mesh.size("dp")
        torch.manual_seed(0)
        model = ex.GPT(args.vocab, args.dim, args.heads, args.layers)
        tp.parallelize(model, tp_comm, ex.plan(model, False))
        job = pgpt.PipelinedGPT(model, mesh, schedule=schedule, microbatches=2, zero=zero,
                                loss_fn=lambda z, y: tp.vocab_parallel_cross_entropy(z, y,
                                                                                     tp_comm))
        opt = torch.optim.SGD(list(job.parameters()), lr=0.5)
        rows, me = args.batch // dp, mesh.coord("dp")

        def batches(step):
            x, y = ex.batch(text, step, args.batch, args.seq, 0)
            return x[me * rows:(me + 1) * rows], y[me * rows:(me + 1) * rows]

        losses, _ = pgpt.train(job, opt, batches, 3, mesh)
        torch.manual_seed(0)
        ref = ex.GPT(args.vocab, args.dim, args.heads, args.layers)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
        want = []
        for step in range(3):
            x, y = ex.batch(text, step, args.batch, args.seq, 0)
            loss = nn.functional.cross_entropy(ref(x).reshape(-1, args.vocab), y.reshape(-1))
            loss.backward()
            ropt.step()
            ropt.zero_grad()
            want.append(loss.item())
        if max(abs(a - b) for a, b in zip(losses, want)) > 1e-4:
            ok, msg = False, f"losses {losses} != {want}"
        for wrapper in job.stages:   # ZeRO: the full parameters from the stepped shards
            if hasattr(wrapper, "forward_refresh"):
                wrapper.forward_refresh()
        full = tp.full_state_dict(model, tp_comm)
        k, p = mesh.coord("pp"), mesh.size("pp")
        mine = {"embed.weight"} if k == 0 else set()
        if k == p - 1:
            mine |= {n for n in full if n.startswith(("norm.", "head."))}
        for s in job.schedule.local_stages(k):
            for i, blk in enumerate(model.blocks):
                if any(blk is b for b in pgpt.stages(model, job.schedule.stages)[s].blocks):
                    mine |= {n for n in full if n.startswith(f"blocks.{i}.")}
        refs = ref.state_dict()
        for name in sorted(mine):
            if not torch.allclose(full[name], refs[name], rtol=1e-4, atol=1e-5):
                ok, msg = False, (msg + f"{name}: {(full[name] - refs[name]).abs().max().item():.2e} "
                                  f"off after 3 steps; ")
        sub.Free()
    assert_all(ok, f"{shape} {schedule} zero={zero}: {msg}")
