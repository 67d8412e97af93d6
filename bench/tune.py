"""``python -m bench tune``: measure every algorithm, write the tuning table ``auto`` reads.

Under ``mpiexec -n N``: for each collective (default all five) every registered algorithm
(``native`` included) runs interleaved over a grid of sizes (``-b/-e/-f``, as the benchmark);
at each size the fastest median time wins (unless what ``auto`` runs now is within the noise of
it, see ``winner``), and consecutive sizes with the same winner become one
rule ``[max_bytes, name]`` (``max_bytes`` = the per-rank input bytes of the last size it won,
``null`` for the last rule). The rules are stored for this communicator size in the JSON schema
of ``collectives.select``::

    {"version": 1, "signature": "<cpu / cores / MPI library>",
     "tables": {"allreduce": {"2": [[4096, "native"], [null, "ring"]], ...,
                              "in-place": {"2": [[524288, "native"], [null, "ring"]]}}, ...}}

(allreduce is measured in place too, and its in-place winners become the ``"in-place"`` rules).
A rule also names the algorithms within 1.5x of the fastest and those the rule in force named
(four at most), then the built-in rule's and the other mode's fastest at that size,
``[max_bytes, winner, alternate, ...]`` (``alternates``):
``auto`` measures them at run time
where that cannot change a result (``collectives.select``), since which of two close
algorithms is faster changes from one process launch to the next on a shared machine.
What ``auto`` runs now stays where the fastest beats it by no more than 3% or three standard
errors (``winner``), 5% where ``auto`` could not race the two (``KEEP_FINAL``): near-equals
trade places from run to run, and the table follows evidence. At more than 2 ranks a
reduction's new rule is led by an algorithm ``auto`` can race (tree, shm) where one is within
5% or the noise of the fastest (``raceable``).

at ``COLLECTIVES_TUNING`` or ``~/.cache/collectives/tuning.json``, merged with the sizes already
in the file when its signature matches (a file of another machine is moved to ``.bak``). It then
prints, per size, the best measured algorithm, what ``auto`` picked before and picks now, and
their measured times; ``--verify`` runs the benchmark again with ``auto`` to show the ratio
``auto / best`` measured afresh.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
from pathlib import Path

import numpy as np

__all__ = ["main", "rules", "winner", "raceable", "choice", "signature", "tuning_file", "merge"]

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


def tuning_file() -> Path:
    """Where ``tune`` writes: ``COLLECTIVES_TUNING`` or the default user cache path."""
    env = os.environ.get("COLLECTIVES_TUNING")
    if env:
        return Path(env)
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


def rules(best: list[tuple]) -> list[list]:
    """``[(input bytes, winner or (winner, alternate, ...))]`` -> ``[[max_bytes, name, ...],
    ..., [None, name, ...]]``, sorted by size, consecutive sizes with the same names merged."""
    out: list[list] = []
    for nbytes, names in sorted(best, key=lambda b: b[0]):
        names = [names] if isinstance(names, str) else list(names)
        if out and out[-1][1:] == names:
            out[-1][0] = nbytes
        else:
            out.append([nbytes] + names)
    if out:
        out[-1][0] = None
    return out


# A rule's alternates, which ``auto`` measures at run time where the choice cannot change a
# result (collectives.select), since one launch's ranking is not the next one's: the algorithms
# within ALTERNATE of the fastest at a size, and the ones the rule named before (the evidence of
# earlier runs: binomial reduce at 128 KiB, n = 2, was 1.26x faster than native in one launch
# and 1.3x slower in another), at most ALTERNATES, fastest first. 1.5, as the benchmark's race
# (harness.CONTEND): allgather at 256 KiB, n = 2, ring was 1.3x native in tune and 0.9x in the
# benchmark's run after; ``auto``'s trial drops the clearly slower ones after a few blocks.
# The built-in rule's names (``keep``) stay whatever this run measured: they are the evidence of
# many runs, and some algorithms run in two modes minutes apart on a shared machine (broadcast,
# 2 ranks, 2 MiB: shm 0.52-0.6x native's time in one benchmark and 3.5x in the tune just
# before it, the same code); dropped from the table, the trial could not find the fast mode.
# So does the other mode's fastest at the size (allreduce's in place, a reduce's root in place):
# at 2 ranks, 512 KiB and 2 MiB, a tune timed shm out of place at 1.6x and 1.4x recursive
# doubling, seventh at both, and left it out, while in place it led; the benchmark after ran it
# the fastest out of place too, and ``auto`` at 0.79 and 0.70 of it (run F2).
# Past the cap, the fastest close one of each way of moving the data (``_transport``) that the
# first ALTERNATES leave out: a machine's slow phases do not slow them alike. At 2 ranks, a
# tune timed shm's allreduce in place at 1.20x and 1.18x the fastest at 512 KiB and 2 MiB
# (sixth of nine at 2 MiB, behind four point-to-point schedules within 6%), and the cap left
# it out; in the benchmark after, every other algorithm at 2 MiB ran 2.3-3.1x its tune time,
# shm 1.9x, and it led both sizes, `auto` at 0.91 and 0.79 of it (run I0, docs/bench.md).
ALTERNATE = 1.5
ALTERNATES = 4


def _transport(name: str) -> str:
    """How ``name`` moves the data: the MPI library's own collective, the shared-memory
    window (``shm``, and ``hierarchical_shm`` within a node), or our schedules of
    point-to-point messages (every other)."""
    if name in ("native", "shm"):
        return name
    return "shm" if name == "hierarchical_shm" else "p2p"


def alternates(row: list, win, before=(), keep=(), single_node: bool = True) -> tuple[str, ...]:
    """The other algorithms of ``row`` within ``ALTERNATE`` of its fastest or named in
    ``before`` (the rule in force), fastest first, ``ALTERNATES`` at most, and the fastest
    of them of each ``_transport`` those leave out; then those of ``keep`` (the built-in
    rule's, and the other mode's fastest) not among them. One name of
    two for the same code (``select.runs``: on one node, hierarchical_shm is shm): ``auto``
    would race one of them."""
    from collectives import select
    fastest = min(r.time for r in row)
    close = sorted((r for r in row if r is not win and
                    (r.time <= ALTERNATE * fastest or r.algorithm in before)),
                   key=lambda r: r.time)
    names = select.distinct((win.algorithm,) + tuple(r.algorithm for r in close), single_node)
    names, rest = list(names[:1 + ALTERNATES]), names[1 + ALTERNATES:]
    ways = {_transport(n) for n in names}
    for name in rest:  # fastest first: the first of each way left out
        if _transport(name) not in ways:
            ways.add(_transport(name))
            names.append(name)
    measured = {r.algorithm for r in row} - {win.algorithm}
    return select.distinct(tuple(names) + tuple(n for n in keep if n in measured),
                           single_node)[1:]


# A new rule must beat what ``auto`` runs now by more than this, or by three standard errors of
# the difference of the two medians, whichever is larger.
KEEP = 0.03
# ... by more than this where ``auto`` cannot race the two (``select.races``), so that the
# table's pick is final. Over the 3-rank tunes on record (runs A-AA), the 9 final changes won
# by 3-5% ran in the benchmark after at 0.87 of the pick they replaced (geometric mean), 6 of
# them below 0.95 (allreduce of 32 KiB, shm for native by 3.1-4.9% in the tune, 0.86-0.87 in the
# benchmark in runs E, W, Y; reduce of 32 MiB, hierarchical for shm by 3.8%, 0.70-0.87), 2
# faster; the 20 won by 5-10% ran at 1.08 of it, 14 faster.
KEEP_FINAL = 0.05


def winner(row: list, incumbent: str | None, keep: float = KEEP):
    """The result whose algorithm a rule names at one size: the fastest median, unless the
    algorithm ``auto`` runs now (``incumbent``) is within the noise of it (``keep``).

    Why: at 3 ranks on 2 cores, algorithms within a few percent of each other trade places
    from run to run; the tuner picked double binary tree over shm at 512 KiB (allreduce,
    n = 3) and ring over shm at 32 MiB in one run, where the benchmark afterwards measured them
    at 0.93 of shm, the pick of every other run. A table changes where the evidence is clear:
    at 3 ranks binomial reduce of 512 KiB ran 180-600 us from block to block, its median 184 us
    in the tuner's run against tree's 297, and 444 against 327 in the benchmark's next run.
    """
    from bench.harness import noise
    win = min(row, key=lambda r: r.time)
    mine = next((r for r in row if r.algorithm == incumbent), None)
    if mine is None or mine is win:
        return win
    if math.log(mine.time / win.time) <= max(keep, noise(mine, win)):
        return mine
    # An algorithm that runs in two modes wins on its median when most rounds catch the fast
    # one, and loses the next run: it replaces the incumbent only if its slow rounds (the upper
    # quartile) are faster too.
    return win if _upper(win) < _upper(mine) else mine


# At more than 2 ranks ``auto`` races a reduction's algorithms only where they combine in the
# rule's first's order (``select.bits``: tree's, or ring's), so that results do not change
# from run to run; a rule led by an algorithm of an order of its own runs that one, whatever
# the machine does next. Such a new winner gives the lead to the fastest algorithm that can
# race another of the row, when within RACEABLE of it (or within the noise): at 3 ranks,
# reduce of 32 MiB, the tuner measured hierarchical at 11.8 ms and shm at 12.3, the benchmark
# after ran shm at 8.5-11.0 and hierarchical at 13.6-15.1, and hierarchical's rule could not
# race (0.66-0.83 of shm); tree ran within 2% of hierarchical there in four runs. Not a winner
# that ``auto`` runs now (``incumbent``): the built-in rules are the evidence of many runs,
# and in runs Y, Z and AA shm took the lead from native (allreduce, 32 KiB) and from ring (in
# place, 8 MiB) that way, and ran at 0.85-0.99 of them.
RACEABLE = 0.05


def raceable(row: list, win, collective: str, n: int, incumbent: str | None = None,
             nbytes: int = 0, where=None):
    """``win``, or the result that leads its rule in its place (see ``RACEABLE``): ``row`` is
    one size (``nbytes`` as ``auto`` sees it); ``where``, ``select.bits``' topology keywords."""
    from bench.harness import noise
    from collectives import select
    if n <= 2 or collective in select.MOVES or win.algorithm == incumbent:
        return win

    def partnered(r):  # r's rule could race another of the row
        return any(q is not r and select.races(collective, n, r.algorithm, q.algorithm,
                                               nbytes, **(where or {})) for q in row)

    if partnered(win):
        return win
    them = [r for r in row if partnered(r)]
    if not them:
        return win
    mine = min(them, key=lambda r: r.time)
    return mine if math.log(mine.time / win.time) <= max(RACEABLE, noise(mine, win)) else win


