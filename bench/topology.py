"""``mpiexec -n N python -m bench topology``: the topology the toolkit sees, and the bytes
each algorithm sends per link class.

Without options it prints the ``Topology`` of ``COMM_WORLD`` (``collectives.topology``; set
``COLLECTIVES_RANKS_PER_NODE`` / ``_NUMA`` to simulate one) and, for every rank, its host,
node, local rank, NUMA domain and CPUs. With ``--traffic MIB`` it also runs one float32
allreduce of MIB per rank with each of ``--algorithms`` and prints the bytes every algorithm
sent per link class, from the executor's counters (``collectives.traffic.count_traffic``):
the busiest rank's and the sum over all ranks. Where the ranks span nodes with a network
interface ``eth0`` (``python -m bench cluster``), it also prints the bytes that crossed the
network by the kernel's counters beside the cost model's count.
"""
from __future__ import annotations

import argparse

import numpy as np

__all__ = ["traffic_table", "main"]


def traffic_table(comm, nbytes: int = 1 << 22, algorithms=("ring", "hierarchical"),
                  collective: str = "allreduce") -> list[tuple]:
    """Bytes sent per link class by each algorithm for one float32 call (collective).

    Returns, on every rank, rows ``(algorithm, link class name, max over ranks, total)``.
    """
    from mpi4py import MPI

    import collectives as coll
    from collectives.topology import LINK_NAMES, topology
    from collectives.traffic import count_traffic
    topo = topology(comm)
    x = np.ones(max(1, nbytes // 4), np.float32)
    run = getattr(coll, collective)
    rows = []
    for name in algorithms:
        run(x, comm=comm, algorithm=name)  # warm up (schedules, windows, sub-communicators)
        with count_traffic(comm, topo) as t:
            run(x, comm=comm, algorithm=name)
        sent = np.array(t.nbytes, dtype=np.int64)
        most = np.empty_like(sent)
        total = np.empty_like(sent)
        comm.Allreduce(sent, most, op=MPI.MAX)
        comm.Allreduce(sent, total, op=MPI.SUM)
        rows += [(name, LINK_NAMES[c], int(most[c]), int(total[c])) for c in range(3)]
    return rows


def network_table(comm, nbytes: int = 1 << 22, algorithms=("ring", "hierarchical"),
                  collective: str = "allreduce", iface: str = "eth0") -> list[tuple]:
    """Bytes that crossed the nodes' network links in one float32 call of each algorithm, as
    the kernel counted them (``iface``'s transmit counter on every node, summed), beside the
    cost model's count of the bytes its schedules send to other nodes (collective).

    Returns, on every rank, rows ``(algorithm, kernel bytes, model bytes or None)``; None
    where a node has no such interface to read."""
    from mpi4py import MPI

    import collectives as coll
    from bench.cluster import link_bytes
    from collectives import costmodel, select
    from collectives.topology import OTHER_NODE, topology
    topo = topology(comm)
    leader = topo.local_rank(comm.Get_rank()) == 0
    if not comm.allreduce(link_bytes(iface) is not None or not leader, op=MPI.LAND):
        return None
    x = np.ones(max(1, nbytes // 4), np.float32)
    run = getattr(coll, collective)
    rows = []
    for name in algorithms:
        run(x, comm=comm, algorithm=name)  # connections, schedules, windows
        comm.Barrier()
        before = link_bytes(iface)[0] if leader else 0
        run(x, comm=comm, algorithm=name)
        comm.Barrier()
        sent = comm.allreduce((link_bytes(iface)[0] - before) if leader else 0)
        model = None
        if select.get(collective, name).kind == select.SCHEDULE:
            model = costmodel.link_bytes(collective, name, comm.Get_size(), x.nbytes,
                                         topology=topo)[OTHER_NODE]
        rows.append((name, sent, model))
    return rows


def main(argv=None, comm=None) -> int:
    """``mpiexec -n N python -m bench topology [--traffic MIB] [--algorithms a,b]``."""
    parser = argparse.ArgumentParser(
        prog="mpiexec -n N python -m bench topology",
        description="Print the topology the toolkit sees (set COLLECTIVES_RANKS_PER_NODE / "
                    "_NUMA to simulate one); with --traffic, the bytes each algorithm sends "
                    "per link class in one allreduce, from the executor's counters.")
    parser.add_argument("--traffic", type=float, metavar="MIB", default=None,
                        help="also count one float32 allreduce of MIB per rank")
    parser.add_argument("--algorithms", default="ring,hierarchical,hierarchical_shm",
                        help="the algorithms --traffic runs (default: %(default)s)")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    from collectives.topology.__main__ import report
    comm = comm or MPI.COMM_WORLD
    text = report(comm)
    if text is not None:
        print(text)
    if args.traffic is None:
        return 0
    table = traffic_table(comm, int(args.traffic * (1 << 20)), args.algorithms.split(","))
    if comm.Get_rank() == 0:
        print(f"\nbytes sent in one float32 allreduce of {args.traffic:g} MiB per rank "
              f"(executor counters; bytes that 'native' and 'shm' move are not counted)")
        print(f"  {'algorithm':>16} {'link':>11} {'max per rank':>14} {'all ranks':>14}")
        for name, link, most, total in table:
            print(f"  {name:>16} {link:>11} {most:14d} {total:14d}")
    if topo_spans(comm):
        wire = network_table(comm, int(args.traffic * (1 << 20)), args.algorithms.split(","))
        if wire is not None and comm.Get_rank() == 0:
            print("\nbytes across the network in the same call: the kernel's count (every "
                  "node's eth0 transmit counter, summed: frames with their headers, and TCP's "
                  "acknowledgements) beside the cost model's (its schedules' sends to other "
                  "nodes)")
            print(f"  {'algorithm':>16} {'kernel':>14} {'model':>14} {'kernel/model':>13}")
            for name, sent, model in wire:
                ratio = f"{sent / model:13.3f}" if model else f"{'-':>13}"
                print(f"  {name:>16} {sent:14d} {model if model is not None else '-':>14} "
                      f"{ratio}")
    return 0


def topo_spans(comm) -> bool:
    """Whether ``comm``'s ranks span nodes."""
    from collectives.topology import topology
    return not topology(comm).single_node
