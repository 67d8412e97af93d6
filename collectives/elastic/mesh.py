"""A ``Mesh`` with a data-parallel axis that survives a dead rank: the dead rank's replica (its
tensor-parallel group, or its pipeline) is dropped whole.

    emesh = elastic.ElasticMesh((2, 2), ("dp", "tp"))     # collective over COMM_WORLD
    tp.parallelize(module, emesh.mesh.comm("tp"), plan)
    model = DistributedDataParallel(module, comm=emesh.mesh.comm("dp"), algorithm="ring",
                                    registered_buckets=False)
    state = elastic.State(model=module, optimizer=opt)
    emesh.attach(state, module, model)
    @elastic.run(state, select=emesh.select, revoke=emesh.revoke)
    def train(state, comm): ...       # emesh.mesh: the mesh in force

The documented behaviour. A tensor-parallel (tp) group holds one copy of the model, cut in
``tp`` shards; the data-parallel (dp) axis holds ``dp`` such copies, equal bitwise (DDP). A dead
rank takes a shard of one copy with it, and no other rank holds that shard of that copy, but
every other complete tp group holds the whole model. So after a failure:

1. ``select`` (collective over the shrunk communicator): the survivors tell each other their
   coordinates in the old mesh; a tp group with all ``tp`` of its ranks alive is *complete*.
   The ranks of incomplete groups *leave*: they take part in the recovery to its end, then
   ``train()`` returns ``None`` on them (their processes end, by exiting normally). No complete
   group left is a ``RanksLost`` on every survivor.
2. ``rebuild`` (``attach``): the complete groups form a new mesh of ``dp'`` (their count) by
   ``tp``, in their old order, each rank at its old tp coordinate; the tensor-parallel layers
   go on over the new tp communicator (the same shards: a rank's tp coordinate is unchanged)
   and DDP over the new dp one.
3. The loop restores the commit: every rank kept its own shards and their optimizer state,
   which is the committed state of its copy. Nothing is resharded, so the run after the
   failure is the run of a ``dp' x tp`` job started from that commit, bitwise.

4 ranks as (dp=2, tp=2), rank 2 killed: tp groups [0, 1] and [2, 3]; [2, 3] is incomplete, so
rank 3 leaves and ranks 0 and 1 go on as (dp=1, tp=2). A further failure then leaves no
complete group: ``RanksLost``, by name. At (dp=3, tp=2) a failure leaves (dp=2, tp=2).

ZeRO over dp (stages 1 and 2) is rebuilt too: the dropped group takes one dp rank from every tp
coordinate, whose part its dp successor holds (``attach``).

Sequence parallelism goes on too: ``collectives.torch.tensor_parallel.rebind`` repoints its
layers and the gradient hooks of its replicated parameters.

A pipeline axis works alike: on a ("dp", "pp") mesh a replica is a whole pipeline, and a job
attached as ``pipeline=`` (``PipelinedGPT``) is rebuilt on the new mesh and its communicators
revoked with the mesh's.

Not covered: replacements (``select`` and ``replace`` exclude each other). torch's default
group on the toolkit's backend is made again over the ranks that go on, as without a mesh
(``State.rebuild``), and destroyed on those that leave.
"""
from __future__ import annotations

import math

from ..mesh import Mesh
from .loop import RanksLost

__all__ = ["ElasticMesh"]


