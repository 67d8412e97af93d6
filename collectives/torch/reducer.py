"""DDP's reducer: gradient buckets, from the first gradient of a backward to the write-back.

``DistributedDataParallel`` holds one ``Reducer`` (``model.reducer``); it works the way torch's
Reducer does, over the toolkit's collectives:

1. *Buckets.* Parameters are packed into flat buffers (``collectives.torch.buckets``): in
   reverse order at first, a small first bucket, at most ``bucket_cap_mb`` each. Each
   parameter's ``.grad`` is a view into its bucket (``gradient_as_bucket_view``), so autograd
   accumulates straight into the buffer that is reduced: no copies. On one node the buckets
   are registered buffers (``collectives.torch.memory``), which the core's dispatch reduces
   one-pass; the reducer names no algorithm, it hands each bucket to the hook.
2. *Readiness.* A ``register_post_accumulate_grad_hook`` per parameter (holding a weak
   reference to the reducer) marks it ready; a parameter that got no gradient takes part at
   the end of backward with what it has, or zeros (``find_unused_parameters``). Readiness,
   launch order and the end-of-backward callback are ZeRO's too (``collectives.torch.backward``).
3. *Launch.* When a bucket's last gradient lands the comm hook starts on it while backward
   goes on (default ``allreduce_hook``: a non-blocking allreduce with ``op="avg"``, the mean
   computed once, in the core). Buckets start strictly in bucket order -- a bucket complete
   early waits for the ones before it -- so every rank starts the same collectives in the same
   order.
4. *End of backward.* A callback queued on the autograd engine waits for every bucket in
   order, copies each hook's result into its bucket, and rescales where ``join()`` says so.
5. *Write-back.* Gradients that are not bucket views are copied out; a parameter unused on
   every rank gets ``grad=None`` back, as in one process. With an optimizer in backward
   (``DistributedDataParallel.optimizer_in_backward``) each bucket's parameters are stepped
   right after its write-back, while the buckets after it are still on the wire.
6. *Rebuild.* After the first synchronized backward the buckets are rebuilt once, in the
   order gradients actually became ready (rank 0's order, broadcast, so the same on every rank).

``static_graph=True`` fixes the buckets and how many times each parameter's gradient
accumulates after the first iteration, so activation checkpointing (reentrant or not) and
parameters used twice train correctly; ``BackwardStart`` puts the end-of-backward callback on
the outer backward.
"""
from __future__ import annotations

import functools
import time
import weakref

import torch

from collectives import timeline, watchdog

from . import functional
from .backward import Launcher, hook_parameters, hooks_removed_with
from .buckets import Bucket, GradBucket, assign
from .hooks import DefaultState, allreduce_hook
from .memory import flat_zeros

__all__ = ["CommStats", "BackwardStart", "through_backward_start", "Reducer"]


class CommStats:
    """Gradient communication of one DDP: bytes handed to collectives and the time exposed.

    Per synchronized backward, the *span* runs from the first bucket's launch to the moment
    every bucket is reduced; the *exposed* part is what remains after backward's computation
    ended (the end-of-backward callback's wait). ``hidden_fraction()`` = 1 - exposed / span.
    """

    __slots__ = ("steps", "wire_bytes", "span_s", "exposed_s", "last_span_s",
                 "last_exposed_s", "last_start")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        self.steps = 0
        self.wire_bytes = 0
        self.span_s = self.exposed_s = 0.0
        self.last_span_s = self.last_exposed_s = 0.0
        self.last_start = 0.0   # time.perf_counter() at the last span's first launch

    def hidden_fraction(self) -> float:
        """The fraction of the communication span that overlapped backward (1.0 if none)."""
        return 1.0 - self.exposed_s / self.span_s if self.span_s > 0 else 1.0

    def __repr__(self):
        return (f"CommStats(steps={self.steps}, wire_bytes={self.wire_bytes}, "
                f"span_s={self.span_s:.4f}, exposed_s={self.exposed_s:.4f}, "
                f"hidden={self.hidden_fraction():.2f})")


