"""``python -m bench cluster``: run an MPI job on a cluster of hosts built on this machine.

    python -m bench cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- python -m bench allreduce
    python -m bench cluster --nodes 3 --ranks-per-node 2 --rate 10gbit -- python examples/train_ddp.py
    python -m bench cluster --nodes 2 --ranks-per-node 2 --show -- python job.py  # print, run nothing

Each host is a network namespace of its own (``n0``, ``n1``, ...) with its own loopback and an
``eth0``: one end of a veth pair whose other end sits on a bridge, as a host's NIC sits on a
switch. The link is limited in both directions by a token-bucket filter (``tc ... tbf rate R``
on ``eth0`` for what the host sends, on the bridge's end for what it receives), so a host
sends and receives at most R at once, as on a full-duplex link of that rate; its TCP buffers
may grow to 64 MiB (``--tcp-buffer``), as on hosts tuned for fast links. Every rank of a
host runs in its namespace, with a hostname of its own: MPI sees the hosts as nodes
(``MPI_Comm_split_type(COMM_TYPE_SHARED)`` groups a host's ranks), moves bytes through shared
memory inside a host and over TCP on ``eth0`` between hosts, and the toolkit's topology is the
real one (``python -m collectives.topology``). The kernel counts what crosses each host's link
(``/sys/class/net/eth0/statistics`` inside it; ``link_bytes``).

The job is started by MPI's own launcher with one proxy per host, reaching each host through a
stand-in for ssh that runs the proxy inside that host's namespace: MPICH's Hydra
(``mpiexec -launcher ssh -launcher-exec STANDIN -iface br0 -hosts n0:K,n1:K``) or Open MPI's
``mpirun`` (its rsh agent), whichever ``--mpiexec`` is (default: the one beside this Python).
The launcher itself runs on the bridge, like a login node.

Everything lives inside one new network, mount and PID namespace: the bridge, the hosts, their
links and the names they resolve (a hosts file mounted over ``/etc/hosts`` there). Nothing is
made on the machine's own interfaces or in its ``/run/netns``, and when the runner ends (also by
Ctrl-C, SIGTERM or SIGKILL) the namespace's first process dies, which kills every process of
the job and lets the kernel remove the hosts and their links.

It needs root (or the capabilities to make namespaces) and the ``unshare``, ``ip`` and ``tc``
tools; without them it says what is missing and runs nothing (exit status 2).

From Python::

    from bench.cluster import Cluster
    done = Cluster(2, 2, "1gbit").run([sys.executable, "job.py"], capture=True)
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench import net

__all__ = ["CLUSTER_ENV", "SUBNET", "Cluster", "check_available", "link_bytes", "main"]

SUBNET = "10.77.0"  # host i is SUBNET.(i+1), the bridge (the launcher's side) SUBNET.254
# MPI between hosts over TCP on each host's eth0, shared memory inside a host. MPICH: the OFI
# netmod on libfabric's tcp provider; Open MPI: the tcp BTL beside its shared-memory one.
CLUSTER_ENV: dict[str, str] = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "eth0",
    "GLOO_SOCKET_IFNAME": "eth0",
    "OMPI_MCA_pml": "ob1",
    "OMPI_MCA_btl": "tcp,sm,self",
    "OMPI_MCA_btl_tcp_if_include": f"{SUBNET}.0/24",
    "OMPI_MCA_oob_tcp_if_include": f"{SUBNET}.0/24",
}
# What would make the toolkit see another topology than MPI's, or MPI another transport.
_DROPPED = ("COLLECTIVES_RANKS_PER_NODE", "COLLECTIVES_RANKS_PER_NUMA", "MPIR_CVAR_NOLOCAL")

# The namespace's first process (not exec'd into the job: as PID 1 it would ignore signals).
# $1 ip, $2 tc, $3 hosts, $4 mtu, $5 the qdisc's parameters ("" for no limit), $6 the largest
# TCP buffer in bytes (0: the kernel's default), then the job.
_SCRIPT = r'''
ip=$1 tc=$2 hosts=$3 mtu=$4 qdisc=$5 tcpmem=$6
shift 6
fail() { echo "bench cluster: $*" >&2; exit 125; }
mount -t tmpfs cluster /run || fail "cannot mount a tmpfs on /run"
mkdir -p /run/netns /run/cluster
"$ip" link set lo up || fail "lo"
"$ip" link add br0 type bridge || fail "cannot make a bridge"
"$ip" addr add SUBNET.254/24 dev br0 && "$ip" link set br0 mtu "$mtu" up || fail "br0"
printf '127.0.0.1 localhost\nSUBNET.254 head\n' > /run/cluster/hosts
i=0
while [ "$i" -lt "$hosts" ]; do
    h=n$i
    "$ip" netns add "$h" || fail "cannot make the namespace of $h"
    "$ip" link add "v$i" mtu "$mtu" type veth peer name eth0 mtu "$mtu" netns "$h" \
        || fail "cannot make the link of $h"
    "$ip" link set "v$i" master br0 up || fail "v$i"
    "$ip" -n "$h" link set lo up || fail "$h: lo"
    "$ip" -n "$h" addr add "SUBNET.$((i + 1))/24" dev eth0 || fail "$h: eth0"
    "$ip" -n "$h" link set eth0 up || fail "$h: eth0"
    if [ -n "$qdisc" ]; then
        "$tc" qdisc add dev "v$i" root tbf $qdisc || fail "$h: tc on the bridge's end"
        "$ip" netns exec "$h" "$tc" qdisc add dev eth0 root tbf $qdisc || fail "$h: tc on eth0"
    fi
    if [ "$tcpmem" -gt 0 ]; then
        "$ip" netns exec "$h" sh -c "echo 4096 131072 $tcpmem > /proc/sys/net/ipv4/tcp_rmem &&
            echo 4096 16384 $tcpmem > /proc/sys/net/ipv4/tcp_wmem" || fail "$h: TCP buffers"
    fi
    echo "SUBNET.$((i + 1)) $h" >> /run/cluster/hosts
    i=$((i + 1))
done
mount --bind /run/cluster/hosts /etc/hosts || fail "cannot mount the hosts file"
cat > /run/cluster/ssh <<EOF
#!/bin/sh
# ssh's stand-in: [options] HOST COMMAND... runs COMMAND in HOST's namespace, named HOST.
while [ \$# -gt 0 ]; do case "\$1" in -*) shift;; *) break;; esac; done
h=\$1
shift
exec "$ip" netns exec "\$h" unshare --uts sh -c "hostname \$h; \$*"
EOF
chmod +x /run/cluster/ssh
"$@"
'''.replace("SUBNET", SUBNET)
STANDIN = "/run/cluster/ssh"
# The most a host's TCP socket buffers grow to (tcp_rmem/tcp_wmem's last field): 64 MiB, as
# hosts on 10 Gbit/s links are tuned, so that bytes MPI has handed to the kernel keep the link
# busy while the ranks compute (the kernel's default send buffer, 4 MiB, drains in 34 ms at
# 1 Gbit/s).
TCP_BUFFER = 64 << 20


def _kind(mpiexec: str) -> str | None:
    """``"mpich"`` or ``"openmpi"``: whose launcher ``mpiexec`` is (None: neither)."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text or "prte" in text:
        return "openmpi"
    return None


