"""``State``: what a training loop must keep to survive a dead rank, committed in memory.

    state = State(model=model, optimizer=opt, step=0, data=sampler, epoch=0)
    for state.step in range(state.step, steps):
        ...                       # one training step
        state.commit()            # step ``state.step`` is done

A *commit* is a copy, on this rank, of the model's ``state_dict`` (its tensors cloned), the
optimizer's ``state_dict`` (deep-copied), the data's ``state_dict`` (when it has one), every
extra value given by keyword (an object with ``state_dict`` and ``load_state_dict``, such as an
averager of ``collectives.torch.averaging`` or a learning-rate scheduler, by its state, loaded
back into it on a restore; and one with a ``rebuild(comm)`` as well is rebuilt after the model),
and the *next step*: ``state.step + 1``. The last two commits are
kept: after a failure, a survivor may have committed one step more than another (its last
collective completed, theirs failed), and the survivors agree on the older one
(``collectives.elastic.loop``). ``restore(next_step)`` loads the commit with that next step back
into the same objects (parameters are copied in place, so an optimizer keeps its references) and
sets ``state.step`` to it. A ``ShardedDataParallel`` model commits its own shards and their
optimizer state, and a copy of its predecessor's (``collectives.elastic.zero``).

Objects built on a communicator (DDP, ZeRO, a Mesh, a torch process group) are rebuilt on the
shrunk one by the callables given to ``on_rebuild(fn)`` (``fn(comm)``), called before the
restore; a model that has a ``rebuild(comm)`` method of its own (``DistributedDataParallel``,
``ShardedDataParallel``) is rebuilt without one, and so is torch's default process group where
it is the toolkit's backend (``collectives.torch.backend.rebuild``: the groups made from it, and
torch's own DDP over them, are the callables' to make again).
"""
from __future__ import annotations

import copy
import time
from collections import deque

__all__ = ["State", "Commit", "Saved", "torch_backend"]


class Commit:
    """One committed state: the next step and the copies (see the module doc). ``readers``
    counts those that still read it after the commit (a checkpoint being written): while it is
    not 0, the commit's tensors are not reused for a newer one."""

    __slots__ = ("next_step", "model", "optimizer", "data", "extra", "readers")

    def __init__(self, next_step, model, optimizer, data, extra):
        self.next_step, self.model, self.optimizer = next_step, model, optimizer
        self.data, self.extra = data, extra
        self.readers = 0


