"""``Mesh``: the ranks of a communicator laid out on a grid of named axes.

    mesh = Mesh((2, 2, 2), ("pp", "dp", "tp"))    # collective over COMM_WORLD (8 ranks)
    mesh.comm("tp")          # this rank's communicator along one axis
    mesh.comm(("dp", "tp"))  # several axes flattened into one communicator
    mesh.coord("pp"), mesh.size("dp"), mesh.shape, mesh.names
    mesh.group("tp")         # the same ranks as a torch ProcessGroup on the toolkit's backend
    mesh.communicators()     # every MPI communicator made so far (to revoke after a failure)
    mesh.free()              # collective: the communicators and the toolkit's state on them go

Vocabulary: a *coordinate* is a rank's position on every axis; ranks are laid out in row-major
order, so the *last axis varies fastest* and a group along it is consecutive ranks (a
tensor-parallel group sits on one node when the node holds a multiple of its size). A *group*
along a set of axes is the ranks that share their coordinates on every other axis; its ranks are
ordered as the mesh orders them (row-major over the chosen axes, in the mesh's axis order,
whatever order the caller names them in).

Walk through shape (2, 2), names ("dp", "tp") on 4 ranks: rank r has coordinates
(r // 2, r % 2); the "tp" groups are [0, 1] and [2, 3], the "dp" groups [0, 2] and [1, 3], the
("dp", "tp") group is [0, 1, 2, 3].

The MPI communicators come from one ``Create_cart`` (without reordering, so a rank's coordinates
follow from its rank in ``comm``) and one ``Cart.Sub`` per set of axes, made on first use and
cached: ``Sub`` is collective over the whole mesh, so every rank must ask for the same axis sets
in the same order, as with any collective. ``groups(shape, axes)`` is the same arithmetic as a
pure function, for tests and for torch's ``new_group``, which wants every group's ranks on every
rank.
"""
from __future__ import annotations

import math

__all__ = ["Mesh", "groups", "coordinates", "check_layout"]


def check_layout(shape, names, size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(shape, names)`` as tuples, or a ``ValueError``: a rank-symmetric check (it reads only
    the arguments and the communicator's size), so every rank raises it before communicating."""
    shape = tuple(shape)
    names = (names,) if isinstance(names, str) else tuple(names)
    if not shape or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape):
        raise ValueError(f"mesh shape {shape} must be one or more positive integers")
    if len(names) != len(shape):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes, names {names} "
                         f"{len(names)}")
    if any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"mesh axis names {names} must be non-empty strings")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"mesh axis names {names} repeat {repeated}")
    if math.prod(shape) != size:
        raise ValueError(f"mesh shape {shape} holds {math.prod(shape)} ranks, the "
                         f"communicator has {size}")
    return shape, names


def coordinates(rank: int, shape) -> tuple[int, ...]:
    """``rank``'s coordinates in row-major order (the last axis varies fastest)."""
    out = []
    for d in reversed(tuple(shape)):
        rank, c = divmod(rank, d)
        out.append(c)
    return tuple(reversed(out))


def _rank(coord, shape) -> int:
    r = 0
    for c, d in zip(coord, shape):
        r = r * d + c
    return r


def groups(shape, axes) -> list[list[int]]:
    """Every group along the axis indices ``axes``: the ranks sharing their coordinates on the
    other axes, each group ordered row-major over ``axes`` (in the mesh's order), the groups
    ordered by their lowest rank."""
    shape = tuple(shape)
    axes = sorted(set(axes))
    others = [i for i in range(len(shape)) if i not in axes]
    out = []
    for fixed in range(math.prod(shape[i] for i in others)):
        base = dict(zip(others, coordinates(fixed, [shape[i] for i in others])))
        members = []
        for inner in range(math.prod(shape[i] for i in axes)):
            coord = {**base, **dict(zip(axes, coordinates(inner, [shape[i] for i in axes])))}
            members.append(_rank([coord[i] for i in range(len(shape))], shape))
        out.append(members)
    return sorted(out)


