"""What the toolkit knows about where ranks run: nodes, NUMA domains, and link classes.

A ``Topology`` is a small immutable table for one communicator: the node and the NUMA domain of
every rank (both numbered 0, 1, ... in order of their lowest rank), from which follow the node
groups, the NUMA groups, each group's leader (its lowest rank) and the *link class* of any pair
of ranks: ``SAME_NUMA`` (0), ``SAME_NODE`` (1, another NUMA domain of the node) or
``OTHER_NODE`` (2). ``topology(comm)`` discovers it once per communicator and caches it in the
toolkit's context; discovery is collective (every rank of ``comm`` must call it, in the same
order as its other collectives: the algorithms that need it do so inside a collective call).

Discovery:

- *Nodes*: ``Split_type(MPI.COMM_TYPE_SHARED)`` groups the ranks that share memory; a node is
  named by the lowest rank it holds, and one small ``Allgather`` tells every rank every name.
- *NUMA domains*: each rank reads its CPU affinity (``os.sched_getaffinity``) and the CPU lists
  of ``/sys/devices/system/node/node*/cpulist``. A rank bound inside one NUMA node belongs to
  that domain. If any rank of a node is not bound inside one domain (the default: processes
  float over every CPU), the whole node counts as one domain, since where its memory lives is
  then up to the kernel, not the rank.
- *Simulation*: ``COLLECTIVES_RANKS_PER_NODE=k`` makes nodes of consecutive rank blocks
  (ranks 0..k-1, k..2k-1, ...; the last may be smaller: 5 ranks with k = 3 are 3 + 2) and
  ``COLLECTIVES_RANKS_PER_NUMA=j`` cuts every node into domains of j consecutive ranks (the last
  may be smaller). Either works alone: j without k simulates domains inside the real nodes.
  Every rank must see the same values (checked: a mismatch is a ``ValueError`` on every rank).
  Both are read through ``collectives.config``. ``simulated(size, k, j, cores_per_node)`` is the
  same table without MPI, for the simulator and the cost model (``collectives.costmodel``), which
  also read ``cores_per_node`` (``oversubscription``) and the rank shift that maps the topology
  onto itself (``period``).

Sub-communicators (``communicators(comm)``) are made on demand, collectively, and cached:
``node`` (the ranks of this rank's node), ``cross`` (the ranks with this rank's local index on
every node: Horovod's and han's "cross" communicator; ranks whose local index exceeds a smaller
node's size simply have fewer peers), ``numa`` and ``leaders`` (the lowest rank of every node,
``COMM_NULL`` elsewhere).

The bytes a rank sends per link class are counted by ``collectives.traffic``; run
``mpiexec -n 4 python -m collectives.topology`` to print what a job sees.
"""
from __future__ import annotations

import os
import re

import numpy as np

from .. import config

__all__ = ["Topology", "topology", "simulated", "communicators", "Communicators", "node_comm",
           "SAME_NUMA", "SAME_NODE", "OTHER_NODE", "LINK_NAMES", "numa_of_cpus", "discover",
           "context_of", "derived", "forget"]

SAME_NUMA, SAME_NODE, OTHER_NODE = 0, 1, 2
LINK_NAMES = ("same_numa", "same_node", "other_node")

_ENV_NODE = "COLLECTIVES_RANKS_PER_NODE"
_ENV_NUMA = "COLLECTIVES_RANKS_PER_NUMA"


def _renumber(keys) -> tuple[int, ...]:
    """Map arbitrary hashable keys to 0, 1, ... in order of first appearance."""
    ids: dict = {}
    return tuple(ids.setdefault(k, len(ids)) for k in keys)


def _groups(ids) -> tuple[tuple[int, ...], ...]:
    out: dict[int, list[int]] = {}
    for rank, g in enumerate(ids):
        out.setdefault(g, []).append(rank)
    return tuple(tuple(out[g]) for g in sorted(out))


def _rebuild(node, numa, source, cores_per_node) -> Topology:
    return Topology(node, numa, source=source, cores_per_node=cores_per_node)


