"""The restart path where the MPI library has no fault tolerance (MPICH): asynchronous sharded
checkpoints and the supervisor, ``python -m collectives.elastic run``.

In one process: a checkpoint written by 4 ranks' shards reads back whole, bit for bit, and
loads at another size. Real jobs (the in-process tier launches them; skipped under
``mpiexec``): a rank of ``examples/train_elastic.py`` killed with SIGKILL from outside, the
supervisor restarts the job on one rank fewer from the newest complete checkpoint, at most the
checkpoint interval of steps is lost, the restarted job's parameters are equal on every rank and
equal to a reference run from that checkpoint; SIGINT to the supervisor leaves no process.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from collectives import elastic  # noqa: E402
from tests.elastic_jobs import finish, kill_at  # noqa: E402
from collectives.elastic import checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_elastic.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
LIMIT = 240   # hard bound of one job (four ranks importing torch share two cores)
UNDER_MPI = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))


class _Comm:
    """A rank of a communicator of ``size``, for the checkpointer's bookkeeping only."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def bcast(self, obj, root=0):
        return obj


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for s in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    return elastic.State(model=model, optimizer=opt, step=7, epoch=1)


def test_a_shard_reads_back_bit_for_bit(tmp_path):
    """``save``/``load``: every dtype (bfloat16 and bool too), 0-d, empty and non-contiguous
    tensors, inside dicts, lists, tuples and a saved extra's state; a file that is not a shard
    or ends early is refused."""
    from collectives.elastic.state import Saved
    g = torch.Generator().manual_seed(0)
    part = {"model": {"w": torch.randn(5, 3, generator=g), "b16": torch.randn(7).bfloat16(),
                      "t": torch.randn(4, 6, generator=g).t(), "n": torch.tensor(3),
                      "e": torch.empty(0, 2), "mask": torch.tensor([True, False])},
            "opt": [{"step": 4, "m": torch.arange(6, dtype=torch.int64)}],
            "pair": (1.5, torch.ones(2, dtype=torch.float16)),
            "extra": Saved({"k": torch.zeros(3)})}
    checkpoint.save(part, tmp_path / "s")
    got = checkpoint.load(tmp_path / "s")

    def same(a, b):
        if torch.is_tensor(a):
            return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a, b))
        if isinstance(a, Saved):
            return isinstance(b, Saved) and same(a.state, b.state)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
        return a == b

    assert same(part, got)
    (tmp_path / "x").write_bytes(b"not a shard at all, nothing like it")
    with pytest.raises(ValueError, match="not a checkpoint shard"):
        checkpoint.load(tmp_path / "x")
    data = (tmp_path / "s").read_bytes()
    (tmp_path / "cut").write_bytes(data[:-5])
    with pytest.raises(ValueError, match="ends inside a tensor"):
        checkpoint.load(tmp_path / "cut")


def test_shards_of_four_ranks_read_back_whole_and_load_elsewhere(tmp_path):
    state = _state()
    commit = state.snapshot(8)
    writers = [checkpoint.Checkpointer(str(tmp_path), every=4, comm=_Comm(r, 4))
               for r in range(4)]
    for w in writers[:3]:
        w.on_commit(commit)
        w.close()
    assert checkpoint.newest(str(tmp_path)) is None       # rank 3's shard is missing
    writers[3].on_commit(commit)
    writers[3].close()
    step, path = checkpoint.newest(str(tmp_path))
    assert step == 8 and sorted(os.listdir(path)) == sorted(
        [f"shard-{r}-of-4.pt" for r in range(4)] + [f"done-{r}" for r in range(4)])
    back = checkpoint.read(path)
    assert back.next_step == 8 and back.extra == {"epoch": 1}
    assert back.model.keys() == commit.model.keys()
    assert all(torch.equal(back.model[k], commit.model[k]) for k in commit.model)
    for k, v in commit.optimizer["state"].items():
        assert all(torch.equal(back.optimizer["state"][k][n], t) if hasattr(t, "shape") else
                   back.optimizer["state"][k][n] == t for n, t in v.items())
    # Another process (another rank count) loads it into fresh objects.
    other = _state()
    with torch.no_grad():
        for p in other.model.parameters():
            p.zero_()
    reader = checkpoint.Checkpointer(str(tmp_path / "unused"), every=4, comm=_Comm(0, 3))
    shutil.copytree(path, tmp_path / "unused" / os.path.basename(path))
    assert reader.load_newest(other) == 8 and other.step == 8 and other.epoch == 1
    assert all(torch.equal(a, b) for a, b in zip(other.model.state_dict().values(),
                                                  state.model.state_dict().values()))


