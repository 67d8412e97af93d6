"""``mpiexec -n N python -m bench overhead``: what a call through the API costs beyond mpi4py.

For an allreduce of float32 with op sum, out of place and in place, at 8 B, 64 B, 512 B, 4 KiB,
32 KiB and 64 KiB per rank, three rows on the same preallocated buffers:

- ``mpi4py comm.Allreduce``: the bare call (``MPI.IN_PLACE`` for in place);
- ``coll.allreduce(algorithm="native")``: the same MPI collective through the API (argument
  checks, buffer wrapping, dispatch);
- ``coll.allreduce(algorithm="auto")``: the API with the table lookup; the row names what
  ``auto`` ran, which at the larger sizes may be another algorithm than MPI's own;
- with ``--watchdog``, ``coll.allreduce(algorithm="native")`` once more with the watchdog off
  (``COLLECTIVES_TIMEOUT=0``, ``COLLECTIVES_STALL_WARNING=0``): its gap to the native row is
  what the always-on watchdog costs per call.

``--collectives all`` (or a comma-separated list) measures instead every collective at 8 bytes
per rank (or at each of ``--sizes``: bytes per rank and block), each kind of call (``KINDS``)
against its bare mpi4py twin (``Allreduce``, ``Reduce``, ``Bcast``, ``Reduce_scatter_block``,
``Allgather``, ``Alltoall``, ``Gather``, ``Scatter``, ``Barrier``) doing the same: the same
buffers every call, a fresh input every call, no ``out`` (the bare call allocates its output),
counts given as a list, counts learned (the bare call adds one ``MPI_Allgather`` of the counts)
and persistent requests (``coll.allreduce_init`` against ``MPI_Allreduce_init``).

The rows run in interleaved rounds (their order shuffled each round); a round times one
block of ``--calls`` back-to-back calls of each, after one untimed call; a block's time is the
slowest rank's average per call. The table shows the median over ``--rounds``, the spread
(interquartile range / median) and ``API - bare``: the row's median minus the bare call's.
Before timing, each row's result is compared with the bare call's; in-place rows are timed on
zeros, since a sum repeated in place would overflow.
"""
from __future__ import annotations

import argparse
import json
import socket

import numpy as np

from bench.harness import abort_on_error, max_over_ranks, per_call
from bench.stats import median, spread
from bench.units import format_size, parse_size

__all__ = ["SIZES", "ROWS", "COLLECTIVES", "KINDS", "measure", "measure_collectives", "format_table",
           "format_collectives", "main"]

SIZES = (8, 64, 512, 4 << 10, 32 << 10, 64 << 10)
ROWS = {"bare": "mpi4py comm.Allreduce",
        "native": 'coll.allreduce(algorithm="native")',
        "auto": 'coll.allreduce(algorithm="auto")',
        "unwatched": 'coll.allreduce(algorithm="native"), watchdog off'}
# The settings a row runs under, set around its blocks.
SETTINGS = {"unwatched": {"COLLECTIVES_TIMEOUT": 0, "COLLECTIVES_STALL_WARNING": 0}}


def _calls(comm, nbytes: int, mode: str):
    """{row: zero-argument call} on preallocated buffers, the arrays each writes its result
    to, the input to reset, and what ``auto`` runs here."""
    from mpi4py import MPI

    import collectives as coll
    from collectives.api import auto_pick
    count = max(1, nbytes // 4)
    x = np.zeros(count, np.float32)
    outs = {row: np.zeros(count, np.float32) for row in ROWS}
    if mode == "in":
        bufs = {row: np.zeros(count, np.float32) for row in ROWS}
        fns = {"bare": lambda b=bufs["bare"]: comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM),
               "native": lambda b=bufs["native"]: coll.allreduce(b, "sum", out=b, comm=comm,
                                                                  algorithm="native"),
               "auto": lambda b=bufs["auto"]: coll.allreduce(b, "sum", out=b, comm=comm,
                                                              algorithm="auto"),
               "unwatched": lambda b=bufs["unwatched"]: coll.allreduce(
                   b, "sum", out=b, comm=comm, algorithm="native")}
        return fns, bufs, bufs, auto_pick("allreduce", count * 4, comm, True)
    fns = {"bare": lambda: comm.Allreduce(x, outs["bare"], op=MPI.SUM),
           "native": lambda: coll.allreduce(x, "sum", out=outs["native"], comm=comm,
                                            algorithm="native"),
           "auto": lambda: coll.allreduce(x, "sum", out=outs["auto"], comm=comm,
                                          algorithm="auto"),
           "unwatched": lambda: coll.allreduce(x, "sum", out=outs["unwatched"], comm=comm,
                                               algorithm="native")}
    return fns, outs, {row: x for row in ROWS}, auto_pick("allreduce", count * 4, comm, False)


