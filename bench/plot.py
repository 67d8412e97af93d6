"""Bus bandwidth vs size, one line per algorithm: ``python -m bench plot FILE.json -o FILE.png``.

The benchmark calls ``plot`` for ``--plot``; the command redraws saved ``--json`` results. Log-2
size axis, busbw in GB/s, MPI's ``native`` dashed, gloo dotted, the title names the collective,
ranks, dtype and host.
"""
from __future__ import annotations

import argparse
import json

from bench.units import format_size

__all__ = ["plot", "main"]


def _label(nbytes: float) -> str:
    return format_size(int(nbytes))


def plot(results: list[dict], path, info: dict, *, mode: str | None = None) -> None:
    """Draw ``results`` (``Result.to_dict()`` rows) into the PNG ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    modes = [r["mode"] for r in results]
    mode = mode or ("out" if "out" in modes else "in")
    rows = [r for r in results if r["mode"] == mode]
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    # An algorithm with no run in this mode (gloo's in-place-only allreduce) is drawn from the
    # other mode, and says so: better than leaving the baseline out of the picture.
    extra = [a for a in dict.fromkeys(r["algorithm"] for r in results) if a not in algs]
    fig, ax = plt.subplots(figsize=(9.5, 5.8), dpi=110)
    # tab10 then its light shades, without the greys that gloo and native use.
    tab20 = plt.get_cmap("tab20").colors
    colors = [tab20[2 * i] for i in range(10) if i != 7] + \
        [tab20[2 * i + 1] for i in range(10) if i != 7]
    markers = "os^vDPX*<>hp"
    k = 0
    for alg in algs + extra:
        pts = sorted((r["size"], r["busbw_GBps"]) for r in results
                     if r["algorithm"] == alg and (r["mode"] == mode or alg in extra))
        label = alg if alg in algs else f"{alg} ({'in' if mode == 'out' else 'out-of'}-place)"
        style = {"native": dict(ls="--", lw=2.4, color="black", marker="o"),
                 "gloo": dict(ls=":", lw=2.2, color="dimgray", marker="x"),
                 "auto": dict(ls="-", lw=5, alpha=0.3, color="tab:green", marker="o")}.get(alg)
        if style is None:
            style = dict(lw=1.5, color=colors[k % len(colors)], marker=markers[k % len(markers)])
            k += 1
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ms=4, label=label, **style)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _label(v)))
    ax.set_xlabel("size (bytes" + (", per rank)" if info.get("collective") in
                                   ("allreduce", "reduce", "broadcast") else ", whole buffer)"))
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(True, which="major", alpha=0.4)
    ax.set_ylim(bottom=0)
    what = {"out": "out-of-place", "in": "in-place"}[mode]
    op = f" {info['op']}" if info.get("op") else ""
    ax.set_title(f"{info.get('collective', '')} busbw ({what}): {info.get('ranks')} ranks, "
                 f"{info.get('dtype')}{op}, host {info.get('host')}", fontsize=11)
    ax.legend(fontsize=9, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    """``python -m bench plot results.json [-o out.png] [--mode out|in]``."""
    p = argparse.ArgumentParser(prog="python -m bench plot",
                                description="busbw vs size from bench --json results")
    p.add_argument("json", help="a file written by python -m bench <collective> --json")
    p.add_argument("-o", "--output", default=None, help="PNG to write (default: JSON name)")
    p.add_argument("--mode", choices=("out", "in"), default=None)
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    out = args.output or args.json.rsplit(".", 1)[0] + ".png"
    plot(data["results"], out, data, mode=args.mode)
    print(out)
    return 0
