"""The alpha-beta-gamma cost model: a schedule's predicted time on a topology, in virtual time.

``predict(collective, algorithm, size, nbytes, topology=..., model=...)`` builds every rank's
schedule as the API would and runs them through ``critical_path``; ``CostModel`` holds the
parameters (``python -m bench calibrate`` measures them, ``COLLECTIVES_COST_MODEL`` names the
file), ``collectives.topology.simulated`` the topology. Every rank runs its schedule the way the
MPI executor does:

- a rank has one CPU. Every op costs ``overhead`` of it when it is issued (the executor's
  Python work per op), a reduce also ``bytes * gamma`` and a copy ``bytes * delta``, and a
  receive ``overhead`` again when it completes. Requests are served first come, first served.
- a message of m bytes over a link of class c (``LINKS``: NUMA / node / network) takes
  ``alpha_c + m * beta_c`` from the moment it can start. Inside a node a CPU copies the bytes
  (shared memory, single copy as MPI's large-message path does): the receiver's CPU is busy
  for ``m * beta_c`` from when the send is issued or it is free. Across nodes the NICs move
  them: the transfer occupies the sending node's outgoing and the receiving node's incoming
  NIC port (shared by the node's ranks), and no CPU. Ranks of one node talk over ``numa`` when
  they share a NUMA domain of a topology that has several, else over ``node``.
- sends and receives to and from one peer are issued in program order, as the executor does;
  a send completes when its message has arrived, a receive when it is issued and the message
  has arrived.
- with more ranks on a node than cores, ranks share cores: a rank runs on core (local rank mod
  cores) of its node (a collective's ranks move in step, and the scheduler does not rebalance
  them fast enough to matter), and a message inside the node waits ``switch`` longer (the
  receiver may be descheduled).
- the memory-bound rates (copies inside a node, reduce, copy) are read at the size of the
  call's buffers on a node, all its ranks together (``CostModel.sized``): what fits in the
  (shared) cache moves faster than what does not.

The schedules form a DAG (the ops, their dependencies, the messages and the resource order), so
the finish time is the length of its critical path; ``Prediction.path`` splits that path into
latency, transfer, compute and overhead. Symmetry: when every rank's schedule is a shifted
(r -> r + m) or XOR-ed (r -> r ^ m) copy of another's and the topology repeats with the same
period, ranks that map onto each other do the same thing at the same times, so only one
period of ranks (one node, say) is simulated; a message to a rank outside it is delivered to
its image inside. The symmetry is checked on a few sample ranks before it is used.
"""
from __future__ import annotations

import heapq
import inspect
import itertools
import json
import math
import os
from array import array
from pathlib import Path

from . import config
from .schedule import RECV, REDUCE, SEND, Schedule, build, split
from .sim import Deadlock
from .topology import OTHER_NODE, SAME_NODE, SAME_NUMA, Topology, simulated

__all__ = ["LINKS", "CURVES", "CostModel", "DEFAULT_MODEL", "Prediction", "critical_path",
           "link_classes", "link_bytes", "predict", "build_schedule", "SYMMETRY_MIN"]

LINKS = ("numa", "node", "net")
CURVES = ("node", "reduce", "copy")
_NUMA, _NODE, _NET = SAME_NUMA, SAME_NODE, OTHER_NODE  # indices into LINKS
# Kinds of critical-path steps.
_PATH = ("latency", "transfer", "compute", "overhead")
_LAT, _XFER, _COMP, _OVH = 0, 1, 2, 3


