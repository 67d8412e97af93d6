"""``[mpiexec -n N] python -m bench tune``: measure the algorithms offline, write the table
``auto`` reads.

For each collective (default all five), at each size of the grid (``-b/-e/-f``, as the
benchmark), every registered algorithm (``native`` included) runs in interleaved rounds
(``bench.harness.Sweep``: one block of each per round, shuffled order, the slowest rank's time
per call, the median over ``--rounds``). Only algorithms whose results were exact compete. The
*incumbent* at a size is the built-in table's pick (``collectives.select.DEFAULT_TABLE``); the
fastest replaces it only when the incumbent's median is more than ``MARGIN`` slower, since
algorithms within a few percent trade places from one run to the next. Consecutive sizes with the
same pick become one rule ``[max_bytes, name]`` (``max_bytes``: the per-rank input bytes of the
last size it covers), in the JSON schema of ``collectives.select``::

    {"version": 1, "signature": "<cpu / cores / MPI library>",
     "tables": {"allreduce": {"2": [[4096, "native"], [67108864, "ring"]], ...,
                              "in-place": {"2": [[524288, "native"], [67108864, "ring"]]}}, ...}}

The last rule ends at the largest size measured: a file governs only the sizes it measured, and
past them ``auto`` uses the built-in table.

(allreduce in place is measured and ruled apart). Where the ranks span nodes of several ranks
(``python -m bench cluster ... -- python -m bench tune``), the rules are the ``"multi-node"``
ones and the incumbent the built-in multi-node pick; where every node holds one rank, the plain
ones. The rules are stored for this communicator
size, beside the other sizes already in the file when its signature matches (a file tuned on
another machine is moved to ``.bak``), at ``-o``, else ``COLLECTIVES_TUNING``, else
``~/.cache/collectives/tuning.json``. The tuner never reads the table it writes: every
algorithm runs by name, and the incumbent comes from the built-in table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

__all__ = ["MARGIN", "spec", "builtin_pick", "pick", "rules", "merge", "signature",
           "output_path", "main"]

# How much slower than the fastest the incumbent must be to be replaced.
MARGIN = 0.05

_SPECS = {
    "allreduce": ("bench.allreduce", "Allreduce"),
    "reduce_scatter": ("bench.reduce_scatter", "ReduceScatter"),
    "allgather": ("bench.allgather", "Allgather"),
    "broadcast": ("bench.broadcast", "Broadcast"),
    "reduce": ("bench.reduce", "Reduce"),
}


def spec(collective: str):
    """The benchmark's ``Collective`` for ``collective``."""
    import importlib
    module, cls = _SPECS[collective]
    return getattr(importlib.import_module(module), cls)()


def output_path(arg: str | None = None) -> Path:
    """Where ``tune`` writes: ``arg`` (``-o``), else ``COLLECTIVES_TUNING``, else the default
    user cache path."""
    if arg:
        return Path(arg)
    # The raw variable, not collectives.config: the toolkit refuses a COLLECTIVES_TUNING that
    # names a missing file, and the file this names may be the one the tuner is about to create.
    env = os.environ.get("COLLECTIVES_TUNING", "").strip()
    if env:
        return Path(os.path.expanduser(env))
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "collectives" / \
        "tuning.json"


def signature(comm) -> str:
    """What the table is valid for: host kind, cores, MPI library (rank counts key the rules)."""
    from mpi4py import MPI
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return f"{cpu} | {os.cpu_count()} cores | {MPI.Get_library_version().splitlines()[0].strip()}"


def builtin_pick(collective: str, nbytes: int, n: int, inplace: bool = False,
                 multi_node: bool = False) -> str:
    """The built-in table's algorithm for ``nbytes`` of per-rank input on ``n`` ranks (without
    a tuning file; ``multi_node``: ranks on several nodes of several ranks each)."""
    from collectives import select
    return select.rule(select.DEFAULT_TABLE, collective, nbytes, n, inplace, multi_node)


def pick(row: list, incumbent: str | None, margin: float = MARGIN):
    """The result a rule names at one size (``row``: one ``Result`` per algorithm): the
    fastest median among the exact ones, unless ``incumbent`` is within ``margin`` of it."""
    exact = [r for r in row if not r.wrong]
    if not exact:
        raise RuntimeError(f"no algorithm gave exact results at {row[0].nbytes} bytes")
    win = min(exact, key=lambda r: r.time)
    mine = next((r for r in exact if r.algorithm == incumbent), None)
    if mine is not None and mine.time <= win.time * (1 + margin):
        return mine
    return win


