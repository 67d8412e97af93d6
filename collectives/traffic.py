"""Bytes and messages a rank sends, per link class of its communicator's ``Topology``.

``count_traffic(comm)`` is a context manager that counts the bytes and messages this rank
*sends* per link class (``collectives.topology.LINK_NAMES``) while it is open, by installing a
``LinkTraffic`` counter in the MPI executor's transport (schedule algorithms: ``ring``,
``tree``, ``hierarchical``, ...) and in those of the node and cross sub-communicators that
composites such as ``hierarchical_shm`` run on. The MPI library's own collectives and ``shm``
move their bytes inside the library or through memory and are not counted.
``sim_traffic(net.traffic, topo, rank)`` splits an in-process simulation's traffic
(``collectives.sim``) the same way.

``python -m bench topology --traffic MIB`` prints the table for one allreduce per algorithm.
"""
from __future__ import annotations

import contextlib

from .topology import LINK_NAMES, Topology, communicators, context_of, topology

__all__ = ["LinkTraffic", "count_traffic", "sim_traffic"]


class LinkTraffic:
    """Bytes and messages one rank sent, per link class (``LINK_NAMES``).

    The MPI executor calls ``add(peer, nbytes)`` once per message it posts while the counter is
    installed (``count_traffic``): one tuple lookup and two list increments.
    """

    __slots__ = ("classes", "nbytes", "messages")

    def __init__(self, classes):
        self.classes = tuple(classes)
        self.nbytes = [0, 0, 0]
        self.messages = [0, 0, 0]

    def add(self, peer: int, nbytes: int) -> None:
        """Count one message of ``nbytes`` to ``peer``."""
        k = self.classes[peer]
        self.nbytes[k] += nbytes
        self.messages[k] += 1

    def as_dict(self) -> dict[str, int]:
        """``{"same_numa": bytes, "same_node": bytes, "other_node": bytes}``."""
        return dict(zip(LINK_NAMES, self.nbytes))

    def __repr__(self):
        parts = ", ".join(f"{n}={b} B/{m} msg" for n, b, m in
                          zip(LINK_NAMES, self.nbytes, self.messages))
        return f"LinkTraffic({parts})"


@contextlib.contextmanager
def count_traffic(comm=None, topo: Topology | None = None):
    """Count the bytes this rank sends per link class inside the ``with`` block.

    ``topo`` defaults to ``topology(comm)`` (collective on first use). Yields a ``LinkTraffic``.
    Messages on the node and cross sub-communicators (``topology.communicators``) count too,
    if they exist when the block starts.
    """
    from .executor import context
    ctx = context_of(comm)
    topo = topo or topology(ctx)
    counter = LinkTraffic(topo.links(ctx.rank))
    installed = [(ctx.transport, counter)]
    comms = communicators(ctx, create=False)
    if comms is not None:
        r = ctx.rank
        local = topo.local_rank(r)
        members = {"node": topo.nodes[topo.node[r]],
                   "cross": tuple(g[local] for g in topo.nodes if len(g) > local)}
        for name, peers in members.items():
            sub = LinkTraffic(topo.link(r, p) for p in peers)
            sub.nbytes, sub.messages = counter.nbytes, counter.messages  # one tally
            installed.append((context(getattr(comms, name)).transport, sub))
    previous = [(t, t.counter) for t, _ in installed]
    for transport, c in installed:
        transport.counter = c
    try:
        yield counter
    finally:
        for transport, old in previous:
            transport.counter = old


def sim_traffic(traffic, topo: Topology, rank: int) -> list[int]:
    """Bytes ``rank`` sent per link class in a simulation's ``net.traffic`` (collectives.sim)."""
    out = [0, 0, 0]
    for (src, dst), nbytes in traffic.bytes.items():
        if src == rank:
            out[topo.link(src, dst)] += nbytes
    return out
