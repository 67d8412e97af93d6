"""A worker's handles on the tables: pull and push rows, blocking or not.

``SparseTable`` and ``DenseTable`` turn a call into one request per server that holds some of
its rows (vectorised: the keys are deduplicated with ``numpy.unique``, grouped by server with
one stable sort, and the reply rows land in one preallocated array, whole dense shards straight
into the result). A push sums the gradient rows of repeated ids on the worker, so a server
applies each row's update once. Every request is a handful of buffer-based non-blocking
point-to-point messages (``protocol``); ``ipull`` and ``ipush`` return a ``Request`` at once and
any number may be outstanding.

Bad input is refused on the worker before anything is sent, with a ``TableError`` (a
``ValueError``) naming the table and the offending key; what a server refuses comes back as the
same error, and the table is left as it was.
"""
from __future__ import annotations

import numpy as np

from .. import p2p
from . import protocol as P
from .store import dense_bounds, shard_of

__all__ = ["TableError", "Request", "Table", "SparseTable", "DenseTable"]


class TableError(ValueError):
    """A request a table refuses: unknown table, wrong dtype or dimension, key out of range."""


class Request:
    """A pending pull or push: ``wait()`` returns the pulled rows (None for a push) or raises
    the ``TableError`` of a refused request; ``test()`` says whether it has completed."""

    def __init__(self, table, what: str, reqs: list, heads: list, finish=None, keep=()):
        self.table = table
        self.what = what
        self._reqs = reqs
        self._heads = heads      # (server rank, reply header) per request sent
        self._finish = finish
        self._keep = keep        # buffers that must outlive the sends and receives
        self._done = False
        self._result = None

    def waiting_for(self) -> str:
        """The servers whose replies this request still waits for."""
        servers = sorted({server for server, _ in self._heads})
        return f"the replies of server rank{'s' if len(servers) > 1 else ''} " \
               f"{', '.join(map(str, servers))}"

    def test(self) -> bool:
        """Whether the request has completed (errors are raised by ``wait``)."""
        if not self._done and self._reqs:
            from mpi4py import MPI
            if not MPI.Request.Testall(self._reqs):
                return False
        return True

    def wait(self):
        """Complete the request; the rows of a pull, None for a push."""
        if self._done:
            return self._result
        if self._reqs:
            job = self.table.job
            p2p.wait_all(self._reqs, lambda: f"parameter server: worker rank {job.rank}'s "
                                             f"{self.what} of table {self.table.name!r}",
                         job.comm, lambda: self.waiting_for())
        self._done = True
        self._keep = ()
        for server, head in self._heads:
            if head[0] != P.Status.OK:
                raise self.table.error(self.what, server, int(head[0]), int(head[2]))
        if self._finish is not None:
            self._result = self._finish()
        return self._result


