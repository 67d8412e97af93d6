"""The job: which ranks serve and which work, the workers' clock, tables, finishing.

``init(comm, servers=k)`` is collective over ``comm``: the last ``k`` ranks become servers,
the others workers; everything runs on a ``Dup`` of ``comm``, so the job's messages never
match the user's. ``job.workers`` is a communicator of the worker ranks (``MPI.COMM_NULL`` on
servers), for the dense part of a model and its allreduce.
"""
from __future__ import annotations

import json

import numpy as np

from .. import p2p
from . import optim
from . import protocol as P
from .client import DenseTable, Request, SparseTable, TableError
from .server import Server

__all__ = ["Job", "init"]

_INITS = ("zeros", "uniform")
_OPS = {P.Op.CREATE: "create", P.Op.LOOKUP: "lookup", P.Op.CLOCK: "clock",
        P.Op.FINISH: "finish"}   # the control requests, in words


def init(comm=None, servers: int = 1) -> "Job":
    """Split ``comm`` (default ``MPI.COMM_WORLD``) into workers and ``servers`` server ranks
    (the last ones); collective over ``comm``."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if comm is None else comm
    size = comm.Get_size()
    if not isinstance(servers, (int, np.integer)) or not 1 <= servers < size:
        raise ValueError(f"servers must be an integer from 1 to {size - 1} (a job needs at "
                         f"least one worker) on a communicator of {size} ranks, got {servers!r}")
    return Job(comm, int(servers))


class Job:
    """One rank's part in a parameter-server job (made by ``init``)."""

    def __init__(self, comm, servers: int):
        from mpi4py import MPI
        self.comm = comm.Dup()
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.servers = servers
        self.num_workers = self.size - servers
        self.is_server = self.rank >= self.num_workers
        color = MPI.UNDEFINED if self.is_server else 0
        self.workers = self.comm.Split(color, self.rank)
        self.clock_value = 0
        self.sent = 0          # bytes this worker sent to the servers (headers included)
        self.received = 0      # bytes it received from them
        self.warnings: list[str] = []
        self.server = None
        self._rid = 0
        self._inflight: list[Request] = []
        self._tables: dict = {}
        self._finished = False

    def __repr__(self):
        role = "server" if self.is_server else "worker"
        return (f"Job(rank {self.rank} of {self.size}, {role}, {self.num_workers} workers, "
                f"{self.servers} servers)")

    # -- server side ------------------------------------------------------------------------
    def serve(self) -> None:
        """Run this server's event loop until every worker has called ``finish``."""
        if not self.is_server:
            raise RuntimeError(f"rank {self.rank} is a worker; only server ranks serve")
        self.server = Server(self.comm, self.num_workers, self.rank - self.num_workers,
                             self.servers)
        self.warnings = self.server.warnings
        self.server.run()

    # -- worker side ------------------------------------------------------------------------
    def server_rank(self, server: int) -> int:
        """The rank (in the job's communicator) of server index ``server``."""
        return self.num_workers + server

    def next_request(self) -> int:
        """A fresh request id (bounding the requests in flight by the reply-tag window)."""
        self._rid += 1
        return self._rid

    def track(self, req: Request) -> None:
        """Keep a request until it completes, so ``finish`` can wait for it."""
        self._inflight.append(req)
        if len(self._inflight) > P.WINDOW // 4:
            self._reap(wait=len(self._inflight) - P.WINDOW // 8)

    def _reap(self, wait: int = 0) -> None:
        """Wait for the ``wait`` oldest requests, drop the completed ones; a refused push
        raises its ``TableError`` here if no one waited for it."""
        keep = []
        for i, req in enumerate(self._inflight):
            if i < wait or req.test():
                req.wait()
            else:
                keep.append(req)
        self._inflight = keep

    def flush(self) -> None:
        """Wait for every request this worker has in flight (raising a refused one's error)."""
        self._worker("flush")
        self._reap(wait=len(self._inflight))

    def clock(self) -> int:
        """End this worker's iteration: tell every server; returns the new clock."""
        self._worker("clock")
        self.clock_value += 1
        self._notify(P.Op.CLOCK)
        self._reap()
        return self.clock_value

    def finish(self) -> None:
        """Wait for this worker's requests, then tell the servers it is done."""
        self._worker("finish")
        if self._finished:
            return
        pending, self._inflight = self._inflight, []
        errors = []
        for req in pending:
            try:
                req.wait()
            except TableError as exc:
                errors.append(exc)
        self._notify(P.Op.FINISH)
        self._finished = True
        if errors:
            raise errors[0]

    def sparse_table(self, name: str, dim: int, dtype="float32", *, optimizer: str = "sgd",
                     lr: float = 0.01, staleness=0, init: str = "zeros",
                     init_scale: float = 0.01, seed: int = 0, **options) -> SparseTable:
        """A table of ``dim``-wide rows by int64 id, created on first touch (``init``: zeros, or
        uniform in [-init_scale, init_scale)); called by every worker with the same arguments,
        the first call creates it on the servers."""
        spec = self._spec(name, "sparse", dim, None, dtype, optimizer, lr, staleness, init,
                          init_scale, seed, options)
        return self._create(spec, SparseTable)

    def dense_table(self, name: str, shape, dtype="float32", *, optimizer: str = "sgd",
                    lr: float = 0.01, staleness=0, init: str = "zeros",
                    init_scale: float = 0.01, seed: int = 0, **options) -> DenseTable:
        """An array of ``shape`` spread over the servers by rows (axis 0); pulls and pushes take
        row ids, or nothing for the whole array."""
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        if not shape or min(shape) < 1:
            raise ValueError(f"dense table {name!r}: shape must have positive sizes, got "
                             f"{shape}")
        dim = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        spec = self._spec(name, "dense", dim, shape, dtype, optimizer, lr, staleness, init,
                          init_scale, seed, options)
        return self._create(spec, DenseTable)

    def table(self, name: str):
        """The handle of a table some worker created (``KeyError`` naming the tables there are)."""
        self._worker("table")
        if name in self._tables:
            return self._tables[name]
        replies = self._control(P.Op.LOOKUP, name.encode())
        status, _, data = replies[0]
        if status != P.Status.OK:
            raise KeyError(f"no table {name!r} on the servers; tables: "
                           f"{', '.join(json.loads(data)) or 'none'}")
        spec = json.loads(data)
        cls = DenseTable if spec["kind"] == "dense" else SparseTable
        self._tables[name] = cls(self, spec, [r[1] for r in replies])
        return self._tables[name]

    # -- helpers ----------------------------------------------------------------------------
    def _worker(self, what: str) -> None:
        if self.is_server:
            raise RuntimeError(f"rank {self.rank} is a server; {what}() is for workers")
        if self._finished:
            raise RuntimeError(f"worker rank {self.rank} has finished; no {what}() after "
                               "finish()")

    def _spec(self, name, kind, dim, shape, dtype, optimizer, lr, staleness, init,
              init_scale, seed, options) -> dict:
        self._worker(f"{kind}_table")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a table name is a non-empty string, got {name!r}")
        if int(dim) < 1:
            raise ValueError(f"table {name!r}: dim must be at least 1, got {dim}")
        P.dtype_code(dtype)
        optim.make(optimizer, 0, 1, dtype, lr, options)   # checks the name, options and lr
        if staleness is not None and (not isinstance(staleness, (int, np.integer))
                                      or staleness < 0):
            raise ValueError(f"table {name!r}: staleness is None (asynchronous) or an integer "
                             f">= 0, got {staleness!r}")
        if init not in _INITS:
            raise ValueError(f"table {name!r}: init is one of {_INITS}, got {init!r}")
        spec = {"name": name, "kind": kind, "dim": int(dim), "dtype": str(np.dtype(dtype)),
                "optimizer": optimizer, "lr": float(lr),
                "options": {k: float(v) for k, v in sorted(options.items())},
                "staleness": None if staleness is None else int(staleness), "init": init,
                "init_scale": float(init_scale), "seed": int(seed)}
        if shape is not None:
            spec["shape"] = list(shape)
            spec["rows"] = shape[0]
        return spec

    def _create(self, spec, cls):
        text = json.dumps(spec, sort_keys=True).encode()
        replies = self._control(P.Op.CREATE, text)
        for server, (status, _, data) in enumerate(replies):
            if status == P.Status.MISMATCH:
                theirs = json.loads(data)
                diff = {k: (theirs.get(k), spec.get(k)) for k in set(theirs) | set(spec)
                        if theirs.get(k) != spec.get(k)}
                raise ValueError(f"table {spec['name']!r} exists with other settings "
                                 f"(theirs, yours): {diff}")
        table = cls(self, spec, [r[1] for r in replies])
        self._tables[spec["name"]] = table
        return table

    def _control(self, op: int, payload: bytes) -> list:
        """Send a control request to every server; their (status, detail, data) replies."""
        from mpi4py import MPI
        reqs, out = [], []
        body = np.frombuffer(payload, np.uint8)
        for s in range(self.servers):
            rank = self.server_rank(s)
            rid = self.next_request()
            h_tag, d_tag = P.reply_tags(rid)
            head = np.zeros(P.REPLY, np.int64)
            data = bytearray(1 << 16)
            reqs += [self.comm.Irecv([head, MPI.INT64_T], rank, h_tag),
                     self.comm.Irecv([data, len(data), MPI.BYTE], rank, d_tag)]
            hdr = np.array([op, -1, rid, len(body), self.clock_value, 0, 0, 0], np.int64)
            reqs += [self.comm.Isend([hdr, MPI.INT64_T], rank, P.TAG_REQUEST),
                     self.comm.Isend([body, len(body), MPI.BYTE], rank, P.TAG_VALUES)]
            out.append((head, data, hdr))
        p2p.wait_all(reqs, lambda: f"parameter server: worker rank {self.rank}'s "
                                   f"{_OPS[op]} request", self.comm,
                     lambda: f"the replies of the {self.servers} server rank(s)")
        return [(int(h[0]), int(h[2]), bytes(d[:int(h[3])])) for h, d, _ in out]

    def _notify(self, op: int) -> None:
        from mpi4py import MPI
        hdr = np.array([op, -1, 0, 0, self.clock_value, 0, 0, 0], np.int64)
        reqs = [self.comm.Isend([hdr, MPI.INT64_T], self.server_rank(s), P.TAG_REQUEST)
                for s in range(self.servers)]
        p2p.wait_all(reqs, lambda: f"parameter server: worker rank {self.rank}'s "
                               f"{_OPS[op]} message", self.comm,
                     lambda: f"the {self.servers} server rank(s) to take it")
