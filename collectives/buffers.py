"""Buffer adaptors: one per array kind, each giving a flat zero-copy view the executor works on.

``wrap(x)`` returns a ``Buffer``: the caller's object, a flat 1-D *view* of its memory as a numpy
array (or a cupy array for device memory), its dtype, shape, device and whether it may be written.
Nothing is copied: a reduction written into ``Buffer.flat`` lands in the caller's array. The
executor only ever sees ``flat`` (numpy or cupy: both accept numpy's ufuncs with ``out=``) and
``Buffer.new`` to make a result of the caller's kind.

Adaptors are tried in order; ``register`` adds one. Cupy arrays and CUDA tensors are seen
through cupy, imported the first time one shows up (``import_cupy``). Accepted dtypes: bool,
int8-64, uint8-64, float16, bfloat16 (ml_dtypes), float32, float64, complex64, complex128.
Buffers must be C-contiguous: a strided view would need a hidden copy, so it is refused with a
``ValueError`` instead.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Buffer", "wrap", "numpy_buffer", "register", "check_dtype", "require_contiguous",
           "torch_dtype_to_numpy", "DTYPES", "bfloat16", "import_cupy", "bf16_supported",
           "wrap_cupy", "wrap_torch_cuda"]

try:
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency
    bfloat16 = None

DTYPES = tuple(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
)) + ((np.dtype(bfloat16),) if bfloat16 is not None else ())


class Buffer:
    """A caller's array seen as a flat typed view (``flat``) plus what it takes to mirror it."""

    __slots__ = ("obj", "flat", "count", "shape", "dtype", "kind", "device", "readonly", "_new")

    def __init__(self, obj, flat, shape, kind, *, device="cpu", readonly=False, new=None):
        self.obj = obj
        self.flat = flat
        self.count = int(flat.shape[0])  # elements
        self.shape = shape if type(shape) is tuple else tuple(shape)
        dtype = flat.dtype
        self.dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        self.kind = kind
        self.device = device
        self.readonly = readonly
        self._new = new

    @property
    def is_device(self) -> bool:
        """Whether the memory is a device's (not the host's)."""
        return self.device != "cpu"

    def new(self, shape) -> Buffer:
        """A fresh, writable buffer of the same kind, dtype and device with ``shape``."""
        if self._new is None:  # numpy: a fresh array is contiguous and writable
            return numpy_buffer(np.empty(shape, self.dtype))
        return self._new(tuple(shape))

    def describe(self) -> str:
        """The buffer in words: kind, dtype, shape and device."""
        return f"{self.kind} {self.dtype.name}{list(self.shape)} on {self.device}"


_ADAPTORS: list = []


def register(adaptor, *, first: bool = False) -> None:
    """Add ``adaptor(x) -> Buffer | None`` (None: not mine) to the ones ``wrap`` tries."""
    if first:
        _ADAPTORS.insert(0, adaptor)
    else:
        _ADAPTORS.append(adaptor)


_DTYPE_SET = frozenset(DTYPES)


def check_dtype(dtype) -> np.dtype:
    """``dtype`` as a numpy dtype, or a TypeError naming the supported ones."""
    if isinstance(dtype, np.dtype) and dtype in _DTYPE_SET:
        return dtype
    dtype = np.dtype(dtype)
    if dtype not in _DTYPE_SET:
        raise TypeError(f"unsupported dtype {dtype.name}; supported: "
                        f"{', '.join(d.name for d in DTYPES)}")
    return dtype


def wrap(x, what: str = "x") -> Buffer:
    """The ``Buffer`` for a numpy array, torch tensor or cupy array; TypeError/ValueError else."""
    if type(x) is np.ndarray:  # the common case, checked here (else by _numpy, which raises)
        flags = x.flags
        if flags.c_contiguous and x.dtype in _DTYPE_SET:
            return numpy_buffer(x, not flags.writeable)
        return _numpy(x)
    for adaptor in _ADAPTORS:
        buf = adaptor(x)
        if buf is not None:
            check_dtype(buf.dtype)
            return buf
    raise TypeError(f"{what}: expected a numpy array, torch tensor or cupy array, "
                    f"got {type(x).__name__}")


def require_contiguous(ok: bool, x, what="buffer") -> None:
    """A ValueError unless ``ok`` (``x`` is C-contiguous), saying how to get a contiguous copy."""
    if not ok:
        raise ValueError(f"{what} of shape {tuple(x.shape)} is not C-contiguous; pass a "
                         f"contiguous copy (numpy.ascontiguousarray / tensor.contiguous())")


