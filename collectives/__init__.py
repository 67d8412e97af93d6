"""collectives: MPI collective-communication algorithms for data-parallel training.

    import collectives as coll
    g = coll.allreduce(grad, op="avg")                       # new array, auto-selected algorithm
    coll.allreduce(grad, out=grad, algorithm="ring")         # in place
    req = coll.iallreduce(grad, out=grad); ...; req.wait()   # non-blocking

README.md and docs/ describe the layers; ``collectives.algorithms(name)`` lists the algorithms.
"""
from collectives.api import (
    algorithms,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    gather,
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
    reduce_scatter,
    scatter,
)
from collectives.node.registered import empty, is_registered
from collectives.errors import CollectiveError, CollectiveTimeout, MessageSizeError, MismatchError
from collectives.progress import Request
from collectives.mesh import Mesh
from collectives import abort as _abort

_abort.install()  # an uncaught exception on one rank ends the whole job (collectives.abort)

__all__ = [
    "allreduce", "reduce", "broadcast", "reduce_scatter", "allgather",
    "alltoall", "gather", "scatter", "barrier",
    "iallreduce", "ireduce", "ireduce_scatter", "iallgather", "ibroadcast",
    "ialltoall", "igather", "iscatter", "ibarrier",
    "algorithms", "Request", "empty", "is_registered", "Mesh",
    "CollectiveError", "MismatchError", "MessageSizeError", "CollectiveTimeout",
]
__version__ = "0.1.0"