class CostModel:
    """Alpha-beta-gamma parameters: per link class a latency ``alpha`` (s) and a bandwidth
    (bytes/s); the reduction and copy bandwidths (bytes of result per second); the executor's
    CPU ``overhead`` per op (s), the per-call overhead ``call`` (s), and ``switch`` (s): the
    extra latency of a message inside a node with more ranks than cores, where the receiver may
    have to be scheduled in first.

    ``curves`` (optional): how the memory-bound rates depend on the size of the call, since a
    buffer that fits in cache moves several times faster than one streamed from memory.
    ``{"node": [(bytes, bytes/s),
    ...], "reduce": [...], "copy": [...]}`` with bytes the buffers of *all the ranks of a node*
    together (the cache is shared), as ``bench calibrate`` measures them; ``sized(nbytes)``
    reads them (log-log interpolation, flat beyond the ends) into a plain model for a call with
    ``nbytes`` of buffers per node. ``node`` stands for both links inside a node. Without curves
    the scalar rates hold at every size."""

    __slots__ = ("alpha", "bandwidth", "reduce_bandwidth", "copy_bandwidth", "overhead", "call",
                 "switch", "source", "curves")

    def __init__(self, alpha, bandwidth, reduce_bandwidth: float, copy_bandwidth: float,
                 overhead: float = 0.0, call: float = 0.0, source: str = "",
                 switch: float = 0.0, curves: dict | None = None):
        alpha, bandwidth = dict(alpha), dict(bandwidth)
        for name in LINKS:
            if alpha.get(name) is None or alpha[name] < 0:
                raise ValueError(f"link {name!r}: alpha must be >= 0 seconds, got "
                                 f"{alpha.get(name)!r}")
            if bandwidth.get(name) is None or bandwidth[name] <= 0:
                raise ValueError(f"link {name!r}: bandwidth must be > 0 bytes/s, got "
                                 f"{bandwidth.get(name)!r}")
        if reduce_bandwidth <= 0 or copy_bandwidth <= 0:
            raise ValueError(f"reduce and copy bandwidths must be > 0 bytes/s, got "
                             f"{reduce_bandwidth}, {copy_bandwidth}")
        if overhead < 0 or call < 0 or switch < 0:
            raise ValueError(f"overheads must be >= 0 s, got {overhead}, {call}, {switch}")
        self.alpha = {k: float(alpha[k]) for k in LINKS}
        self.bandwidth = {k: float(bandwidth[k]) for k in LINKS}
        self.reduce_bandwidth = float(reduce_bandwidth)
        self.copy_bandwidth = float(copy_bandwidth)
        self.overhead, self.call, self.source = float(overhead), float(call), source
        self.switch = float(switch)
        self.curves = {}
        for name, points in (curves or {}).items():
            if name not in CURVES:
                raise ValueError(f"unknown curve {name!r}; expected some of {CURVES}")
            points = sorted((int(m), float(v)) for m, v in points)
            if not points or any(m <= 0 or v <= 0 for m, v in points):
                raise ValueError(f"curve {name!r}: points must be (bytes > 0, rate > 0), got "
                                 f"{points!r}")
            self.curves[name] = points

    def sized(self, nbytes: int) -> CostModel:
        """The model for a call with ``nbytes`` of buffers per node: the scalar rates replaced
        by the curves' values at that size (itself when there are no curves)."""
        if not self.curves or nbytes <= 0:
            return self
        rate = {name: _interpolate(points, nbytes) for name, points in self.curves.items()}
        bandwidth = dict(self.bandwidth)
        if "node" in rate:
            bandwidth.update(numa=rate["node"], node=rate["node"])
        return CostModel(self.alpha, bandwidth, rate.get("reduce", self.reduce_bandwidth),
                         rate.get("copy", self.copy_bandwidth), self.overhead, self.call,
                         self.source, self.switch)

    @property
    def gamma(self) -> float:
        """Seconds per byte of reduction result."""
        return 1.0 / self.reduce_bandwidth

    def beta(self, link: str) -> float:
        """Seconds per byte over ``link``."""
        return 1.0 / self.bandwidth[link]

    def replace(self, **links) -> CostModel:
        """A copy with some link parameters replaced: ``net=(alpha, bandwidth)``; None keeps."""
        alpha, bandwidth = dict(self.alpha), dict(self.bandwidth)
        for name, (a, bw) in links.items():
            if name not in LINKS:
                raise ValueError(f"unknown link class {name!r}; expected one of {LINKS}")
            if a is not None:
                alpha[name] = a
            if bw is not None:
                bandwidth[name] = bw
        return CostModel(alpha, bandwidth, self.reduce_bandwidth, self.copy_bandwidth,
                         self.overhead, self.call, self.source, self.switch, self.curves)

    def to_dict(self) -> dict:
        """The JSON form (seconds and bytes per second)."""
        return {"version": 1,
                "links": {k: {"alpha": self.alpha[k], "bandwidth": self.bandwidth[k]}
                          for k in LINKS},
                "reduce_bandwidth": self.reduce_bandwidth, "copy_bandwidth": self.copy_bandwidth,
                "overhead": self.overhead, "call": self.call, "switch": self.switch,
                "curves": {k: [list(p) for p in v] for k, v in self.curves.items()},
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """Read the JSON form written by ``to_dict``."""
        if data.get("version") != 1:
            raise ValueError(f"cost model version {data.get('version')!r}, expected 1")
        links = data["links"]
        return cls({k: links[k]["alpha"] for k in LINKS},
                   {k: links[k]["bandwidth"] for k in LINKS},
                   data["reduce_bandwidth"], data["copy_bandwidth"], data.get("overhead", 0.0),
                   data.get("call", 0.0), data.get("source", ""), data.get("switch", 0.0),
                   data.get("curves"))

    @staticmethod
    def default_path() -> Path:
        """``COLLECTIVES_COST_MODEL`` or ``~/.cache/collectives/costmodel.json``."""
        named = config.get("COLLECTIVES_COST_MODEL")
        if named:
            return Path(named)
        return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / \
            "collectives" / "costmodel.json"

    @classmethod
    def load(cls, path=None) -> CostModel:
        """The calibrated model at ``path`` (default path), else ``DEFAULT_MODEL``."""
        named = path is None and config.get("COLLECTIVES_COST_MODEL") is not None
        where = f"COLLECTIVES_COST_MODEL={str(cls.default_path())!r}" if named else str(path)
        path = Path(path) if path is not None else cls.default_path()
        if not path.exists():
            if path == cls.default_path() and not named:
                return DEFAULT_MODEL
            if named:
                raise ValueError(f"{where}: no such file; `python -m bench calibrate` writes one")
            raise FileNotFoundError(f"no cost model at {path}; run python -m bench calibrate")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}: not a cost model file ({exc!r}); run python -m bench "
                             f"calibrate") from None

    def save(self, path=None) -> Path:
        """Write the JSON form to ``path`` (default path); returns the path."""
        path = Path(path) if path is not None else self.default_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def __repr__(self):
        links = ", ".join(f"{k}: {self.alpha[k] * 1e6:.2f} us {self.bandwidth[k] / 1e9:.2f} GB/s"
                          for k in LINKS)
        return (f"CostModel({links}; reduce {self.reduce_bandwidth / 1e9:.2f} GB/s, copy "
                f"{self.copy_bandwidth / 1e9:.2f} GB/s, overhead {self.overhead * 1e6:.2f} us/op, "
                f"call {self.call * 1e6:.1f} us, switch {self.switch * 1e6:.1f} us"
                + (f"; curves: {', '.join(self.curves)}" if self.curves else "") + ")")


