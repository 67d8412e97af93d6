"""Test configuration for both tiers.

In-process tests run in one process (``python -m pytest -m "not mpi"``). MPI tests are marked
``mpi`` and run under ``mpiexec -n N python -m pytest --with-mpi -m mpi``. Under MPI a failure
on one rank must never leave the others waiting: a failed test prints its report and calls
``COMM_WORLD.Abort(1)`` (the whole job ends, non-zero), every test has a timeout (thread method,
which interrupts a rank blocked inside MPI), and ``MPIEXEC_TIMEOUT`` bounds the job.
"""
import os
import sys

import pytest


def _mpi_world():
    if "mpi4py.MPI" not in sys.modules:
        return None
    from mpi4py import MPI
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return MPI.COMM_WORLD


_CONFIG = None


def pytest_configure(config):
    global _CONFIG
    _CONFIG = config


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if not report.failed or os.environ.get("COLLECTIVES_TEST_NO_ABORT"):
        return
    world = _mpi_world()
    if world is None or world.Get_size() == 1:
        return
    capture = _CONFIG.pluginmanager.getplugin("capturemanager") if _CONFIG else None
    if capture is not None:
        capture.suspend_global_capture(in_=False)  # so the report reaches the terminal
    sys.stderr.write(f"\n[rank {world.Get_rank()}] FAILED {report.nodeid} ({report.when})\n"
                     f"{report.longreprtext}\n[rank {world.Get_rank()}] aborting the job\n")
    sys.stderr.flush()
    world.Abort(1)
