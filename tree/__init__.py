"""Tree and butterfly algorithms: binomial, pipelined binary, double binary tree, recursive
doubling/halving, Rabenseifner, binomial gather and scatter, Bruck's all-to-all.

Installed as ``collectives.tree``; every function returns a ``collectives.schedule.Schedule``.
"""
if __name__ != "collectives.tree":
    raise ImportError(f"the tree algorithms install as 'collectives.tree', not {__name__!r}: "
                      "pip install the project (pip install -e .) instead of importing tree/ "
                      "from the source tree")

from collectives.tree.binomial import binomial_allreduce, binomial_broadcast, binomial_reduce
from collectives.tree.bruck import bruck_alltoall
from collectives.tree.gather import binomial_gather, binomial_scatter
from collectives.tree.double_binary import double_binary_tree_allreduce
from collectives.tree.pipelined import allreduce, broadcast, reduce
from collectives.tree.rabenseifner import rabenseifner_allreduce
from collectives.tree.recursive_doubling import (recursive_doubling_allgather,
                                                 recursive_doubling_allreduce)
from collectives.tree.recursive_halving import recursive_halving_reduce_scatter

__all__ = [
    "allreduce", "reduce", "broadcast",
    "binomial_allreduce", "binomial_reduce", "binomial_broadcast",
    "double_binary_tree_allreduce",
    "recursive_doubling_allreduce", "rabenseifner_allreduce",
    "recursive_halving_reduce_scatter", "recursive_doubling_allgather",
    "binomial_gather", "binomial_scatter", "bruck_alltoall",
]
