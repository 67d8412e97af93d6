"""``python -m bench cluster`` and ``bench.cluster.Cluster``: MPI sees the hosts as nodes, the
links are limited and counted by the kernel, nothing of a cluster outlives its runner, and
refusals run nothing.

The cases that build clusters need root and ``unshare``/``ip``/``tc`` and are skipped with
``check_available``'s reason elsewhere. After every run the machine's interfaces, network
namespaces and queueing disciplines must be as before, and no process of the job may be left
(found by a marker word in its command line).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bench import cluster, net
from tests.test_bench_net import alive, assert_gone

ROOT = Path(__file__).resolve().parent.parent
WHY = cluster.check_available()
MPIEXEC = Path(sys.executable).parent / "mpiexec"
needs_cluster = pytest.mark.skipif(WHY is not None or not MPIEXEC.exists(),
                                   reason=f"bench cluster cannot run here: {WHY or 'no mpiexec'}")
pytestmark = pytest.mark.timeout(120)


def machine_state() -> dict:
    """What a cluster must leave as it found it: links, namespaces, qdiscs."""
    def out(*argv):
        return subprocess.run(argv, capture_output=True, text=True).stdout
    return {"links": out("ip", "-o", "link", "show"), "netns": out("ip", "netns", "list"),
            "qdiscs": out("tc", "qdisc", "show"), "run": sorted(os.listdir("/run"))}


# Every rank's host name, MPI's node size, and its host link's bytes around a 4 MiB allreduce
# (MPI's own), as one JSON list from rank 0.
JOB = """
import json, socket, sys
import numpy as np
from mpi4py import MPI
from bench.cluster import link_bytes
comm = MPI.COMM_WORLD
node = comm.Split_type(MPI.COMM_TYPE_SHARED)
x = np.ones(1 << 20, np.float32)
y = np.empty_like(x)
comm.Allreduce(x[:1], y[:1])
comm.Barrier()
before = link_bytes()
comm.Allreduce(x, y)
comm.Barrier()
after = link_bytes()
rows = comm.gather({"rank": comm.Get_rank(), "host": socket.gethostname(),
                    "node_size": node.Get_size(), "sum": float(y[0]),
                    "sent": after[0] - before[0], "received": after[1] - before[1],
                    "tcp_wmem": open("/proc/sys/net/ipv4/tcp_wmem").read().split()})
if rows:
    print(json.dumps(rows), flush=True)
