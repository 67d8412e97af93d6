"""``python -m bench model``: what the alpha-beta-gamma cost model predicts, at any scale.

Plan a cluster job from a laptop::

    python -m bench model --ranks 4096 --ranks-per-node 8 --bytes 256M \\
        --net-alpha 5us --net-bw 25GB/s

runs every schedule algorithm of the collective through ``collectives.costmodel.predict`` with
the parameters of ``python -m bench calibrate`` (or the built-in defaults) for the links inside a
node, and the network given on the command line, and prints each one's predicted time, algbw,
busbw and what its critical path is made of (latency, transfer, compute, executor overhead).
Algorithms that are not schedules (``native``: MPI's own, ``shm``) cannot be modelled.

``mpiexec -n N python -m bench model --validate`` measures every schedule algorithm over sizes
(``-b 1K -e 64M`` by default) with the benchmark harness and prints the model's prediction for
the same size and rank count beside it, with the ratio predicted / measured.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time

__all__ = ["main", "model_from_args", "schedule_algorithms", "validate", "markdown"]


def schedule_algorithms(collective: str) -> list[str]:
    """The registered algorithms of ``collective`` that are schedules (the model can run)."""
    from collectives import select
    return [name for name in select.algorithms(collective)
            if select.get(collective, name).kind == select.SCHEDULE]


def model_from_args(args):
    """The calibrated (or default) model with the link options of ``args`` applied."""
    from bench.units import parse_rate, parse_time
    from collectives import costmodel
    model = costmodel.CostModel.load(args.params)
    links = {}
    for link in costmodel.LINKS:
        a, bw = getattr(args, f"{link}_alpha"), getattr(args, f"{link}_bw")
        if a is not None or bw is not None:
            links[link] = (None if a is None else parse_time(a),
                           None if bw is None else parse_rate(bw))
    return model.replace(**links) if links else model


def _parser():
    p = argparse.ArgumentParser(prog="python -m bench model",
                                description="predict every algorithm's time with the "
                                            "alpha-beta-gamma cost model")
    p.add_argument("--collective", default="allreduce",
                   help="allreduce, reduce_scatter, allgather, broadcast, reduce, or all")
    p.add_argument("--ranks", type=int, default=None, help="communicator size")
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: all on one node")
    p.add_argument("--ranks-per-numa", type=int, default=None, help="default: no NUMA split")
    p.add_argument("--cores-per-node", type=int, default=None,
                   help="CPU cost x ranks/cores when ranks per node exceed it")
    p.add_argument("--bytes", default="256M",
                   help="sizes, comma-separated (as the benchmark's size column)")
    p.add_argument("-d", "--datatype", default="float32")
    p.add_argument("-r", "--root", type=int, default=0)
    p.add_argument("--algorithms", default=None, help="comma-separated (default: all schedules)")
    p.add_argument("--params", default=None,
                   help="calibration file (default: $COLLECTIVES_COST_MODEL or "
                        "~/.cache/collectives/costmodel.json, else built-in defaults)")
    for link in ("numa", "node", "net"):
        p.add_argument(f"--{link}-alpha", default=None, help=f"{link} latency, e.g. 5us")
        p.add_argument(f"--{link}-bw", default=None, help=f"{link} bandwidth, e.g. 25GB/s")
    p.add_argument("--seg", default=None, help="executor segment size (default: its own)")
    p.add_argument("--exact", action="store_true", help="simulate every rank (no symmetry)")
    p.add_argument("--max-ops", type=int, default=2_000_000,
                   help="ops simulated before extrapolating (default 2M)")
    p.add_argument("-j", "--jobs", type=int, default=0,
                   help="processes modelling algorithms at once (default: the cores)")
    p.add_argument("--json", default=None, help="write predictions/validation as JSON")
    p.add_argument("--validate", action="store_true",
                   help="(under mpiexec) measure and compare with the model")
    p.add_argument("-b", "--minbytes", default="1K", help="--validate: smallest size")
    p.add_argument("-e", "--maxbytes", default="64M", help="--validate: largest size")
    p.add_argument("-f", "--stepfactor", type=float, default=4, help="--validate: factor")
    p.add_argument("--rounds", type=int, default=3, help="--validate: rounds")
    p.add_argument("--markdown", action="store_true",
                   help="--validate: also print a Markdown table (measured us (pred/meas))")
    return p


def _fmt_ms(t):
    return f"{t * 1e3:10.3f}"


def main(argv=None) -> int:
    """``python -m bench model [options]`` (``--validate`` under mpiexec)."""
    args = _parser().parse_args(argv)
    if args.validate:
        return validate(args)
    import numpy as np

    from bench.collective import busbw_factor  # its module registers bfloat16 with numpy
    from bench.units import format_size, parse_size
    from collectives.topology import simulated
    if args.ranks is None:
        raise SystemExit("--ranks is required (or --validate under mpiexec)")
    itemsize = np.dtype(args.datatype).itemsize
    model = model_from_args(args)
    topo = simulated(args.ranks, args.ranks_per_node, args.ranks_per_numa, args.cores_per_node)
    collectives = list(_collectives()) if args.collective == "all" else [args.collective]
    seg = parse_size(args.seg) if args.seg else None
    nodes = math.ceil(args.ranks / topo.ranks_per_node)
    print(f"# cost model: {args.ranks} ranks = {nodes} node(s) x {topo.ranks_per_node}"
          + (f" ({topo.ranks_per_node // args.ranks_per_numa} NUMA domains of "
             f"{args.ranks_per_numa})" if args.ranks_per_numa else "")
          + (f", {args.cores_per_node} cores per node" if args.cores_per_node else "")
          + f", {args.datatype}")
    print(f"# {model!r}")
    print(f"# parameters from: {model.source or 'built-in defaults'}")
    out = []
    for collective in collectives:
        algs = args.algorithms.split(",") if args.algorithms else schedule_algorithms(collective)
        factor = busbw_factor(collective, args.ranks)
        for nbytes in (parse_size(b) for b in args.bytes.split(",")):
            print(f"#\n# {collective}, {format_size(nbytes)} "
                  + ("per rank" if collective in ("allreduce", "reduce", "broadcast")
                     else "in all"))
            print(f"# {'algorithm':<19} {'time(ms)':>10} {'algbw':>7} {'busbw':>7} {'hops':>6} "
                  f"{'latency':>9} {'transfer':>9} {'compute':>9} {'overhead':>9}   "
                  f"{'how (wall s)'}")
            print(f"# {'':<19} {'':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'(ms)':>9} "
                  f"{'(ms)':>9} {'(ms)':>9} {'(ms)':>9}")
            best = None
            job = functools.partial(_predict, collective, args.ranks, nbytes, itemsize,
                                    args.root, topo, model, seg,
                                    "none" if args.exact else "auto", args.max_ops)
            for alg, (p, wall) in zip(algs, _map(job, algs, args.jobs)):
                if isinstance(p, str):
                    print(f"  {alg:<19} not modelled: {p}", flush=True)
                    continue
                algbw = nbytes / p.time / 1e9 if p.time > 0 else 0.0
                pth = p.path
                print(f"  {alg:<19} {_fmt_ms(p.time)} {algbw:7.3f} {algbw * factor:7.3f} "
                      f"{p.hops:>6} {pth['latency'] * 1e3:9.3f} {pth['transfer'] * 1e3:9.3f} "
                      f"{pth['compute'] * 1e3:9.3f} {pth['overhead'] * 1e3:9.3f}   "
                      f"{p.method}, {p.simulated} ranks ({wall:.1f})", flush=True)
                out.append({"collective": collective, "size": nbytes, "algorithm": alg,
                            "time_s": p.time, "algbw_GBps": algbw,
                            "busbw_GBps": algbw * factor, "hops": p.hops, "path_s": pth,
                            "method": p.method, "simulated": p.simulated})
                if best is None or p.time < best[1]:
                    best = (alg, p.time)
            if best:
                print(f"# fastest: {best[0]} ({best[1] * 1e3:.3f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "ranks_per_node": topo.ranks_per_node,
                       "ranks_per_numa": args.ranks_per_numa, "model": model.to_dict(),
                       "predictions": out}, f, indent=1)
    return 0


def _predict(collective, ranks, nbytes, itemsize, root, topo, model, seg, symmetry, max_ops,
             alg):
    """One prediction and its wall time (an error message instead when it cannot be made)."""
    from collectives import costmodel
    t0 = time.perf_counter()
    try:
        p = costmodel.predict(collective, alg, ranks, nbytes, itemsize=itemsize, root=root,
                              topology=topo, model=model, seg_bytes=seg, symmetry=symmetry,
                              max_ops=max_ops)
    except ValueError as exc:
        return str(exc), 0.0
    return p, time.perf_counter() - t0


def _map(fn, items, jobs):
    """``fn`` over ``items`` in order, on ``jobs`` processes (forked: MPI is not initialised
    here) when more than one."""
    jobs = min(jobs or os.cpu_count() or 1, len(items))
    if jobs <= 1:
        yield from map(fn, items)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        yield from pool.map(fn, items)


def _collectives():
    """Every collective the toolkit has."""
    from collectives.select import COLLECTIVES
    return COLLECTIVES


def validate(args) -> int:
    """Measure every schedule algorithm and print the model's prediction beside it."""
    from mpi4py import MPI

    from bench.harness import Sweep, abort_on_error
    from bench.units import byte_sizes, parse_size
    from bench.tune import spec
    from collectives import costmodel
    from collectives.topology import simulated
    from bench.report import check_outputs
    comm = MPI.COMM_WORLD
    abort_on_error(comm)
    check_outputs(comm, {"--json": args.json})
    n, rank0 = comm.Get_size(), comm.Get_rank() == 0
    model = model_from_args(args)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = local.Get_size()
    local.Free()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    topo = simulated(n, per_node, args.ranks_per_numa, cores)
    sizes = byte_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    collectives = list(_collectives()) if args.collective == "all" else [args.collective]
    rows = []
    for collective in collectives:
        s = spec(collective)
        algs = args.algorithms.split(",") if args.algorithms else schedule_algorithms(collective)
        res = Sweep(s, comm, dtype=args.datatype, algorithms=algs, rounds=args.rounds,
                    check=False, modes=[s.modes[0]]).run(sizes)
        if not rank0:
            continue
        import numpy as np
        itemsize = np.dtype(args.datatype).itemsize
        for r in res:
            p = costmodel.predict(collective, r.algorithm, n, r.nbytes, itemsize=itemsize,
                                  topology=topo, model=model)
            rows.append({"collective": collective, "ranks": n, "size": r.nbytes,
                         "algorithm": r.algorithm, "measured_us": r.time * 1e6,
                         "spread": r.spread, "predicted_us": p.time * 1e6,
                         "ratio": p.time / r.time})
    if rank0:
        print(f"# cost model validation: {n} ranks ({per_node} per node, {cores} cores), "
              f"{args.datatype}; {model!r}")
        print(f"# parameters from: {model.source or 'built-in defaults'}")
        print(f"# {'collective':<15} {'size':>10} {'algorithm':<19} {'measured(us)':>13} "
              f"{'±%':>4} {'predicted(us)':>14} {'pred/meas':>9}")
        for row in rows:
            print(f"  {row['collective']:<15} {row['size']:>10} {row['algorithm']:<19} "
                  f"{row['measured_us']:13.1f} {100 * row['spread']:4.0f} "
                  f"{row['predicted_us']:14.1f} {row['ratio']:9.2f}")
        large = [r for r in rows if r["size"] >= 1 << 20]
        for label, group in (("all sizes", rows), (">= 1 MiB", large)):
            if group:
                worst = max(group, key=lambda r: abs(math.log(r["ratio"])))
                inside = sum(1 for r in group if 0.5 <= r["ratio"] <= 2)
                print(f"# {label}: {inside}/{len(group)} predictions within 2x of measured; "
                      f"worst {worst['ratio']:.2f} ({worst['algorithm']}, {worst['size']} B)")
        if args.markdown:
            print(markdown(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": n, "model": model.to_dict(), "rows": rows}, f, indent=1)
    return 0


def markdown(rows) -> str:
    """Validation rows as a Markdown table: a row per size, a column per algorithm, each cell
    "measured us (predicted / measured)"."""
    from bench.harness import format_size
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    n = rows[0]["ranks"] if rows else 0
    lines = [f"| n = {n}, size | " + " | ".join(algs) + " |",
             "|---:|" + "---:|" * len(algs)]
    for size in dict.fromkeys(r["size"] for r in rows):
        cells = {r["algorithm"]: r for r in rows if r["size"] == size}
        lines.append(f"| {format_size(size)} | " + " | ".join(
            f"{cells[a]['measured_us']:.0f} ({cells[a]['ratio']:.2f})" if a in cells else ""
            for a in algs) + " |")
    return "\n".join(lines)
