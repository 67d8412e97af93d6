"""Table storage on a server: a dense shard (a row range) or a sparse shard (a hash table).

A table's rows are spread over the servers: a dense table of ``rows`` rows by contiguous
ranges (``dense_bounds``, the ``numpy.array_split`` split), a sparse table by a hash of the
int64 id (``shard_of``: splitmix64 of the id, modulo the number of servers), so that ids that
are close, or that a Zipf law makes popular, still land evenly. A sparse shard is a distributed
hash table's local part: ``KeyIndex`` maps ids to slots in a row store that grows by doubling;
a row is created on first touch, initialised by ``initial_rows`` (a pure function of the
table's seed, the id and the column, so a row's first value does not depend on which worker
touched it first, nor when).

Every lookup and update is vectorised over the request's keys (``numpy.searchsorted`` into
sorted key arrays); no Python loop runs per key.
"""
from __future__ import annotations

import numpy as np

from . import optim

__all__ = ["mix", "shard_of", "dense_bounds", "initial_rows", "KeyIndex", "DenseShard",
           "SparseShard", "make_shard"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def shard_of(ids: np.ndarray, servers: int) -> np.ndarray:
    """The server index (0 .. servers-1) holding each sparse id."""
    if servers == 1:
        return np.zeros(len(ids), dtype=np.int64)
    return (mix(ids.view(np.uint64)) % np.uint64(servers)).astype(np.int64)


def dense_bounds(rows: int, servers: int) -> np.ndarray:
    """Row boundaries of a dense table's shards: server s holds rows [b[s], b[s+1])."""
    q, r = divmod(rows, servers)
    sizes = np.full(servers, q, dtype=np.int64)
    sizes[:r] += 1
    return np.concatenate(([0], np.cumsum(sizes)))


def initial_rows(ids: np.ndarray, dim: int, dtype, init: str, scale: float,
                 seed: int) -> np.ndarray:
    """A table's first values for rows ``ids``: zeros, or uniform in [-scale, scale) drawn from
    (seed, id, column) by hashing."""
    out = np.zeros((len(ids), dim), dtype=dtype)
    if init == "zeros" or len(ids) == 0:
        return out
    with np.errstate(over="ignore"):
        x = (ids.astype(np.uint64)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)
             + np.uint64(seed) * _GOLDEN)
    u = (mix(x) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    out[...] = (2.0 * u - 1.0) * scale
    return out


class KeyIndex:
    """Sorted int64 keys -> slots, in two levels: a large main array and a small recent one
    merged into it when it grows past an eighth of the main, so that inserting a few new ids
    per request costs a merge of the small level, not a re-sort of all keys."""

    def __init__(self):
        self._keys = [np.empty(0, np.int64), np.empty(0, np.int64)]
        self._slots = [np.empty(0, np.int64), np.empty(0, np.int64)]

    def __len__(self) -> int:
        return len(self._keys[0]) + len(self._keys[1])

    def lookup(self, q: np.ndarray) -> np.ndarray:
        """The slot of each key of ``q``, -1 where absent."""
        out = np.full(len(q), -1, dtype=np.int64)
        for keys, slots in zip(self._keys, self._slots):
            if len(keys) == 0:
                continue
            pos = np.searchsorted(keys, q)
            np.minimum(pos, len(keys) - 1, out=pos)
            hit = keys[pos] == q
            out[hit] = slots[pos[hit]]
        return out

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Add distinct ``keys`` (none present yet) at ``slots``."""
        k = np.concatenate((self._keys[1], keys))
        s = np.concatenate((self._slots[1], slots))
        level = 1
        if len(k) > max(1024, len(self._keys[0]) // 8):
            k = np.concatenate((self._keys[0], k))
            s = np.concatenate((self._slots[0], s))
            self._keys[1] = self._slots[1] = np.empty(0, np.int64)
            level = 0
        order = np.argsort(k, kind="stable")
        self._keys[level] = k[order]
        self._slots[level] = s[order]


class DenseShard:
    """Rows [lo, hi) of a dense table, flattened to (rows, row size)."""

    def __init__(self, spec: dict, server: int, servers: int):
        b = dense_bounds(spec["rows"], servers)
        self.lo, self.hi = int(b[server]), int(b[server + 1])
        self.dim = spec["dim"]
        self.data = initial_rows(np.arange(self.lo, self.hi, dtype=np.int64), self.dim,
                                 spec["dtype"], spec["init"], spec["init_scale"], spec["seed"])
        self.optimizer = optim.make(spec["optimizer"], len(self.data), self.dim, spec["dtype"],
                                    spec["lr"], spec["options"])

    def check(self, keys):
        """The first key outside this shard, or None (keys None: the whole shard)."""
        if keys is None or len(keys) == 0:
            return None
        bad = (keys < self.lo) | (keys >= self.hi)
        return int(keys[np.argmax(bad)]) if bad.any() else None

    def _index(self, keys):
        return slice(None) if keys is None else keys - self.lo

    def rows(self, keys) -> np.ndarray:
        """The rows of ``keys`` (a view of the whole shard for None)."""
        return self.data if keys is None else self.data[keys - self.lo]

    def apply(self, keys, grads) -> None:
        """The optimizer's update of rows ``keys`` (distinct) with ``grads``."""
        self.optimizer.apply(self.data, self._index(keys), grads)

    def assign(self, keys, values) -> None:
        """Overwrite rows ``keys`` with ``values``."""
        self.data[self._index(keys)] = values


class SparseShard:
    """This server's rows of a sparse table: ids hashed here, created on first touch."""

    def __init__(self, spec: dict, server: int, servers: int):
        self.spec = spec
        self.dim = spec["dim"]
        self.index = KeyIndex()
        self.count = 0
        self.data = np.empty((1024, self.dim), dtype=spec["dtype"])
        self.optimizer = optim.make(spec["optimizer"], len(self.data), self.dim, spec["dtype"],
                                    spec["lr"], spec["options"])

    def check(self, keys):
        """Sparse ids are all valid."""
        return None

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """The slots of distinct ``keys``, creating the rows of new ones."""
        s = self.index.lookup(keys)
        new = s < 0
        if new.any():
            fresh = keys[new]
            n = len(fresh)
            if self.count + n > len(self.data):
                cap = max(2 * len(self.data), self.count + n)
                grown = np.empty((cap, self.dim), dtype=self.data.dtype)
                grown[:self.count] = self.data[:self.count]
                self.data = grown
                self.optimizer.resize(cap)
            at = np.arange(self.count, self.count + n, dtype=np.int64)
            self.data[at] = initial_rows(fresh, self.dim, self.data.dtype, self.spec["init"],
                                         self.spec["init_scale"], self.spec["seed"])
            self.index.insert(fresh, at)
            self.count += n
            s[new] = at
        return s

    def rows(self, keys) -> np.ndarray:
        """The rows of distinct ``keys`` (created if new)."""
        slots = self.slots(keys)   # first: it may grow self.data
        return self.data[slots]

    def apply(self, keys, grads) -> None:
        """The optimizer's update of rows ``keys`` (distinct) with ``grads``."""
        slots = self.slots(keys)
        self.optimizer.apply(self.data, slots, grads)

    def assign(self, keys, values) -> None:
        """Overwrite rows ``keys`` with ``values``."""
        slots = self.slots(keys)
        self.data[slots] = values


def make_shard(spec: dict, server: int, servers: int):
    """The shard of table ``spec`` that server ``server`` of ``servers`` holds."""
    cls = DenseShard if spec["kind"] == "dense" else SparseShard
    return cls(spec, server, servers)
