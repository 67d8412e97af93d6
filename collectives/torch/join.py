"""Uneven inputs for ``DistributedDataParallel``: the protocol behind ``model.join()``.

    with model.join():                 # every rank of the communicator enters it
        for x, y in my_batches:        # ranks may have different numbers of batches
            ...

One ``Join`` lives for one context. The steps:

1. *Agree.* Every forward inside the context starts with one small allreduce (``agree``: n + 1
   int32s) that tells every rank which ranks still train and whether a synchronized backward
   follows (``no_sync()`` and ``torch.no_grad()`` forwards say no). Its answer sets the
   reducer's ``rescale``: the hook averages over every rank, the joined ones sending zeros, so
   the average over the ranks that train is the hook's times ``n / active`` (none with
   ``divide_by_initial_world_size=True``, torch's default).
2. *Stand in.* A rank whose loop has ended waits in the context's exit (``until_all_joined``)
   and answers each step with the same collectives carrying zeros: every bucket through the
   registered hook, as the training ranks reduce it (``GradBucket.joined()`` is True, so error
   feedback keeps its residual out), the used-parameter flags of ``find_unused_parameters``, the
   buffer broadcast (from the lowest rank still training, since rank 0 may have left) and the
   first iteration's bucket rebuild.
3. *Leave.* When an agreement counts no rank training, every rank takes the parameters (and
   buffers) of the lowest rank that trained to the end: a joined rank ran no optimizer step
   since it left, so without this it would keep a stale model (torch's ``Join`` broadcasts its
   last joiner's model the same way).
"""
from __future__ import annotations

import torch

from . import functional
from .agreement import broadcast_coalesced

__all__ = ["Join"]


class Join:
    """The state of one ``join()`` context over ``comm`` (see the module doc)."""

    __slots__ = ("comm", "rank", "size", "divide_initial", "last", "zeros")

    def __init__(self, comm, divide_by_initial_world_size: bool = False):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.divide_initial = bool(divide_by_initial_world_size)
        self.last = 0        # the lowest rank training at the last agreement any trained in
        self.zeros = None    # this rank's stand-in buckets, once it has left its loop

    def agree(self, training: bool, sync: bool = False) -> tuple[int, int, bool]:
        """(ranks training, the lowest of them, whether they synchronize this backward).
        Collective: every rank of ``comm`` calls it once per step, training or not."""
        flags = torch.zeros(self.size + 1, dtype=torch.int32)
        if training:
            flags[self.rank] = 1
            flags[self.size] = int(sync)
        functional.all_reduce(flags, "sum", comm=self.comm)
        active = int(flags[:self.size].sum())
        root = int(torch.argmax(flags[:self.size]))
        if active:
            self.last = root  # the same on every rank: all take part in each agreement
        return active, root, bool(flags[self.size])

    def rescale(self, active: int) -> float:
        """The factor from the hook's average (over every rank) to the wanted one."""
        if self.divide_initial or active >= self.size:
            return 1.0
        return self.size / active

    def train(self, reducer, sync: bool) -> int:
        """A training rank's agreement at a forward: sets ``reducer``'s step; the root of the
        buffer broadcast."""
        active, root, _ = self.agree(True, sync)
        reducer.rescale = self.rescale(active)
        return root

    def until_all_joined(self, reducer, sync_buffers) -> None:
        """This rank's loop has ended: stand in for every step of the others until none
        trains (``sync_buffers(root)``: the forward's buffer broadcast)."""
        while True:
            active, root, sync = self.agree(False)
            if active == 0:
                return
            sync_buffers(root)
            if sync:
                self.stand_in(reducer)

    def stand_in(self, reducer) -> None:
        """A joined rank's part of one synchronized backward: the same collectives, zeros."""
        if self.zeros is None:
            self.zeros = [torch.zeros_like(b.flat) for b in reducer.buckets]
        futures = []
        for b, zero in zip(reducer.buckets, self.zeros):
            zero.zero_()  # a hook may have left something in it
            futures.append(reducer.hook(reducer.state, reducer.grad_bucket(b, zero)))
        if reducer.find_unused_parameters:
            functional.all_reduce(torch.zeros(len(reducer.params), dtype=torch.int32), "max",
                                  comm=self.comm)
        for f in futures:
            functional.wait_future(f)
        if reducer.rebuild_pending:
            reducer.rebuild(joined=True)
            self.zeros = None

    def leave(self, tensors) -> None:
        """Every rank takes the values of ``tensors`` (the model) from the lowest rank that
        trained to the end."""
        broadcast_coalesced(tensors, self.last, self.comm)