def _interpolate(points, x: float) -> float:
    """Piecewise log-log linear through ``points`` [(x, y), ...] sorted by x; flat outside."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    return points[-1][1]


# ``python -m bench calibrate`` on the project's CI machine kind (2 shared cores, MPICH from the
# package index), rounded, without ``switch`` (it depends on the load); the network is a typical
# 100 Gb/s fabric (5 us, 12.5 GB/s).
DEFAULT_MODEL = CostModel(
    alpha={"numa": 2.5e-6, "node": 2.5e-6, "net": 5e-6},
    bandwidth={"numa": 3.3e9, "node": 3.3e9, "net": 12.5e9},
    reduce_bandwidth=2e9, copy_bandwidth=3.5e9, overhead=1.5e-6, call=50e-6,
    source="built-in defaults (this project's 2-core CI machine kind)")


class Prediction:
    """What the model predicts for one collective: ``time`` (s), its critical ``path`` split in
    seconds of latency/transfer/compute/overhead, ``hops`` (messages on that path), ``ops``
    simulated, ``simulated`` ranks and the ``method``: "all ranks", "shift symmetry", "xor
    symmetry" or "extrapolated from k1, k2 segments"."""

    __slots__ = ("time", "path", "hops", "ops", "simulated", "method")

    def __init__(self, time, path, hops, ops, simulated, method="all ranks"):
        self.time, self.path, self.hops, self.ops = time, path, hops, ops
        self.simulated, self.method = simulated, method

    def __repr__(self):
        parts = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in self.path.items())
        return (f"Prediction({self.time * 1e6:.1f} us: {parts}; {self.hops} hops, {self.ops} ops, "
                f"{self.simulated} ranks simulated, {self.method})")