def either_mode(row: list, other: list, win, keep: float = KEEP):
    """``win``, or the result of ``row`` whose algorithm runs best in the worse of the two
    modes, ``row``'s and ``other``'s (a reduce's in place), where that is better than ``win``'s
    by more than ``keep``: one rule serves both. A reduce is in place on its root alone, so
    ``auto`` cannot tell the two apart on every rank (``select.IN_PLACE_RULES``), and there they
    rank the algorithms differently: shm's root combining in place ran 1.2-2.2x as fast as
    out of place at 512 KiB - 32 MiB (runs AE-AI), tree's at 0.74-1.07x, and at 2 ranks,
    8 MiB, where tree led out of place by 4%, it ran in place at 0.69 of shm (AF)."""
    there = {r.algorithm: r.time for r in other}
    if not there:
        return win
    here_best, there_best = min(r.time for r in row), min(there.values())

    def worse(r):
        return min(here_best / r.time, there_best / there.get(r.algorithm, math.inf))

    best = max(row, key=worse)
    return best if worse(best) > worse(win) * (1 + keep) else win


def choice(collective: str, n: int, row: list, other: list, before=(), built=(),
           shared: bool = False, where=None):
    """The winner of ``row`` (one size of one mode, on ``n`` ranks) and the names of its rule:
    the winner, then its alternates (``alternates``: ``before``, the rule in force; ``built``,
    the built-in rule's names; and ``other``'s fastest, the other mode's rows at this size).
    ``shared``: the two modes share this rule (a reduce), so it serves both (``either_mode``).
    ``where``: the topology keywords of ``select.bits``."""
    from collectives import select
    now = before[0] if before else None
    fastest = min(row, key=lambda r: r.time).algorithm
    nbytes = _input_bytes(collective, row[0])
    keep = KEEP if select.races(collective, n, now, fastest, nbytes, **(where or {})) \
        else KEEP_FINAL
    win = raceable(row, winner(row, now, keep), collective, n, now, nbytes, where)
    if shared:
        win = either_mode(row, other, win)
    there = (min(other, key=lambda r: r.time).algorithm,) if other else ()
    return win, (win.algorithm,) + alternates(row, win, before, tuple(built) + there,
                                              (where or {}).get("single_node", True))


