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
benchmark's own noise at that cell could make the difference (two rows of one algorithm's code
differed by 2% on average in a run here, and by more than 5% at about one cell in 80).

The whole check, as the README gives it (``make verify-auto`` runs it)::

    mpiexec -n 2 python -m bench tune -o T.json; mpiexec -n 3 python -m bench tune -o T.json
    COLLECTIVES_TUNING=T.json mpiexec -n N python -m bench <collective> -b 8 -e 64M -f 4 \\
        --json <collective>-nN.json        # N = 2, 3; the five collectives
    python -m bench verdict *-n2.json *-n3.json
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np

__all__ = ["cells", "interval", "main"]

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


def cells(results: list[dict], threshold: float = 0.95) -> list[dict]:
    """One dict per (collective, ranks, mode, size) that has an ``auto`` row: ``best``,
    ``best_us``, ``auto_us``, ``picked``, ``ratio`` (best / auto), ``paired`` (``interval``:
    the paired ratio and its range, or None), ``own`` (the pick's row / auto, None where the
    pick has no row), ``miss`` (ratio below ``threshold``) and ``clear`` (a miss whose paired
    range is wholly below)."""
    rows = defaultdict(dict)
    for r in results:
        if r["algorithm"] != "gloo" and r.get("time_us") == r.get("time_us"):  # not NaN
            rows[(r["collective"], r["ranks"], r["mode"], r["size"])][r["algorithm"]] = r
    out = []
    for (coll, n, mode, size), row in sorted(rows.items()):
        auto = row.get("auto")
        others = {a: r for a, r in row.items() if a != "auto"}
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


def _load(paths) -> list[dict]:
    results = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        results += data["results"]
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
    found = cells(_load(args.files), args.threshold)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