def _default_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def check_available() -> str | None:
    """None when this process can build clusters, else why not, with how to run it."""
    why = net.check_available()
    if why:
        return why.replace("bench net", "bench cluster").replace(
            "shape its loopback", "build hosts").replace("its loopback", "a host's link")
    probe = subprocess.run(_unshare(["true"], hosts=1, mtu=1500, qdisc="rate 1gbit burst 256kb "
                                    "latency 100ms", tcp_buffer=TCP_BUFFER),
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return (f"bench cluster could not build a host (a namespace, a bridge, a veth pair and "
                f"a tbf qdisc; exit status {probe.returncode}): {probe.stderr.strip()[-400:]}")
    return None


def _unshare(command, hosts: int, mtu: int, qdisc: str, tcp_buffer: int) -> list[str]:
    found = net.tools()
    return [found["unshare"] or "unshare", "--net", "--mount", "--pid", "--fork",
            "--kill-child", "sh", "-c", _SCRIPT, "sh", found["ip"] or "ip", found["tc"] or "tc",
            str(hosts), str(mtu), qdisc, str(tcp_buffer), *command]


def link_bytes(iface: str = "eth0") -> tuple[int, int] | None:
    """(sent, received) bytes of ``iface`` from the kernel's counters, as this process sees
    them (inside a cluster host: the host's link); None where there is no such interface."""
    stats = Path("/sys/class/net") / iface / "statistics"
    try:
        return (int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text()))
    except OSError:
        return None


