"""Synchronising less: average the model every few steps instead of the gradients every step.

    from collectives.torch import averaging
    avg = averaging.Periodic(model, period=8, warmup=100)          # local SGD / post-local SGD
    avg = averaging.Hierarchical(model, {4: node_comm, 32: None})  # often in a node, rarely across
    avg = averaging.DiLoCo(model, opt, outer="nesterov", outer_lr=0.7, period=64)
    for x, y in shard:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        avg.step()                                                 # after opt.step(), every step

Every rank trains its own copy of the model on its shard; ``step()`` counts optimizer steps
and, when the period says so, makes the copies one again:

* ``Periodic``: local SGD (Lin et al. 2020). After step t (counted from 1) past the warm-up,
  every ``period`` steps, the parameters and floating-point buffers are replaced by their mean
  over ``comm``.
* ``Hierarchical``: several periods, each with its communicator (hierarchical SGD, torch's
  ``HierarchicalModelAverager``): after a step, the largest period that divides the steps
  since the warm-up picks the communicator that averages; the communicators must nest (the
  ranks of a smaller period's communicator inside the larger's).
* ``DiLoCo`` (Douillard et al. 2023): every ``period`` steps the mean over ranks of the
  *pseudo-gradient* (global copy - local parameters) is the gradient of an outer optimizer
  (SGD with Nesterov momentum 0.9 and ``outer_lr`` by default) that steps a global copy of the
  parameters; every rank then starts again from the global copy. Buffers are averaged.

1. *What is averaged.* Parameters that require gradients, and every floating-point (or
   complex) buffer: BatchNorm's running statistics are averaged too, which torch's averagers
   leave apart. Integer buffers (BatchNorm's ``num_batches_tracked``) stay local: every rank
   counts its own forwards, and ranks that step together count alike.
2. *One allreduce a round.* The averaged tensors are copied into one flat buffer per dtype and
   device (``flat.FlatBuffer``), allocated once (one buffer for a model of one dtype), averaged
   in place by one allreduce (``op="avg"``, which cannot overflow where the mean does not,
   float16 and bfloat16 included) and copied back. Results are bitwise identical on every rank.
3. *Warm-up* (post-local SGD: ``warmup`` steps of every-step synchronous training first).
   With a ``collectives.torch.DistributedDataParallel`` model the warm-up is the DDP as it is
   (its own average with its fast paths, or the comm hook registered on it); when it ends the
   averager registers ``hooks.noop_hook`` on the DDP's comm state, so backward sends nothing,
   and turns the DDP's buffer broadcast at each forward off (the buffers are averaged with the
   parameters instead). That is what torch's ``post_localSGD_hook`` does by counting
   iterations inside the hook; one object that counts the steps can switch the hook instead.
   The optimizer sees DDP's gradients during the warm-up, so any optimizer trains as under
   DDP. With a plain module there is no gradient exchange to use: the parameters and buffers
   are averaged after every warm-up step, which gives DDP's parameters for SGD with or without
   momentum (the update is linear in the gradient) but not for Adam.
4. *Agreement.* At construction every rank checks its arguments, then one agreement
   (``agreement.agree``: a small allreduce of a digest) on the outermost communicator
   compares every setting the ranks must share (the kind of averager,
   the periods, the warm-up, DiLoCo's outer optimizer and learning rate, whether the model is
   a DDP): a bad value on one rank or a setting that differs is a ``ValueError`` on every rank
   naming it and the ranks' values, never a hang. The averaged tensors' names, shapes and
   dtypes are compared as DDP compares its parameters
   (``agreement.same_parameters``), and every rank starts from rank 0's values
   (``agreement.broadcast_coalesced``; a DDP has done both already).
5. *Bytes.* ``payload_bytes`` is what this rank handed to collectives for synchronisation:
   the flat buffers of its averaging rounds, and with a DDP model the warm-up's gradient
   buckets (what the DDP's comm state counted, ``wire_bytes``, since the averager began).
   ``bytes_sent`` is what a bandwidth-optimal allreduce (ring, Rabenseifner) sends per rank
   for that payload:
   payload x 2 (n-1) / n on each communicator of n ranks (0 on one rank), the volume behind
   nccl-tests' bus bandwidth. It is the figure to compare across methods; the algorithm that
   ``auto`` picks for a small payload may send more (recursive doubling sends payload x log2 n).
   ``bytes_per_step()`` divides it by ``step_count``.

``state_dict()`` / ``load_state_dict()`` hold the step counter and the byte counts, and
DiLoCo's global copy and outer optimizer state (the inner optimizer is the caller's to save).
"""
from __future__ import annotations

