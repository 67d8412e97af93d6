"""collectives.Mesh: the group arithmetic in one process (every shape of up to 4 axes and 16
ranks, against groups computed from coordinates), then the MPI communicators and torch groups
at every rank count the job has."""
import itertools
import math
import os

import numpy as np
import pytest

from collectives.mesh import check_layout, coordinates, groups

pytestmark = pytest.mark.timeout(120)


def _shapes(max_axes=4, max_ranks=16):
    for k in range(1, max_axes + 1):
        for shape in itertools.product(range(1, max_ranks + 1), repeat=k):
            if math.prod(shape) <= max_ranks:
                yield shape


def _by_coordinates(shape, axes):
    """Groups from first principles: ranks whose coordinates agree off ``axes``, in rank order
    (row-major over the remaining axes is rank order, the last axis fastest)."""
    keyed = {}
    for r in range(math.prod(shape)):
        c = np.unravel_index(r, shape)  # numpy's C order: the last axis varies fastest
        keyed.setdefault(tuple(int(c[i]) for i in range(len(shape)) if i not in axes),
                         []).append(r)
    return sorted(keyed.values())


def test_coordinates_are_row_major():
    for shape in _shapes():
        for r in range(math.prod(shape)):
            assert coordinates(r, shape) == tuple(int(c) for c in np.unravel_index(r, shape))


def test_groups_match_coordinates():
    count = 0
    for shape in _shapes():
        for k in range(1, len(shape) + 1):
            for axes in itertools.combinations(range(len(shape)), k):
                got = groups(shape, axes)
                assert got == _by_coordinates(shape, axes), (shape, axes)
                # the groups of a set of axes partition the ranks, each of the axes' size
                assert sorted(r for g in got for r in g) == list(range(math.prod(shape)))
                assert {len(g) for g in got} == {math.prod(shape[i] for i in axes)}
                count += 1
    assert count > 1000


def test_groups_ignore_the_order_axes_are_named_in():
    assert groups((2, 3, 2), (2, 0)) == groups((2, 3, 2), (0, 2))
    assert groups((2, 2), (1,)) == [[0, 1], [2, 3]]
    assert groups((2, 2), (0,)) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("shape, names, size, words", [
    ((2, 2), ("dp", "tp"), 6, "holds 4 ranks, the communicator has 6"),
    ((2, 3), ("dp",), 6, "has 2 axes, names ('dp',) 1"),
    ((2, 2), ("tp", "tp"), 4, "repeat ['tp']"),
    ((0, 2), ("dp", "tp"), 0, "positive integers"),
    ((), (), 1, "positive integers"),
    ((2, 2), ("dp", ""), 4, "non-empty strings"),
])
def test_bad_layouts(shape, names, size, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        check_layout(shape, names, size)


def _factorizations(n, k):
    """Every shape of k axes whose product is n."""
    return [s for s in itertools.product(range(1, n + 1), repeat=k) if math.prod(s) == n]


@pytest.mark.mpi
def test_mesh_communicators_match_groups():
    from mpi4py import MPI

    from collectives import Mesh
    from mpiutil import assert_all
    import collectives as coll
    world = MPI.COMM_WORLD
    n, me = world.Get_size(), world.Get_rank()
    msgs = []
    for k in (1, 2, 3):
        for shape in _factorizations(n, k):
            names = ("pp", "dp", "tp")[3 - k:]
            mesh = Mesh(shape, names)
            if mesh.shape != shape or mesh.names != names:
                msgs.append(f"{shape}: shape/names {mesh.shape} {mesh.names}")
            for j in range(1, k + 1):
                for axes in itertools.combinations(names, j):
                    idx = [names.index(a) for a in axes]
                    mine = next(g for g in groups(shape, idx) if me in g)
                    comm = mesh.comm(axes[::-1])  # any order names the same communicator
                    ranks = comm.allgather(me)
                    # and the collectives run on it: a sum of world ranks over the group
                    total = coll.allreduce(np.array([me], dtype=np.int64), comm=comm)
                    if (ranks != mine or mesh.size(axes) != len(mine)
                            or int(total[0]) != sum(mine) or comm is not mesh.comm(axes)):
                        msgs.append(f"{shape} {axes}: ranks {ranks}, expected {mine}")
            want = coordinates(me, shape)
            if tuple(mesh.coord(a) for a in names) != want:
                msgs.append(f"{shape}: coordinates {[mesh.coord(a) for a in names]} != {want}")
    assert_all(not msgs, "; ".join(msgs))


@pytest.mark.mpi
def test_mesh_bad_input_raises_on_every_rank():
    from mpi4py import MPI

    from collectives import Mesh
    from mpiutil import assert_all
    n = MPI.COMM_WORLD.Get_size()
    cases = [((n + 1,), ("tp",)), ((n, 1), ("tp", "tp")), ((n,), ("dp", "tp"))]
    raised = 0
    for shape, names in cases:
        try:
            Mesh(shape, names)
        except ValueError:
            raised += 1
    mesh = Mesh((n,), ("tp",))
    for bad in ("dp", ("tp", "tp")):
        try:
            mesh.comm(bad)
        except ValueError:
            raised += 1
    assert_all(raised == len(cases) + 2, f"{raised} ValueErrors of {len(cases) + 2}")


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.mpi
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's /proc/self/maps")
def test_mesh_free_frees_the_windows_of_its_communicators():
    """A registered buffer made on a mesh's communicator and dropped leaves its shared window
    mapped (pooled for the next one, or waiting for every rank to drop theirs) until the mesh
    is freed: then the window goes with the communicator's context."""
    import gc

    from mpi4py import MPI

    import collectives as coll
    from collectives import Mesh
    from mpiutil import assert_all
    n = MPI.COMM_WORLD.Get_size()
    if n == 1:
        pytest.skip("one rank: coll.empty makes no shared window")
    mesh = Mesh((n, 1), ("dp", "tp"))
    x = coll.empty(1 << 16, np.float32, comm=mesh.comm("dp"))
    x[:] = 1.0
    addr = x.ctypes.data
    del x
    gc.collect()
    before = _mapped(addr)
    mesh.free()
    after = _mapped(addr)
    assert_all(before and not after, f"window mapped before free: {before}, after: {after}")


@pytest.mark.mpi
def test_mesh_torch_groups(process_group):
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from collectives import Mesh
    from mpiutil import assert_all
    world = MPI.COMM_WORLD
    n, me = world.Get_size(), world.Get_rank()
    shape = (n // 2, 2) if n % 2 == 0 else (1, n)
    mesh = Mesh(shape, ("dp", "tp"))
    msgs = []
    for axis in ("tp", "dp", ("dp", "tp")):
        g = mesh.group(axis)
        mine = mesh.ranks(axis)
        t = torch.tensor([float(me)])
        dist.all_reduce(t, group=g)
        if dist.get_world_size(g) != len(mine) or float(t) != sum(mine) or \
                dist.get_process_group_ranks(g) != mine:
            msgs.append(f"{axis}: sum {float(t)}, ranks {dist.get_process_group_ranks(g)}, "
                        f"expected {mine}")
        if mesh.group(axis) is not g:
            msgs.append(f"{axis}: group not cached")
    assert_all(not msgs, "; ".join(msgs))
