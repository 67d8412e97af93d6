"""What reliability costs: an 8-byte allreduce with checking off/on and the watchdog off/on.

    mpiexec -n 3 python tests/faults/cost.py [iterations] [rounds]

Prints, on rank 0, the median over ``rounds`` of the mean time per call (microseconds) of
``iterations`` back-to-back allreduces of one float64, for the native and ring algorithms, and
the cost of the watchdog's registration alone (``watch`` + ``unwatch``, in one process). The
configurations are interleaved within each round, so a machine whose load drifts biases none.
"""
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as coll
from collectives import watchdog
from collectives.executor import context

iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 300
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
x = np.ones(1, np.float64)
out = np.empty_like(x)
default = watchdog.timeout()
CONFIGS = [(algorithm, check, timeout) for algorithm in ("native", "ring")
           for check, timeout in ((False, 0), (False, 300), (True, 300))]


def mean_call(algorithm, check, timeout):
    watchdog.set_timeout(timeout)
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(iterations):
        coll.allreduce(x, out=out, algorithm=algorithm, check=check)
    watchdog.set_timeout(default)
    return (time.perf_counter() - t) / iterations * 1e6


for config in CONFIGS:  # warm up: contexts, schedules, the watchdog thread
    for _ in range(20):
        coll.allreduce(x, out=out, algorithm=config[0], check=config[1])
times = {config: [] for config in CONFIGS}
for _ in range(rounds):
    for config in CONFIGS:
        times[config].append(mean_call(*config))

ctx = context(comm)
t = time.perf_counter()
for _ in range(100000):
    watchdog.unwatch(watchdog.watch(ctx, what="probe"))
watch_us = (time.perf_counter() - t) / 100000 * 1e6

if rank == 0:
    print(f"8-byte allreduce (1 x float64), {comm.Get_size()} ranks, median of {rounds} rounds "
          f"of {iterations} calls")
    print("| algorithm | COLLECTIVES_CHECK | watchdog | time per call | vs. both off |")
    print("| --- | --- | --- | --- | --- |")
    for algorithm, check, timeout in CONFIGS:
        t = statistics.median(times[(algorithm, check, timeout)])
        base = statistics.median(times[(algorithm, False, 0)])
        dog = f"on ({timeout:g} s)" if timeout else "off"
        print(f"| {algorithm} | {int(check)} | {dog} | {t:.1f} us | {t / base:.2f}x |")
    print(f"watchdog registration alone (watch + unwatch): {watch_us:.2f} us per call")
