"""What reliability costs: an 8-byte allreduce with checking off/on and the watchdog off/on (on: its defaults).

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
from collectives import config, watchdog
from collectives.executor import context

iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 300
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
x = np.ones(1, np.float64)
out = np.empty_like(x)
WATCHDOG = ("COLLECTIVES_TIMEOUT", "COLLECTIVES_STALL_WARNING")
CONFIGS = [(algorithm, check, watched) for algorithm in ("native", "ring")
           for check, watched in ((False, False), (False, True), (True, True))]


def mean_call(algorithm, check, watched):
    old = {name: config.set(name, 0) for name in WATCHDOG} if not watched else {}
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(iterations):
        coll.allreduce(x, out=out, algorithm=algorithm, check=check)
    for name, value in old.items():
        config.set(name, value)
    return (time.perf_counter() - t) / iterations * 1e6


for setup in CONFIGS:  # warm up: contexts, schedules, the watchdog thread
    for _ in range(20):
        coll.allreduce(x, out=out, algorithm=setup[0], check=setup[1])
times = {setup: [] for setup in CONFIGS}
for _ in range(rounds):
    for setup in CONFIGS:
        times[setup].append(mean_call(*setup))

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
    for algorithm, check, watched in CONFIGS:
        t = statistics.median(times[(algorithm, check, watched)])
        base = statistics.median(times[(algorithm, False, False)])
        dog = "on (the defaults)" if watched else "off"
        print(f"| {algorithm} | {int(check)} | {dog} | {t:.1f} us | {t / base:.2f}x |")
    print(f"watchdog registration alone (watch + unwatch): {watch_us:.2f} us per call")
