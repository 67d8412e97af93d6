"""The timeline (``COLLECTIVES_TIMELINE``): a valid Chrome trace per rank of a real DDP job.

In-process: the per-rank file names. Launcher tier (the test runs ``mpiexec -n 2`` itself,
skipped under mpiexec): a DDP job with the timeline on writes one file per rank; every event has
name, ph, ts, pid, tid; the collectives carry algorithm and bytes; DDP's buckets (ready,
started, done) and the forward, backward and optimizer phases are there, on the rank's pid.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from collectives import timeline

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
UNDER_MPI = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))

JOB = textwrap.dedent("""
    import torch
    from torch import nn
    from collectives.torch import DistributedDataParallel as DDP
    import collectives as coll
    import numpy as np
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    ddp = DDP(net, bucket_cap_mb=1e-3)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
    coll.allreduce(np.arange(7, dtype=np.float64), algorithm="ring")
""")


def test_path_for_each_rank():
    assert timeline.path_for("t.json", 0, 1) == "t.json"
    assert timeline.path_for("t.json", 2, 3) == "t.2.json"
    assert timeline.path_for("out/t", 1, 2) == "out/t.1.json"
    assert timeline.path_for("t-{rank}.trace", 4, 5) == "t-4.trace"


@pytest.mark.timeout(300)
def test_a_ddp_job_writes_a_valid_trace_per_rank(tmp_path):
    pytest.importorskip("torch")
    if UNDER_MPI:
        pytest.skip("launches its own mpiexec job: run the test without mpiexec")
    if not MPIEXEC.exists():
        pytest.skip("mpiexec not found beside the interpreter")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(COLLECTIVES_TIMELINE=str(tmp_path / "trace.json"), MPIEXEC_TIMEOUT="240")
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-c", JOB],
                          capture_output=True, text=True, timeout=270, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        trace = json.loads((tmp_path / f"trace.{rank}.json").read_text())
        events = trace["traceEvents"]
        for ev in events:
            missing = {"name", "ph", "ts", "pid", "tid"} - set(ev)
            assert not missing, (ev, missing)
            assert ev["pid"] == rank, ev
            assert ev["ph"] != "X" or ev["dur"] >= 0, ev
        colls = [e for e in events if e.get("cat") == "collective"]
        assert any(e["name"] == "allreduce" and e["args"]["algorithm"] == "ring" and
                   e["args"]["bytes"] == 56 for e in colls), colls[-3:]
        assert all({"algorithm", "bytes"} <= set(e["args"]) for e in colls)
        names = {e["name"] for e in events}
        assert {"forward", "backward", "optimizer"} <= names, names
        phases = [e for e in events if e.get("cat") == "phase"]
        assert sum(e["name"] == "optimizer" for e in phases) == 3
        buckets = [e["name"] for e in events if e.get("cat") == "bucket"]
        assert {"bucket 0 ready", "bucket 0 started", "bucket 0"} <= set(buckets), buckets
