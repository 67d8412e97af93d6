"""Drop-in collectives on torch tensors, in place like ``torch.distributed``.

    from collectives.torch import all_reduce
    all_reduce(t)                          # t now holds the sum over all ranks
    work = all_reduce(t, op="avg", async_op=True); ...; work.wait()

Each call goes through the public API (``collectives.allreduce`` and friends), so the algorithm,
the checks and the progress thread are the toolkit's; this module only adds torch's calling
convention: results land in the tensors passed in, ``op`` may also be a
``torch.distributed.ReduceOp``, a blocking call returns None and ``async_op=True`` returns a
``Work``.

A ``Work`` is completed in *start order*. Its ``get_future()`` gives a ``torch.futures.Future``
whose value is ``[tensor]`` (torch's convention); the future is completed, and its ``then``
callbacks run, in the thread that calls ``Work.wait()`` or ``wait_future()`` -- never in a
background thread. That keeps callbacks that start more collectives (PowerSGD's second
allreduce, say) in the same order on every rank, which overlapping collectives need.
"""
from __future__ import annotations

import threading
from collections import deque

import collectives as coll

__all__ = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
           "all_to_all_single", "all_to_all", "gather", "scatter", "Work", "wait_future",
           "settle", "progress", "op_name", "unpack_into", "equal_blocks"]

_TORCH_OPS = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg",
              "BAND": "band", "BOR": "bor", "BXOR": "bxor"}


def op_name(op) -> object:
    """The toolkit's name for ``op``: a name or ``MPI.Op`` passes through, a ReduceOp is mapped."""
    if isinstance(op, str):
        return op
    red = getattr(op, "op", op)  # torch.distributed.ReduceOp instance -> its RedOpType
    name = getattr(red, "name", None)
    if type(red).__name__ == "RedOpType" and name is not None:
        if name not in _TORCH_OPS:
            raise ValueError(f"ReduceOp.{name} is not supported; use one of "
                             f"{', '.join('ReduceOp.' + k for k in _TORCH_OPS)}")
        return _TORCH_OPS[name]
    return op  # an MPI.Op, checked by collectives.ops


def _tensor(t, what: str):
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _flat(t, what: str):
    """A 1-D view of ``t`` (the toolkit wants outputs shaped exactly; torch's may be any shape)."""
    if not t.is_contiguous():
        raise ValueError(f"{what} of shape {tuple(t.shape)} is not C-contiguous; pass a "
                         f"contiguous tensor (tensor.contiguous())")
    return t.view(-1)


def _size(comm) -> int:
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    return comm.Get_size()


# -- Work and the in-order completion of futures --------------------------------------------------
_PENDING: deque = deque()       # started async Works, oldest first
_LOCK = threading.RLock()       # re-entrant: a future's callback may start or wait on Works


