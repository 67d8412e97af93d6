"""Parameter server: tables on server ranks, pushed and pulled by workers with bounded staleness.

::

    from collectives import ps
    job = ps.init(MPI.COMM_WORLD, servers=1)     # collective; the last `servers` ranks serve
    if job.is_server:
        job.serve()                              # returns when every worker has finished
    else:
        emb = job.sparse_table("emb", dim=32, optimizer="adagrad", lr=0.05, staleness=3)
        rows = emb.pull(ids); emb.push(ids, grads)   # also ipull / ipush -> Request
        job.clock()                              # end of this worker's iteration
        coll.allreduce(g, op="avg", comm=job.workers)
        job.finish()

The modules, from the wire up: ``protocol`` (headers, tags, status codes), ``store`` (a
server's shard of a table: a row range, or a hash table of rows), ``optim`` (SGD, momentum,
Adagrad, Adam applied on push), ``clock`` (BSP, SSP, ASP: when a pull may be answered),
``server`` (the event loop), ``client`` (a worker's table handles and requests), ``job``
(the split, the clock, finishing). docs/ps.md is the user's guide.
"""
from .client import DenseTable, Request, SparseTable, TableError
from .job import Job, init
from .optim import OPTIMIZERS

__all__ = ["init", "Job", "SparseTable", "DenseTable", "Request", "TableError", "OPTIMIZERS"]