COLLECTIVES = ("allreduce", "reduce", "broadcast", "reduce_scatter", "allgather", "alltoall",
               "gather", "scatter", "barrier")
# How the API is called in each row of --collectives, and what its bare call does alike.
KINDS = {
    "same": "the same x and out every call",
    "fresh": "a fresh x every call (the bare call too)",
    "no out": "the API allocates the result (the bare call allocates its out)",
    "list": "counts given as a list (alltoall's send and receive counts: the bare call is "
            "MPI_Alltoallv with them, as each rank knows only its own)",
    "learned": "no counts: learned with one exchange (the bare row adds one MPI_Allgather of "
               "the counts)",
    "persistent": "coll.<name>_init once, then start() and wait() (bare: MPI_<Name>_init, "
                  "Start, Wait)",
}


def _collective_calls(comm, collective: str, nbytes: int = 8) -> tuple[dict, list]:
    """{row kind: (bare call, API call, the bare call's name)} of ``collective`` at ``nbytes``
    per rank (per block where a rank sends one to each), the kinds of ``KINDS`` that apply,
    and the persistent requests made for them (``Free``/``free`` them when done)."""
    from mpi4py import MPI

    import collectives as coll
    n, rank = comm.Get_size(), comm.Get_rank()
    count = max(1, nbytes // 4)
    x, out = np.ones(count, np.float32), np.zeros(count, np.float32)
    big, every = np.ones(count * n, np.float32), np.zeros(count * n, np.float32)
    rows, rows_list = (count,) * n, [count] * n
    counts_of = np.empty(2 * n, np.int64)
    mine = np.array([count, 1], np.int64)
    root_out = every if rank == 0 else None

    def fresh(k=count):
        return np.ones(k, np.float32)

    def learn():  # what the API's exchange of row counts costs bare
        comm.Allgather(mine, counts_of)

    def both(bare, api):  # a row whose bare call learns the counts first, as the API does
        return (lambda: (learn(), bare())), api

    made = []  # the persistent requests, freed by the caller once measured

    def persistent(bare_init, api_init):
        b, a = bare_init(), api_init()
        made.extend((b, a))
        return (lambda: (b.Start(), b.Wait())), (lambda: (a.start(), a.wait()))

    calls = {
        "allreduce": ("Allreduce", {
            "same": (lambda: comm.Allreduce(x, out), lambda: coll.allreduce(x, out=out)),
            "fresh": (lambda: comm.Allreduce(fresh(), out),
                      lambda: coll.allreduce(fresh(), out=out)),
            "no out": (lambda: comm.Allreduce(x, np.empty_like(x)), lambda: coll.allreduce(x)),
            "persistent": persistent(lambda: comm.Allreduce_init(x, out),
                                     lambda: coll.allreduce_init(x, out=out)),
        }),
        "reduce": ("Reduce", {
            "same": (lambda: comm.Reduce(x, out, root=0), lambda: coll.reduce(x, out=out)),
            "fresh": (lambda: comm.Reduce(fresh(), out, root=0),
                      lambda: coll.reduce(fresh(), out=out)),
            "no out": (lambda: comm.Reduce(x, np.empty_like(x) if rank == 0 else None, root=0),
                       lambda: coll.reduce(x)),
            "persistent": persistent(lambda: comm.Reduce_init(x, out, root=0),
                                     lambda: coll.reduce_init(x, out=out)),
        }),
        "broadcast": ("Bcast", {
            "same": (lambda: comm.Bcast(out, 0), lambda: coll.broadcast(out)),
            "fresh": (lambda: comm.Bcast(fresh(), 0), lambda: coll.broadcast(fresh())),
            "persistent": persistent(lambda: comm.Bcast_init(out, 0),
                                     lambda: coll.broadcast_init(out)),
        }),
        "reduce_scatter": ("Reduce_scatter_block", {
            "same": (lambda: comm.Reduce_scatter_block(big, out),
                     lambda: coll.reduce_scatter(big, out=out)),
            "fresh": (lambda: comm.Reduce_scatter_block(fresh(count * n), out),
                      lambda: coll.reduce_scatter(fresh(count * n), out=out)),
            "no out": (lambda: comm.Reduce_scatter_block(big, np.empty_like(out)),
                       lambda: coll.reduce_scatter(big)),
            "list": (lambda: comm.Reduce_scatter_block(big, out),
                     lambda: coll.reduce_scatter(big, counts=rows_list, out=out)),
            "persistent": persistent(lambda: comm.Reduce_scatter_block_init(big, out),
                                     lambda: coll.reduce_scatter_init(big, out=out)),
        }),
        "allgather": ("Allgather", {
            "same": (lambda: comm.Allgather(x, every),
                     lambda: coll.allgather(x, out=every, counts=rows)),
            "fresh": (lambda: comm.Allgather(fresh(), every),
                      lambda: coll.allgather(fresh(), out=every, counts=rows)),
            "no out": (lambda: comm.Allgather(x, np.empty_like(every)),
                       lambda: coll.allgather(x, counts=rows)),
            "list": (lambda: comm.Allgather(x, every),
                     lambda: coll.allgather(x, out=every, counts=rows_list)),
            "learned": both(lambda: comm.Allgather(x, every),
                            lambda: coll.allgather(x, out=every)),
            "persistent": persistent(lambda: comm.Allgather_init(x, every),
                                     lambda: coll.allgather_init(x, out=every, counts=rows)),
        }),
        "alltoall": ("Alltoall", {
            "same": (lambda: comm.Alltoall(big, every), lambda: coll.alltoall(big, out=every)),
            "fresh": (lambda: comm.Alltoall(fresh(count * n), every),
                      lambda: coll.alltoall(fresh(count * n), out=every)),
            "no out": (lambda: comm.Alltoall(big, np.empty_like(every)),
                       lambda: coll.alltoall(big)),
            "list": (lambda: comm.Alltoallv([big, rows_list], [every, rows_list]),
                     lambda: coll.alltoall(big, rows_list, recv_counts=rows_list, out=every),
                     "Alltoallv"),
            "learned": both(lambda: comm.Alltoall(big, every),
                            lambda: coll.alltoall(big, rows_list, out=every)),
            "persistent": persistent(lambda: comm.Alltoall_init(big, every),
                                     lambda: coll.alltoall_init(big, out=every)),
        }),
        "gather": ("Gather", {
            "same": (lambda: comm.Gather(x, root_out, root=0),
                     lambda: coll.gather(x, out=root_out, counts=rows)),
            "fresh": (lambda: comm.Gather(fresh(), root_out, root=0),
                      lambda: coll.gather(fresh(), out=root_out, counts=rows)),
            "no out": (lambda: comm.Gather(x, np.empty_like(every) if rank == 0 else None,
                                           root=0),
                       lambda: coll.gather(x, counts=rows)),
            "list": (lambda: comm.Gather(x, root_out, root=0),
                     lambda: coll.gather(x, out=root_out, counts=rows_list)),
            "learned": both(lambda: comm.Gather(x, root_out, root=0),
                            lambda: coll.gather(x, out=root_out)),
            "persistent": persistent(lambda: comm.Gather_init(x, root_out, root=0),
                                     lambda: coll.gather_init(x, out=root_out, counts=rows)),
        }),
        "scatter": ("Scatter", {
            "same": (lambda: comm.Scatter(big, out, root=0), lambda: coll.scatter(big, out=out)),
            "fresh": (lambda: comm.Scatter(fresh(count * n), out, root=0),
                      lambda: coll.scatter(fresh(count * n), out=out)),
            "list": (lambda: comm.Scatter(big, out, root=0),
                     lambda: coll.scatter(big, counts=rows_list, out=out)),
            "persistent": persistent(lambda: comm.Scatter_init(big, out, root=0),
                                     lambda: coll.scatter_init(big, out=out)),
        }),
        "barrier": ("Barrier", {
            "same": (comm.Barrier, coll.barrier),
            "persistent": persistent(comm.Barrier_init, coll.barrier_init),
        }),
    }
    name, kinds = calls[collective]
    del MPI
    return {kind: (pair[0], pair[1], pair[2] if len(pair) > 2 else
                   f"{name}_init" if kind == "persistent" else name)
            for kind, pair in kinds.items()}, made


def measure_collectives(comm, collectives=COLLECTIVES, rounds: int = 9, calls: int = 2000,
                        sizes=(8,), kinds=tuple(KINDS)) -> list:
    """One dict per (collective, size, kind of call, row "bare" or "api"): median and spread
    of the slowest rank's per-call time and the API's gap to its bare call (seconds).
    Collective over ``comm``; fewer calls per block at larger sizes (at most about 64 MiB
    moved a block). The API's call and its bare twin run in interleaved rounds."""
    out = []
    rng = np.random.default_rng(rounds)  # the same orders on every rank
    for collective, nbytes in ((c, b) for c in collectives for b in sizes):
        block = max(3, min(calls, (64 << 20) // max(1, nbytes * comm.Get_size())))
        pairs, made = _collective_calls(comm, collective, nbytes)
        for kind in (k for k in kinds if k in pairs):
            bare, api, name = pairs[kind]
            fns = {"bare": bare, "api": api}
            for fn in fns.values():  # warm-up, untimed
                for _ in range(max(1, block // 10)):
                    fn()
            times = {row: [] for row in fns}
            keys = list(fns)
            for _ in range(rounds):
                for i in rng.permutation(len(keys)):
                    times[keys[i]].append(_block(comm, fns[keys[i]], block))
            for row in keys:
                out.append({"collective": collective, "size": max(1, nbytes // 4) * 4,
                            "kind": kind, "row": row,
                            "call": f"comm.{name}" if row == "bare" else f"coll.{collective}",
                            "time": median(times[row]), "spread": spread(times[row]),
                            "over_bare": median(times[row]) - median(times["bare"]),
                            "rounds": times[row]})
        for request in made:  # an MPI.Prequest (Free) or a collectives.Persistent (free)
            (request.Free if hasattr(request, "Free") else request.free)()
    return out


def format_collectives(rows: list, info: dict) -> str:
    """``measure_collectives``'s rows as a Markdown table, one line per collective and kind
    of call, with the kinds explained below it."""
    by = {(r["collective"], r["size"], r["kind"], r["row"]): r for r in rows}
    lines = [f"# API overhead per call: {info['ranks']} ranks on {info['host']}, "
             f"{info['mpi']}; {info['rounds']} rounds of {info['calls']} calls per row, order "
             f"shuffled each round; time = median over rounds of the slowest rank's per-call "
             f"time; spread = interquartile range / median",
             "", "| collective | size | call | bare call | bare (µs) | spread | API (µs) | "
             "spread | API - bare (µs) |", "|:---|---:|:---|:---|---:|---:|---:|---:|---:|"]
    for collective, size, kind in dict.fromkeys((r["collective"], r["size"], r["kind"])
                                                for r in rows):
        b, a = by[(collective, size, kind, "bare")], by[(collective, size, kind, "api")]
        lines.append(f"| {collective} | {format_size(size)} | {kind} | {b['call']} | "
                     f"{b['time'] * 1e6:.2f} | {100 * b['spread']:.1f}% | {a['time'] * 1e6:.2f} | "
                     f"{100 * a['spread']:.1f}% | {a['over_bare'] * 1e6:+.2f} |")
    lines += [""] + [f"- {kind}: {text}" for kind, text in KINDS.items()
                     if any(r["kind"] == kind for r in rows)]
    return "\n".join(lines)


def _check(comm, fns, results, inputs) -> None:
    """One call of each row on exact rank-dependent data; every row must equal the bare one."""
    data = (np.arange(inputs["bare"].size) % 7 + comm.Get_rank()).astype(np.float32)
    for row, fn in fns.items():
        np.copyto(inputs[row], data)
        fn()
    bad = sum(int(not np.array_equal(results[row], results["bare"])) for row in fns)
    if comm.allreduce(bad):
        raise RuntimeError("the API's allreduce differs from comm.Allreduce's on some rank")
    for row in fns:
        inputs[row].fill(0)


def _block(comm, fn, calls: int, settings=None) -> float:
    """The slowest rank's seconds per call over a block of ``calls`` (after one untimed),
    under ``settings`` ({name: value}, restored after)."""
    from collectives import config
    old = {name: config.set(name, value) for name, value in (settings or {}).items()}
    try:
        fn()
        return max_over_ranks(comm, per_call(comm, fn, calls))
    finally:
        for name, value in old.items():
            config.set(name, value)


def measure(comm, sizes=SIZES, modes=("out", "in"), rounds: int = 9, calls: int = 500,
            rows=("bare", "native", "auto")) -> list:
    """One dict per (size, mode, row): median and spread of the slowest rank's per-call time,
    and the gap to the bare call (seconds; see the module doc). Collective over ``comm``."""
    out = []
    for nbytes in sizes:
        for mode in modes:
            fns, results, inputs, pick = _calls(comm, nbytes, mode)
            fns = {row: fns[row] for row in rows}
            _check(comm, fns, results, inputs)
            for fn in fns.values():  # warm-up, untimed
                for _ in range(max(1, calls // 10)):
                    fn()
            times = {row: [] for row in fns}
            keys = list(fns)
            rng = np.random.default_rng(rounds)  # the same orders on every rank
            for _ in range(rounds):
                for i in rng.permutation(len(keys)):
                    times[keys[i]].append(_block(comm, fns[keys[i]], calls,
                                                 SETTINGS.get(keys[i])))
            bare = median(times["bare"])
            for row in keys:
                out.append({"size": max(1, nbytes // 4) * 4, "mode": mode, "row": row,
                            "call": ROWS[row], "picked": pick if row == "auto" else None,
                            "time": median(times[row]), "spread": spread(times[row]),
                            "over_bare": median(times[row]) - bare,
                            "rounds": times[row]})
    return out


def format_table(rows: list, info: dict) -> str:
    """The rows as a Markdown table, under a line saying how they were measured."""
    lines = [f"# API overhead: allreduce float32 sum, {info['ranks']} ranks on {info['host']}, "
             f"{info['mpi']}; {info['rounds']} rounds of {info['calls']} calls per row, order "
             f"shuffled each round; time = median over rounds of the slowest rank's per-call "
             f"time; spread = interquartile range / median",
             "", "| size | mode | call | time (µs) | spread | API - bare (µs) |",
             "|---:|:---|:---|---:|---:|---:|"]
    for r in rows:
        call = r["call"] + (f" → {r['picked']}" if r["picked"] else "")
        gap = "" if r["row"] == "bare" else f"{r['over_bare'] * 1e6:+.2f}"
        lines.append(f"| {format_size(r['size'])} | {r['mode']} | {call} | "
                     f"{r['time'] * 1e6:.2f} | {100 * r['spread']:.1f}% | {gap} |")
    return "\n".join(lines)


def _report(comm, args, rows, form) -> None:
    """On rank 0: the table ``form`` makes of ``rows``, and ``--json``'s file."""
    from mpi4py import MPI
    if comm.Get_rank() != 0:
        return
    info = {"ranks": comm.Get_size(), "host": socket.gethostname(),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "rounds": max(1, args.rounds), "calls": max(1, args.calls)}
    print(form(rows, info), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info, rows=rows), f, indent=1)
            f.write("\n")


def main(argv=None) -> int:
    """``[mpiexec -n N] python -m bench overhead [options]``."""
    p = argparse.ArgumentParser(prog="python -m bench overhead",
                                description="per-call cost of coll.allreduce against bare "
                                            "mpi4py comm.Allreduce (run under mpiexec -n N)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated bytes per rank, suffixes K, M (default "
                        "8,64,512,4K,32K,64K; with --collectives, 8)")
    p.add_argument("--modes", default="out,in", help="out,in (default both)")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    p.add_argument("--calls", type=int, default=500, help="calls per timed block (default 500)")
    p.add_argument("--watchdog", action="store_true",
                   help="add the native row with the watchdog off (what it costs per call)")
    p.add_argument("--collectives", default=None,
                   help="'all' or a comma-separated list: every collective's 8-byte call "
                        "against its bare mpi4py call instead of the allreduce sweep")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"with --collectives: the kinds of call (default all: "
                        f"{','.join(KINDS)})")
    p.add_argument("--json", default=None, help="write the rows as JSON (times in seconds)")
    args = p.parse_args(argv)
    args.sizes_given = args.sizes is not None
    if args.sizes is None:
        args.sizes = ",".join(format_size(s) for s in SIZES)
    chosen = None
    if args.collectives is not None:
        chosen = COLLECTIVES if args.collectives == "all" else \
            tuple(c.strip() for c in args.collectives.split(",") if c.strip())
        unknown = sorted(set(chosen) - set(COLLECTIVES))
        if unknown:
            p.error(f"unknown collective(s) {unknown}; expected 'all' or some of "
                    f"{', '.join(COLLECTIVES)}")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    abort_on_error(comm)
    if chosen is not None:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()] \
            if args.sizes_given else [8]
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            p.error(f"unknown kind(s) {unknown}; expected some of {', '.join(KINDS)}")
        rows = measure_collectives(comm, chosen, max(1, args.rounds), max(1, args.calls), sizes,
                                   kinds)
        _report(comm, args, rows, format_collectives)
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    modes = [m for m in args.modes.split(",") if m in ("out", "in")]
    rows = measure(comm, sizes, modes, max(1, args.rounds), max(1, args.calls),
                   tuple(ROWS) if args.watchdog else ("bare", "native", "auto"))
    _report(comm, args, rows, format_table)
    return 0