class Work:
    """An async collective on tensors: ``wait()``, ``is_completed()``, ``get_future()``."""

    __slots__ = ("_request", "_tensors", "_future", "_done", "_error", "__weakref__")

    def __init__(self, request, tensors):
        self._request = request
        self._tensors = list(tensors)
        self._future = None
        self._done = False
        self._error = None
        with _LOCK:
            _PENDING.append(self)

    def _finish(self) -> None:
        """Complete this Work (the oldest pending one) and its future."""
        try:
            self._request.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait(), set on the future
            self._error = exc
        self._done = True
        if self._future is not None:
            if self._error is not None:
                self._future.set_exception(self._error)
            else:
                self._future.set_result(self._tensors)

    def wait(self, timeout=None) -> bool:
        """Block until complete (earlier Works complete first); returns True like torch."""
        with _LOCK:
            while not self._done:
                _PENDING.popleft()._finish()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the collective has finished (never blocks)."""
        return self._done or self._request.test()

    def get_future(self):
        """A ``torch.futures.Future`` of ``[tensor]``, completed when this Work is waited."""
        import torch
        with _LOCK:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done:
                    if self._error is not None:
                        self._future.set_exception(self._error)
                    else:
                        self._future.set_result(self._tensors)
            return self._future

    def result(self) -> list:
        """The output tensors (valid after ``wait()``)."""
        return list(self._tensors)

    def __repr__(self):
        return f"<collectives.torch.Work {'done' if self._done else 'in flight'}>"


def settle() -> None:
    """Complete every pending Work now, in start order, each with its result or its error:
    after a process failure (``collectives.elastic``), whose revoked communicators fail the
    abandoned ones at once, so that none is left for ``progress`` or a later wait to meet."""
    with _LOCK:
        while _PENDING:
            _PENDING.popleft()._finish()


def wait_future(fut):
    """Complete pending Works in start order until ``fut`` is done; returns ``fut.wait()``."""
    while not fut.done():
        with _LOCK:
            if fut.done():
                break
            if not _PENDING:
                raise RuntimeError("the future cannot complete: no collective of "
                                   "collectives.torch is in flight to complete it")
            _PENDING.popleft()._finish()
    return fut.wait()


def progress() -> None:
    """Advance the in-flight collectives without blocking or completing any future.

    With the progress thread (the default) this only looks; with
    ``COLLECTIVES_PROGRESS_THREAD=0`` it moves whatever bytes can move now, in this thread --
    DDP calls it from every gradient hook so that buckets progress while backward runs.
    """
    for work in tuple(_PENDING):
        if not work._done:
            work._request.test()


# -- the collectives -------------------------------------------------------------------------
def all_reduce(tensor, op="sum", comm=None, async_op=False, *, algorithm="auto"):
    """Reduce ``tensor`` over all ranks in place; a ``Work`` if ``async_op`` else None."""
    _tensor(tensor, "tensor")
    name = op_name(op)
    if async_op:
        req = coll.iallreduce(tensor, name, out=tensor, comm=comm, algorithm=algorithm)
        return Work(req, [tensor])
    coll.allreduce(tensor, name, out=tensor, comm=comm, algorithm=algorithm)
    return None


def broadcast(tensor, src=0, comm=None, async_op=False, *, algorithm="auto"):
    """Fill ``tensor`` on every rank with rank ``src``'s, in place."""
    _tensor(tensor, "tensor")
    if async_op:
        return Work(coll.ibroadcast(tensor, src, comm=comm, algorithm=algorithm), [tensor])
    coll.broadcast(tensor, src, comm=comm, algorithm=algorithm)
    return None


def all_gather_into_tensor(output_tensor, input_tensor, comm=None, async_op=False, *,
                           algorithm="auto"):
    """Every rank's ``input_tensor`` concatenated (rank order) into ``output_tensor``."""
    _tensor(output_tensor, "output_tensor")
    _tensor(input_tensor, "input_tensor")
    size = _size(comm)
    if output_tensor.numel() != size * input_tensor.numel():
        raise ValueError(f"output_tensor has {output_tensor.numel()} elements, expected "
                         f"{size} ranks x {input_tensor.numel()} = "
                         f"{size * input_tensor.numel()}")
    if output_tensor.dtype != input_tensor.dtype:
        raise TypeError(f"output_tensor is {output_tensor.dtype}, input_tensor is "
                        f"{input_tensor.dtype}")
    flat, out = _flat(input_tensor, "input_tensor"), _flat(output_tensor, "output_tensor")
    if async_op:
        req = coll.iallgather(flat, out=out, comm=comm, algorithm=algorithm)
        return Work(req, [output_tensor])
    coll.allgather(flat, out=out, comm=comm, algorithm=algorithm)
    return None


def reduce_scatter_tensor(output_tensor, input_tensor, op="sum", comm=None, async_op=False, *,
                          algorithm="auto"):
    """Reduce ``input_tensor`` over ranks; rank r gets block r (``output_tensor.numel()``)."""
    _tensor(output_tensor, "output_tensor")
    _tensor(input_tensor, "input_tensor")
    size = _size(comm)
    block = output_tensor.numel()
    if input_tensor.numel() != size * block:
        raise ValueError(f"input_tensor has {input_tensor.numel()} elements, expected "
                         f"{size} ranks x {block} = {size * block}")
    if output_tensor.dtype != input_tensor.dtype:
        raise TypeError(f"output_tensor is {output_tensor.dtype}, input_tensor is "
                        f"{input_tensor.dtype}")
    counts = (block,) * size
    name = op_name(op)
    out = _flat(output_tensor, "output_tensor")
    if async_op:
        req = coll.ireduce_scatter(input_tensor, name, counts=counts, out=out, comm=comm,
                                   algorithm=algorithm)
        return Work(req, [output_tensor])
    coll.reduce_scatter(input_tensor, name, counts=counts, out=out, comm=comm,
                        algorithm=algorithm)
    return None


def _run(request, outputs, async_op, then=None):
    """A ``Work`` for ``request`` (``then`` run once it is done), or wait for it now."""
    if then is not None:
        request = _Then(request, then)
    if async_op:
        return Work(request, outputs)
    request.wait()
    return None


