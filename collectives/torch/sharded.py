"""Sharded data parallelism (ZeRO stages 1, 2 and 3) on the toolkit's collectives.

Vocabulary. A *unit* is a group of parameters that share one flat buffer
(``flat.FlatBuffer``, DDP's buckets' layout): for stages 1 and 2 a
gradient bucket (``buckets.assign``, reverse parameter order, ``bucket_cap_mb``), for stage 3 one
submodule's own parameters (a layer). A unit's flat buffer holds its parameters end to end,
padded to a multiple of N ranks; rank r owns the *shard* ``[r*s, (r+1)*s)`` with ``s = padded/N``,
so a parameter may straddle shards. ``parameters()`` yields the shards (one ``nn.Parameter`` per
unit), which is all an optimizer sees.

1. *Forward.* Stages 1 and 2 keep every full parameter as a view into its unit's flat buffer; the
   first forward after an optimizer step all-gathers the shards into the flat buffers (a shard
   whose version counter has not moved is not gathered again). Stage 3 keeps only the shard: a
   forward pre-hook on each layer all-gathers its flat buffer (and starts the next layer's
   all-gather), a forward hook frees it again (each parameter's ``.data`` is rebound to an empty
   tensor; autograd saved the parameter objects, which the re-gather rebinds to a new buffer).
2. *Backward.* Readiness, launch order and the end of backward are DDP's
   (``collectives.torch.backward``): a ``register_post_accumulate_grad_hook`` per parameter
   counts it ready; a ready unit is launched in unit order (the same on every rank, so
   non-blocking collectives match); the end-of-backward callback waits for every launch in that
   order. Stage 1 averages the unit's flat gradient buffer (``param.grad`` are views into it, as
   DDP's ``gradient_as_bucket_view``) with an all-reduce; stages 2 and 3 pack the gradients into
   a flat buffer, reduce-scatter it into the shard's gradient and drop the full ones. The
   packing buffers are ``PACKED`` slots (one a unit at most), allocated with the flat buffers
   and taken in turn (launch k packs into slot k mod ``PACKED``, whose size is the largest of
   the units it packs; at most ``PACKED - 1`` launches are in flight while the next one
   packs), so no backward allocates one: a registered allocation is a collective that would
   stop every rank's backward at each launch.
   Stage 3 re-gathers a layer before its backward (a hook on the layer's outputs) and frees it
   once its gradients are launched. A layer run again by activation checkpointing
   (``collectives.torch.checkpoint``) is gathered for its recompute and kept until then. At the end of backward, units with unused parameters are
   launched with zeros for them, and every launch is waited. Every average is the core's
   ``op="avg"``, which cannot overflow where the mean does not (float16, bfloat16).
3. *State.* ``full_state_dict`` gathers full tensors (names of ``module.state_dict()``);
   ``load_full_state_dict`` slices them into this rank's shards, so a checkpoint written at N
   ranks loads at M. ``full_optim_state_dict`` / ``load_full_optim_state_dict`` do the same for
   the optimizer's per-shard tensors.

Flat buffers are allocated by ``flat_buffer`` alone. On one node (``registered_buffers``, default
``"auto"``: the ranks share one node and ``algorithm="auto"``) the host buffers that
collectives read -- the flat parameters and gradients, the shards of stage 3, the packed
gradients of stages 2 and 3 -- are registered buffers (``collectives.node.registered``), so their
broadcasts, allreduces, reduce-scatters and all-gathers take the one-pass path
(``collectives.node.onepass``); stage 3's gathered layers stay ordinary memory, freed after use.

Construction checks that every rank wraps the same parameters with DDP's check
(``agreement.same_parameters``). The hooks on the module's parameters, layers and
outputs reach the wrapper through a weak reference, so the module does not keep a
dropped wrapper alive, and the wrapper's death removes them.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch

from . import functional
from .agreement import same_parameters
from .backward import Launcher, hook_parameters, hooks_removed_with
from .checkpoint import recomputing
from .buckets import assign
from .flat import FlatBuffer
from .memory import flat_zeros, register_on

__all__ = ["ShardedDataParallel", "flat_buffer"]


def flat_buffer(numel: int, dtype, device, comm=None) -> torch.Tensor:
    """A new zeroed 1-D tensor for a unit's flat parameters or gradients; registered on
    ``comm``'s node when ``comm`` is given and the tensor is on the host (collective then)."""
    return flat_zeros(numel, dtype, device, comm)


