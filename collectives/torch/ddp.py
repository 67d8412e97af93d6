"""``DistributedDataParallel``: data-parallel training with gradient buckets on autograd hooks.

    model = DistributedDataParallel(module)          # every rank: same module, its shard of data
    loss_fn(model(x), y).backward()                  # gradients averaged over ranks on return
    optimizer.step()

It works the way torch's Reducer does, over the toolkit's collectives:

1. *Construction.* The parameters' names, shapes and dtypes are compared across ranks (a
   mismatch is a ``ValueError`` on every rank naming the first differing parameter and the
   ranks), then rank 0's parameters and buffers are broadcast to all ranks.
2. *Buckets.* Parameters are packed into flat buffers (``collectives.torch.buckets``): in
   reverse order at first, a small first bucket, at most ``bucket_cap_mb`` each. Each
   parameter's ``.grad`` is a view into its bucket (``gradient_as_bucket_view``), so autograd
   accumulates straight into the buffer that is reduced: no copies. On one node the host
   buckets are registered buffers (``registered_buckets``, default ``"auto"``: the ranks share
   one node and ``algorithm="auto"``), so each bucket's allreduce takes the one-pass path
   (``collectives.onepass``).
3. *Backward.* A ``register_post_accumulate_grad_hook`` per parameter marks it ready; when a
   bucket's last gradient lands, the comm hook (default: divide, then non-blocking
   ``collectives.iallreduce``) starts on it while backward goes on. Buckets start strictly in
   bucket order -- a bucket that is complete early waits for the ones before it -- so every
   rank starts the same collectives in the same order. A callback queued on the autograd
   engine runs when backward is over: it waits for every bucket in order and copies each
   hook's result into its bucket.
4. *Rebuild.* After the first synchronized backward the buckets are rebuilt once, in the order
   gradients actually became ready (rank 0's order, broadcast, so the same on every rank).

``no_sync()`` accumulates gradients locally (the flag is restored in ``finally``);
``join()`` lets ranks run out of batches at different steps: a rank that left its loop keeps
answering the others' collectives with zeros, and the average divides by the ranks that still
train (torch's ``Join``). ``static_graph=True`` fixes the buckets and how many times each
parameter's gradient accumulates after the first iteration, so activation checkpointing
(reentrant or not) and parameters used twice train correctly.
``find_unused_parameters=True`` lets parameters that got no gradient take part with zeros
(a parameter unused on every rank keeps ``grad=None``, as in one process). Hooks hold weak
references to the DDP object, never strong ones (STYLE 10). ``state_dict()`` is the module's
own (no ``module.`` prefix) and ``load_state_dict`` accepts both forms.

``overlap_forward=True`` carries the communication into the next forward
(``collectives.torch.overlap``): backward returns without waiting, each piece of gradient is
stepped by the attached optimizer (``attach_optimizer``) when its allreduce completes, and
the next forward waits, module by module, only for its own parameters' pieces;
``synchronize()`` applies every pending update (before evaluation or a checkpoint).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import time
import weakref

import torch
from torch import nn

import collectives as coll
from collectives import registered, timeline, watchdog

from . import functional
from .buckets import Bucket, GradBucket, assign
from .hooks import DefaultState, allreduce_hook
from .memory import flat_zeros, register_on
from .overlap import ForwardOverlap

__all__ = ["DistributedDataParallel", "CommStats"]

_BROADCAST_CHUNK_BYTES = 64 << 20  # construction/buffer broadcasts are coalesced up to this


class CommStats:
    """Gradient communication of one DDP: bytes handed to collectives and the time exposed.

    Per synchronized backward, the *span* runs from the first bucket's launch to the moment
    every bucket is reduced; the *exposed* part is what remains after backward's computation
    ended (the end-of-backward callback's wait). ``hidden_fraction()`` = 1 - exposed / span.
    With ``overlap_forward`` the span runs to the last piece finished and the exposed part is
    the time spent waiting for pieces; the *forward* span starts when backward ends, and
    ``forward_hidden_fraction()`` is the share of it hidden behind the next forward (and
    whatever else ran before the waits).
    """

    __slots__ = ("steps", "wire_bytes", "span_s", "exposed_s", "last_span_s",
                 "last_exposed_s", "forward_span_s", "forward_exposed_s")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        self.steps = 0
        self.wire_bytes = 0
        self.span_s = self.exposed_s = 0.0
        self.last_span_s = self.last_exposed_s = 0.0
        self.forward_span_s = self.forward_exposed_s = 0.0

    def hidden_fraction(self) -> float:
        """The fraction of the communication span that overlapped backward (1.0 if none)."""
        return 1.0 - self.exposed_s / self.span_s if self.span_s > 0 else 1.0

    def forward_hidden_fraction(self) -> float:
        """``overlap_forward``: the fraction of the communication left when backward ended
        that did not block (1.0 if none)."""
        if self.forward_span_s <= 0:
            return 1.0
        return 1.0 - self.forward_exposed_s / self.forward_span_s

    def __repr__(self):
        return (f"CommStats(steps={self.steps}, wire_bytes={self.wire_bytes}, "
                f"span_s={self.span_s:.4f}, exposed_s={self.exposed_s:.4f}, "
                f"hidden={self.hidden_fraction():.2f})")


def _on_grad_ready(ref, index, param):
    ddp = ref()
    if ddp is not None:
        ddp._grad_ready(index)


def _on_backward_end(ref):
    ddp = ref()
    if ddp is not None:
        ddp._end_backward()


def _on_forward_pre(ref, module, args):
    ddp = ref()
    if ddp is not None and ddp._overlap is not None:
        ddp._overlap.before(module)


def _sum_hook(state, bucket):
    """``allreduce_hook`` when DDP has already divided every gradient by the rank count."""
    return state.all_reduce(bucket.buffer()).get_future().then(_first)


def _onepass_sum_hook(state, bucket):
    """``_sum_hook`` on registered buckets of every rank (``registered_buckets``): the
    one-pass allreduce by name, which skips ``auto``'s agreement (one blocking allreduce a
    bucket that would make each rank wait for the others at every launch)."""
    return state.all_reduce(bucket.buffer(), "onepass").get_future().then(_first)


def _onepass_avg_hook(state, bucket):
    """``allreduce_hook`` on registered float buckets of every rank: the one-pass average,
    which divides each chunk while it is in cache, so DDP leaves the gradients undivided."""
    return state.all_reduce(bucket.buffer(), "onepass", "avg").get_future().then(_first)


def _first(fut):
    return fut.value()[0]


class _BackwardStart(torch.autograd.Function):
    """Identity on the forward's outputs whose backward runs first in the *outer* backward.

    With reentrant activation checkpointing a gradient hook may fire inside a nested backward,
    whose end callback would come too early; queueing DDP's callback from here puts it on the
    outer backward, the one that ends last (torch's ``_DDPSink``).
    """

    @staticmethod
    def forward(ctx, ref, *tensors):
        ctx.ref = ref
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ddp = ctx.ref()
        if ddp is not None:
            ddp._start_backward()
        return (None, *grads)


def _through_backward_start(ref, out):
    """``out`` with its tensors that need gradients passed through ``_BackwardStart``."""
    if isinstance(out, torch.Tensor):
        return _BackwardStart.apply(ref, out)[0] if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        picks = [k for k, t in enumerate(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not picks:
            return out
        passed = _BackwardStart.apply(ref, *(out[k] for k in picks))
        items = list(out)
        for k, t in zip(picks, passed):
            items[k] = t
        return type(out)(items) if isinstance(out, list) else tuple(items)
    return out


_optimizer_traced = False


def _trace_optimizers() -> None:
    """Timeline: every optimizer step is an ``optimizer`` span (torch's global step hooks)."""
    global _optimizer_traced
    if _optimizer_traced:
        return
    _optimizer_traced = True
    starts = {}

    def pre(opt, args, kwargs):
        if timeline.on:
            starts[id(opt)] = timeline.now()

    def post(opt, args, kwargs):
        t0 = starts.pop(id(opt), None)
        if t0 is not None:
            timeline.span_event("optimizer", "phase", t0, timeline.now(),
                                {"optimizer": type(opt).__name__})

    from torch.optim import optimizer
    optimizer.register_optimizer_step_pre_hook(pre)
    optimizer.register_optimizer_step_post_hook(post)


def _bucket_done(index: int, t0: float, fut):
    timeline.span_event(f"bucket {index}", "bucket", t0, timeline.now(), {"bucket": index})
    return fut.value()


def _last_occurrences(seq) -> list:
    """Each distinct item of ``seq`` once, ordered by where it occurs last."""
    last = {x: k for k, x in enumerate(seq)}
    return sorted(last, key=last.get)


def _remove_handles(handles) -> None:
    for h in handles:
        h.remove()


def _accept_unprefixed(state_dict, prefix, local_metadata, strict, missing, unexpected,
                       errors):
    """Load pre-hook: keys saved without the ``module.`` level are moved under it."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
    meta = getattr(state_dict, "_metadata", None)
    if meta is None:
        return
    for key in list(meta):
        if prefix == "":
            rel = key
        elif key == prefix[:-1]:
            rel = ""
        elif key.startswith(prefix):
            rel = key[len(prefix):]
        else:
            continue
        if rel == "module" or rel.startswith("module."):
            continue
        meta.setdefault(inner[:-1] + ("." + rel if rel else ""), meta[key])


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that backward averages its gradients over the ranks of ``comm``."""

    def __init__(self, module, comm=None, bucket_cap_mb=25, algorithm="auto",
                 find_unused_parameters=False, gradient_as_bucket_view=True,
                 broadcast_buffers=True, comm_hook=None, static_graph=False,
                 registered_buckets="auto", overlap_forward=False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        if algorithm != "auto" and algorithm not in coll.algorithms("allreduce"):
            raise ValueError(f"unknown allreduce algorithm {algorithm!r}; expected 'auto' or "
                             f"one of {', '.join(coll.algorithms('allreduce'))}")
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        self.module = module
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.algorithm = algorithm
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.static_graph = bool(static_graph)
        self.stats = CommStats()
        self.overlap_forward = bool(overlap_forward)
        self._overlap = None
        if self.overlap_forward:
            clash = [what for what, on in (
                ("comm_hook", comm_hook is not None),
                ("find_unused_parameters=True", self.find_unused_parameters),
                ("static_graph=True", self.static_graph),
                ("gradient_as_bucket_view=False", not self.gradient_as_bucket_view)) if on]
            if clash:
                raise ValueError(f"overlap_forward=True does not combine with "
                                 f"{', '.join(clash)}")
        # Buckets in shared windows (collectives.registered): every step's allreduce takes
        # the one-pass path.
        self._registered = register_on(registered_buckets, comm, algorithm,
                                       "registered_buckets") is not None

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for n, p in named:
            if p.layout != torch.strided:
                raise TypeError(f"parameter {n!r} has layout {p.layout}; only dense "
                                f"parameters are supported")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]

        # 1. Agree on the parameters, then start from rank 0's values.
        self._verify_params()
        with torch.no_grad():
            self._broadcast_coalesced(list(self._params) + list(module.buffers()))

        # 2. Buckets, and 3. one hook per parameter (a weak reference back to us).
        self._build_buckets(None)
        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(
            functools.partial(_on_grad_ready, ref, i)) for i, p in enumerate(self._params)]
        weakref.finalize(self, _remove_handles, self._handles)
        self._register_load_state_dict_pre_hook(_accept_unprefixed)

        self._require_sync = True
        self._rebuild_pending = True
        self._order: list[int] = []
        self._used = bytearray(len(self._params))   # got a gradient since the last sync
        self._none_before: list[int] = []            # unused here and grad was None
        # static_graph: gradient accumulations per parameter in one backward (None until the
        # first synchronized backward has counted them), and the order of this one's.
        self._expected = None
        self._static_order: list[int] = []
        # join(): None outside; else whether the average divides by the initial world size.
        self._join_initial = None
        self._join_last = 0               # lowest rank training at the last agreement
        self._active = self.size          # ranks that train this step (join)
        self._zero_flats = None           # a joined rank's stand-in buckets
        self._fused = self._divide = False  # set as each backward starts (_start_backward)
        self._t_backward = 0.0
        if timeline.on:
            _trace_optimizers()
        self._reset_iteration()
        self.register_comm_hook(None, allreduce_hook)
        if comm_hook is not None:
            if isinstance(comm_hook, tuple):
                self.register_comm_hook(*comm_hook)
            else:
                self.register_comm_hook(None, comm_hook)
        if self.overlap_forward:
            self._overlap = ForwardOverlap(module, self._params, self._names,
                                           self._hook_state, self.size)
            self._overlap.plan(self._buckets, self._piece_algorithm())
            owners = {id(m): m for m in self._overlap.owner}.values()
            self._handles.extend(m.register_forward_pre_hook(
                functools.partial(_on_forward_pre, ref)) for m in owners)

    # -- construction helpers -------------------------------------------------------------------
    def _verify_params(self) -> None:
        """Same parameter names, shapes and dtypes on every rank, or a ValueError on every rank."""
        sig = [(n, tuple(p.shape), str(p.dtype).replace("torch.", ""))
               for n, p in zip(self._names, self._params)]
        digest = hashlib.sha256(repr(sig).encode()).hexdigest()
        if self.size == 1 or len(set(self.comm.allgather(digest))) == 1:
            return
        sigs = self.comm.allgather(sig)  # metadata, once: only when the digests differ

        def show(e):
            return "no such parameter" if e is None else f"{e[0]!r} of shape {list(e[1])} {e[2]}"

        for k in range(max(len(s) for s in sigs)):
            entries = [s[k] if k < len(s) else None for s in sigs]
            bad = [r for r in range(1, len(sigs)) if entries[r] != entries[0]]
            if bad:
                first = (entries[0] or entries[bad[0]])[0]
                detail = "; ".join(f"rank {r} has {show(entries[r])}" for r in [0] + bad[:3])
                raise ValueError(f"DistributedDataParallel: parameter {k} ({first!r}) differs "
                                 f"across ranks {[0] + bad}: {detail}; every rank must wrap "
                                 f"the same model")
        raise AssertionError("parameter digests differ but the signatures agree")

    def _broadcast_coalesced(self, tensors, root: int = 0) -> None:
        """``root``'s values into ``tensors`` on every rank, one broadcast per dtype and chunk."""
        if self.size == 1 or not tensors:
            return
        groups: dict = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for group in groups.values():
            chunk, nbytes = [], 0
            for t in group + [None]:
                if t is not None and (nbytes == 0 or nbytes + t.numel() * t.element_size()
                                      <= _BROADCAST_CHUNK_BYTES):
                    chunk.append(t)
                    nbytes += t.numel() * t.element_size()
                    continue
                flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                functional.broadcast(flat, root, comm=self.comm)
                offset = 0
                for c in chunk:
                    c.detach().copy_(flat[offset:offset + c.numel()].view(c.shape))
                    offset += c.numel()
                chunk, nbytes = ([t], t.numel() * t.element_size()) if t is not None \
                    else ([], 0)

    def _build_buckets(self, order) -> None:
        """(Re)make the buckets for ``order``; gradients so far move into the new buffers."""
        params = self._params
        groups = assign([p.numel() * p.element_size() for p in params],
                        [(p.dtype, p.device) for p in params],
                        max(1, int(self.bucket_cap_mb * (1 << 20))), order)
        alloc = functools.partial(flat_zeros, comm=self.comm) if self._registered else None
        buckets = [Bucket(k, members, params, alloc) for k, members in enumerate(groups)]
        # every bucket registered on every rank of one node: the one-pass allreduce by name
        self._onepass = self._registered and self.size > 1 and \
            registered.single_node(self.comm) and all(b.flat.device.type == "cpu"
                                                       for b in buckets)
        # ... and float buckets whose sum cannot overflow where the mean would not: averaged
        # in the one-pass itself (the division in cache, no pass of its own)
        self._onepass_avg = self._onepass and all(
            b.flat.dtype in (torch.float32, torch.float64, torch.bfloat16) for b in buckets)
        self._zero_flats = None
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
        self._buckets, self._slots = buckets, slots

    def bucket_layout(self) -> list[list[str]]:
        """The parameter names of each bucket, in launch order."""
        return [[self._names[i] for i in b.members] for b in self._buckets]

    # -- public API ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the module (after broadcasting rank 0's buffers if ``broadcast_buffers``)."""
        if self._in_backward:  # the last backward raised before its end callback ran
            self._reset_iteration()
        t0 = timeline.now() if timeline.on else 0.0
        root = 0
        if self._join_initial is not None:
            active, root, _ = self._agree_join(True)
            self._active = active
        self._sync_buffers(root)
        if self._overlap is not None:
            if self._overlap.optimizer is None and torch.is_grad_enabled():
                raise RuntimeError("DistributedDataParallel(overlap_forward=True) steps the "
                                   "optimizer itself: call model.attach_optimizer(optimizer) "
                                   "before the first forward")
            self._overlap.forward_starts()
        out = self.module(*args, **kwargs)
        if self._overlap is not None:
            self._overlap.forward_ends()
            self._account_overlap()
        if self.static_graph and self._require_sync and torch.is_grad_enabled():
            out = _through_backward_start(weakref.ref(self), out)
        if timeline.on:
            timeline.span_event("forward", "phase", t0, timeline.now())
        return out

    def _sync_buffers(self, root: int) -> None:
        if self.broadcast_buffers and self.size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                with torch.no_grad():
                    self._broadcast_coalesced(buffers, root)

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = False, enable: bool = True):
        """Train on uneven inputs: a rank whose loop ends waits here for the others.

        Every forward inside agrees (one small allreduce) on which ranks still train and
        whether a synchronized backward follows; a rank that has left its loop answers each
        step with zeros: the bucket collectives (through the comm hook, so compressing hooks
        match), the unused-parameter flags and the buffer broadcast, which comes from the
        lowest rank still training. The average divides by the ranks that still train (by
        the initial rank count with ``divide_by_initial_world_size=True``, as torch's
        default). Every rank of ``comm`` must enter the context. On leaving it, every rank
        takes the parameters (and buffers, with ``broadcast_buffers``) of the lowest rank
        that trained to the end, so all hold one model (torch's last joiner).
        """
        if self._overlap is not None:
            raise RuntimeError("join() does not combine with overlap_forward=True")
        if not enable or self.size == 1:
            yield
            return
        if self._join_initial is not None:
            raise RuntimeError("DistributedDataParallel.join() is already active")
        self._join_initial = bool(divide_by_initial_world_size)
        self._join_last = 0
        try:
            yield
            while True:
                active, root, sync = self._agree_join(False)
                if active == 0:
                    break
                self._sync_buffers(root)
                if sync:
                    self._shadow_backward()
            # A rank that left early ran no optimizer step since: everyone takes the model
            # of the ranks still training at the last step (the lowest of them).
            with torch.no_grad():
                self._broadcast_coalesced(list(self._params) + (
                    list(self.module.buffers()) if self.broadcast_buffers else []),
                    self._join_last)
        finally:
            self._join_initial = None
            self._active = self.size

    def _agree_join(self, training: bool):
        """(ranks training, lowest of them, whether they synchronize this backward)."""
        flags = torch.zeros(self.size + 1, dtype=torch.int32)
        if training:
            flags[self.rank] = 1
            flags[self.size] = int(self._require_sync and torch.is_grad_enabled())
        functional.all_reduce(flags, "sum", comm=self.comm)
        active = int(flags[:self.size].sum())
        root = int(torch.argmax(flags[:self.size]))
        if active:
            self._join_last = root  # the same on every rank: all take part in each agreement
        return active, root, bool(flags[self.size])

    def _shadow_backward(self) -> None:
        """A joined rank's part of one synchronized backward: the same collectives, zeros."""
        if self._zero_flats is None:
            self._zero_flats = [torch.zeros_like(b.flat) for b in self._buckets]
        hook = _sum_hook if self._prescale else self._hook
        futures = []
        for b, zero in zip(self._buckets, self._zero_flats):
            zero.zero_()  # a hook may have left something in it
            params = [self._params[i] for i in b.members]
            futures.append(hook(self._hook_state, GradBucket(
                b.index, zero, params, b.index == len(self._buckets) - 1, joined=True)))
        if self.find_unused_parameters:
            functional.all_reduce(torch.zeros(len(self._params), dtype=torch.int32), "max",
                                  comm=self.comm)
        for f in futures:
            functional.wait_future(f)
        if self._rebuild_pending:
            self._order = []
            self._rebuild()

    @contextlib.contextmanager
    def no_sync(self):
        """Within this context backward accumulates gradients locally, without communicating."""
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future`` (state None: DDP's comm)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if self.overlap_forward and hook is not allreduce_hook:
            raise ValueError("overlap_forward=True reduces pieces of buckets with the default "
                             "allreduce; it takes no comm hook")
        self._hook = hook
        self._hook_state = DefaultState(self.comm, self.algorithm) if state is None else state
        # The default hook's division is done by DDP itself, gradient by gradient as each one
        # lands (fused into the copy into the bucket when the gradient is fresh), as torch's
        # Reducer does without a hook: one pass over the gradients less.
        # With static_graph a gradient may land in two parts, so the whole bucket is divided.
        self._prescale = hook is allreduce_hook and self.size > 1 and \
            type(self._hook_state) is DefaultState and not self.static_graph

    @property
    def comm_state(self):
        """The state passed to the comm hook (it counts ``wire_bytes``)."""
        return self._hook_state

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The wrapped module's state dict: the same keys as without DDP."""
        self.synchronize()
        return self.module.state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)

    def attach_optimizer(self, optimizer) -> None:
        """``overlap_forward``: the optimizer the model steps, piece by piece, as gradients
        arrive (its ``step()`` then raises; ``zero_grad()`` is not needed)."""
        if self._overlap is None:
            raise RuntimeError("attach_optimizer() needs DistributedDataParallel("
                               "overlap_forward=True); otherwise call optimizer.step() "
                               "after backward")
        if self._overlap.optimizer is not None:
            raise RuntimeError("an optimizer is already attached")
        self._overlap.attach(optimizer)

    def synchronize(self) -> None:
        """``overlap_forward``: wait for every pending piece and apply its update (before
        evaluation, a checkpoint or reading the parameters); a no-op otherwise."""
        if self._overlap is not None and self._overlap.finish_all():
            self._account_overlap()

    def _piece_algorithm(self):
        """``overlap_forward``'s pieces: the one-pass allreduce by name where the buckets
        take it (registered, one node, ``auto``), so a launch never waits for the others."""
        return "onepass" if self._onepass and self.algorithm == "auto" else None

    def _account_overlap(self) -> None:
        times = self._overlap.done()
        if times is None:
            return
        span, after, blocked = times
        s = self.stats
        s.last_span_s, s.last_exposed_s = span, blocked
        s.span_s += span
        s.exposed_s += blocked
        s.forward_span_s += after
        s.forward_exposed_s += blocked

    # -- the reducer --------------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._in_backward = False
        self._ready = bytearray(len(self._params))
        self._calls = [0] * len(self._params)
        self._static_order = []
        self._next = 0
        self._t_first = None
        for b in self._buckets:
            b.pending = len(b.members)
            b.future = None
            b.grad_bucket = None
        if self._overlap is not None:
            self._overlap.reset()

    def _start_backward(self) -> None:
        """Queue the end-of-backward callback on the backward that runs now."""
        if not self._in_backward:
            if self._overlap is not None and self._overlap.pending():
                # Its gradients would land in buckets still on the wire.
                raise RuntimeError("overlap_forward: this backward started while the last "
                                   "synchronized backward's updates are pending (no forward "
                                   "since); run a forward or model.synchronize() in between")
            self._in_backward = True
            # This backward's buckets averaged by the one-pass (every rank trains, DDP's own
            # hook, no overlap); else DDP divides each gradient as it lands (_divide).
            self._fused = self._prescale and self._onepass_avg and self._overlap is None \
                and self._active == self.size and self.comm_state.algorithm == "auto"
            self._divide = self._prescale and not self._fused
            if timeline.on:
                self._t_backward = timeline.now()
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_on_backward_end, weakref.ref(self)))

    def _grad_ready(self, index: int) -> None:
        """The post-accumulate-grad hook of parameter ``index``."""
        self._start_backward()
        p = self._params[index]
        b, pos = self._slots[index]
        view = b.views[pos]
        sync = self._require_sync
        complete = True
        if sync and self.static_graph:
            self._calls[index] += 1
            calls = self._calls[index]
            if self._expected is None:
                self._static_order.append(index)
                complete = False   # the first backward launches everything at its end
            elif calls > self._expected[index]:
                raise RuntimeError(
                    f"parameter {self._names[index]!r} got a gradient {calls} times in one "
                    f"backward, {self._expected[index]} in the first; static_graph=True needs "
                    f"the same graph every iteration")
            else:
                complete = calls == self._expected[index]
        elif sync and self._ready[index]:
            raise RuntimeError(f"parameter {self._names[index]!r} got a gradient twice in one "
                               f"backward (activation checkpointing, a parameter used twice "
                               f"or a reentrant backward); pass static_graph=True to "
                               f"DistributedDataParallel if the graph is the same every "
                               f"iteration")
        self._used[index] = 1
        if self.gradient_as_bucket_view:
            if p.grad is not view:  # set_to_none zero_grad, or a grad the user replaced
                self._into_bucket(p.grad, view, sync)
                p.grad = view
            elif sync and self._divide:
                view.div_(self.size)  # while this gradient is still in cache
        elif sync:
            self._into_bucket(p.grad, view, True)
        if sync and complete:
            self._mark_ready(index, b)
            functional.progress()  # without a progress thread, this is when bytes move

    def _into_bucket(self, grad, view, sync: bool) -> None:
        """Copy ``grad`` into its bucket slot, divided by the rank count if DDP divides."""
        if sync and self._divide:
            torch.div(grad, self.size, out=view)  # the copy and the division in one pass
        else:
            view.copy_(grad)

    def _mark_ready(self, index: int, b: Bucket) -> None:
        self._ready[index] = 1
        if self._rebuild_pending:
            self._order.append(index)
        b.pending -= 1
        if self._overlap is not None:
            self._overlap.ready(index)
            return
        if b.pending == 0:
            if timeline.on:
                timeline.instant(f"bucket {b.index} ready", "bucket", {"bucket": b.index})
            buckets = self._buckets
            while self._next < len(buckets) and buckets[self._next].pending == 0:
                self._launch(buckets[self._next])
                self._next += 1

    def _launch(self, b: Bucket) -> None:
        if self._t_first is None:
            self._t_first = time.perf_counter()
        params = [self._params[i] for i in b.members]
        b.grad_bucket = GradBucket(b.index, b.flat, params, b.index == len(self._buckets) - 1)
        hook = self._hook
        if self._fused:
            hook = _onepass_avg_hook
        elif self._prescale:  # registered buckets on every rank, unless one stands in (join)
            hook = _onepass_sum_hook if self._onepass and self._active == self.size \
                and self.comm_state.algorithm == "auto" else _sum_hook
        names = [self._names[i] for i in b.members]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        # A collective that hangs is reported by the watchdog with its bucket and parameters.
        with watchdog.label(f"DDP bucket {b.index} of {len(self._buckets)}: {shown}"):
            fut = hook(self._hook_state, b.grad_bucket)
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future and then()'s
            raise TypeError(f"comm hook {getattr(self._hook, '__name__', self._hook)!r} "
                            f"returned {type(fut).__name__}, expected a torch.futures.Future")
        if timeline.on:
            t0 = timeline.now()
            timeline.instant(f"bucket {b.index} started", "bucket",
                             {"bucket": b.index, "bytes": b.nbytes,
                              "parameters": len(b.members)})
            fut = fut.then(functools.partial(_bucket_done, b.index, t0))
        b.future = fut

    def _mark_unused(self, index: int) -> None:
        """A parameter without a gradient this backward takes part with what it has (or 0)."""
        p = self._params[index]
        b, pos = self._slots[index]
        view = b.views[pos]
        g = p.grad
        if g is None:
            view.zero_()
            self._none_before.append(index)
        elif g is not view:
            self._into_bucket(g, view, True)
            if self.gradient_as_bucket_view:
                p.grad = view
        elif self._divide:
            view.div_(self.size)
        self._mark_ready(index, b)

    def _end_backward(self) -> None:
        """The end-of-backward callback: finish every bucket, in order, then tidy up."""
        self._in_backward = False
        if timeline.on:
            timeline.span_event("backward", "phase", self._t_backward, timeline.now(),
                                {"sync": self._require_sync})
        if not self._require_sync:
            return
        try:
            t_end = time.perf_counter()
            if self.static_graph and self._expected is None:
                self._expected = list(self._calls)
                for i in _last_occurrences(self._static_order):
                    self._mark_ready(i, self._slots[i][0])
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            if missing and not self.find_unused_parameters and not self.static_graph:
                names = ", ".join(repr(self._names[i]) for i in missing[:4])
                raise RuntimeError(
                    f"rank {self.rank}: {len(missing)} of {len(self._params)} parameters got "
                    f"no gradient in this backward ({names}{', ...' if len(missing) > 4 else ''}"
                    f"); pass find_unused_parameters=True if parameters may not take part in "
                    f"the loss, or static_graph=True with reentrant activation checkpointing")
            for i in missing:
                self._mark_unused(i)
            if self._overlap is not None:
                self._overlap.end_backward(t_end)
                self.stats.steps += 1
                self.stats.wire_bytes = self._hook_state.wire_bytes
                if self._rebuild_pending:  # the buckets change: nothing may be in flight
                    self.synchronize()
                    self._rebuild()
                return
            used = None
            if self.find_unused_parameters:
                # Every rank takes part: which parameters were used anywhere since the last sync.
                used = torch.frombuffer(self._used, dtype=torch.uint8).to(torch.int32)
                functional.all_reduce(used, "max", comm=self.comm)
            for b in self._buckets:
                value = functional.wait_future(b.future)
                if value is not b.flat:
                    if not isinstance(value, torch.Tensor) or value.numel() != b.flat.numel():
                        raise TypeError(f"comm hook result for bucket {b.index}: expected a "
                                        f"tensor of {b.flat.numel()} elements, got "
                                        f"{getattr(value, 'shape', type(value).__name__)}")
                    if value.data_ptr() != b.flat.data_ptr():
                        b.flat.copy_(value.view(-1))
            t_done = time.perf_counter()
            if self._join_initial is False and self._active < self.size:
                # The hook averaged over every rank; joined ranks sent zeros.
                for b in self._buckets:
                    b.flat.mul_(self.size / self._active)
            self._write_back(used)
            self._account(t_end, t_done)
            if self._rebuild_pending:
                self._rebuild()
        finally:
            self._used = bytearray(len(self._params))
            self._none_before = []
            self._reset_iteration()

    def _write_back(self, used) -> None:
        with torch.no_grad():
            if not self.gradient_as_bucket_view:
                for i, p in enumerate(self._params):
                    b, pos = self._slots[i]
                    if p.grad is None:
                        p.grad = b.views[pos].clone()
                    else:
                        p.grad.copy_(b.views[pos])
            for i in self._none_before:
                p = self._params[i]
                if used is not None and not used[i]:
                    p.grad = None  # unused on every rank: as in one process
                elif p.grad is None:
                    b, pos = self._slots[i]
                    p.grad = b.views[pos] if self.gradient_as_bucket_view \
                        else b.views[pos].clone()

    def _account(self, t_end: float, t_done: float) -> None:
        s = self.stats
        s.steps += 1
        s.wire_bytes = getattr(self._hook_state, "wire_bytes", 0)
        if self._t_first is not None:
            s.last_span_s = t_done - self._t_first
            s.last_exposed_s = t_done - t_end
            s.span_s += s.last_span_s
            s.exposed_s += s.last_exposed_s

    def _rebuild(self) -> None:
        """Once, after the first synchronized backward: buckets in the order grads were ready."""
        self._rebuild_pending = False
        n = len(self._params)
        # A joined rank has no order of its own; rank 0's wins anyway.
        order = torch.tensor(self._order if len(self._order) == n else range(n - 1, -1, -1),
                             dtype=torch.int64)
        self._order = []
        functional.broadcast(order, 0, comm=self.comm)
        order = order.tolist()
        groups = assign([p.numel() * p.element_size() for p in self._params],
                        [(p.dtype, p.device) for p in self._params],
                        max(1, int(self.bucket_cap_mb * (1 << 20))), order)
        if groups != [b.members for b in self._buckets]:
            self._build_buckets(order)
        if self._overlap is not None:
            self._overlap.plan(self._buckets, self._piece_algorithm())
            self._overlap.prioritize(self.comm)
