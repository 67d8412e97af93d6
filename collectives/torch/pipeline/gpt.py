"""3-D parallelism for a GPT: pipeline stages x tensor parallelism x data parallelism.

    mesh = Mesh((pp, dp, tp), ("pp", "dp", "tp"))
    tensor_parallel.parallelize(model, mesh.comm("tp"), plan)     # every rank, the whole model
    job = pp.gpt.PipelinedGPT(model, mesh, schedule="1f1b", microbatches=4, loss_fn=loss_fn)
    loss = job.step(x, y); opt.step(); opt.zero_grad()           # opt over job.parameters()

The model is GPT-shaped: ``embed``, ``blocks`` (a ModuleList), ``norm`` and ``head``, run in
that order (examples/train_gpt.py's ``GPT``). ``stages(model, n)`` cuts it into n stage modules:
the first holds the embedding, the last the final norm and the head, the blocks are dealt out
as evenly as they go (earlier stages take the extra ones). Rank (pp = k) keeps the stages of
``schedule.local_stages(k)``; what it does not keep it never uses, and its parameters are
never trained there.

Activation checkpointing: ``recompute="full"`` (every block keeps its input only) or
``"selective"`` (the attention core) marks the model's modules before it is cut
(``collectives.torch.checkpoint``); a stage's backward recomputes them, in whatever order its
schedule runs the backwards (a split backward's B and W each recompute what they need).

Data parallelism: each stage module is wrapped in the toolkit's ``DistributedDataParallel``
(``zero=0``) or ``ShardedDataParallel`` stage 1 (``zero=1``) over ``mesh.comm("dp")``; the
runner runs every backward but a stage's last under ``no_sync()``, so the gradients are
reduced once per step, in the backward that finishes them.

The tied embedding and head. One process ties the head's weight to the embedding's; across a
pipeline the first stage holds the embedding and the last the head, two copies of one weight.
They start equal (the same seed everywhere) and stay equal: after the step the two gradients
are summed over the *tied group* (the first and last pipeline ranks with the same dp and tp
coordinates: with tensor parallelism both hold the same vocabulary shard), so both copies take
the same update, as Megatron's embedding group does.
"""
from __future__ import annotations

import torch
from torch import nn

from .runner import Pipeline
from .schedules import schedule as make_schedule

__all__ = ["Stage", "stages", "PipelinedGPT", "train"]


class Stage(nn.Module):
    """A contiguous piece of a GPT: the embedding (first stage), blocks, the norm and head
    (last stage)."""

    def __init__(self, blocks, embed=None, norm=None, head=None):
        super().__init__()
        self.embed, self.norm, self.head = embed, norm, head
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def stages(model: nn.Module, n: int) -> list[Stage]:
    """``model`` (embed, blocks, norm, head) cut into ``n`` stage modules sharing its modules."""
    blocks = list(model.blocks)
    if n < 1:
        raise ValueError(f"expecting at least one stage, got {n}")
    per, extra = divmod(len(blocks), n)
    out, at = [], 0
    for k in range(n):
        take = per + (k < extra)
        out.append(Stage(blocks[at:at + take], embed=model.embed if k == 0 else None,
                         norm=model.norm if k == n - 1 else None,
                         head=model.head if k == n - 1 else None))
        at += take
    return out


def _tied_group(mesh):
    """The communicator of this rank and its counterpart at the other end of the pipeline
    (None where the pipeline has one stage per end or this rank is in the middle)."""
    from mpi4py import MPI
    pp_comm = mesh.comm("pp")
    p, k = pp_comm.Get_size(), pp_comm.Get_rank()
    world = mesh.comm(mesh.names)
    # one colour per (dp, tp) position, for the two ends only; every rank of the mesh calls it
    others = [n for n in mesh.names if n != "pp"]
    colour = MPI.UNDEFINED
    if p > 1 and k in (0, p - 1):
        colour = 0
        for n in others:
            colour = colour * mesh.size(n) + mesh.coord(n)
    group = world.Split(colour, k)
    return None if group == MPI.COMM_NULL else group


