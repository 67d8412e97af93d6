"""Single-copy reads from another process's memory: Linux cross-memory attach (CMA).

``process_vm_readv(pid, local, remote)`` copies bytes straight from another process's address
space into ours, one copy with no shared staging buffer in between. It is what MPICH's and
Open MPI's single-copy shared-memory transports use for large messages; ``collectives.node.shm``
uses it to read a peer's input and result buffers directly (see its module doc).

The kernel allows it where this process may ptrace the other (same user and, under Yama's
``ptrace_scope = 1``, a process that declared us its tracer). ``allow_peers()`` makes that
declaration (``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``, as Open MPI's CMA transport does);
``collectives.node.shm`` calls it only when a probe read between the ranks of a node fails, and
turns CMA off (two copies through the window instead) if the probe still fails.
``COLLECTIVES_SHM_CMA=0`` (or ``config.set("COLLECTIVES_SHM_CMA", False)``) turns it off there.
"""
from __future__ import annotations

import ctypes
import os

__all__ = ["Reader", "available", "allow_peers"]

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None, None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return libc, fn


_LIBC, _READV = _libc()


def available() -> bool:
    """Whether this system has ``process_vm_readv`` (Linux)."""
    return _READV is not None


def allow_peers() -> bool:
    """Let processes of this user read our memory under Yama (``PR_SET_PTRACER_ANY``)."""
    if _LIBC is None:
        return False
    try:
        return _LIBC.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0) == 0
    except AttributeError:
        return False


class Reader:
    """Reads ``nbytes`` at an address of process ``pid`` into an address of ours.

    One pair of iovecs, reused (a call costs about a microsecond of ctypes); the GIL is released
    while the kernel copies. A short read (the peer unmapped the range) or an error raises
    ``OSError`` naming the peer.
    """

    __slots__ = ("_local", "_remote", "_lp", "_rp")

    def __init__(self):
        self._local, self._remote = _Iovec(), _Iovec()
        self._lp, self._rp = ctypes.byref(self._local), ctypes.byref(self._remote)

    def read(self, pid: int, dst: int, src: int, nbytes: int) -> None:
        local, remote = self._local, self._remote
        while nbytes > 0:
            local.base, local.len = dst, nbytes
            remote.base, remote.len = src, nbytes
            got = _READV(pid, self._lp, 1, self._rp, 1, 0)
            if got <= 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_readv of {nbytes} bytes from process {pid}: "
                                   f"{os.strerror(err) if got < 0 else 'nothing read'}")
            dst, src, nbytes = dst + got, src + got, nbytes - got
