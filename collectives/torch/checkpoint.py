"""Activation checkpointing (recompute) of a model's own layers, and counting what autograd saves.

    from collectives.torch import checkpoint
    checkpoint.recompute(model, ["blocks.*"])              # full: each block keeps its input only
    checkpoint.recompute(model, ["blocks.*.attn.core"])    # selective: the attention core
    checkpoint.recompute(model, checkpoint.GPT_POLICIES["selective"])
    nbytes = checkpoint.saved_bytes(lambda: block(x))      # what autograd keeps for backward

Vocabulary. A *recomputed module* runs its forward under ``torch.utils.checkpoint``
(non-reentrant): autograd keeps the module's inputs and nothing it computes inside; in backward,
the first saved tensor the graph asks for runs the forward again (the *recompute*) and hands
autograd what it would have saved. *Full* recompute marks whole blocks (a block then holds its
input, ``b s h`` elements, for backward); *selective* marks the attention core
(``softmax(q k^T) v``, whose saved scores grow with the square of the sequence), so the
projections' and the MLP's saved tensors stay and only the core is computed twice.

Modules are named as ``tensor_parallel.parallelize`` names them (dotted names, ``fnmatch`` per
segment, ``*`` one segment); marking replaces the module's ``forward`` on the instance, so names,
state dicts and hooks are untouched. The recompute is an ordinary forward: tensor-parallel
collectives inside it run again on every rank at the same point of the backward (the same order
on every rank); ``ShardedDataParallel`` stage 3 reads ``recomputing()`` and keeps a layer it
gathers for the recompute until that layer's gradients are launched (the regather), instead of
freeing it after the recomputed forward.

``saved_bytes(fn)`` runs ``fn`` under saved-tensor hooks and counts the bytes autograd keeps:
every saved tensor's storage once, parameters and views of them excluded, since the model holds
them anyway; a recomputed module's inputs, which the checkpoint keeps outside autograd,
included. It is the profiling pass the planner's activation formulas are checked against.
"""
from __future__ import annotations

import contextlib
import fnmatch
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

__all__ = ["recompute", "recomputing", "recomputed", "saved_bytes", "POLICIES", "GPT_POLICIES"]

POLICIES = ("none", "selective", "full")

# The GPT-shaped model's (examples/train_gpt.py, collectives.torch.pipeline.gpt) modules to mark
# for each policy.
GPT_POLICIES = {"none": (), "selective": ("blocks.*.attn.core",), "full": ("blocks.*",)}

_depth = 0  # recomputations running (a recompute may nest inside another)
_counting = None  # saved_bytes's storages while it runs


def recomputing() -> bool:
    """Whether a recomputed module's forward is being run again inside backward now."""
    return _depth > 0


class _Recomputing:
    """Entered around each recompute; reusable, since one checkpointed call recomputes once per
    backward that needs it (a split backward's B and W are two)."""

    __slots__ = ()

    def __enter__(self):
        global _depth
        _depth += 1

    def __exit__(self, *exc):
        global _depth
        _depth -= 1


_RECOMPUTING = _Recomputing()


def _contexts():
    return contextlib.nullcontext(), _RECOMPUTING


class _Checkpointed:
    """The ``forward`` of a recomputed module: its class's forward under non-reentrant
    checkpointing (a plain call where no gradient is being recorded). It holds the module
    weakly: the module holds it (an instance attribute), and a strong reference back would
    make a cycle that keeps a dropped module's parameters until the cyclic collector runs."""

    __slots__ = ("module", "function")

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)
        self.function = type(module).forward

    def __call__(self, *args, **kwargs):
        forward = self.function.__get__(self.module())
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if _counting is not None:  # what the checkpoint keeps: the inputs, outside autograd
            for t in args:
                if isinstance(t, torch.Tensor):
                    _count(_counting, t)
        return _torch_checkpoint(forward, *args, use_reentrant=False,
                                 context_fn=_contexts, **kwargs)


def _matches(pattern: str, name: str) -> bool:
    a, b = pattern.split("."), name.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(y, x) for x, y in zip(a, b))


def recompute(module: nn.Module, patterns) -> list[str]:
    """Mark every submodule of ``module`` whose dotted name matches one of ``patterns`` for
    recompute, in place; returns the marked names. A pattern that names no module is a
    ``ValueError``; a module marked already stays marked once."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    named = [(n, m) for n, m in module.named_modules() if n]
    marked, used = [], set()
    for name, m in named:
        hits = [p for p in patterns if _matches(p, name)]
        if not hits:
            continue
        used.update(hits)
        marked.append(name)
        if not isinstance(m.__dict__.get("forward"), _Checkpointed):
            # the class's forward bound to this instance; the instance attribute shadows it
            m.forward = _Checkpointed(m)
    empty = [p for p in patterns if p not in used]
    if empty:
        raise ValueError(f"recompute patterns {empty} name no module of the "
                         f"{type(module).__name__}")
    return marked


def recomputed(module: nn.Module) -> list[str]:
    """The names of ``module``'s submodules marked for recompute."""
    return [n for n, m in module.named_modules()
            if isinstance(m.__dict__.get("forward"), _Checkpointed)]


def saved_bytes(fn) -> tuple[int, object]:
    """(bytes autograd saves for backward while ``fn()`` runs, ``fn()``'s result): each saved
    storage counted once, parameters excluded, recomputed modules' inputs included."""
    global _counting
    seen: dict = {}

    def pack(t):
        _count(seen, t)
        return t

    outer, _counting = _counting, seen
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
    finally:
        _counting = outer
    return sum(seen.values()), out


def _count(seen: dict, t: torch.Tensor) -> None:
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
        return  # a parameter, or a view of one (a linear layer saves weight.t())
    try:
        s = t.untyped_storage()
        seen[(s.data_ptr(), str(t.device))] = s.nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor without storage
        seen[id(t)] = t.numel() * t.element_size()
