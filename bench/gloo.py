"""torch.distributed's CPU collectives (the gloo backend) as a benchmark baseline.

``init(comm)`` starts a gloo process group over the MPI ranks: rank 0 opens a ``TCPStore`` on a
free port of its host (127.0.0.1 when every rank shares that host), the port is broadcast over
MPI, and the others connect. The numpy buffers are handed to torch with ``torch.from_numpy``
(zero-copy), so gloo reads and writes the very arrays the harness checks. Returns None when
torch is not importable.
"""
from __future__ import annotations

import os
import socket
import sys
import warnings

import numpy as np

__all__ = ["init", "Gloo", "OPS", "DTYPES"]

# Our op names -> torch.distributed.ReduceOp names (gloo has no avg).
OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "band": "BAND",
       "bor": "BOR", "bxor": "BXOR"}


# The dtypes gloo reduces (torch 2.13, 2 ranks, one all_reduce of each): int16, uint16, uint32
# and uint64 raise "Invalid scalar type" at the first call, on every rank.
DTYPES = ("int8", "int32", "int64", "uint8", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128")


class Gloo:
    """A live gloo process group; ``call`` wraps one collective on numpy buffers."""

    def __init__(self, dist, torch):
        self.dist, self.torch = dist, torch

    def tensor(self, arr: np.ndarray):
        """A torch view of ``arr`` (bfloat16 through its 16-bit pattern)."""
        if arr.dtype.name == "bfloat16":
            return self.torch.from_numpy(arr.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(arr)

    def call(self, spec, x, out, mode, op, root):
        """A callable running ``spec``'s gloo collective, or None if gloo cannot run it."""
        if x.dtype.kind == "b":
            return None
        torch_op = None
        if spec.has_op:
            if op not in OPS:
                return None
            torch_op = getattr(self.dist.ReduceOp, OPS[op])
        try:
            tx, tout = self.tensor(x), self.tensor(out)
        except (TypeError, RuntimeError):  # a dtype torch has no tensor for (uint32, ...)
            return None
        return spec.gloo(self.dist, tx, tout, mode, torch_op, root)

    def close(self) -> None:
        """Destroy the process group."""
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def init(comm) -> Gloo | None:
    """Start gloo on the ranks of ``comm`` (collective over ``comm``); None without torch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1
    addr = "127.0.0.1" if one_host else hosts[0]
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store, port = None, None
    if rank == 0:
        store = dist.TCPStore(addr if not one_host else "127.0.0.1", 0, size, True,
                              wait_for_workers=False)
        port = store.port
    port = comm.bcast(port, root=0)
    if rank != 0:
        store = dist.TCPStore(addr, port, size, False)
    # init_process_group wraps sys.excepthook in one that buffers the traceback and writes it
    # after the hook it wraps returns; that hook aborts the job (bench.harness.abort_on_error),
    # so an error after gloo's rows would end the job without a word. Keep the hook as it was.
    hook = sys.excepthook
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    sys.excepthook = hook
    return Gloo(dist, torch)
