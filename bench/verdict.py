"""``python -m bench verdict FILE.json ...``: is ``auto`` within 5% of the best algorithm?

Reads the ``--json`` files of benchmark runs (any collectives, any rank counts) and prints, per
collective, rank count, mode and size, the best algorithm of the row other than ``auto`` (gloo
left out: ``auto`` cannot run it), ``auto``'s time and pick, ``best / auto`` (the issue's
acceptance figure: at least ``--threshold`` everywhere) and ``pick / auto`` (``auto`` against
the row of the algorithm it ran: the same code, so what is left is the measurement's own
noise). Each cell that falls below the threshold is a *miss*; the summary counts them, per rank
count, and says how many are ``auto`` against its own pick's row. Exit status 0 either way: it
reports, the reader judges.

How sure a cell's ratio is: ``interval`` takes the rounds that ``auto`` and the best ran
together, whose blocks ran back to back (a slow phase of the machine falls on both), and gives
the median of their ratios, *paired*, with its 90% range over resamples of those rounds. A
miss whose paired range lies wholly below the threshold is *clear*; for the others the
benchmark's own noise at that cell could make the difference: in a run of all 168 cells with
twin rows (below; run F0, ``docs/bench.md``), two rows of one code were a median 3.9% apart,
and an ``auto`` that ran the best algorithm's code every time fell below 0.95 at 9 cells.

The benchmark's own floor: with ``--twin`` every algorithm also runs as a second row of
its code (``NAME#2``), interleaved with the others, and ``floor`` measures from those rows how
far two rows of one code fall apart, and how an ``auto`` that ran the best algorithm's code
every time would fare against the best of the other rows (``make verify-auto
BENCH_FLAGS=--twin``). Twin rows are never anyone's best in ``cells``.

The whole check, as the README gives it (``make verify-auto`` runs it)::

    mpiexec -n 2 python -m bench tune -o T.json; mpiexec -n 3 python -m bench tune -o T.json
    COLLECTIVES_TUNING=T.json mpiexec -n N python -m bench <collective> -b 8 -e 64M -f 4 \\
        --json <collective>-nN.json        # N = 2, 3; the five collectives
    python -m bench verdict *-n2.json *-n3.json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import numpy as np

__all__ = ["cells", "floor", "interval", "main"]

# Resamples of ``interval`` (fixed seed: the same verdict from the same files), and the fewest
# rounds in common that it takes.
RESAMPLES = 2000
MIN_ROUNDS = 5


def _rounds(row: dict) -> dict:
    """``{round id: time}`` of one JSON row (as measured: a pair's ratio cancels the drift)."""
    times = row.get("rounds_us") or []
    return dict(zip(row.get("round_ids") or range(len(times)), times))


def interval(best: dict, auto: dict, level: float = 0.9) -> tuple[float, float, float] | None:
    """``best / auto`` from the rounds both rows of one cell ran, paired: the median of the
    rounds' ratios, and its ``level`` range over resamples of those rounds; None below
    ``MIN_ROUNDS`` rounds in common."""
    b, a = _rounds(best), _rounds(auto)
    both = sorted(set(b) & set(a))
    if len(both) < MIN_ROUNDS:
        return None
    logs = np.log([b[i] / a[i] for i in both])
    pick = np.random.default_rng(0).integers(0, len(both), (RESAMPLES, len(both)))
    lo, hi = np.quantile(np.median(logs[pick], axis=1), [(1 - level) / 2, (1 + level) / 2])
    return float(np.exp(np.median(logs))), float(np.exp(lo)), float(np.exp(hi))


def _rows(results: list[dict]) -> list[tuple[tuple, dict]]:
    """The JSON rows by cell, sorted: ``((collective, ranks, mode, size), {algorithm: row})``,
    gloo and rows without a time (NaN) left out."""
    rows = defaultdict(dict)
    for r in results:
        if r["algorithm"] != "gloo" and r.get("time_us") == r.get("time_us"):  # not NaN
            rows[(r["collective"], r["ranks"], r["mode"], r["size"])][r["algorithm"]] = r
    return sorted(rows.items())


def cells(results: list[dict], threshold: float = 0.95) -> list[dict]:
    """One dict per (collective, ranks, mode, size) that has an ``auto`` row: ``best``,
    ``best_us``, ``auto_us``, ``picked``, ``ratio`` (best / auto), ``paired`` (``interval``:
    the paired ratio and its range, or None), ``own`` (the pick's row / auto, None where the
    pick has no row), ``miss`` (ratio below ``threshold``) and ``clear`` (a miss whose paired
    range is wholly below)."""
    out = []
    for (coll, n, mode, size), row in _rows(results):
        auto = row.get("auto")
        others = {a: r for a, r in row.items() if a != "auto" and "#" not in a}
        if auto is None or not others:
            continue
        best = min(others, key=lambda a: others[a]["time_us"])
        ratio = others[best]["time_us"] / auto["time_us"]
        pick = others.get(auto.get("picked"))
        span = interval(others[best], auto)
        out.append({"collective": coll, "ranks": n, "mode": mode, "size": size,
                    "best": best, "best_us": others[best]["time_us"],
                    "auto_us": auto["time_us"], "picked": auto.get("picked"),
                    "then": auto.get("then"), "ratio": ratio, "paired": span,
                    "own": None if pick is None else pick["time_us"] / auto["time_us"],
                    "miss": ratio < threshold,
                    "clear": ratio < threshold and span is not None and span[2] < threshold})
    return out


def floor(results: list[dict], threshold: float = 0.95) -> dict | None:
    """The benchmark's own floor, from runs with twin rows (``--twin``: ``NAME#2`` runs NAME's
    code as a row of its own); None without them.

    ``pairs``: every algorithm's row against its twin's, cell by cell (the same code timed
    twice), and ``apart``, how many of them are more than ``1 / threshold`` apart. ``oracle``:
    per cell and direction, an ``auto`` that ran the best algorithm's code every time, as a
    row of its own, against the best of the other rows: the twin of the algorithm fastest over
    both rows of it (the geometric mean), against the fastest of the first rows; and the other
    way round, its first row against the fastest twin. Choosing that algorithm from both rows
    favours it, so the count of ``misses`` (below ``threshold``) is, if anything, low; and
    ``clear``, those whose paired range (``interval``) lies wholly below it."""
    pairs, oracle = [], []
    for cell, row in _rows(results):
        both = [a for a in row if "#" not in a and a != "auto" and f"{a}#2" in row]
        if len(both) < 2:
            continue
        pairs += [row[a]["time_us"] / row[f"{a}#2"]["time_us"] for a in both]
        best = min(both, key=lambda a: row[a]["time_us"] * row[f"{a}#2"]["time_us"])
        for first, second in (("", "#2"), ("#2", "")):
            fastest = min((a + first for a in both), key=lambda a: row[a]["time_us"])
            ran = row[best + second]
            ratio = row[fastest]["time_us"] / ran["time_us"]
            span = interval(row[fastest], ran)
            oracle.append({"cell": cell, "best": fastest, "ran": best + second,
                           "ratio": ratio, "paired": span, "miss": ratio < threshold,
                           "clear": ratio < threshold and span is not None
                           and span[2] < threshold})
    if not pairs:
        return None
    pairs = np.asarray(pairs)
    return {"pairs": len(pairs), "apart": int(np.sum(np.abs(np.log(pairs)) > -np.log(threshold))),
            "median_gap": float(np.exp(np.median(np.abs(np.log(pairs))))),
            "oracle": oracle, "misses": sum(o["miss"] for o in oracle),
            "clear": sum(o["clear"] for o in oracle)}


def _load(paths) -> list[dict]:
    """The rows of every benchmark ``--json`` file in ``paths``. Other JSON (the tuning table
    that ``make verify-auto`` writes beside them, so that ``DIR/*.json`` works) is skipped,
    with a line on stderr; none left is an error."""
    results, read = [], 0
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("results"), list):
            print(f"# skipped {path}: not a benchmark's --json file", file=sys.stderr)
            continue
        results += data["results"]
        read += 1
    if not read:
        raise SystemExit("python -m bench verdict: none of the files is a benchmark's --json")
    return results


