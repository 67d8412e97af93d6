"""Tree and butterfly algorithms: binomial, pipelined binary, double binary tree, recursive
doubling/halving, Rabenseifner.

Installed as ``collectives.tree``; every function returns a ``collectives.schedule.Schedule``.
"""
if __name__ != "collectives.tree":
    raise ImportError(f"the tree algorithms install as 'collectives.tree', not {__name__!r}: "
                      "pip install the project (pip install -e .) instead of importing tree/ "
                      "from the source tree")

__all__: list[str] = []
