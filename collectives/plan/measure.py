"""What a process holds, measured by the process (Linux): the resident set now and its peak since
a reset, for checking the memory model against a run.

    measure.steady_allocator()       # large blocks from mmap, returned to the system when freed
    measure.trim()                   # the heap's free pages back to the system
    ...                              # a warm-up of the same plan (examples/train_gpt.py)
    base = measure.reset_peak()      # the resident set now; the peak restarts from it
    ...                              # build the model, train
    held = measure.peak() - base     # the most the run added, bytes

``reset_peak`` writes 5 to ``/proc/self/clear_refs`` (the kernel's reset of ``VmHWM``) and
returns ``VmRSS``; ``peak`` reads ``VmHWM``. ``steady_allocator`` fixes glibc's mmap threshold
at 64 KiB (``mallopt(M_MMAP_THRESHOLD)``): by default the threshold grows after large frees, and
freed tensors then stay in the heap, so the resident set would count memory the program no
longer holds.

``trim`` gives the free pages of the C heap back to the system (``malloc_trim(0)``). Blocks
under the threshold (the bookkeeping of tensors, autograd's graphs, the interpreter's and MPI's
objects) come from the heap, and what a plan frees there stays resident and is reused by the
next plan in the process without raising its resident set: a job that measures plans one after
the other trims before each plan's warm-up, so that the free heap a plan starts from is its
warm-up's, not what the largest plan before it left.
"""
from __future__ import annotations

__all__ = ["rss", "peak", "reset_peak", "steady_allocator", "trim", "MMAP_THRESHOLD"]

_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 16   # ``steady_allocator``'s: blocks this large or larger are mapped alone


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


def _libc():
    import ctypes
    import ctypes.util
    return ctypes.CDLL(ctypes.util.find_library("c"))


def trim() -> bool:
    """Give the C heap's free pages back to the system; whether it gave any (glibc)."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


def steady_allocator(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve blocks of ``threshold`` bytes or more from mmap (returned when freed); whether the
    C library took the setting."""
    try:
        return bool(_libc().mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
