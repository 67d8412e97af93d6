"""One model on every rank: the check that the ranks wrap the same parameters, and the
coalesced broadcast that gives them the same values.

Both data-parallel wrappers (``DistributedDataParallel``, ``ShardedDataParallel``) start with
``check_same_parameters``: the ranks compare a digest of their parameters' names, shapes and
dtypes (one small allgather), and only when the digests differ gather the signatures to name the
first differing parameter and the ranks, in a ``ValueError`` raised on every rank.
``broadcast_coalesced`` then copies one rank's tensors into every rank's, packed into one flat
buffer per dtype and device (chunks of at most ``BROADCAST_CHUNK_BYTES``): DDP's start from
rank 0, its buffer broadcasts, and ``join()``'s end (the model of the ranks that trained to the
end).
"""
from __future__ import annotations

import hashlib

import torch

from . import functional

__all__ = ["BROADCAST_CHUNK_BYTES", "check_same_parameters", "broadcast_coalesced"]

BROADCAST_CHUNK_BYTES = 64 << 20  # a coalesced broadcast sends at most this much at once


def check_same_parameters(named, comm, who: str) -> None:
    """Same parameter names, shapes and dtypes on every rank of ``comm``, or a ValueError on
    every rank naming the first differing parameter and the ranks (``who`` opens it)."""
    sig = [(n, tuple(p.shape), str(p.dtype).replace("torch.", "")) for n, p in named]
    digest = hashlib.sha256(repr(sig).encode()).hexdigest()
    if comm.Get_size() == 1 or len(set(comm.allgather(digest))) == 1:
        return
    sigs = comm.allgather(sig)  # metadata, once: only when the digests differ

    def show(e):
        return "no such parameter" if e is None else f"{e[0]!r} of shape {list(e[1])} {e[2]}"

    for k in range(max(len(s) for s in sigs)):
        entries = [s[k] if k < len(s) else None for s in sigs]
        bad = [r for r in range(1, len(sigs)) if entries[r] != entries[0]]
        if bad:
            first = (entries[0] or entries[bad[0]])[0]
            detail = "; ".join(f"rank {r} has {show(entries[r])}" for r in [0] + bad[:3])
            raise ValueError(f"{who}: parameter {k} ({first!r}) differs across ranks "
                             f"{[0] + bad}: {detail}; every rank must wrap the same model")
    raise AssertionError("parameter digests differ but the signatures agree")


def broadcast_coalesced(tensors, root: int, comm) -> None:
    """``root``'s values into ``tensors`` on every rank, one broadcast per dtype and chunk."""
    if comm.Get_size() == 1 or not tensors:
        return
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in groups.values():
            chunk, nbytes = [], 0
            for t in group + [None]:
                if t is not None and (nbytes == 0 or nbytes + t.numel() * t.element_size()
                                      <= BROADCAST_CHUNK_BYTES):
                    chunk.append(t)
                    nbytes += t.numel() * t.element_size()
                    continue
                flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                functional.broadcast(flat, root, comm=comm)
                offset = 0
                for c in chunk:
                    c.detach().copy_(flat[offset:offset + c.numel()].view(c.shape))
                    offset += c.numel()
                chunk, nbytes = ([t], t.numel() * t.element_size()) if t is not None \
                    else ([], 0)
