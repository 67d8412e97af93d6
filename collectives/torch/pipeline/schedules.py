"""Pipeline schedules as data: pure functions of (stages, micro-batches, virtual stages per rank).

Vocabulary. The model is cut into ``S = p * v`` *stages*; rank r of the p pipeline ranks holds
the v stages ``r, r + p, ..., r + (v - 1) p`` (its *chunks*, Megatron's interleaving; v = 1 is
one stage per rank). The batch is cut into m *micro-batches*. Compute actions:

- ``F(mb, s)``: forward of micro-batch mb through stage s;
- ``B(mb, s)``: its backward. In schedules that split the backward (``zero_bubble``) B computes
  only the gradient of the stage's input (what the previous stage waits for) and
  ``W(mb, s)`` later computes the gradient of the stage's weights (what nobody waits for); in
  the others B is the whole backward and there is no W.

Communication actions, inserted next to the compute they serve: ``SEND_F(mb, s)`` sends stage
s's output to the rank of stage s + 1 right after ``F(mb, s)``; ``RECV_F(mb, s)`` receives
stage s's input right before ``F(mb, s)``; ``SEND_B(mb, s)`` sends the gradient of stage s's
input to the rank of stage s - 1 right after ``B(mb, s)``; ``RECV_B(mb, s)`` receives the
gradient of stage s's output right before ``B(mb, s)``. Neighbouring stages on one rank (p = 1)
hand over in memory, without messages. A message is named by (direction, micro-batch,
receiving stage), so the runner gives every one its own tag: sends never block (they are
completed at the end of the step), a receive waits for its one matching send.

Each schedule is a compute order per rank; the walk-through below is p = 4, m = 6, rank 0
(stage 0; W omitted where B is whole):

    gpipe        F0 F1 F2 F3 F4 F5 B0 B1 B2 B3 B4 B5              m micro-batches alive
    1f1b         F0 F1 F2 | F3 B0 F4 B1 F5 B2 | B3 B4 B5        warm-up p - 1 - r, then one
                                                                 forward, one backward
    zero_bubble  F0 F1 F2 | F3 B0 W0 F4 B1 W1 F5 B2 W2 | B3 W3 B4 W4 B5 W5
                 (rank r defers its first r W's: the last rank answers its B's soonest, and
                  the deferred W's fill the drain; ZB-H1 of Qi et al., at 1F1B's memory)
    interleaved  v chunks per rank; forwards go round by round (a round is up to p
                 micro-batches) through chunk 0, 1, ..., v - 1, backwards through the chunks in
                 reverse; warm-up (v - 1) * round + 2 (p - 1 - r) forwards (Megatron's), so
                 the bubble shrinks by v at v times the messages

Arithmetic. ``1f1b``, ``interleaved`` and ``zero_bubble`` (1F1B's order with the backward
split) share one generator, as torch's ``_get_1f1b_rank_ops`` does: after
``warmup`` forwards each step is one forward then one backward, then the remaining backwards.
The micro-batch of each action is the next one of its stage (each stage sees its micro-batches
in order 0, 1, ...). With v > 1 a round holds ``m // max(1, m // p)`` micro-batches, so the
schedule is defined when that divides m (torch's flexible rule).

This module imports neither torch nor mpi4py: ``pp.verify`` and ``pp.simulate`` read the same
data in one process, and ``pp.Pipeline`` executes it.
"""
from __future__ import annotations

__all__ = ["Action", "Schedule", "schedule", "SCHEDULES", "F", "B", "W", "SEND_F", "RECV_F",
           "SEND_B", "RECV_B", "COMPUTE", "per_round"]

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)


class Action(tuple):
    """One step of a rank: ``(kind, microbatch, stage)``; ``str`` reads ``F(3, 1)``."""

    __slots__ = ()

    def __new__(cls, kind: str, mb: int, stage: int):
        return tuple.__new__(cls, (kind, mb, stage))

    kind = property(lambda self: self[0])
    mb = property(lambda self: self[1])
    stage = property(lambda self: self[2])

    def __repr__(self):
        return f"{self[0]}({self[1]}, {self[2]})"

    __str__ = __repr__


