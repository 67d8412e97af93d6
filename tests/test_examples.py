"""The example jobs of the new collectives, run as real ``mpiexec -n 3`` jobs (in-process tier:
the test process is the launcher; skipped under mpiexec)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
UNDER_MPI = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))


def run(script, *args, n=3, limit=240) -> str:
    if UNDER_MPI:
        pytest.skip("launches its own mpiexec jobs: run the test without mpiexec")
    if not MPIEXEC.exists():
        pytest.skip("mpiexec not found beside the interpreter")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(PYTHONUNBUFFERED="1", MPIEXEC_TIMEOUT=str(limit))
    done = subprocess.run([str(MPIEXEC), "-n", str(n), sys.executable,
                           str(ROOT / "examples" / script), *args], capture_output=True,
                          text=True, timeout=limit + 30, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.timeout(600)
def test_fsdp_example_matches_gloo():
    ours = run("train_fsdp.py", "--steps", "8")
    gloo = run("train_fsdp.py", "--steps", "8", "--backend", "gloo")
    a = [float(v) for v in re.findall(r"loss ([0-9.]+)", ours)]
    b = [float(v) for v in re.findall(r"loss ([0-9.]+)", gloo)]
    assert len(a) == len(b) == 8, (ours, gloo)
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b)), (a, b)
    assert "parameters on this rank" in ours


@pytest.mark.timeout(600)
@pytest.mark.parametrize("top_k", ["1", "2"])
def test_moe_example_loss_falls(top_k):
    out = run("train_moe.py", "--epochs", "4", "--steps", "15", "--top-k", top_k)
    losses = [float(v) for v in re.findall(r"epoch \d+: loss ([0-9.]+)", out)]
    assert len(losses) == 4, out
    assert losses[-1] < 0.5 * losses[0], losses
    sent = re.findall(r"KiB sent per step by each rank \[([^\]]+)\]", out)
    assert sent and all(float(v) > 0 for v in sent[-1].split(",")), out


def run_one_process(script, *args, limit=240) -> str:
    """``python examples/<script> args`` in one process (no mpiexec)."""
    if UNDER_MPI:
        pytest.skip("launches its own jobs: run the test without mpiexec")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args],
                          capture_output=True, text=True, timeout=limit, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.timeout(600)
def test_ddp_example_first_epoch_is_one_process_on_the_global_batch():
    """docs/torch.md: n ranks at --batch B take the steps one process takes at --batch n*B, up
    to float32 rounding; the first epoch's loss agrees to the printed digits."""
    common = ("--epochs", "1", "--samples", "384", "--no-progress")
    ranks = run("train_ddp.py", "--batch", "32", *common, n=2)
    single = run_one_process("train_ddp.py", "--batch", "64", *common)
    a = [float(v) for v in re.findall(r"epoch 1  loss ([0-9.]+)", ranks)]
    b = [float(v) for v in re.findall(r"epoch 1  loss ([0-9.]+)", single)]
    assert len(a) == len(b) == 1, (ranks, single)
    assert abs(a[0] - b[0]) <= 1e-4, (a, b)
    assert "2 ranks" in ranks and "1 ranks" in single