class _Compiled:
    """What the model needs of one schedule, shared by every rank whose schedule has the same
    ops up to the names of its peers (tree leaves, say): kinds, lengths, the dependency DAG, and
    each message's queue (per peer and direction, numbered by first appearance) and position."""

    __slots__ = ("kinds", "nelems", "users", "ndeps", "order", "qid", "queues")

    def __init__(self, schedule):
        ops = schedule.ops
        self.kinds = [op[0] for op in ops]
        self.nelems = [op.nelems() for op in ops]
        deps = schedule.deps()
        self.users: list[list[int]] = [[] for _ in ops]
        for i, d in enumerate(deps):
            for j in d:
                self.users[j].append(i)
        self.ndeps = [len(d) for d in deps]
        self.order = [0] * len(ops)
        self.qid = [-1] * len(ops)
        ids: dict = {}
        self.queues: list[list[int]] = []
        for i, op in enumerate(ops):
            if op[0] <= RECV:
                q = ids.get((op[0], op[1]))
                if q is None:
                    q = ids[(op[0], op[1])] = len(self.queues)
                    self.queues.append([])
                self.order[i] = len(self.queues[q])
                self.qid[i] = q
                self.queues[q].append(i)


def _shape(schedule) -> tuple:
    """A key equal for schedules that are the same up to a renaming of peers."""
    names: dict[int, int] = {}
    return (schedule.alias,) + tuple(
        (kind, names.setdefault(peer, len(names)) if peer >= 0 else -1, dst, srcs)
        for kind, peer, dst, srcs in schedule.ops)


class _Rank:
    """One simulated rank: its compiled schedule, peers, and the state of the simulation."""

    __slots__ = ("rank", "kinds", "peers", "nbytes", "users", "pending", "rtime", "rnode",
                 "order", "qid", "queues", "next", "posted", "cpu")

    def __init__(self, rank, schedule, itemsize, cache: dict):
        key = _shape(schedule)
        c = cache.get(key)
        if c is None:
            c = cache[key] = _Compiled(schedule)
        self.rank = rank
        self.kinds, self.users, self.order, self.qid, self.queues = \
            c.kinds, c.users, c.order, c.qid, c.queues
        self.peers = [op[1] for op in schedule.ops]
        self.nbytes = [e * itemsize for e in c.nelems]
        self.pending = list(c.ndeps)
        n = len(c.kinds)
        self.rtime = [0.0] * n
        self.rnode = [0] * n
        self.next = [0] * len(c.queues)
        self.posted: list = [None] * n
        self.cpu = [0.0, 0]  # when its core is free next, and that critical-path node


def _identity_canon(size):
    return lambda q, r: (q, r)


def _shift_canon(size, period):
    def canon(q, r):
        rep = q % period
        return rep, (r - (q - rep)) % size
    return canon


def _xor_canon(size, period):
    def canon(q, r):
        rep = q & (period - 1)
        return rep, r ^ (q ^ rep)
    return canon


def link_classes(topology: Topology):
    """``link(a, b)``: the model's link class (index into ``LINKS``) between two ranks. Ranks of
    one node share the ``numa`` class only where the topology cuts nodes into NUMA domains."""
    if topology.has_numa:
        return topology.link
    node = topology.node
    return lambda a, b: _NODE if node[a] == node[b] else _NET