class PipelinedGPT:
    """A GPT trained over a ("pp", "dp", "tp") mesh: pipeline runner, data-parallel wrappers,
    the tied embedding kept in step."""

    def __init__(self, model: nn.Module, mesh, schedule: str = "1f1b", microbatches: int = 4,
                 virtual: int = 1, loss_fn=None, zero: int = 0, recompute: str = "none"):
        from collectives.torch import DistributedDataParallel, ShardedDataParallel
        from collectives.torch.checkpoint import GPT_POLICIES, recompute as mark
        if recompute not in GPT_POLICIES:
            raise ValueError(f"recompute {recompute!r}: expected one of {', '.join(GPT_POLICIES)}")
        if GPT_POLICIES[recompute]:
            mark(model, GPT_POLICIES[recompute])
        pp_comm, dp_comm = mesh.comm("pp"), mesh.comm("dp")
        p, k = pp_comm.Get_size(), pp_comm.Get_rank()
        self.schedule = make_schedule(schedule, p, microbatches, virtual)
        cut = stages(model, p * virtual)
        mine = [cut[s] for s in self.schedule.local_stages(k)]
        if zero not in (0, 1):
            raise ValueError(f"pipelined stages take DistributedDataParallel (zero=0) or "
                             f"ZeRO stage 1 (zero=1), got zero={zero}")
        if dp_comm.Get_size() > 1:
            mine = [DistributedDataParallel(m, comm=dp_comm) if zero == 0
                    else ShardedDataParallel(m, stage=1, comm=dp_comm) for m in mine]
        self.stages = mine
        self.runner = Pipeline(mine, comm=pp_comm, schedule=self.schedule, loss_fn=loss_fn)
        self.first, self.last = k == 0, k == p - 1
        self.tied_group = _tied_group(mesh)
        ends = [m.module if hasattr(m, "module") else m for m in mine]
        self._tied = None
        if self.tied_group is not None:
            self._tied = (ends[0].embed.weight if self.first else ends[-1].head.weight)

    def communicators(self) -> list:
        """The communicators this job made for itself (the runner's, the tied pair's): what
        to revoke with the mesh's on a failure."""
        return [*self.runner.communicators(),
                *([self.tied_group] if self.tied_group is not None else [])]

    def rebuild(self, mesh) -> None:
        """Go on over ``mesh``, the survivors' after a failure (``collectives.elastic.mesh``:
        the same pipeline positions, fewer data-parallel replicas): the runner over its pp
        axis, each stage's data-parallel wrapper over its dp axis, the tied pair's group made
        again. Collective over ``mesh``."""
        self.runner.rebind(mesh.comm("pp"))
        for m in self.stages:
            if hasattr(m, "rebuild"):
                m.rebuild(mesh.comm("dp"))
        self.tied_group = _tied_group(mesh)

    def parameters(self):
        """What this rank's optimizer steps: its stages' parameters (its shards with ZeRO)."""
        seen = set()
        for m in self.stages:
            for q in m.parameters():
                if id(q) not in seen:
                    seen.add(id(q))
                    yield q

    def step(self, x=None, y=None) -> torch.Tensor:
        """One pipelined step (forward, backward, gradient reduction over dp and over the tied
        group); returns the loss of this data-parallel slice's batch on every pipeline rank."""
        loss = self.runner.step(x, y)
        if self._tied is not None:
            from collectives.torch import all_reduce
            g = self._tied.grad
            if g is None:
                g = self._tied.grad = torch.zeros_like(self._tied)
            all_reduce(g, comm=self.tied_group)
        return loss


def train(job: PipelinedGPT, optimizer, batches, steps: int, mesh, on_step=None):
    """``steps`` pipelined steps on ``batches(step) -> (x, y)`` (this data-parallel rank's
    rows); returns (losses averaged over dp, step times in seconds)."""
    import time

    import collectives as coll
    losses, times = [], []
    for step in range(steps):
        x, y = batches(step)
        t0 = time.perf_counter()
        loss = job.step(x if job.first else None, y if job.last else None)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
        value = loss.detach().reshape(1)
        if mesh.size("dp") > 1:
            value = coll.allreduce(value, op="avg", comm=mesh.comm("dp"))
        losses.append(float(value))
        if on_step:
            on_step(step, losses[-1])
    return losses, times
