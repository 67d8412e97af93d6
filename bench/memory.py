"""``mpiexec -n N python -m bench memory``: resident memory over a long loop of calls.

A training job issues the same calls every step for days; a call that something keeps after it
completes (a request, the watchdog's registry, a pending list) keeps its buffers, and the loop
ends in an out-of-memory crash. For each form of call that a training loop repeats (every
non-blocking collective on fresh arrays, an allreduce on registered buffers, the torch drop-in's
``all_reduce(async_op=True)``), this runs ``--calls`` calls of ``--bytes`` each and prints the
resident set after the warm-up (``--warmup``) and at the end, and the largest growth over the
ranks. ``tests/test_memory.py`` asserts the same at a smaller scale.
"""
from __future__ import annotations

import argparse

import numpy as np

from bench.harness import abort_on_error
from bench.units import format_size, parse_size

__all__ = ["cases", "rss_mib", "main"]


def rss_mib() -> float:
    """This process's resident set, MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def cases(comm, nbytes: int) -> dict:
    """{name: one call} for each form of call, ``nbytes`` per rank."""
    import collectives as coll
    n, r = comm.Get_size(), comm.Get_rank()
    count = max(n, nbytes // 4)
    reg = coll.empty(count, np.float32)
    calls = {
        "iallreduce": lambda: coll.iallreduce(np.ones(count, np.float32)).wait(),
        "iallreduce in place": lambda: (lambda a: coll.iallreduce(a, out=a).wait())(
            np.ones(count, np.float32)),
        "ireduce_scatter": lambda: coll.ireduce_scatter(np.ones(count, np.float32)).wait(),
        "iallgather (ragged)": lambda: coll.iallgather(
            np.ones(count // n + r, np.float32)).wait(),
        "ibroadcast": lambda: coll.ibroadcast(np.ones(count, np.float32)).wait(),
        "ialltoall": lambda: coll.ialltoall(np.ones(count // n * n, np.float32)).wait(),
        "coll.empty + allreduce": lambda: coll.allreduce(reg, out=reg),
    }
    try:
        import torch

        from collectives.torch import all_reduce
    except ImportError:
        return calls
    calls["torch all_reduce(async_op=True)"] = \
        lambda: all_reduce(torch.ones(count), async_op=True).wait()
    return calls


def main(argv=None) -> int:
    """``mpiexec -n N python -m bench memory [options]``."""
    p = argparse.ArgumentParser(prog="python -m bench memory",
                                description="resident memory over a long loop of calls")
    p.add_argument("--calls", type=int, default=4000, help="calls of each form (default 4000)")
    p.add_argument("--warmup", type=int, default=500,
                   help="calls before the first reading (default 500)")
    p.add_argument("--bytes", default="1M", help="bytes per rank and call (default 1M)")
    args = p.parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    abort_on_error(comm)
    nbytes = parse_size(args.bytes)
    calls, warmup = max(1, args.calls), max(0, min(args.warmup, args.calls - 1))
    if comm.Get_rank() == 0:
        print(f"# resident memory, {comm.Get_size()} ranks, {format_size(nbytes)} per call, "
              f"{calls} calls each; growth = the largest over the ranks from call {warmup} to "
              f"call {calls}\n\n| call | RSS at call {warmup} (MiB) | at call {calls} | "
              f"growth (MiB) |\n|:---|---:|---:|---:|", flush=True)
    for name, call in cases(comm, nbytes).items():
        first = rss_mib()
        for i in range(calls):
            call()
            if i + 1 == warmup:
                first = rss_mib()
        last = rss_mib()
        grown = comm.allreduce(last - first, op=MPI.MAX)
        if comm.Get_rank() == 0:
            print(f"| {name} | {first:.0f} | {last:.0f} | {grown:+.1f} |", flush=True)
    return 0