def critical_path(schedules, topology: Topology, model: CostModel, itemsize: int, *,
                  canon=None, method: str = "all ranks") -> Prediction:
    """Run ``schedules`` (a list, one per rank, or ``{rank: schedule}`` of the ranks simulated
    with ``canon``) through the cost model; returns the ``Prediction``.

    ``canon(q, r) -> (q', r')``: the simulated rank q' that stands for rank q, and the rank r'
    that stands for sender r from q''s point of view (symmetry; identity by default).
    """
    if not isinstance(schedules, dict):
        schedules = dict(enumerate(schedules))
    size = topology.size
    canon = canon or _identity_canon(size)
    cache: dict = {}
    ranks = {r: _Rank(r, s, itemsize, cache) for r, s in schedules.items()}
    o = model.overhead
    gam, dlt = 1.0 / model.reduce_bandwidth, 1.0 / model.copy_bandwidth
    alphas = [model.alpha[k] for k in LINKS]
    if topology.oversubscription > 1:
        # Ranks share cores: rank r runs on core (r mod cores) of its node, one timeline per
        # core, and a message waits ``switch`` longer (its receiver may be descheduled).
        cores = topology.cores_per_node
        shared: dict = {}
        for r, st in ranks.items():
            key = (topology.node[r], topology.local_rank(r) % cores)
            st.cpu = shared.setdefault(key, st.cpu)
        alphas[_NUMA] += model.switch
        alphas[_NODE] += model.switch
    betas = [1.0 / model.bandwidth[k] for k in LINKS]
    # Critical-path nodes: time, predecessor, kind of the step from the predecessor.
    nt, npred, nkind = array("d", [0.0]), array("q", [-1]), array("b", [_OVH])
    nt_add, npred_add, nkind_add = nt.append, npred.append, nkind.append
    heap: list = []
    tick = itertools.count()
    heappush, heappop = heapq.heappush, heapq.heappop
    link, node_of = link_classes(topology), topology.node
    nic_out: dict[int, tuple[float, int]] = {}
    nic_in: dict[int, tuple[float, int]] = {}
    arrived: dict = {}   # (src, dst, n) -> (time, node) of a message nobody received yet
    waiting: dict = {}   # (src, dst, n) -> (time, node, rank, op) of a posted receive
    last = [0.0, 0]  # finish time and node of the op that ends last

    for st in ranks.values():
        if model.call:
            nt_add(st.cpu[0] + model.call), npred_add(st.cpu[1]), nkind_add(_OVH)
            st.cpu[:] = nt[-1], len(nt) - 1
        for i, n in enumerate(st.pending):
            if n == 0:
                heap.append((0.0, next(tick), 0, st.rank, i, 0))
    heapq.heapify(heap)

    def finish(st, i, t, nd):
        """Op i of ``st`` ends at t: its users whose last dependency this was become ready."""
        if t > last[0]:
            last[0], last[1] = t, nd
        pending, rtime, rnode = st.pending, st.rtime, st.rnode
        for u in st.users[i]:
            pending[u] -= 1
            if t > rtime[u] or rnode[u] == 0:
                rtime[u], rnode[u] = t, nd
            if pending[u] == 0:
                heappush(heap, (rtime[u], next(tick), 0, st.rank, u, rnode[u]))

    def cpu_at(st, t, nd, cost, kind):
        """Book the CPU of ``st`` for ``cost`` from ``t`` (first come, first served)."""
        cpu = st.cpu
        if cpu[0] > t:
            t, nd = cpu
        end = t + cost
        nt_add(end), npred_add(nd), nkind_add(kind)
        cpu[0], cpu[1] = end, len(nt) - 1
        return end, cpu[1]

    def arrive(st, i, rep, src, arrival, xn):
        """Send i of ``st`` arrives at ``rep`` (from ``src``, as rep sees it) at ``arrival``."""
        nt_add(arrival), npred_add(xn), nkind_add(_LAT)
        an = len(nt) - 1
        finish(st, i, arrival, an)
        mkey = (src, rep, st.order[i])
        hit = waiting.pop(mkey, None)
        if hit is None:
            arrived[mkey] = (arrival, an)
        elif hit[0] > arrival:
            heappush(heap, (hit[0], next(tick), 2, hit[2], hit[3], hit[1]))
        else:
            heappush(heap, (arrival, next(tick), 2, hit[2], hit[3], an))

    def post(st, key):
        """Issue the messages of queue ``key`` whose turn has come and that are ready."""
        q, pos, posted, rank = st.queues[key], st.next[key], st.posted, st.rank
        while pos < len(q) and posted[q[pos]] is not None:
            i = q[pos]
            t, nd = cpu_at(st, posted[i][0], posted[i][1], o, _OVH)
            if st.kinds[i] == SEND:
                heappush(heap, (t, next(tick), 1, rank, i, nd))
            else:
                mkey = (st.peers[i], rank, st.order[i])
                hit = arrived.pop(mkey, None)
                if hit is None:
                    waiting[mkey] = (t, nd, rank, i)
                elif t >= hit[0]:
                    heappush(heap, (t, next(tick), 2, rank, i, nd))
                else:
                    heappush(heap, (hit[0], next(tick), 2, rank, i, hit[1]))
            pos += 1
        st.next[key] = pos

    while heap:
        t, _, what, rank, i, nd = heappop(heap)
        st = ranks[rank]
        if what == 0:  # op i became ready
            kind = st.kinds[i]
            if kind >= REDUCE:
                cost = o + st.nbytes[i] * (gam if kind == REDUCE else dlt)
                end, en = cpu_at(st, t, nd, cost, _COMP)
                finish(st, i, end, en)
            else:
                st.posted[i] = (t, nd)
                key = st.qid[i]
                if st.order[i] == st.next[key]:
                    post(st, key)
        elif what == 1:  # a send was issued: move the message
            peer = st.peers[i]
            cls = link(rank, peer)
            rep, src = canon(peer, rank)
            wire = st.nbytes[i] * betas[cls]
            if cls == _NET:
                a, b = node_of[rank], node_of[rep]
                for port in (nic_out.get(a), nic_in.get(b)):
                    if port is not None and port[0] > t:
                        t, nd = port
                end = t + wire
                nt_add(end), npred_add(nd), nkind_add(_XFER)
                xn = len(nt) - 1
                nic_out[a] = nic_in[b] = (end, xn)
            else:
                # Inside a node the receiver's CPU copies the bytes (single copy, as MPI's
                # large-message shared-memory path does), from when the send is issued or the
                # CPU is free; booked below at t, so that bookings are made in time order.
                heappush(heap, (t, next(tick), 3, rank, i, nd))
                continue
            arrive(st, i, rep, src, end + alphas[cls], xn)
        elif what == 3:  # the receiver of an intra-node message copies it
            rep, src = canon(st.peers[i], rank)
            other = ranks[rep]  # under symmetry maybe the sender itself (its image)
            cls = link(rank, st.peers[i])
            end, en = cpu_at(other, t, nd, st.nbytes[i] * betas[cls], _XFER)
            arrive(st, i, rep, src, end + alphas[cls], en)
        else:  # a receive's message is in: the executor completes it
            end, en = cpu_at(st, t, nd, o, _OVH)
            finish(st, i, end, en)
    if waiting or arrived or any(any(st.pending) for st in ranks.values()):
        stuck = [f"rank {r}: {sum(1 for p in st.pending if p)} ops blocked"
                 for r, st in ranks.items() if any(st.pending)]
        stuck += [f"rank {k[1]}: receive from rank {k[0]} never sent" for k in waiting]
        stuck += [f"rank {k[0]}: message to rank {k[1]} never received" for k in arrived]
        raise Deadlock("the cost model cannot finish the schedules (unmatched messages?):\n  "
                       + "\n  ".join(stuck[:8]))
    path = dict.fromkeys(_PATH, 0.0)
    hops, n = 0, last[1]
    while n > 0:
        p = npred[n]
        path[_PATH[nkind[n]]] += nt[n] - nt[p]
        hops += nkind[n] == _LAT
        n = p
    ops = sum(len(st.kinds) for st in ranks.values())
    return Prediction(last[0], path, hops, ops, len(ranks), method)


