"""One model and one set of settings on every rank: the cross-rank agreement of the torch
layer, and the coalesced broadcast that gives the ranks the same values.

``agree(comm, what, settings)`` is the one "these settings agree across ranks" check of the
torch layer, over the core's ``collectives.check.same``: every rank hashes its settings (and
the error its own checks found, if any) into a fixed-size code, and one small
``MPI_Allreduce`` tells every rank whether the codes agree. Only when they do not (the error
path) are the settings gathered, so that every rank raises the same ``ValueError`` naming the
first setting that differs and each rank's value -- never a hang where one rank raises and the
others wait in a collective. A setting is a value compared as a whole (a period, a learning
rate) or a list of *rows* ``(name, description)`` compared row by row (a model's parameters,
a tensor-parallel plan's layers), whose first differing row is named. Its users: both
data-parallel wrappers (``same_parameters``: names, shapes and dtypes), the averagers (their
kind, periods, warm-up and outer optimizer) and ``tensor_parallel.parallelize`` (the planned
layers).

``broadcast_coalesced`` copies one rank's tensors into every rank's, packed into one
``FlatBuffer`` per dtype and device (chunks of at most ``BROADCAST_CHUNK_BYTES``): DDP's start
from rank 0, its buffer broadcasts, the averagers' start, and ``join()``'s end (the model of
the ranks that trained to the end).
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from collectives import check

from . import functional
from .flat import FlatBuffer

__all__ = ["BROADCAST_CHUNK_BYTES", "agree", "same_parameters", "broadcast_coalesced"]

BROADCAST_CHUNK_BYTES = 64 << 20  # a coalesced broadcast sends at most this much at once


def _rows(value) -> bool:
    return isinstance(value, list) and all(isinstance(r, tuple) and len(r) == 2 for r in value)


def _difference(what: str, key: str, values: list, hint: str) -> str | None:
    """The message for setting ``key`` whose value on rank r is ``values[r]``, or None if it
    agrees."""
    if all(_rows(v) for v in values):
        for k in range(max(len(v) for v in values)):
            rows = [v[k] if k < len(v) else None for v in values]
            bad = [r for r in range(1, len(rows)) if rows[r] != rows[0]]
            if bad:
                name = (rows[0] or rows[bad[0]])[0]
                shown = "; ".join(f"rank {r} has "
                                  f"{'no such ' + key if rows[r] is None else rows[r][1]}"
                                  for r in [0] + bad[:3])
                return (f"{what}: {key} {k} ({name!r}) differs across ranks {[0] + bad}: "
                        f"{shown}; {hint}")
        return None
    bad = [r for r in range(1, len(values)) if values[r] != values[0]]
    if not bad:
        return None
    shown = "; ".join(f"rank {r} has {values[r]!r}" for r in [0] + bad[:3])
    return f"{what}: {key} differs across ranks: {shown}; {hint}"


def agree(comm, what: str, settings: dict, error: str | None = None, *,
          hint: str = "every rank must pass the same settings") -> None:
    """Every rank of ``comm`` passes the same ``settings`` ({name: value or rows}) and no rank
    an ``error`` (what its own checks found), or the same ``ValueError`` on every rank, opened
    by ``what``: the first rank's error, or the first setting that differs with each rank's
    value (and ``hint``). Collective: one small allreduce, a gather only on the error path."""
    mine = (error, settings)
    if comm.Get_size() > 1:
        digest = hashlib.sha256(repr(mine).encode()).digest()
        if check.same(comm, np.frombuffer(digest, dtype=np.int64)):
            everyone = [mine] * comm.Get_size()
        else:
            everyone = comm.allgather(mine)   # the error path only: name what differs
    else:
        everyone = [mine]
    errors = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if errors:
        r, e = errors[0]
        more = f" (and on {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
        raise ValueError(f"{what}: rank {r}: {e}{more}")
    for key in dict.fromkeys(k for _, s in everyone for k in s):
        told = _difference(what, key, [s.get(key) for _, s in everyone], hint)
        if told is not None:
            raise ValueError(told)
    if len({repr(m) for m in everyone}) > 1:
        raise ValueError(f"{what}: the settings differ across ranks; {hint}")


def same_parameters(named, comm, what: str) -> None:
    """Same parameter names, shapes and dtypes on every rank of ``comm`` (``agree``), or a
    ValueError on every rank naming the first differing parameter and the ranks."""
    rows = [(n, f"{n!r} of shape {list(p.shape)} {str(p.dtype).replace('torch.', '')}")
            for n, p in named]
    agree(comm, what, {"parameter": rows}, hint="every rank must wrap the same model")


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
                size = 0 if t is None else t.numel() * t.element_size()
                if t is not None and (nbytes == 0 or nbytes + size <= BROADCAST_CHUNK_BYTES):
                    chunk.append(t)
                    nbytes += size
                    continue
                flat = FlatBuffer.of(chunk)
                flat.copy_in(chunk)
                functional.broadcast(flat.flat, root, comm=comm)
                flat.copy_out(chunk)
                chunk, nbytes = ([t], size) if t is not None else ([], 0)
