"""``python -m bench net``: run a job over MPI's TCP transport on a loopback limited to a rate.

    python -m bench net --rate 1gbit -- mpiexec -n 3 python examples/train_ddp.py
    python -m bench net --rate none -- mpiexec -n 2 python -m bench allreduce   # TCP, no limit
    python -m bench net --rate 500mbit --show -- mpiexec -n 2 python a.py      # print, run nothing

On one machine MPI moves bytes through shared memory, and there is no network to be slow. This
command gives a job one: it runs the command in a new, anonymous network namespace (and PID
namespace) whose only interface is a loopback of its own, shaped by a token-bucket filter
(``tc qdisc add dev lo root tbf rate R burst B latency L``), with the environment telling MPI to
use TCP even between ranks of one machine (``TCP_ENV``: MPICH's ofi/tcp netmod without the
shared-memory path, Open MPI's tcp BTL) and the toolkit that every rank is a node of its own
(``NODE_ENV``). The rate is shared by all of the job's traffic: every
rank's sends cross the same one loopback.

Nothing is ever changed on the host: the limit lives on the namespace's own loopback, and the
namespace with it vanishes when its last process exits, so the host's ``tc qdisc show dev lo`` is
the same before, during and after, even when the runner is killed. The job cannot outlive the
runner: the runner's death kills ``unshare`` (parent-death signal), whose death kills the
namespace's first process (``--kill-child``), whose death kills every process in the PID
namespace. SIGINT and SIGTERM are forwarded to the job's process group; the runner then waits
for the job (at most ``GRACE_S`` seconds, then it kills the namespace) and exits with its status
(128 + signal for a job ended by a signal). When standard
input is a terminal the job does not read it (it runs in its own process group, which would be
stopped by a read).

It needs root (or the capabilities to create namespaces) and the ``unshare``, ``ip`` and ``tc``
tools; without them it says what is missing and runs nothing (exit status 2).

From Python, for other benchmarks::

    from bench.net import Network, check_available
    with Network("1gbit") as net:                      # validated once
        done = net.run(["mpiexec", "-n", "3", "python", "job.py"], capture=True)
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading

__all__ = ["TCP_ENV", "NODE_ENV", "check_available", "tools", "Network", "parse_rate", "execute",
           "parse", "launch", "main"]

# MPI between ranks of one machine over TCP, not shared memory. MPICH: no local (shm) path, the
# OFI netmod on libfabric's tcp provider. Open MPI: the tcp and self BTLs only, on the loopback
# (the tcp BTL excludes 127.0.0.0/8 by default). Each library ignores the other's variables.
TCP_ENV: dict[str, str] = {
    "MPIR_CVAR_NOLOCAL": "1",
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "OMPI_MCA_pml": "ob1",
    "OMPI_MCA_btl": "tcp,self",
    "OMPI_MCA_btl_tcp_if_include": "lo",
}

# The toolkit, told that every rank is a node of its own (``COLLECTIVES_RANKS_PER_NODE``), as
# across a network: no shared-memory algorithm, window or one-pass bucket, so all of its bytes
# cross the limited loopback. Set the variable to simulate nodes of several ranks instead.
NODE_ENV: dict[str, str] = {"COLLECTIVES_RANKS_PER_NODE": "1"}

TOOLS = ("unshare", "ip", "tc")
NO_LIMIT = ("none", "0", "unlimited", "off")
_SBIN = os.pathsep.join(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])

# tc's units (tc(8)): a rate needs one here, so that "1000" is not read as 1000 bit/s by mistake.
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2 ** 10, "mibit": 2 ** 20, "gibit": 2 ** 30, "tibit": 2 ** 40,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
               "kibps": 8 * 2 ** 10, "mibps": 8 * 2 ** 20, "gibps": 8 * 2 ** 30,
               "tibps": 8 * 2 ** 40}
_SIZE = re.compile(r"\d+(\.\d+)?(b|k|kb|m|mb|g|gb|kbit|mbit|gbit)?", re.I)
_TIME = re.compile(r"\d+(\.\d+)?(s|sec|secs|ms|msec|msecs|us|usec|usecs)?", re.I)

# The namespace's first process: bring its loopback up, shape it, run the job (not exec'd: as
# PID 1 the job would ignore every signal it has no handler for).
_SCRIPT = ('"$1" link set lo up || exit 125; '
           'if [ -n "$3" ]; then "$2" qdisc add dev lo root tbf $3 || exit 125; fi; '
           'shift 3; "$@"')


def parse_rate(rate: str | None) -> float | None:
    """``rate`` in tc's syntax (``1gbit``, ``500mbit``, ``10Gbit``) -> bits per second; None for
    no limit (None, ``none``, ``0``, ``unlimited``, ``off``); ``ValueError`` otherwise."""
    if rate is None or str(rate).strip().lower() in NO_LIMIT:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", str(rate).strip().lower())
    if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"rate {rate!r}: expected a number and a tc unit, e.g. 1gbit, 10gbit, "
                         f"500mbit, 100mbps ({', '.join(_RATE_UNITS)}), or none for no limit")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def _check(value: str, pattern, what: str, example: str) -> str:
    if not pattern.fullmatch(str(value).strip()):
        raise ValueError(f"{what} {value!r}: expected tc's syntax, e.g. {example}")
    return str(value).strip()


def tools() -> dict[str, str | None]:
    path = os.environ.get("PATH", "") + os.pathsep + _SBIN
    return {t: shutil.which(t, path=path) for t in TOOLS}


def check_available() -> str | None:
    """None when this process can run jobs on a limited network, else why not (not root, a
    missing tool, namespaces refused), with how to run it."""
    if os.geteuid() != 0:
        return (f"bench net needs root to create a network namespace and shape its loopback "
                f"(this process runs as uid {os.geteuid()}): run it as root, e.g. "
                f"sudo {shlex.quote(sys.executable)} -m bench net ...")
    missing = [t for t, p in tools().items() if p is None]
    if missing:
        return (f"bench net needs {', '.join(missing)} (not found on PATH or in /usr/sbin): "
                f"install util-linux (unshare) and iproute2 (ip, tc)")
    probe = subprocess.run(_argv(["true"], "rate 1gbit burst 256kb latency 100ms"),
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return (f"bench net could not create a network namespace with a tbf qdisc on its "
                f"loopback (exit status {probe.returncode}): {probe.stderr.strip()[-400:]}")
    return None


def _argv(command, qdisc: str) -> list[str]:
    found = tools()
    return [found["unshare"] or "unshare", "--net", "--pid", "--fork", "--kill-child",
            "sh", "-c", _SCRIPT, "sh", found["ip"] or "ip", found["tc"] or "tc", qdisc, *command]


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _start_child():
    """In the child, before exec: a process group of its own (signals reach the job through
    it), and the runner's death kills unshare."""
    os.setpgid(0, 0)
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Network:
    """A loopback limited to ``rate`` (tc syntax; None or ``"none"``: TCP, no limit) for jobs
    run with ``run``; each run gets its own namespace, gone when the run ends."""

    def __init__(self, rate: str | None = "1gbit", burst="256kb", latency="100ms"):
        self.bits_per_second = parse_rate(rate)
        self.rate = None if self.bits_per_second is None else str(rate).strip()
        self.burst = _check(burst, _SIZE, "burst", "256kb, 1mb")
        self.latency = _check(latency, _TIME, "latency", "100ms, 1s")

    def __enter__(self) -> "Network":
        why = check_available()
        if why:
            raise RuntimeError(why)
        return self

    def __exit__(self, *exc) -> None:
        return None

    @property
    def qdisc(self) -> str:
        """The qdisc's parameters (``rate R burst B latency L``); "" without a limit."""
        if self.rate is None:
            return ""
        return f"rate {self.rate} burst {self.burst} latency {self.latency}"

    def argv(self, command) -> list[str]:
        """The command line that runs ``command`` in a fresh limited namespace."""
        return _argv([str(a) for a in command], self.qdisc)

    def run(self, argv, env=None, timeout=None, capture=False) -> subprocess.CompletedProcess:
        """Run ``argv`` in a fresh namespace with ``TCP_ENV`` added to ``env`` (default
        ``os.environ``); the status is the job's (128 + n for a job ended by signal n). On
        ``timeout`` seconds the whole namespace is killed and ``subprocess.TimeoutExpired`` is
        raised. A SIGINT or SIGTERM to this process is passed on to the job; once the job has
        ended, SIGINT raises ``KeyboardInterrupt`` and SIGTERM ``SystemExit(143)`` (signals are
        handled so in the main thread only; elsewhere they stay with this process's handlers).
        ``RuntimeError`` (the reason) where jobs cannot run here."""
        why = check_available()
        if why:
            raise RuntimeError(why)
        done, signum = self._execute(argv, env, timeout, capture)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum is not None:
            raise SystemExit(128 + signum)
        return done

    def environment(self, env=None) -> dict:
        """``env`` (default ``os.environ``) with ``TCP_ENV`` and, unless set, ``NODE_ENV``."""
        full = dict(os.environ if env is None else env)
        full.update(TCP_ENV)
        for name, value in NODE_ENV.items():  # the caller's choice wins
            full.setdefault(name, value)
        return full

    def _execute(self, argv, env, timeout, capture):
        """(CompletedProcess, the signal passed on or None)."""
        return execute(self.argv(argv), list(argv), self.environment(env), timeout, capture)


