"""collectives: MPI collective-communication algorithms for data-parallel training.

    import collectives as coll
    g = coll.allreduce(grad, op="avg")                       # new array, auto-selected algorithm
    coll.allreduce(grad, out=grad, algorithm="ring")         # in place
    req = coll.iallreduce(grad, out=grad); ...; req.wait()   # non-blocking
    req = coll.allreduce_init(grad, out=grad)                # persistent (MPI-4)
    req.start(); ...; req.wait()                             # as often as wanted

README.md and docs/ describe the layers; ``collectives.algorithms(name)`` lists the algorithms.
"""
from collectives.api import (
    algorithms,
    allgather,
    allgather_init,
    allreduce,
    allreduce_init,
    alltoall,
    alltoall_init,
    barrier,
    barrier_init,
    broadcast,
    broadcast_init,
    gather,
    gather_init,
    iallgather,
    iallreduce,
    ialltoall,
    ibarrier,
    ibroadcast,
    igather,
    ireduce,
    ireduce_scatter,
    iscatter,
    reduce,
    reduce_init,
    reduce_scatter,
    reduce_scatter_init,
    scatter,
    scatter_init,
)
from collectives.node.registered import empty, is_registered
from collectives.errors import CollectiveError, CollectiveTimeout, MessageSizeError, MismatchError
from collectives.persistent import Persistent
from collectives.progress import Request
from collectives.mesh import Mesh
from collectives import abort as _abort

_abort.install()  # an uncaught exception on one rank ends the whole job (collectives.abort)

__all__ = [
    "allreduce", "reduce", "broadcast", "reduce_scatter", "allgather",
    "alltoall", "gather", "scatter", "barrier",
    "iallreduce", "ireduce", "ireduce_scatter", "iallgather", "ibroadcast",
    "ialltoall", "igather", "iscatter", "ibarrier",
    "allreduce_init", "reduce_init", "broadcast_init", "reduce_scatter_init", "allgather_init",
    "alltoall_init", "gather_init", "scatter_init", "barrier_init",
    "algorithms", "Request", "Persistent", "empty", "is_registered", "Mesh",
    "CollectiveError", "MismatchError", "MessageSizeError", "CollectiveTimeout",
]
__version__ = "0.1.0"