import copy
import numbers
import weakref

import torch
from torch import nn

from collectives import timeline, watchdog

from . import functional
from .agreement import agree, broadcast_coalesced, same_parameters
from .ddp import DistributedDataParallel
from .flat import FlatBuffer
from .hooks import noop_hook

__all__ = ["Periodic", "Hierarchical", "DiLoCo", "pick_level", "bandwidth_bytes", "OUTER"]

OUTER = ("nesterov", "sgd")  # DiLoCo's outer optimizers by name
_DRIVEN: weakref.WeakSet = weakref.WeakSet()  # the DDPs an averager drives (one each)


def pick_level(local_step: int, periods) -> int | None:
    """The index of the largest of ``periods`` (increasing) that divides ``local_step`` (the
    steps since the warm-up, from 1), or None: which level averages after that step."""
    for k in range(len(periods) - 1, -1, -1):
        if local_step % periods[k] == 0:
            return k
    return None


def bandwidth_bytes(payload: int, size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal allreduce of ``payload`` bytes over ``size``
    ranks: payload x 2 (size-1) / size, rounded down."""
    return payload * 2 * (size - 1) // size


# -- checks -------------------------------------------------------------------------------------
def _int_error(name: str, value, least: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        return f"{name} must be an integer >= {least}, got {value!r}"
    return None


def _nesting_error(periods, comms) -> str | None:
    """Whether each level's communicator lies inside the next one's (on this rank)."""
    from mpi4py import MPI
    for k in range(len(comms) - 1):
        inner, outer = comms[k], comms[k + 1]
        gi, go = inner.Get_group(), outer.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(gi, list(range(gi.Get_size())), go)
        finally:
            gi.Free()
            go.Free()
        if MPI.UNDEFINED in ranks:
            return (f"the communicator of period {periods[k]} ({inner.Get_size()} ranks) is "
                    f"not inside that of period {periods[k + 1]} ({outer.Get_size()} ranks); "
                    f"the communicators must nest, smaller periods inside larger ones")
    return None


def _floating(t) -> bool:
    return t.is_floating_point() or t.is_complex()


def _level_colors(comms) -> list[int]:
    """For each inner level, the outermost communicator's rank of that level's rank 0 on
    this rank: the same on every member of one group, and a label the survivors of the group
    share after a failure (``_Averager.rebuild``)."""
    from mpi4py import MPI
    outer = comms[-1].Get_group()
    colors = []
    for c in comms[:-1]:
        group = c.Get_group()
        colors.append(MPI.Group.Translate_ranks(group, [0], outer)[0])
        group.Free()
    outer.Free()
    return colors


class _Group(FlatBuffer):
    """The averaged tensors of one dtype and device (parameters first) in one flat buffer."""

    __slots__ = ("tensors", "names", "nparams")

    def __init__(self, named_params, named_buffers):
        named = named_params + named_buffers
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]
        self.nparams = sum(t.numel() for _, t in named_params)
        first = self.tensors[0]
        super().__init__([t.shape for t in self.tensors], first.dtype, first.device)

    def pack(self) -> None:
        self.copy_in(self.tensors)

    def unpack(self) -> None:
        self.copy_out(self.tensors)


# -- the averagers ------------------------------------------------------------------------------
class _Averager:
    """What the averagers share: the levels (period, communicator), the warm-up, the flat
    buffers, the agreement at construction, the step counter and the byte counts."""

    kind = "averager"

    def __init__(self, model, levels, warmup, extra_settings: dict, local_error=None):
        from mpi4py import MPI
        if not isinstance(model, nn.Module):
            raise TypeError(f"{self.kind}: model must be a torch.nn.Module, got "
                            f"{type(model).__name__}")
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.module = model.module if self.ddp is not None else model
        default = self.ddp.comm if self.ddp is not None else MPI.COMM_WORLD
        self.periods = [p for p, _ in levels]
        self.comms = [default if c is None else c for _, c in levels]
        for p, c in zip(self.periods, self.comms):
            if not isinstance(c, MPI.Comm) or c == MPI.COMM_NULL:  # nothing to agree over
                raise TypeError(f"{self.kind}: the communicator of period {p} is {c!r}, not "
                                f"an mpi4py communicator")
        self.comm = self.comms[-1]   # the outermost: the agreement and the warm-up's averaging
        self.warmup = warmup

        # 1. This rank's own checks; then every rank learns every rank's verdict and settings.
        error = local_error
        for p in self.periods:
            error = error or _int_error("period", p, 1)
        error = error or _int_error("warmup", warmup, 0)
        if error is None and list(self.periods) != sorted(set(self.periods)):
            error = f"periods must be distinct and increasing, got {self.periods}"
        if error is None:
            error = self._comm_error()
        params = [(n, p) for n, p in self.module.named_parameters()
                  if p.requires_grad and _floating(p)]
        buffers = [(n, b) for n, b in self.module.named_buffers() if _floating(b)]
        for n, t in params + buffers:
            if error is None and t.layout != torch.strided:
                error = f"{n!r} has layout {t.layout}; only dense tensors are averaged"
        settings = {"kind": self.kind,
                    "model": "DistributedDataParallel" if self.ddp is not None else "module",
                    "periods" if len(levels) > 1 else "period":
                        self.periods if len(levels) > 1 else self.periods[0],
                    "warmup": warmup, **extra_settings}
        agree(self.comm, self.kind, settings, error)
        same_parameters(params + buffers, self.comm, self.kind)
        if self.ddp is None:
            broadcast_coalesced([t for _, t in params + buffers], 0, self.comm)

        # 2. One flat buffer per dtype and device, allocated once.
        keys = list(dict.fromkeys((t.dtype, t.device) for _, t in params + buffers))
        self.groups = [_Group([(n, t) for n, t in params if (t.dtype, t.device) == key],
                              [(n, t) for n, t in buffers if (t.dtype, t.device) == key])
                       for key in keys]
        self.sizes = [c.Get_size() for c in self.comms]
        self._colors = _level_colors(self.comms)
        self.step_count = 0
        self.rounds = 0                          # averaging rounds done (warm-up ones included)
        self.payload = [0] * len(levels)         # bytes handed to allreduces, per level

        # 3. A DDP: its gradient payload from here on is the warm-up's.
        self.local = False      # past the warm-up: a DDP's backward sends nothing
        self.warmup_payload = 0
        if self.ddp is not None:
            _DRIVEN.add(self.ddp)
            self._wire0 = self._ddp_wire_bytes()
        if warmup == 0:
            self._end_warmup()

    def _comm_error(self) -> str | None:
        from mpi4py import MPI
        error = _nesting_error(self.periods, self.comms)
        if error is None and self.ddp is not None:
            if self.ddp in _DRIVEN:
                return "this DistributedDataParallel is driven by another averager already"
            if MPI.Comm.Compare(self.ddp.comm, self.comm) not in (MPI.IDENT, MPI.CONGRUENT):
                return (f"the DistributedDataParallel's communicator "
                        f"({self.ddp.comm.Get_size()} ranks) is not the averaging one "
                        f"({self.comm.Get_size()} ranks); its warm-up synchronises the ranks "
                        f"that average")
        return error

    def communicators(self) -> list:
        """The communicators it averages over, innermost first (what a failure revokes:
        ``collectives.elastic``)."""
        return list(self.comms)

    def rebuild(self, comm) -> None:
        """Go on over ``comm``, the survivors of a failure (``collectives.elastic``; collective
        over it): the outermost level becomes ``comm``, and each inner level is made again
        from it with the survivors of its old group (``comm.Split``: the nesting holds). A
        DDP model is rebuilt by its owner first (the elastic ``State`` does so), so that its
        communicator is ``comm`` again. The step count, the warm-up and the flat buffers go
        on; commit the averager's ``state_dict`` to go back with the model."""
        inner = [comm.Split(color, comm.Get_rank()) for color in self._colors]
        self.comms = inner + [comm]
        self.comm = comm
        self.sizes = [c.Get_size() for c in self.comms]
        self._colors = _level_colors(self.comms)

    # -- the training loop ------------------------------------------------------------------
    def step(self) -> None:
        """Count one optimizer step (call it after ``optimizer.step()``, every step) and
        average if the period says so."""
        self.step_count += 1
        t = self.step_count
        if t <= self.warmup:
            if self.ddp is None:   # a plain module: the warm-up averages every step
                self._average(len(self.comms) - 1)
            if t == self.warmup:
                self._end_warmup()
            return
        k = pick_level(t - self.warmup, self.periods)
        if k is not None:
            self._round(k)

    def _ddp_wire_bytes(self) -> int:
        return getattr(self.ddp.comm_state, "wire_bytes", 0)

    def _end_warmup(self) -> None:
        if self.ddp is not None and not self.local:
            self.warmup_payload = self._ddp_wire_bytes() - self._wire0
            # The same state keeps the DDP's byte count; backward sends nothing from now on,
            # and buffers are averaged with the parameters rather than broadcast every forward.
            self.ddp.register_comm_hook(self.ddp.comm_state, noop_hook)
            self.ddp.broadcast_buffers = False
        self.local = True

    def _round(self, k: int) -> None:
        """What the period does at level ``k``."""
        self._average(k)

    def _average(self, k: int) -> None:
        """Every averaged tensor := its mean over level ``k``'s communicator."""
        self.rounds += 1
        if self.sizes[k] == 1:
            return
        t0 = timeline.now() if timeline.on else 0.0
        with torch.no_grad():
            for g in self.groups:
                g.pack()
                self._allreduce(g.flat, k)
                g.unpack()
        if timeline.on:
            timeline.span_event("average", "phase", t0, timeline.now(),
                                {"period": self.periods[k], "ranks": self.sizes[k]})

    def _allreduce(self, flat, k: int) -> None:
        """``flat`` := its mean over level ``k``'s communicator, in place."""
        comm, n = self.comms[k], self.sizes[k]
        with watchdog.label(f"{self.kind}: averaging {flat.numel()} elements over {n} ranks "
                            f"(period {self.periods[k]}, step {self.step_count})"):
            functional.all_reduce(flat, "avg", comm=comm)
        self.payload[k] += flat.numel() * flat.element_size()

    # -- what it cost -----------------------------------------------------------------------
    @property
    def payload_bytes(self) -> int:
        """Bytes this rank handed to collectives to synchronise: averaging rounds, and with a
        DDP model the warm-up's gradient buckets."""
        return sum(self.payload) + self._gradient_payload()

    def _gradient_payload(self) -> int:
        """A DDP's gradient payload in the warm-up (so far, while it lasts)."""
        if self.ddp is None or self.local:
            return self.warmup_payload
        return self._ddp_wire_bytes() - self._wire0

    @property
    def bytes_sent(self) -> int:
        """Bytes a bandwidth-optimal allreduce sends from this rank for ``payload_bytes``:
        payload x 2 (n-1) / n on each communicator of n ranks."""
        sent = sum(bandwidth_bytes(p, n) for p, n in zip(self.payload, self.sizes))
        if self.ddp is not None:
            sent += bandwidth_bytes(self._gradient_payload(), self.ddp.size)
        return sent

    def bytes_per_step(self) -> float:
        """``bytes_sent`` per optimizer step so far (0.0 before the first)."""
        return self.bytes_sent / self.step_count if self.step_count else 0.0

    @property
    def averaged_bytes(self) -> int:
        """The size of one averaging round's payload (every flat buffer)."""
        return sum(g.flat.numel() * g.flat.element_size() for g in self.groups)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The step counter and the byte counts (DiLoCo adds its global copy and outer state)."""
        return {"kind": self.kind, "step_count": self.step_count, "rounds": self.rounds,
                "payload": list(self.payload),
                "warmup_payload": self._gradient_payload()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: the next ``step()`` continues its count."""
        if state.get("kind") != self.kind:
            raise ValueError(f"{self.kind}.load_state_dict: the state is a "
                             f"{state.get('kind')!r}'s")
        if len(state["payload"]) != len(self.payload):
            raise ValueError(f"{self.kind}.load_state_dict: the state has "
                             f"{len(state['payload'])} levels, this averager "
                             f"{len(self.payload)}")
        self.step_count = int(state["step_count"])
        self.rounds = int(state["rounds"])
        self.payload = [int(p) for p in state["payload"]]
        if self.step_count >= self.warmup:
            self._end_warmup()
        if self.ddp is not None and not self.local:   # the warm-up goes on from here
            self._wire0 = self._ddp_wire_bytes() - int(state["warmup_payload"])
        self.warmup_payload = int(state["warmup_payload"])

    def __repr__(self):
        return (f"{self.kind}(periods={self.periods}, warmup={self.warmup}, "
                f"step_count={self.step_count}, bytes_sent={self.bytes_sent})")


class Periodic(_Averager):
    """Local SGD: the parameters and floating buffers averaged over ``comm`` (default: the
    DDP's communicator, else ``COMM_WORLD``) every ``period`` steps after ``warmup`` steps of
    every-step synchronisation (post-local SGD)."""

    kind = "Periodic"

    def __init__(self, model, period: int = 8, warmup: int = 0, comm=None):
        super().__init__(model, [(period, comm)], warmup, {})
        self.period = period


class Hierarchical(_Averager):
    """Averaging at several periods, each over its communicator (``{period: comm}``, in any
    order; None: the DDP's communicator, else ``COMM_WORLD``): after a step, the largest
    period that divides the steps since the warm-up averages over its communicator. The
    communicators must nest, smaller periods' inside larger ones'."""

    kind = "Hierarchical"

    def __init__(self, model, periods: dict, warmup: int = 0):
        if not isinstance(periods, dict) or not periods:
            raise TypeError(f"Hierarchical: periods must be a non-empty dict "
                            f"{{period: communicator}}, got {periods!r}")
        levels = list(periods.items())
        if all(isinstance(p, numbers.Real) for p, _ in levels):
            levels.sort(key=lambda kv: kv[0])   # any other key is reported by the checks
        super().__init__(model, levels, warmup, {"levels": len(levels)})


class DiLoCo(_Averager):
    """DiLoCo: every ``period`` steps an outer optimizer (``outer``: "nesterov", SGD with
    Nesterov momentum ``outer_momentum``; or "sgd", plain SGD) steps a global copy of the
    parameters with the mean over ranks of (global copy - local parameters) as its gradient;
    the local parameters then take the global copy's values and the buffers their mean.
    ``inner_optimizer`` is the optimizer the caller steps every step."""

    kind = "DiLoCo"

    def __init__(self, model, inner_optimizer, outer: str = "nesterov", outer_lr: float = 0.7,
                 period: int = 64, comm=None, *, warmup: int = 0, outer_momentum: float = 0.9):
        error = None
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            error = (f"inner_optimizer must be a torch.optim.Optimizer, got "
                     f"{type(inner_optimizer).__name__}")
        elif outer not in OUTER:
            error = f"outer must be one of {', '.join(map(repr, OUTER))}, got {outer!r}"
        elif isinstance(outer_lr, bool) or not isinstance(outer_lr, numbers.Real) \
                or not 0 < outer_lr < float("inf"):
            error = f"outer_lr must be a positive number, got {outer_lr!r}"
        elif isinstance(outer_momentum, bool) or not isinstance(outer_momentum, numbers.Real) \
                or not 0 <= outer_momentum < 1:
            error = f"outer_momentum must be in [0, 1), got {outer_momentum!r}"
        else:
            mine = {id(p) for p in model.parameters()}
            if any(id(p) not in mine for grp in inner_optimizer.param_groups
                   for p in grp["params"]):
                error = "inner_optimizer steps parameters that are not the model's"
        self.inner_optimizer = inner_optimizer
        self.outer_name = outer
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum if outer == "nesterov" else 0.0
        self.global_params: list = []   # set before the base's end of warm-up snapshots them
        self.outer = None
        self._ready = False
        super().__init__(model, [(period, comm)], warmup,
                         {"outer": outer, "outer_lr": outer_lr,
                          "outer_momentum": self.outer_momentum}, local_error=error)
        self.period = period
        # The global copy (one flat leaf per group, the parameters' part) and the outer
        # optimizer, allocated once; each flat buffer's parameter part is the outer gradient.
        self.global_params = [g.flat.new_empty(g.nparams) for g in self.groups if g.nparams]
        for gp, g in zip(self.global_params, (g for g in self.groups if g.nparams)):
            gp.grad = g.flat[:g.nparams]
        if self.global_params:
            kw = {"momentum": outer_momentum, "nesterov": True} if outer == "nesterov" else {}
            self.outer = torch.optim.SGD(self.global_params, lr=outer_lr, **kw)
        self._ready = True
        self._snapshot()

    def _end_warmup(self) -> None:
        super()._end_warmup()
        if self._ready:
            self._snapshot()

    def _snapshot(self) -> None:
        """The global copy := the parameters (the same on every rank here)."""
        with torch.no_grad():
            for gp, g in zip(self.global_params, (g for g in self.groups if g.nparams)):
                g.pack()
                gp.copy_(g.flat[:g.nparams])

    def _round(self, k: int) -> None:
        """1. pseudo-gradient = global copy - local parameters, into the flat buffer;
        2. one allreduce averages it (and the buffers); 3. the outer optimizer steps the
        global copy; 4. parameters := global copy, buffers := their mean."""
        self.rounds += 1
        t0 = timeline.now() if timeline.on else 0.0
        with torch.no_grad():
            owners = [g for g in self.groups if g.nparams]
            for g in self.groups:
                g.pack()
            for gp, g in zip(self.global_params, owners):
                pseudo = g.flat[:g.nparams]
                torch.sub(gp, pseudo, out=pseudo)
            if self.sizes[k] > 1:
                for g in self.groups:
                    self._allreduce(g.flat, k)
            if self.outer is not None:
                self.outer.step()
            for gp, g in zip(self.global_params, owners):
                g.flat[:g.nparams].copy_(gp)
            for g in self.groups:
                g.unpack()
        if timeline.on:
            timeline.span_event("outer step", "phase", t0, timeline.now(),
                                {"period": self.periods[k], "ranks": self.sizes[k]})

    def global_state(self) -> dict:
        """The global copy by parameter name (views into it)."""
        out = {}
        for gp, g in zip(self.global_params, (g for g in self.groups if g.nparams)):
            offset = 0
            for name, view in zip(g.names, g.views):
                if offset >= g.nparams:
                    break
                out[name] = gp[offset:offset + view.numel()].view(view.shape)
                offset += view.numel()
        return out

    def state_dict(self) -> dict:
        """The base's, a copy of the global copy (by parameter name) and of the outer
        optimizer's state."""
        sd = super().state_dict()
        sd["global"] = {n: t.clone() for n, t in self.global_state().items()}
        # A snapshot: the optimizer's own state_dict() refers to its live momentum buffers.
        sd["outer"] = copy.deepcopy(self.outer.state_dict()) if self.outer is not None else None
        return sd

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: counters, global copy and outer optimizer state."""
        super().load_state_dict(state)
        mine = self.global_state()
        theirs = state["global"]
        if set(theirs) != set(mine):
            missing = sorted(set(mine) - set(theirs))[:4]
            extra = sorted(set(theirs) - set(mine))[:4]
            raise ValueError(f"DiLoCo.load_state_dict: the global copy's names differ "
                             f"(missing {missing}, unexpected {extra})")
        with torch.no_grad():
            for name, view in mine.items():
                view.copy_(theirs[name])
        if self.outer is not None and state["outer"] is not None:
            self.outer.load_state_dict(state["outer"])
            for gp, g in zip(self.global_params, (g for g in self.groups if g.nparams)):
                gp.grad = g.flat[:g.nparams]   # loading may not replace it, but keep it certain
