"""``pp.Pipeline``: run a schedule's actions on this rank's stages, over MPI point-to-point.

    runner = pp.Pipeline(stage_module, comm=pp_comm, schedule=sched, loss_fn=loss_fn)
    loss = runner.step(x, target)     # x used on the first stage, target on the last

The runner walks ``sched.actions(rank)`` in order, the same list ``pp.verify`` proved and
``pp.simulate`` priced:

1. F runs the stage on its input (the micro-batch of x, the previous stage's output on this
   rank, or what a receive brought) and keeps input and output for the backward; on the last
   stage the output goes through ``loss_fn`` and is weighted by the micro-batch's share of the
   batch, so that the summed gradients are those of one process on the whole batch (a
   ``loss_fn`` that takes the mean over its micro-batch, as torch's losses do by default).
2. B is ``autograd.backward`` from the output (the loss on the last stage) with the gradient
   the next stage sent; with a split backward (``zero_bubble``) B asks autograd for the
   input's gradient alone and keeps the graph, and W later runs it into the weights.
3. A send is an ``Isend`` of the tensor's bytes, completed at the end of the step (or earlier
   once done), so a rank never waits for a receiver; a receive takes its message by tag.

Messages go through ``collectives.p2p``. The runner works on its own ``Dup`` of ``comm``; a
message's tag names it (direction, micro-batch, receiving stage), so messages match by name
whatever order they arrive in. A receive probes for any message from its peer (``Improbe``)
and files what it finds by tag until its own is there. Shapes are learned: the first message
of a (direction, micro-batch, stage) is preceded by p2p's typed header (dtype and shape), and
later ones only when the shape or dtype changes (a new sequence length); both sides remember
the last shape per message name, so they agree on when a header comes, and MPI's
non-overtaking rule (one sender, one receiver, one communicator, a probe that matches any
tag) delivers the header first. A message whose bytes are not its header's is a
``MessageSizeError``; a gradient whose shape is not the shape of the output it belongs to is
an error naming both stages.

Failures. An exception in a stage is raised again as ``PipelineError`` naming the stage, the
rank and the action; uncaught, the toolkit's hook (``collectives.abort``) ends the whole job.
Receives and the step's last sends wait in p2p's one wait: it polls and yields the core on a
busy node (``COLLECTIVES_WAIT``, as the executor's waits do) and is watched, so a rank whose
neighbour died or hangs is reported by the watchdog (the stage, and the activation or gradient
it waits for and from which rank) and the job aborted at ``COLLECTIVES_TIMEOUT``.
"""
from __future__ import annotations

import contextlib

import torch

import collectives as coll
from collectives import p2p
from collectives.errors import CollectiveError

from .schedules import B, F, RECV_F, SEND_B, SEND_F, W, Schedule
from .verify import verify

__all__ = ["Pipeline", "PipelineError"]


class PipelineError(CollectiveError):
    """A stage raised, or neighbouring stages disagree about a tensor."""