PACKED = 3   # stages 2 and 3: packing buffers, one more than the launches kept in flight


class _Unit:
    """One flat buffer's parameters: their layout (``full``, padded to a multiple of the rank
    count), this rank's shard of it and, for stage 1, the flat gradients (``grads``)."""

    __slots__ = ("index", "names", "params", "nranks", "full", "grads", "shard",
                 "shard_numel", "gathered_version", "gathered", "pending", "module")

    def __init__(self, index, names, params, nranks, module=None):
        self.index = index
        self.names = names
        self.params = params
        self.nranks = nranks
        p0 = params[0]
        self.full = FlatBuffer([p.shape for p in params], p0.dtype, p0.device, pad_to=nranks,
                               allocate=False)
        self.shard_numel = self.full.padded // nranks  # rank r owns [r*s, (r+1)*s)
        self.grads = None
        self.shard = None
        self.gathered_version = None
        self.gathered = False
        self.pending = None    # stage 3: an all-gather in flight (the prefetch)
        self.module = module

    def like(self, dtype, device) -> FlatBuffer:
        """A new zeroed flat buffer of this unit's layout in ``dtype`` on ``device`` (a
        checkpoint's full tensors, an optimizer state's)."""
        return FlatBuffer(self.full.shapes, dtype, device, pad_to=self.nranks)


