"""For benchmarks that run without ``mpiexec`` and launch their own jobs (``bench fsdp``,
``bench wall``): which ``mpiexec`` to launch them with."""
from __future__ import annotations

import os
import shutil
import sys

__all__ = ["mpiexec"]


def mpiexec(given: str | None = None) -> str:
    """``given`` (``--mpiexec``), else the ``mpiexec`` beside this Python (a venv's), else the
    one on ``PATH``; none at all ends the program, saying so."""
    if given:
        return given
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if not found:
        raise SystemExit("no mpiexec beside this Python or on PATH; pass --mpiexec")
    return found