def _upper(res) -> float:
    """The upper quartile of ``res``'s drift-corrected rounds."""
    return float(np.percentile(res.corrected(), 75))


def merge(path: Path, sig: str, size: int, new: dict) -> tuple[dict, str | None]:
    """The file's content with ``new`` ({collective: rules}) stored for ``size``; and a note."""
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
        collective, inplace = _split(key)
        tables = data["tables"].setdefault(collective, {})
        if inplace:
            tables = tables.setdefault("in-place", {})
        tables[str(size)] = table
    return data, note


def _input_bytes(collective, result) -> int:
    """The per-rank input bytes ``auto`` sees for a benchmark size."""
    if collective == "allgather":
        return result.nbytes // result.n
    return result.nbytes


def main(argv=None) -> int:
    """``[mpiexec -n N] python -m bench tune [options]``."""
    from bench.harness import BUDGET_MS
    p = argparse.ArgumentParser(prog="python -m bench tune",
                                description="measure every algorithm and write the tuning "
                                            "table that algorithm='auto' reads")
    p.add_argument("--collectives", default=",".join(_SPECS),
                   help="comma-separated (default: all five)")
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=float, default=4)
    p.add_argument("-d", "--datatype", default="float32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=BUDGET_MS,
                   help=f"ms per round (default {BUDGET_MS:g}, as the benchmark's)")
    p.add_argument("-o", "--output", default=None,
                   help="tuning file (default: $COLLECTIVES_TUNING or "
                        "~/.cache/collectives/tuning.json)")
    p.add_argument("--settle", type=float, default=20.0,
                   help="seconds of extra rounds per size for the close contenders (see "
                        "python -m bench allreduce --help; default 20)")
    p.add_argument("--dry-run", action="store_true", help="print, do not write")
    p.add_argument("--verify", action="store_true",
                   help="benchmark auto again with the new table")
    p.add_argument("--json", default=None,
                   help="write every measured row as JSON (the benchmark's schema)")
    args = p.parse_args(argv)
    from mpi4py import MPI

    from bench.harness import Sweep, _abort_on_error, byte_sizes, parse_size
    from collectives import api, select
    comm = MPI.COMM_WORLD
    _abort_on_error(comm)
    n, rank0 = comm.Get_size(), comm.Get_rank() == 0
    sizes = byte_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    collectives = args.collectives.split(",")
    for c in collectives:
        if c not in _SPECS:
            raise SystemExit(f"unknown collective {c!r}; expected some of {', '.join(_SPECS)}")
    path = Path(args.output) if args.output else tuning_file()
    if args.output:
        os.environ["COLLECTIVES_TUNING"] = str(path)  # so auto reads the table we write
    sig = signature(comm)
    where = api._placement(api._context(comm))
    measured, new, unruled, rows_all = {}, {}, {}, []
    rule_now = _rules_now(n, path)
    builtin = _rules_now(n, path, builtin=True)
    for c in collectives:
        s = spec(c)
        algs = [a for a in select.algorithms(c)]
        if rank0:
            print(f"# tune {c} on {n} ranks: {', '.join(algs)} over {len(sizes)} sizes",
                  flush=True)
        # Every mode the benchmark times (out of place and in place where the collective has
        # both), so that both see the same interleaving; ``_ruled`` says which make rules.
        sweep = Sweep(s, comm, dtype=args.datatype, algorithms=algs, rounds=args.rounds,
                      budget=args.budget / 1e3, check=True, modes=list(s.modes),
                      settle=args.settle,
                      incumbent=lambda nbytes, mode, c=c: rule_now(c, nbytes, mode == "in")[0])
        res = sweep.run(sizes)
        rows_all += res
        for mode in sweep.modes:
            if _ruled(c, mode, sweep.modes):
                key = c if mode == sweep.modes[0] else f"{c} in-place"
                measured[key] = [r for r in res if r.mode == mode]
            elif mode != sweep.modes[0]:  # timed, no rules of its own: the first's rules serve it
                unruled[c] = [r for r in res if r.mode == mode]
    before = {}  # the rule auto uses now, per measured size
    for key, mine in measured.items():
        c, inplace = _split(key)
        before[key] = {r.nbytes: rule_now(c, _input_bytes(c, r), inplace) for r in mine}
        # the other mode's rows at each size: its fastest is kept among the alternates
        twin = unruled.get(c) or measured.get(c if inplace else f"{c} in-place") or []
        best = []
        for nbytes in dict.fromkeys(r.nbytes for r in mine):
            row = [r for r in mine if r.nbytes == nbytes]
            win, names = choice(c, n, row, [r for r in twin if r.nbytes == nbytes],
                                before[key][nbytes], builtin(c, _input_bytes(c, row[0]), inplace),
                                shared=not inplace and c in unruled, where=where)
            best.append((_input_bytes(c, win), names))
        new[key] = rules(best)
    note = None
    if rank0 and not args.dry_run:
        data, note = merge(path, sig, n, new)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    comm.Barrier()
    if not args.dry_run:
        select.load_table(reload=True)  # auto reads the table once per process: now the new one
    if rank0:
        _report(measured, before, new, n, path, sig, note, args.dry_run)
        if args.json:
            from bench.harness import write_json
            write_json(args.json, rows_all, {"tune": True, "ranks": n, "signature": sig,
                                             "collectives": collectives, "table": str(path)})
    if args.verify and not args.dry_run:
        _verify(comm, collectives, sizes, args)
    return 0