def _copy(value, into=None):
    """A copy of ``value`` (tensors, and dicts and lists of them: state dicts): a tensor copied
    into ``into``'s tensor at the same place where that has its shape and dtype (a commit that
    is being dropped: no fresh allocation, whose pages the kernel would zero every step),
    else cloned; anything else deep-copied."""
    if hasattr(value, "detach"):
        if (hasattr(into, "copy_") and into.shape == value.shape and into.dtype == value.dtype
                and into.device == value.device):
            return into.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        old = into if isinstance(into, dict) else {}
        return {k: _copy(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, list):
        old = into if isinstance(into, list) and len(into) == len(value) else [None] * len(value)
        return [_copy(v, o) for v, o in zip(value, old)]
    return copy.deepcopy(value)


class State:
    """What a training loop keeps: ``model``, ``optimizer``, ``step``, ``data`` and extras."""

    def __init__(self, model=None, optimizer=None, step: int = 0, data=None, **extra):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self.model, self.optimizer, self.step, self.data = model, optimizer, step, data
        self.extra = dict(extra)
        self.commits: deque = deque(maxlen=2)
        self.rebuilders: list = []
        self.listeners: list = []   # fn(commit): called after each commit (checkpoints)
        self.restore_listeners: list = []   # fn(commit): called after each restore
        self.comm = None            # the communicator in force (set by the loop)
        self.recoveries: list = []  # one ``Recovery`` per failure survived (the loop's)
        self.committed_at = 0.0     # time.monotonic() of the newest commit
        # fn(comm) -> the communicator the model is rebuilt on, from the one that goes on (a
        # mesh's dp axis: collectives.elastic.mesh); None: that one
        self.model_comm = None

    def __getattr__(self, name):
        extra = self.__dict__.get("extra")
        if extra is not None and name in extra:
            return extra[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        extra = self.__dict__.get("extra")
        if extra is not None and name in extra:
            extra[name] = value
        else:
            object.__setattr__(self, name, value)

    def on_rebuild(self, fn) -> None:
        """Call ``fn(comm)`` with the shrunk communicator after a failure, before the
        restore: rebuild there what was built on the old one."""
        self.rebuilders.append(fn)

    def on_restore(self, fn) -> None:
        """Call ``fn(commit)`` after each restore (the commit training goes on from)."""
        self.restore_listeners.append(fn)

    # -- commit and restore -------------------------------------------------------------------
    def snapshot(self, next_step: int, into: Commit | None = None) -> Commit:
        """A commit of the current state whose next step is ``next_step`` (not kept); its
        tensors copied into ``into``'s, a commit no longer needed, where they fit."""
        model = None if self.model is None else _model_state(self, into)
        opt = None if self.optimizer is None else _optim_state(self, into)
        data = None
        if self.data is not None and hasattr(self.data, "state_dict"):
            data = copy.deepcopy(self.data.state_dict())
        extra = {k: Saved(copy.deepcopy(v.state_dict())) if _stateful(v) else copy.deepcopy(v)
                 for k, v in self.extra.items()}
        return Commit(next_step, model, opt, data, extra)

    def commit(self) -> None:
        """Step ``self.step`` is done: keep a copy of the state (the next step is
        ``self.step + 1``). The oldest commit kept, which this one pushes out, lends its
        tensors unless something still reads it."""
        spare = None
        if len(self.commits) == self.commits.maxlen and not self.commits[0].readers:
            spare = self.commits[0]
        self.keep(self.snapshot(self.step + 1, spare))

    def keep(self, commit: Commit) -> None:
        """Keep ``commit`` as the newest (the older of the two kept goes)."""
        self.commits.append(commit)
        self.committed_at = time.monotonic()
        for fn in self.listeners:
            fn(commit)

    @property
    def committed(self) -> int:
        """The next step of the newest commit (-1 before any)."""
        return self.commits[-1].next_step if self.commits else -1

    def committed_steps(self) -> tuple[int, ...]:
        """The next steps of the commits kept, oldest first."""
        return tuple(c.next_step for c in self.commits)

    def find(self, next_step: int) -> Commit:
        """The kept commit whose next step is ``next_step``."""
        for c in self.commits:
            if c.next_step == next_step:
                return c
        raise LookupError(f"no commit with next step {next_step} on this rank (it keeps "
                          f"{self.committed_steps()})")

    def restore(self, next_step: int | None = None) -> None:
        """Load the commit with ``next_step`` (default: the newest) into the objects and set
        ``step`` to it; newer commits are dropped."""
        c = self.commits[-1] if next_step is None else self.find(next_step)
        while self.commits and self.commits[-1] is not c:
            self.commits.pop()
        self.load(c)
        for fn in self.restore_listeners:
            fn(c)

    def load(self, c: Commit) -> None:
        """Load ``c`` into the objects (the commit itself is not kept)."""
        if c.model is not None:
            _load_model(self, c.model)
        if c.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(c.optimizer))
        if c.data is not None:
            self.data.load_state_dict(copy.deepcopy(c.data))
        for k, v in c.extra.items():
            if isinstance(v, Saved) and _stateful(self.extra.get(k)):
                self.extra[k].load_state_dict(copy.deepcopy(v.state))
            else:
                self.extra[k] = copy.deepcopy(v)
        self.step = c.next_step

    def rebuild(self, comm) -> None:
        """Rebuild what was built on the old communicator on ``comm`` (collective): torch's
        default group where it is the toolkit's backend on the old communicator
        (``collectives.torch.backend.rebuild``), then the model, then the ``on_rebuild``
        callables (which make again what torch's groups carried: subgroups, torch's DDP)."""
        old, self.comm = self.comm, comm
        backend = torch_backend()
        if backend is not None and old is not None:
            backend.rebuild(old, comm)
        rebuild = getattr(self.model, "rebuild", None)
        if rebuild is not None:
            rebuild(comm if self.model_comm is None else self.model_comm(comm))
        for value in self.extra.values():
            if _stateful(value) and callable(getattr(value, "rebuild", None)):
                value.rebuild(comm)        # an averager: after the DDP it drives
        for fn in self.rebuilders:
            fn(comm)


class Saved:
    """An extra's ``state_dict()`` in a commit: loaded back into the object, which stays."""

    __slots__ = ("state",)

    def __init__(self, state):
        self.state = state


def _stateful(value) -> bool:
    """An object that saves and loads its own state (an averager, a scheduler)."""
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def torch_backend():
    """``collectives.torch.backend`` where the program has loaded it (elastic training never
    imports torch itself), else None."""
    import sys
    return sys.modules.get("collectives.torch.backend")


# A sharded model (ShardedDataParallel) keeps a part of the state per rank, and the
# optimizer's state of that part: both are committed together, with a redundant copy
# (collectives.elastic.zero).
def _sharded(model) -> bool:
    return hasattr(model, "shard_state") and hasattr(model, "load_shards")


def _model_state(state, into=None):
    if _sharded(state.model):
        from . import zero
        return zero.commit(state.model, state.optimizer)
    return _copy(state.model.state_dict(), None if into is None else into.model)


def _load_model(state, saved) -> None:
    if _sharded(state.model):
        from . import zero
        zero.restore(state.model, state.optimizer, saved, state.model.comm)
    else:
        state.model.load_state_dict(saved)


def _optim_state(state, into=None):
    if _sharded(state.model):
        return None
    return _copy(state.optimizer.state_dict(), None if into is None else into.optimizer)
