"""Test configuration for both tiers.

In-process tests run in one process (``python -m pytest -m "not mpi"``). MPI tests are marked
``mpi`` and run under ``mpiexec -n N python -m pytest --with-mpi -m mpi``. Under MPI a failure
on one rank must never leave the others waiting: a failed test prints its report and calls
``COMM_WORLD.Abort(1)`` (the whole job ends, non-zero), every test has a timeout (thread method,
which interrupts a rank blocked inside MPI), and ``MPIEXEC_TIMEOUT`` bounds the job. Only rank 0
prints pytest's progress and summary; another rank prints the report of a test that fails there
(then aborts the job, as above).

Settings (``collectives.config``) are read once per process: a test that changes one uses the
``setting`` fixture (``config.set`` for the test's duration), or changes ``os.environ`` and calls
``config.reload()`` after the change and after restoring it.
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
_STDOUT = []  # a quiet rank's real sys.stdout while the terminal reporter is being made


def _quiet_rank(config) -> bool:
    """Whether this process is a rank other than 0 of an ``--with-mpi`` job."""
    return _RANK not in (None, "0") and bool(config.getoption("--with-mpi", default=False))


@pytest.hookimpl(tryfirst=True)
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
    if _quiet_rank(config):
        # Ranks other than 0 run the same tests: only rank 0 prints progress and the summary.
        # The terminal reporter (made by pytest's own pytest_configure, after this one) writes
        # to the sys.stdout it finds then: os.devnull here, the real one again from
        # pytest_sessionstart. A failure on this rank is still printed, to stderr
        # (pytest_runtest_logreport below).
        config.option.verbose = -2
        config.option.reportchars = ""
        _STDOUT.append(sys.stdout)
        sys.stdout = open(os.devnull, "w")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    if _STDOUT:
        sys.stdout = _STDOUT.pop()


def pytest_unconfigure(config):
    base = config.option.basetemp
    if _RANK is not None and base and os.path.basename(base).startswith("pytest-mpi-"):
        import shutil
        shutil.rmtree(base, ignore_errors=True)


def _print_failure(report, what: str, rank=_RANK, tail: str = "") -> None:
    """Write ``report`` to stderr, past pytest's capture, marked with this rank."""
    capture = _CONFIG.pluginmanager.getplugin("capturemanager") if _CONFIG else None
    if capture is not None:
        capture.suspend_global_capture(in_=False)  # so the report reaches the terminal
    sys.stderr.write(f"\n[rank {rank}] {what} {report.nodeid} ({report.when})\n"
                     f"{report.longreprtext}\n{tail}")
    sys.stderr.flush()


@pytest.hookimpl(trylast=True)
def pytest_collectreport(report):
    if report.failed and _CONFIG is not None and _quiet_rank(_CONFIG):
        _print_failure(report, "ERROR collecting")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if not report.failed:
        return
    world = None if os.environ.get("COLLECTIVES_TEST_NO_ABORT") else _mpi_world()
    if world is None or world.Get_size() == 1:
        if _CONFIG is not None and _quiet_rank(_CONFIG):  # its terminal reporter is silent
            _print_failure(report, "FAILED")
        return
    rank = world.Get_rank()
    _print_failure(report, "FAILED", rank, f"[rank {rank}] aborting the job\n")
    world.Abort(1)


@pytest.fixture
def process_group():
    """torch.distributed on the toolkit's backend for one test (left as found: a group that
    another test made stays, one made here is destroyed, so later tests can make their own)."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    import collectives.torch.backend as cb
    made = not dist.is_initialized()
    if made:
        cb.init_process_group()
    yield
    if made:
        dist.destroy_process_group()


@pytest.fixture
def setting():
    """``setting(name, value)``: ``config.set(name, value)`` for this test only (a blank value:
    the default, as an empty variable is). Settings are read once per process, so a test that
    changed ``os.environ`` instead would need ``config.reload()`` after the change and after
    restoring it."""
    from collectives import config
    olds = []

    def put(name, value):
        if isinstance(value, str) and not value.strip():
            value = None
        olds.append((name, config.set(name, value)))

    yield put
    for name, old in reversed(olds):
        config.set(name, old)
