"""``DistributedDataParallel``: data-parallel training with gradient buckets on autograd hooks.

    model = DistributedDataParallel(module)          # every rank: same module, its shard of data
    loss_fn(model(x), y).backward()                  # gradients averaged over ranks on return
    optimizer.step()

A facade over its parts:

1. *Construction.* The parameters' names, shapes and dtypes are compared across ranks
   (``agreement.same_parameters``: a mismatch is a ``ValueError`` on every rank naming
   the first differing parameter and the ranks), then rank 0's parameters and buffers are
   broadcast to all ranks (``agreement.broadcast_coalesced``).
2. *Backward.* The reducer (``collectives.torch.reducer``, ``model.reducer``) owns the
   buckets, each parameter's readiness, the launch of each bucket's comm hook (default: a
   non-blocking ``collectives.iallreduce`` with ``op="avg"``; on one node the buckets are
   registered buffers, ``registered_buckets``, which the core reduces one-pass), the end of
   backward and the write-back.
3. *Forward.* Buffers are broadcast from rank 0 (``broadcast_buffers``); under ``join()`` the
   ranks first agree which of them still train (``collectives.torch.join``).

``no_sync()`` accumulates gradients locally (the flag is restored in ``finally``);
``join()`` lets ranks run out of batches at different steps: a rank that left its loop keeps
answering the others' collectives with zeros, the average divides by the ranks that still
train (torch's ``Join``), and every rank leaves the context with the model of the ranks that
trained to the end. ``static_graph=True`` fixes the buckets and how many times each
parameter's gradient accumulates after the first iteration, so activation checkpointing
(reentrant or not) and parameters used twice train correctly.
``optimizer_in_backward(optimizer)`` steps the optimizer inside backward, bucket by bucket as
each bucket's average arrives, so that the step overlaps the buckets still on the wire (torch's
optimizer-in-backward); the training loop then calls no ``optimizer.step()``.
``find_unused_parameters=True`` lets parameters that got no gradient take part with zeros
(a parameter unused on every rank keeps ``grad=None``, as in one process). Hooks hold weak
references to the reducer, never strong ones. ``state_dict()`` is the module's
own (no ``module.`` prefix) and ``load_state_dict`` accepts both forms.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

import collectives as coll
from collectives import timeline

from .agreement import broadcast_coalesced, same_parameters
from .hooks import DefaultState
from .join import Join
from .memory import register_on
from .reducer import CommStats, Reducer, through_backward_start

__all__ = ["DistributedDataParallel", "CommStats"]

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
                 registered_buckets="auto"):
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
        self.registered_buckets = registered_buckets
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for n, p in named:
            if p.layout != torch.strided:
                raise TypeError(f"parameter {n!r} has layout {p.layout}; only dense "
                                f"parameters are supported")
        self._attach(comm)
        self._register_load_state_dict_pre_hook(_accept_unprefixed)
        self._join = None   # the Join of an active join() context
        if timeline.on:
            _trace_optimizers()
        if comm_hook is not None:
            if isinstance(comm_hook, tuple):
                self.register_comm_hook(*comm_hook)
            else:
                self.register_comm_hook(None, comm_hook)

    def _attach(self, comm) -> None:
        """Steps 1 and 2 of construction on ``comm`` (collective)."""
        module = self.module
        # Buckets in shared windows (collectives.node.registered): every step's allreduce takes
        # the one-pass path.
        registered_on = register_on(self.registered_buckets, comm, self.algorithm,
                                    "registered_buckets")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]

        # 1. Agree on the parameters, then start from rank 0's values.
        same_parameters(named, comm, "DistributedDataParallel")
        broadcast_coalesced(params + list(module.buffers()), 0, comm)

        # 2. The reducer: buckets, one hook per parameter (a weak reference back to it).
        self.reducer = Reducer(params, [n for n, _ in named], comm, self.algorithm,
                               self.bucket_cap_mb, registered_on, self.find_unused_parameters,
                               self.gradient_as_bucket_view, self.static_graph)
        self.stats = self.reducer.stats

    def rebuild(self, comm) -> None:
        """Go on over ``comm`` instead (collective over it): the survivors of a failed rank
        (``collectives.elastic``). A new reducer and buckets, rank 0's parameters and buffers
        broadcast again; the old reducer's hooks go with it. A comm hook set with a state of
        its own is kept (its state must not hold the old communicator); the default one
        follows ``comm``."""
        old = self.reducer
        hook, state, optimizer = old.hook, old.state, old.optimizer
        # Now, not when the old reducer is collected: the failed step's traceback keeps it.
        for handle in old.handles:
            handle.remove()
        for p in old.params:
            p.grad = None   # views into the old buckets
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self._join = None
        self._attach(comm)
        if hook is not self.reducer.hook or not isinstance(state, DefaultState):
            self.reducer.set_hook(hook, None if isinstance(state, DefaultState) else state)
        self.reducer.set_optimizer(optimizer)

    # -- what tests and tools look at -----------------------------------------------------------
    @property
    def _buckets(self):
        return self.reducer.buckets

    @property
    def _params(self):
        return self.reducer.params

    def bucket_layout(self) -> list[list[str]]:
        """The parameter names of each bucket, in launch order."""
        r = self.reducer
        return [[r.names[i] for i in b.members] for b in r.buckets]

    @property
    def comm_state(self):
        """The state passed to the comm hook (it counts ``wire_bytes``)."""
        return self.reducer.state

    # -- public API ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the module (after broadcasting rank 0's buffers if ``broadcast_buffers``)."""
        r = self.reducer
        if r.in_backward:  # the last backward raised before its end callback ran
            r.reset_iteration()
        t0 = timeline.now() if timeline.on else 0.0
        root = 0
        if self._join is not None:
            root = self._join.train(r, r.require_sync and torch.is_grad_enabled())
        self._sync_buffers(root)
        out = self.module(*args, **kwargs)
        if self.static_graph and r.require_sync and torch.is_grad_enabled():
            out = through_backward_start(r.ref, out)
        if timeline.on:
            timeline.span_event("forward", "phase", t0, timeline.now())
        return out

    def _sync_buffers(self, root: int) -> None:
        if self.broadcast_buffers and self.size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_coalesced(buffers, root, self.comm)

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
        if not enable or self.size == 1:
            yield
            return
        if self._join is not None:
            raise RuntimeError("DistributedDataParallel.join() is already active")
        self._join = Join(self.comm, divide_by_initial_world_size)
        try:
            yield
            self._join.until_all_joined(self.reducer, self._sync_buffers)
            self._join.leave(self.reducer.params + (
                list(self.module.buffers()) if self.broadcast_buffers else []))
        finally:
            self._join = None
            self.reducer.rescale = 1.0

    @contextlib.contextmanager
    def no_sync(self):
        """Within this context backward accumulates gradients locally, without communicating."""
        old = self.reducer.require_sync
        self.reducer.require_sync = False
        try:
            yield
        finally:
            self.reducer.require_sync = old

    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future`` (state None: DDP's comm)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self.reducer.set_hook(hook, state)

    def optimizer_in_backward(self, optimizer) -> None:
        """Step ``optimizer`` at the end of every synchronized backward, one bucket at a time
        as soon as that bucket's average has arrived (None: stop).

        The step of the buckets reduced first then overlaps the communication of the rest.
        The training loop calls ``optimizer.zero_grad()`` but no ``optimizer.step()``;
        backward inside ``no_sync()`` steps nothing. Each param group holds only the bucket's
        share of its parameters during a step, so the optimizer must update each parameter
        from its own gradient and state (SGD, Adam, AdamW, ...: not L-BFGS, nor a gradient
        clipped by the norm over all parameters). Every parameter the optimizer holds must be
        one of this model's.
        """
        self.reducer.set_optimizer(optimizer)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The wrapped module's state dict: the same keys as without DDP."""
        return self.module.state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
