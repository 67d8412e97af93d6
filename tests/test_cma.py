"""collectives.node.cma in one process: reads of our own memory through process_vm_readv, and the
errors (a bad address, a process that does not exist)."""
import os

import numpy as np
import pytest

from collectives.node import cma

pytestmark = pytest.mark.skipif(not cma.available(), reason="no process_vm_readv (not Linux)")


def test_read_own_memory():
    src = np.arange(100_003, dtype=np.float64)
    dst = np.zeros_like(src)
    cma.Reader().read(os.getpid(), dst.ctypes.data, src.ctypes.data, src.nbytes)
    assert np.array_equal(dst, src)


def test_read_slices_and_zero_bytes():
    src = np.arange(1000, dtype=np.int32)
    dst = np.full(1000, -1, np.int32)
    reader = cma.Reader()
    reader.read(os.getpid(), dst[10:].ctypes.data, src[500:].ctypes.data, 7 * 4)
    reader.read(os.getpid(), dst.ctypes.data, src.ctypes.data, 0)
    assert np.array_equal(dst[10:17], src[500:507])
    assert (dst[:10] == -1).all() and (dst[17:] == -1).all()


def test_bad_address_is_an_oserror():
    dst = np.zeros(4, np.int64)
    with pytest.raises(OSError, match="process_vm_readv of 32 bytes from process"):
        cma.Reader().read(os.getpid(), dst.ctypes.data, 8, dst.nbytes)


def test_missing_process_is_an_oserror():
    dst = np.zeros(4, np.int64)
    pid = 2 ** 22 + 12345  # above the default pid_max
    with pytest.raises(OSError):
        cma.Reader().read(pid, dst.ctypes.data, dst.ctypes.data, dst.nbytes)