# -- autograd glue (weak references to the reducer only) ---------------------------------------
class BackwardStart(torch.autograd.Function):
    """Identity on the forward's outputs whose backward runs first in the *outer* backward.

    With reentrant activation checkpointing a gradient hook may fire inside a nested backward,
    whose end callback would come too early; queueing the reducer's callback from here puts it
    on the outer backward, the one that ends last (torch's ``_DDPSink``).
    """

    @staticmethod
    def forward(ctx, ref, *tensors):
        ctx.ref = ref
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        reducer = ctx.ref()
        if reducer is not None:
            reducer.start_backward()
        return (None, *grads)


def through_backward_start(ref, out):
    """``out`` with its tensors that need gradients passed through ``BackwardStart``."""
    if isinstance(out, torch.Tensor):
        return BackwardStart.apply(ref, out)[0] if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        picks = [k for k, t in enumerate(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not picks:
            return out
        passed = BackwardStart.apply(ref, *(out[k] for k in picks))
        items = list(out)
        for k, t in zip(picks, passed):
            items[k] = t
        return type(out)(items) if isinstance(out, list) else tuple(items)
    return out


def _bucket_done(index: int, t0: float, fut):
    timeline.span_event(f"bucket {index}", "bucket", t0, timeline.now(), {"bucket": index})
    return fut.value()


def _last_occurrences(seq) -> list:
    """Each distinct item of ``seq`` once, ordered by where it occurs last."""
    last = {x: k for k, x in enumerate(seq)}
    return sorted(last, key=last.get)


class Reducer:
    """The buckets of one DDP and their life through each backward (see the module doc)."""

    def __init__(self, params, names, comm, algorithm: str, bucket_cap_mb,
                 registered_on, find_unused_parameters: bool, gradient_as_bucket_view: bool,
                 static_graph: bool):
        self.params, self.names = params, names
        self.comm, self.size, self.rank = comm, comm.Get_size(), comm.Get_rank()
        self.algorithm = algorithm
        self.cap_bytes = max(1, int(bucket_cap_mb * (1 << 20)))
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.stats = CommStats()
        self.registered_on = registered_on   # the communicator buckets are registered on
        self.require_sync = True     # False inside no_sync()
        self.rescale = 1.0           # join(): the hook's average times this is the wanted one
        self.rebuild_pending = True
        self.order: list[int] = []   # indices in the order gradients became ready
        self.used = bytearray(len(params))   # got a gradient since the last sync
        self.none_before: list[int] = []     # unused here and grad was None
        # static_graph: gradient accumulations per parameter in one backward (None until the
        # first synchronized backward has counted them), and the order of this one's.
        self.expected = None
        self.static_order: list[int] = []
        self.t_backward = 0.0
        self.optimizer = None   # stepped bucket by bucket at the end of backward, if set
        self.build_buckets(None)
        self.ref = weakref.ref(self)
        self.handles = hook_parameters(params, self.ref, "grad_ready")
        hooks_removed_with(self, self.handles)
        self.set_hook(allreduce_hook, None)
        self.reset_iteration()

    # -- the hook -----------------------------------------------------------------------------
    def set_hook(self, hook, state) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (state None: a ``DefaultState``)."""
        self.hook = hook
        self.state = DefaultState(self.comm, self.algorithm) if state is None else state

    # -- buckets ------------------------------------------------------------------------------
    def groups(self, order) -> list[list[int]]:
        """The parameter indices of each bucket for ``order`` (None: reverse order)."""
        params = self.params
        return assign([p.numel() * p.element_size() for p in params],
                      [(p.dtype, p.device) for p in params], self.cap_bytes, order)

    def build_buckets(self, order) -> None:
        """(Re)make the buckets for ``order``; gradients so far move into the new buffers."""
        params = self.params
        alloc = functools.partial(flat_zeros, comm=self.comm) \
            if self.registered_on is not None else None
        if alloc is not None and getattr(self, "buckets", None):
            # Registered windows are pooled once released on every rank, and reused by the
            # next buffers that fit: the gradients wait in plain copies while the old buckets
            # go, so that the new ones take their windows instead of mapping a second set
            # (which would stay resident in the pool).
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad = p.grad.clone()
            for b in self.buckets:
                b.release()
            self.buckets = self.slots = None
        buckets = [Bucket(k, members, params, alloc)
                   for k, members in enumerate(self.groups(order))]
        self.launcher = Launcher(len(b.members) for b in buckets)
        slots = [None] * len(params)
        for b in buckets:
            for pos, i in enumerate(b.members):
                slots[i] = (b, pos)
        with torch.no_grad():
            for i, p in enumerate(params):
                b, pos = slots[i]
                g = p.grad
                if g is not None:
                    b.views[pos].copy_(g)
                    if self.gradient_as_bucket_view:
                        p.grad = b.views[pos]
        self.buckets, self.slots = buckets, slots

    def rebuild(self, joined: bool = False) -> None:
        """Once, after the first synchronized backward: buckets in the order grads were ready
        (rank 0's; a rank standing in under ``join()`` has no order of its own)."""
        self.rebuild_pending = False
        n = len(self.params)
        mine = self.order if len(self.order) == n and not joined else range(n - 1, -1, -1)
        order = torch.tensor(mine, dtype=torch.int64)
        self.order = []
        functional.broadcast(order, 0, comm=self.comm)
        order = order.tolist()
        if self.groups(order) != [b.members for b in self.buckets]:
            self.build_buckets(order)

    # -- readiness ----------------------------------------------------------------------------
    def reset_iteration(self) -> None:
        """Forget this backward's progress (a new one, or one that raised)."""
        self.launcher.end()
        self.launcher.reset()
        self.launcher.discard()
        self.ready = bytearray(len(self.params))
        self.calls = [0] * len(self.params)
        self.static_order = []
        self.t_first = None
        self.t_reduced = None

    def start_backward(self) -> None:
        """Queue the end-of-backward callback on the backward that runs now."""
        if self.launcher.active:
            return
        if timeline.on:
            self.t_backward = timeline.now()
        self.launcher.begin(self.ref, "end_backward")

    @property
    def in_backward(self) -> bool:
        """Inside a backward whose end-of-backward callback has not run."""
        return self.launcher.active

    def grad_ready(self, index: int) -> None:
        """The post-accumulate-grad hook of parameter ``index``."""
        self.start_backward()
        p = self.params[index]
        b, pos = self.slots[index]
        view = b.views[pos]
        sync = self.require_sync
        complete = True
        if sync and self.static_graph:
            self.calls[index] += 1
            calls = self.calls[index]
            if self.expected is None:
                self.static_order.append(index)
                complete = False   # the first backward launches everything at its end
            elif calls > self.expected[index]:
                raise RuntimeError(
                    f"parameter {self.names[index]!r} got a gradient {calls} times in one "
                    f"backward, {self.expected[index]} in the first; static_graph=True needs "
                    f"the same graph every iteration")
            else:
                complete = calls == self.expected[index]
        elif sync and self.ready[index]:
            raise RuntimeError(f"parameter {self.names[index]!r} got a gradient twice in one "
                               f"backward (activation checkpointing, a parameter used twice "
                               f"or a reentrant backward); pass static_graph=True to "
                               f"DistributedDataParallel if the graph is the same every "
                               f"iteration")
        self.used[index] = 1
        if self.gradient_as_bucket_view:
            if p.grad is not view:  # set_to_none zero_grad, or a grad the user replaced
                view.copy_(p.grad)
                p.grad = view
        elif sync:
            view.copy_(p.grad)
        if sync and complete:
            self.mark_ready(index, b)
            functional.progress()  # without a progress thread, this is when bytes move

    def mark_ready(self, index: int, b: Bucket) -> None:
        self.ready[index] = 1
        if self.rebuild_pending:
            self.order.append(index)
        now = self.launcher.ready(b.index)
        if timeline.on and self.launcher.complete(b.index):
            timeline.instant(f"bucket {b.index} ready", "bucket", {"bucket": b.index})
        for k in now:
            self.launch(self.buckets[k])

    def mark_unused(self, index: int) -> None:
        """A parameter without a gradient this backward takes part with what it has (or 0)."""
        p = self.params[index]
        b, pos = self.slots[index]
        view = b.views[pos]
        g = p.grad
        if g is None:
            view.zero_()
            self.none_before.append(index)
        elif g is not view:
            view.copy_(g)
            if self.gradient_as_bucket_view:
                p.grad = view
        self.mark_ready(index, b)

    # -- launch -------------------------------------------------------------------------------
    def grad_bucket(self, b: Bucket, flat=None) -> GradBucket:
        """What the hook sees of ``b`` (``flat``: a joined rank's stand-in buffer)."""
        params = [self.params[i] for i in b.members]
        return GradBucket(b.index, b.flat if flat is None else flat, params,
                          b.index == len(self.buckets) - 1, joined=flat is not None)

    def launch(self, b: Bucket) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        names = [self.names[i] for i in b.members]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        # A collective that hangs is reported by the watchdog with its bucket and parameters.
        with watchdog.label(f"DDP bucket {b.index} of {len(self.buckets)}: {shown}"):
            fut = self.hook(self.state, self.grad_bucket(b))
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future and then()'s
            raise TypeError(f"comm hook {getattr(self.hook, '__name__', self.hook)!r} "
                            f"returned {type(fut).__name__}, expected a torch.futures.Future")
        if timeline.on:
            t0 = timeline.now()
            timeline.instant(f"bucket {b.index} started", "bucket",
                             {"bucket": b.index, "bytes": b.nbytes,
                              "parameters": len(b.members)})
            fut = fut.then(functools.partial(_bucket_done, b.index, t0))
        self.launcher.started(b.index, fut)

    # -- end of backward ----------------------------------------------------------------------
    def end_backward(self) -> None:
        """The end-of-backward callback: finish every bucket, in order, then tidy up."""
        self.launcher.end()
        if timeline.on:
            timeline.span_event("backward", "phase", self.t_backward, timeline.now(),
                                {"sync": self.require_sync})
        if not self.require_sync:
            return
        try:
            t_end = time.perf_counter()
            if self.static_graph and self.expected is None:
                self.expected = list(self.calls)
                for i in _last_occurrences(self.static_order):
                    self.mark_ready(i, self.slots[i][0])
            missing = [i for i, ready in enumerate(self.ready) if not ready]
            if missing and not self.find_unused_parameters and not self.static_graph:
                names = ", ".join(repr(self.names[i]) for i in missing[:4])
                raise RuntimeError(
                    f"rank {self.rank}: {len(missing)} of {len(self.params)} parameters got "
                    f"no gradient in this backward ({names}{', ...' if len(missing) > 4 else ''}"
                    f"); pass find_unused_parameters=True if parameters may not take part in "
                    f"the loss, or static_graph=True with reentrant activation checkpointing")
            for i in missing:
                self.mark_unused(i)
            used = None
            if self.find_unused_parameters:
                # Every rank takes part: which parameters were used anywhere since the last sync.
                used = torch.frombuffer(self.used, dtype=torch.uint8).to(torch.int32)
                functional.all_reduce(used, "max", comm=self.comm)
            shares = self.optimizer_shares() if self.optimizer is not None else None
            self.launcher.drain(functools.partial(self.finish_bucket, used, shares))
            self.account(t_end, self.t_reduced)
            if self.rebuild_pending:
                self.rebuild()
        finally:
            self.used = bytearray(len(self.params))
            self.none_before = []
            self.reset_iteration()

    def finish_bucket(self, used, shares, k: int, fut) -> None:
        """Bucket ``k``'s hook is done: its average into place, rescaled (``join()``: the hook
        averaged over ranks sending zeros), written back, and its share of the optimizer
        stepped (``shares``: ``optimizer_shares()``, or None)."""
        b = self.buckets[k]
        self.into_place(k, fut)
        self.t_reduced = time.perf_counter()
        if self.rescale != 1.0:
            b.flat.mul_(self.rescale)
        self.write_back(b, used)
        if shares is not None and any(shares[k]):
            self.step_share(shares[k])

    def into_place(self, k: int, fut) -> None:
        """Wait for bucket ``k``'s hook and copy its result into the bucket if elsewhere."""
        b = self.buckets[k]
        value = functional.wait_future(fut)
        if value is not b.flat:
            if not isinstance(value, torch.Tensor) or value.numel() != b.flat.numel():
                raise TypeError(f"comm hook result for bucket {b.index}: expected a "
                                f"tensor of {b.flat.numel()} elements, got "
                                f"{getattr(value, 'shape', type(value).__name__)}")
            if value.data_ptr() != b.flat.data_ptr():
                b.flat.copy_(value.view(-1))

    def write_back(self, b: Bucket, used) -> None:
        """Bucket ``b``'s gradients out where they are not views; ``None`` back where a
        parameter was unused on every rank (``used``: the agreed flags, or None)."""
        with torch.no_grad():
            if not self.gradient_as_bucket_view:
                for pos, i in enumerate(b.members):
                    p = self.params[i]
                    if p.grad is None:
                        p.grad = b.views[pos].clone()
                    else:
                        p.grad.copy_(b.views[pos])
            for i in self.none_before:
                if self.slots[i][0] is not b:
                    continue
                p = self.params[i]
                if used is not None and not used[i]:
                    p.grad = None  # unused on every rank: as in one process
                elif p.grad is None:
                    b, pos = self.slots[i]
                    p.grad = b.views[pos] if self.gradient_as_bucket_view \
                        else b.views[pos].clone()

    # -- optimizer in backward -----------------------------------------------------------------
    def set_optimizer(self, optimizer) -> None:
        """Step ``optimizer`` bucket by bucket at the end of each synchronized backward (None:
        never); every parameter it holds must be one of this reducer's."""
        if optimizer is not None:
            mine = {id(p) for p in self.params}
            foreign = [p for g in optimizer.param_groups for p in g["params"]
                       if id(p) not in mine]
            if foreign:
                raise ValueError(f"{len(foreign)} of the optimizer's parameters are not "
                                 f"parameters of this DistributedDataParallel (that require "
                                 f"gradients); it steps only its own, bucket by bucket")
        self.optimizer = optimizer

    def optimizer_shares(self) -> list:
        """For each bucket, its parameters in each of the optimizer's param groups (read at
        every backward: groups may be added between steps)."""
        where = {id(p): self.slots[i][0].index for i, p in enumerate(self.params)}
        groups = self.optimizer.param_groups
        shares = [[[] for _ in groups] for _ in self.buckets]
        for j, g in enumerate(groups):
            for p in g["params"]:
                k = where.get(id(p))
                if k is None:
                    raise RuntimeError("the optimizer in backward holds a parameter that is "
                                       "not one of this DistributedDataParallel's")
                shares[k][j].append(p)
        return shares

    def step_share(self, share) -> None:
        """``optimizer.step()`` over one bucket's parameters: each param group holds only its
        share during the call (hyperparameters, state and schedulers stay the group's own)."""
        groups = self.optimizer.param_groups
        full = [g["params"] for g in groups]
        try:
            for g, part in zip(groups, share):
                g["params"] = part
            self.optimizer.step()
        finally:
            for g, params in zip(groups, full):
                g["params"] = params

    # -- statistics ---------------------------------------------------------------------------
    def account(self, t_end: float, t_done) -> None:
        s = self.stats
        s.steps += 1
        s.wire_bytes = getattr(self.state, "wire_bytes", 0)
        if self.t_first is not None and t_done is not None:
            s.last_start = self.t_first
            s.last_span_s = t_done - self.t_first
            s.last_exposed_s = t_done - t_end
            s.span_s += s.last_span_s
            s.exposed_s += s.last_exposed_s