"""


@needs_cluster
@pytest.mark.parametrize("nodes,per", [(2, 2), (3, 2)])
def test_ranks_on_hosts_see_nodes_and_cross_the_links(nodes, per):
    before = machine_state()
    done = cluster.Cluster(nodes, per, "1gbit").run([sys.executable, "-c", JOB], capture=True,
                                                    timeout=90, env={**os.environ,
                                                                     "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.splitlines()[-1])
    assert [r["rank"] for r in rows] == list(range(nodes * per))
    assert [r["host"] for r in rows] == [f"n{r // per}" for r in range(nodes * per)]
    assert all(r["node_size"] == per for r in rows)
    assert all(r["sum"] == nodes * per for r in rows)
    assert all(int(r["tcp_wmem"][-1]) == cluster.TCP_BUFFER for r in rows)
    # Bytes crossed every host's link: at least a host's share of the sum of the others.
    for r in rows:
        assert r["sent"] >= (1 << 22) // per, r
        assert r["received"] >= (1 << 22) // per, r
    assert machine_state() == before


@needs_cluster
def test_the_link_is_limited_to_its_rate():
    """4 MiB across one 50 Mbit/s link takes at least the wire time (0.67 s); unlimited, far
    less."""
    job = ("import time, numpy as np; from mpi4py import MPI; c = MPI.COMM_WORLD; "
           "x = np.ones(1 << 20, np.float32); c.Barrier(); t = time.perf_counter(); "
           "(c.Send(x, 1) if c.rank == 0 else c.Recv(x, 0)); c.Barrier(); "
           "print(time.perf_counter() - t) if c.rank == 1 else None")
    seconds = {}
    for rate in ("none", "50mbit"):
        done = cluster.Cluster(2, 1, rate).run([sys.executable, "-c", job], capture=True,
                                               timeout=90)
        assert done.returncode == 0, done.stderr
        seconds[rate] = float(done.stdout.split()[-1])
    assert seconds["50mbit"] >= (4 << 20) * 8 / 50e6 * 0.9, seconds
    assert seconds["none"] < seconds["50mbit"] / 4, seconds


def runner(*job: str, nodes=2, per=2) -> subprocess.Popen:
    """``python -m bench cluster`` in a session of its own, stdout piped."""
    return subprocess.Popen([sys.executable, "-m", "bench", "cluster", "--nodes", str(nodes),
                             "--ranks-per-node", str(per), "--rate", "100mbit", "--", *job],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def sleeper(marker: str) -> list[str]:
    """Every rank prints ready and sleeps, a background child beside it."""
    return ["sh", "-c", f"sh -c 'sleep 60; : {marker}' & echo ready; sleep 61; : {marker}"]


@needs_cluster
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_nothing_survives_the_runner(how):
    before = machine_state()
    marker = f"bench-cluster-{uuid.uuid4().hex}"
    proc = runner(*sleeper(marker))
    try:
        for _ in range(4):
            assert proc.stdout.readline().strip() == "ready"
        assert len(alive(marker)) >= 8  # two shells a rank
        assert machine_state()["links"] == before["links"]  # while it runs too
        proc.send_signal(how)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    # killed, or the job's failing status passed on
    assert proc.returncode == -signal.SIGKILL if how == signal.SIGKILL else proc.returncode > 0
    assert_gone(marker)
    assert machine_state() == before


@needs_cluster
def test_a_failing_job_gives_its_status_and_leaves_nothing():
    before = machine_state()
    done = cluster.Cluster(2, 1, "1gbit").run(["sh", "-c", "exit 3"], capture=True, timeout=60)
    assert done.returncode != 0
    assert machine_state() == before


@needs_cluster
def test_a_timeout_kills_the_cluster():
    marker = f"bench-cluster-{uuid.uuid4().hex}"
    with pytest.raises(subprocess.TimeoutExpired):
        cluster.Cluster(2, 1, "1gbit").run(sleeper(marker), timeout=3, capture=True)
    assert_gone(marker)


def test_without_root_it_refuses_and_runs_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(net.os, "geteuid", lambda: 1000)
    flag = tmp_path / "ran"
    assert cluster.main(["--nodes", "2", "--", "touch", str(flag)]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "bench cluster" in err and "nothing was run" in err
    assert not flag.exists()
    with pytest.raises(RuntimeError, match="needs root"):
        cluster.Cluster(2, 2).run(["touch", str(flag)])
    assert not flag.exists()


def test_without_the_tools_it_says_which_are_missing(monkeypatch):
    monkeypatch.setattr(net.os, "geteuid", lambda: 0)
    monkeypatch.setattr(net, "tools", lambda: {"unshare": None, "ip": "/usr/sbin/ip",
                                                "tc": None})
    why = cluster.check_available()
    assert why.startswith("bench cluster needs unshare, tc")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rate"):
        cluster.Cluster(2, 2, "fast")
    with pytest.raises(ValueError, match="at least one host"):
        cluster.Cluster(0, 2)
    with pytest.raises(ValueError, match="mtu"):
        cluster.Cluster(2, 2, mtu=100)
    assert cluster.main(["--nodes", "2"]) == 2  # no command


def test_show_prints_the_launch_and_runs_nothing(capsys, tmp_path):
    flag = tmp_path / "ran"
    assert cluster.main(["--nodes", "3", "--ranks-per-node", "2", "--rate", "10gbit", "--show",
                         "--", "touch", str(flag)]) == 0
    out = capsys.readouterr().out
    assert "3 hosts x 2 ranks, links of 10gbit" in out
    assert "-hosts n0:2,n1:2,n2:2" in out or "--host n0:2,n1:2,n2:2" in out
    assert "FI_PROVIDER=tcp" in out
    assert not flag.exists()
    # The bucket holds 2 ms of the rate: 2.5 MB at 10 Gbit/s.
    assert cluster.Cluster(2, 2, "10gbit").burst == "2500000b"
    assert cluster.Cluster(2, 2, "1gbit").burst == f"{256 * 1024}b"


def test_the_cluster_environment_drops_simulated_topologies():
    env = cluster.Cluster(2, 2).environment({"COLLECTIVES_RANKS_PER_NODE": "1",
                                             "MPIR_CVAR_NOLOCAL": "1", "KEEP": "x"})
    assert "COLLECTIVES_RANKS_PER_NODE" not in env and "MPIR_CVAR_NOLOCAL" not in env
    assert env["KEEP"] == "x" and env["FI_TCP_IFACE"] == "eth0"


OMPI = ROOT / ".venv-ompi" / "bin"


@needs_cluster
@pytest.mark.skipif(not (OMPI / "mpirun").exists() or not (OMPI / "python").exists(),
                    reason="no Open MPI venv (.venv-ompi) beside the checkout")
def test_open_mpi_launches_through_its_rsh_agent():
    before = machine_state()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    done = cluster.Cluster(2, 2, "1gbit", mpiexec=str(OMPI / "mpirun")).run(
        [str(OMPI / "python"), "-c", JOB], capture=True, timeout=110, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    assert [r["host"] for r in rows] == ["n0", "n0", "n1", "n1"]
    assert all(r["node_size"] == 2 and r["sum"] == 4 for r in rows)
    assert all(r["sent"] >= (1 << 22) // 2 for r in rows)
    assert machine_state() == before
