"""Predicted step time of a plan: compute per block (measured once, or from a FLOP rate), every
collective priced on the link class its mesh axis crosses, the pipeline by ``pp.simulate``.

1. *Compute.* ``Measured`` runs one block (and the head with its loss) forward and backward on
   this machine at the micro-batch size and the tensor-parallel rank's share of the layers (the
   q/k/v, projection and MLP widths divided by tp; the collectives left out), once per (micro-batch,
   tp, sequence parallelism, recompute), median of a few runs. ``FlopRate`` divides
   ``GPTShape.layer_flops`` by a rate for a machine that is not here. A recomputed block's
   backward includes its forward again (full) or its attention core's (selective).
2. *Collectives* (``Network``: the calibrated ``CostModel``, ranks per node): bandwidth-optimal
   rings priced with the model's alpha, beta and gamma of the link class the axis crosses. A
   mesh ``(pp, dp, tp)`` lays tp fastest: an axis of stride ``k`` (tp 1, dp tp, pp dp tp) and
   size ``n`` stays inside a node when ``k n`` ranks fit in one, else it crosses the network.
   Per block and micro-batch: two allreduces of the hidden state forward and two backward (with
   sequence parallelism two all-gathers and two reduce-scatters each way); full recompute runs
   the forward's again in backward. Pipeline messages: one hidden state (its sequence share under
   sp) per micro-batch and direction. Data parallelism: DDP an allreduce of the rank's gradients,
   ZeRO-1 that and an all-gather of the parameters, ZeRO-2 a reduce-scatter and an all-gather,
   ZeRO-3 a reduce-scatter and two all-gathers (forward, backward); ``overlap`` is the share of
   the last micro-batch's backward that hides it (0 where the collectives and the compute share
   the cores, 1 where a NIC moves the bytes).
3. *Pipeline.* ``pp.simulate`` on per-stage forward, backward (and, for zero bubble, weight)
   times with the message time as ``p2p``; zero bubble's split backward as the runner runs it:
   the input gradient half a backward, the weights' a whole one (autograd reaches a layer's
   weights through every later layer's input gradient again); the step is its makespan plus
   the exposed data-parallel time, the tied pair's sum of the embedding's gradient (first and last stage)
   and the optimizer's step.
"""
from __future__ import annotations

import functools
import statistics
import time

from .memory import stage_layers
from .model import GPTShape
from .record import Plan

__all__ = ["Network", "FlopRate", "Measured", "step_time", "lower_bound", "layer_comm",
           "layer_time"]


class Network:
    """The cost model and the layout: ``ranks_per_node``; ``overlap`` (0..1) of data-parallel
    communication with backward; ``cores`` per node (None: a rank has its own), so that ranks
    sharing cores compute ``ranks_per_node / cores`` times slower; ``host``: the collectives
    work in host memory (the toolkit's CPU path), so their node windows take memory."""

    __slots__ = ("model", "ranks_per_node", "overlap", "cores", "host")

    def __init__(self, model=None, ranks_per_node: int = 1, overlap: float = 0.0,
                 cores: int | None = None, host: bool = True):
        from collectives.costmodel import CostModel
        self.model = model if model is not None else CostModel.load()
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        if not 0.0 <= overlap <= 1.0:
            raise ValueError(f"overlap must be within [0, 1], got {overlap}")
        self.ranks_per_node, self.overlap, self.cores = ranks_per_node, overlap, cores
        self.host = host

    @property
    def share(self) -> float:
        """How much slower a rank computes for sharing its node's cores (1 at most one rank a
        core)."""
        return max(1.0, self.ranks_per_node / self.cores) if self.cores else 1.0

    def link(self, stride: int, size: int) -> str:
        """The link class a mesh axis of ``stride`` and ``size`` crosses."""
        return "node" if stride * size <= self.ranks_per_node else "net"

    def _ring(self, kind: str, nbytes: float, n: int, link: str) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        m = self.model
        chunk = nbytes / n
        step = m.alpha[link] + chunk * m.beta(link)
        if kind == "allreduce":
            return 2 * (n - 1) * step + (n - 1) * chunk * m.gamma + m.call
        if kind == "reduce_scatter":
            return (n - 1) * (step + chunk * m.gamma) + m.call
        return (n - 1) * step + m.call  # allgather

    def collective(self, kind: str, nbytes: float, n: int, stride: int) -> tuple[float, float]:
        """(seconds, bytes this rank sends) of one ``kind`` of ``nbytes`` (the full buffer)
        over an axis of ``n`` ranks and ``stride``."""
        if n <= 1:
            return 0.0, 0.0
        sent = {"allreduce": 2, "reduce_scatter": 1, "allgather": 1}[kind] * (n - 1) * nbytes / n
        return self._ring(kind, nbytes, n, self.link(stride, n)), sent

    def message(self, nbytes: float, stride: int, size: int) -> float:
        """Seconds of one point-to-point message along an axis."""
        link = self.link(stride, size)
        return self.model.alpha[link] + nbytes * self.model.beta(link)


