"""``pp.simulate``: a pipeline schedule's step time, bubble and peak live activations, predicted.

Each rank runs its actions in order on one clock: a compute action takes its stage's time
(``forward``, ``backward``: the input-gradient part, ``weight``: the weight-gradient part; a
whole backward B of a schedule that does not split it takes backward + weight), a send costs
its rank nothing and its message arrives ``p2p`` seconds later, a receive waits for that
arrival. Times are one number for every stage or a list with one per stage (``S = p * v``
entries, stage order), so per-stage times measured on a real run can be fed back in.

- step time: when the last rank finishes;
- bubble: the share of ``p * step`` in which ranks compute nothing, ``1 - busy / (p * step)``
  (GPipe and 1F1B with equal stages and free messages: (p - 1) / (m + p - 1));
- peak activations per rank: the most (micro-batch, stage) pairs a rank holds at once, from
  its F to the end of its backward (W where the backward is split), in units of one stage's
  activations for one micro-batch (1F1B's first rank: min(p, m); GPipe's: m).

``p2p_time(nbytes)`` prices one message with the toolkit's cost model (``CostModel.load()``:
alpha + bytes * beta of a link class), for ``p2p=``.
"""
from __future__ import annotations

from .schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Schedule

__all__ = ["simulate", "Simulation", "p2p_time"]


class Simulation:
    """What ``simulate`` predicts: ``step``, ``bubble``, ``busy`` and ``peak`` (per rank),
    ``timeline`` ((rank, action, start, end) per compute action); ``draw()`` as text."""

    __slots__ = ("schedule", "step", "bubble", "busy", "peak", "timeline")

    def __init__(self, schedule, step, busy, peak, timeline):
        self.schedule, self.step, self.busy, self.peak = schedule, step, busy, peak
        self.timeline = timeline
        p = schedule.ranks
        self.bubble = 1.0 - sum(busy) / (p * step) if step > 0 else 0.0

    def draw(self, unit: float | None = None) -> str:
        """One line per rank, one character per ``unit`` of time (default: the shortest
        compute action): F, B, W as the action's letter, a digit-free gap as '.'; the
        micro-batch of each action under it is left out for width."""
        acts = [e for e in self.timeline if e[3] > e[2]]
        if not acts:
            return ""
        unit = unit or min(e[3] - e[2] for e in acts)
        width = int(round(self.step / unit))
        rows = [["."] * width for _ in range(self.schedule.ranks)]
        for r, a, t0, t1 in acts:
            i0, i1 = int(round(t0 / unit)), max(int(round(t1 / unit)), int(round(t0 / unit)) + 1)
            ch = a[0] if self.schedule.virtual == 1 else (a[0] if a[2] < self.schedule.ranks
                                                         else a[0].lower())
            for i in range(i0, min(i1, width)):
                rows[r][i] = ch
        return "\n".join(f"rank {r:>2} |{''.join(row)}|" for r, row in enumerate(rows))

    def __repr__(self):
        return (f"Simulation({self.schedule.name}: step {self.step:.4g}, bubble "
                f"{self.bubble:.3f}, peak {self.peak})")


def _per_stage(value, stages: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * stages
    values = [float(x) for x in value]
    if len(values) != stages:
        raise ValueError(f"{what}: expecting one time per stage ({stages}), got {len(values)}")
    if any(x < 0 for x in values):
        raise ValueError(f"{what}: times must be >= 0, got {values}")
    return values


def simulate(sched: Schedule, forward=1.0, backward=2.0, weight=0.0, p2p=0.0) -> Simulation:
    """Predict ``sched``'s step on stages that take these times (seconds, or any unit)."""
    S, p = sched.stages, sched.ranks
    fw = _per_stage(forward, S, "forward")
    bw = _per_stage(backward, S, "backward")
    ww = _per_stage(weight, S, "weight")
    if p2p < 0:
        raise ValueError(f"p2p must be >= 0, got {p2p}")
    cost = {F: fw, W: ww, B: bw if sched.split_backward else [b + w for b, w in zip(bw, ww)]}
    last = W if sched.split_backward else B
    acts = [sched.actions(r) for r in range(p)]
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    live, peak = [0] * p, [0] * p
    arrival: dict = {}
    waiting: dict = {}
    timeline = []
    todo = list(range(p - 1, -1, -1))
    while todo:
        r = todo.pop()
        seq, i, t = acts[r], pos[r], clock[r]
        while i < len(seq):
            kind, mb, s = seq[i]
            if kind == RECV_F or kind == RECV_B:
                msg = (kind, mb, s)
                if msg not in arrival:
                    waiting[msg] = r
                    break
                t = max(t, arrival[msg])
            elif kind == SEND_F or kind == SEND_B:
                msg = (RECV_F, mb, s + 1) if kind == SEND_F else (RECV_B, mb, s - 1)
                arrival[msg] = t + p2p
                q = waiting.pop(msg, None)
                if q is not None:
                    todo.append(q)
            else:
                d = cost[kind][s]
                timeline.append((r, seq[i], t, t + d))
                t += d
                busy[r] += d
                if kind == F:
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                elif kind == last:
                    live[r] -= 1
            i += 1
        pos[r], clock[r] = i, t
    if any(pos[r] < len(acts[r]) for r in range(p)):
        raise ValueError(f"{sched!r} does not run to the end; pp.verify names the action")
    return Simulation(sched, max(clock), busy, peak, timeline)


def p2p_time(nbytes: int, link: str = "node", model=None) -> float:
    """Seconds for one message of ``nbytes`` over ``link`` (numa, node, net) by the cost model
    (``CostModel.load()`` unless ``model`` is given): alpha + nbytes * beta."""
    from collectives.costmodel import CostModel
    model = model or CostModel.load()
    return model.alpha[link] + nbytes * model.beta(link)
