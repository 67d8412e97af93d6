"""Tensor and sequence parallelism (Megatron-LM's layers) on the toolkit's collectives.

    from collectives.torch import tensor_parallel as tp
    tp.parallelize(model, mesh.comm("tp"), plan={"blocks.*.attn.qkv": "colwise:96",
                   "blocks.*.attn.proj": "rowwise:32", "blocks.*.mlp.fc1": "colwise",
                   "blocks.*.mlp.fc2": "rowwise", "embed": "vocab", "head": "colwise",
                   "blocks.*.norm*": "sequence", "norm": "sequence"})
    loss = tp.vocab_parallel_cross_entropy(model(ids), target, comm=mesh.comm("tp"))
    full = tp.full_state_dict(model, mesh.comm("tp"))     # full tensors for a checkpoint

Vocabulary. The *tp group* is the communicator the layers run on (size ``tp``, this rank's
index ``r``). A *shard* is this rank's contiguous block of a full weight along its *split
dimension*: block ``r`` of ``tp`` equal blocks. A *unit* is the smallest block a split may not
cut (a head's q, k and v rows of a fused projection); a size must be divisible by ``tp * unit``.
The *sequence dimension* (``seq_dim``, 1 for batch-first activations) is where sequence
parallelism splits the activations between the tensor-parallel regions.

The layers, each a pair of collectives (forward / backward) around a local matmul:

- ``ColumnParallelLinear``: the output features are split (weight rows, bias). Its input is
  copied into the region: identity forward / allreduce backward (with sequence parallelism:
  all-gather along the sequence forward / reduce-scatter backward). ``gather_output``
  all-gathers the output features (backward: this rank's slice).
- ``RowParallelLinear``: the input features are split (weight columns; the bias is replicated
  and added after the reduction). Its output leaves the region: allreduce forward / identity
  backward (with sequence parallelism: reduce-scatter along the sequence forward / all-gather
  backward).
- ``VocabParallelEmbedding``: the vocabulary is split (weight rows); ids outside this rank's
  rows look up zeros, then the partial embeddings are allreduced (reduce-scattered along the
  sequence with sequence parallelism).
- ``vocab_parallel_cross_entropy``: logits split over the vocabulary; two allreduces (the max,
  then the sum of exponentials packed with the target's logit), so no rank holds full logits.
- Sequence parallelism: between the regions every rank holds ``1/tp`` of the tokens, so a norm
  layer (or a row-parallel bias) sees only its tokens and its gradient is a partial sum. The
  toolkit allreduces those gradients over the tp group (a hook on each such parameter, run once
  per backward before the gradient is accumulated), so they stay identical on every rank.

``parallelize(module, comm, plan)`` converts a plain model in place: every module whose dotted
name matches a pattern (``fnmatch`` per name segment: ``*`` is one segment) is replaced by its
parallel layer, whose shard is sliced from the module's full weight (every rank must hold the
same full weights: the same seed, or a loaded checkpoint). Styles: ``colwise[:unit]``,
``rowwise[:unit]``, ``vocab``, ``sequence`` (a norm under sequence parallelism; any
``sequence`` entry turns sequence parallelism on for every layer of the plan), ``recompute``
(activation checkpointing of the module, ``collectives.torch.checkpoint``: ``"blocks.*"`` full,
``"blocks.*.attn.core"`` selective; its collectives run again in backward). A weight shared by
two layers (an output head tied to the embedding) stays shared when both split it the same way.
Before any other collective, the ranks agree (``agreement.agree``: one small allreduce of a
digest) on every planned layer's name, style and shape; a disagreement, a pattern that names no
module, a size that ``tp`` does not divide: a ``ValueError`` on every rank naming the layer and
the sizes.
"""
from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

import collectives as coll

from . import checkpoint
from .agreement import agree

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "rebind",
           "vocab_parallel_cross_entropy", "parallelize", "full_state_dict",
           "load_full_state_dict", "sharded_parameter_bytes", "copy_to_region",
           "reduce_from_region", "gather_along", "reduce_scatter_along", "STYLES", "Traffic",
           "traffic"]

