#!/usr/bin/env bash
# Fetch, here (where pip reaches the package index), the wheels that run_on_device.sh may need on
# the device machine (Python 3.12, x86-64, no network): an MPI library and mpiexec (MPICH), an
# mpi4py >= 4 that can load it, and pytest-mpi. They land in .whl/ (ignored by git) and travel
# with the device tool's `carry: [".whl"]`; the script installs only what the machine lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl \
    mpi4py==4.1.2 mpich==5.0.2 pytest-mpi==0.6
ls -l .whl
du -sh .whl