def execute(full_argv, argv, env, timeout, capture):
    """Run ``full_argv`` (an ``unshare`` line that holds the job ``argv``) in a process group of
    its own that dies with this process; SIGINT and SIGTERM are passed on to it. Returns
    (CompletedProcess, the signal passed on or None); on ``timeout`` the whole group is killed
    and ``subprocess.TimeoutExpired`` raised."""
    stdin = subprocess.DEVNULL if _tty_stdin() else None
    proc = subprocess.Popen(full_argv, env=env, stdin=stdin, preexec_fn=_start_child,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.PIPE if capture else None,
                            text=True if capture else None)
    received = []

    def forward(signum, frame):
        received.append(signum)
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if main else {}
    try:
        try:
            out, err = _communicate(proc, timeout, received)
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
        except BaseException:
            _kill(proc)
            proc.wait()
            raise
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    code = proc.returncode
    if code < 0:  # unshare itself ended by a signal
        code = 128 - code
    return subprocess.CompletedProcess(list(argv), code, out, err), \
        (received[0] if received else None)


# How long a job may take to end after a SIGINT or SIGTERM was passed on to it, before the
# whole namespace is killed (a rank that ignores the signal must not keep the runner waiting).
GRACE_S = 10.0


def _communicate(proc, timeout, received):
    """``proc.communicate(timeout)``, killing the job ``GRACE_S`` after a signal arrived."""
    import time
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        step = GRACE_S if received else 0.5
        if deadline is not None:
            step = min(step, max(0.0, deadline - time.monotonic()))
        try:
            return proc.communicate(timeout=step)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            if received and step == GRACE_S:
                _kill(proc)