def rules(best: list[tuple]) -> list[list]:
    """``[(input bytes, name)]`` -> ``[[max_bytes, name], ...]``, sorted by size, consecutive
    sizes with the same name merged. The last rule ends at the largest size measured: past it
    the built-in table applies (``collectives.select.rule``), since nothing was measured there."""
    out: list[list] = []
    for nbytes, name in sorted(best, key=lambda b: b[0]):
        if out and out[-1][1] == name:
            out[-1][0] = nbytes
        else:
            out.append([nbytes, name])
    return out


def merge(path: Path, sig: str, size: int, new: dict) -> tuple[dict, str | None]:
    """The file's content with ``new`` (``{collective, "collective in-place" or "collective
    multi-node": rules}``) stored for ``size`` ranks; and a note on what happened to an
    unusable old file."""
    data, note = None, None
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except ValueError:
            note = f"{path} was not valid JSON: replaced"
        if data is not None and data.get("signature") != sig:
            backup = path.with_name(path.name + ".bak")
            path.replace(backup)
            note = f"{path} was tuned for another machine ({data.get('signature')}): moved to " \
                   f"{backup}"
            data = None
    if data is None:
        data = {"version": 1, "signature": sig, "tables": {}}
    for key, table in new.items():
        collective, _, section = key.partition(" ")
        tables = data["tables"].setdefault(collective, {})
        if section:
            tables = tables.setdefault(section, {})
        tables[str(size)] = table
    return data, note


def _input_bytes(collective: str, result) -> int:
    """The per-rank input bytes ``auto`` sees for a benchmark size (all-gather's size column
    is the whole output)."""
    return result.nbytes // result.n if collective == "allgather" else result.nbytes


def _algorithms(collective: str, one_node: bool) -> list[str]:
    """The registered algorithms a table may name that can run here (single-node ones only on
    one node; not those that run on registered buffers only, which auto takes by agreement)."""
    from collectives import select
    return [a for a in select.algorithms(collective)
            if (one_node or select.get(collective, a).needs != select.ONE_NODE)
            and not select.get(collective, a).registered]


def _modes(collective: str, modes, in_place: bool = True) -> list[str]:
    """The modes that get rules: the first, and in place where it has rules of its own
    (``in_place``: not for the multi-node rules, which hold for both)."""
    from collectives import select
    return [m for m in modes if m == modes[0] or
            (in_place and m == "in" and collective in select.IN_PLACE_RULES)]


