"""The node composite: an allreduce over several nodes of one size as node stage -> ring
across nodes -> node stage.

Vocabulary: the ranks of a communicator fall into *nodes* (``collectives.topology``, simulated
ones included) of k ranks each; *local rank* j is a rank's place in its node; the *cross*
communicator of local rank j holds local rank j of every node. A node's buffer is cut into k
*blocks*, block j handled by local rank j. For local rank j:

1. *node stage in*: block j of the node's sum, on this rank (shm: a reduce-scatter through the
   node's window, ``shm.reduce_scatter_rounds``; one-pass: slice j of every registered input of
   the node folded straight into the first output);
2. *ring across nodes*: block j allreduced in place among the ranks of the cross communicator
   with ``ring``'s schedule, run by the executor on the cross communicator's context inside
   this call's work (a ring: every node gets the same bits); ``op="avg"`` arrives as the
   node stage's quotients (each input divided by the rank count first), so the ring sums;
3. *node stage out*: block j into every output of the node (shm: an all-gather through the
   window; one-pass: copies into every registered output).

Walk-through, 4 ranks as 2 nodes x 2, N elements: ranks 0 and 1 (node 0) reduce-scatter so that
rank 0 holds [0, N/2) of node 0's sum and rank 1 [N/2, N), ranks 2 and 3 likewise for node 1;
ranks 0 and 2 allreduce [0, N/2) over their cross communicator while ranks 1 and 3 allreduce
[N/2, N) over theirs; each node all-gathers. Only the blocks cross nodes: 1/k of the data, the
bytes of ``hierarchical``'s allreduce; inside a node each byte goes through shared memory
instead of around a ring.

The three steps run as one ``ShmWork`` of the node's window, in the window's order, so the node
stages of consecutive calls never interleave. While the ring runs, the work tells the watchdog
which peer it waits for.

``launch_shm(call)`` is ``algorithm="hierarchical_shm"``; ``collectives.node.onepass`` runs its
multi-node allreduce through ``allreduce`` with its own stages.
"""
from __future__ import annotations

import numpy as np

from .. import hierarchical
from ..buffers import wrap
from ..ops import resolve
from ..call import make_call
from ..executor import context, launch_schedule, schedule_for
from ..ring import allreduce as ring_allreduce
from ..schedule import split
from ..topology import communicators, topology
from . import shm
from .window import ShmWork, Window, window

__all__ = ["Node", "node", "allreduce", "launch_shm"]


class Node:
    """Where this rank's composite runs: its node's shm window (``win``), its local rank and
    the node's size (``rank``, ``size``), and its cross communicator (``cross``)."""

    __slots__ = ("win", "rank", "size", "cross")

    def __init__(self, win: Window, rank: int, size: int, cross):
        self.win, self.rank, self.size, self.cross = win, rank, size, cross


def node(ctx) -> Node:
    """This rank's ``Node`` within ``ctx``'s communicator (collective on first use: the
    sub-communicators and the node's window are made then)."""
    comms = communicators(ctx)
    return Node(window(context(comms.node)), comms.node.Get_rank(), comms.node.Get_size(),
                comms.cross)


def allreduce(work, here: Node, op, stage_in, stage_out) -> None:
    """Steps 1-3 for this rank inside ``work`` (a running ``ShmWork`` of ``here.win``):
    ``stage_in()`` returns block j of the node's result, reduced with ``op``; the ring across
    nodes allreduces it in place; ``stage_out(block)`` hands it to the node."""
    block = stage_in()
    _across(work, here.cross, block, op)
    stage_out(block)


def _across(work, cross, block, op) -> None:
    """``block`` allreduced in place among the ranks of ``cross``: ring's schedule run by the
    executor on ``cross``'s context (its own tags, so no other call's messages match), as the
    outer call's part; ``avg`` arrives as quotients (``onepass``), so the ring sums them."""
    ctx = context(cross)
    if ctx.size == 1 or block.shape[0] == 0:
        return
    if op.is_avg:
        op = resolve("sum", block.dtype)
    buf = wrap(block)
    call = make_call("allreduce", ctx, buf, buf, op, inplace=True)
    call.algorithm, call.seq = "ring", ctx.next_seq()
    run = launch_schedule(call, schedule_for(call, ring_allreduce))
    # the ring's ranks are the cross communicator's: rank n is this local rank on node n
    work.where = lambda: (f"the ring across nodes (rank n: the same local rank on node n), "
                          f"{run.describe()}: {run.waiting_for()}")
    run.wait()
    work.where = None


# -- algorithm="hierarchical_shm" ---------------------------------------------------------------
def launch_shm(call):
    """``algorithm="hierarchical_shm"`` (allreduce): the node stages through the node's shm
    window (steps 1-3 with shm's reduce-scatter and all-gather).

    With nodes of different sizes the blocks of step 2 cannot line up, and device buffers
    cannot use the window, so those calls run the ``hierarchical`` schedule; on one node this
    is plain ``shm``.
    """
    ctx = call.ctx
    topo = topology(ctx)
    if call.x.is_device or len({len(g) for g in topo.nodes}) != 1:
        return launch_schedule(call, schedule_for(call, hierarchical.allreduce, topo.kwargs()))
    if topo.single_node:
        return shm.launch(call)
    here = node(ctx)
    src = call.out.flat if call.inplace else call.x.flat
    bounds = split(call.count, here.size)
    counts = tuple(bounds[i + 1] - bounds[i] for i in range(here.size))
    return ShmWork(here.win, _shm_nodes, (here, src, call.out.flat, call.op, counts), call)


def _shm_nodes(work, here: Node, src, out, op, counts) -> None:
    win, j = here.win, here.rank

    def stage_in():  # block j of the node's sum (the whole buffer on a node of one)
        if here.size == 1:
            np.copyto(out, src)
            return out
        shard = np.empty(counts[j], out.dtype)
        shm.reduce_scatter_rounds(work, win, src, shard, op, counts)
        return shard

    def stage_out(block):
        if here.size > 1:
            shm.allgather_rounds(work, win, block, out, counts)

    allreduce(work, here, op, stage_in, stage_out)