def test_only_every_kth_commit_is_written_and_old_ones_go(tmp_path):
    state = _state()
    ck = checkpoint.Checkpointer(str(tmp_path), every=2, comm=_Comm(0, 1), keep=2)
    ck.attach(state)
    for state.step in range(0, 7):
        state.commit()
        ck.close()                # one at a time, so that pruning is deterministic here
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("step-"))
    assert names == ["step-00000004", "step-00000006"]
    assert ck.written == 3


def test_a_partial_checkpoint_is_dropped_when_a_job_starts(tmp_path):
    state = _state()
    full = checkpoint.Checkpointer(str(tmp_path), every=1, comm=_Comm(0, 1))
    full.on_commit(state.snapshot(4))
    full.close()
    partial = checkpoint.Checkpointer(str(tmp_path), every=1, comm=_Comm(0, 2))
    partial.on_commit(state.snapshot(5))                    # rank 1 of 2 never wrote
    partial.close()
    fresh = _state()
    assert checkpoint.Checkpointer(str(tmp_path), every=1, comm=_Comm(0, 3)).load_newest(
        fresh) == 4
    assert not (tmp_path / "step-00000005").exists()


def test_supervisor_arguments():
    from collectives.elastic.supervisor import Supervisor
    with pytest.raises(ValueError, match="--min-np"):
        Supervisor(["true"], 2, 3)
    with pytest.raises(ValueError, match="no command"):
        Supervisor([], 2, 1)


# -- real jobs ----------------------------------------------------------------------------------
def _needs_mpich():
    if UNDER_MPI:
        pytest.skip("launches its own jobs: run the test without mpiexec")
    if not MPIEXEC.exists():
        pytest.skip("no mpiexec beside this python")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(PYTHONUNBUFFERED="1", COLLECTIVES_TIMEOUT="30")
    return env


def _supervise(*args, np_=3, min_np=2):
    cmd = [sys.executable, "-m", "collectives.elastic", "run", "--np", str(np_), "--min-np",
           str(min_np), "--", sys.executable, str(EXAMPLE), *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True)


def _finish(proc):
    return finish(proc, LIMIT)


def _json_lines(out):
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


@pytest.mark.timeout(3 * LIMIT)
def test_supervisor_restarts_from_the_newest_checkpoint(tmp_path):
    _needs_mpich()
    steps, every, victim, at = 16, 4, 1, 9
    ckpt = tmp_path / "ckpt"
    proc = _supervise("--steps", steps, "--checkpoint-dir", ckpt, "--checkpoint-every", every,
                      "--checkpoint-keep", steps, "--announce")
    read = kill_at(proc, victim, at, LIMIT)
    rc, out, err = _finish(proc)
    out = read + out
    assert rc == 0, err[-3000:]
    job, sup = _json_lines(out)[-2:]
    assert sup["supervisor"] and [a["ranks"] for a in sup["attempts"]] == [3, 2]
    assert sup["attempts"][0]["rc"] != 0 and sup["attempts"][1]["rc"] == 0
    assert job["path"] == "restart" and job["ranks_end"] == 2 and job["digests_equal"]
    # The restarted job began at the newest complete checkpoint before the kill: steps lost
    # (those finished before the kill and done again) are at most the interval.
    assert job["started_at"] % every == 0 and 0 < job["started_at"] <= at + 1
    assert at + 1 - job["started_at"] <= every
    # A reference: two ranks from that checkpoint, with the same data, end where it did.
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    src = ckpt / f"step-{job['started_at']:08d}"
    assert src.is_dir()
    shutil.copytree(src, ref_dir / src.name)
    ref = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, str(EXAMPLE), "--steps",
                          str(steps), "--quiet", "--checkpoint-dir", str(ref_dir),
                          "--checkpoint-every", str(10 * steps)],
                         capture_output=True, text=True, timeout=LIMIT, env=_env())
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = _json_lines(ref.stdout)[-1]
    assert r["started_at"] == job["started_at"] and r["digest"] == job["digest"]


@pytest.mark.timeout(2 * LIMIT)
def test_sigint_to_the_supervisor_leaves_no_process(tmp_path):
    _needs_mpich()
    marker = f"--checkpoint-dir={tmp_path}/never-used"
    proc = _supervise("--steps", 100000, marker, "--checkpoint-every", 1000)
    deadline = time.monotonic() + LIMIT
    for line in proc.stdout:
        if line.startswith("step 2 "):
            break
        assert time.monotonic() < deadline
    proc.send_signal(signal.SIGINT)
    rc, out, err = _finish(proc)
    assert rc == 130, err[-3000:]
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left: {left.stdout}"
