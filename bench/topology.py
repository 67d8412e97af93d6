"""``mpiexec -n N python -m bench topology``: the topology the toolkit sees, and the bytes
each algorithm sends per link class.

Without options it prints the ``Topology`` of ``COMM_WORLD`` (``collectives.topology``; set
``COLLECTIVES_RANKS_PER_NODE`` / ``_NUMA`` to simulate one) and, for every rank, its host,
node, local rank, NUMA domain and CPUs. With ``--traffic MIB`` it also runs one float32
allreduce of MIB per rank with each of ``--algorithms`` and prints the bytes every algorithm
sent per link class, from the executor's counters (``collectives.traffic.count_traffic``):
the busiest rank's and the sum over all ranks.
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
    return 0
