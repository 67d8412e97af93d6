"""Registered torch tensors: ``empty(shape, dtype=...)`` in a shared window of the node's ranks.

The torch form of ``collectives.empty`` (``collectives.node.registered``): the same window, seen as
a CPU tensor of any dtype torch has (bfloat16 included), so that collectives on it take the
one-pass path. Collective over ``comm`` like ``collectives.empty``.
"""
from __future__ import annotations

import torch

import collectives as coll
from collectives.node import registered

__all__ = ["empty", "zeros", "flat_zeros", "register_on"]


def empty(shape, *, dtype=None, comm=None) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory is registered (collective over ``comm``)."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    shape = torch.Size((shape,) if isinstance(shape, int) else shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = coll.empty(shape.numel() * itemsize, "uint8", comm=comm)
    return torch.from_numpy(raw).view(dtype).view(shape)


def zeros(shape, *, dtype=None, comm=None) -> torch.Tensor:
    """``empty``, zero-filled."""
    return empty(shape, dtype=dtype, comm=comm).zero_()


def flat_zeros(numel: int, dtype, device, comm=None) -> torch.Tensor:
    """A zeroed 1-D tensor of ``numel``: registered on ``comm``'s node when ``comm`` is given
    and the tensor is on the host (collective then), else ``torch.zeros``. What DDP's buckets
    and ShardedDataParallel's flat buffers are allocated with."""
    if comm is not None and torch.device(device).type == "cpu":
        return zeros(int(numel), dtype=dtype, comm=comm)
    return torch.zeros(int(numel), dtype=dtype, device=device)


def register_on(choice, comm, algorithm: str, option: str):
    """The communicator a wrapper registers its flat buffers on, or None, for its ``option``
    (DDP's ``registered_buckets``, ShardedDataParallel's ``registered_buffers``): True always;
    ``"auto"`` when the ranks share one node and ``algorithm="auto"``; False never.
    Collective (the node is asked once per communicator)."""
    if choice not in ("auto", True, False):
        raise ValueError(f"{option} must be 'auto', True or False, got {choice!r}")
    if choice is True or (choice == "auto" and algorithm == "auto" and comm.Get_size() > 1
                          and registered.single_node(comm)):
        return comm
    return None