class ShardedDataParallel(torch.nn.Module):
    """ZeRO stage 1, 2 or 3 over ``module``: ``parameters()`` yields this rank's flat shards."""

    def __init__(self, module, stage: int = 1, comm=None, bucket_cap_mb: float = 25,
                 algorithm: str = "auto", registered_buffers="auto"):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        self.module = module
        self.stage = stage
        self.algorithm = algorithm
        self.bucket_cap_mb, self.registered_buffers = bucket_cap_mb, registered_buffers
        self._previous_shards = None   # the shards before a rebuild, until load_shards
        self._attach(comm)

    def _attach(self, comm) -> None:
        """Units, flat buffers (rank 0's parameters) and hooks over ``comm`` (collective)."""
        module, stage = self.module, self.stage
        bucket_cap_mb, algorithm = self.bucket_cap_mb, self.algorithm
        registered_buffers = self.registered_buffers
        self.comm = comm
        self.rank, self.nranks = comm.Get_rank(), comm.Get_size()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        same_parameters(named, comm, "ShardedDataParallel")
        if any(p.dtype != named[0][1].dtype or p.device != named[0][1].device for _, p in named):
            raise TypeError("ShardedDataParallel needs one dtype and device for all parameters")
        self._units = self._make_units(named, bucket_cap_mb)
        # the communicator to register flat buffers on, or None
        self._reg = register_on(registered_buffers, comm, algorithm, "registered_buffers")
        # backward produces gradients last layer first: stage 3's units are in forward order
        self._launch_order = self._units[::-1] if stage == 3 else list(self._units)
        self._launcher = Launcher(len(u.params) for u in self._launch_order)
        self._sync = True
        self._synced_backward = False
        self._scratch = None
        self._packing: list = []   # stages 2 and 3: launch k's layout in its packing slot
        self._forward_seen: list = []
        self._next_in_forward: dict = {}
        self._shards = torch.nn.ParameterList()
        self._init_buffers()
        # Hooks reach this object through a weak reference only: the module's parameters and
        # layers do not keep it alive, and its death removes them.
        self._ref = ref = weakref.ref(self)
        # parameter k of the hooked list belongs to the unit launched at _position[k]
        self._position = [k for k, u in enumerate(self._launch_order) for _ in u.params]
        self._hooks = hook_parameters([p for u in self._launch_order for p in u.params], ref,
                                      "_on_grad")
        if stage == 3:
            for unit in self._units:
                self._hooks.append(unit.module.register_forward_pre_hook(
                    functools.partial(_before_forward, ref, unit)))
                self._hooks.append(unit.module.register_forward_hook(
                    functools.partial(_after_forward, ref, unit)))
        hooks_removed_with(self, self._hooks)

    # -- construction ---------------------------------------------------------------------------
    def _make_units(self, named, bucket_cap_mb):
        if self.stage == 3:
            units, by_module = [], {}
            ids = {id(p): n for n, p in named}
            for mname, mod in self.module.named_modules():
                own = [(f"{mname}.{n}" if mname else n, p)
                       for n, p in mod.named_parameters(recurse=False) if id(p) in ids]
                own = [(n, p) for n, p in own if id(p) not in by_module]
                if own:
                    for _, p in own:
                        by_module[id(p)] = mname
                    units.append(_Unit(len(units), [n for n, _ in own], [p for _, p in own],
                                       self.nranks, mod))
            return units
        sizes = [p.numel() * p.element_size() for _, p in named]
        groups = assign(sizes, [0] * len(named), int(bucket_cap_mb * (1 << 20)))
        return [_Unit(k, [named[i][0] for i in g], [named[i][1] for i in g], self.nranks)
                for k, g in enumerate(groups)]

    def _init_buffers(self) -> None:
        """Rank 0's parameters into every rank's flat buffers; shards as views or copies."""
        alloc = functools.partial(flat_buffer, comm=self._reg)
        with torch.no_grad():
            for unit in self._units:
                full = unit.full
                flat = full.allocate(alloc)
                full.copy_in(unit.params)
                functional.broadcast(flat, 0, comm=self.comm, algorithm=self.algorithm)
                lo = self.rank * unit.shard_numel
                if self.stage == 3:
                    shard = flat_buffer(unit.shard_numel, full.dtype, full.device, self._reg)
                    unit.shard = torch.nn.Parameter(shard.copy_(flat[lo:lo + unit.shard_numel]))
                    self._free(unit)
                else:
                    unit.shard = torch.nn.Parameter(flat[lo:lo + unit.shard_numel])
                    full.alias(unit.params)
                    unit.gathered_version = unit.shard._version
                if self.stage == 1:
                    unit.grads = FlatBuffer(full.shapes, full.dtype, full.device,
                                            pad_to=self.nranks, alloc=alloc)
                    for p, view in zip(unit.params, unit.grads.views):
                        p.grad = view
                self._shards.append(unit.shard)
            biggest = max((u.shard_numel for u in self._units), default=0)
            if self.stage != 3 and self.nranks > 1 and self._units:
                full = self._units[0].full
                self._scratch = flat_buffer(biggest, full.dtype, full.device, self._reg)
            if self.stage != 1 and self._units:
                # slot j packs the launches j, j + PACKED, ...: the largest of those units
                full, count = self._units[0].full, min(PACKED, len(self._units))
                slots = [flat_buffer(max(u.full.padded for u in self._launch_order[j::count]),
                                     full.dtype, full.device, self._reg) for j in range(count)]
                for k, unit in enumerate(self._launch_order):
                    layout = FlatBuffer(unit.full.shapes, full.dtype, full.device,
                                        pad_to=self.nranks, allocate=False)
                    layout.bind(slots[k % count][:unit.full.padded])
                    self._packing.append(layout)

    # -- the optimizer's view -------------------------------------------------------------------
    def parameters(self, recurse: bool = True):
        """This rank's flat shards, one per unit: what an optimizer steps."""
        return iter(list(self._shards))

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        """``("shard.<unit>", shard)`` for this rank's shards."""
        return iter([(f"{prefix}shard.{k}", s) for k, s in enumerate(self._shards)])

    def units(self) -> list[list[str]]:
        """The parameter names of each unit, in unit order."""
        return [list(u.names) for u in self._units]

    # -- forward --------------------------------------------------------------------------------
    def _gather(self, unit, async_op=False):
        """All-gather ``unit``'s shards into its flat buffer (stage 3: reallocating it)."""
        if self.stage == 3:
            unit.full.allocate(flat_buffer)
            unit.full.alias(unit.params)
            src = unit.shard.detach()
        else:
            src = self._scratch[:unit.shard_numel]
            src.copy_(unit.shard.detach())
        return functional.all_gather_into_tensor(unit.full.flat, src, comm=self.comm,
                                                 async_op=async_op, algorithm=self.algorithm)

    def forward(self, *args, **kwargs):
        """Refresh the full parameters from the shards if they moved, then run the module."""
        if self._launcher.active:  # the last backward raised before its end callback ran
            self._launcher.end()
            self._launcher.discard()
        if self.stage == 3:
            seen = self._forward_seen
            if seen:
                self._next_in_forward = {a.index: b for a, b in zip(seen, seen[1:])}
            self._forward_seen = []
        if self._synced_backward and self.stage == 1:
            for unit in self._units:
                unit.grads.flat.zero_()
        self._synced_backward = False
        if self.stage != 3 and self.nranks > 1:
            with torch.no_grad():
                for unit in self._units:
                    if unit.shard._version != unit.gathered_version:
                        self._gather(unit)
                        unit.gathered_version = unit.shard._version
        elif self.stage != 3:
            for unit in self._units:
                unit.gathered_version = unit.shard._version
        return self.module(*args, **kwargs)

    def _ensure_gathered(self, unit, prefetch=None) -> None:
        with torch.no_grad():
            if unit.pending is not None:
                unit.pending.wait()
                unit.pending = None
            elif not unit.gathered:
                self._gather(unit)
            unit.gathered = True
            if prefetch is not None and not prefetch.gathered and prefetch.pending is None:
                prefetch.pending = self._gather(prefetch, async_op=True)
                prefetch.gathered = True

    def _free(self, unit) -> None:
        if unit.pending is not None:
            unit.pending.wait()
            unit.pending = None
        # Autograd saved the parameter objects, not their data: rebinding .data frees the
        # full buffer and the re-gather before backward binds a new one.
        unit.full.release()
        for p in unit.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        unit.gathered = False

    def _before_forward(self, unit) -> None:
        if recomputing():  # inside backward: gather this layer, prefetch nothing
            self._ensure_gathered(unit)
            return
        # Prefetch what followed this layer in the previous forward (the same on every rank).
        self._forward_seen.append(unit)
        self._ensure_gathered(unit, self._next_in_forward.get(unit.index))

    def _after_forward(self, unit, out) -> None:
        if recomputing():
            # The recomputed forward handed autograd this layer's parameters for the backward
            # about to run: it stays gathered until its gradients are launched (_launch frees).
            return
        self._free(unit)
        if not torch.is_grad_enabled():
            return
        regather = functools.partial(_regather, self._ref, unit, [False])
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(regather)

    def _regather(self, unit) -> None:
        """Stage 3, before ``unit``'s backward: gather it again, prefetching the one before."""
        prev = self._units[unit.index - 1] if unit.index > 0 else None
        self._ensure_gathered(unit, prev)

    # -- backward -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (full size) without communicating, as DDP's no_sync."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _on_grad(self, index: int) -> None:
        """The post-accumulate-grad hook of the ``index``-th hooked parameter."""
        if self._launcher.begin(self._ref, "_finish_backward"):
            self._launcher.reset()
        if self._sync:
            for k in self._launcher.ready(self._position[index]):
                self._launch(k)

    def _launch(self, k: int) -> None:
        """Start the reduction of the unit launched ``k``-th."""
        unit = self._launch_order[k]
        if self.stage == 1:
            grads = unit.grads
            for p, view in zip(unit.params, grads.views):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    self._rebind_grad(p, view)
            work = functional.all_reduce(grads.flat, "avg", comm=self.comm, async_op=True,
                                         algorithm=self.algorithm)
            self._launcher.started(k, (work, None, None))
            return
        # slot k mod PACKED held the launch PACKED before this one: it must have finished
        self._launcher.drain(self._complete, keep=min(PACKED, len(self._packing)) - 1)
        full, packed = unit.full, self._packing[k]
        for p, view in zip(unit.params, packed.views):
            if p.grad is not None:
                view.copy_(p.grad)
            else:
                view.zero_()
            p.grad = None
        packed.flat[full.numel:].zero_()   # the padding (another unit's gradients before)
        if self.stage == 3:
            self._free(unit)
        out = torch.empty(unit.shard_numel, dtype=full.dtype, device=full.device)
        work = functional.reduce_scatter_tensor(out, packed.flat, "avg", comm=self.comm,
                                                async_op=True, algorithm=self.algorithm)
        self._launcher.started(k, (work, out, packed))

    @staticmethod
    def _rebind_grad(p, view) -> None:
        """Put ``p``'s gradient back into its view of the flat gradients (after a user set it
        to None or replaced it)."""
        if p.grad is not None:
            view.copy_(p.grad)
        else:
            view.zero_()
        p.grad = view

    def _complete(self, k: int, launched) -> None:
        """Wait for the ``k``-th launch and hand its result to the shard's gradient."""
        unit = self._launch_order[k]
        work, out, _packed = launched
        work.wait()
        if self.stage == 1:
            s, lo = unit.shard_numel, self.rank
            unit.shard.grad = unit.grads.flat[lo * s:(lo + 1) * s]
        elif unit.shard.grad is None:
            unit.shard.grad = out
        else:
            unit.shard.grad.add_(out)

    def _finish_backward(self) -> None:
        self._launcher.end()
        if not self._sync:
            if self.stage == 3:
                for unit in self._units:
                    self._free(unit)
            return
        for k in self._launcher.rest():
            self._launch(k)
        self._launcher.drain(self._complete)
        if self.stage == 3:
            for unit in self._units:
                self._free(unit)
        self._synced_backward = True

    # -- state ----------------------------------------------------------------------------------
    def full_state_dict(self) -> dict:
        """Full tensors under ``module.state_dict()``'s names, identical on every rank."""
        with torch.no_grad():
            if self.stage == 3:
                for unit in self._units:
                    self._gather(unit)
                sd = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
                for unit in self._units:
                    self._free(unit)
                return sd
            self.forward_refresh()
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def forward_refresh(self) -> None:
        """Gather every shard that moved into the full parameters (stages 1 and 2)."""
        with torch.no_grad():
            for unit in self._units:
                if self.stage != 3 and unit.shard._version != unit.gathered_version:
                    if self.nranks > 1:
                        self._gather(unit)
                    unit.gathered_version = unit.shard._version

    def load_full_state_dict(self, state: dict) -> None:
        """Load full tensors (from a checkpoint at any number of ranks) into this rank's shards."""
        expected = dict(self.module.state_dict())
        for unit in self._units:  # stage 3's parameters are empty between uses
            for n, shape in zip(unit.names, unit.full.shapes):
                expected[n] = torch.empty(shape)
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        if missing or extra:
            raise KeyError(f"checkpoint does not match the model: missing {missing[:5]}, "
                           f"unexpected {extra[:5]}")
        for k, v in expected.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(f"checkpoint {k!r} has shape {tuple(state[k].shape)}, "
                                 f"the model's is {tuple(v.shape)}")
        names = {n for u in self._units for n in u.names}
        with torch.no_grad():
            for k, v in expected.items():
                if k not in names:
                    v.copy_(state[k])
            for unit in self._units:
                full = unit.like(unit.shard.dtype, unit.shard.device)
                full.copy_in([state[n] for n in unit.names])
                lo = self.rank * unit.shard_numel
                unit.shard.copy_(full.flat[lo:lo + unit.shard_numel])

    def _check_optimizer(self, optimizer) -> None:
        mine = {id(s) for s in self._shards}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in mine:
                    raise ValueError("the optimizer holds a tensor that is not one of this "
                                     "model's shards (build it from model.parameters())")

    def full_optim_state_dict(self, optimizer) -> dict:
        """The optimizer's state consolidated: ``{name: {key: full tensor or value}}``."""
        self._check_optimizer(optimizer)
        out: dict = {n: {} for u in self._units for n in u.names}
        for unit in self._units:
            st = optimizer.state.get(unit.shard, {})
            keys = self.comm.bcast(sorted(st), root=0)
            for key in keys:
                val = st[key]
                if torch.is_tensor(val) and val.numel() == unit.shard_numel and val.dim() == 1:
                    full = unit.like(val.dtype, val.device)
                    functional.all_gather_into_tensor(full.flat, val.contiguous(),
                                                      comm=self.comm, algorithm=self.algorithm)
                    for n, view in zip(unit.names, full.views):
                        out[n][key] = view.clone()
                else:
                    for n in unit.names:
                        out[n][key] = val.clone() if torch.is_tensor(val) else val
        return out

    def load_full_optim_state_dict(self, optimizer, state: dict) -> None:
        """Slice a consolidated optimizer state (from any number of ranks) into this rank's."""
        self._check_optimizer(optimizer)
        names = [n for u in self._units for n in u.names]
        if sorted(state) != sorted(names):
            raise KeyError("optimizer checkpoint names do not match the model's parameters")
        for unit in self._units:
            per = state[unit.names[0]]
            new = {}
            for key, val in per.items():
                if torch.is_tensor(val) and tuple(val.shape) == tuple(unit.full.shapes[0]) \
                        and val.dim() > 0:
                    full = unit.like(val.dtype, "cpu")
                    full.copy_in([state[n][key] for n in unit.names])
                    lo = self.rank * unit.shard_numel
                    new[key] = full.flat[lo:lo + unit.shard_numel].clone()
                else:
                    new[key] = val.clone() if torch.is_tensor(val) else val
            optimizer.state[unit.shard] = new

    # -- going on over fewer ranks (collectives.elastic) ------------------------------------------
    def rebuild(self, comm) -> None:
        """Go on over ``comm`` instead (collective over it): new units, padded for its size,
        and new hooks; the old hooks are removed now. The shards then hold rank 0's
        parameters of ``comm``: ``load_shards`` puts the committed state back. An optimizer
        over the old shards is moved to the new ones by ``load_shards``."""
        for handle in self._hooks:
            handle.remove()
        with torch.no_grad():
            for unit in self._units:
                for p, shape in zip(unit.params, unit.full.shapes):
                    p.grad = None
                    if tuple(p.shape) != tuple(shape):   # stage 3: freed between uses
                        p.data = torch.zeros(shape, dtype=unit.full.dtype,
                                             device=unit.full.device)
        self._previous_shards = list(self._shards)
        self._attach(comm)

    def shard_state(self, optimizer) -> dict:
        """This rank's part of the state, copied: per unit its flat shard and the optimizer's
        state of it; the module's buffers (whole on every rank); the rank count it is cut
        for. Local: no communication."""
        self._check_optimizer(optimizer)
        units = []
        with torch.no_grad():
            for unit in self._units:
                st = optimizer.state.get(unit.shard, {})
                units.append({"shard": unit.shard.detach().clone(),
                              "optim": {k: v.clone() if torch.is_tensor(v) else v
                                        for k, v in st.items()}})
        names = {n for u in self._units for n in u.names}
        buffers = {k: v.detach().clone() for k, v in self.module.state_dict().items()
                   if k not in names}
        return {"nranks": self.nranks, "units": units, "buffers": buffers}

    def load_shards(self, optimizer, parts: list) -> None:
        """Put back the state that ``shard_state`` cut into ``len(parts)`` shards (``parts[r]``:
        old rank r's, from whichever rank held it), resharded for this communicator; the
        optimizer's parameters are moved from the old shards to the new ones (by position).
        Every rank passes the same ``parts``."""
        previous = self._previous_shards
        if previous is not None:
            where = {id(p): k for k, p in enumerate(previous)}
            for group in optimizer.param_groups:
                group["params"] = [self._shards[where[id(p)]] if id(p) in where else p
                                   for p in group["params"]]
            for p in previous:
                optimizer.state.pop(p, None)
            self._previous_shards = None
        n = len(parts)
        if any(p["nranks"] != n for p in parts):
            raise ValueError(f"shards cut for {[p['nranks'] for p in parts]} ranks, {n} given")
        state, optim = dict(parts[0]["buffers"]), {}
        for k, unit in enumerate(self._units):
            flat = torch.cat([p["units"][k]["shard"] for p in parts])
            old_numel = parts[0]["units"][k]["shard"].numel()
            for name, view in zip(unit.names, _split(flat, unit.full.shapes)):
                state[name] = view
            for key, val in parts[0]["units"][k]["optim"].items():
                if torch.is_tensor(val) and val.dim() == 1 and val.numel() == old_numel:
                    full = torch.cat([p["units"][k]["optim"][key] for p in parts])
                    for name, view in zip(unit.names, _split(full, unit.full.shapes)):
                        optim.setdefault(name, {})[key] = view
                else:
                    for name in unit.names:
                        optim.setdefault(name, {})[key] = val
        self.load_full_state_dict(state)
        if optim:
            self.load_full_optim_state_dict(optimizer, optim)
        self.forward_refresh()

    # -- accounting -----------------------------------------------------------------------------
    def memory_report(self, optimizer=None) -> dict:
        """Bytes on this rank (unique storages) of parameters, gradients and optimizer state."""
        seen: set = set()

        def size(tensors):
            total = 0
            for t in tensors:
                if t is None or not torch.is_tensor(t):
                    continue
                st = t.untyped_storage()
                key = (st.data_ptr(), st.nbytes())
                if st.nbytes() == 0 or key in seen:
                    continue
                seen.add(key)
                total += st.nbytes()
            return total
        params = size([p for u in self._units for p in u.params] + list(self._shards))
        grads = size([p.grad for u in self._units for p in u.params]
                     + [s.grad for s in self._shards])
        opt = 0
        if optimizer is not None:
            self._check_optimizer(optimizer)
            opt = size([v for st in optimizer.state.values() for v in st.values()])
        numel = sum(u.full.numel for u in self._units)
        return {"parameters": params, "gradients": grads, "optimizer": opt,
                "total": params + grads + opt, "numel": numel,
                "bytes_per_parameter": (params + grads + opt) / max(numel, 1)}


# -- autograd and module hooks: weak references to the wrapper -----------------------------------
def _split(flat, shapes) -> list:
    """Views of ``flat`` (a unit's parameters end to end, then padding) per shape."""
    out, at = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        out.append(flat[at:at + n].view(shape))
        at += n
    return out


def _before_forward(ref, unit, module, args):
    sdp = ref()
    if sdp is not None:
        sdp._before_forward(unit)


def _after_forward(ref, unit, module, args, out):
    sdp = ref()
    if sdp is not None:
        sdp._after_forward(unit, out)


def _regather(ref, unit, fired, grad):
    sdp = ref()
    if sdp is not None and not fired[0]:
        fired[0] = True
        sdp._regather(unit)
    return grad


def _tensors(out):
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []
