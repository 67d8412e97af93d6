"""``python -m bench verdict FILE.json ...``: is ``auto`` within 5% of the best algorithm?

Reads the ``--json`` files of benchmark runs (any collectives, any rank counts) and prints, per
collective, rank count, mode and size, the best algorithm of the row other than ``auto`` (gloo
left out: ``auto`` cannot run it), ``auto``'s time and pick, ``best / auto`` (the issue's
acceptance figure: at least ``--threshold`` everywhere) and ``pick / auto`` (``auto`` against
the row of the algorithm it ran: the same code, so what is left is the measurement's own
noise). Each cell that falls below the threshold is a *miss*; the summary counts them, per rank
count, and says how many are ``auto`` against its own pick's row. Exit status 0 either way: it
reports, the reader judges.

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

__all__ = ["cells", "main"]


def cells(results: list[dict], threshold: float = 0.95) -> list[dict]:
    """One dict per (collective, ranks, mode, size) that has an ``auto`` row: ``best``,
    ``best_us``, ``auto_us``, ``picked``, ``ratio`` (best / auto), ``own`` (the pick's row /
    auto, None where the pick has no row) and ``miss`` (ratio below ``threshold``)."""
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
        out.append({"collective": coll, "ranks": n, "mode": mode, "size": size,
                    "best": best, "best_us": others[best]["time_us"],
                    "auto_us": auto["time_us"], "picked": auto.get("picked"),
                    "then": auto.get("then"), "ratio": ratio,
                    "own": None if pick is None else pick["time_us"] / auto["time_us"],
                    "miss": ratio < threshold})
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
          f"{'best us':>9} {'auto us':>9} {'auto ran':<19} {'best/auto':>9} {'pick/auto':>9}")
    for c in found:
        if not (args.all or c["miss"]):
            continue
        own = "-" if c["own"] is None else f"{c['own']:.3f}"
        ran = c["picked"] or "?"
        if c["then"]:
            ran += f">{c['then']}"
        print(f"  {c['collective']:<15} {c['ranks']:>2} {c['mode']:<4} "
              f"{format_size(c['size']):>8} {c['best']:<19} {c['best_us']:9.1f} "
              f"{c['auto_us']:9.1f} {ran:<19} {c['ratio']:9.3f} {own:>9}"
              + ("  MISS" if c["miss"] else ""))
    by_n = defaultdict(lambda: [0, 0])
    for c in found:
        by_n[c["ranks"]][0] += 1
        by_n[c["ranks"]][1] += c["miss"]
    own_miss = sum(1 for c in found if c["own"] is not None and c["own"] < args.threshold)
    worst = min((c["ratio"] for c in found), default=float("nan"))
    print(f"# {sum(c['miss'] for c in found)} of {len(found)} cells below {args.threshold:g} ("
          + ", ".join(f"n = {n}: {m} of {k}" for n, (k, m) in sorted(by_n.items()))
          + f"); worst {worst:.3f}; auto below {args.threshold:g} of its own pick's row: "
          f"{own_miss}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
