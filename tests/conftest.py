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


# The rank, when an MPI launcher started this process (MPICH's Hydra, Open MPI).
_RANK = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")


def pytest_configure(config):
    global _CONFIG
    _CONFIG = config
    if _RANK is not None and config.option.basetemp is None:
        # Each rank its own tmp_path root: the ranks of one job shared pytest's default one and
        # raced to prune its old directories ("rm_rf ... Directory not empty" warnings).
        # Named by the launcher's process on this node (the same for every rank of the job).
        import tempfile
        config.option.basetemp = os.path.join(
            tempfile.gettempdir(), f"pytest-mpi-{os.getppid()}-rank{_RANK}")


def pytest_unconfigure(config):
    base = config.option.basetemp
    if _RANK is not None and base and os.path.basename(base).startswith("pytest-mpi-"):
        import shutil
        shutil.rmtree(base, ignore_errors=True)


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


@pytest.fixture(autouse=True)
def roomy_node(monkeypatch):
    """No node is crowded unless a test says so: ``auto``'s trials then race the same way on a
    machine with a core for every rank and on one with fewer (3 ranks on CI's 2 cores), where
    calls under ``_Trial.CROWDED_MIN`` bytes would not race (collectives.api._Trial)."""
    from collectives import api
    monkeypatch.setattr(api._Trial, "_crowded", lambda self: 0.0)