class Mesh:
    """Named axes of sub-communicators over ``comm`` (default ``COMM_WORLD``); collective."""

    def __init__(self, shape, names, comm=None):
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        self._shape, self._names = check_layout(shape, names, comm.Get_size())
        self._cart = comm.Create_cart(list(self._shape), periods=[False] * len(self._shape),
                                      reorder=False)
        self._coord = coordinates(self._cart.Get_rank(), self._shape)
        self._comms = {}
        self._groups = {}

    @property
    def shape(self) -> tuple[int, ...]:
        """The number of ranks along each axis."""
        return self._shape

    @property
    def names(self) -> tuple[str, ...]:
        """The axes' names, outermost first."""
        return self._names

    @property
    def rank(self) -> int:
        """This rank in the mesh's communicator."""
        return self._cart.Get_rank()

    def _axes(self, axes) -> tuple[int, ...]:
        """Axis indices of a name or a tuple of names, in the mesh's order (checked)."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [n for n in names if n not in self._names]
        if unknown or not names:
            raise ValueError(f"mesh axes {names}: unknown {unknown}; the mesh has "
                             f"{self._names}")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axes {names} name an axis twice")
        return tuple(sorted(self._names.index(n) for n in names))

    def coord(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self._coord[self._axes(axis)[0]]

    def size(self, axes) -> int:
        """The number of ranks along ``axes`` (a name or a tuple of names)."""
        return math.prod(self._shape[i] for i in self._axes(axes))

    def ranks(self, axes) -> list[int]:
        """The mesh ranks of this rank's group along ``axes``, in group order."""
        idx = self._axes(axes)
        return next(g for g in groups(self._shape, idx) if self.rank in g)

    def comm(self, axes):
        """This rank's mpi4py communicator along ``axes`` (collective on first use per axis set,
        cached)."""
        idx = self._axes(axes)
        if idx not in self._comms:
            self._comms[idx] = self._cart.Sub([i in idx for i in range(len(self._shape))])
        return self._comms[idx]

    def communicators(self) -> list:
        """The MPI communicators this mesh has made so far: its cartesian one, then one per
        axis set asked for (what to revoke when a rank of the mesh fails)."""
        return [self._cart, *self._comms.values()]

    def free(self) -> None:
        """Free the mesh's communicators, in the order they were made (collective over the
        mesh). The toolkit's state on each goes with it (its context: the private duplicate,
        the shared windows of registered buffers), which otherwise lives as long as the
        process: MPI's tables of windows and communicators, which grow to the most that were
        ever alive at once, keep that high-water mark. Nothing built on the mesh (wrappers,
        pipelines, arrays in its registered buffers) may be used afterwards."""
        from mpi4py import MPI
        if MPI.Is_finalized():
            return
        for comm in self.communicators():
            if comm != MPI.COMM_NULL:
                comm.Free()
        self._comms = {}

    def group(self, axes):
        """This rank's group along ``axes`` as a torch ``ProcessGroup`` on the default group's
        backend (``collectives.torch.backend.init_process_group()`` first). Collective over the
        whole mesh on first use: torch's ``new_group`` is called for every group of the axes, on
        every rank, in the same order; non-members return at once."""
        import torch.distributed as dist
        idx = self._axes(axes)
        if idx not in self._groups:
            if not dist.is_initialized():
                raise RuntimeError("Mesh.group needs torch.distributed initialised: "
                                   "collectives.torch.backend.init_process_group()")
            if dist.get_world_size() != self._cart.Get_size():
                raise ValueError(f"Mesh.group: torch's default group has "
                                 f"{dist.get_world_size()} ranks, the mesh "
                                 f"{self._cart.Get_size()} (a mesh over COMM_WORLD is needed)")
            from mpi4py import MPI
            mine = None
            # torch numbers ranks as COMM_WORLD does; the mesh as its communicator does.
            here, world = self._cart.Get_group(), MPI.COMM_WORLD.Get_group()
            for members in groups(self._shape, idx):
                g = dist.new_group(list(MPI.Group.Translate_ranks(here, members, world)))
                if self.rank in members:
                    mine = g
            here.Free()
            world.Free()
            self._groups[idx] = mine
        return self._groups[idx]

    def __repr__(self):
        axes = ", ".join(f"{n}={d}" for n, d in zip(self._names, self._shape))
        return f"Mesh({axes}; rank {self.rank} at {self._coord})"