def main(argv=None) -> int:
    """Print every cell's verdict and the summary."""
    p = argparse.ArgumentParser(prog="python -m bench verdict",
                                description="auto against the best algorithm of each row")
    p.add_argument("files", nargs="+", help="benchmark --json files")
    p.add_argument("--threshold", type=float, default=0.95,
                   help="best / auto below this is a miss (default 0.95)")
    p.add_argument("--all", action="store_true", help="every cell, not only the misses")
    args = p.parse_args(argv)
    from bench.harness import format_size
    results = _load(args.files)
    found = cells(results, args.threshold)
    print(f"# {'collective':<15} {'n':>2} {'mode':<4} {'size':>8} {'best':<19} "
          f"{'best us':>9} {'auto us':>9} {'auto ran':<19} {'best/auto':>9} "
          f"{'paired (90%)':>21} {'pick/auto':>9}")
    for c in found:
        if not (args.all or c["miss"]):
            continue
        own = "-" if c["own"] is None else f"{c['own']:.3f}"
        span = "-" if c["paired"] is None else \
            f"{c['paired'][0]:.3f} ({c['paired'][1]:.3f}-{c['paired'][2]:.3f})"
        ran = c["picked"] or "?"
        if c["then"]:
            ran += f">{c['then']}"
        print(f"  {c['collective']:<15} {c['ranks']:>2} {c['mode']:<4} "
              f"{format_size(c['size']):>8} {c['best']:<19} {c['best_us']:9.1f} "
              f"{c['auto_us']:9.1f} {ran:<19} {c['ratio']:9.3f} {span:>21} {own:>9}"
              + ("  MISS (clear)" if c["clear"] else "  MISS" if c["miss"] else ""))
    by_n = defaultdict(lambda: [0, 0])
    for c in found:
        by_n[c["ranks"]][0] += 1
        by_n[c["ranks"]][1] += c["miss"]
    own_miss = sum(1 for c in found if c["own"] is not None and c["own"] < args.threshold)
    worst = min((c["ratio"] for c in found), default=float("nan"))
    print(f"# {sum(c['miss'] for c in found)} of {len(found)} cells below {args.threshold:g} ("
          + ", ".join(f"n = {n}: {m} of {k}" for n, (k, m) in sorted(by_n.items()))
          + f"); worst {worst:.3f}; clearly below (the paired 90% range): "
          f"{sum(c['clear'] for c in found)}; auto below {args.threshold:g} of its own pick's "
          f"row: {own_miss}")
    base = floor(results, args.threshold)
    if base is not None:
        _print_floor(base, args.threshold, format_size)
    return 0