class Pipeline:
    """Execute ``schedule``'s actions for this rank's stages over ``comm`` (one rank per
    pipeline position; default ``COMM_WORLD``).

    ``stage_module``: this rank's stage, or a list of its ``schedule.virtual`` stages
    (stages r, r + p, ...: ``[stages[s] for s in schedule.local_stages(rank)]``).
    ``loss_fn(output, target)`` runs on the last stage.
    """

    def __init__(self, stage_module, comm=None, schedule: Schedule | None = None,
                 loss_fn=None):
        from mpi4py import MPI
        if schedule is None:
            raise ValueError("Pipeline needs a schedule: pp.schedule(name, stages, microbatches)")
        if loss_fn is None:
            raise ValueError("Pipeline needs loss_fn(output, target) for the last stage")
        base = comm if comm is not None else MPI.COMM_WORLD
        if base.Get_size() != schedule.ranks:
            raise ValueError(f"the schedule is for {schedule.ranks} pipeline ranks, the "
                             f"communicator has {base.Get_size()}")
        modules = list(stage_module) if isinstance(stage_module, (list, tuple)) \
            else [stage_module]
        if len(modules) != schedule.virtual:
            raise ValueError(f"expecting {schedule.virtual} stage module(s) on this rank "
                             f"(virtual={schedule.virtual}), got {len(modules)}")
        verify(schedule)
        self.comm = base.Dup()
        self.rank = self.comm.Get_rank()
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.modules = {s: mod for s, mod in zip(schedule.local_stages(self.rank), modules)}
        self._actions = schedule.actions(self.rank)
        # A stage wrapped for data parallelism (DistributedDataParallel, ShardedDataParallel)
        # reduces its gradients in the backward that finishes them: the stage's last
        # weight-gradient action; the others run under its no_sync() and only accumulate.
        grad_kind = W if schedule.split_backward else B
        self._syncs_at = {s: max(i for i, a in enumerate(self._actions)
                                 if a[0] == grad_kind and a[2] == s) for s in self.modules}
        top = 4 * schedule.microbatches * schedule.stages
        ub = self.comm.Get_attr(MPI.TAG_UB)
        if ub is not None and top > ub:
            raise ValueError(f"{schedule.microbatches} micro-batches x {schedule.stages} stages "
                             f"need tags up to {top}; this MPI allows {ub}")
        self._sent_shape: dict = {}      # message -> (dtype, shape) last sent
        self._known_shape: dict = {}     # message -> (dtype, shape) last announced to us
        self._mailbox: dict = {}         # tag -> tensor received before its turn
        self.headers_sent = 0            # how many shape headers this rank has sent
        self.peak = 0                    # most (micro-batch, stage) activations held, last step
        self._status = MPI.Status()

    def parameters(self):
        """The parameters of this rank's stages."""
        for mod in self.modules.values():
            yield from mod.parameters()

    # -- messages -------------------------------------------------------------------------
    def _tag(self, direction: str, mb: int, stage: int, header: bool = False) -> int:
        return ((mb * self.schedule.stages + stage) * 2 + (direction == B)) * 2 + header

    def _send(self, t: torch.Tensor, direction: str, mb: int, stage: int, sends: p2p.Sends):
        dest = self.schedule.rank_of(stage)
        t = t.detach().contiguous()
        key = (direction, mb, stage)
        sig = (t.dtype, tuple(t.shape))
        if self._sent_shape.get(key) != sig:
            try:
                hdr = p2p.header(t.dtype, t.shape)
            except (TypeError, ValueError) as exc:
                raise PipelineError(f"stage {stage - 1 if direction == F else stage + 1} "
                                    f"cannot send a {t.dtype} tensor of shape "
                                    f"{tuple(t.shape)}: {exc}") from None
            sends.add(self.comm.Isend(hdr, dest, self._tag(*key, header=True)), hdr)
            self._sent_shape[key] = sig
            self.headers_sent += 1
        sends.add(p2p.isend(self.comm, t, dest, self._tag(*key)), t)

    def _recv(self, direction: str, mb: int, stage: int, source: int) -> torch.Tensor:
        """The tensor of message (direction, mb, stage), filing others from ``source``."""
        want = self._tag(direction, mb, stage)
        if want not in self._mailbox:
            sched = self.schedule
            p2p.wait(lambda: self._file(source, want),
                     lambda: f"pipeline stage {stage} (rank {self.rank} of {sched.ranks}, "
                             f"{sched.name})",
                     lambda: f"{'the activation' if direction == F else 'the gradient'} of "
                             f"micro-batch {mb} from rank {source} (tag {want})", self.comm)
        return self._mailbox.pop(want)

    def _file(self, source: int, want: int) -> bool:
        """Receive what has arrived from ``source``, filing it by tag: whether message ``want``
        is in the mailbox now."""
        from mpi4py import MPI
        status = self._status
        while want not in self._mailbox:
            msg = self.comm.Improbe(source, MPI.ANY_TAG, status)
            if msg is None:
                return False
            tag = status.Get_tag()
            d, s = (tag >> 1) & 1, tag >> 2
            key = (B if d else F, s // self.schedule.stages, s % self.schedule.stages)
            if tag & 1:
                self._known_shape[key] = p2p.recv_header(msg)
                continue
            if key not in self._known_shape:
                raise PipelineError(f"stage {key[2]} (rank {self.rank}) got data for {key} "
                                    f"from rank {source} before its header")
            t = p2p.empty(*self._known_shape[key], kind="torch")
            p2p.recv_probed(msg, status, t, lambda: f"pipeline stage {key[2]} (rank "
                                                    f"{self.rank}), message {key}")
            self._mailbox[tag] = t
        return True

    # -- the step -------------------------------------------------------------------------
    def communicators(self) -> list:
        """The communicator the runner's messages go over (to revoke on a failure)."""
        return [self.comm]

    def rebind(self, comm) -> None:
        """Send over ``comm`` from now on: a group of the same size with this rank at the same
        position (the survivors' pipeline after a failure: ``collectives.elastic.mesh``);
        the old duplicate is left as it is, and what was sent or filed over it (shapes
        announced, messages received early) is forgotten. Collective over ``comm`` (one
        ``Dup``)."""
        if (comm.Get_size(), comm.Get_rank()) != (self.comm.Get_size(), self.rank):
            raise ValueError(f"rebind: the pipeline has {self.comm.Get_size()} ranks and this "
                             f"one at {self.rank}, the new group {comm.Get_size()} and "
                             f"{comm.Get_rank()}: the stages would not match")
        self.comm = comm.Dup()
        self._sent_shape.clear()
        self._known_shape.clear()
        self._mailbox.clear()

    def step(self, x=None, target=None) -> torch.Tensor:
        """One training step's forward and backward over every micro-batch; gradients are
        accumulated into this rank's stages' parameters (zero them between steps). Returns
        the batch's loss on every rank."""
        sched, r = self.schedule, self.rank
        S = sched.stages
        xs = ts = shares = None
        if 0 in self.modules:
            if x is None:
                raise ValueError("the first stage needs the batch x")
            xs = self._chunks(x, "x")
        if S - 1 in self.modules:
            if target is None:
                raise ValueError("the last stage needs the target")
            ts = self._chunks(target, "target")
            total = sum(len(t) for t in ts)
            shares = [len(t) / total for t in ts]
        inputs, outputs, grads, in_grads = {}, {}, {}, {}
        sends = p2p.Sends()
        loss = torch.zeros((), dtype=torch.float64)
        self.peak = 0
        for i, (kind, mb, s) in enumerate(self._actions):
            try:
                if kind == F:
                    if s == 0:
                        inp = xs[mb]
                    elif (mb, s) in inputs:
                        inp = inputs[(mb, s)]
                    else:                       # the previous stage is on this rank
                        inp = outputs[(mb, s - 1)].detach()
                        if inp.is_floating_point():
                            inp.requires_grad_()
                    inputs[(mb, s)] = inp
                    out = self.modules[s](inp)
                    if s == S - 1:
                        out = self.loss_fn(out, ts[mb]) * shares[mb]
                        loss += out.detach().double()
                    outputs[(mb, s)] = out
                    # the graphs this rank holds: one per (micro-batch, stage) until its backward
                    self.peak = max(self.peak, len(outputs))
                elif kind == B:
                    with self._accumulating(s, i):
                        self._backward(mb, s, inputs, outputs, grads, in_grads)
                elif kind == W:
                    out, g = outputs.pop((mb, s)), grads.pop((mb, s), None)
                    # a data-parallel wrapper's parameters() may be its shards (ZeRO): the
                    # graph's leaves are the wrapped module's own parameters
                    inner = getattr(self.modules[s], "module", self.modules[s])
                    params = [q for q in inner.parameters() if q.requires_grad]
                    if params:
                        with self._accumulating(s, i):
                            torch.autograd.backward(out, g, inputs=params)
                    inputs.pop((mb, s), None)
                elif kind == SEND_F:
                    self._send(outputs[(mb, s)], F, mb, s + 1, sends)
                elif kind == SEND_B:
                    self._send(in_grads.pop((mb, s)), B, mb, s - 1, sends)
                elif kind == RECV_F:
                    t = self._recv(F, mb, s, sched.rank_of(s - 1))
                    if t.is_floating_point():
                        t.requires_grad_()
                    inputs[(mb, s)] = t
                else:  # RECV_B
                    g = self._recv(B, mb, s, sched.rank_of(s + 1))
                    out = outputs[(mb, s)]
                    if g.shape != out.shape or g.dtype != out.dtype:
                        raise PipelineError(
                            f"stage {s + 1} (rank {sched.rank_of(s + 1)}) sent a gradient of "
                            f"{g.dtype} {tuple(g.shape)} for micro-batch {mb}, but stage {s} "
                            f"(rank {r}) produced an output of {out.dtype} {tuple(out.shape)}")
                    grads[(mb, s)] = g
            except PipelineError:
                raise
            except Exception as exc:
                raise PipelineError(f"pipeline stage {s} (rank {r} of {sched.ranks}) raised "
                                    f"{type(exc).__name__} in action {i} {kind}({mb}, {s}) of "
                                    f"{sched.name}: {exc}") from exc
            if len(sends) > 64:          # release the buffers of sends already delivered
                sends.reap()
        sends.wait(f"pipeline stage(s) {sorted(self.modules)} (rank {r} of {sched.ranks}, "
                   f"{sched.name}): the step's last sends", self.comm)
        coll.broadcast(loss.numpy(), root=sched.rank_of(S - 1), comm=self.comm)
        return loss.float()

    def _accumulating(self, s: int, i: int):
        """``no_sync()`` of stage s's data-parallel wrapper unless action i finishes its
        gradients (a plain module: nothing)."""
        no_sync = getattr(self.modules[s], "no_sync", None)
        if no_sync is None or i == self._syncs_at[s]:
            return contextlib.nullcontext()
        return no_sync()

    def _backward(self, mb, s, inputs, outputs, grads, in_grads):
        out = outputs[(mb, s)]
        g = grads.get((mb, s))
        inp = inputs[(mb, s)]
        wants = s > 0 and inp.requires_grad
        if self.schedule.split_backward:
            # the first stage's input gradient too when the batch asks for one (x.requires_grad)
            if inp.requires_grad:
                got, = torch.autograd.grad(out, inp, g, retain_graph=True)
                if s > 0:
                    in_grads[(mb, s)] = got
        else:
            torch.autograd.backward(out, g)
            outputs.pop((mb, s)), grads.pop((mb, s), None), inputs.pop((mb, s))
            if wants:
                in_grads[(mb, s)] = inp.grad
        if s > 0 and self.schedule.rank_of(s - 1) == self.rank:
            # the previous stage is on this rank: hand the gradient over in memory
            grads[(mb, s - 1)] = in_grads.pop((mb, s))

    def _chunks(self, t: torch.Tensor, what: str) -> list:
        m = self.schedule.microbatches
        if len(t) < m:
            raise ValueError(f"{what} has {len(t)} rows, fewer than the {m} micro-batches")
        return list(torch.tensor_split(t, m))
