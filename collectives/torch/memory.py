"""Registered torch tensors: ``empty(shape, dtype=...)`` in a shared window of the node's ranks.

The torch form of ``collectives.empty`` (``collectives.registered``): the same window, seen as
a CPU tensor of any dtype torch has (bfloat16 included), so that collectives on it take the
one-pass path. Collective over ``comm`` like ``collectives.empty``.
"""
from __future__ import annotations

import torch

import collectives as coll

__all__ = ["empty", "zeros"]


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