def build_schedule(collective: str, builder, rank: int, size: int, count: int, *, root: int = 0,
                   seg: int | None = None, **kwargs) -> Schedule:
    """``builder``'s schedule for ``rank``, called as the API does; ``count`` is the element
    count of the per-rank input (allreduce, reduce, broadcast) or of the whole buffer
    (reduce_scatter: the input; allgather, gather and scatter: the root's or output buffer),
    split evenly over the ranks; for alltoall, the per-rank input in equal blocks."""
    if collective == "alltoall":
        row = (count // size,) * size
        return build(builder, collective, rank, size, count, (row, row, (row,) * size), root,
                     seg, **kwargs)
    bounds = split(count, size)
    counts = tuple(bounds[k + 1] - bounds[k] for k in range(size))
    return build(builder, collective, rank, size, count, counts, root, seg, **kwargs)


def _signature(s: Schedule, g):
    return [(op[0], g(op[1]) if op[1] >= 0 else -1, op.nelems()) for op in s.ops]


def _same(a, b) -> bool:
    """Two signatures match: kinds and peers equal, lengths within one element (ragged)."""
    return len(a) == len(b) and all(x[0] == y[0] and x[1] == y[1] and abs(x[2] - y[2]) <= 1
                                    for x, y in zip(a, b))


def _symmetry(build, size: int, period: int, reps: dict):
    """("shift" | "xor", canon) if sample ranks' schedules are images of their
    representatives' under that map, else None."""
    samples = sorted({period, period + period // 2 + 1, size // 2 + 1, size - 1} - set(reps))
    samples = [x for x in samples if period <= x < size]
    built = {x: build(x) for x in samples}
    kinds = [("shift", lambda x, m: (lambda y: (y - m) % size), lambda x: x % period)]
    if size & (size - 1) == 0 and period & (period - 1) == 0:
        kinds.append(("xor", lambda x, m: (lambda y: y ^ m), lambda x: x & (period - 1)))
    for name, gmap, rep_of in kinds:
        ok = True
        for x, s in built.items():
            rep = rep_of(x)
            m = x - rep if name == "shift" else x ^ rep
            if not _same(_signature(s, gmap(x, m)), _signature(reps[rep], lambda y: y)):
                ok = False
                break
        if ok:
            canon = _shift_canon(size, period) if name == "shift" else _xor_canon(size, period)
            return name, canon
    return None


SYMMETRY_MIN = 32  # below this many ranks every rank is simulated (cheap, and exact)


def predict(collective: str, algorithm, size: int, nbytes: int, *, itemsize: int = 4,
            root: int = 0, topology: Topology | None = None, model: CostModel | None = None,
            seg_bytes: int | None = None, symmetry: str = "auto", max_ops: int = 2_000_000,
            **kwargs) -> Prediction:
    """Predict the time of ``algorithm`` (a registered name or a builder) for ``collective`` of
    ``nbytes`` on ``size`` ranks (``nbytes`` as the benchmark's size column: the per-rank input,
    or the whole buffer for reduce_scatter and allgather).

    How: every rank is simulated when ``size < SYMMETRY_MIN`` or ``symmetry="none"``. Otherwise
    a symmetry (shift or XOR of ranks, checked on sample ranks) lets one period of the topology
    stand for all ranks. Without one, if every rank's schedule together exceeds ``max_ops`` ops,
    the model runs two smaller messages of k1 and k2 = 2 k1 >= 8 segments (as many as
    ``max_ops`` allows, at most half the real count) and extrapolates linearly in the number of
    segments: exact for a pipeline in its steady state, an approximation otherwise.
    ``seg_bytes``: the executor's segment size (default: ``COLLECTIVES_SEGMENT_BYTES``). Extra
    ``kwargs`` go to the builder.
    """
    from . import select
    if isinstance(algorithm, str):
        record = select.get(collective, algorithm)
        if record.kind != select.SCHEDULE:
            raise ValueError(f"{collective} {algorithm!r} is not a schedule algorithm: the "
                             f"cost model cannot run it")
        builder = record.build[collective]
        wants_topology = record.needs == select.TOPOLOGY
    else:
        builder = algorithm
        wants_topology = "nodes" in inspect.signature(builder).parameters
    topology = topology or simulated(size)
    if wants_topology:
        # A topology-aware builder: the API passes the communicator's topology, we pass ours.
        kwargs = {**dict(topology.kwargs()), **kwargs}
    if symmetry not in ("auto", "none"):
        raise ValueError(f"symmetry must be 'auto' or 'none', got {symmetry!r}")
    if topology.size != size:
        raise ValueError(f"topology has {topology.size} ranks, expected {size}")
    model = (model or CostModel.load()).sized(nbytes * topology.ranks_per_node)
    seg = max(1, (seg_bytes or config.get("COLLECTIVES_SEGMENT_BYTES")) // itemsize)
    count = nbytes // itemsize
    if count == 0 or size == 1:
        return Prediction(model.call * topology.oversubscription, dict.fromkeys(_PATH, 0.0), 0,
                          0, size)

    def builds(n):
        return lambda r: build_schedule(collective, builder, r, size, n, root=root, seg=seg,
                                        **kwargs)

    build = builds(count)
    period = topology.period()
    if topology.oversubscription > 1 and period is not None and period % topology.ranks_per_node:
        period = None  # ranks share cores: simulate whole nodes
    if symmetry == "auto" and size >= SYMMETRY_MIN and period is not None and period < size:
        reps = {r: build(r) for r in range(period)}
        found = _symmetry(build, size, period, reps)
        if found is not None:
            name, canon = found
            return critical_path(reps, topology, model, itemsize, canon=canon,
                                 method=f"{name} symmetry")
    first = build(0)
    total = len(first.ops) * size  # a first guess; exact once every schedule is built
    if total <= 20 * max_ops:
        schedules = [first] + [build(r) for r in range(1, size)]
        total = sum(len(s.ops) for s in schedules)
        if total <= max_ops:
            return critical_path(schedules, topology, model, itemsize)
        del schedules
    # Segments of the longest message: the whole buffer, or one block for the scattering ones.
    unit = seg * size if collective in ("reduce_scatter", "allgather") else seg
    nseg = count / unit
    k2 = min(int(nseg) // 2, int(max_ops / total * nseg))
    if k2 < 8:
        raise ValueError(f"{collective} {algorithm!r} on {size} ranks has about {total} ops, "
                         f"no symmetry to exploit and too few segments to extrapolate within "
                         f"max_ops={max_ops}: model fewer ranks, or raise max_ops")
    k1 = k2 // 2
    lo, hi = (critical_path([builds(k * unit)(r) for r in range(size)], topology, model,
                            itemsize) for k in (k1, k2))
    scale = (nseg - k2) / (k2 - k1)
    path = {k: hi.path[k] + (hi.path[k] - lo.path[k]) * scale for k in _PATH}
    return Prediction(hi.time + (hi.time - lo.time) * scale, path,
                      round(hi.hops + (hi.hops - lo.hops) * scale), lo.ops + hi.ops, size,
                      f"extrapolated from {k1} and {k2} segments")


def link_bytes(collective: str, algorithm, size: int, nbytes: int, *, itemsize: int = 4,
               root: int = 0, topology: Topology | None = None,
               seg_bytes: int | None = None) -> list[int]:
    """The bytes every rank of ``algorithm``'s schedules sends, summed per link class
    (``LINKS`` order: same NUMA domain, same node, other node), for the call ``predict`` would
    model: the count the model's transfers are made of."""
    from . import select
    record = select.get(collective, algorithm)
    if record.kind != select.SCHEDULE:
        raise ValueError(f"{collective} {algorithm!r} is not a schedule algorithm: the cost "
                         f"model cannot count its bytes")
    topology = topology or simulated(size)
    kwargs = dict(topology.kwargs()) if record.needs == select.TOPOLOGY else {}
    seg = max(1, (seg_bytes or config.get("COLLECTIVES_SEGMENT_BYTES")) // itemsize)
    out = [0, 0, 0]
    for r in range(size):
        s = build_schedule(collective, record.build[collective], r, size, nbytes // itemsize,
                           root=root, seg=seg, **kwargs)
        for op in s.ops:
            if op[0] == SEND:
                out[topology.link(r, op[1])] += op.nelems() * itemsize
    return out