class _Then:
    """A request whose ``wait`` runs ``then`` once after the collective completed."""

    __slots__ = ("request", "then", "ran")

    def __init__(self, request, then):
        self.request, self.then, self.ran = request, then, False

    def wait(self):
        result = self.request.wait()
        if not self.ran:
            self.ran = True
            self.then()
        return result

    def test(self) -> bool:
        return self.request.test()


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      comm=None, async_op=False, *, algorithm="auto"):
    """Rows of ``input`` (axis 0) to every rank, equal or by ``input_split_sizes``; the rows
    from every rank land in ``output`` in rank order (``output_split_sizes`` of them each; when
    not given they are learned with one small exchange, or equal where the input's are)."""
    _tensor(output, "output")
    _tensor(input, "input")
    counts = None if input_split_sizes is None else list(input_split_sizes)
    recv = None if output_split_sizes is None else list(output_split_sizes)
    req = coll.ialltoall(input, counts, recv_counts=recv, out=output, comm=comm,
                         algorithm=algorithm)
    return _run(req, [output], async_op)


def _cat(tensors, what: str):
    import torch
    for t in tensors:
        _tensor(t, what)
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack_into(flat, tensors):
    """A callable copying consecutive pieces of 1-D ``flat`` into ``tensors``, in order."""
    def unpack():
        at = 0
        for t in tensors:
            t.view(-1).copy_(flat[at:at + t.numel()])
            at += t.numel()
    return unpack


def all_to_all(output_tensor_list, input_tensor_list, comm=None, async_op=False, *,
               algorithm="auto"):
    """``input_tensor_list[j]`` goes to rank j; rank i's lands in ``output_tensor_list[i]``
    (sizes may differ per rank)."""
    flat = _cat(input_tensor_list, "input_tensor_list")
    out = flat.new_empty(sum(t.numel() for t in output_tensor_list))
    req = coll.ialltoall(flat, [t.numel() for t in input_tensor_list],
                         recv_counts=[t.numel() for t in output_tensor_list], out=out,
                         comm=comm, algorithm=algorithm)
    return _run(req, output_tensor_list, async_op, unpack_into(out, output_tensor_list))


def gather(tensor, gather_list=None, dst=0, comm=None, async_op=False, *, algorithm="auto"):
    """Every rank's ``tensor`` into ``gather_list`` (one tensor per rank) on rank ``dst``; as
    in torch, every rank's tensor has as many elements (``equal_blocks``)."""
    _tensor(tensor, "tensor")
    size, n = _size(comm), tensor.numel()
    out = then = None
    if gather_list is not None:
        out = tensor.new_empty(size * n)
        then = equal_blocks(n, gather_list, size, "gather_list") or \
            unpack_into(out, gather_list)
    req = coll.igather(tensor.reshape(-1), dst, out=out, counts=(n,) * size, comm=comm,
                       algorithm=algorithm)
    return _run(req, list(gather_list or []), async_op, then)


def scatter(tensor, scatter_list=None, src=0, comm=None, async_op=False, *, algorithm="auto"):
    """``scatter_list[r]`` of rank ``src`` into ``tensor`` on every rank r; as in torch, every
    piece has ``tensor``'s number of elements (``equal_blocks``)."""
    _tensor(tensor, "tensor")
    out = _flat(tensor, "tensor")
    flat = misfit = None
    if scatter_list is not None:
        size = _size(comm)
        misfit = equal_blocks(out.numel(), scatter_list, size, "scatter_list")
        flat = _cat(scatter_list, "scatter_list") if misfit is None else \
            out.new_zeros(size * out.numel())
    req = coll.iscatter(flat, src, out=out, comm=comm, algorithm=algorithm)
    return _run(req, [tensor], async_op, misfit)


def equal_blocks(n: int, pieces, size: int, what: str):
    """torch's gather and scatter move equal blocks ("all tensors must be the same size"), so
    every rank knows every block's size from its own tensor and none exchanges sizes (MPI_Gather
    and MPI_Scatter). None when the root's ``pieces`` are ``size`` tensors of ``n`` elements;
    else a callable raising the error, to run once the call is done: the root takes part all
    the same, with a scratch buffer, so that no rank is left waiting."""
    got = [t.numel() for t in pieces]
    if len(got) == size and got.count(n) == size:
        return None
    error = ValueError(f"{what}: torch's gather and scatter move one block a rank, the size of "
                       f"this rank's tensor: {size} tensors of {n} elements, got {got}")

    def fail():
        raise error
    return fail
