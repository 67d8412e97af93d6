"""Predicted peak memory per rank of a plan: model states by ZeRO stage, activations by recompute
policy and pipeline schedule, the transients around them.

Activations of one block for one micro-batch, per rank, in elements of ``e`` bytes (``n = b s``
tokens, ``n' = n / t`` under sequence parallelism else ``n``, ``t`` the tensor-parallel size,
``f`` the MLP width): what autograd saves for the toolkit's layers (examples/train_gpt.py's
``Block`` on ``tensor_parallel``'s layers), tensor by tensor:

    the block's input (norm1's input)        n' h      norm1's mean and 1/std     2 n' (fp32)
    q/k/v's input (gathered under sp)        n h       q, k, v                    3 n h / t
    the core's output (the projection's in)  n h / t   norm2's input              n' h
    norm2's mean and 1/std                   2 n' (fp32)
    fc1's input (gathered under sp)          n h       GELU's input and output    2 n f / t
    the core: sdpa  log-sum-exp             b a s / t (fp32)
              math  softmax                  b a s^2 / t,   the causal mask  s^2 (bool)

    none       all of the above: e (2 n' h + 2 n h + 4 n h / t + 2 n f / t) + 16 n' + core
    selective  the core's own terms dropped (its inputs and output are kept by the layers
               around it)
    full       the block's input only: e n' h; one block's "none" is live again while it is
               recomputed in backward

(Korthikanti et al. count 34 s b h + 5 a s^2 b bytes for Megatron's fp16 layers with dropout;
this table is the toolkit's float32 layers without dropout, checked tensor by tensor against
``collectives.torch.checkpoint.saved_bytes`` in the tests.)

The first stage adds the embedding's saved ids and masks (9 n bytes); the last stage the final
norm (``e n' h + 8 n'``), the head's input (``e n h``) and the vocabulary-parallel
cross-entropy's softmax, target and mask (``e n V / t + 9 n``).

A pipeline rank's activations come from the schedule itself, walked from ``pp.SCHEDULES``'
compute order of that rank (``held``): after each action, the (micro-batch, stage) graphs it
holds between F and the end of their backward (at most GPipe m, 1F1B min(p - r, m),
interleaved and zero bubble as they are built: ``in_flight``), and the hidden states
(``e n' h`` each) the runner keeps: every stage output (kept for its backward, then by its
send) and every input gradient it sent, until the step's sends complete at its end. The peak
is the moment that holds the most bytes of both, graphs times their stages' saved bytes plus
hidden states times one's, plus, on a stage without data parallelism, the gradients it holds
then: such a stage runs plain (``pipeline.gpt``), no bucket keeps its gradients, the
optimizer's ``zero_grad`` drops them after each step and the stage's first backward of the next
makes them again (``graded``), so a GPipe rank's fullest moment, the end of its forwards, holds
none of them; the optimizer's step holds all of them. The fullest rank is the pipeline's
first (the most blocks, in-flight micro-batches and the embedding) or its last (the head and
the loss): those two are priced (``rank_memory`` prices any).

Model states per rank (``P`` the rank's parameters: its stages' blocks, its tensor-parallel
shards, the norms whole): parameters ``P wp`` (ZeRO-3: ``P wp / dp`` plus the layers gathered
at once: two, or a whole block while it is recomputed), gradients ``P wg`` (ZeRO-2 and 3:
``/ dp`` plus the packing slots: every unit while there are at most three, else three of
the largest), optimizer state ``P wo`` (ZeRO 1-3: ``/ dp``);
ZeRO 1-2 also keep a scratch shard.

Transients. End of forward on the last stage: the logits, their shifted copy and the softmax
(``3 e n V / t``); in backward: a gradient of the logits' size and two of the hidden state's
(``e (n V / t + 2 n h)``) on the last stage, three hidden-state gradients elsewhere; with
selective recompute the core's saved tensors on top (recomputed in the middle of its block's
backward); with full recompute the larger of that and a block recomputed at the start of its
backward: its "none" beyond its input, the gradient coming into it (``e n' h``) and, under
sequence parallelism, two gathered hidden states (``2 e n h``: the incoming gradient's and the
projection's output before its scatter); the optimizer step: one float32 temporary of its
parameters (AdamW's ``foreach`` square root).
The peak is the larger of (states + activations + backward transient) and (states + optimizer
temporary).

Pages. On host memory a tensor of ``MMAP_THRESHOLD`` bytes or more is mapped on its own
(``plan.measure``'s allocator setting), in whole pages behind its headers: ``host_slack``, a
page more for a power-of-two size (3% of a 128 KiB tensor, 6% of a 64 KiB one). Each tensor a
block saves, the ends' tensors, each message, the transients, and the parameters, gradients
and AdamW's state where they are tensors of their own (not ZeRO's flat buffers nor the
data-parallel buckets) are priced so.

Scratch. On host memory (the toolkit's CPU path) a communicator whose collectives take the
node's shared-memory path maps one window of ``SLOTS`` slots of ``COLLECTIVES_SHM_CHUNK_BYTES``
per rank, and every rank faults in all of them: ``k (header + 4 chunk)`` resident bytes for a
group of k ranks (``window_bytes``): a group one of whose calls ``auto`` sends through a node
algorithm (asked of the selection table at the call's size), the data-parallel group (whose
registered flat buffers take the one-pass path) and a pipeline's tied pair on its two end
ranks (its in-place sum of the embedding's gradient takes the node path where the table says
so, and always with data parallelism, whose gradient lies in a registered bucket); the
one-pass collectives also touch slices of the peers' registered buffers (``scratch``).
"""
from __future__ import annotations

