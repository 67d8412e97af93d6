"""``mpiexec -n N python -m collectives.topology``: the topology the toolkit sees.

Prints, on rank 0, the ``Topology`` of ``COMM_WORLD`` (nodes from MPI, or as
``COLLECTIVES_RANKS_PER_NODE`` / ``_NUMA`` simulate them) and, for every rank, its host, node,
local rank, NUMA domain and CPUs.
"""
from __future__ import annotations

import os
import sys

from . import topology

__all__ = ["report", "main"]


def report(comm) -> str | None:
    """The topology of ``comm`` and a line per rank, on rank 0 (None elsewhere); collective."""
    from mpi4py import MPI
    topo = topology(comm)
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = []
    rows = comm.gather((comm.Get_rank(), MPI.Get_processor_name(), cpus), root=0)
    if rows is None:
        return None
    lines = [topo.describe()]
    for r, host, cpu in rows:
        lines.append(f"  rank {r}: host {host}, node {topo.node[r]}, local rank "
                     f"{topo.local_rank(r)}/{topo.local_size(r)}, numa {topo.numa[r]}, cpus "
                     f"{','.join(map(str, cpu))}")
    return "\n".join(lines)


def main(argv=None) -> int:
    if list(sys.argv[1:] if argv is None else argv):
        print("usage: mpiexec -n N python -m collectives.topology", file=sys.stderr)
        return 2
    from mpi4py import MPI
    text = report(MPI.COMM_WORLD)
    if text is not None:
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