class Table:
    """What sparse and dense tables share: the spec, the ids each server gave it, sending."""

    def __init__(self, job, spec: dict, ids: list):
        self.job = job
        self.spec = spec
        self.name = spec["name"]
        self.dim = spec["dim"]
        self.dtype = np.dtype(spec["dtype"])
        self.staleness = spec["staleness"]
        self.code = P.dtype_code(self.dtype)
        self.server_ids = ids   # the id each server gave the table

    def __repr__(self):
        return (f"{type(self).__name__}({self.name!r}, dim={self.dim}, dtype={self.dtype}, "
                f"optimizer={self.spec['optimizer']!r}, staleness={self.staleness})")

    # -- the public calls -------------------------------------------------------------------
    def pull(self, ids=None, *, out=None) -> np.ndarray:
        """The rows of ``ids`` (shape ``ids.shape + (dim,)``), as consistent as the table's
        staleness requires at this worker's clock."""
        return self.ipull(ids, out=out).wait()

    def push(self, ids, grads=None) -> None:
        """Send gradient rows for ``ids``; the servers apply the table's optimizer."""
        self.ipush(ids, grads).wait()

    def assign(self, ids, values=None) -> None:
        """Overwrite rows with ``values`` (no optimizer): initial values, a checkpoint."""
        self._update(P.Op.ASSIGN, ids, values).wait()

    def ipull(self, ids=None, *, out=None) -> Request:
        """Non-blocking ``pull``: ``Request.wait()`` returns the rows."""
        return self._pull(ids, out)

    def ipush(self, ids, grads=None) -> Request:
        """Non-blocking ``push``; ``grads`` must not change until the request completes."""
        return self._update(P.Op.PUSH, ids, grads)

    # -- errors -----------------------------------------------------------------------------
    def error(self, what: str, server: int, status: int, detail: int) -> TableError:
        """The ``TableError`` of a status a server replied with."""
        where = f"table {self.name!r}: {what} refused by server rank {server}"
        if status == P.Status.UNKNOWN_TABLE:
            return TableError(f"{where}: the server has no table with id {detail}")
        if status == P.Status.OUT_OF_RANGE:
            return TableError(f"{where}: key {detail} is outside the table")
        if status == P.Status.BAD_DTYPE:
            return TableError(f"{where}: the table holds {p2p.dtype_of(detail).name}, this "
                              f"handle {self.dtype}")
        return TableError(f"{where}: {detail} bytes do not match the rows requested "
                          f"(dim {self.dim}, {self.dtype})")

    # -- keys -------------------------------------------------------------------------------
    def _keys(self, ids, what: str) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TableError(f"table {self.name!r}: {what} ids must be integers, got "
                             f"{ids.dtype}")
        return ids.reshape(-1).astype(np.int64, copy=False)

    def _group(self, keys: np.ndarray):
        """Distinct keys grouped by server: (sorted keys, per-server counts, position of each
        original key in the grouped order)."""
        uniq, inv = np.unique(keys, return_inverse=True)
        owner = self._owner(uniq)
        order = np.argsort(owner, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        counts = np.bincount(owner, minlength=self.job.servers)
        return uniq[order], counts, rank[inv.reshape(-1)]

    def _grads(self, ids, grads, what: str):
        if grads is None:
            raise TableError(f"table {self.name!r}: {what} needs ids and rows")
        keys = self._keys(ids, what)
        g = np.asarray(grads)
        if g.dtype != self.dtype:
            raise TableError(f"table {self.name!r}: {what} of {g.dtype} rows, the table holds "
                             f"{self.dtype} (key {keys[0] if len(keys) else None})")
        if g.size != len(keys) * self.dim or g.ndim < 1:
            raise TableError(f"table {self.name!r}: {what} of rows shaped {g.shape} for "
                             f"{len(keys)} keys, expected ({len(keys)}, {self.dim}) "
                             f"(key {keys[0] if len(keys) else None})")
        return keys, g.reshape(len(keys), self.dim)

    # -- sending ----------------------------------------------------------------------------
    def _send(self, server: int, op: int, keys, values, flags: int = 0, data=None):
        """Post one request to server index ``server``; the reply receives first."""
        job = self.job
        MPI = _mpi()
        rid = job.next_request()
        rank = job.server_rank(server)
        h_tag, d_tag = P.reply_tags(rid)
        head = np.zeros(P.REPLY, dtype=np.int64)
        reqs = [job.comm.Irecv([head, MPI.INT64_T], rank, h_tag)]
        if data is not None:
            view = data.reshape(-1).view(np.uint8)
            reqs.append(job.comm.Irecv([view, view.size, MPI.BYTE], rank, d_tag))
            job.received += view.size
        n = 0 if keys is None else len(keys)
        hdr = np.array([op, self.server_ids[server], rid, n, job.clock_value, flags,
                        self.code, 0], dtype=np.int64)
        reqs.append(job.comm.Isend([hdr, MPI.INT64_T], rank, P.TAG_REQUEST))
        sent = hdr.nbytes
        if keys is not None:
            reqs.append(job.comm.Isend([keys, MPI.INT64_T], rank, P.TAG_KEYS))
            sent += keys.nbytes
        if values is not None:
            v = values.reshape(-1).view(np.uint8)
            reqs.append(job.comm.Isend([v, v.size, MPI.BYTE], rank, P.TAG_VALUES))
            sent += v.size
        job.sent += sent
        job.received += head.nbytes
        return reqs, (rank, head), (hdr, keys, values, data)

    def _pull_rows(self, ids, shape, out) -> Request:
        """Pull the rows of ``ids`` (each fetched once, from its server) into a result of
        ``shape`` (``out`` if given)."""
        keys = self._keys(ids, "pull")
        grouped, counts, pos = self._group(keys)
        rows = np.empty((len(grouped), self.dim), dtype=self.dtype)
        result = _out(out, shape, self.dtype, self.name)
        parts, at = [], 0
        for s, c in enumerate(counts):
            if c:
                parts.append(self._send(s, P.Op.PULL, grouped[at:at + c], None,
                                        data=rows[at:at + c]))
            at += c

        def finish():
            np.take(rows, pos, axis=0, out=result.reshape(-1, self.dim))
            return result
        return self._post("pull", parts, finish, (rows,))

    def _post(self, what, parts, finish=None, keep=()) -> Request:
        reqs, heads, bufs = [], [], list(keep)
        for r, h, b in parts:
            reqs += r
            heads.append(h)
            bufs.append(b)
        req = Request(self, what, reqs, heads, finish, bufs)
        self.job.track(req)
        return req


class SparseTable(Table):
    """Rows by int64 id, spread over the servers by hash, created on first touch."""

    def _owner(self, keys):
        return shard_of(keys, self.job.servers)

    def _pull(self, ids, out) -> Request:
        if ids is None:
            raise TableError(f"table {self.name!r}: a sparse table pulls by ids")
        return self._pull_rows(ids, np.shape(ids) + (self.dim,), out)

    def _update(self, op, ids, grads) -> Request:
        what = "push" if op == P.Op.PUSH else "assign"
        keys, g = self._grads(ids, grads, what)
        grouped, counts, pos = self._group(keys)
        summed = np.zeros((len(grouped), self.dim), dtype=self.dtype)
        if len(grouped) == len(keys):
            summed[pos] = g
        elif op == P.Op.PUSH:
            np.add.at(summed, pos, g)
        else:
            summed[pos] = g   # assign: the last row given for a repeated id wins
        parts, at = [], 0
        for s, c in enumerate(counts):
            if c:
                parts.append(self._send(s, op, grouped[at:at + c], summed[at:at + c]))
            at += c
        return self._post(what, parts)


class DenseTable(Table):
    """An array of ``shape`` (rows on axis 0), spread over the servers by row ranges."""

    def __init__(self, job, spec, ids):
        super().__init__(job, spec, ids)
        self.shape = tuple(spec["shape"])
        self.rows = spec["rows"]
        self.bounds = dense_bounds(self.rows, job.servers)

    def _owner(self, keys):
        return np.searchsorted(self.bounds, keys, side="right") - 1

    def _keys(self, ids, what):
        keys = super()._keys(ids, what)
        bad = (keys < 0) | (keys >= self.rows)
        if bad.any():
            raise TableError(f"table {self.name!r}: {what} of key {int(keys[np.argmax(bad)])}, "
                             f"outside rows [0, {self.rows})")
        return keys

    def _pull(self, ids, out) -> Request:
        if ids is not None:
            return self._pull_rows(ids, np.shape(ids) + self.shape[1:], out)
        result = _out(out, self.shape, self.dtype, self.name)
        flat = result.reshape(self.rows, self.dim)
        parts = [self._send(s, P.Op.PULL, None, None, P.FLAG_WHOLE,
                            data=flat[self.bounds[s]:self.bounds[s + 1]])
                 for s in range(self.job.servers) if self.bounds[s + 1] > self.bounds[s]]
        return self._post("pull", parts, lambda: result)

    def _update(self, op, ids, grads) -> Request:
        what = "push" if op == P.Op.PUSH else "assign"
        if grads is None:      # push(grads): the whole array
            g = np.asarray(ids)
            if g.dtype != self.dtype:
                raise TableError(f"table {self.name!r}: {what} of {g.dtype}, the table holds "
                                 f"{self.dtype}")
            if g.shape != self.shape:
                raise TableError(f"table {self.name!r}: {what} of shape {g.shape}, the table "
                                 f"is {self.shape}")
            flat = np.ascontiguousarray(g).reshape(self.rows, self.dim)
            parts = [self._send(s, op, None, flat[self.bounds[s]:self.bounds[s + 1]],
                                P.FLAG_WHOLE)
                     for s in range(self.job.servers) if self.bounds[s + 1] > self.bounds[s]]
            return self._post(what, parts)
        keys, g = self._grads(ids, grads, what)
        grouped, counts, pos = self._group(keys)
        summed = np.zeros((len(grouped), self.dim), dtype=self.dtype)
        if len(grouped) == len(keys) or op != P.Op.PUSH:
            summed[pos] = g
        else:
            np.add.at(summed, pos, g)
        parts, at = [], 0
        for s, c in enumerate(counts):
            if c:
                parts.append(self._send(s, op, grouped[at:at + c], summed[at:at + c]))
            at += c
        return self._post(what, parts)


def _out(out, shape, dtype, name):
    if out is None:
        return np.empty(shape, dtype=dtype)
    if out.shape != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise TableError(f"table {name!r}: out must be a C-contiguous {dtype} array of shape "
                         f"{tuple(shape)}, got {out.dtype} {out.shape}")
    return out


def _mpi():
    from mpi4py import MPI
    return MPI