class FlopRate:
    """Compute priced from floating-point operations: ``rate`` FLOP/s per rank; the optimizer
    at ``optimizer_rate`` parameters per second."""

    __slots__ = ("rate", "optimizer_rate")

    def __init__(self, rate: float, optimizer_rate: float = 1e11):
        self.rate, self.optimizer_rate = float(rate), float(optimizer_rate)

    def layer(self, model: GPTShape, b: int, tp: int, sp: bool, recompute: str):
        """(forward, backward) seconds of one block on one micro-batch."""
        fwd = model.layer_flops(b) / tp / self.rate
        extra = {"none": 0.0, "full": fwd,
                 "selective": 4 * b * model.seq ** 2 * model.dim / tp / self.rate}[recompute]
        return fwd, 2 * fwd + extra

    def head(self, model: GPTShape, b: int, tp: int, sp: bool):
        """(forward, backward) seconds of the head and its loss on one micro-batch."""
        fwd = model.head_flops(b) / tp / self.rate
        return fwd, 2 * fwd

    def optimizer(self, params: int) -> float:
        """Seconds of one optimizer step over ``params`` parameters."""
        return params / self.optimizer_rate


class Measured:
    """Compute measured on this machine: ``block(model, tp)`` builds one block whose q/k/v,
    projection and MLP are a tensor-parallel rank's share (examples/train_gpt.py's ``Block``
    with narrowed linears), ``head(h, v_local)`` the norm, head and loss. Each
    (micro-batch, tp, sp, recompute) is timed once: ``repeats`` forward + backward runs, the
    median."""

    def __init__(self, block, head, repeats: int = 5, threads: int = 1):
        self._block, self._head = block, head
        self.repeats, self.threads = repeats, threads
        self._cache: dict = {}

    def _timed(self, key, build, inputs):
        if key in self._cache:
            return self._cache[key]
        import torch
        old = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            module = build()
            fw, bw = [], []
            for _ in range(self.repeats + 1):
                args = inputs()
                t0 = time.perf_counter()
                out = module(*args)
                loss = out if out.dim() == 0 else out.float().pow(2).mean()
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                fw.append(t1 - t0)
                bw.append(t2 - t1)
            result = (statistics.median(fw[1:]), statistics.median(bw[1:]))
        finally:
            torch.set_num_threads(old)
        self._cache[key] = result
        return result

    def layer(self, model: GPTShape, b: int, tp: int, sp: bool, recompute: str):
        """(forward, backward) seconds of one block on one micro-batch, measured."""
        import torch

        def build():
            from collectives.torch import checkpoint
            torch.manual_seed(0)
            holder = torch.nn.Module()  # names the block as the policies do: "block", ...
            holder.block = self._block(model, tp)
            if recompute != "none":
                checkpoint.recompute(holder, {"full": "block", "selective": "block.attn.core"}
                                     [recompute])
            return holder.block

        return self._timed(("layer", b, tp, recompute), build, lambda: (
            torch.randn(b, model.seq, model.dim, requires_grad=True),))

    def head(self, model: GPTShape, b: int, tp: int, sp: bool):
        """(forward, backward) seconds of the norm, head and loss on one micro-batch."""
        import torch
        v = model.vocab // tp
        return self._timed(("head", b, tp), lambda: self._head(model.dim, v), lambda: (
            torch.randn(b, model.seq, model.dim, requires_grad=True),
            torch.randint(0, v, (b, model.seq))))

    def optimizer(self, params: int) -> float:
        """Seconds of one AdamW step over ``params`` float32 parameters, measured once per
        size class."""
        import torch
        key = ("optimizer", params)
        if key not in self._cache:
            p = torch.nn.Parameter(torch.zeros(max(params, 1)))
            p.grad = torch.ones_like(p)
            opt = torch.optim.AdamW([p], lr=1e-3)
            times = []
            for _ in range(self.repeats + 1):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            self._cache[key] = statistics.median(times[1:])
        return self._cache[key]


