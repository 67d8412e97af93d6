"""What a process holds, measured by the process (Linux): the resident set now and its peak since
a reset, for checking the memory model against a run.

    measure.steady_allocator()       # large blocks from mmap, returned to the system when freed
    base = measure.reset_peak()      # the resident set now; the peak restarts from it
    ...                              # build the model, train
    held = measure.peak() - base     # the most the run added, bytes

``reset_peak`` writes 5 to ``/proc/self/clear_refs`` (the kernel's reset of ``VmHWM``) and
returns ``VmRSS``; ``peak`` reads ``VmHWM``. ``steady_allocator`` fixes glibc's mmap threshold
at 64 KiB (``mallopt(M_MMAP_THRESHOLD)``): by default the threshold grows after large frees, and
freed tensors then stay in the heap, so the resident set would count memory the program no
longer holds.
"""
from __future__ import annotations

__all__ = ["rss", "peak", "reset_peak", "steady_allocator"]

_M_MMAP_THRESHOLD = -3


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss() -> int:
    """Resident bytes now (``VmRSS``)."""
    return _status("VmRSS")


def peak() -> int:
    """The most resident bytes since the last ``reset_peak`` (``VmHWM``)."""
    return _status("VmHWM")


def reset_peak() -> int:
    """Restart the peak from the resident set now; returns it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss()


def steady_allocator(threshold: int = 1 << 16) -> bool:
    """Serve blocks of ``threshold`` bytes or more from mmap (returned when freed); whether the
    C library took the setting."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
