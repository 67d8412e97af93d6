"""The benchmark's reports: the nccl-tests table, its closing lines, and JSON/CSV files.

Columns as nccl-tests prints them (size, count, type, redop, root, then time, spread, algbw,
busbw and #wrong for out-of-place and for in-place), then optionally OSU's latency columns,
the ratio to MPI's own collective (``xnative``: native's time / this row's) and ``%bound`` (the
time to move 2 n N bytes at the machine's memory bandwidth / this row's), for each mode (the
second mode's columns are ``xnat-in`` and ``%bnd-in``).
An ``auto`` row names the algorithm it ran: ``auto:ring``, or ``auto:ring/shm`` when its
out-of-place and in-place picks differ.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os

import numpy as np

from bench.stats import Result
from bench.units import format_size

__all__ = ["label", "header", "rows", "footer", "format_table", "write_json", "write_csv",
           "output_problem", "check_outputs"]

_MODE_HEAD = {"out": "out-of-place", "in": "in-place"}
_NAME = 28  # the algorithm column's width: "auto:recursive_doubling/shm" fits


def _fmt_time(t: float) -> str:
    return f"{t * 1e6:10.2f}" if t < 1e-2 else f"{t * 1e6:10.0f}"


def label(algorithm: str, picks) -> str:
    """The algorithm column: ``auto`` with what it ran in each mode (``picks``, in the table's
    mode order; None: unknown), any other algorithm as it is."""
    picks = [p for p in picks if p]
    if algorithm != "auto" or not picks:
        return algorithm
    return "auto:" + "/".join(dict.fromkeys(picks))


def header(modes, *, latency=False, ratio=True, bound=False) -> list[str]:
    """The three header lines of the table."""
    left = (f"{'size':>10} {'count':>11} {'type':>9} {'redop':>6} {'root':>5} "
            f"{'algorithm':<{_NAME}}")
    units = f"{'(B)':>10} {'(elements)':>11} {'':>9} {'':>6} {'':>5} {'':<{_NAME}}"
    group, mid, mid_u = " " * len(left), "", ""
    for mode in modes:
        block = f" {'time':>10} {'iqr%':>5} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        group += f"{_MODE_HEAD[mode]:^{len(block)}}"
        mid += block
        mid_u += f" {'(us)':>10} {'':>5} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
    tail, tail_u = "", ""
    if latency:
        tail += f" {'lat-min':>9} {'lat-avg':>9} {'lat-max':>9} {'iters':>6}"
        tail_u += f" {'(us)':>9} {'(us)':>9} {'(us)':>9} {'':>6}"
    for k, mode in enumerate(modes):  # the first mode's columns keep the plain names
        if ratio:
            tail += f" {'xnative' if k == 0 else 'xnat-' + mode:>7}"
            tail_u += f" {'':>7}"
        if bound:
            tail += f" {'%bound' if k == 0 else '%bnd-' + mode:>7}"
            tail_u += f" {'':>7}"
    return ["#" + group[1:], "#" + (left + mid + tail)[1:], "#" + (units + mid_u + tail_u)[1:]]


def rows(results: list[Result], modes, *, latency=False, ratio=True, membw_Bps=None,
         only=None) -> list[str]:
    """Table lines for the results of one size: one per algorithm (those in ``only``, if
    given; the ratio column still divides by ``native``'s time among ``results``)."""
    by = {(r.algorithm, r.mode): r for r in results}
    lines = []
    for alg in dict.fromkeys(r.algorithm for r in results):
        if only is not None and alg not in only:
            continue
        mine = [by[(alg, m)] for m in modes if (alg, m) in by]
        first = mine[0]
        name = label(alg, [r.picked for r in mine])
        line = (f"{first.nbytes:>10} {first.count:>11} {first.dtype:>9} {first.op:>6} "
                f"{first.root:>5} {name:<{_NAME}}")
        for mode in modes:
            r = by.get((alg, mode))
            if r is None:
                line += f" {'-':>10} {'':>5} {'-':>7} {'-':>7} {'-':>6}"
                continue
            wrong = "N/A" if r.wrong is None else str(r.wrong)
            line += (f" {_fmt_time(r.time)} {100 * r.spread:5.1f} {r.algbw / 1e9:7.2f} "
                     f"{r.busbw / 1e9:7.2f} {wrong:>6}")
        if latency:
            lo, avg, hi = first.latency()
            line += f" {lo * 1e6:9.2f} {avg * 1e6:9.2f} {hi * 1e6:9.2f} {first.iters:>6}"
        for mode in modes:
            r, base = by.get((alg, mode)), by.get(("native", mode))
            if ratio:
                line += (f" {base.time / r.time:7.2f}" if r is not None and base is not None
                         and r.time > 0 else f" {'-':>7}")
            if membw_Bps:
                line += (f" {100 * 2 * r.n * r.nbytes / membw_Bps / r.time:7.1f}"
                         if r is not None and r.time > 0 else f" {'-':>7}")
        lines.append(line)
    return lines


def footer(results: list[Result], modes) -> list[str]:
    """Closing lines: each algorithm's average busbw over the sweep (first mode) and #wrong,
    then what ``auto`` ran, size by size (in place too where that differs)."""
    lines = ["#", "# Avg bus bandwidth (GB/s, over sizes; first mode):"]
    for alg in dict.fromkeys(r.algorithm for r in results):
        bw = [r.busbw for r in results if r.algorithm == alg and r.mode == modes[0]]
        wrong = [r.wrong for r in results if r.algorithm == alg and r.wrong is not None]
        if bw:
            lines.append(f"#   {alg:<19} {np.mean(bw) / 1e9:8.3f}"
                         + (f"   #wrong {sum(wrong)}" if wrong else ""))
    said = None
    for mode in modes:
        picks = [(r.nbytes, r.picked) for r in results if r.picked and r.mode == mode]
        if not picks or picks == said:
            continue
        spans: list[list] = []  # runs of consecutive sizes with the same pick
        for nbytes, name in picks:
            if spans and spans[-1][2] == name:
                spans[-1][1] = nbytes
            else:
                spans.append([nbytes, nbytes, name])
        lines.append(f"# auto ran{' in place' if said else ''}: " + ", ".join(
            f"{name} ({format_size(a)}" + (f" - {format_size(b)})" if b != a else ")")
            for a, b, name in spans))
        said = picks
    return lines


def format_table(results: list[Result], modes, **kw) -> str:
    """The whole table for ``results`` (any number of sizes) as one string; ``kw`` as
    ``rows``."""
    lines = header(modes, latency=kw.get("latency", False), ratio=kw.get("ratio", True),
                   bound=bool(kw.get("membw_Bps")))
    for nbytes in dict.fromkeys(r.nbytes for r in results):
        lines += rows([r for r in results if r.nbytes == nbytes], modes, **kw)
    return "\n".join(lines)


def write_json(path, results: list[Result], meta: dict) -> None:
    """Results and run metadata as JSON (what ``python -m bench plot`` reads back)."""
    with open(path, "w") as f:
        json.dump(dict(meta, results=[r.to_dict() for r in results]), f, indent=1)
        f.write("\n")


def write_csv(path, results: list[Result]) -> None:
    """One CSV row per (size, algorithm, mode); the per-round times are in the JSON only."""
    dicts = [r.to_dict() for r in results]
    if not dicts:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in dicts[0] if k != "rounds_us"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(dicts)


def output_problem(path, *, needs: str | None = None) -> str | None:
    """Why ``path`` cannot be written at the end of a run (its folder is missing or not
    writable, it is a folder, or the module ``needs`` is not installed), or None."""
    if needs and importlib.util.find_spec(needs) is None:
        return f"{path}: needs {needs}, which is not installed (pip install {needs})"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a folder"
    if not os.path.isdir(folder):
        return f"{path}: no folder {folder}"
    if not os.access(folder, os.W_OK):
        return f"{path}: folder {folder} is not writable"
    return None


def check_outputs(comm, outputs: dict) -> None:
    """Refuse, on every rank and before any measurement, the output files that rank 0 could
    not write after the sweep (``outputs``: option -> path or None; ``--plot`` needs
    matplotlib): rank 0 looks, every rank raises ``SystemExit`` with the same message."""
    problems = None
    if comm.Get_rank() == 0:
        problems = [f"{opt} {p}" for opt, path in outputs.items() if path
                    for p in [output_problem(path, needs="matplotlib" if opt == "--plot"
                                             else None)] if p]
    problems = comm.bcast(problems, root=0)
    if problems:
        raise SystemExit(f"rank {comm.Get_rank()}: cannot write " + "; ".join(problems))