def _tty_stdin() -> bool:
    try:
        return os.isatty(0)
    except OSError:
        return False


def _kill(proc) -> None:
    """Kill the job's process group; unshare's death takes the whole namespace with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m bench net",
        usage="python -m bench net [--rate RATE] [--burst SIZE] [--latency TIME] [--show] "
              "-- COMMAND ...",
        description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--rate", default="1gbit",
                   help="the loopback's rate in tc's syntax: 1gbit, 10gbit, 500mbit, 100mbps; "
                        "none (or 0, unlimited): TCP without a limit (default 1gbit)")
    p.add_argument("--burst", default="256kb", help="the token bucket's size (default 256kb)")
    p.add_argument("--latency", default="100ms",
                   help="the longest a packet waits in the bucket's queue (default 100ms)")
    p.add_argument("--show", action="store_true",
                   help="print the command line and settings it would run, and run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the job, after --: mpiexec -n 3 python examples/train_ddp.py")
    return p


def parse(parser, argv):
    """``parser``'s options before ``--`` and the command after it (``args.command``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        args.command = argv[cut + 1:]
    else:
        args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return args


def launch(runner, command, show: bool, available, shown: dict, line: list) -> int:
    """The end of ``bench net`` and ``bench cluster``: with ``show``, print the environment
    ``shown`` and the command ``line`` and run nothing; else run ``command`` with ``runner``
    where ``available()`` says it can (exit status 2 and the reason where not)."""
    if show:
        print(" ".join(f"{k}={v}" for k, v in shown.items()) + " \\\n  " + shlex.join(line))
        why = available()
        print(f"# {'runs here' if why is None else 'cannot run here: ' + why}")
        return 0
    why = available()
    if why:
        print(f"{why}; nothing was run", file=sys.stderr)
        return 2
    done, _ = runner._execute(command, None, None, False)
    return done.returncode


def main(argv=None) -> int:
    """Run the command after ``--`` on the limited network; its exit status (2 when it cannot
    run here)."""
    args = parse(_parser(), argv)
    if not args.command:
        print("bench net: no command to run: python -m bench net --rate 1gbit -- "
              "mpiexec -n 3 python examples/train_ddp.py", file=sys.stderr)
        return 2
    try:
        net = Network(args.rate, args.burst, args.latency)
    except ValueError as exc:
        print(f"bench net: {exc}", file=sys.stderr)
        return 2
    shown = {**TCP_ENV, **{k: os.environ.get(k, v) for k, v in NODE_ENV.items()}}
    return launch(net, args.command, args.show, check_available, shown,
                  net.argv(args.command))


if __name__ == "__main__":
    sys.exit(main())