def _ruled(collective: str, mode: str, modes: list[str]) -> bool:
    """Whether the results of ``mode`` make rules: the first mode, and in place for the
    collectives with in-place rules."""
    from collectives import select
    return mode == modes[0] or (mode == "in" and collective in select.IN_PLACE_RULES)


def _split(key: str) -> tuple[str, bool]:
    """``"allreduce in-place"`` -> ``("allreduce", True)``."""
    c, _, mode = key.partition(" ")
    return c, bool(mode)


def _rules_now(n: int, path: Path, builtin: bool = False):
    """``rule(collective, input bytes, in place)``: the algorithms of the rule ``auto`` uses now
    there, its pick first (the file's, or the built-in table if there is no file yet, or with
    ``builtin`` always); memoized, for the race (``Sweep``'s ``incumbent``) and the verdict
    (``winner``) alike."""
    from collectives import select
    memo: dict = {}

    def rule(collective: str, nbytes: int, inplace: bool) -> tuple[str, ...]:
        key = (collective, nbytes, inplace and collective in select.IN_PLACE_RULES)
        if key not in memo:
            with _rules_in_force(path, builtin):
                memo[key] = select.candidates(collective, nbytes, n, inplace=key[2])
        return memo[key]
    return rule


@contextlib.contextmanager
def _rules_in_force(path: Path, builtin: bool = False):
    """The rules ``auto`` uses now: the file's, or the built-in table if there is no file yet or
    ``builtin`` (select refuses a COLLECTIVES_TUNING that names no file: it points at an empty
    table)."""
    import tempfile
    if path.exists() and not builtin:
        yield
        return
    saved = os.environ.get("COLLECTIVES_TUNING")
    fd, empty = tempfile.mkstemp(suffix=".json")
    os.write(fd, b'{"version": 1, "tables": {}}')
    os.close(fd)
    os.environ["COLLECTIVES_TUNING"] = empty
    try:
        yield
    finally:
        os.unlink(empty)
        if saved is None:
            del os.environ["COLLECTIVES_TUNING"]
        else:
            os.environ["COLLECTIVES_TUNING"] = saved


