"""Gradient communication into the next forward: ``DistributedDataParallel(overlap_forward=True)``.

    model = DistributedDataParallel(module, overlap_forward=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.attach_optimizer(opt)          # the model steps it, piece by piece
    for x, y in data:
        loss_fn(model(x), y).backward()  # returns while gradients are still on the wire
    model.synchronize()                  # every update applied (before eval or a checkpoint)

Plain DDP waits at the end of backward for every bucket, then the optimizer steps everything.
Here backward returns at once; each *piece* of gradient is stepped by the optimizer when its
allreduce completes, and the next forward waits, layer by layer, only for the pieces of the
parameters it is about to use (ByteScheduler, P3). The vocabulary:

* *piece*: consecutive parameters of one bucket and one module, closed once it holds at least
  ``PIECE_BYTES``, reduced by one allreduce of its slice of the bucket.
  Pieces are numbered in the order backward makes them ready: piece 0 holds the last layer.
  A bucket of several layers is split so that the first layer waits for its own piece, not
  for the whole bucket.
* *priority*: the next forward needs piece N-1 (the first layer) first and piece 0 last.
* *launch*: non-blocking collectives complete in start order on every rank (``functional``'s
  Works, the progress thread), so priority can only be given by the order pieces are started,
  and that order must be the same on every rank: it depends only on which gradients are
  ready, never on timing. During backward, pieces start in ready order while the bytes
  started stay within ``backward_share`` of the gradient bytes: those are the last layers',
  needed last, and they use the wire while backward computes. The rest are held and start
  when backward ends, in priority order (first layer first), so that the first layer's piece
  does not queue behind pieces the forward needs later.
* *finish*: wait for a piece's allreduce (earlier-started ones complete first), step the
  optimizer on its parameters (an optimizer per piece, built from the attached one, sharing
  its ``state`` and taking its hyperparameters when backward ends, so learning-rate
  schedulers and ``optimizer.state_dict()`` keep working). Between the end of backward and
  its piece's step a gradient lives in its bucket only (``.grad`` is None, so a
  ``zero_grad()`` cannot touch a buffer still on the wire); the next backward's first
  gradient is copied into the slot, one pass, as after ``zero_grad(set_to_none=True)``.
* *wait in forward*: a forward pre-hook on every module that owns parameters finishes the
  pieces holding them. A parameter whose module's forward did not run in the previous forward
  (a parameter used through ``torch.nn.functional`` by its parent) has its piece finished at
  the start of the forward instead. Whatever is still pending when the forward returns is
  finished then.

Walk through 4 pieces [p0 p1 p2 p3] of 8 MB each (p3 the first layer) with
``backward_share=0.5``: backward readies p0 and starts it, readies p1 and starts it (16 MB =
half), readies p2 and p3 and holds them; when backward ends p3 starts, then p2. The next
forward's first layer waits for p3 (behind p0 and p1 only if they are still on the wire),
its step, and computes while p2 moves; the second layer waits for p2, and so on.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from collectives import timeline, watchdog

__all__ = ["PIECE_BYTES", "BACKWARD_SHARE", "Piece", "pieces", "ForwardOverlap"]

PIECE_BYTES = 4 << 20   # a piece closes once it holds this much
BACKWARD_SHARE = 0.5    # the share of the gradient bytes started while backward runs


class Piece:
    """One allreduce of ``overlap_forward``: a slice of a bucket and its parameters."""

    __slots__ = ("index", "bucket", "start", "stop", "members", "views", "pending", "work",
                 "optimizer", "groups", "t_start")

    def __init__(self, index: int, bucket, start: int, stop: int, members):
        self.index = index
        self.bucket = bucket          # the Bucket whose flat tensor holds the piece
        self.start, self.stop = start, stop   # element range in bucket.flat
        self.members = list(members)  # parameter indices
        first = bucket.members.index(self.members[0])
        self.views = bucket.views[first:first + len(self.members)]  # their gradients
        self.pending = len(self.members)
        self.work = None              # the Work in flight; None when not started or finished
        self.optimizer = None         # steps the members (None: no member is optimized)
        self.groups = []              # (this optimizer's group, the attached one's group)
        self.t_start = 0.0

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.bucket.flat.element_size()

    def flat(self):
        """The piece's slice of its bucket."""
        return self.bucket.flat[self.start:self.stop]


def pieces(buckets, params, piece_bytes: int = PIECE_BYTES, owner=None) -> list[Piece]:
    """The buckets cut at parameter boundaries: a piece closes once it holds at least
    ``piece_bytes``, and where ``owner`` (a key per parameter: its module) changes."""
    out: list[Piece] = []
    for b in buckets:
        begin = offset = 0
        members: list[int] = []
        size = b.flat.element_size()
        for i in b.members:
            n = params[i].numel()
            if members and ((offset - begin) * size >= piece_bytes or
                            (owner is not None and owner[i] != owner[members[-1]])):
                out.append(Piece(len(out), b, begin, offset, members))
                begin, members = offset, []
            members.append(i)
            offset += n
        if members:
            out.append(Piece(len(out), b, begin, offset, members))
    return out