# -- numpy --------------------------------------------------------------------------------------
_blank = object.__new__


def _numpy(x):
    if not isinstance(x, np.ndarray):
        return None
    flags = x.flags
    if not flags.c_contiguous:
        require_contiguous(False, x, "numpy array")
    dtype = x.dtype
    if dtype not in _DTYPE_SET:
        check_dtype(dtype)  # raises the TypeError
    return numpy_buffer(x, not flags.writeable)


register(_numpy)


class _NumpyBuffer(Buffer):
    """A numpy array's ``Buffer``: host memory, and ``new`` makes a numpy array (what every
    numpy Buffer has alike is the class's, not filled in on every call)."""

    __slots__ = ()
    kind, device, _new = "numpy", "cpu", None


def numpy_buffer(x: np.ndarray, readonly: bool = False, into: Buffer | None = None) -> Buffer:
    """The ``Buffer`` of a numpy array already known to be C-contiguous and of a supported
    dtype (``wrap`` without its checks). Every call wraps its buffers: filled slot by slot,
    this is 0.5 us quicker than ``__init__``. ``into``: a numpy ``Buffer`` of x's shape and
    dtype to fill instead, as a signature's plan keeps its own (``signature.Plan``)."""
    if into is None:
        buf = _blank(_NumpyBuffer)
        shape = buf.shape = x.shape
        buf.count = x.size
        buf.dtype = x.dtype
    else:
        buf, shape = into, into.shape
    buf.obj = x
    buf.flat = x if len(shape) == 1 else x.reshape(-1)
    buf.readonly = readonly
    return buf


# -- torch (CPU here; CUDA tensors are viewed through cupy, below) -------------------------------
def _torch_module():
    import sys
    return sys.modules.get("torch")  # never import torch just to look at a buffer


def torch_dtype_to_numpy(dtype):
    """The numpy dtype of torch dtype ``dtype`` (ml_dtypes' for bfloat16)."""
    import torch
    if dtype == torch.bfloat16:
        return np.dtype(bfloat16)
    return torch.empty((), dtype=dtype).numpy().dtype


def _torch(x):
    torch = _torch_module()
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    if x.device.type == "cuda":
        return wrap_torch_cuda(x)  # a cupy view of the tensor's memory; TypeError without cupy
    if x.device.type != "cpu":
        raise TypeError(f"{x.device.type} tensors are not supported (CPU and CUDA tensors are); "
                        f"got a tensor on {x.device}")
    require_contiguous(x.is_contiguous(), x, "torch tensor")
    t = x.detach()
    if t.dtype == torch.bfloat16:
        flat = t.view(torch.int16).numpy().view(bfloat16).reshape(-1)
    elif t.dtype in (torch.float16, torch.float32, torch.float64, torch.complex64,
                     torch.complex128, torch.bool, torch.int8, torch.int16, torch.int32,
                     torch.int64, torch.uint8):
        flat = t.numpy().reshape(-1)
    else:
        raise TypeError(f"unsupported torch dtype {x.dtype}")
    return Buffer(x, flat, x.shape, "torch", device="cpu", readonly=False,
                  new=lambda shape: _torch(torch.empty(shape, dtype=x.dtype)))


register(_torch)


# -- device memory: cupy arrays and CUDA tensors, cupy imported only when one shows up ----------
# ``Buffer.flat`` is a zero-copy 1-D *cupy* view (a CUDA tensor is seen through DLPack), so the
# executor's reductions, ``numpy.add(a, b, out=dst)``, dispatch to cupy through
# ``__array_ufunc__`` and run on the GPU. bfloat16 needs a cupy that knows ml_dtypes' bfloat16
# (cupy >= 14); a tensor is viewed as int16 and then as bfloat16, because DLPack export of
# bfloat16 is newer still. An older cupy gets a TypeError rather than a silent round trip
# through the host.
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


def wrap_torch_cuda(t) -> Buffer:
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
                  new=lambda shape: wrap_torch_cuda(torch.empty(shape, dtype=tdtype, device=dev)))


def _cupy(x):
    module = type(x).__module__
    if module != "cupy" and not module.startswith("cupy."):
        return None
    return wrap_cupy(x)


register(_cupy)