def _after(rules_: list, nbytes: int) -> str:
    for limit, name, *_alternates in rules_:
        if limit is None or nbytes <= limit:
            return name
    return "native"


def _report(measured, before, new, n, path, sig, note, dry):
    from collectives import select
    print(f"#\n# tuning table for {n} ranks " + ("(dry run, not written)" if dry else
                                                f"written to {path}"))
    print(f"# signature: {sig}")
    if note:
        print(f"# note: {note}")
    for c, res in measured.items():
        print(f"#\n# {c}: {select.describe(new[c])}")
        print(f"# {'size':>10} {'best':>19} {'time(us)':>10}   {'auto before':>19} "
              f"{'time(us)':>10} {'x best':>6}   {'auto after':>19} {'time(us)':>10} "
              f"{'x best':>6}")
        for nbytes in dict.fromkeys(r.nbytes for r in res):
            row = {r.algorithm: r for r in res if r.nbytes == nbytes}
            win = min(row.values(), key=lambda r: r.time)
            b = before[c][nbytes][0]
            a = _after(new[c], _input_bytes(_split(c)[0], win))
            tb = row[b].time if b in row else float("nan")
            ta = row[a].time
            print(f"  {nbytes:>10} {win.algorithm:>19} {win.time * 1e6:10.1f}   {b:>19} "
                  f"{tb * 1e6:10.1f} {win.time / tb:6.2f}   {a:>19} {ta * 1e6:10.1f} "
                  f"{win.time / ta:6.2f}")
    print("# x best = best time / that algorithm's time (1.00: auto picks the fastest)")


