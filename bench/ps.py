"""``python -m bench ps``: the parameter server's straggler study and its bytes per step.

Runs ``examples/train_ps.py`` under ``mpiexec`` (this command itself runs in one process) and
prints two tables:

1. **stragglers**: 1 server + ``--workers`` workers (``--dense server``: the whole model on
   the servers, so that the staleness bound governs it) for staleness 0 (BSP), 1, 3, 10 and
   none (ASP), under transient stragglers (``--straggle P --slowdown F``: each worker, each
   step, with probability P, takes F times its ``--compute`` seconds) and under one
   persistently slow worker (``--straggler 1 --slowdown F``): time to the target loss, final
   loss (a fixed evaluation set after every push), wall time, and each one's ratio to BSP's
   under the same stragglers. Runs go in ``--rounds`` interleaved rounds, in an order shuffled
   the same way for every round's seed, and the table shows medians (with the range);
2. **bytes** (``--bytes``): the hybrid (embeddings on the servers, MLP on the allreduce) against
   ``--mode allreduce`` (the whole table allreduced) at ``--ids`` ids x 32: bytes per step per
   worker (both directions) and the median step time, one run each.

``--json PATH`` writes every run's summary.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys

__all__ = ["STALENESS", "run_example", "main"]

STALENESS = ("0", "1", "3", "10", "none")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(ranks: int, args: list, timeout: float = 600) -> dict:
    """Run examples/train_ps.py on ``ranks`` ranks; its JSON summary (``RuntimeError`` with
    its output if it fails)."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep +
                           os.environ.get("PATH", ""))
    if mpiexec is None:
        raise RuntimeError("bench ps needs mpiexec on PATH or beside the python")
    cmd = [mpiexec, "-n", str(ranks), sys.executable,
           os.path.join(ROOT, "examples", "train_ps.py"), "--quiet", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _fmt(values, digits=2):
    vals = [v for v in values if v is not None]
    if not vals:
        return "never"
    mid = statistics.median(vals)
    text = f"{mid:.{digits}f}"
    if len(vals) > 1:
        text += f" [{min(vals):.{digits}f}-{max(vals):.{digits}f}]"
    if len(vals) < len(values):
        text += f" ({len(values) - len(vals)} never)"
    return text


def stragglers(opts, runs: list) -> None:
    """The straggler table."""
    common = ["--dense", "server", "--steps", str(opts.steps), "--compute", str(opts.compute),
              "--target-loss", str(opts.target_loss)]
    scenarios = {"transient": ["--straggle", str(opts.straggle), "--slowdown",
                               str(opts.slowdown)],
                 "persistent": ["--straggler", "1", "--slowdown", str(opts.slowdown)]}
    cases = [(sc, s) for sc in scenarios for s in STALENESS]
    results = {c: [] for c in cases}
    for r in range(opts.rounds):
        order = list(cases)
        random.Random(r).shuffle(order)
        for sc, s in order:
            out = run_example(opts.workers + 1, common + scenarios[sc] +
                              ["--staleness", s, "--seed", str(opts.seed + r)])
            out["scenario"] = sc
            runs.append(out)
            results[(sc, s)].append(out)
    print(f"# straggler study: 1 server + {opts.workers} workers, {opts.steps} steps of "
          f"{opts.compute} s compute, target loss {opts.target_loss}, {opts.rounds} rounds "
          f"(median [min-max])")
    print(f"# transient: --straggle {opts.straggle} --slowdown {opts.slowdown}; persistent: "
          f"--straggler 1 --slowdown {opts.slowdown}")
    print(f"{'scenario':<11}{'staleness':>10}{'to target s':>24}{'x BSP':>7}"
          f"{'final loss':>28}{'x BSP':>7}{'wall s':>22}")
    for sc in scenarios:
        base = results[(sc, "0")]
        t0 = statistics.median([x["time_to_target_s"] or float("inf") for x in base])
        l0 = statistics.median([x["final_loss"] for x in base])
        for s in STALENESS:
            rs = results[(sc, s)]
            tt = [x["time_to_target_s"] for x in rs]
            tmed = statistics.median([t if t is not None else float("inf") for t in tt])
            fl = [x["final_loss"] for x in rs]
            print(f"{sc:<11}{s:>10}{_fmt(tt):>24}{tmed / t0:>7.2f}{_fmt(fl, 5):>28}"
                  f"{statistics.median(fl) / l0:>7.3f}{_fmt([x['wall_s'] for x in rs]):>22}")


def bytes_table(opts, runs: list) -> None:
    """Hybrid against the whole table on allreduce."""
    common = ["--ids", str(opts.ids), "--compute", "0", "--steps", str(opts.bytes_steps)]
    hybrid = run_example(opts.workers + 1, common + ["--staleness", "0"])
    dense = run_example(opts.workers, common + ["--mode", "allreduce"])
    runs += [hybrid, dense]
    print(f"# bytes per step: {opts.workers} workers, {opts.ids} ids x 32 float32, batch 128 x 8 "
          f"ids, {opts.bytes_steps} steps each")
    print(f"{'mode':<34}{'bytes/step/worker':>20}{'step s':>10}{'final loss':>12}")
    for name, r in (("hybrid (1 server, MLP allreduce)", hybrid),
                    ("allreduce (whole table)", dense)):
        print(f"{name:<34}{r['bytes_per_step']:>20,}{r['step_s']:>10.4f}{r['final_loss']:>12.5f}")
    print(f"# ratio: {dense['bytes_per_step'] / hybrid['bytes_per_step']:.0f}x fewer bytes, "
          f"{dense['step_s'] / hybrid['step_s']:.1f}x shorter step")


def main(argv=None) -> int:
    """Parse the options, run the study, print the tables."""
    ap = argparse.ArgumentParser(prog="python -m bench ps", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--compute", type=float, default=0.02)
    ap.add_argument("--straggle", type=float, default=0.2)
    ap.add_argument("--slowdown", type=float, default=4.0)
    ap.add_argument("--target-loss", type=float, default=0.0095)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bytes", action="store_true", help="also the bytes-per-step table")
    ap.add_argument("--no-stragglers", action="store_true", help="only the bytes table")
    ap.add_argument("--ids", type=int, default=1_000_000)
    ap.add_argument("--bytes-steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    opts = ap.parse_args(argv)
    runs: list = []
    if not opts.no_stragglers:
        stragglers(opts, runs)
    if opts.bytes or opts.no_stragglers:
        bytes_table(opts, runs)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