def layer_time(compute, model: GPTShape, b: int, tp: int, sp: bool,
               recompute: str) -> tuple[float, float]:
    """(forward, backward) seconds of one block on one micro-batch from ``compute``. A
    recomputed block's backward is the plain block's and the part of the forward it runs
    again: at least the plain backward plus that part's share of the plain forward's
    floating-point operations (all of it under full recompute, the attention core's
    ``4 b s^2 h`` under selective). A measurement that finds it cheaper measured noise, and
    would rank plans that differ only in their recompute by it."""
    fwd, bwd = compute.layer(model, b, tp, sp, recompute)
    if recompute == "none":
        return fwd, bwd
    fwd0, bwd0 = compute.layer(model, b, tp, sp, "none")
    share = 1.0 if recompute == "full" else \
        4 * b * model.seq ** 2 * model.dim / model.layer_flops(b)
    return fwd, max(bwd, bwd0 + share * fwd0)


def layer_comm(net: Network, model: GPTShape, plan: Plan) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, bytes sent) of one block's tensor-parallel
    collectives on one micro-batch."""
    t = plan.tp
    if t == 1:
        return 0.0, 0.0, 0.0
    x = model.bytes[3] * plan.micro_batch * model.seq * model.dim
    if plan.sequence_parallel:
        ag, s1 = net.collective("allgather", x, t, 1)
        rs, s2 = net.collective("reduce_scatter", x, t, 1)
        once, sent = 2 * (ag + rs), 2 * (s1 + s2)
    else:
        ar, s1 = net.collective("allreduce", x, t, 1)
        once, sent = 2 * ar, 2 * s1
    fwd, bwd = once / 2, once / 2
    if plan.recompute == "full":
        return fwd, bwd + fwd, sent * 1.5
    return fwd, bwd, sent


def _dp_comm(net: Network, model: GPTShape, plan: Plan, params: int) -> tuple[float, float]:
    """(seconds, bytes sent) of one step's data-parallel collectives on a rank holding
    ``params`` parameters."""
    dp, stride = plan.dp, plan.tp
    g, w = params * model.bytes[1], params * model.bytes[0]
    ops = {0: [("allreduce", g)], 1: [("allreduce", g), ("allgather", w)],
           2: [("reduce_scatter", g), ("allgather", w)],
           3: [("reduce_scatter", g), ("allgather", w), ("allgather", w)]}[plan.zero]
    secs = sent = 0.0
    for kind, nbytes in ops:
        s, b = net.collective(kind, nbytes, dp, stride)
        secs, sent = secs + s, sent + b
    return secs, sent


def _tied_comm(net: Network, model: GPTShape, plan: Plan) -> tuple[float, float]:
    """(seconds, bytes sent) of a pipeline's tied pair: the first and the last stage's ranks of
    one (dp, tp) position sum the embedding's gradient after the step's backwards (the
    vocabulary shard of a tp rank), an axis of 2 ranks and stride ``dp tp (pp - 1)``."""
    if plan.pp == 1 or not model.tied:
        return 0.0, 0.0
    stride = plan.dp * plan.tp * (plan.pp - 1)
    return net.collective("allreduce", model.bytes[1] * model.vocab * model.dim // plan.tp, 2,
                          stride)


def _stage_params(model: GPTShape, plan: Plan, blocks: int, first: bool, last: bool) -> int:
    h, t = model.dim, plan.tp
    out = blocks * ((4 * h * h + 2 * h * model.ffn) // t + 4 * h)
    if first:
        out += model.vocab * h // t
    if last:
        out += 2 * h + (model.vocab * h // t if (plan.pp > 1 or not model.tied) else 0)
    return out


def _stages(model: GPTShape, plan: Plan, net: Network, compute):
    """Per stage (forward, backward, weight) seconds, and per rank its parameters."""
    p, v, b, t, sp = plan.pp, plan.virtual, plan.micro_batch, plan.tp, plan.sequence_parallel
    S = p * v
    counts = stage_layers(model.layers, S)
    k = net.share
    lf, lb = (k * x for x in layer_time(compute, model, b, t, sp, plan.recompute))
    cf, cb, _ = layer_comm(net, model, plan)
    hf, hb = (k * x for x in compute.head(model, b, t, sp))
    x = model.bytes[3] * b * model.seq * model.dim
    edge, _ = net.collective("allreduce", x, t, 1) if not sp else \
        net.collective("reduce_scatter", x, t, 1)
    redo_layer = 0.0
    if plan.recompute != "none" and plan.schedule == "zero_bubble" and p > 1:
        redo_layer = max(lb - k * compute.layer(model, b, t, sp, "none")[1], 0.0)
    fw, bw, ww = [], [], []
    for s in range(S):
        f = counts[s] * (lf + cf) + (edge if s == 0 else 0.0) + (hf if s == S - 1 else 0.0)
        bk = counts[s] * (lb + cb) + (edge + hb if s == S - 1 else 0.0)
        fw.append(f)
        if plan.schedule == "zero_bubble" and p > 1:
            # B asks autograd for the stage input's gradient alone (about half the matmuls'
            # backward) and keeps the graph; W runs autograd into the weights, which walks the
            # graph again, every layer's input gradient on the way to the weights before it:
            # a whole backward. A recompute runs in both.
            redo = counts[s] * redo_layer
            bw.append((bk - redo) / 2 + redo)
            ww.append(bk)
        else:
            bw.append(bk)
            ww.append(0.0)
    params = [_stage_params(model, plan, sum(counts[s] for s in range(r, S, p)),
                            r == 0, r == p - 1) for r in range(p)]
    return fw, bw, ww, params


def lower_bound(model: GPTShape, plan: Plan, net: Network, compute) -> float:
    """A step time no schedule beats, plus the first rank's exposed data-parallel time and
    optimizer step: the larger of the first rank's compute for every micro-batch and the
    chain through the last rank (its first forward cannot start before the p - 1 stages ahead
    of it ran one, its forwards and backwards take their time, and its last backward still has
    to travel back through those stages). Closed forms over the ranks' block counts."""
    p, v, m, b, t, sp = (plan.pp, plan.virtual, plan.microbatches, plan.micro_batch, plan.tp,
                         plan.sequence_parallel)
    S = p * v
    per, extra = divmod(model.layers, S)
    k = net.share
    lf, lb = (k * x for x in layer_time(compute, model, b, t, sp, plan.recompute))
    cf, cb, _ = layer_comm(net, model, plan)
    hf, hb = (k * x for x in compute.head(model, b, t, sp))
    layer = lf + cf + lb + cb
    first_blocks = v * per + sum(1 for s in range(0, S, p) if s < extra)
    last_blocks = v * per + sum(1 for s in range(p - 1, S, p) if s < extra)
    ahead = (p - 1) * per + min(extra, p - 1)   # blocks of the stages before stage p - 1
    # the input-gradient part of a backward: all of it, or about half where it is split
    split = 2 if plan.schedule == "zero_bubble" and p > 1 else 1
    back = (lb + cb) / split
    first = m * first_blocks * layer
    last = ahead * (lf + cf) + m * (last_blocks * (lf + cf + back) + hf + hb / split) + \
        ahead * back
    # the data-parallel step of the rank with the most parameters, as step_time takes it, its
    # overlap with the longest backward that rank could have
    ends = [(_stage_params(model, plan, first_blocks, True, p == 1), first_blocks, p == 1),
            (_stage_params(model, plan, last_blocks, p == 1, True), last_blocks, True)]
    params, blocks, has_head = max(ends, key=lambda e: e[0])
    dp_secs, _ = _dp_comm(net, model, plan, params)
    x = model.bytes[3] * b * model.seq * model.dim
    edge, _ = net.collective("reduce_scatter" if sp else "allreduce", x, t, 1)
    longest = blocks * (2 * lb + cb) + (hb + edge if has_head else 0.0)
    exposed = max(dp_secs - net.overlap * longest, 0.0)
    return max(first, last) + exposed + \
        k * compute.optimizer(-(-params // (plan.dp if plan.zero else 1)))


@functools.lru_cache(maxsize=1024)
def _schedule(name, p, m, v):
    from collectives.torch.pipeline import schedule
    return schedule(name, p, m, v)


@functools.lru_cache(maxsize=8192)
def _simulated(name, p, m, v, fw, bw, ww, p2p):
    from collectives.torch.pipeline import simulate
    sim = simulate(_schedule(name, p, m, v), forward=list(fw), backward=list(bw),
                   weight=list(ww), p2p=p2p)
    return sim.step, sim.bubble


def step_time(model: GPTShape, plan: Plan, net: Network, compute) -> tuple[float, float, dict,
                                                                             dict]:
    """(seconds per step, bubble, bytes sent per step by link class, the time's terms)."""
    p, m, v, t, dp = plan.pp, plan.microbatches, plan.virtual, plan.tp, plan.dp
    fw, bw, ww, params = _stages(model, plan, net, compute)
    link_bytes = {"node": 0.0, "net": 0.0}
    _, _, tp_sent = layer_comm(net, model, plan)
    counts = stage_layers(model.layers, p * v)
    rank0_blocks = sum(counts[s] for s in range(0, p * v, p))
    link_bytes[net.link(1, t)] += tp_sent * rank0_blocks * m
    nl = plan.micro_batch * model.seq // (t if plan.sequence_parallel else 1)
    msg = model.bytes[3] * nl * model.dim
    if p > 1:
        p2p = net.message(msg, dp * t, p)
        # round to a microsecond so equal stages share one simulation
        key = tuple(round(x, 6) for x in fw), tuple(round(x, 6) for x in bw), \
            tuple(round(x, 6) for x in ww)
        pipe, bubble = _simulated(plan.schedule, p, m, v, *key, round(p2p, 6))
        link_bytes[net.link(dp * t, p)] += 2 * msg * m * v
    else:
        pipe, bubble = m * (fw[0] + bw[0]), 0.0
    worst = max(range(p), key=lambda r: params[r])
    dp_secs, dp_sent = _dp_comm(net, model, plan, params[worst])
    link_bytes[net.link(t, dp)] += dp_sent
    last_backward = bw[worst] + ww[worst]
    exposed = max(dp_secs - net.overlap * last_backward, 0.0)
    tied, tied_sent = _tied_comm(net, model, plan)
    link_bytes[net.link(dp * t * (p - 1), 2)] += tied_sent
    opt = net.share * compute.optimizer(-(-params[worst] // (dp if plan.zero else 1)))
    total = pipe + exposed + tied + opt
    return total, bubble, {k: int(b) for k, b in link_bytes.items()}, \
        {"pipeline": pipe, "dp_exposed": exposed, "tied": tied, "optimizer": opt}