def _print_floor(base: dict, threshold: float, format_size) -> None:
    """``floor``'s figures: the oracle's misses, then the summary."""
    print("#")
    print("# the floor (twin rows): an auto that ran the best algorithm's code every time, "
          "as a row of its own")
    for o in base["oracle"]:
        if o["miss"]:
            coll, n, mode, size = o["cell"]
            span = "-" if o["paired"] is None else \
                f"{o['paired'][0]:.3f} ({o['paired'][1]:.3f}-{o['paired'][2]:.3f})"
            print(f"  {coll:<15} {n:>2} {mode:<4} {format_size(size):>8} {o['best']:<21} "
                  f"{o['ran']:<21} {o['ratio']:9.3f} {span:>21}"
                  + ("  MISS (clear)" if o["clear"] else "  MISS"))
    k = len(base["oracle"])
    print(f"# oracle: {base['misses']} of {k} (cells x 2 directions) below {threshold:g}, "
          f"{base['misses'] / 2:.1f} per {k // 2} cells; clearly below: {base['clear']}; "
          f"two rows of one code: median {100 * (base['median_gap'] - 1):.1f}% apart, "
          f"{base['apart']} of {base['pairs']} more than {100 * (1 / threshold - 1):.1f}%")


if __name__ == "__main__":
    raise SystemExit(main())