def _refuse_step(optimizer, args, kwargs):
    raise RuntimeError(f"this {type(optimizer).__name__} is attached to a "
                       f"DistributedDataParallel with overlap_forward=True, which steps it "
                       f"piece by piece as gradients arrive; do not call step() (use "
                       f"model.synchronize() to apply every pending update now)")


def _owners(module, params) -> list:
    """For each parameter, the first module of ``module.modules()`` that registers it."""
    index = {id(p): i for i, p in enumerate(params)}
    owner = [None] * len(params)
    for m in module.modules():
        for p in m.parameters(recurse=False):
            i = index.get(id(p))
            if i is not None and owner[i] is None:
                owner[i] = m
    return owner


class ForwardOverlap:
    """The pieces of one DDP and their schedule (see the module doc); DDP drives it."""

    def __init__(self, module, params, names, state, size: int):
        self.params = params
        self.names = names
        self.state = state            # the DefaultState: comm, algorithm, wire_bytes
        self.size = size
        self.backward_share = BACKWARD_SHARE
        self.piece_bytes = PIECE_BYTES
        self.optimizer = None
        self.algorithm = None
        self.owner = _owners(module, params)
        self.pieces: list[Piece] = []
        self.piece_of: list[int] = []
        self.by_module: dict = {}     # id(module) -> indices of the pieces it needs
        self.eager: list[int] = []    # pieces finished at the start of every forward
        self.fired: dict = {}         # id(module) -> its place among this forward's pre-hooks
        self.calls: dict = {}         # the same for the last complete forward
        self.priority: list[int] = [] # the order held pieces start in: first needed first
        self.in_flight: deque = deque()    # started and not finished, in start order
        self.next = 0                 # backward: the next piece in ready order to consider
        self.started_bytes = 0
        self.total_bytes = 0
        self.t_first = None           # when the first piece of this step started
        self.t_end = None             # when the last backward ended (None: nothing pending)
        self.blocked = 0.0            # seconds spent waiting since then

    # -- the plan ---------------------------------------------------------------------------
    def plan(self, buckets, algorithm=None) -> None:
        """Cut ``buckets`` into pieces (at construction and after a rebuild); none in flight.
        ``algorithm`` reduces the pieces (None: the state's), as DDP's buckets would be."""
        assert not self.in_flight, "pieces replanned while some are in flight"
        self.algorithm = algorithm
        self.pieces = pieces(buckets, self.params, self.piece_bytes,
                             [id(m) for m in self.owner])
        self.piece_of = [0] * len(self.params)
        for pc in self.pieces:
            for i in pc.members:
                self.piece_of[i] = pc.index
        self.total_bytes = sum(pc.nbytes for pc in self.pieces)
        by_module: dict = {}
        for i, m in enumerate(self.owner):
            by_module.setdefault(id(m), set()).add(self.piece_of[i])
        self.by_module = {k: sorted(v, reverse=True) for k, v in by_module.items()}
        self.eager = []
        self.priority = list(range(len(self.pieces) - 1, -1, -1))
        if self.optimizer is not None:
            self._build_optimizers()
        self.reset()

    def prioritize(self, comm) -> None:
        """Start held pieces in the order the last forward needed them (collective): a piece
        ranks by the first pre-hook among its parameters' modules (a module that did not run
        counts as the forward's start), ties in reverse ready order; rank 0's order, so the
        same on every rank."""
        from . import functional
        when = [min(self.calls.get(id(self.owner[i]), -1) for i in pc.members)
                for pc in self.pieces]
        order = torch.tensor(sorted(range(len(self.pieces)), key=lambda k: (when[k], -k)),
                             dtype=torch.int64)   # no forward recorded: reverse ready order
        if self.size > 1:
            functional.broadcast(order, 0, comm=comm)
        self.priority = order.tolist()

    def reset(self) -> None:
        """A new backward: every piece waits for all its gradients."""
        for pc in self.pieces:
            pc.pending = len(pc.members)
        self.next = 0
        self.started_bytes = 0

    def attach(self, optimizer) -> None:
        """Step ``optimizer`` piece by piece from now on."""
        mine = {id(p) for p in self.params}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in mine:
                    raise ValueError("attach_optimizer: the optimizer holds a tensor of shape "
                                     f"{list(p.shape)} that is not a parameter of this model "
                                     "that requires a gradient")
        self.optimizer = optimizer
        self._build_optimizers()
        optimizer.register_step_pre_hook(_refuse_step)

    def _build_optimizers(self) -> None:
        opt = self.optimizer
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        for pc in self.pieces:
            per_group: dict = {}
            for i in pc.members:
                g = group_of.get(id(self.params[i]))
                if g is not None:
                    per_group.setdefault(id(g), (g, []))[1].append(self.params[i])
            if not per_group:
                pc.optimizer, pc.groups = None, []
                continue
            spec = [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                    for g, ps in per_group.values()]
            try:
                pc.optimizer = type(opt)(spec, **opt.defaults)
            except TypeError as exc:
                raise TypeError(f"attach_optimizer: cannot build a {type(opt).__name__} per "
                                f"piece from its param_groups and defaults ({exc})") from exc
            pc.optimizer.state = opt.state   # one state: opt.state_dict() stays whole
            pc.groups = list(zip(pc.optimizer.param_groups,
                                 [g for g, _ in per_group.values()]))

    # -- backward -----------------------------------------------------------------------------
    def ready(self, index: int) -> None:
        """Parameter ``index``'s gradient is in its bucket (and divided by the rank count)."""
        pc = self.pieces[self.piece_of[index]]
        pc.pending -= 1
        budget = self.backward_share * self.total_bytes
        while self.next < len(self.pieces):
            pc = self.pieces[self.next]
            if pc.pending or self.started_bytes + pc.nbytes > budget:
                break
            self._start(pc)
            self.next += 1

    def end_backward(self, t_end: float) -> None:
        """Backward is over: start the held pieces, first needed first. Each piece's
        optimizer takes the attached one's hyperparameters now, when plain DDP's step would
        run (a scheduler stepped after backward applies from the next step on)."""
        for pc in self.pieces:
            for mine, theirs in pc.groups:
                for key, value in theirs.items():
                    if key != "params":
                        mine[key] = value
        for k in self.priority:
            pc = self.pieces[k]
            if k >= self.next:
                assert pc.pending == 0, f"piece {k} ended backward with missing gradients"
                self._start(pc)
        self.next = len(self.pieces)
        # Until its piece steps, a reduced gradient lives in its bucket only, out of reach of
        # zero_grad(set_to_none=False), which would zero a buffer still on the wire.
        for p in self.params:
            p.grad = None
        if self.t_end is None:
            self.t_end = t_end
            self.blocked = 0.0

    def _start(self, pc: Piece) -> None:
        names = [self.names[i] for i in pc.members]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        with watchdog.label(f"DDP piece {pc.index} of {len(self.pieces)}: {shown}"):
            pc.work = self.state.all_reduce(pc.flat(), self.algorithm)
        self.started_bytes += pc.nbytes
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if timeline.on:
            pc.t_start = timeline.now()
        self.in_flight.append(pc)

    # -- finishing ------------------------------------------------------------------------------
    def finish(self, index: int) -> bool:
        """Finish piece ``index`` and every piece started before it; whether any waited."""
        pc = self.pieces[index]
        if pc.work is None:
            return False
        while pc.work is not None:
            self._finish_oldest()
        return True

    def finish_all(self) -> bool:
        """Finish every piece in flight; whether there were any."""
        if not self.in_flight:
            return False
        while self.in_flight:
            self._finish_oldest()
        return True

    def _finish_oldest(self) -> None:
        pc = self.in_flight.popleft()
        work, pc.work = pc.work, None
        t0 = time.perf_counter()
        work.wait()
        self.blocked += time.perf_counter() - t0
        if timeline.on:
            timeline.span_event(f"piece {pc.index}", "bucket", pc.t_start, timeline.now(),
                                {"piece": pc.index, "bytes": pc.nbytes})
        if pc.optimizer is not None:
            # The step sees the reduced gradients; what .grad held (None, or the gradient of
            # a backward that began since) is put back after.
            kept = [self.params[i].grad for i in pc.members]
            for i, view in zip(pc.members, pc.views):
                self.params[i].grad = view
            pc.optimizer.step()
            for i, g in zip(pc.members, kept):
                self.params[i].grad = g

    def pending(self) -> bool:
        """Whether some piece has not been finished."""
        return bool(self.in_flight)

    def done(self):
        """Once nothing is pending: seconds from the first piece's start, from the end of
        backward, and blocked waiting (None if that step was accounted already)."""
        if self.t_end is None or self.in_flight:
            return None
        now = time.perf_counter()
        after = now - self.t_end
        out = (now - self.t_first, after, min(self.blocked, after))
        self.t_end = self.t_first = None
        return out

    # -- forward --------------------------------------------------------------------------------
    def forward_starts(self) -> None:
        """Before the module runs: finish the eager pieces; count the pre-hooks from here."""
        self.fired = {}
        for k in self.eager:
            self.finish(k)

    def before(self, module) -> None:
        """A forward pre-hook: finish the pieces of ``module``'s own parameters."""
        self.fired.setdefault(id(module), len(self.fired))
        for k in self.by_module.get(id(module), ()):
            self.finish(k)

    def forward_ends(self) -> None:
        """The module returned: pieces whose modules did not run are awaited from the start
        of the next forward on; anything still pending is finished now."""
        late = {self.piece_of[i] for i, m in enumerate(self.owner) if id(m) not in self.fired}
        self.eager = sorted(late, key=self.priority.index)
        self.calls = self.fired
        self.finish_all()
