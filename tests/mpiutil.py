"""Helpers for MPI tests: agree on failure before asserting, exact rank-dependent data."""
import numpy as np

__all__ = ["world", "assert_all", "rank_data", "exact_sum", "op_inputs", "DTYPES",
           "FLOAT_DTYPES", "spans_nodes", "refused_off_node", "one_node_only"]

from collectives.buffers import DTYPES  # noqa: E402

FLOAT_DTYPES = tuple(d for d in DTYPES if d.kind in "fcV")


def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def assert_all(ok: bool, message: str = "", comm=None) -> None:
    """Fail on every rank if ``ok`` is false on any (nccl-tests: allreduce the error count)."""
    from mpi4py import MPI
    comm = comm or MPI.COMM_WORLD
    bad = comm.allreduce(0 if ok else 1, op=MPI.SUM)
    if bad:
        ranks = comm.allgather(None if ok else comm.Get_rank())
        raise AssertionError(f"failed on {bad} rank(s) {[r for r in ranks if r is not None]}: "
                             f"{message}")


def spans_nodes(comm=None) -> bool:
    """Whether the ranks of ``comm`` (default ``COMM_WORLD``) are on several nodes."""
    from collectives.topology import topology
    return not topology(comm or world()).single_node


def one_node_only(comm=None) -> None:
    """Skip a test of one node's shared-memory machinery where ``comm``'s ranks span nodes (the
    refusal there is ``refused_off_node``'s)."""
    if spans_nodes(comm):
        import pytest
        pytest.skip("needs every rank on one node (the node's shared memory)")


def refused_off_node(collective: str, algorithm: str, comm=None) -> bool:
    """Where ``algorithm`` needs every rank on one node and ``comm``'s ranks span nodes: check
    that a call is refused on every rank (``ValueError``) and return True (the test is done);
    else False."""
    import collectives as coll
    from collectives import select
    comm = comm or world()
    record = select.get(collective, algorithm)
    if record.needs is not select.ONE_NODE or not spans_nodes(comm):
        return False
    x = coll.empty(4, np.float64) if record.registered else np.ones(4)
    x[...] = 1
    try:
        getattr(coll, collective)(x, comm=comm, algorithm=algorithm)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    assert_all("one node" in refused, f"{collective} {algorithm} across nodes: {refused!r}",
               comm)
    return True


def rank_data(rank: int, n: int, dtype, *, base: int = 1) -> np.ndarray:
    """Exact small integers that depend on rank and index: (rank + base) * 3 + i % 5."""
    dtype = np.dtype(dtype)
    vals = (rank + base) * 3 + (np.arange(n) % 5)
    if dtype.kind == "b":
        return ((vals + rank) % 3 == 0)
    if dtype.kind == "u" or dtype.kind == "i":
        vals = vals % 50
    return vals.astype(dtype)


def exact_sum(size: int, n: int, dtype, *, base: int = 1) -> np.ndarray:
    """Sum over ranks of ``rank_data`` in float64 (exact for these small integers)."""
    return sum(rank_data(r, n, dtype, base=base).astype(np.float64) for r in range(size))


def op_inputs(size: int, n: int, dtype, op: str) -> list:
    """Every rank's input for ``op``: exact small values (1-2 for prod, so products stay exact,
    a pattern for bool), so that each rank can compute the answer locally."""
    dtype = np.dtype(dtype)
    out = []
    for r in range(size):
        i = np.arange(n)
        if op == "prod":
            v = 1 + (r + i) % 2
        elif dtype.kind == "b":
            v = (r + i) % 3 == 0
        else:
            v = (r + 1) * 3 + i % 5
        out.append(np.asarray(v).astype(dtype))
    return out
