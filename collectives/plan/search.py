"""``search``: every way to run a GPT shape on a number of ranks, the ones that fit, ranked.

Enumeration. tp divides the ranks, stays inside a node (``tp <= ranks_per_node``) and divides the
heads, the MLP width and the vocabulary; sequence parallelism where tp > 1 and tp divides the
sequence. pp divides the rest and is at most the layers; dp is what remains and divides the
global batch. A pipeline (pp > 1) takes every schedule (gpipe, 1f1b, zero_bubble; interleaved
with v = 2, 3, ... virtual stages while p v <= layers and the schedule is defined) and every
micro-batch size b dividing the data-parallel rank's rows (m = rows / b micro-batches); without
one, the rank's rows are one micro-batch. ZeRO 0-3 where dp > 1 (0 alone at dp = 1); recompute
none, selective, full (selective only with the written-out attention core: with a fused one it
would save the core's log-sum-exp alone). ``runnable=True`` keeps what the toolkit's GPT runs as
examples/train_gpt.py does: ZeRO 0-1 with a pipeline, no ZeRO-3 with a tied head.

Pruning. Memory is cheap: every candidate's peak is predicted (on the pipeline's first and last
ranks, which hold the most in-flight micro-batches and the edges) and those above the budget are
dropped. Time is priced in order of a lower bound (the busiest rank's compute, after the
earliest its first forward can start, plus its optimizer step): a candidate is simulated only
while its bound is below the ``top``-th best step found, so a search over thousands of plans
simulates a few dozen pipelines.
"""
from __future__ import annotations

import heapq

from .memory import memory
from .model import GPTShape
from .record import Plan
from .timing import Network, lower_bound, step_time

__all__ = ["search", "candidates", "parse_bytes"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "zero_bubble", "interleaved")
RECOMPUTE = ("none", "selective", "full")


def parse_bytes(value) -> int:
    """``80GB``, ``512M``, ``1.5GiB``, ``3000000`` as bytes (K, M, G, T: powers of 1024)."""
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().upper().replace("IB", "").rstrip("B")
    scale = 1
    if text and text[-1] in "KMGT":
        scale = 1 << (10 * ("KMGT".index(text[-1]) + 1))
        text = text[:-1]
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"memory {value!r}: expected bytes such as 3000000, 512M or 80GB") \
            from None
    if number <= 0:
        raise ValueError(f"memory {value!r} must be positive")
    return int(number * scale)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: GPTShape, ranks: int, global_batch: int, ranks_per_node: int = 1,
               runnable: bool = False, max_micro_batch: int | None = None,
               microbatches: int | None = None):
    """Every plan of the enumeration above (unpriced); ``microbatches`` fixes a pipeline's."""
    from collectives.torch.pipeline.schedules import per_round
    for tp in _divisors(ranks):
        if tp > max(ranks_per_node, 1) or model.heads % tp or model.ffn % tp or model.vocab % tp:
            continue
        for pp in _divisors(ranks // tp):
            dp = ranks // (tp * pp)
            if pp > model.layers or global_batch % dp:
                continue
            rows = global_batch // dp
            # with a fused attention core, selective recompute saves only its log-sum-exp
            recomputes = RECOMPUTE if model.attention == "math" else ("none", "full")
            sps = (False, True) if tp > 1 and model.seq % tp == 0 else (False,)
            zeros = (0,) if dp == 1 else ((0, 1) if runnable and pp > 1 else
                                          (0, 1, 2) if runnable and model.tied else (0, 1, 2, 3))
            if pp == 1:
                pipes = [("1f1b", 1, 1, rows)]
            else:
                pipes = []
                for b in _divisors(rows):
                    m = rows // b
                    if (max_micro_batch and b > max_micro_batch) or \
                            (microbatches and m != microbatches):
                        continue
                    pipes += [(name, 1, m, b) for name in ("gpipe", "1f1b", "zero_bubble")]
                    for v in range(2, model.layers // pp + 1):
                        try:
                            per_round(pp, m, v)
                        except ValueError:
                            continue
                        pipes.append(("interleaved", v, m, b))
            for sp in sps:
                for name, v, m, b in pipes:
                    for zero in zeros:
                        for rec in recomputes:
                            yield Plan(dp, tp, pp, sp, name, v, m, zero, rec, b)


def search(model: GPTShape, ranks: int, global_batch: int, memory_per_rank=None,
           ranks_per_node: int = 1, network: Network | None = None, compute=None,
           top: int | None = 20, runnable: bool = False,
           max_micro_batch: int | None = None, microbatches: int | None = None) -> list[Plan]:
    """The plans that fit ``memory_per_rank`` (bytes or ``"80GB"``; None: all), fastest first,
    at most ``top`` of them (None: every one, each priced)."""
    if compute is None:
        raise ValueError("search needs compute: plan.Measured(...) or plan.FlopRate(flop/s)")
    net = network or Network(ranks_per_node=ranks_per_node)
    budget = parse_bytes(memory_per_rank) if memory_per_rank is not None else None
    fitting = []
    for plan in candidates(model, ranks, global_batch, ranks_per_node, runnable,
                           max_micro_batch, microbatches):
        plan.memory, terms = memory(model, plan, ranks_per_node if net.host else 0)
        plan.breakdown = {"memory": terms}
        if budget is None or plan.memory <= budget:
            fitting.append(plan)
    bounded = [(lower_bound(model, plan, net, compute), i, plan)
               for i, plan in enumerate(fitting)]
    bounded.sort(key=lambda x: (x[0], x[1]))
    best: list = []  # a max-heap of the top plans' step times: (-time, index)
    out = []
    for bound, i, plan in bounded:
        if top is not None and len(best) >= top and bound >= -best[0][0]:
            break
        plan.step_time, plan.bubble, plan.link_bytes, terms = step_time(model, plan, net,
                                                                        compute)
        plan.breakdown["time"] = terms
        out.append(plan)
        heapq.heappush(best, (-plan.step_time, i))
        if top is not None and len(best) > top:
            heapq.heappop(best)
    out.sort(key=lambda q: (q.step_time, q.memory))
    return out if top is None else out[:top]
