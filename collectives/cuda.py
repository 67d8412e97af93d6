"""Whether the MPI library takes device memory itself (CUDA-awareness).

The adaptors that make the ``Buffer`` of a cupy array or a CUDA tensor are
``collectives.buffers``' (``wrap_cupy``, ``wrap_torch_cuda``; cupy is imported only by programs
that use device memory), re-exported here with ``import_cupy`` and ``bf16_supported``.

``awareness()`` says whether the MPI library reads and writes device memory itself: the setting
``COLLECTIVES_CUDA_AWARE`` (``collectives.config``), else the library's own answer
(``MPIX_Query_cuda_support``, exported by Open MPI and MPICH >= 4), else its settings (Open MPI:
``ompi_info``; MPICH family: ``MPIR_CVAR_ENABLE_GPU``, ``MPICH_GPU_SUPPORT_ENABLED``,
``MV2_USE_CUDA``). Messages are the same bytes either way, so ranks may even disagree.

How the bytes of device buffers move (handed to MPI, or staged through pinned host memory) is
``collectives.cuda_transport``.
"""
from __future__ import annotations

import os

from . import config
from .buffers import bf16_supported, import_cupy, wrap_cupy
from .buffers import wrap_torch_cuda as wrap_torch

__all__ = ["wrap_cupy", "wrap_torch", "import_cupy", "bf16_supported", "awareness", "aware"]


# -- is the MPI library CUDA-aware? ----------------------------------------------------------------
_DETECTED = None


def awareness() -> tuple[bool, str]:
    """``(aware, how we know)``: whether device buffers go to MPI directly."""
    global _DETECTED
    setting = config.get("COLLECTIVES_CUDA_AWARE")
    if setting is not None:
        return setting, f"COLLECTIVES_CUDA_AWARE={int(setting)}"
    if _DETECTED is None:
        _DETECTED = _detect()
    return _DETECTED


def aware() -> bool:
    """Whether device buffers are handed to MPI directly (see ``awareness``)."""
    return awareness()[0]


def _mpi_symbol(name):
    """``name`` from the MPI library mpi4py loaded (ctypes; None when it does not export it)."""
    import ctypes
    from mpi4py import MPI
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    try:  # dlsym on mpi4py's extension also searches the libmpi it links
        lib = ctypes.CDLL(MPI.__file__, mode=mode)
    except OSError:
        return None
    fn = getattr(lib, name, None)
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = []
    return fn


def _detect() -> tuple[bool, str]:
    from mpi4py import MPI
    query = getattr(MPI, "Query_cuda_support", None)  # a later mpi4py may expose it
    if query is not None:
        return bool(query()), "MPI.Query_cuda_support()"
    fn = _mpi_symbol("MPIX_Query_cuda_support")
    if fn is not None:
        return bool(fn()), "MPIX_Query_cuda_support()"
    vendor = MPI.get_vendor()[0]
    if vendor == "Open MPI":
        return _ompi_info()
    for var in ("MPIR_CVAR_ENABLE_GPU", "MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA"):
        value = os.environ.get(var, "").strip().lower()
        if value in config.ON_WORDS:
            return True, f"{var}={value}"
    return False, f"{vendor} gives no CUDA query; staging (set COLLECTIVES_CUDA_AWARE=1 to " \
                  f"override)"


def _ompi_info() -> tuple[bool, str]:
    import subprocess
    try:
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"ompi_info failed ({exc}); staging"
    built = "mpi_built_with_cuda_support:value:true" in out
    return built, f"ompi_info: mpi_built_with_cuda_support={'true' if built else 'false'}"