def _verify(comm, collectives, sizes, args):
    """Benchmark ``auto`` beside every algorithm with the new table in force."""
    from bench.harness import Sweep
    from collectives import select
    rank0 = comm.Get_rank() == 0
    if rank0:
        print("#\n# verify: auto / best, measured afresh with the new table")
    for c in collectives:
        s = spec(c)
        algs = list(select.algorithms(c)) + ["auto"]
        modes = list(s.modes)
        res = Sweep(s, comm, dtype=args.datatype, algorithms=algs, rounds=args.rounds,
                    budget=args.budget / 1e3, check=True, modes=modes,
                    settle=args.settle).run(sizes)
        if rank0:
            for mode in [m for m in modes if _ruled(c, m, modes)]:
                worst = 1.0
                name = c if mode == modes[0] else f"{c} in-place"
                for nbytes in dict.fromkeys(r.nbytes for r in res):
                    row = {r.algorithm: r for r in res if r.nbytes == nbytes and r.mode == mode}
                    best = min((r for a, r in row.items() if a != "auto"), key=lambda r: r.time)
                    ratio = best.time / row["auto"].time
                    worst = min(worst, ratio)
                    print(f"  {name:<25} {nbytes:>10} auto={row['auto'].picked:<19} "
                          f"best={best.algorithm:<19} best/auto={ratio:5.2f}")
                print(f"# {name}: worst best/auto over the grid {worst:.2f} (>= 0.95 is the "
                      f"target)")