STYLES = ("colwise", "rowwise", "vocab", "sequence", "recompute")


# --- the collectives along a dimension -------------------------------------------------------

class Traffic:
    """Bytes this rank sends in the layers' collectives, by kind, counted as a bandwidth-optimal
    algorithm sends them (nccl-tests' bus bytes): an allreduce of S bytes over n ranks
    2(n-1)/n * S, an all-gather of S bytes from each rank (n-1) * S, a reduce-scatter of S bytes
    (n-1)/n * S. A sequence-parallel all-gather plus reduce-scatter thus counts what the
    allreduce it replaces does."""

    __slots__ = ("allreduce", "allgather", "reduce_scatter", "calls")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        self.allreduce = self.allgather = self.reduce_scatter = self.calls = 0

    def total(self) -> int:
        """Bytes over every kind."""
        return self.allreduce + self.allgather + self.reduce_scatter

    def add(self, kind: str, x: torch.Tensor, n: int) -> None:
        """Count one call of ``kind`` on input ``x`` over ``n`` ranks."""
        nbytes = x.numel() * x.element_size()
        sent = {"allreduce": 2 * (n - 1) * nbytes // n, "allgather": (n - 1) * nbytes,
                "reduce_scatter": (n - 1) * nbytes // n}[kind]
        setattr(self, kind, getattr(self, kind) + sent)
        self.calls += 1


traffic = Traffic()  # the process's counters (the layers of every tp group add to them)


def _all_gather(x: torch.Tensor, dim: int, comm) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``."""
    if comm.Get_size() == 1:
        return x
    dim = dim % x.dim()
    n = comm.Get_size()
    traffic.add("allgather", x, n)
    y = x.movedim(dim, 0).contiguous()
    # every rank holds the same shape: its counts need no exchange of row counts
    y = coll.allgather(y, counts=(y.shape[0],) * n, comm=comm)
    return y.movedim(0, dim) if dim else y


def _reduce_scatter(x: torch.Tensor, dim: int, comm) -> torch.Tensor:
    """The sum over ranks of ``x``, this rank's block of ``tp`` along ``dim``."""
    n = comm.Get_size()
    if n == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % n:  # every rank of the group holds the same shape: all raise alike
        raise ValueError(f"reduce-scatter along dimension {dim}: its length {x.shape[dim]} "
                         f"(the sequence under sequence parallelism) is not divisible by the "
                         f"tensor-parallel size {n}")
    y = x.movedim(dim, 0).contiguous()
    traffic.add("reduce_scatter", y, n)
    out = coll.reduce_scatter(y, comm=comm)
    out = out.view(y.shape[0] // n, *y.shape[1:])
    return out.movedim(0, dim) if dim else out


def _slice(x: torch.Tensor, dim: int, comm) -> torch.Tensor:
    """This rank's block of ``tp`` along ``dim`` (no communication)."""
    n = comm.Get_size()
    if n == 1:
        return x
    return x.chunk(n, dim=dim)[comm.Get_rank()].contiguous()


def _all_reduce(x: torch.Tensor, comm) -> torch.Tensor:
    if comm.Get_size() == 1:
        return x
    traffic.add("allreduce", x, comm.Get_size())
    return coll.allreduce(x.contiguous(), comm=comm)


class _CopyToRegion(torch.autograd.Function):
    """Identity forward, allreduce backward (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromRegion(torch.autograd.Function):
    """Allreduce forward, identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlong(torch.autograd.Function):
    """All-gather along ``dim`` forward; backward: reduce-scatter (``reduce=True``, the
    sequence entering a column-parallel layer, whose gradient is a partial sum on each rank)
    or this rank's slice (the output features, whose gradient is whole on every rank)."""

    @staticmethod
    def forward(ctx, x, dim, comm, reduce):
        ctx.dim, ctx.comm, ctx.reduce = dim, comm, reduce
        return _all_gather(x, dim, comm)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            return _reduce_scatter(grad, ctx.dim, ctx.comm), None, None, None
        return _slice(grad, ctx.dim, ctx.comm), None, None, None


class _ReduceScatterAlong(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _reduce_scatter(x, dim, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.comm), None, None


class _SliceAlong(torch.autograd.Function):
    """This rank's slice along ``dim`` forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _slice(x, dim, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.comm), None, None


def copy_to_region(x, comm):
    """Enter a tensor-parallel region: identity forward, allreduce backward."""
    return _CopyToRegion.apply(x, comm)


def reduce_from_region(x, comm):
    """Leave a tensor-parallel region: allreduce forward, identity backward."""
    return _ReduceFromRegion.apply(x, comm)


def gather_along(x, dim, comm, reduce_backward=True):
    """All-gather along ``dim``; backward reduce-scatters (or slices, ``reduce_backward=False``)."""
    return _GatherAlong.apply(x, dim, comm, reduce_backward)


def reduce_scatter_along(x, dim, comm):
    """Reduce-scatter along ``dim``; backward all-gathers."""
    return _ReduceScatterAlong.apply(x, dim, comm)


def _sync_grad(param: nn.Parameter, comm) -> None:
    """Sum ``param``'s gradient over ``comm`` once per backward, before it is accumulated (a
    replicated parameter that sees only this rank's tokens under sequence parallelism). The
    hook reads the communicator from a holder on the parameter, which ``rebind`` repoints."""
    if comm.Get_size() == 1:
        return
    held = getattr(param, "_tp_grad_comm", None)
    if held is not None and held[0] is comm:
        return
    held = [comm]
    param.register_hook(lambda grad: _all_reduce(grad, held[0]))
    param._tp_grad_comm = held


def rebind(module: nn.Module, comm) -> None:
    """Point every tensor-parallel layer of ``module`` and every gradient hook that sequence
    parallelism put on its replicated parameters at ``comm``, which must have the size of the
    old group and this rank at the same index (the shards stay as they are: a survivors' group
    after a failure, ``collectives.elastic.mesh``); no communication."""
    layers = [m for m in module.modules() if getattr(m, "tp_split", None)]
    for m in layers:
        old = m.comm
        if (old.Get_size(), old.Get_rank()) != (comm.Get_size(), comm.Get_rank()):
            raise ValueError(f"rebind: the layer's group has {old.Get_size()} ranks and this "
                             f"rank at {old.Get_rank()}, the new one {comm.Get_size()} and "
                             f"{comm.Get_rank()}: the shards would not match")
    for m in layers:
        m.comm = comm
    for p in module.parameters():
        held = getattr(p, "_tp_grad_comm", None)
        if held is not None:
            held[0] = comm


def _check_split(name: str, what: str, size: int, tp: int, unit: int = 1) -> None:
    if size % (tp * unit):
        if unit > 1:
            raise ValueError(f"{name}: {what} {size} are {size / unit:g} blocks of {unit} (heads), "
                             f"which tensor-parallel size {tp} does not divide")
        raise ValueError(f"{name}: {what} {size} is not divisible by the tensor-parallel "
                         f"size {tp}")


# --- the layers -------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with the output features split over ``comm``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, comm,
                 gather_output: bool = False, sequence_parallel: bool = False, seq_dim: int = 1,
                 unit: int = 1, name: str = "ColumnParallelLinear", device=None, dtype=None):
        super().__init__()
        tp = comm.Get_size()
        _check_split(name, "out_features", out_features, tp, unit)
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.gather_output = comm, gather_output
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features // tp, **kw)) if bias else None
        self.tp_split = {"weight": 0, "bias": 0} if bias else {"weight": 0}
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # nn.Linear's, fan_in as the full's
        if self.bias is not None:
            bound = 1 / in_features ** 0.5
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x):
        if self.sequence_parallel:
            x = _GatherAlong.apply(x, self.seq_dim, self.comm, True)
        else:
            x = _CopyToRegion.apply(x, self.comm)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = _GatherAlong.apply(y, -1, self.comm, False)
        return y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features // self.comm.Get_size()} here), "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with the input features split over ``comm``; the bias is replicated."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, comm,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 seq_dim: int = 1, unit: int = 1, name: str = "RowParallelLinear", device=None,
                 dtype=None):
        super().__init__()
        tp = comm.Get_size()
        _check_split(name, "in_features", in_features, tp, unit)
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.input_is_parallel = comm, input_is_parallel
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.tp_split = {"weight": 1}
        bound = 1 / in_features ** 0.5
        nn.init.uniform_(self.weight, -bound, bound)  # nn.Linear's bound, from the full fan_in
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)
            if sequence_parallel:
                _sync_grad(self.bias, comm)

    def forward(self, x):
        if not self.input_is_parallel:
            x = _SliceAlong.apply(x, -1, self.comm)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = _ReduceScatterAlong.apply(y, self.seq_dim, self.comm)
        else:
            y = _ReduceFromRegion.apply(y, self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features} "
                f"({self.in_features // self.comm.Get_size()} here), "
                f"out_features={self.out_features}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary (weight rows) split over ``comm``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, comm,
                 sequence_parallel: bool = False, seq_dim: int = 1,
                 name: str = "VocabParallelEmbedding", device=None, dtype=None):
        super().__init__()
        tp = comm.Get_size()
        _check_split(name, "num_embeddings", num_embeddings, tp)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.comm, self.sequence_parallel, self.seq_dim = comm, sequence_parallel, seq_dim
        per = num_embeddings // tp
        self.start, self.stop = comm.Get_rank() * per, (comm.Get_rank() + 1) * per
        self.weight = nn.Parameter(torch.empty(per, embedding_dim, device=device, dtype=dtype))
        self.tp_split = {"weight": 0}
        nn.init.normal_(self.weight)

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return _ReduceScatterAlong.apply(y, self.seq_dim, self.comm)
        return _ReduceFromRegion.apply(y, self.comm)

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.start}, {self.stop}) "
                f"here, sequence_parallel={self.sequence_parallel}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-split logits; backward: softmax minus one-hot,
    this rank's columns only."""

    @staticmethod
    def forward(ctx, logits, target, comm):
        per = logits.shape[-1]
        start = comm.Get_rank() * per
        # 1. The max over the whole vocabulary, for a stable exponential.
        top = logits.detach().amax(dim=-1)
        if comm.Get_size() > 1:
            traffic.add("allreduce", top, comm.Get_size())
            coll.allreduce(top, op="max", out=top, comm=comm)
        shifted = logits.detach() - top.unsqueeze(-1)
        # 2. The sum of exponentials and the target's logit (zero on the ranks without it),
        #    summed in one allreduce.
        exp = shifted.exp()
        outside = (target < start) | (target >= start + per)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        both = torch.stack([exp.sum(dim=-1), picked])
        if comm.Get_size() > 1:
            traffic.add("allreduce", both, comm.Get_size())
            coll.allreduce(both, out=both, comm=comm)
        total, picked = both[0], both[1]
        exp.div_(total.unsqueeze(-1))  # now this rank's columns of the softmax
        ctx.save_for_backward(exp, local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        return g.mul_(grad.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits, target, comm, reduction: str = "mean"):
    """Cross-entropy of logits split over the vocabulary (last dimension) across ``comm``:
    equal to ``F.cross_entropy`` of the full logits, which no rank ever holds. ``reduction``:
    ``"mean"``, ``"sum"`` or ``"none"`` (a loss per token, shaped as ``target``)."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and "
                         f"target {tuple(target.shape)} differ before the vocabulary dimension")
    loss = _VocabParallelCrossEntropy.apply(logits, target, comm)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction {reduction!r}: expected 'mean', 'sum' or 'none'")


# --- converting a plain model -----------------------------------------------------------------

def _parse(style: str, pattern: str) -> tuple[str, int]:
    name, _, unit = str(style).partition(":")
    if name not in STYLES or (unit and (not unit.isdigit() or int(unit) < 1)) or \
            (unit and name not in ("colwise", "rowwise")):
        raise ValueError(f"plan entry {pattern!r}: style {style!r}; expected one of {STYLES}, "
                         f"colwise and rowwise optionally with ':unit' (a positive integer)")
    return name, int(unit or 1)


def _matches(pattern: str, name: str) -> bool:
    a, b = pattern.split("."), name.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(y, x) for x, y in zip(a, b))


def _resolve(module: nn.Module, plan: dict) -> list[tuple[str, nn.Module, str, int]]:
    """(name, module, style, unit) of every planned module, in ``named_modules`` order."""
    found, styles = [], {}
    named = [(n, m) for n, m in module.named_modules() if n]
    parsed = {p: _parse(s, p) for p, s in plan.items()}
    for name, m in named:
        hits = [p for p in plan if _matches(p, name)]
        if not hits:
            continue
        choice = {parsed[p] for p in hits}
        if len(choice) > 1:
            raise ValueError(f"{name} is matched by plan entries {hits} with different styles")
        style, unit = choice.pop()
        want = {"colwise": nn.Linear, "rowwise": nn.Linear, "vocab": nn.Embedding}.get(style)
        if want is not None and type(m) is not want:
            raise ValueError(f"{name}: style {style!r} converts a {want.__name__}, this is a "
                             f"{type(m).__name__}")
        if style == "recompute":
            pass
        elif style == "sequence" and not list(m.parameters(recurse=False)):
            raise ValueError(f"{name}: style 'sequence' marks a norm layer, this "
                             f"{type(m).__name__} has no parameters of its own")
        found.append((name, m, style, unit))
        for p in hits:
            styles[p] = True
    empty = [p for p in plan if p not in styles]
    if empty:
        raise ValueError(f"plan entries {empty} name no module of the "
                         f"{type(module).__name__}")
    return found


def _layers(found) -> list[tuple[str, str]]:
    """The plan's layers as ``agree``'s rows: (name, "name style weight shape")."""
    out = []
    for name, m, style, unit in found:
        shape = tuple(m.weight.shape) if hasattr(m, "weight") and m.weight is not None else ()
        out.append((name, f"{name} {style}{':' + str(unit) if unit > 1 else ''} weight {shape}"))
    return out


def _set(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def _shard(full: torch.Tensor, dim: int, comm) -> torch.Tensor:
    return full.detach().chunk(comm.Get_size(), dim=dim)[comm.Get_rank()].clone()


def parallelize(module: nn.Module, comm, plan: dict, *, seq_dim: int = 1) -> nn.Module:
    """Convert ``module`` in place by ``plan`` ({pattern: style}) over the tp group ``comm``;
    returns ``module``. Collective over ``comm`` (one small allreduce)."""
    try:
        found, problem = _resolve(module, plan), None
    except ValueError as e:  # raised after the agreement, so every rank raises alike
        found, problem = [], str(e)
    agree(comm, "parallelize", {"layer": _layers(found)}, problem,
          hint=f"the {comm.Get_size()} tensor-parallel ranks must plan the same layers")
    if problem:
        raise ValueError(problem)
    tp = comm.Get_size()
    sequence = any(style == "sequence" for _, _, style, _ in found)
    shared = {}  # id of a full tensor -> its shard parameter (a tied weight stays one)

    def take(full, dim):
        if id(full) not in shared:
            shared[id(full)] = nn.Parameter(_shard(full, dim, comm),
                                            requires_grad=full.requires_grad)
        return shared[id(full)]

    splits = {}  # id of a full weight -> (layer, split dimension): a tied weight splits alike
    for name, m, style, unit in found:  # every check first, so no layer is half converted
        if style in ("colwise", "rowwise", "vocab"):
            dim = 1 if style == "rowwise" else 0
            first, was = splits.setdefault(id(m.weight), (name, dim))
            if was != dim:
                raise ValueError(f"{name}: its weight is tied to {first}'s, which splits it "
                                 f"along dimension {was}, this layer along {dim}")
        if style == "colwise":
            _check_split(name, "out_features", m.out_features, tp, unit)
        elif style == "rowwise":
            _check_split(name, "in_features", m.in_features, tp, unit)
        elif style == "vocab":
            _check_split(name, "num_embeddings", m.num_embeddings, tp)
            if m.padding_idx is not None or m.max_norm is not None or m.sparse:
                raise ValueError(f"{name}: VocabParallelEmbedding supports no padding_idx, "
                                 f"max_norm or sparse")
    for name, m, style, unit in found:
        kw = {"comm": comm, "sequence_parallel": sequence, "seq_dim": seq_dim, "name": name}
        if style == "recompute":
            continue
        if style == "sequence":
            if sequence:
                for p in m.parameters(recurse=False):
                    _sync_grad(p, comm)
            continue
        with torch.device("meta"):  # the shards come from the full weights below
            if style == "colwise":
                new = ColumnParallelLinear(m.in_features, m.out_features, m.bias is not None,
                                           unit=unit, dtype=m.weight.dtype, **kw)
            elif style == "rowwise":
                new = RowParallelLinear(m.in_features, m.out_features, m.bias is not None,
                                        unit=unit, dtype=m.weight.dtype, **kw)
            else:
                new = VocabParallelEmbedding(m.num_embeddings, m.embedding_dim,
                                             dtype=m.weight.dtype, **kw)
        new.weight = take(m.weight, new.tp_split["weight"])
        if getattr(m, "bias", None) is not None:
            new.bias = (take(m.bias, 0) if "bias" in new.tp_split
                        else nn.Parameter(m.bias.detach().clone()))
            if style == "rowwise" and sequence:
                _sync_grad(new.bias, comm)
        new.to(m.weight.device)
        _set(module, name, new)
    marked = [name for name, _, style, _ in found if style == "recompute"]
    if marked:  # after the conversion: the marks go on the modules that stay
        checkpoint.recompute(module, marked)
    return module


def _splits(module: nn.Module) -> dict[str, int]:
    """Every sharded tensor's state_dict key and split dimension."""
    out = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for pname, dim in getattr(m, "tp_split", {}).items():
            out[f"{mname}.{pname}" if mname else pname] = dim
    return out


def full_state_dict(module: nn.Module, comm, state_dict: dict | None = None) -> dict:
    """Full tensors (keys as in ``module.state_dict()``) on every rank of ``comm``: each shard
    all-gathered along its split dimension, the replicated tensors copied. ``state_dict``: a
    state of ``module`` gathered elsewhere first (``ShardedDataParallel.full_state_dict()``).
    Collective over ``comm``."""
    splits = _splits(module)
    state = module.state_dict() if state_dict is None else state_dict
    return {k: (_all_gather(v.detach(), splits[k], comm).contiguous() if k in splits
                else v.detach().clone()) for k, v in state.items()}


def load_full_state_dict(module: nn.Module, state: dict, comm) -> None:
    """Load full tensors (as ``full_state_dict`` returns, or a plain model's ``state_dict()``)
    into ``module``'s shards and replicated tensors; no communication."""
    splits = _splits(module)
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"load_full_state_dict: missing {missing}")
    with torch.no_grad():
        for k, t in own.items():
            src = state[k]
            if k in splits:
                src = src.chunk(comm.Get_size(), dim=splits[k])[comm.Get_rank()]
            if tuple(src.shape) != tuple(t.shape):
                raise ValueError(f"load_full_state_dict: {k} is {tuple(state[k].shape)}, this "
                                 f"rank's part {tuple(t.shape)} at tensor-parallel size "
                                 f"{comm.Get_size()}")
            t.copy_(src)


def sharded_parameter_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of this rank's shards, bytes of the same parameters unsplit): the tensor-parallel
    layers' parameter memory; a tied weight counts once."""
    seen, here, full = set(), 0, 0
    for m in module.modules():
        split = getattr(m, "tp_split", None)
        if not split:
            continue
        for pname in split:
            p = getattr(m, pname)
            if id(p) in seen:
                continue
            seen.add(id(p))
            here += p.numel() * p.element_size()
            full += p.numel() * p.element_size() * m.comm.Get_size()
    return here, full