class ElasticMesh:
    """A mesh with a data-parallel axis ``dp`` whose incomplete replicas are dropped after a
    failure (see the module doc); collective. A replica is the ranks that share a dp
    coordinate: one tensor-parallel group of a ("dp", "tp") mesh, one pipeline (of tp groups)
    of a ("dp", "pp"[, "tp"]) one."""

    def __init__(self, shape, names=("dp", "tp"), comm=None, dp: str = "dp", tp: str = "tp"):
        from .replace import name
        names = tuple(names)
        if names.count(dp) != 1 or len(set(names)) != len(names) or len(names) < 2:
            raise ValueError(f"ElasticMesh: names {names} must be distinct and hold the "
                             f"data-parallel axis {dp!r} and at least one other")
        self.names, self.dp, self.tp = names, dp, tp
        self.mesh = Mesh(shape, names, comm)
        self.inner = tuple(n for n in names if n != dp)        # a replica's axes
        self._inner_shape = tuple(self.mesh.size(n) for n in self.inner)
        self._made: list = []      # every communicator made for a mesh so far
        self._jobs: list = []      # what attach was given that made communicators of its own
        # The replicas by process name, in dp order, each in the order of its own axes:
        # dropping the incomplete ones is the same whether a rank applies it once or again on a
        # retry with fewer survivors.
        where = self.mesh.comm(names).allgather(
            (self.mesh.coord(dp), tuple(self.mesh.coord(n) for n in self.inner), name()))
        self.groups = [[n for _, _, n in sorted(g for g in where if g[0] == d)]
                       for d in range(self.mesh.size(dp))]

    def attach(self, state, module=None, model=None, pipeline=None) -> None:
        """Rebuild on the communicator that goes on after a failure: this mesh, ``module``'s
        tensor-parallel layers (``tensor_parallel.rebind``), ``model`` (a data-parallel
        wrapper over the dp axis: its ``rebuild``) and ``pipeline`` (a job over a "pp" axis with
        ``rebuild(mesh)`` and ``communicators()``: ``collectives.torch.pipeline.gpt.
        PipelinedGPT``). DDP: the State's model is ``module`` (each rank commits its own
        shards or stages, the committed state of its replica). ZeRO (``ShardedDataParallel``
        over dp, stage 1 or 2): the State's model is ``model``; its parts are kept around the
        dp ring (``collectives.elastic.zero``), and after a failure each replica position's
        dp ranks pool theirs, the dropped replica's from their copies, and cut them for the
        new dp size."""
        sharded = hasattr(state.model, "load_shards")
        if hasattr(state.model, "rebuild") and not sharded:
            raise ValueError("ElasticMesh.attach: give the State the inner module, not the "
                             "data-parallel wrapper (whose rebuild takes the dp communicator)")
        if sharded and state.model is not model:
            raise ValueError("ElasticMesh.attach: a sharded model (ZeRO over dp) is the "
                             "State's model and the one given here")
        if pipeline is not None:
            self._jobs.append(pipeline)

        def dp_axis(comm):
            self.rebuild(comm)
            if module is not None and self.tp in self.names:
                from ..torch.tensor_parallel import rebind
                rebind(module, self.mesh.comm(self.tp))
            if pipeline is not None:
                pipeline.rebuild(self.mesh)
            return self.mesh.comm(self.dp)

        if sharded:     # the State rebuilds it on the new dp axis, then pools its shards there
            state.model_comm = dp_axis
            return

        def rebuild(comm):
            dp = dp_axis(comm)
            if model is not None:
                model.rebuild(dp)
        state.on_rebuild(rebuild)

    def revoke(self) -> list:
        """Every communicator this mesh, and the jobs attached, have made (to revoke on a
        failure)."""
        return [*self._made, *self.mesh.communicators(),
                *(c for job in self._jobs for c in job.communicators())]

    def select(self, comm):
        """The survivors of complete replicas, as one communicator ordered by the new mesh
        (``None`` on a rank that leaves); collective over ``comm``, the shrunk communicator."""
        from mpi4py import MPI

        from ..mesh import coordinates
        from .replace import name
        alive = set(comm.allgather(name()))
        self.groups = [g for g in self.groups if alive.issuperset(g)]
        if not self.groups:
            raise RanksLost(f"no replica (a {' x '.join(self.inner)} group of "
                            f"{math.prod(self._inner_shape)} ranks) is complete among the "
                            f"{comm.Get_size()} survivors")
        me = name()
        at = next(((d, g.index(me)) for d, g in enumerate(self.groups) if me in g), None)
        if at is None:
            comm.Split(MPI.UNDEFINED, 0)
            return None
        coord = {self.dp: at[0], **dict(zip(self.inner, coordinates(at[1],
                                                                     self._inner_shape)))}
        key = 0
        for n, size in zip(self.names, self._shape(len(self.groups))):
            key = key * size + coord[n]
        kept = comm.Split(0, key)
        self._made.append(kept)
        return kept

    def _shape(self, groups: int) -> tuple:
        sizes = {self.dp: groups, **dict(zip(self.inner, self._inner_shape))}
        return tuple(sizes[n] for n in self.names)

    def rebuild(self, comm) -> None:
        """A new mesh over ``comm`` (``select``'s): the complete replicas along dp, the other
        axes kept."""
        self._made.extend(self.mesh.communicators())
        self.mesh = Mesh(self._shape(len(self.groups)), self.names, comm)
