"""Report what the device check runs on: GPU, CUDA, cupy, torch, mpi4py, the MPI library and
whether it is CUDA-aware, and where ``collectives`` was imported from.

    python3 tests/gpu/gpu_check.py [OUT_DIR]      # prints JSON; writes OUT_DIR/env.json
"""
import json
import os
import platform
import sys

__all__ = ["report"]


def _try(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a report, not a test
        return f"unavailable: {exc!r}"


def _cupy():
    import cupy
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props["name"]
    return {"version": cupy.__version__, "runtime": rt.runtimeGetVersion(),
            "driver": rt.driverGetVersion(), "devices": rt.getDeviceCount(),
            "name": name.decode() if isinstance(name, bytes) else name,
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1)}


def _torch():
    import torch
    return {"version": torch.__version__, "cuda": torch.version.cuda,
            "available": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _mpi():
    import mpi4py
    from mpi4py import MPI
    maps = [line.split()[-1] for line in open("/proc/self/maps") if "libmpi" in line]
    return {"mpi4py": mpi4py.__version__, "vendor": list(MPI.get_vendor()),
            "library": MPI.Get_library_version().strip().splitlines()[0],
            "standard": list(MPI.Get_version()), "libmpi": sorted(set(maps))}


def _collectives():
    import collectives
    from collectives import cuda
    aware, how = cuda.awareness()
    out = {"path": os.path.dirname(collectives.__file__), "cuda_aware": aware, "how": how}
    out["bfloat16_on_gpu"] = _try(lambda: cuda.bf16_supported(cuda.import_cupy()))
    return out


def report() -> dict:
    """Everything above, as a dict (each part says 'unavailable: ...' where it failed)."""
    return {"python": sys.version.split()[0], "machine": platform.machine(),
            "numpy": _try(lambda: __import__("numpy").__version__),
            "ml_dtypes": _try(lambda: __import__("ml_dtypes").__version__),
            "cupy": _try(_cupy), "torch": _try(_torch), "mpi": _try(_mpi),
            "collectives": _try(_collectives),
            "env": {k: v for k, v in os.environ.items()
                    if k.startswith(("COLLECTIVES_", "MPI4PY_", "MPIR_CVAR", "OMPI_MCA",
                                     "UCX_", "FI_", "CUDA_VISIBLE"))}}


if __name__ == "__main__":
    info = report()
    text = json.dumps(info, indent=2, default=str)
    print(text)
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], "env.json"), "w") as f:
            f.write(text + "\n")
