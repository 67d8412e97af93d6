"""The command line of a collective's benchmark, ``[mpiexec -n N] python -m bench <collective>``:
nccl-tests' and OSU's options, the sweep (``bench.harness``), the table as each size is done,
and the JSON/CSV/PNG files (``bench.report``, ``bench.plot``).
"""
from __future__ import annotations

import argparse
import socket

from bench.collective import Collective
from bench.harness import ROUNDS, Sweep, abort_on_error, membw
from bench.report import check_outputs, footer, header, rows, write_csv, write_json
from bench.units import byte_sizes, parse_size

__all__ = ["parser", "run_info", "main"]


def parser(spec: Collective) -> argparse.ArgumentParser:
    """The options of ``python -m bench <collective>``."""
    p = argparse.ArgumentParser(
        prog=f"python -m bench {spec.name}",
        description=f"{spec.name} bandwidth and latency, every algorithm beside MPI's own "
                    f"(run under mpiexec -n N)")
    p.add_argument("-b", "--minbytes", default="8",
                   help="smallest size in bytes; suffixes K, M, G (powers of 1024), e.g. 8, "
                        "64K, 16M (default 8)")
    p.add_argument("-e", "--maxbytes", default="32M",
                   help="largest size, always measured; suffixes as -b (default 32M)")
    p.add_argument("-f", "--stepfactor", type=float, default=4,
                   help="each size is the one before times this (default 4)")
    p.add_argument("-d", "--datatype", default="float32", help="numpy dtype (default float32)")
    if spec.has_op:
        p.add_argument("-o", "--op", default="sum",
                       help="sum, prod, min, max, avg, band, bor, bxor (default sum)")
    if spec.rooted:
        p.add_argument("-r", "--root", type=int, default=0, help="root rank (default 0)")
    p.add_argument("-n", "--iters", type=int, default=0,
                   help="calls per timed block (default: enough for about 2 ms)")
    p.add_argument("-w", "--warmup_iters", type=int, default=2,
                   help="untimed calls of each algorithm before its first timed one (default 2)")
    p.add_argument("-c", "--check", type=int, default=1, help="check results (default 1)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"timed rounds per size; the table shows their median (default "
                        f"{ROUNDS})")
    p.add_argument("--algorithms", default=None,
                   help="comma-separated (default: every registered one, auto, gloo)")
    p.add_argument("--modes", default=None, help=f"out,in (default: {','.join(spec.modes)})")
    p.add_argument("--registered", action="store_true",
                   help="add a 'registered' row: auto on buffers from collectives.empty "
                        "(the one-pass path on one node)")
    p.add_argument("--latency", action="store_true", help="OSU min/avg/max latency columns")
    p.add_argument("--json", default=None, help="write the results as JSON")
    p.add_argument("--csv", default=None, help="write the results as CSV")
    p.add_argument("--plot", default=None, help="draw busbw vs size into this PNG")
    return p


def run_info(sweep: Sweep) -> dict:
    """Metadata of a run: collective, ranks, host, MPI library, dtype, op, rounds."""
    from mpi4py import MPI
    return {"collective": sweep.spec.name, "ranks": sweep.n, "host": socket.gethostname(),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "dtype": sweep.dtype.name, "op": sweep.op, "root": sweep.root,
            "rounds": sweep.rounds, "notes": sweep.notes}


def _algorithms(spec: Collective, text: str | None) -> list[str] | None:
    """``--algorithms``, each name checked against the registry."""
    if not text:
        return None
    import collectives
    names = [a.strip() for a in text.split(",") if a.strip()]
    known = set(collectives.algorithms(spec.name)) | {"auto", "gloo"}
    unknown = [a for a in names if a not in known]
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {', '.join(unknown)} for {spec.name}; "
                         f"expected some of {', '.join(sorted(known))}")
    return names


def main(spec: Collective, argv=None) -> int:
    """``python -m bench <collective> [options]`` (see ``parser``)."""
    args = parser(spec).parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    abort_on_error(comm)
    sizes = byte_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    # Before the sweep: a path that cannot be written would otherwise fail after all of it.
    check_outputs(comm, {"--json": args.json, "--csv": args.csv, "--plot": args.plot})
    rank0 = comm.Get_rank() == 0
    bw = membw(comm) if spec.name == "allreduce" else None
    kw = dict(latency=args.latency, membw_Bps=bw)
    gloo_head = [True]

    def show(res, late=False):
        if not rank0:
            return
        if late and gloo_head[0]:
            gloo_head[0] = False
            print("# gloo, timed after every size above; xnative against the native row of "
                  "its size")
        print("\n".join(rows(res, sweep.modes, only={"gloo"} if late else None, **kw)),
              flush=True)

    sweep = Sweep(spec, comm, dtype=args.datatype, op=getattr(args, "op", None),
                  root=getattr(args, "root", 0), algorithms=_algorithms(spec, args.algorithms),
                  rounds=args.rounds, iters=args.iters, warmup=args.warmup_iters,
                  check=bool(args.check), modes=args.modes.split(",") if args.modes else None,
                  out=show, registered=args.registered)
    info = run_info(sweep)
    if rank0:
        print(f"# collectives benchmark: {spec.name}, {sweep.n} ranks on {info['host']}, "
              f"{sweep.dtype.name}" + (f" {sweep.op}" if sweep.op else "")
              + (f", root {sweep.root}" if spec.rooted else ""))
        print(f"# {info['mpi']}")
        print(f"# {sweep.rounds} rounds per size; a round times one block of calls of every "
              f"algorithm, in an order shuffled each round; time = median over rounds of the "
              f"slowest rank's time per call; iqr% = interquartile range / median")
        print(f"# algorithms: {', '.join(sweep.algorithms)}"
              + "".join(f"\n# note: {n}" for n in sweep.notes))
        print("#")
        print("\n".join(header(sweep.modes, latency=args.latency, bound=bool(bw))), flush=True)
    try:
        results = sweep.run(sizes)
    finally:
        sweep.close()
    if rank0:
        print("\n".join(footer(results, sweep.modes)))
        if bw:
            print(f"# memory bandwidth: {bw / 1e9:.2f} GB/s (numpy.copyto of 32 MiB on every "
                  f"rank at once, read + write); %bound = time to move 2 n N bytes at that "
                  f"bandwidth / time")
        info["membw_GBps"] = bw / 1e9 if bw else None
        if args.json:
            write_json(args.json, results, info)
        if args.csv:
            write_csv(args.csv, results)
        if args.plot:
            from bench import plot
            plot.plot([r.to_dict() for r in results], args.plot, info)
            print(f"# plot: {args.plot}")
    return 0
