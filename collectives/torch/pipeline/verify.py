"""``pp.verify``: prove a pipeline schedule runs to the end, in one process, before any job does.

Two passes over the data of a ``Schedule``:

1. Bookkeeping. Every action names a stage its rank holds; every (micro-batch, stage) has one
   F and one B (and one W when the backward is split, none otherwise); every message has
   exactly one send and one receive, on the ranks that hold the sending and the receiving
   stage.
2. Execution with the runner's semantics and no clock: a send never blocks, a receive waits
   for its one matching send, a compute action needs what it consumes already done on its rank
   (F its input: the previous stage's F on this rank or the receive; B its F and the output's
   gradient; W its B). Ranks advance until none can; a rank stopped at a compute action or a
   send waits for nothing another rank can do, so that action can never run; ranks stopped at
   receives whose senders are stopped too form a cycle of waits, which the error spells out.

Messages are matched by name (the runner gives each its own tag), so the order of sends and
receives between two ranks matters only through the waits it creates, which pass 2 follows.
The cost is one visit per action: every schedule at p = 1..16, m = 1..32, v = 1..4 takes
seconds.
"""
from __future__ import annotations

from collections import Counter

from .schedules import B, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule

__all__ = ["verify", "ScheduleError"]


class ScheduleError(ValueError):
    """A schedule that cannot run as given: ``rank``, ``index`` and ``action`` name the first
    action that never runs (None when the fault is not one action's)."""

    def __init__(self, message: str, rank=None, index=None, action=None):
        super().__init__(message)
        self.rank, self.index, self.action = rank, index, action


def _message(a: Action):
    """The message a send produces or a receive consumes: (direction, mb, receiving stage)."""
    kind, mb, s = a
    if kind == SEND_F:
        return (F, mb, s + 1)
    if kind == SEND_B:
        return (B, mb, s - 1)
    if kind == RECV_F:
        return (F, mb, s)
    return (B, mb, s)


def _fail(sched, r, i, why):
    a = sched.actions(r)[i] if i is not None else None
    where = f"rank {r} action {i} {a}" if a is not None else f"rank {r}"
    raise ScheduleError(f"{sched.name} schedule (p={sched.ranks}, m={sched.microbatches}, "
                        f"v={sched.virtual}): {where} can never run: {why}", r, i, a)


def _bookkeeping(sched: Schedule) -> dict:
    """Pass 1; returns where each message is sent: {message: (rank, index)}."""
    p, m, S = sched.ranks, sched.microbatches, sched.stages
    seen: Counter = Counter()
    sends, recvs = {}, {}
    for r in range(p):
        for i, a in enumerate(sched.actions(r)):
            kind, mb, s = a
            if not (0 <= mb < m and 0 <= s < S):
                _fail(sched, r, i, f"micro-batch {mb} or stage {s} out of range (m = {m}, "
                                   f"{S} stages)")
            if sched.rank_of(s) != r:
                _fail(sched, r, i, f"stage {s} is held by rank {sched.rank_of(s)}")
            if kind in COMPUTE:
                if kind == W and not sched.split_backward:
                    _fail(sched, r, i, "W in a schedule whose B is the whole backward")
                seen[a] += 1
                if seen[a] > 1:
                    _fail(sched, r, i, f"{a} is done twice on rank {r}")
                continue
            if kind not in (SEND_F, SEND_B, RECV_F, RECV_B):
                _fail(sched, r, i, f"unknown action kind {kind!r}")
            msg = _message(a)
            if not 0 <= msg[2] < S:
                _fail(sched, r, i, f"sends to stage {msg[2]}, outside the {S} stages")
            table = sends if kind in (SEND_F, SEND_B) else recvs
            if msg in table:
                _fail(sched, r, i, f"the message {msg} is {'sent' if table is sends else 'received'}"
                                   f" twice (also rank {table[msg][0]} action {table[msg][1]})")
            table[msg] = (r, i)
    kinds = (F, B, W) if sched.split_backward else (F, B)
    # Each entry is in range and counted once: a full count means nothing is missing.
    for mb in range(m) if len(seen) < m * S * len(kinds) else ():
        for s in range(S):
            for kind in kinds:
                if not seen[(kind, mb, s)]:
                    raise ScheduleError(
                        f"{sched.name} schedule: {kind}({mb}, {s}) is missing on rank "
                        f"{sched.rank_of(s)}", sched.rank_of(s), None, Action(kind, mb, s))
    for msg, (r, i) in sends.items():
        if msg not in recvs:
            _fail(sched, r, i, f"no rank receives its message (rank {sched.rank_of(msg[2])} "
                               f"holds stage {msg[2]})")
        if recvs[msg][0] != sched.rank_of(msg[2]):
            _fail(sched, *recvs[msg], "it receives for a stage it does not hold")
    for msg, (r, i) in recvs.items():
        if msg not in sends:
            _fail(sched, r, i, "no rank sends its message")
    return sends