class Schedule:
    """Every rank's ordered actions for p ranks, m micro-batches, v stages per rank.

    ``actions(rank)``: the list; ``stages``: S = p * v; ``rank_of(stage)``: stage % p;
    ``split_backward``: whether B and W are separate actions. Built by ``schedule(...)``, or
    directly from per-rank lists (``Schedule(name, p, m, v, lists, split_backward)``: how the
    tests build broken ones for ``pp.verify`` to reject).
    """

    __slots__ = ("name", "ranks", "microbatches", "virtual", "split_backward", "_actions")

    def __init__(self, name: str, ranks: int, microbatches: int, virtual: int, actions,
                 split_backward: bool = False):
        if len(actions) != ranks:
            raise ValueError(f"expecting one action list per rank ({ranks}), got {len(actions)}")
        self.name, self.ranks, self.microbatches, self.virtual = name, ranks, microbatches, virtual
        self.split_backward = split_backward
        self._actions = [[a if type(a) is Action else Action(*a) for a in acts]
                         for acts in actions]

    @property
    def stages(self) -> int:
        """Model stages in all: ranks times virtual stages per rank."""
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        return stage % self.ranks

    def local_stages(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, first to last."""
        return list(range(rank, self.stages, self.ranks))

    def actions(self, rank: int) -> list[Action]:
        """``rank``'s actions in the order it runs them (compute and communication)."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not one of the schedule's {self.ranks} ranks")
        return list(self._actions[rank])

    def compute(self, rank: int) -> list[Action]:
        """``rank``'s compute actions only (F, B, W) in order."""
        return [a for a in self._actions[rank] if a[0] in COMPUTE]

    def __repr__(self):
        return (f"Schedule({self.name!r}, ranks={self.ranks}, microbatches={self.microbatches}, "
                f"virtual={self.virtual})")


def per_round(p: int, m: int, v: int) -> int:
    """Micro-batches per round for interleaving (torch's flexible rule), checked."""
    rounds = max(1, m // p)
    if v > 1 and m % rounds:
        raise ValueError(f"interleaved schedules need the micro-batches ({m}) to be a multiple "
                         f"of the rounds max(1, m // p) = {rounds} (p = {p})")
    return m // rounds


def _gpipe(r: int, p: int, m: int, v: int) -> list[Action]:
    return [Action(F, mb, r) for mb in range(m)] + [Action(B, mb, r) for mb in range(m)]


def _one_f_one_b(r: int, p: int, m: int, v: int, *, split: bool, factor: int) -> list[Action]:
    """1F1B over v chunks: ``warmup`` forwards, then forward-backward pairs, then backwards.

    Forward step k uses chunk (k // round) % v, backward step k chunk v - 1 - ((k - warmup) //
    round) % v; each chunk takes its next micro-batch. With ``split``, the W of the oldest
    backward follows each backward once rank r has done r of them (ZB-H1), the rest at the end.
    """
    group = per_round(p, m, v) if v > 1 else m
    total = m * v
    warmup = min((v - 1) * group + factor * (p - 1 - r), total)
    next_f = [0] * v
    next_b = [0] * v
    out: list[Action] = []
    backwards: list[Action] = []
    weights = 0

    def forward(k):
        c = (k // group) % v
        out.append(Action(F, next_f[c], c * p + r))
        next_f[c] += 1

    def backward(k):
        nonlocal weights
        c = v - 1 - ((k - warmup) // group) % v
        b = Action(B, next_b[c], c * p + r)
        next_b[c] += 1
        out.append(b)
        backwards.append(b)
        if split and len(backwards) > r:
            out.append(Action(W, backwards[weights].mb, backwards[weights].stage))
            weights += 1

    for k in range(warmup):
        forward(k)
    for k in range(warmup, total):
        forward(k)
        backward(k)
    for k in range(total, total + warmup):
        backward(k)
    if split:
        out.extend(Action(W, b.mb, b.stage) for b in backwards[weights:])
    return out


SCHEDULES = {
    # name: (compute order of rank r, whether the backward is split, the virtual stages allowed)
    "gpipe": (_gpipe, False, (1,)),
    "1f1b": (lambda r, p, m, v: _one_f_one_b(r, p, m, v, split=False, factor=1), False, (1,)),
    "interleaved": (lambda r, p, m, v: _one_f_one_b(r, p, m, v, split=False, factor=2), False,
                    None),
    "zero_bubble": (lambda r, p, m, v: _one_f_one_b(r, p, m, v, split=True, factor=1), True,
                    (1,)),
}


def with_messages(order: list[Action], r: int, p: int, stages: int) -> list[Action]:
    """``order`` (compute only) with the receives before and the sends after each action that
    needs them: nothing crosses between stages on one rank."""
    out: list[Action] = []
    for a in order:
        kind, mb, s = a
        if kind == F:
            if s > 0 and (s - 1) % p != r:
                out.append(Action(RECV_F, mb, s))
            out.append(a)
            if s < stages - 1 and (s + 1) % p != r:
                out.append(Action(SEND_F, mb, s))
        elif kind == B:
            if s < stages - 1 and (s + 1) % p != r:
                out.append(Action(RECV_B, mb, s))
            out.append(a)
            if s > 0 and (s - 1) % p != r:
                out.append(Action(SEND_B, mb, s))
        else:
            out.append(a)
    return out


def schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule ``name`` (gpipe, 1f1b, interleaved, zero_bubble) for ``stages`` pipeline
    ranks, ``microbatches`` micro-batches and ``virtual`` stages per rank."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of "
                         f"{', '.join(SCHEDULES)}")
    p, m, v = stages, microbatches, virtual
    for what, n in (("stages", p), ("microbatches", m), ("virtual", v)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} must be a positive integer, got {n!r}")
    order, split, allowed = SCHEDULES[name]
    if allowed is not None and v not in allowed:
        raise ValueError(f"schedule {name!r} takes virtual=1 (one stage per rank), got {v}; "
                         f"'interleaved' takes several")
    if v > 1:
        per_round(p, m, v)
    lists = [with_messages(order(r, p, m, v), r, p, p * v) for r in range(p)]
    return Schedule(name, p, m, v, lists, split_backward=split)