import functools
import mmap

import numpy as np

from .measure import MMAP_THRESHOLD
from .model import GPTShape
from .record import Plan

__all__ = ["layer_activations", "stage_layers", "in_flight", "memory", "rank_memory", "held",
           "graded", "host_slack", "scratch", "window_bytes", "BUCKET_BYTES"]

BUCKET_BYTES = 25 << 20  # DistributedDataParallel's and ZeRO's bucket_cap_mb
FIRST_BUCKET_BYTES = 1 << 20  # the first bucket's (``collectives.torch.buckets``)
PACKED = 3               # ZeRO-2 and -3's packing slots (``collectives.torch.sharded``)
PAGE = mmap.PAGESIZE
# what glibc maps for torch's posix_memalign(64, x) beyond x: the alignment plus a minimum
# chunk (64 + 32), each request rounded to 16 bytes with its 8-byte header (16 + 16), and the
# mapped chunk's own header (8)
ALIGN_SLACK = 136


def _block_tensors(model: GPTShape, b: int, tp: int, sp: bool, recompute: str) -> list[int]:
    """The tensors one block saves for backward on one micro-batch, per rank, in bytes."""
    e = model.bytes[3]
    s, h, f, a = model.seq, model.dim, model.ffn, model.heads
    n = b * s
    nl = n // tp if sp else n
    if recompute == "full":
        return [e * nl * h]
    # the norms' inputs and statistics, q/k/v's and fc1's inputs, q/k/v, the core's output,
    # GELU's input and output
    kept = [e * nl * h, 4 * nl, 4 * nl, e * n * h, e * 3 * n * h // tp, e * n * h // tp,
            e * nl * h, 4 * nl, 4 * nl, e * n * h, e * n * f // tp, e * n * f // tp]
    if recompute == "selective":
        return kept
    if model.attention == "math":
        return kept + [e * b * (a // tp) * s * s, s * s]
    return kept + [4 * b * (a // tp) * s]


def layer_activations(model: GPTShape, b: int, tp: int, sp: bool, recompute: str) -> int:
    """Bytes one block saves for backward on one micro-batch of ``b`` sequences, per rank."""
    return sum(_block_tensors(model, b, tp, sp, recompute))


def _edge_tensors(model: GPTShape, b: int, tp: int, sp: bool, first: bool,
                  last: bool) -> list[int]:
    e, n, h = model.bytes[3], b * model.seq, model.dim
    nl = n // tp if sp else n
    out = [8 * n, n] if first else []
    if last:
        out += [e * nl * h, 4 * nl, 4 * nl, e * n * h, e * n * model.vocab // tp, 8 * n, n]
    return out


def _edge_activations(model: GPTShape, b: int, tp: int, sp: bool, first: bool,
                      last: bool) -> int:
    return sum(_edge_tensors(model, b, tp, sp, first, last))


def host_slack(tensors) -> int:
    """What host memory holds beyond the bytes of ``tensors`` (each a size in bytes): a block
    of ``MMAP_THRESHOLD`` bytes or more that the heap's free space does not hold is mapped on
    its own (``plan.measure``'s allocator setting), in whole pages, behind torch's 64-byte
    alignment and the C library's chunk headers, so that a tensor of a power-of-two size
    takes one page more."""
    return sum(-(-(x + ALIGN_SLACK) // PAGE) * PAGE - x for x in tensors if x >= MMAP_THRESHOLD)


def stage_layers(layers: int, stages: int) -> list[int]:
    """Blocks per stage as ``pipeline.gpt.stages`` deals them (earlier stages the extra)."""
    per, extra = divmod(layers, stages)
    return [per + (k < extra) for k in range(stages)]


@functools.lru_cache(maxsize=16384)
def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> tuple:
    """The most (micro-batch, stage) pairs pipeline rank ``rank`` holds at once, walked from
    its compute order: ``((stage, count), ...)`` at that moment."""
    from collectives.torch.pipeline.schedules import B, F, SCHEDULES, W
    order, split, _ = SCHEDULES[schedule]
    last = W if split else B
    live: dict = {}
    total = best = 0
    best_live: dict = {}
    for kind, _mb, s in order(rank, p, m, v):
        if kind == F:
            live[s] = live.get(s, 0) + 1
            total += 1
            if total > best:
                best, best_live = total, dict(live)
        elif kind == last:
            live[s] -= 1
            total -= 1
    return tuple(sorted(best_live.items()))


@functools.lru_cache(maxsize=16384)
def held(schedule: str, p: int, m: int, v: int, rank: int) -> tuple:
    """What pipeline rank ``rank`` holds through one step, walked from its compute order:
    ``(((stage, graphs), ...), messages)`` after each of its actions (the peak is one of these
    moments whatever the bytes of a graph and of a message). ``graphs``: (micro-batch, stage)
    pairs between F and the end of their backward; ``messages``: the hidden states the
    runner keeps alive, each stage's output after its F (kept for the backward, then by its
    send) and each input gradient it sent after its B, on every stage that sends them, until
    the step's sends complete at its end (``pp.Pipeline``; past 64 sends in flight it
    releases the completed ones, so for long steps this is an upper bound)."""
    from collectives.torch.pipeline.schedules import B, F, SCHEDULES, W
    order, split, _ = SCHEDULES[schedule]
    last = W if split else B
    S = p * v
    live: dict = {}
    sent = 0
    moments = []
    for kind, _mb, s in order(rank, p, m, v):
        if kind == F:
            live[s] = live.get(s, 0) + 1
            sent += s != S - 1
        if kind == B:
            sent += s != 0
        if kind == last:
            live[s] -= 1
        moments.append((tuple(sorted((k, c) for k, c in live.items() if c)), sent))
    return tuple(moments)


@functools.lru_cache(maxsize=16384)
def graded(schedule: str, p: int, m: int, v: int, rank: int) -> tuple:
    """The stages of pipeline rank ``rank`` whose gradients exist after each of its actions
    (``held``'s moments) in a step that starts without them, as a plain stage's does (the
    optimizer's ``zero_grad`` drops them): a stage's from the end of its first backward that
    accumulates them (B, or W where the backward is split)."""
    from collectives.torch.pipeline.schedules import B, SCHEDULES, W
    order, split, _ = SCHEDULES[schedule]
    accumulating = W if split else B
    have: set = set()
    moments = []
    for kind, _mb, s in order(rank, p, m, v):
        if kind == accumulating:
            have.add(s)
        moments.append(tuple(sorted(have)))
    return tuple(moments)


@functools.lru_cache(maxsize=16384)
def _held_matrix(schedule: str, p: int, m: int, v: int, rank: int, plain: bool = False):
    """``held`` as a matrix, a row a moment: the graphs of each of the rank's stages (in
    order r, r + p, ...), then the hidden states, then (``plain``) whether each stage's
    gradients exist (``graded``); priced by one product (the search prices thousands of
    plans)."""
    stages = list(range(rank, p * v, p))
    rows = [[dict(graphs).get(s, 0) for s in stages] + [sent]
            + ([int(s in have) for s in stages] if plain else [])
            for (graphs, sent), have in zip(held(schedule, p, m, v, rank),
                                            graded(schedule, p, m, v, rank))]
    return np.unique(np.array(rows, dtype=np.float64), axis=0)


def _param_tensors(model: GPTShape, plan: Plan, first: bool, last: bool) -> tuple[list, list]:
    """The parameter tensors of one block, and of a stage's ends, in elements: a block's q/k/v,
    projection, fc1 and fc2 shards and its norms' weights and biases; the embedding's shard on
    the first stage, the final norm and the head's shard on the last (``_states`` counts the
    same)."""
    t, h, f, V = plan.tp, model.dim, model.ffn, model.vocab
    block = [3 * h * h // t, h * h // t, f * h // t, h * f // t, h, h, h, h]
    ends = [V * h // t] if first else []
    if last:
        ends += [h, h] + ([V * h // t] if (plan.pp > 1 or not model.tied) else [])
    return block, ends


def _state_slack(model: GPTShape, plan: Plan, blocks: int, first: bool, last: bool,
                 plain: bool) -> tuple[int, int, int]:
    """``host_slack`` of the parameters, the gradients and the optimizer's state, tensor by
    tensor where they are the model's own tensors: not where ZeRO packs them into flat
    buffers (parameters and state), nor where data-parallel buckets hold the gradients (a
    plain pipeline stage keeps them per parameter); AdamW keeps its state per parameter, in
    float32 tensors of the parameter's shape."""
    if plan.zero >= 1 and plan.dp > 1:
        return 0, 0, 0
    wp, wg, wo, _ = model.bytes
    block, ends = _param_tensors(model, plan, first, last)

    def slack(width):
        return blocks * host_slack(width * x for x in block) + host_slack(width * x for x in ends)

    return slack(wp), slack(wg) if plain else 0, (wo // 4) * slack(4)


def _states(model: GPTShape, plan: Plan, blocks: int, first: bool, last: bool) -> dict:
    wp, wg, wo, _ = model.bytes
    t, dp = plan.tp, plan.dp
    h = model.dim
    sharded_layer = 4 * h * h + 2 * h * model.ffn
    per_layer = sharded_layer // t + 4 * h
    params = blocks * per_layer
    if first:
        params += model.vocab * h // t
    if last:
        params += 2 * h + (model.vocab * h // t if (plan.pp > 1 or not model.tied) else 0)
    out = {"params": params * wp, "grads": params * wg, "optimizer": params * wo}
    if plan.zero >= 1:
        out["optimizer"] = -(-params * wo // dp)
    # stage 3's units are layers, the largest a linear of the MLP or the embedding
    biggest = max(h * model.ffn // t, model.vocab * h // t if first or last else 0)
    if plan.zero >= 2:
        # the shard's gradients and the packing slots (``sharded.PACKED``, one a unit at most;
        # a slot is the largest of the units it packs in turn): every bucket while there are
        # at most PACKED of them (the first holds FIRST_BUCKET_BYTES), else a bucket a slot;
        # under stage 3 a unit is a layer
        g = params * wg
        if plan.zero == 2:
            units = 1 + -(-max(g - FIRST_BUCKET_BYTES, 0) // BUCKET_BYTES)
            packed = g if units <= PACKED else PACKED * BUCKET_BYTES
        else:
            packed = PACKED * biggest * wg
        out["grads"] = -(-g // dp) + packed
    if plan.zero == 3:
        # the layer being used and the one prefetched (a whole block while it is recomputed)
        gathered = max(2 * biggest, per_layer if plan.recompute == "full" else 0) * wp
        out["params"] = -(-params * wp // dp) + gathered
    if plan.zero in (1, 2) and dp > 1:
        out["scratch"] = min(BUCKET_BYTES, params * wp) // dp
    return out


def window_bytes(ranks: int) -> int:
    """Resident bytes of one communicator's shared window on a node of ``ranks`` ranks
    (``collectives.node.window``): every rank faults in every rank's slots and header."""
    from collectives.node.window import rank_bytes, slot_bytes
    return ranks * rank_bytes(ranks, slot_bytes(ranks))


def _pow2(n: int) -> int:
    return 1 << max(12, (max(n, 1) - 1).bit_length())


def _node_path(collective: str, nbytes: int, size: int, inplace: bool = False) -> bool:
    """Whether ``auto`` takes a node algorithm (one that maps the node's shared window) for
    this call on one node: the choice the toolkit's table makes, asked, not assumed, with
    the call's ``inplace`` (``out=x``) as the caller makes it (the table's rules differ)."""
    from collectives.select import REGISTRY, auto
    name = auto(collective, int(nbytes), size, single_node=True, inplace=inplace)
    return REGISTRY[collective][name].needs == "one node"


def scratch(model: GPTShape, plan: Plan, ranks_per_node: int, states: dict,
            end: bool = True) -> int:
    """The collectives' memory on a rank of a host-memory job, for its groups that fit on one
    node: the shared window of each communicator one of whose calls takes a node algorithm
    (``auto``'s choice for the tensor-parallel activations, the loss's and the tied gradient's
    sums, the pipeline's loss broadcast; always for the data-parallel group, whose registered
    buffers take the one-pass path, and for a tied pair whose gradient lies in a registered
    bucket), and the pages of the peers' registered buffers this rank touches: a one-pass
    allreduce or reduce-scatter reads and writes slice r of every peer's buffer ((dp - 1) / dp
    of one buffer in all), an all-gather reads every peer's shard (the same). Registered
    windows are whole powers of two. ``end``: the rank is one of the pipeline's two ends,
    whose tied pair sums the embedding's gradient."""
    t, dp, p = plan.tp, plan.dp, plan.pp
    e, n = model.bytes[3], plan.micro_batch * model.seq
    x = e * n * model.dim
    out = 0
    if 1 < t <= ranks_per_node:
        # the activations' collectives out of place, the loss's max and sums in place
        calls = [("reduce_scatter", x, False), ("allgather", x // t, False)] \
            if plan.sequence_parallel else [("allreduce", x, False)]
        calls += [("allreduce", 4 * n, True), ("allreduce", 8 * n, True)]
        if any(_node_path(c, b, t, inplace) for c, b, inplace in calls):
            out += window_bytes(t)
    if 1 < p <= ranks_per_node and _node_path("broadcast", 8, p, True):
        out += window_bytes(p)
    tied = model.bytes[1] * model.vocab * model.dim // t   # summed in place
    if end and p > 1 and 2 <= ranks_per_node and (
            dp > 1 or _node_path("allreduce", tied, 2, True)):
        out += window_bytes(2)
    if dp < 2 or dp > ranks_per_node:
        return out
    out += window_bytes(dp)
    # ZeRO 0-1 reduce the full-size gradients, ZeRO-2 a packed buffer of the same size
    out += (dp - 1) * _pow2(states["grads"]) // dp
    if plan.zero >= 1:
        out += (dp - 1) * _pow2(states["params"]) // dp
    return out


def rank_memory(model: GPTShape, plan: Plan, r: int, ranks_per_node: int = 0) -> tuple[int, dict]:
    """(predicted peak bytes on pipeline rank ``r``, its terms); ``memory`` is the fullest of
    the pipeline's end ranks."""
    p, v, b = plan.pp, plan.virtual, plan.micro_batch
    t, sp = plan.tp, plan.sequence_parallel
    e, n, h = model.bytes[3], b * model.seq, model.dim
    S = p * v
    counts = stage_layers(model.layers, S)
    per_layer = layer_activations(model, b, t, sp, plan.recompute)
    recompute_live = (layer_activations(model, b, t, sp, "none") - per_layer
                      if plan.recompute != "none" else 0)
    stages = list(range(r, S, p))
    first, last = 0 in stages, S - 1 in stages
    states = _states(model, plan, sum(counts[s] for s in stages), first, last)
    # on the host, the pages each tensor rounds up to (``host_slack``)
    host = ranks_per_node > 0
    block_slack = host_slack(_block_tensors(model, b, t, sp, plan.recompute)) if host else 0
    graph = {s: counts[s] * (per_layer + block_slack)
             + _edge_activations(model, b, t, sp, s == 0, s == S - 1)
             + (host_slack(_edge_tensors(model, b, t, sp, s == 0, s == S - 1)) if host else 0)
             for s in stages}
    # a stage without data parallelism runs plain (``pipeline.gpt``): no bucket keeps its
    # gradients, the optimizer's zero_grad drops them, and its backward makes them again
    plain = p > 1 and plan.dp == 1
    slack = [_state_slack(model, plan, counts[s], s == 0, s == S - 1, plain) if host
             else (0, 0, 0) for s in stages]
    grads = states["grads"] + sum(g for _, g, _ in slack) if plain else 0
    if p > 1:
        # the graphs in flight, and the hidden states the runner keeps (the stages' outputs,
        # for their backward and then in their sends, and the input gradients it sent), and
        # a plain stage's gradients from its first backward, at the moment of the step that
        # holds the most of them (``held``)
        message = e * (n // t if sp else n) * h
        price = [graph[s] for s in stages] + [message + (host_slack([message]) if host else 0)]
        if plain:
            price += [_states(model, plan, counts[s], s == 0, s == S - 1)["grads"] + g
                      for s, (_, g, _) in zip(stages, slack)]
        moments = _held_matrix(plan.schedule, p, plan.microbatches, v, r, plain)
        held_bytes = moments @ np.array(price, dtype=np.float64)
        at = int(held_bytes.argmax())
        acts = int(held_bytes[at])
        grads_then = int(moments[at, len(stages) + 1:] @ np.array(price[len(stages) + 1:],
                                                                   dtype=np.float64))
        acts -= grads_then
    else:
        acts = graph[0]
    backward = [e * n * model.vocab // t, e * n * h, e * n * h] if last else 3 * [e * n * h]
    transient = sum(backward)
    if last:
        transient = max(transient, 3 * e * n * model.vocab // t - e * n * model.vocab // t)
    if host:
        transient += host_slack(backward)
    live = (_block_tensors(model, b, t, sp, "none") if plan.recompute != "none" else [])
    recomputed = recompute_live + (host_slack(live) - block_slack if host and live else 0)
    if plan.recompute == "full":
        # a block is recomputed at the start of its backward, when the one gradient alive is
        # the one coming into it (a hidden state's), and sequence parallelism's gathered
        # copies (the incoming gradient's, the projection's output before its scatter); its
        # saved tensors then go as its backward makes gradients
        gathered = 2 * e * n * h if sp else 0
        transient = max(transient, recomputed + e * (n // t if sp else n) * h + gathered)
    else:
        # the attention core is recomputed in the middle of its block's backward
        transient += recomputed
    optimizer = 4 * (states["optimizer"] // max(model.bytes[2], 1))
    if host:
        states["params"] += sum(x for x, _, _ in slack)
        states["optimizer"] += sum(o for _, _, o in slack)
        if not plain:
            states["grads"] += sum(g for _, g, _ in slack)
    if ranks_per_node:
        full = _states(model, Plan(1, t, p, sp, plan.schedule, v, plan.microbatches, 0,
                                   plan.recompute, b), sum(counts[s] for s in stages),
                       first, last)
        states["scratch"] = states.get("scratch", 0) + scratch(model, plan, ranks_per_node,
                                                               full, r in (0, p - 1))
    if plain:
        # a plain stage's peak holds the gradients of its fullest moment, or all of them
        # through the optimizer's step
        states["grads"] = grads if grads + optimizer > grads_then + acts + transient \
            else grads_then
    total = sum(states.values()) + max(acts + transient, optimizer)
    return total, dict(states, activations=acts, transient=max(transient, optimizer - acts),
                       rank=r)


def memory(model: GPTShape, plan: Plan, ranks_per_node: int = 0) -> tuple[int, dict]:
    """(predicted peak bytes on the fullest rank, its terms). ``ranks_per_node`` > 0: the
    collectives run on host memory, so their node windows count (``scratch``). The fullest
    rank is the pipeline's first (the most in-flight micro-batches and the embedding) or its
    last (the head and the loss)."""
    return max((rank_memory(model, plan, r, ranks_per_node) for r in sorted({0, plan.pp - 1})),
               key=lambda found: found[0])
