"""The ``"collectives"`` backend of ``torch.distributed``: torch's own API on our algorithms.

    import collectives.torch.backend as cb
    cb.init_process_group()              # ranks and size from MPI.COMM_WORLD, a TCPStore
    dist.all_reduce(t)                   # -> collectives.iallreduce
    model = torch.nn.parallel.DistributedDataParallel(module)   # torch's Reducer, our wire

Importing this module registers the backend (``Backend.register_backend("collectives", ...,
extended_api=True, devices=["cpu"])``); ``dist.init_process_group("collectives", store=...,
rank=..., world_size=...)`` works as well, provided torch's ranks are the ``COMM_WORLD`` ranks
(mpiexec starts the processes; the collectives need no rendezvous, but torch's store-based
features do: ``init_process_group`` gives torch a ``TCPStore`` that rank 0 serves, ``tcp_store``).
A communicator passed as ``pg_options`` is the group's own: ``cb.init_process_group(comm)``
binds the default group to any communicator (a shrunk one after a failure: ``rebuild``, which
``collectives.elastic`` calls), and ``dist.new_group(ranks, pg_options=mesh.comm("tp"))`` runs a
group on a communicator already made.
The process group is a Python
subclass of ``torch.distributed.ProcessGroup``: each operation starts the toolkit's
non-blocking collective and returns a ``Work`` built on a ``torch.futures.Future``, which one
*completer* thread per group completes in start order (waiting on the collectives' requests),
so torch's C++ Reducer can chain its callbacks on them as it does with gloo.

Supported: all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor, reduce_scatter,
reduce_scatter_tensor (and their coalesced forms), all_to_all_single (even and uneven splits),
all_to_all, gather, scatter, barrier, send and recv, on CPU tensors (and CUDA ones once the toolkit
accepts them). Limits (see docs/torch.md): a comm hook registered on torch's DDP whose future
callbacks start further collectives (torch's PowerSGD) would start them from the completer
thread, out of order with the main thread's; use ``collectives.torch.DistributedDataParallel``
for such hooks.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch.autograd import Variable

import collectives as coll

from .. import p2p
from ..progress import Worker
from .functional import equal_blocks, op_name, unpack_into

__all__ = ["ProcessGroupCollectives", "init_process_group", "register", "tcp_store", "rebuild",
           "communicators", "BACKEND"]

BACKEND = "collectives"
_GROUPS: weakref.WeakSet = weakref.WeakSet()   # every live group of this process


def _complete(item) -> None:
    """Wait for one Work's requests, then complete its future (in the group's completer).
    ``failed`` (a list) marks a call started inside a backward: its error goes there, for
    ``_raise_failed`` to raise as that backward ends, and the future gets its result."""
    wait, fut, result, failed = item
    try:
        wait()
    except BaseException as exc:  # noqa: BLE001 - delivered through the future
        if failed is None:
            fut.set_exception(exc)
            return
        failed.append(exc)
    fut.set_result(result)


def _raise_failed(fut, failed: list) -> None:
    """A final callback of the backward that started a call: once the call is complete, its
    error, if it failed."""
    fut.wait()
    if failed:
        raise failed[0]


def _completer() -> Worker:
    """One daemon thread per group completing its futures in the order the work was started
    (groups apart: one group's slow work never holds up another's)."""
    return Worker("collectives-torch-completer", _complete)


class _Work(dist.Work):
    """torch's ``Work`` for one call, completed through ``fut``: ``wait()`` raises the call's
    error (a mismatch, a failed peer, the watchdog's timeout), where a Work that torch makes
    from a future (``_create_work_from_future``) returns True and drops it."""

    def __init__(self, fut, failed=None):
        super().__init__()
        self._fut = fut
        self._failed = failed   # a call started inside a backward: its error (``_complete``)

    def wait(self, timeout=None) -> bool:
        self._fut.wait()  # raises what set_exception gave it
        if self._failed:
            raise self._failed[0]
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self.exception() is None

    def exception(self):
        if not self._fut.done():
            return None
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the call's error, reported, not raised
            return exc
        return None

    def get_future(self):
        return self._fut


class ProcessGroupCollectives(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on ``collectives``."""

    def __init__(self, comm, algorithm: str = "auto", timeout=None):
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._comm = comm
        self._p2p = comm.Dup()  # send/recv never match the collectives' messages
        self._algorithm = algorithm
        self._timeout = timeout  # torch's, kept for a rebuild
        self._completer = _completer()
        _GROUPS.add(self)
        # The group's thread ends with the group (torch drops it in destroy_process_group).
        weakref.finalize(self, self._completer.close)

    def getBackendName(self) -> str:
        return BACKEND

    # torch names every group it creates (``_set_group_name``) and its clients look groups up
    # by name (DeviceMesh, FSDP2, functional collectives). The base class keeps the name on
    # its C++ backends, which a Python group has none of, so the group keeps it itself.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "undefined")

    def __repr__(self):
        return f"<ProcessGroupCollectives rank {self.rank()} of {self.size()}>"

    # -- plumbing -------------------------------------------------------------------------------
    def _submit(self, opts, requests, result, then=None):
        """A Work completed once ``requests`` are and ``then()`` ran: at once, in this thread,
        for a call torch waits on as it returns (``opts.asyncOp`` false: FSDP2's all-gathers
        and reduce-scatters on CPU, every blocking ``dist.*`` call); else by the completer, in
        start order."""
        fut = torch.futures.Future()

        def wait():
            for r in requests:
                r.wait()
            if then is not None:
                then()

        if opts is not None and not getattr(opts, "asyncOp", True):
            # Handing the wait to the completer and back costs two thread wake-ups per call,
            # each a scheduler slice on a loaded machine, for a caller that only waits.
            _complete((wait, fut, result, None))
            return _Work(fut)
        failed = None
        if torch._C._current_graph_task_id() != -1:
            # torch's DDP reads its buckets' futures at the end of backward without asking
            # whether they failed: a future completed with an error crashes the process there
            # (a null value read in parseCppCommHookResult). A call started inside a backward
            # (a DDP bucket, any hook's) completes its future with its result and hands its
            # error to a callback of that backward, which waits for the call: backward raises
            # it, as a blocking call would.
            failed = []
            Variable._execution_engine.queue_callback(
                functools.partial(_raise_failed, fut, failed))
        self._completer.put((wait, fut, result, failed))
        return _Work(fut, failed)

    def _kw(self, collective: str = "allreduce"):
        """The keyword arguments of a call: the group's communicator, and its algorithm where
        ``collective`` has one of that name (else ``auto``)."""
        algorithm = self._algorithm if self._algorithm in coll.algorithms(collective) else "auto"
        return {"comm": self._comm, "algorithm": algorithm}

    # -- collectives ----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = op_name(opts.reduceOp if opts is not None else "sum")
        reqs = [coll.iallreduce(t, op, out=t, **self._kw()) for t in tensors]
        return self._submit(opts, reqs, tensors)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        reqs = [coll.ibroadcast(t, root, **self._kw("broadcast")) for t in tensors]
        return self._submit(opts, reqs, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        op = op_name(opts.reduceOp if opts is not None else "sum")
        flat = torch.cat([t.reshape(-1) for t in tensors])
        req = coll.iallreduce(flat, op, out=flat, **self._kw())
        return self._submit(opts, [req], tensors, unpack_into(flat, tensors))

    def reduce(self, tensors, opts=None):
        op = op_name(opts.reduceOp)
        root = opts.rootRank
        reqs = [coll.ireduce(t, op, root, out=t if self.rank() == root else None,
                             **self._kw("reduce")) for t in tensors]
        return self._submit(opts, reqs, tensors)

    def all_gather_single(self, output, input, opts=None):
        # FSDP2 gathers in place: its input is this rank's slot of the output (as NCCL allows)
        req = self._iallgather_equal(_apart(input, output), output)
        return self._submit(opts, [req], [output])

    def _iallgather_equal(self, x, out):
        """``coll.iallgather`` for ``all_gather_into_tensor``, whose inputs have
        ``out.numel() / size`` elements on every rank: with those counts given, the toolkit
        skips the exchange of row counts that ragged all-gathers need, a blocking
        ``MPI_Allgather`` in which each call would first wait for every rank to reach it (FSDP2
        makes two all-gathers per layer and step)."""
        n = x.numel()
        return coll.iallgather(x.reshape(-1), counts=(n,) * self.size(), out=out.view(-1),
                               **self._kw("allgather"))

    _allgather_base = all_gather_single  # the name before torch 2.12

    def allgather(self, output_tensors, input_tensors, opts=None):
        # every rank's output list holds every rank's size (uneven ones too): the counts,
        # known alike on every rank, so none is exchanged
        reqs, unpacks = [], []
        for outs, inp in zip(output_tensors, input_tensors):
            counts = tuple(o.numel() for o in outs)
            flat = inp.new_empty(sum(counts))
            reqs.append(coll.iallgather(inp.reshape(-1), counts=counts, out=flat,
                                        **self._kw("allgather")))
            unpacks.append(unpack_into(flat, outs))

        def unpack():
            for each in unpacks:
                each()

        return self._submit(opts, reqs, output_tensors, unpack)

    def reduce_scatter_single(self, output, input, opts=None):
        op = op_name(opts.reduceOp if opts is not None else "sum")
        counts = (output.numel(),) * self.size()
        req = coll.ireduce_scatter(_apart(input, output), op, counts=counts,
                                   out=output.view(-1), **self._kw("reduce_scatter"))
        return self._submit(opts, [req], [output])

    _reduce_scatter_base = reduce_scatter_single  # the name before torch 2.12

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = op_name(opts.reduceOp if opts is not None else "sum")
        reqs = []
        for out, ins in zip(output_tensors, input_tensors):
            flat = torch.cat([t.reshape(-1) for t in ins])
            counts = tuple(t.numel() for t in ins)
            reqs.append(coll.ireduce_scatter(flat, op, counts=counts, out=out.view(-1),
                                             **self._kw("reduce_scatter")))
        return self._submit(opts, reqs, output_tensors)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        reqs = [self._iallgather_equal(_apart(i, o), o) for o, i in zip(outputs, inputs)]
        return self._submit(opts, reqs, outputs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op = op_name(opts.reduceOp if opts is not None else "sum")
        reqs = [coll.ireduce_scatter(i, op, counts=(o.numel(),) * self.size(), out=o.view(-1),
                                     **self._kw("reduce_scatter"))
                for o, i in zip(outputs, inputs)]
        return self._submit(opts, reqs, outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        n = self.size()
        counts = list(input_split_sizes) or None
        recv = list(output_split_sizes) or None
        if counts is not None and recv is None:
            recv = [output.shape[0] // n] * n if output.dim() else None
        req = coll.ialltoall(input, counts, recv_counts=recv, out=output, **self._kw("alltoall"))
        return self._submit(opts, [req], [output])

    alltoall_base = all_to_all_single  # the name before torch 2.12

    def alltoall(self, output_tensors, input_tensors, opts=None):
        flat = torch.cat([t.reshape(-1) for t in input_tensors])
        out = flat.new_empty(sum(t.numel() for t in output_tensors))
        req = coll.ialltoall(flat, [t.numel() for t in input_tensors],
                             recv_counts=[t.numel() for t in output_tensors], out=out,
                             **self._kw("alltoall"))
        return self._submit(opts, [req], output_tensors, unpack_into(out, output_tensors))

    def gather(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        inp = input_tensors[0]
        size, n = self.size(), inp.numel()
        out = then = None
        if self.rank() == root:
            out = inp.new_empty(size * n)
            then = equal_blocks(n, output_tensors[0], size, "gather") or \
                unpack_into(out, output_tensors[0])
        req = coll.igather(inp.reshape(-1), root, out=out, counts=(n,) * size,
                           **self._kw("gather"))
        return self._submit(opts, [req], output_tensors, then)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        out = output_tensors[0].view(-1)
        flat = misfit = None
        if self.rank() == root:
            misfit = equal_blocks(out.numel(), input_tensors[0], self.size(), "scatter")
            flat = torch.cat([t.reshape(-1) for t in input_tensors[0]]) if misfit is None \
                else out.new_zeros(self.size() * out.numel())
        req = coll.iscatter(flat, root, out=out, **self._kw("scatter"))
        return self._submit(opts, [req], output_tensors, misfit)

    def barrier(self, opts=None):
        return self._submit(opts, [coll.ibarrier(self._comm)], [])

    def send(self, tensors, dst, tag=0):
        reqs = [p2p.isend(self._p2p, t, dst, tag) for t in tensors]
        return self._submit(None, [_P2PWait(r, self._p2p, f"dist.send to rank {dst} (tag {tag})")
                                   for r in reqs], tensors)

    def recv(self, tensors, src, tag=0):
        reqs = [p2p.irecv(self._p2p, t, src, tag) for t in tensors]
        return self._submit(None, [_P2PWait(r, self._p2p,
                                            f"dist.recv from rank {src} (tag {tag})")
                                   for r in reqs], tensors)


def _apart(x, out):
    """``x``, or a copy of it where it shares memory with ``out`` (the toolkit's all-gather and
    reduce-scatter take separate buffers; torch's clients may pass a slot of the other)."""
    if x.numel() and out.numel():
        xs = x.untyped_storage().data_ptr()
        if xs == out.untyped_storage().data_ptr():
            return x.clone()
    return x


class _P2PWait:
    """A point-to-point request of ``send``/``recv``, waited for in p2p's watched wait (the
    watchdog names it where a rank waits too long)."""

    __slots__ = ("request", "comm", "what")

    def __init__(self, request, comm, what):
        self.request, self.comm, self.what = request, comm, what

    def wait(self):
        p2p.wait_all([self.request], self.what, self.comm)


def _default_group():
    """torch's default group where it is this backend's, else None."""
    group = dist.group.WORLD if dist.is_initialized() else None
    return group if isinstance(group, ProcessGroupCollectives) else None


def _default_comm():
    """The communicator whose ranks torch's ranks are: the default group's where it is this
    backend's (``init_process_group(comm=...)`` binds it), else ``COMM_WORLD``."""
    from mpi4py import MPI
    group = _default_group()
    return MPI.COMM_WORLD if group is None else group._comm


def _create(dist_opts, backend_options=None):
    """``register_backend``'s creator: the group's MPI communicator and its process group.
    A communicator given as ``pg_options`` is the group's own (torch's size and rank must be
    its); otherwise the group's ranks are ranks of the default group's communicator."""
    from mpi4py import MPI
    size, rank = dist_opts.group_size, dist_opts.group_rank
    if isinstance(backend_options, MPI.Comm):
        comm = backend_options
        if (comm.Get_size(), comm.Get_rank()) != (size, rank):
            raise ValueError(f"torch's group is rank {rank} of {size}, its communicator "
                             f"(pg_options) rank {comm.Get_rank()} of {comm.Get_size()}")
        return ProcessGroupCollectives(comm, timeout=dist_opts.timeout)
    if backend_options is not None:
        raise TypeError(f"pg_options of the collectives backend is an MPI communicator, got "
                        f"{type(backend_options).__name__}")
    base = _default_comm()
    name = "MPI.COMM_WORLD" if base == MPI.COMM_WORLD else "the default group's communicator"
    ranks = list(dist_opts.global_ranks_in_group or range(size))
    if len(ranks) == base.Get_size() and ranks == list(range(base.Get_size())):
        comm = base
        if rank != base.Get_rank():
            raise ValueError(f"the collectives backend needs torch's ranks to be MPI's: torch "
                             f"says rank {rank}, {name} says {base.Get_rank()} (pass "
                             f"rank=MPI.COMM_WORLD.Get_rank())")
    else:
        if max(ranks) >= base.Get_size():
            raise ValueError(f"group ranks {ranks} do not exist in {name} of size "
                             f"{base.Get_size()}")
        comm = base.Create_group(base.Get_group().Incl(ranks))
    if comm.Get_size() != size:
        raise ValueError(f"torch's group has {size} ranks, {name} {comm.Get_size()}; launch "
                         f"with mpiexec -n {size}")
    return ProcessGroupCollectives(comm, timeout=dist_opts.timeout)


_REGISTERED = False


def register() -> None:
    """Register ``"collectives"`` with ``torch.distributed`` (done on import; idempotent)."""
    global _REGISTERED
    if not _REGISTERED and BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _REGISTERED = True


_STORE_TIMEOUT_S = 300.0  # torch's own TCPStore default


def _listen_fd(addr: str, port: int) -> tuple[int, int]:
    """A listening socket bound to ``addr:port`` (port 0: the OS picks a free one), as its file
    descriptor (handed over: the store closes it) and its port."""
    import socket
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed port after a restart
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port


def _port_setting() -> int:
    import os
    text = os.environ.get("MASTER_PORT", "").strip()
    try:
        port = int(text or 0)
    except ValueError:
        port = -1
    if not 0 <= port < 65536:
        raise ValueError(f"MASTER_PORT={text!r}: expected a TCP port, 0-65535")
    return port


def tcp_store(comm=None, timeout=None):
    """A ``torch.distributed.TCPStore`` shared by the ranks of ``comm`` (default ``COMM_WORLD``;
    collective): the store ``cb.init_process_group()`` gives torch.

    Rank 0 serves it. When every rank is on one host it listens on the loopback only
    (``127.0.0.1``, or ``MASTER_ADDR`` if set) on the port the OS picks (``MASTER_PORT`` if
    set), so jobs side by side never collide; across hosts it listens as torch's ``env://``
    does, on every interface, and the others connect to ``MASTER_ADDR`` or rank 0's host name.
    The port reaches the other ranks by MPI. ``timeout`` (a ``timedelta``, default 300 s)
    bounds connecting and every ``get``/``wait``; a rank that cannot serve or reach the store
    makes the call raise on every rank."""
    import datetime
    import os
    import socket

    from mpi4py import MPI
    comm = comm or MPI.COMM_WORLD
    size = comm.Get_size()
    if timeout is None:
        timeout = datetime.timedelta(seconds=_STORE_TIMEOUT_S)
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo groups beside ours, too
    addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host else hosts[0])
    port, store, error = _port_setting(), None, None
    if comm.Get_rank() == 0:
        try:
            fd = None
            if one_host:
                fd, port = _listen_fd(addr, port)
            store = dist.TCPStore(addr, port, size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=fd)
            port = store.port
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = f"rank 0 could not serve the store on {addr}:{port}: {exc}"
    port, error = comm.bcast((port, error), root=0)
    if error is None and store is None:
        try:
            store = dist.TCPStore(addr, port, size, False, timeout)
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = f"rank {comm.Get_rank()} could not reach the store at {addr}:{port}: {exc}"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise RuntimeError("; ".join(errors))
    return store


def init_process_group(comm=None, **kwargs) -> None:
    """``dist.init_process_group("collectives")`` over ``comm`` (default ``COMM_WORLD``; any
    intracommunicator: torch's ranks and size are its) with a store shared by its ranks
    (``tcp_store``; ``store=`` overrides it, ``timeout=`` bounds it too). Collective over
    ``comm``; ``dist.new_group(ranks)`` then takes ranks of ``comm``."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if comm is None else comm
    if "pg_options" in kwargs:
        raise TypeError("init_process_group(comm=...) names the group's communicator; "
                        "pg_options is not taken beside it")
    register()
    if kwargs.get("store") is None:
        # torch's features that rendezvous through the default store (new_group on another
        # backend, store-based barriers, distributed checkpointing) need one every rank reaches
        kwargs["store"] = tcp_store(comm, kwargs.get("timeout"))
    dist.init_process_group(BACKEND, rank=comm.Get_rank(), world_size=comm.Get_size(),
                            pg_options=comm, **kwargs)


def communicators() -> list:
    """The MPI communicators of every live group of this backend in this process (each
    group's own and the duplicate its send/recv use): what a failure must revoke."""
    return [c for g in list(_GROUPS) for c in (g._comm, g._p2p)]


def rebuild(old, new) -> bool:
    """Where torch's default group is this backend's and runs on ``old``, make it again on
    ``new`` (``None``: only destroy it): torch's ``destroy_process_group`` ends every group (the
    subgroups too: make them again after this), then ``init_process_group(comm=new)`` with a
    store of ``new``'s ranks (the old one's server may have been a rank that is gone) and the
    old timeout. Collective over ``new``; whether it did. ``collectives.elastic`` calls it on
    the survivors of a failure, and on a replacement with the communicator it joins."""
    group = _default_group()
    if group is None or group._comm != old:
        return False
    timeout = group._timeout
    dist.destroy_process_group()
    if new is not None:
        init_process_group(new, **({} if timeout is None else {"timeout": timeout}))
    return True


register()