class Cluster(net.Network):
    """``nodes`` hosts of ``ranks_per_node`` ranks each, every host's link limited to ``rate``
    (tc syntax; None or ``"none"``: no limit) in each direction. ``run`` starts a command on
    every rank under MPI's launcher; each run builds the cluster anew and leaves nothing."""

    def __init__(self, nodes: int, ranks_per_node: int, rate: str | None = "1gbit",
                 burst: str | None = None, latency: str = "100ms", mtu: int = 9000,
                 mpiexec: str | None = None, tcp_buffer: int = TCP_BUFFER):
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"a cluster needs at least one host of one rank "
                             f"(nodes={nodes}, ranks_per_node={ranks_per_node})")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu {mtu}: expected 576..65535 (9000: jumbo frames)")
        if tcp_buffer < 0:
            raise ValueError(f"tcp_buffer {tcp_buffer}: expected bytes, or 0 for the kernel's "
                             f"default")
        bits = net.parse_rate(rate)
        # The bucket holds 2 ms of the rate (at least 256 KiB): a smaller one caps the rate
        # below R at the kernel's timer granularity.
        burst = burst or f"{max(256 * 1024, int((bits or 0) / 8 * 0.002))}b"
        super().__init__(rate, burst, latency)
        self.nodes, self.ranks_per_node, self.mtu = nodes, ranks_per_node, mtu
        self.tcp_buffer = tcp_buffer
        self.mpiexec = mpiexec or _default_mpiexec()

    @property
    def size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def hosts(self) -> list[str]:
        return [f"n{i}" for i in range(self.nodes)]

    def launcher(self, command) -> list[str]:
        """The launcher's command line that starts ``command`` on every rank."""
        if self.mpiexec is None:
            raise RuntimeError("bench cluster: no mpiexec beside this Python or on PATH; "
                               "pass --mpiexec")
        hosts = ",".join(f"{h}:{self.ranks_per_node}" for h in self.hosts)
        command = [str(a) for a in command]
        if _kind(self.mpiexec) == "openmpi":
            return [self.mpiexec, "--allow-run-as-root", "--mca", "plm_rsh_agent", STANDIN,
                    "--host", hosts, "-np", str(self.size), *command]
        return [self.mpiexec, "-launcher", "ssh", "-launcher-exec", STANDIN, "-iface", "br0",
                "-hosts", hosts, "-n", str(self.size), *command]

    def argv(self, command) -> list[str]:
        """The whole command line: build the cluster, then launch ``command`` on it."""
        return _unshare(self.launcher(command), self.nodes, self.mtu, self.qdisc,
                        self.tcp_buffer)

    def environment(self, env=None) -> dict:
        """``env`` (default ``os.environ``) with ``CLUSTER_ENV``, less whatever would make MPI
        or the toolkit see another topology."""
        full = {k: v for k, v in (os.environ if env is None else env).items()
                if k not in _DROPPED}
        full.update(CLUSTER_ENV)
        return full

    def __enter__(self) -> "Cluster":
        why = check_available()
        if why:
            raise RuntimeError(why)
        return self

    def run(self, argv, env=None, timeout=None, capture=False) -> subprocess.CompletedProcess:
        """Run ``argv`` on every rank of a new cluster; as ``Network.run`` (the job's status,
        signals passed on, ``TimeoutExpired`` after killing everything)."""
        why = check_available()
        if why:
            raise RuntimeError(why)
        return super().run(argv, env, timeout, capture)

    def describe(self) -> str:
        rate = self.rate or "no limit"
        tcp = f"TCP buffers up to {self.tcp_buffer >> 20} MiB" if self.tcp_buffer else \
            "the kernel's TCP buffers"
        return (f"{self.nodes} hosts x {self.ranks_per_node} ranks, links of {rate} each way "
                f"(tbf burst {self.burst}), MTU {self.mtu}, {tcp}")


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m bench cluster",
        usage="python -m bench cluster --nodes N --ranks-per-node K [--rate RATE] [--show] "
              "-- COMMAND ...",
        description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--nodes", type=int, default=2, help="hosts (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument("--rate", default="1gbit",
                   help="each host's link, each way, in tc's syntax: 1gbit, 10gbit, 500mbit; "
                        "none: no limit (default 1gbit)")
    p.add_argument("--burst", default=None,
                   help="the token bucket's size (default: 2 ms of the rate, at least 256kb)")
    p.add_argument("--latency", default="100ms",
                   help="the longest a packet waits in the bucket's queue (default 100ms)")
    p.add_argument("--mtu", type=int, default=9000, help="the links' MTU (default 9000)")
    p.add_argument("--tcp-buffer", type=int, default=TCP_BUFFER,
                   help=f"the most a TCP socket's send or receive buffer grows to on a host, "
                        f"bytes; 0: the kernel's default (default {TCP_BUFFER})")
    p.add_argument("--mpiexec", default=None,
                   help="MPICH's mpiexec or Open MPI's mpirun (default: beside this Python)")
    p.add_argument("--show", action="store_true",
                   help="print the command line and settings it would run, and run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="what every rank runs, after --: python examples/train_ddp.py")
    return p


def main(argv=None) -> int:
    """Run the command after ``--`` on every rank of the cluster; its exit status (2 when it
    cannot run here)."""
    args = net.parse(_parser(), argv)
    if not args.command:
        print("bench cluster: no command to run: python -m bench cluster --nodes 2 "
              "--ranks-per-node 2 -- python examples/train_ddp.py", file=sys.stderr)
        return 2
    try:
        cluster = Cluster(args.nodes, args.ranks_per_node, args.rate, args.burst, args.latency,
                          args.mtu, args.mpiexec, args.tcp_buffer)
    except ValueError as exc:
        print(f"bench cluster: {exc}", file=sys.stderr)
        return 2
    if args.show:
        print(f"# {cluster.describe()}")
    return net.launch(cluster, args.command, args.show, check_available,
                      cluster.environment({}), cluster.launcher(args.command))


if __name__ == "__main__":
    sys.exit(main())
