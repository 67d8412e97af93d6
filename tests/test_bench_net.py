"""``python -m bench net`` and ``bench.net.Network``: the limit works, never touches the host's
loopback, and nothing of a job survives its runner; refusals run nothing.

The cases that run jobs need root and ``unshare``/``ip``/``tc`` (``check_available``) and are
skipped with its reason elsewhere. A case's leftovers are found by a marker word in the job's
command line, looked for in every process's ``/proc/PID/cmdline``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bench import net

ROOT = Path(__file__).resolve().parent.parent
WHY = net.check_available()
needs_net = pytest.mark.skipif(WHY is not None, reason=f"bench net cannot run here: {WHY}")

# Two processes over loopback TCP: a child sends N bytes, the parent receives them and prints
# the bytes and seconds from the connection's acceptance to its end.
STREAM = """
import os, socket, sys, time
n = int(sys.argv[1])
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
if os.fork() == 0:
    c = socket.create_connection(srv.getsockname())
    c.sendall(bytes(n))
    c.close()
    os._exit(0)
conn, _ = srv.accept()
t, got = time.perf_counter(), 0
while True:
    b = conn.recv(1 << 16)
    if not b:
        break
    got += len(b)
dt = time.perf_counter() - t
os.wait()
print(got, dt)
"""


def host_qdisc() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                          text=True, check=True).stdout


def alive(marker: str) -> list[int]:
    """The processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = (Path("/proc") / entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry))
    return found


