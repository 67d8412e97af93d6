"""Persistent collectives: a call checked, wrapped and chosen once, then started many times.

MPI-4's persistent collectives (``MPI_Allreduce_init`` and its siblings) are how MPI users say
"this call repeats on these buffers": the library works out the call once and each
``MPI_Start`` only runs it. ``coll.allreduce_init(x, out=out)`` and its siblings return a
``Persistent`` made the same way::

    req = coll.allreduce_init(grad, op="avg", out=grad)   # collective, like MPI_Allreduce_init
    for step in range(steps):
        ...                                               # fill grad
        req.start(); ...; req.wait()                      # as often as wanted
    req.free()

The arguments are checked (across ranks too, with ``check=True`` or ``COLLECTIVES_CHECK``)
and the algorithm chosen once, when the request is made. Where the choice is the MPI library's
own collective, the library's persistent request is made once too (where the library offers
it) and each ``start()`` is one ``MPI_Start`` (``wait()`` one ``MPI_Wait``, watched by the
watchdog as a blocking call is); any other algorithm is started as a non-blocking call of the
chosen algorithm, skipping the checks and the choice. Every start is numbered on the
communicator. The request holds
its buffers (it was made for them) until ``free()``. Every start gives the same bits for the same
inputs on every rank; MPI's persistent collective may add floating values in another order than
its blocking one, so a persistent sum can differ from the ordinary call's in the last bits.
"""
from __future__ import annotations

from . import check as _check
from . import config, dispatch, native, ops, select
from . import watchdog as _watchdog
from .call import Call, make_call
from .errors import network_error

__all__ = ["Persistent"]

class Persistent:
    """A persistent collective request: ``start()`` runs the call, ``wait()`` returns its
    result, ``test()`` polls; start again once it is complete. ``free()`` lets go of it."""

    __slots__ = ("_call", "_result", "_algo", "_mpi", "_request", "_mean",
                 "_scratch", "description")

    def __init__(self, call: Call, algorithm, check, result, algo=None):
        ctx, collective = call.ctx, call.collective
        self._result, self._request, self._mpi = result, None, None
        if algo is None and algorithm != "auto":
            try:
                algo = select.get(collective, algorithm)
            except (TypeError, ValueError) as exc:
                raise _check.failed(ctx, collective, check, exc)
        if check if check is not None else config.get("COLLECTIVES_CHECK"):
            dispatch.verify(call, algorithm, ctx.next_seq())
        # avg: each start divides x into what the sum reads (x's output, or a scratch made once)
        self._mean = None
        if call.op is not None and call.op.is_avg and ctx.size > 1:
            x = call.x
            dispatch.mean_first(call)
            self._scratch = call.x
            self._mean = (x.flat, ctx.size, call.x.flat)
        else:
            self._scratch = None
        if algo is None and not dispatch.preferred(call):
            algo = dispatch.auto_algorithm(call)  # else each start agrees again (cached)
        call.algorithm = algorithm if algo is None else algo.name
        call.algo = self._algo = algo
        self._call = call
        self.description = f"persistent {collective} ({call.algorithm})"
        if algo is not None and algo.kind is select.NATIVE and ctx.size > 1 and \
                not call.x.is_device and not dispatch.nothing_to_move(call):
            name, args = native.arguments(call)
            init = getattr(ctx.comm, name + "_init", None)  # MPI-4: MPI_Allreduce_init, ...
            if init is not None:
                try:
                    self._mpi = init(*args)
                except NotImplementedError:  # an MPI library before MPI-4
                    self._mpi = None

    def start(self) -> None:
        """Start the call (complete the previous start first)."""
        if self._request is not None:
            raise RuntimeError(f"{self.description}: started again before wait() completed "
                               f"the previous start")
        call = self._call
        if self._mean is not None:
            ops.mean_first(*self._mean)
        if self._mpi is None:
            again = make_call(call.collective, call.ctx, call.x, call.out, call.op, call.root,
                              call.counts, call.inplace, False)
            self._request = dispatch.start(again, call.algorithm, False, self._result,
                                           self._algo)
            return
        ctx = call.ctx
        call.seq = ctx.seq
        ctx.seq += 1
        if ctx.pending:
            dispatch.drain(ctx)
        try:
            self._mpi.Start()
        except BaseException as exc:
            raise network_error(exc, f"rank {ctx.rank}: {call.describe()}")
        self._request = self._mpi

    def wait(self):
        """Block until the started call completes; returns its result (as the call would).
        A rank waiting here is watched like a blocking collective (``COLLECTIVES_TIMEOUT``)."""
        request = self._request
        if request is None:
            raise RuntimeError(f"{self.description}: wait() without start()")
        self._request = None
        if request is not self._mpi:
            return request.wait()
        call = self._call
        entry = _watchdog.enter(call.ctx, call)
        try:
            request.Wait()
        except BaseException as exc:
            if entry is not None:
                _watchdog.unwatch(entry, exc)
            raise network_error(exc, f"rank {call.ctx.rank}: {call.describe()}")
        if entry is not None:
            entry.release()
        return self._result

    def test(self) -> bool:
        """True once the started call is complete (then ``wait()`` returns at once)."""
        request = self._request
        if request is None:
            raise RuntimeError(f"{self.description}: test() without start()")
        if request is not self._mpi:
            return request.test()
        try:
            return bool(request.Test())
        except BaseException as exc:
            raise network_error(exc, f"rank {self._call.ctx.rank}: {self._call.describe()}")

    def free(self) -> None:
        """Let go of the request (and of its buffers): after the last ``wait()``."""
        if self._request is not None:
            raise RuntimeError(f"{self.description}: free() while a start is in flight")
        if self._mpi is not None:
            self._mpi.Free()
            self._mpi = None
        self._call = self._mean = self._scratch = self._result = None

    def __del__(self):
        mpi = self._mpi
        if mpi is not None and self._request is None:
            from mpi4py import MPI
            if not MPI.Is_finalized():
                mpi.Free()

    def __repr__(self):
        return f"<collectives.Persistent {self.description}>"