def _ready(a: Action, done: set, got: set, r: int, sched: Schedule):
    """None when ``a`` can run on rank r now; else what it waits for."""
    kind, mb, s = a
    p, last = sched.ranks, sched.stages - 1
    if kind == F:
        if s == 0:
            return None
        need = (F, mb, s - 1) if (s - 1) % p == r else ("recv", F, mb, s)
    elif kind == B:
        if (F, mb, s) not in done:
            return Action(F, mb, s)
        if s == last:
            return None
        need = (B, mb, s + 1) if (s + 1) % p == r else ("recv", B, mb, s)
    elif kind == W:
        need = (B, mb, s)
    elif kind == SEND_F:
        need = (F, mb, s)
    elif kind == SEND_B:
        need = (B, mb, s)
    else:
        return None
    if need[0] == "recv":
        return None if need[1:] in got else need
    return None if need in done else Action(*need)


def verify(sched: Schedule) -> Schedule:
    """Raise ``ScheduleError`` naming the first action that can never run; return ``sched``."""
    sends = _bookkeeping(sched)
    p = sched.ranks
    acts = [sched.actions(r) for r in range(p)]
    pos = [0] * p
    done = [set() for _ in range(p)]
    got = [set() for _ in range(p)]
    sent: set = set()
    waiting: dict = {}            # message -> the rank stopped at its receive
    todo = list(range(p - 1, -1, -1))
    while todo:
        r = todo.pop()
        seq, i = acts[r], pos[r]
        while i < len(seq):
            a = seq[i]
            kind = a[0]
            if kind in (RECV_F, RECV_B):
                msg = _message(a)
                if msg not in sent:
                    waiting[msg] = r
                    break
                got[r].add(msg)
            else:
                need = _ready(a, done[r], got[r], r, sched)
                if need is not None:
                    pos[r] = i
                    what = (f"the receive of {need[1]}({need[2]}, {need[3]})"
                            if need[0] == "recv" else str(need))
                    _fail(sched, r, i, f"it needs {what}, which rank {r} does not do before it")
                if kind in (SEND_F, SEND_B):
                    msg = _message(a)
                    sent.add(msg)
                    q = waiting.pop(msg, None)
                    if q is not None:
                        todo.append(q)
                else:
                    done[r].add(a)
            i += 1
        pos[r] = i
    stuck = [r for r in range(p) if pos[r] < len(acts[r])]
    if stuck:
        _deadlock(sched, acts, pos, sends, stuck)
    return sched


def _deadlock(sched, acts, pos, sends, stuck):
    """Every stuck rank waits at a receive: follow sender after sender to a cycle, and name
    the receive of the lowest rank on it."""
    def waits_for(r):
        q, j = sends[_message(acts[r][pos[r]])]
        return q, j

    r, seen = stuck[0], []
    while r not in seen:
        seen.append(r)
        r = waits_for(r)[0]
    cycle = seen[seen.index(r):]
    first = min(cycle)
    k = cycle.index(first)
    cycle = cycle[k:] + cycle[:k]
    steps = []
    for q in cycle:
        s, j = waits_for(q)
        steps.append(f"rank {q} at action {pos[q]} {acts[q][pos[q]]} waits for rank {s}'s "
                     f"{acts[s][j]} (its action {j})")
    _fail(sched, first, pos[first], "a cycle of waits: " + "; ".join(steps))