def main(argv=None) -> int:
    """``[mpiexec -n N] python -m bench tune [options]``."""
    from bench.harness import ROUNDS
    p = argparse.ArgumentParser(prog="python -m bench tune",
                                description="measure every algorithm and write the tuning "
                                            "table that algorithm='auto' reads")
    p.add_argument("--collectives", default=",".join(_SPECS),
                   help="comma-separated (default: all five)")
    p.add_argument("-b", "--minbytes", default="8",
                   help="smallest size; suffixes K, M, G, e.g. 8, 64K, 16M (default 8)")
    p.add_argument("-e", "--maxbytes", default="64M",
                   help="largest size, always measured (default 64M)")
    p.add_argument("-f", "--stepfactor", type=float, default=4, help="size factor (default 4)")
    p.add_argument("-d", "--datatype", default="float32")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"timed rounds per size (default {ROUNDS})")
    p.add_argument("-o", "--output", default=None,
                   help="tuning file (default: $COLLECTIVES_TUNING or "
                        "~/.cache/collectives/tuning.json)")
    p.add_argument("--dry-run", action="store_true", help="print, do not write")
    p.add_argument("--json", default=None,
                   help="write every measured row as JSON (the benchmark's schema)")
    args = p.parse_args(argv)
    from mpi4py import MPI

    from bench.harness import Sweep, abort_on_error
    from bench.report import check_outputs, write_json
    from bench.units import byte_sizes, parse_size
    comm = MPI.COMM_WORLD
    abort_on_error(comm)
    n, rank0 = comm.Get_size(), comm.Get_rank() == 0
    sizes = byte_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    check_outputs(comm, {"--json": args.json})
    collectives = args.collectives.split(",")
    for c in collectives:
        if c not in _SPECS:
            raise SystemExit(f"unknown collective {c!r}; expected some of {', '.join(_SPECS)}")
    from collectives import select
    from collectives.topology import topology
    topo = topology(comm)
    one_node = topo.single_node
    # Nodes of several ranks get the multi-node rules; where every node holds one rank, the
    # ranks are a flat network, which the other rules serve (as auto reads them).
    several = not one_node and max(map(len, topo.nodes)) > 1
    path = output_path(args.output)
    # The tuner measures named algorithms only and compares with the built-in table: a
    # COLLECTIVES_TUNING that names the file about to be written must not be read.
    from collectives import config
    config.set("COLLECTIVES_TUNING", None)
    new, report, every = {}, [], []
    for c in collectives:
        s = spec(c)
        algs = _algorithms(c, one_node)
        modes = _modes(c, list(s.modes), not several)
        if rank0:
            print(f"# tune {c} on {n} ranks: {', '.join(algs)} over {len(sizes)} sizes",
                  flush=True)
        res = Sweep(s, comm, dtype=args.datatype, algorithms=algs, rounds=args.rounds,
                    check=True, modes=modes).run(sizes)
        every += res
        for mode in modes:
            inplace = mode == "in" and mode != modes[0]
            key = f"{c} in-place" if inplace else f"{c} {select.MULTI}" if several else c
            best = []
            for nbytes in _sizes(res, mode):
                row = [r for r in res if r.mode == mode and r.nbytes == nbytes]
                nin = _input_bytes(c, row[0])
                now = builtin_pick(c, nin, n, inplace, several)
                win = pick(row, now)
                best.append((nin, win.algorithm))
                fastest = min((r for r in row if not r.wrong), key=lambda r: r.time)
                report.append((key, nbytes, fastest, next((r for r in row
                                                          if r.algorithm == now), None), win))
            new[key] = rules(best)
    note = None
    if rank0 and not args.dry_run:
        data, note = merge(path, signature(comm), n, new)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    comm.Barrier()
    if rank0:
        _print(new, report, n, path, note, args.dry_run)
        if args.json:
            write_json(args.json, every, {"tune": True, "ranks": n, "collectives": collectives,
                                          "table": str(path)})
    return 0


def _sizes(results, mode: str) -> list[int]:
    """The sizes of ``results`` in ``mode``, in order."""
    return list(dict.fromkeys(r.nbytes for r in results if r.mode == mode))


def _print(new, report, n, path, note, dry) -> None:
    from bench.units import format_size
    from collectives import select
    print(f"#\n# tuning table for {n} ranks " + ("(dry run, not written)" if dry else
                                                f"written to {path}"))
    if note:
        print(f"# note: {note}")
    print(f"# {'rules':<20} {'size':>10} {'fastest':>19} {'time(us)':>10} {'built-in':>19} "
          f"{'time(us)':>10} {'pick':>19}")
    for key, nbytes, fastest, builtin, win in report:
        b_name = builtin.algorithm if builtin else "-"
        b_time = f"{builtin.time * 1e6:10.1f}" if builtin else f"{'-':>10}"
        print(f"  {key:<20} {nbytes:>10} {fastest.algorithm:>19} {fastest.time * 1e6:10.1f} "
              f"{b_name:>19} {b_time} {win.algorithm:>19}")
    for key, table in new.items():
        print(f"# {key}: {select.describe(table)}"
              + (f"; past {format_size(table[-1][0])}: the built-in table"
                 if table and table[-1][0] is not None else ""))
    print(f"# pick: the fastest, unless the built-in table's pick is within "
          f"{100 * MARGIN:g}% of it")
    if not dry:
        # What the next job needs to run on this table: nothing at the default path.
        env = os.environ.get("COLLECTIVES_TUNING", "").strip()
        if env and Path(os.path.expanduser(env)).resolve() == path.resolve():
            print(f"# auto reads {path} while COLLECTIVES_TUNING={env}")
        elif path.resolve() == output_path().resolve():
            print(f"# auto reads {path} in every job (unless COLLECTIVES_TUNING names another "
                  f"file)")
        else:
            print(f"# auto reads {path} with COLLECTIVES_TUNING={path}")
