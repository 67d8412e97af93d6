"""What DDP's reducer and ZeRO share through a backward: readiness, launch order, the end.

Both wrappers cut the parameters into *groups* that share one flat buffer (DDP's buckets,
ZeRO's units) and reduce a group with one non-blocking collective as soon as backward has
produced every gradient in it. The rules are the same for both, and live here once:

1. *Readiness.* ``hook_parameters`` registers a ``register_post_accumulate_grad_hook`` per
   parameter that calls a method of its owner through a weak reference, so the module's
   parameters never keep a dropped wrapper alive (``hooks_removed_with`` removes them when the
   owner dies). The owner tells its ``Launcher`` that a member of group k is ready.
2. *Launch order.* ``Launcher.ready(k)`` answers which groups to launch now: a group whose last
   member is ready starts once every group before it in launch order has started, so every
   rank starts the same collectives in the same order (non-blocking collectives match by
   order). ``rest()`` gives the groups not started yet (the end of backward starts them with
   what they hold).
3. *End of backward.* ``Launcher.begin`` queues the owner's end-of-backward method on the
   autograd engine once per backward (the first gradient of a backward calls it); there the
   owner waits for the outstanding collectives in launch order (``started`` / ``drain``), so a
   collective's result is used only after every one started before it completed.
"""
from __future__ import annotations

import functools
import weakref

import torch

__all__ = ["Launcher", "hook_parameters", "hooks_removed_with", "call_weak"]


def call_weak(ref, method: str, *args):
    """``ref()``'s ``method(*args)``, if the object still lives (autograd and module hooks)."""
    owner = ref()
    if owner is not None:
        getattr(owner, method)(*args)


def _on_grad(ref, method: str, index: int, param):
    call_weak(ref, method, index)


def hook_parameters(params, ref, method: str) -> list:
    """A post-accumulate-grad hook on each of ``params`` calling ``ref()``'s
    ``method(index)`` (``index``: the parameter's position in ``params``); the handles."""
    return [p.register_post_accumulate_grad_hook(functools.partial(_on_grad, ref, method, i))
            for i, p in enumerate(params)]


def _remove(handles) -> None:
    for h in handles:
        h.remove()


def hooks_removed_with(owner, handles) -> None:
    """Remove ``handles`` (a list the owner may extend) when ``owner`` is collected."""
    weakref.finalize(owner, _remove, handles)


class Launcher:
    """One backward's progress over groups in launch order (see the module doc).

    ``sizes[k]``: how many members group k waits for. Pure bookkeeping: the owner launches
    and completes; this says which and when.
    """

    __slots__ = ("sizes", "pending", "next", "active", "inflight")

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self.active = False   # inside a backward whose end callback is queued
        self.inflight: list = []  # (group, work) started and not yet completed, oldest first
        self.reset()

    def reset(self) -> None:
        """Forget this backward's readiness and launches (a new one, or one that raised)."""
        self.pending = list(self.sizes)
        self.next = 0

    def begin(self, ref, method: str) -> bool:
        """At a backward's first gradient: queue ``ref()``'s ``method()`` to run when the
        autograd engine finishes this backward; False (nothing done) when already queued."""
        if self.active:
            return False
        self.active = True
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(call_weak, ref, method))
        return True

    def end(self) -> None:
        """The end callback runs: the next gradient begins a new backward."""
        self.active = False

    def ready(self, k: int) -> range:
        """One member of group ``k`` is ready: the groups to launch now, in order."""
        self.pending[k] -= 1
        start = self.next
        while self.next < len(self.pending) and self.pending[self.next] <= 0:
            self.next += 1
        return range(start, self.next)

    def complete(self, k: int) -> bool:
        """Whether every member of group ``k`` is ready."""
        return self.pending[k] <= 0

    def rest(self) -> range:
        """Every group not launched yet, in order (the end of backward launches them)."""
        start, self.next = self.next, len(self.sizes)
        return range(start, self.next)

    def started(self, k: int, work) -> None:
        """Group ``k``'s collective is in flight as ``work``."""
        self.inflight.append((k, work))

    def drain(self, complete, keep: int = 0) -> None:
        """``complete(k, work)`` for the oldest in-flight groups until ``keep`` remain."""
        while len(self.inflight) > keep:
            k, work = self.inflight.pop(0)
            complete(k, work)

    def discard(self) -> None:
        """Forget the in-flight works (a backward that raised: they are not waited here)."""
        self.inflight = []
