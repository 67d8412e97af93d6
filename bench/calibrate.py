"""``mpiexec -n 2 python -m bench calibrate``: measure this machine's cost-model parameters.

1. *alpha, bandwidth* per link class: MPI ping-pong (``Send``/``Recv``) between rank 0 and rank 1
   (same node: the ``numa`` and ``node`` classes) and between rank 0 and the first rank on
   another node if there is one (``net``; else ``--net-alpha``/``--net-bw`` are kept): alpha is
   half the round trip of 8 bytes, the bandwidth the inverse slope of a least-squares line
   through the half round trips of 256 KiB .. 64 MiB. Each is the 5th percentile of many
   timed round trips, so that a busy machine's outliers do not count.
2. *reduce and copy bandwidth*: ``numpy.add(a, b, out=c)`` and ``numpy.copyto`` over 64 MiB in
   segment-sized pieces, every rank at once (the ranks of an allreduce reduce at the same time);
   bytes of result per second of the slowest rank.
   *Curves*: the same rates, and the ping-pong's, over buffers of 256 KiB .. 64 MiB. They fall
   by 2-5x from the smallest to the largest (cache, then memory). They are keyed by the bytes
   of all the ranks' buffers on the node (the cache is shared), and the model reads a call's
   rates at its buffers' bytes on a node (``CostModel.sized``); the scalars are the 64 MiB rates.
3. *overhead per op*: the executor's own cost, fitted through the model: a schedule of many
   8-byte ping-pongs runs through the MPI executor, and the overhead is the value that makes the
   model's time for that schedule equal the measured one.
4. *overhead per call*: likewise from an 8-byte ``ring`` allreduce through the public API.

The result goes to ``COLLECTIVES_COST_MODEL`` or ``~/.cache/collectives/costmodel.json`` (or
``-o``), where ``python -m bench model`` finds it. Run it with 2 ranks on an idle machine.

Run again with more ranks than cores (``mpiexec -n 3`` on 2 cores) to add ``switch``: the extra
latency of a message when every rank is busy and the receiver may be descheduled (every rank
passes 8 bytes around the ring at once); the model adds it to messages inside a node that has
more ranks than cores.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import numpy as np

__all__ = ["main", "pingpong", "fit_line"]


def fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: returns ``(a, b)``."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def pingpong(comm, peer: int, nbytes: int, iters: int, active: bool) -> float:
    """Half the round-trip time (s) of ``nbytes`` between this rank and ``peer``: the 5th
    percentile of ``iters`` timed round trips, after a few untimed ones (what the machine does
    when nobody else is in the way: a loaded machine only adds slow outliers). Ranks not
    ``active`` only take part in the barrier."""
    buf = np.zeros(max(nbytes, 1), np.uint8)
    rank = comm.Get_rank()
    comm.Barrier()
    if not active:
        return 0.0
    mpibyte = _byte()
    times = []
    for k in range(iters + 3):
        t0 = time.perf_counter()
        if rank < peer:
            comm.Send([buf, nbytes, mpibyte], peer, 7)
            comm.Recv([buf, nbytes, mpibyte], peer, 7)
        else:
            comm.Recv([buf, nbytes, mpibyte], peer, 7)
            comm.Send([buf, nbytes, mpibyte], peer, 7)
        if k >= 3:
            times.append(time.perf_counter() - t0)
    return float(np.percentile(times, 5)) / 2


def _byte():
    from mpi4py import MPI
    return MPI.BYTE


def _iters(nbytes: int) -> int:
    return int(min(500, max(10, (256 << 20) // max(nbytes, 1) // 4)))


def _link(comm, a: int, b: int, sizes) -> tuple[float, float, list]:
    """(alpha, bandwidth, [(bytes, half round trip)]) between ranks a and b."""
    rank = comm.Get_rank()
    active = rank in (a, b)
    peer = b if rank == a else a
    rows = []
    for nbytes in sizes:
        t = pingpong(comm, peer, nbytes, _iters(nbytes), active)
        rows.append((nbytes, t))
    rows = comm.bcast(rows if rank == a else None, root=a)
    alpha = rows[0][1]
    big = [(m, t) for m, t in rows if m >= 256 << 10]
    _, slope = fit_line([m for m, _ in big], [t for _, t in big])
    return alpha, 1.0 / max(slope, 1e-15), rows


def _kernel_bandwidth(comm, fn, nbytes=64 << 20, piece=4 << 20) -> float:
    """Bytes of result per second of ``fn(dst, a, b)`` over buffers of ``nbytes`` in ``piece``
    chunks, every rank at once, repeated over at least 256 MiB (a small buffer stays in cache,
    as a collective's does); the slowest rank's best of three."""
    from bench.harness import max_over_ranks
    n = nbytes // 4
    a, b, c = (np.full(n, 1.0, np.float32) for _ in range(3))
    step = min(piece, nbytes) // 4
    reps = max(1, (256 << 20) // nbytes)
    best = np.inf
    for _ in range(3):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            for i in range(0, n, step):
                fn(c[i:i + step], a[i:i + step], b[i:i + step])
        best = min(best, time.perf_counter() - t0)
    return c.nbytes * reps / max_over_ranks(comm, best)


# Buffer sizes of the curves, per rank (the model reads them by the bytes on a node: ``sized``).
CURVE_SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)


def _link_curve(rows, alpha) -> list:
    """[(bytes on the node, bandwidth)] from ping-pong ``rows`` at the curve's sizes: two
    buffers of m bytes, m / (t - alpha)."""
    return [(2 * m, m / max(t - alpha, 1e-12)) for m, t in rows if m in CURVE_SIZES]


def _pingpong_schedule(rank: int, trips: int, count: int):
    from collectives.schedule import OUT, Schedule
    s = Schedule(rank, 2, count, name="calibrate.pingpong")
    for _ in range(trips):
        if rank == 0:
            s.send(1, (OUT, 0, count))
            s.recv(1, (OUT, 0, count))
        else:
            s.recv(0, (OUT, 0, count))
            s.send(0, (OUT, 0, count))
    return s


def _executor_time(comm, trips: int) -> float:
    """Seconds of one run of the ping-pong schedule through the MPI executor (ranks 0, 1)."""
    from mpi4py import MPI

    from collectives.executor import MPITransport, Run
    from collectives.ops import resolve
    pair = comm.Split(0 if comm.Get_rank() < 2 else MPI.UNDEFINED, comm.Get_rank())
    best = np.inf
    if pair != MPI.COMM_NULL:
        sched = _pingpong_schedule(pair.Get_rank(), trips, 2)
        plan = sched.plan()
        buf = np.zeros(2, np.float32)
        tmp = np.zeros(1, np.float32)
        transport = MPITransport(pair)
        op = resolve("sum", np.float32)
        for k in range(20):
            pair.Barrier()
            t0 = time.perf_counter()
            Run(plan, buf, buf, tmp, op, transport, 11 + k).start().wait()
            best = min(best, time.perf_counter() - t0)
        pair.Free()
    return float(comm.bcast(best, root=0))


def _api_time(comm) -> float:
    """Seconds of an 8-byte ring allreduce through the public API on ``comm``: the 5th
    percentile of 1000 timed calls, slowest rank."""
    import collectives as coll
    x = np.ones(2, np.float32)
    out = np.empty_like(x)
    for _ in range(20):
        coll.allreduce(x, out=out, comm=comm, algorithm="ring")
    comm.Barrier()
    times = np.empty(1000)
    for k in range(len(times)):
        t0 = time.perf_counter()
        coll.allreduce(x, out=out, comm=comm, algorithm="ring")
        times[k] = time.perf_counter() - t0
    from bench.harness import max_over_ranks
    return max_over_ranks(comm, float(np.percentile(times, 5)))


def _fit(measured: float, model_time) -> float:
    """The parameter value v >= 0 with ``model_time(v) == measured`` (the model is linear)."""
    t0, t1 = model_time(0.0), model_time(1e-6)
    slope = (t1 - t0) / 1e-6
    return max(0.0, (measured - t0) / slope) if slope > 0 else 0.0


def _oversubscribed(comm, args, n, cores) -> int:
    """More ranks than cores: measure only ``switch``, the extra latency of a message when
    every rank is busy, and add it to the model calibrated before with 2 ranks. Every rank
    passes 8 bytes around the ring (send right, receive from the left) as a collective does;
    switch = the time per hop minus alpha."""
    from collectives import costmodel
    model = costmodel.CostModel.load(args.output)
    hop = _ring_hop(comm)
    switch = max(0.0, hop - model.alpha["node"])
    model = costmodel.CostModel(model.alpha, model.bandwidth, model.reduce_bandwidth,
                                model.copy_bandwidth, model.overhead, model.call,
                                model.source.split("; switch")[0]
                                + f"; switch with {n} ranks on {cores} cores", switch,
                                model.curves)
    if comm.Get_rank() == 0:
        print(f"# {n} ranks on {cores} cores: 8 bytes around the ring take {hop * 1e6:.1f} us "
              f"per hop (alone: {model.alpha['node'] * 1e6:.1f} us): switch {switch * 1e6:.1f} us")
        if not args.dry_run:
            print(f"# saved to {model.save(args.output)}")
    return 0


def _ring_hop(comm, laps=200) -> float:
    """Seconds per hop of 8 bytes passed around the ring by every rank at once (median of 5)."""
    rank, n = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    sbuf, rbuf = np.zeros(8, np.uint8), np.zeros(8, np.uint8)
    mpibyte = _byte()
    rounds = []
    for _ in range(5):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(laps):
            comm.Sendrecv([sbuf, mpibyte], right, 7, [rbuf, mpibyte], left, 7)
        rounds.append((time.perf_counter() - t0) / laps)
    from bench.harness import max_over_ranks
    return max_over_ranks(comm, float(np.median(rounds)))


def main(argv=None) -> int:
    """``mpiexec -n 2 python -m bench calibrate [-o FILE]``."""
    from bench.harness import abort_on_error
    from bench.units import parse_rate, parse_time
    p = argparse.ArgumentParser(prog="python -m bench calibrate",
                                description="measure alpha, beta, gamma and the executor's "
                                            "overheads for the cost model (mpiexec -n 2)")
    p.add_argument("-o", "--output", default=None,
                   help="file (default: $COLLECTIVES_COST_MODEL or "
                        "~/.cache/collectives/costmodel.json)")
    p.add_argument("--net-alpha", default="5us", help="network latency if no second node")
    p.add_argument("--net-bw", default="12.5GB/s", help="network bandwidth if no second node")
    p.add_argument("--dry-run", action="store_true", help="print, do not save")
    args = p.parse_args(argv)
    from mpi4py import MPI

    from collectives import costmodel
    from collectives.topology import simulated
    comm = MPI.COMM_WORLD
    abort_on_error(comm)
    rank, n = comm.Get_rank(), comm.Get_size()
    if n < 2:
        raise SystemExit("calibrate needs 2 ranks: mpiexec -n 2 python -m bench calibrate")
    hosts = comm.allgather(socket.gethostname())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if len(set(hosts)) == 1 and n > cores:
        return _oversubscribed(comm, args, n, cores)
    sizes = [8, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    alpha, bandwidth = {}, {}
    table = {}
    if hosts[1] == hosts[0]:
        a, bw, rows = _link(comm, 0, 1, sizes)
        alpha.update(numa=a, node=a)
        bandwidth.update(numa=bw, node=bw)
        table["node"] = rows
    remote = next((r for r in range(1, n) if hosts[r] != hosts[0]), None)
    if remote is not None:
        a, bw, rows = _link(comm, 0, remote, sizes)
        alpha["net"], bandwidth["net"] = a, bw
        table["net"] = rows
        if "node" not in alpha:  # ranks 0 and 1 on different nodes: no intra-node pair measured
            alpha.update(numa=a, node=a)
            bandwidth.update(numa=bw, node=bw)
    else:
        alpha["net"], bandwidth["net"] = parse_time(args.net_alpha), parse_rate(args.net_bw)

    def add(c, a, b):
        # The executor's reductions write into one of their operands (out of place the
        # receive lands in the destination, Schedule.direct; in place OUT op= TMP): a kernel
        # with a separate third array runs ~2x slower here and would overstate gamma.
        np.add(a, c, out=c)

    def copy(c, a, b):
        np.copyto(c, a)

    # Keyed by the bytes of buffers on the node, as the model reads them (n ranks at once).
    curves = {"reduce": [(n * m, _kernel_bandwidth(comm, add, m)) for m in CURVE_SIZES],
              "copy": [(n * m, _kernel_bandwidth(comm, copy, m)) for m in CURVE_SIZES]}
    if "node" in table:
        curves["node"] = _link_curve(table["node"], alpha["node"])
    reduce_bw, copy_bw = curves["reduce"][-1][1], curves["copy"][-1][1]
    model = costmodel.CostModel(alpha, bandwidth, reduce_bw, copy_bw, 0.0, 0.0,
                                source=f"python -m bench calibrate on {hosts[0]}, "
                                       f"{time.strftime('%Y-%m-%d %H:%M')}", curves=curves)
    # 3. per-op overhead, fitted through the model on the executor's ping-pong schedule.
    trips = 50
    measured = _executor_time(comm, trips)
    pair_topo = simulated(2, 2 if hosts[1] == hosts[0] else 1)
    scheds = [_pingpong_schedule(r, trips, 2) for r in range(2)]

    def with_overhead(o, call=0.0):
        return costmodel.CostModel(model.alpha, model.bandwidth, reduce_bw, copy_bw, o, call,
                                   model.source, curves=curves)

    overhead = _fit(measured, lambda o: costmodel.critical_path(scheds, pair_topo,
                                                                with_overhead(o), 4).time)
    # 4. per-call overhead, fitted on an 8-byte ring allreduce through the API (all ranks).
    api = _api_time(comm)
    topo = simulated(n, n if len(set(hosts)) == 1 else None)
    call = _fit(api, lambda c: costmodel.predict("allreduce", "ring", n, 8, topology=topo,
                                                 model=with_overhead(overhead, c)).time)
    model = with_overhead(overhead, call)
    if rank == 0:
        print(f"# cost model calibration on {hosts[0]} ({n} ranks)")
        for link, rows in table.items():
            print(f"# ping-pong {link}: half round trip")
            for m, t in rows:
                print(f"  {m:>10} B  {t * 1e6:10.2f} us  {m / t / 1e9 if t else 0:7.3f} GB/s")
        for k in costmodel.LINKS:
            print(f"  {k:<5} alpha {model.alpha[k] * 1e6:7.2f} us   bandwidth "
                  f"{model.bandwidth[k] / 1e9:7.3f} GB/s")
        print(f"  reduce (numpy.add)   {reduce_bw / 1e9:7.3f} GB/s of result")
        print(f"  copy (numpy.copyto)  {copy_bw / 1e9:7.3f} GB/s")
        print("# rates by buffer size per rank (GB/s; the model reads a call's rates at the "
              "size of its buffers on a node)")
        print(f"  {'bytes':>10}  " + "  ".join(f"{k:>7}" for k in curves))
        for i, m in enumerate(CURVE_SIZES):
            print(f"  {m:>10}  " + "  ".join(f"{v[i][1] / 1e9:7.3f}" for v in curves.values()))
        print(f"  executor overhead    {overhead * 1e6:7.2f} us per op "
              f"(ping-pong schedule: {measured / trips / 2 * 1e6:.2f} us per hop)")
        print(f"  call overhead        {call * 1e6:7.2f} us "
              f"(8-byte ring allreduce: {api * 1e6:.2f} us)")
        if not args.dry_run:
            path = model.save(args.output)
            print(f"# saved to {path}")
    return 0
