"""Ring algorithms: reduce-scatter, all-gather, allreduce (= both), pipelined broadcast, and the
pairwise-exchange all-to-all (a ring of shifts).

Installed as ``collectives.ring``; every function returns a ``collectives.schedule.Schedule``.
"""
if __name__ != "collectives.ring":
    raise ImportError(f"the ring algorithms install as 'collectives.ring', not {__name__!r}: "
                      "pip install the project (pip install -e .) instead of importing ring/ "
                      "from the source tree")

from collectives.ring.allgather import allgather
from collectives.ring.allreduce import allreduce
from collectives.ring.broadcast import broadcast
from collectives.ring.pairwise import pairwise_alltoall
from collectives.ring.reduce_scatter import reduce_scatter

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "pairwise_alltoall"]
