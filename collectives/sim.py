"""The in-process executor: runs one schedule per virtual rank, n ranks in one process.

It drives the very same ``Run`` state machine as the MPI executor, over a mailbox transport:
a send and a receive between a pair of ranks match in the order each side posted them, and the
bytes move when both are posted (rendezvous: a send does not complete before its receive is
posted, the strictest buffering MPI allows, so a schedule that relies on eager buffering
deadlocks here instead of in production). Matched messages must have equal sizes. If no rank
can move, the simulation raises with every rank's pending operations.

``simulate(builder, inputs, op)`` is what tests use: it builds each rank's schedule, validates it,
runs all of them and returns each rank's OUT. The time the same schedules would take is
``collectives.costmodel``'s business.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .errors import CollectiveError, MessageSizeError
from .executor import Run
from .ops import Op, resolve
from .schedule import RECV, SEND, Schedule

__all__ = ["simulate", "run_schedules", "SimNetwork", "Deadlock", "Traffic"]


class Deadlock(CollectiveError):
    """No virtual rank can make progress."""


class _Handle:
    __slots__ = ("src", "dst", "view", "done", "kind")

    def __init__(self, kind, src, dst, view):
        self.kind, self.src, self.dst, self.view, self.done = kind, src, dst, view, False


class Traffic:
    """Bytes and messages sent, per (src, dst) pair, over a simulation."""

    def __init__(self):
        self.bytes: dict[tuple[int, int], int] = {}
        self.messages: dict[tuple[int, int], int] = {}

    def add(self, src, dst, nbytes):
        self.bytes[(src, dst)] = self.bytes.get((src, dst), 0) + nbytes
        self.messages[(src, dst)] = self.messages.get((src, dst), 0) + 1

    def sent_by(self, rank: int, where=None) -> int:
        """Bytes sent by ``rank`` (to destinations for which ``where(dst)`` holds)."""
        return sum(b for (s, d), b in self.bytes.items()
                   if s == rank and (where is None or where(d)))


class SimNetwork:
    """Mailboxes between n virtual ranks; one ``transport(rank)`` per rank."""

    def __init__(self, size: int):
        self.size = size
        self.sends: dict[tuple[int, int], deque] = {}
        self.recvs: dict[tuple[int, int], deque] = {}
        self.traffic = Traffic()

    def transport(self, rank: int) -> _SimTransport:
        return _SimTransport(self, rank)

    def match(self) -> bool:
        """Move every message whose send and receive are both posted; True if any moved."""
        moved = False
        for key, sends in self.sends.items():
            recvs = self.recvs.get(key)
            while sends and recvs:
                s, r = sends.popleft(), recvs.popleft()
                if s.view.nbytes != r.view.nbytes:
                    raise MessageSizeError(f"rank {s.src} sent {s.view.nbytes} bytes, rank "
                                           f"{r.dst} expected {r.view.nbytes}")
                r.view[...] = s.view
                self.traffic.add(s.src, s.dst, s.view.nbytes)
                s.done = r.done = True
                moved = True
        return moved


class _SimTransport:
    __slots__ = ("net", "rank")

    def __init__(self, net: SimNetwork, rank: int):
        self.net, self.rank = net, rank

    def isend(self, view, peer, tag):
        h = _Handle(SEND, self.rank, peer, view)
        self.net.sends.setdefault((self.rank, peer), deque()).append(h)
        return h

    def irecv(self, view, peer, tag):
        h = _Handle(RECV, peer, self.rank, view)
        self.net.recvs.setdefault((peer, self.rank), deque()).append(h)
        return h

    def testsome(self, handles):
        return [(k, None) for k, h in enumerate(handles) if h.done]

    def waitany(self, handles):  # pragma: no cover - the simulator never blocks
        raise Deadlock("the simulator cannot block")

    def finish(self, handle, status, nbytes, op):
        pass


def run_schedules(schedules: list[Schedule], ins: list, outs: list, op: Op,
                  *, net: SimNetwork | None = None, direct: bool | None = None) -> SimNetwork:
    """Run ``schedules[r]`` on ``ins[r]``/``outs[r]`` for every virtual rank r.

    ``direct``: run ``Schedule.direct()``'s plan; by default where IN and OUT are separate
    memory, as the API does.
    """
    size = len(schedules)
    net = net or SimNetwork(size)
    runs = []
    for r, s in enumerate(schedules):
        s.validate()
        # Out of place (separate IN and OUT), run as the API does: receives go straight to
        # their reduction's destination (Schedule.direct).
        plan = s.plan(direct=not np.may_share_memory(ins[r], outs[r]) if direct is None
                      else direct)
        tmp = np.zeros(plan.schedule.tmp, dtype=outs[r].dtype)
        runs.append(Run(plan, ins[r], outs[r], tmp, op, net.transport(r), 0,
                        info=f"{s.name} rank {r}/{size}"))
    for run in runs:
        run.start()
    while not all(run.done for run in runs):
        progressed = net.match()
        for run in runs:
            if not run.done:
                before = run.left
                run.test()
                progressed |= run.left != before or run.done
        if not progressed:
            stuck = [f"rank {r}: {run.left} ops left, waiting for {run.waiting_for()}"
                     for r, run in enumerate(runs) if not run.done]
            raise Deadlock("simulated schedules deadlock:\n  " + "\n  ".join(stuck))
    return net


def simulate(builder, inputs: list[np.ndarray], op="sum", *, out_counts=None, inplace=False,
             outs=None, **kwargs):
    """Build ``builder(rank, size, **kwargs)`` for each rank and run them on ``inputs``.

    ``out_counts[r]``: OUT length of rank r (default: the schedule's ``count_out``).
    ``inplace``: run with OUT and IN the same array (the input is then overwritten).
    Returns ``(outs, net)``: each rank's OUT and the network (traffic counters).
    """
    size = len(inputs)
    dtype = inputs[0].dtype
    opr = op if isinstance(op, Op) else resolve(op, dtype)
    schedules = [builder(r, size, **kwargs) for r in range(size)]
    ins = [np.ascontiguousarray(x).reshape(-1) for x in inputs]
    if outs is None:
        if inplace:
            outs = ins
        else:
            outs = [np.full(s.count_out if out_counts is None else out_counts[r], 0, dtype)
                    for r, s in enumerate(schedules)]
    net = run_schedules(schedules, ins, outs, opr)
    return outs, net