class Topology:
    """Node and NUMA domain of every rank of one communicator (immutable; see the module doc)."""

    __slots__ = ("node", "numa", "source", "cores_per_node", "_nodes", "_numas", "_local")

    def __init__(self, node, numa=None, *, source: str = "given",
                 cores_per_node: int | None = None):
        if cores_per_node is not None and cores_per_node < 1:
            raise ValueError(f"cores per node must be positive, got {cores_per_node}")
        node = _renumber(node)
        # A NUMA domain never spans nodes: key it by (node, domain) before renumbering.
        numa = node if numa is None else _renumber(zip(node, numa))
        if len(numa) != len(node):
            raise ValueError(f"node has {len(node)} entries but numa has {len(numa)}")
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "numa", numa)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "cores_per_node", cores_per_node)
        object.__setattr__(self, "_nodes", _groups(node))
        object.__setattr__(self, "_numas", _groups(numa))
        local = [0] * len(node)
        for group in self._nodes:
            for i, r in enumerate(group):
                local[r] = i
        object.__setattr__(self, "_local", tuple(local))

    def __setattr__(self, name, value):
        raise AttributeError("Topology is immutable")

    def __reduce__(self):  # pickled by the cost model's worker processes
        return (_rebuild, (self.node, self.numa, self.source, self.cores_per_node))

    # -- the table --------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.node)

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of every node, in order of their lowest rank."""
        return self._nodes

    @property
    def numas(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of every NUMA domain (domains never span nodes)."""
        return self._numas

    @property
    def leaders(self) -> tuple[int, ...]:
        """The lowest rank of every node."""
        return tuple(g[0] for g in self._nodes)

    def local_rank(self, rank: int) -> int:
        """``rank``'s index inside its node."""
        return self._local[rank]

    def local_size(self, rank: int) -> int:
        """Number of ranks on ``rank``'s node."""
        return len(self._nodes[self.node[rank]])

    @property
    def single_node(self) -> bool:
        """All ranks on one node."""
        return len(self._nodes) == 1

    @property
    def has_numa(self) -> bool:
        """Some node holds more than one NUMA domain."""
        return len(self._numas) > len(self._nodes)

    def link(self, a: int, b: int) -> int:
        """Link class between ranks ``a`` and ``b``: SAME_NUMA, SAME_NODE or OTHER_NODE."""
        if self.node[a] != self.node[b]:
            return OTHER_NODE
        return SAME_NUMA if self.numa[a] == self.numa[b] else SAME_NODE

    def links(self, rank: int) -> tuple[int, ...]:
        """Link class from ``rank`` to every rank (the executor's per-peer lookup table)."""
        return tuple(self.link(rank, peer) for peer in range(self.size))

    def kwargs(self) -> tuple:
        """The hashable ``(name, value)`` pairs ``hierarchical`` builders take."""
        return (("nodes", self.nodes), ("numas", self.numas))

    # -- what the cost model reads ----------------------------------------------------------
    @property
    def ranks_per_node(self) -> int:
        """The most ranks on one node."""
        return max(len(g) for g in self._nodes) if self._nodes else 0

    @property
    def oversubscription(self) -> float:
        """The most ranks that share one core of a node, ``ceil(ranks / cores)`` (at least 1;
        1 when ``cores_per_node`` is unknown): how much slower a rank runs when all are busy."""
        if self.cores_per_node is None:
            return 1.0
        return float(max(1, -(-self.ranks_per_node // self.cores_per_node)))

    def period(self) -> int | None:
        """The smallest rank shift ``p < size`` (dividing ``size``) that maps the nodes and NUMA
        domains onto themselves (``r -> r + p mod size``); None when only the identity does."""
        n = self.size
        for p in range(1, n):
            if n % p == 0 and all(_renumber(ids[p:] + ids[:p]) == ids
                                  for ids in (self.node, self.numa)):
                return p
        return None

    # -- value semantics ------------------------------------------------------------------
    def __eq__(self, other):
        return isinstance(other, Topology) and (self.node, self.numa, self.cores_per_node) == \
            (other.node, other.numa, other.cores_per_node)

    def __hash__(self):
        return hash((self.node, self.numa))

    def __repr__(self):
        return f"Topology(nodes={self.nodes}, numas={self.numas}, source={self.source!r})"

    def describe(self) -> str:
        """Several lines for people: one per node with its NUMA domains."""
        lines = [f"{self.size} ranks on {len(self.nodes)} node(s), {len(self.numas)} NUMA "
                 f"domain(s) ({self.source})"]
        for n, group in enumerate(self.nodes):
            doms = [g for g in self.numas if g[0] in group]
            text = "  ".join("[" + " ".join(map(str, d)) + "]" for d in doms)
            lines.append(f"  node {n}: ranks {' '.join(map(str, group))}  leader {group[0]}  "
                         f"numa {text}")
        return "\n".join(lines)


def _blocks(count: int, per: int) -> tuple[int, ...]:
    """Block index of each of ``count`` items cut in consecutive blocks of ``per``."""
    return tuple(i // per for i in range(count))


def simulated(size: int, ranks_per_node: int | None = None,
              ranks_per_numa: int | None = None, cores_per_node: int | None = None) -> Topology:
    """The topology that ``COLLECTIVES_RANKS_PER_NODE/NUMA`` simulate for ``size`` ranks (None:
    one node, no NUMA split), with ``cores_per_node`` (None: never oversubscribed)."""
    if size < 1:
        raise ValueError(f"a topology needs at least 1 rank, got {size}")
    for name, v in (("ranks_per_node", ranks_per_node), ("ranks_per_numa", ranks_per_numa)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")
    node = _blocks(size, ranks_per_node or size)
    numa = _numa_blocks(node, ranks_per_numa)
    src = f"simulated: {ranks_per_node or size} ranks per node"
    if ranks_per_numa:
        src += f", {ranks_per_numa} per NUMA domain"
    if cores_per_node:
        src += f", {cores_per_node} cores per node"
    return Topology(node, numa, source=src, cores_per_node=cores_per_node)


def _numa_blocks(node, per):
    """NUMA domain of each rank: blocks of ``per`` consecutive ranks inside each node."""
    if not per:
        return None
    seen: dict[int, int] = {}
    out = []
    for n in node:
        i = seen.get(n, 0)
        seen[n] = i + 1
        out.append((n, i // per))
    return out


# -- discovery ------------------------------------------------------------------------------
def _cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            cpus.update(range(int(a), int(b) + 1))
        else:
            cpus.add(int(part))
    return cpus


def numa_of_cpus(cpus, root: str = "/sys/devices/system/node") -> int:
    """The NUMA node holding every CPU of ``cpus``, or -1 (several, or unknown)."""
    try:
        names = os.listdir(root)
    except OSError:
        return -1
    hits = []
    for name in names:
        m = re.fullmatch(r"node(\d+)", name)
        if not m:
            continue
        try:
            with open(os.path.join(root, name, "cpulist")) as f:
                node_cpus = _cpulist(f.read())
        except OSError:
            continue
        if node_cpus & set(cpus):
            hits.append(int(m.group(1)))
    return hits[0] if len(hits) == 1 else -1


def discover(comm) -> Topology:
    """Discover the topology of ``comm`` (collective; prefer the cached ``topology(comm)``)."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    try:  # a bad value on some ranks only must not leave the others in the Allgather
        k, j = config.get(_ENV_NODE) or 0, config.get(_ENV_NUMA) or 0
        bad, why = 0, ""
    except ValueError as exc:
        k, j, bad, why = 0, 0, 1, str(exc)
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = set()
    numa_here = numa_of_cpus(cpus) if cpus else -1
    if k:
        node_key = -1  # no need to ask MPI: the blocks are the nodes
    else:
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        node_key = shared.allreduce(rank, op=MPI.MIN)
        shared.Free()
    mine = np.array([node_key, numa_here, k, j, bad], dtype=np.int64)
    table = np.empty((size, 5), dtype=np.int64)
    comm.Allgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
    if table[:, 4].any():
        raise ValueError(f"{_ENV_NODE} / {_ENV_NUMA} must be positive integers (rank(s) "
                         f"{np.flatnonzero(table[:, 4]).tolist()} read something else"
                         + (f": {why}" if why else "") + ")")
    if (table[:, 2] != k).any() or (table[:, 3] != j).any():
        seen = sorted({(int(a), int(b)) for a, b in table[:, 2:4]})
        raise ValueError(f"ranks disagree on {_ENV_NODE}/{_ENV_NUMA}: saw (k, j) = {seen} "
                         f"(0 = unset); set them alike on every rank")
    if k:
        node = _blocks(size, k)
        source = f"simulated: {_ENV_NODE}={k}"
    else:
        node = _renumber(int(x) for x in table[:, 0])
        source = "MPI COMM_TYPE_SHARED"
    if j:
        numa = _numa_blocks(_renumber(node), j)
        source += f", {_ENV_NUMA}={j}"
    else:
        # A node counts its ranks' domains only if every rank there is bound inside one.
        node_ids = _renumber(node)
        unknown = {node_ids[r] for r in range(size) if table[r, 1] < 0}
        numa = [(node_ids[r], -1 if node_ids[r] in unknown else int(table[r, 1]))
                for r in range(size)]
        source += ", NUMA from CPU affinity"
    return Topology(node, numa, source=source)


class _Known:
    """What a communicator's context knows of its topology: the ``Topology``, and the
    sub-communicators once made (freed with the context)."""

    __slots__ = ("topology", "comms")

    def __init__(self, ctx):
        self.topology = self.comms = None

    def close(self) -> None:
        if self.comms is not None:
            self.comms.close()


def topology(comm=None) -> Topology:
    """The (cached) ``Topology`` of ``comm`` (default ``COMM_WORLD``); collective on first use."""
    ctx = context_of(comm)
    known = ctx.slot(_Known)
    if known.topology is None:
        known.topology = discover(ctx.comm)
    return known.topology


def context_of(comm):
    """The executor's ``Context`` of ``comm`` (``COMM_WORLD`` when None; a ``Context`` is
    its own)."""
    from ..executor import Context, context
    if isinstance(comm, Context):
        return comm
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    return context(comm)


# -- sub-communicators ----------------------------------------------------------------------
class Communicators:
    """The sub-communicators of one rank (see the module doc); ``close()`` frees them."""

    __slots__ = ("node", "cross", "numa", "leaders")

    def __init__(self, node, cross, numa, leaders):
        self.node, self.cross, self.numa, self.leaders = node, cross, numa, leaders

    def close(self) -> None:
        """Free the sub-communicators (the context does this when its communicator goes)."""
        from mpi4py import MPI
        if MPI.Is_finalized():
            return
        for c in (self.node, self.cross, self.numa, self.leaders):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()


def communicators(comm=None, create: bool = True) -> Communicators | None:
    """This rank's node / cross / numa / leaders communicators (collective on first use);
    with ``create=False``, None where they have not been made yet (never collective)."""
    from mpi4py import MPI
    ctx = context_of(comm)
    known = ctx.slot(_Known)
    comms = known.comms
    if comms is None and create:
        topo = topology(ctx)
        r = ctx.rank
        local = topo.local_rank(r)
        node = ctx.comm.Split(topo.node[r], local)
        cross = ctx.comm.Split(local, topo.node[r])
        numa = ctx.comm.Split(topo.numa[r], r)
        leaders = ctx.comm.Split(0 if local == 0 else MPI.UNDEFINED, r)
        comms = known.comms = Communicators(node, cross, numa, leaders)
    return comms


def node_comm(comm=None):
    """The communicator of this rank's node within ``comm``: the one answer to "which ranks
    share a node", simulated ones (``COLLECTIVES_RANKS_PER_NODE``) included. Cached with the
    other sub-communicators (collective on first use); the caller must not free it."""
    return communicators(comm).node


# -- when a communicator is lost ------------------------------------------------------------
def derived(comm) -> list:
    """The communicators the toolkit made for ``comm`` and still holds (its context's private
    Dup and the sub-communicators), never making one: what must be revoked with ``comm`` when
    a process of it fails, so that no rank stays blocked on them."""
    from mpi4py import MPI
    from ..executor import cached_context
    ctx = cached_context(comm)
    if ctx is None:
        return []
    out = [ctx.comm]
    known = ctx.slots.get(_Known)
    if known is not None and known.comms is not None:
        c = known.comms
        out += [x for x in (c.node, c.cross, c.numa, c.leaders)
                if x is not None and x != MPI.COMM_NULL]
    return out


def forget(comm) -> None:
    """Empty what the toolkit caches for ``comm`` (its context: the watchdog's side channel,
    scratch, the topology), so that nothing of the toolkit runs on it again; never collective,
    and frees no MPI object. For a communicator that lost a process and was revoked, with
    what ``derived`` named: a revoked communicator is kept, not freed (Open MPI 5 crashes
    when another rank's revoke notice reaches a freed one), and so is the layers' state, which
    may hold shared windows (freeing one is collective, and a rank of it is gone)."""
    from mpi4py import MPI
    from ..executor import cached_context
    from ..watchdog import Channel
    ctx = cached_context(comm)
    if ctx is None:
        return
    channel = ctx.slots.pop(Channel, None)
    if channel is not None:
        channel.close()   # the watchdog stops asking on it
    _FORGOTTEN.append((ctx.comm, dict(ctx.slots)))
    ctx.slots.clear()
    ctx.comm = MPI.COMM_NULL   # the context's own free (at exit) leaves the Dup alone


_FORGOTTEN: list = []
