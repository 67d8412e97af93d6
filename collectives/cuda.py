"""Device memory as buffers: cupy arrays and CUDA torch tensors, and whether MPI takes them.

Adaptors
    ``wrap_cupy`` and ``wrap_torch`` make the ``Buffer`` of a cupy array or a CUDA tensor
    (``collectives.buffers`` calls them the first time such an object shows up, so cupy is only
    imported by programs that use device memory). ``Buffer.flat`` is a zero-copy 1-D *cupy* view
    (a CUDA tensor is seen through DLPack), so the executor's reductions, ``numpy.add(a, b,
    out=dst)``, dispatch to cupy through ``__array_ufunc__`` and run on the GPU. bfloat16 needs a
    cupy that knows ml_dtypes' bfloat16 (cupy >= 14); a tensor is viewed as int16 and then as
    bfloat16, because DLPack export of bfloat16 is newer still. An older cupy gets a TypeError
    rather than a silent round trip through the host.

CUDA-awareness
    ``awareness()`` says whether the MPI library reads and writes device memory itself: the
    setting ``COLLECTIVES_CUDA_AWARE`` (``collectives.config``), else the library's own answer
    (``MPIX_Query_cuda_support``, exported by Open MPI and MPICH >= 4), else its settings (Open
    MPI: ``ompi_info``; MPICH family: ``MPIR_CVAR_ENABLE_GPU``, ``MPICH_GPU_SUPPORT_ENABLED``,
    ``MV2_USE_CUDA``). Messages are the same bytes either way, so ranks may even disagree.

How the bytes of device buffers move (handed to MPI, or staged through pinned host memory) is
``collectives.cuda_transport``.
"""
from __future__ import annotations

import os

import numpy as np

from . import config
from .buffers import Buffer, bfloat16, check_dtype, require_contiguous, torch_dtype_to_numpy

__all__ = ["wrap_cupy", "wrap_torch", "import_cupy", "bf16_supported", "awareness", "aware"]

_CUPY = None
_BF16: dict = {}  # "ok": whether this cupy computes on bfloat16


def import_cupy():
    """The cupy module, or a TypeError that says what to install."""
    global _CUPY
    if _CUPY is None:
        try:
            import cupy
        except Exception as exc:  # noqa: BLE001 - ImportError, or CUDA libraries missing
            raise TypeError(f"CUDA buffers need cupy (pip install cupy-cuda12x, or the cupy "
                            f"matching your CUDA): importing it failed: {exc}") from exc
        _CUPY = cupy
    return _CUPY


def bf16_supported(cp) -> bool:
    """Whether this cupy computes on ml_dtypes' bfloat16 (cupy >= 14 with ml_dtypes)."""
    ok = _BF16.get("ok")
    if ok is None:
        try:
            a = cp.ones(2, dtype=bfloat16)
            cp.add(a, a, out=a)
            ok = bool((a.view(cp.uint16) == 0x4000).all())  # 2.0 in bfloat16
        except Exception:  # noqa: BLE001 - unsupported dtype, old cupy
            ok = False
        _BF16["ok"] = ok
    return ok


def _no_bf16(cp):
    return TypeError(f"bfloat16 device buffers need cupy >= 14 with ml_dtypes (cupy "
                     f"{cp.__version__} cannot compute on bfloat16); use float16/float32 or "
                     f"upgrade cupy")


# -- adaptors ------------------------------------------------------------------------------------
def wrap_cupy(x) -> Buffer | None:
    """The ``Buffer`` of a cupy array (None for other cupy objects)."""
    cp = import_cupy()
    if not isinstance(x, cp.ndarray):
        return None
    require_contiguous(x.flags.c_contiguous, x, "cupy array")
    dtype = check_dtype(x.dtype)
    if dtype == np.dtype(bfloat16) and not bf16_supported(cp):
        raise _no_bf16(cp)
    index = x.device.id

    def new(shape):
        with cp.cuda.Device(index):
            return wrap_cupy(cp.empty(shape, dtype))

    return Buffer(x, x.reshape(-1), x.shape, "cupy", device=f"cuda:{index}", new=new)


_TORCH_DIRECT = ("float16", "float32", "float64", "complex64", "complex128", "int8", "int16",
                 "int32", "int64", "uint8")


def _from_torch(cp, t, dtype):
    """A zero-copy 1-D cupy view of contiguous CUDA tensor ``t`` as ``dtype``."""
    flat = t.reshape(-1)
    if flat.numel() == 0:  # nothing to alias; DLPack of empty tensors varies between versions
        with cp.cuda.Device(t.device.index):
            return cp.empty(0, dtype)
    with cp.cuda.Device(t.device.index):
        return cp.from_dlpack(flat)


def wrap_torch(t) -> Buffer:
    """The ``Buffer`` of a CUDA tensor: a cupy view of its memory (DLPack, zero-copy)."""
    import torch
    cp = import_cupy()
    require_contiguous(t.is_contiguous(), t, "torch tensor")
    d = t.detach()
    tdtype = d.dtype
    if tdtype == torch.bfloat16:
        if not bf16_supported(cp):
            raise _no_bf16(cp)
        flat = _from_torch(cp, d.view(torch.int16), np.int16).view(bfloat16)
    elif tdtype == torch.bool:  # DLPack's bool code is recent; the bytes are the same
        flat = _from_torch(cp, d.view(torch.uint8), np.uint8).view(np.bool_)
    elif str(tdtype).replace("torch.", "") in _TORCH_DIRECT:
        flat = _from_torch(cp, d, torch_dtype_to_numpy(tdtype))
    else:
        raise TypeError(f"unsupported torch dtype {tdtype}")
    dev = d.device
    return Buffer(t, flat, t.shape, "torch", device=f"cuda:{dev.index}",
                  new=lambda shape: wrap_torch(torch.empty(shape, dtype=tdtype, device=dev)))


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