def assert_gone(marker: str, within: float = 5.0) -> None:
    """Every process of the job has ended within ``within`` seconds (killed if not, then the
    test fails)."""
    deadline = time.monotonic() + within
    while alive(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alive(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job outlived its runner: {left}"


def runner(rate: str, *job: str) -> subprocess.Popen:
    """``python -m bench net --rate RATE -- JOB`` in a session of its own (signals sent to it
    reach only it), its output piped."""
    return subprocess.Popen([sys.executable, "-m", "bench", "net", "--rate", rate, "--", *job],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def sleeper(marker: str) -> list[str]:
    """A job that says it has started, then sleeps (``marker`` in its command line)."""
    return [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)",
            marker]


# -- refusals and settings (any user) --------------------------------------------------------------
def test_rates_in_tc_syntax():
    assert net.parse_rate("1gbit") == 1e9
    assert net.parse_rate("500Mbit") == 5e8
    assert net.parse_rate("100mbps") == 8e8
    for none in (None, "none", "0", "unlimited"):
        assert net.parse_rate(none) is None
    for bad in ("fast", "1000", "1gb", "-1gbit", "1 gbit x"):
        with pytest.raises(ValueError, match="expected a number and a tc unit"):
            net.parse_rate(bad)
    with pytest.raises(ValueError, match="burst"):
        net.Network("1gbit", burst="lots")
    assert net.Network("none").qdisc == ""
    assert net.Network("2gbit").qdisc == "rate 2gbit burst 256kb latency 100ms"


def test_bad_rate_is_a_clear_error_and_runs_nothing(tmp_path, capsys):
    flag = tmp_path / "ran"
    assert net.main(["--rate", "fast", "--", "touch", str(flag)]) == 2
    assert "rate 'fast': expected a number and a tc unit" in capsys.readouterr().err
    assert not flag.exists()


def test_without_root_it_refuses_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    flag = tmp_path / "ran"
    assert net.main(["--rate", "1gbit", "--", "touch", str(flag)]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "uid 1000" in err and "nothing was run" in err
    with pytest.raises(RuntimeError, match="needs root"):
        net.Network("1gbit").run(["touch", str(flag)])
    with pytest.raises(RuntimeError, match="needs root"):
        with net.Network("1gbit"):
            pass
    assert not flag.exists()


def test_without_a_tool_it_says_which(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(net.shutil, "which", lambda name, path=None: None)
    why = net.check_available()
    assert why.startswith("bench net needs unshare, ip, tc")


def test_show_prints_and_runs_nothing(tmp_path, capsys):
    flag = tmp_path / "ran"
    assert net.main(["--rate", "10gbit", "--show", "--", "touch", str(flag)]) == 0
    out = capsys.readouterr().out
    assert "FI_PROVIDER=tcp" in out and "rate 10gbit burst 256kb latency 100ms" in out
    assert not flag.exists()


# -- jobs (root) ------------------------------------------------------------------------------------
@needs_net
def test_the_limit_slows_loopback_tcp_and_the_job_sees_the_tcp_settings():
    before = host_qdisc()
    n = 2 << 20
    rates = {}
    for rate in ("none", "50mbit"):
        with net.Network(rate) as network:
            done = network.run([sys.executable, "-c", STREAM, str(n)], capture=True, timeout=60)
        assert done.returncode == 0, done.stderr
        got, seconds = done.stdout.split()
        assert int(got) == n
        rates[rate] = n * 8 / float(seconds)
    # 50 Mbit/s through the bucket (the burst lets the first 256 KB through at once): far below
    # loopback TCP without a limit, and not above a few times the rate.
    assert rates["50mbit"] < 4 * 50e6 and rates["50mbit"] * 5 < rates["none"], rates
    done = net.Network("1gbit").run(
        [sys.executable, "-c", "import os; print(os.environ['MPIR_CVAR_NOLOCAL'], "
         "os.environ['FI_PROVIDER'], os.environ['OMPI_MCA_btl'])"], capture=True)
    assert done.stdout.split() == ["1", "tcp", "tcp,self"]
    assert host_qdisc() == before


@needs_net
def test_the_jobs_status_is_returned_and_the_host_untouched():
    before = host_qdisc()
    done = net.Network("1gbit").run(["sh", "-c", "tc qdisc show dev lo; exit 3"], capture=True)
    assert done.returncode == 3
    assert "tbf" in done.stdout and "rate 1Gbit" in done.stdout  # inside: the job's own loopback
    assert "tbf" not in host_qdisc() and host_qdisc() == before
    cli = subprocess.run([sys.executable, "-m", "bench", "net", "--rate", "1gbit", "--",
                          "sh", "-c", "exit 5"], cwd=ROOT)
    assert cli.returncode == 5
    assert host_qdisc() == before


@needs_net
def test_a_timeout_kills_the_whole_namespace():
    marker = f"bench-net-{uuid.uuid4().hex}"
    with pytest.raises(subprocess.TimeoutExpired):
        net.Network("1gbit").run(
            ["sh", "-c", f"sh -c 'sleep 60; : {marker}' & sleep 61; : {marker}"], timeout=1)
    assert_gone(marker)


@needs_net
def test_sigint_reaches_the_job_and_its_status_comes_back():
    before = host_qdisc()
    marker = f"bench-net-{uuid.uuid4().hex}"
    proc = runner("50mbit", *sleeper(marker))
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert "tbf" not in host_qdisc()  # while the job runs too
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 130, err  # the job ended by SIGINT (KeyboardInterrupt)
        assert "KeyboardInterrupt" in err
    finally:
        proc.kill()
        proc.wait()
    assert_gone(marker)
    assert host_qdisc() == before


@needs_net
def test_nothing_survives_a_killed_runner():
    before = host_qdisc()
    marker = f"bench-net-{uuid.uuid4().hex}"
    # the job and a grandchild in the background: both must die with the runner
    proc = runner("50mbit", "sh", "-c",
                  f"sh -c 'sleep 60; : {marker}' & echo ready; sleep 61; : {marker}")
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 5
        while len(alive(marker)) < 4 and time.monotonic() < deadline:  # unshare, sh, sh, sh
            time.sleep(0.02)
        assert len(alive(marker)) >= 4, alive(marker)
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert_gone(marker)
    assert host_qdisc() == before


ALLREDUCE = """
import time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
x = np.ones(1 << 18, np.float32)  # 1 MiB
y = np.empty_like(x)
comm.Allreduce(x[:2], y[:2])  # connections up
comm.Barrier()
t = time.perf_counter()
comm.Allreduce(x, y)
t = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
assert y[0] == comm.Get_size()
if comm.Get_rank() == 0:
    print(t)
"""


@needs_net
def test_mpi_goes_through_the_limited_loopback():
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("mpiexec not found beside the interpreter")
    seconds = {}
    for rate in ("none", "50mbit"):
        done = net.Network(rate).run([str(mpiexec), "-n", "2", sys.executable, "-c", ALLREDUCE],
                                     capture=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seconds[rate] = float(done.stdout.split()[-1])
    # 2 ranks put 2 MiB on the wire (0.34 s at 50 Mbit/s, 256 KB of it in the burst)
    assert seconds["50mbit"] > 0.15 and seconds["50mbit"] > 5 * seconds["none"], seconds


@needs_net
def test_network_run_raises_keyboard_interrupt_after_the_job_ends():
    marker = f"bench-net-{uuid.uuid4().hex}"
    script = ("import sys; from bench.net import Network\n"
              "try:\n"
              f"    Network('1gbit').run({sleeper(marker)!r})\n"
              "except KeyboardInterrupt:\n"
              "    print('interrupted', flush=True); sys.exit(7)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 7 and out.strip() == "interrupted", err
    finally:
        proc.kill()
        proc.wait()
    assert_gone(marker)
