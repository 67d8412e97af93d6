"""The planner against measurement: every plan of examples/train_gpt.py's GPT on n ranks.

    python -m bench plan                          # 4 ranks, every plan, 3 interleaved rounds
    python -m bench plan --ranks 4 --rounds 5 --json plan.json

It launches its own jobs (``mpiexec -n N``, ``--mpiexec`` to name one), each in fresh processes:

1. *Predict.* ``collectives.plan.search`` lists every plan the example runs on n ranks (dp x tp
   x pp, sequence parallelism, pipeline schedules at ``--microbatches``, ZeRO stage, recompute)
   with its predicted peak memory per rank and step time; the compute is measured once
   (``train_gpt.measured_compute``: one block at each micro-batch size and tensor-parallel
   share) on every rank at once, so that it runs on the cores as shared as in training.
2. *Measure.* The plans run in batches of ``--batch-plans``, one job a batch (a job builds a
   mesh and its communicators per plan, and MPI holds a few thousand at most), each plan for
   ``--steps`` steps after two steps of the same plan at the same widths with one block a
   stage (``train_gpt.warm_up``: code and the libraries' first-use allocations, which depend
   on operand sizes, held before the baseline). ``--rounds`` rounds run the batches in a
   rotated order, so that load from other jobs falls on all of them alike; ``--only REGEX``
   keeps the plans whose name matches.

Measured by the processes themselves: the peak memory, the most any rank's resident set rose
(``VmHWM`` after a reset through ``/proc/self/clear_refs``) above what it held before the plan's
mesh and model were built, with glibc's mmap threshold fixed so that freed tensors leave the
resident set (``collectives.plan.measure``); the step time, the median over the steps after the
first of the slowest rank's step. The table shows the medians over the rounds, the ratios
predicted / measured and the rounds' spread of the step (interquartile range over the median);
the summary the error statistics and the planner's first choice against the fastest plan
measured; the last table what recompute keeps and costs for one block.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]


def _parser():
    p = argparse.ArgumentParser(prog="python -m bench plan", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per step, global (16)")
    p.add_argument("--vocab", type=int, default=264)
    p.add_argument("--attention", choices=("sdpa", "math"), default="math")
    p.add_argument("--microbatches", type=int, default=4, help="a pipeline's micro-batches (4)")
    p.add_argument("--steps", type=int, default=3, help="steps per plan and round (3)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-plans", type=int, default=10, help="plans per job (10)")
    p.add_argument("--limit", type=int, default=None, help="the first N plans only")
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="the plans whose name matches REGEX only ('pp4', 'tp4 pp1 zero0')")
    p.add_argument("--json", default=None, help="write every row as JSON")
    p.add_argument("--mpiexec", default=None)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)   # predict:FILE, run:FILE
    p.add_argument("--plans", default=None, help=argparse.SUPPRESS)  # i,j,... with run
    return p


def _flags(args) -> list[str]:
    return ["--dim", str(args.dim), "--heads", str(args.heads), "--layers", str(args.layers),
            "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
            "--attention", args.attention, "--steps", str(args.steps)]


def _job(args) -> int:
    """One MPI job: ``predict:FILE`` writes every plan with its prediction, ``run:FILE`` runs
    the plans ``--plans`` of FILE and appends their measurements to FILE.rows."""
    import torch
    from mpi4py import MPI

    from bench.harness import abort_on_error
    from bench.tp import train_gpt_module
    from collectives import plan as planner
    from collectives.plan import measure
    world = MPI.COMM_WORLD
    abort_on_error(world)
    measure.steady_allocator()
    torch.set_num_threads(1)
    ex = train_gpt_module()
    rank0 = world.Get_rank() == 0
    kind, _, path = args.job.partition(":")
    base = _flags(args)
    if kind == "predict":
        shape = ex.shape(ex.parser().parse_args(base))
        ranks_per_node, cores = ex.node_layout(world)
        net = planner.calibrated(ranks_per_node=ranks_per_node)
        t0 = time.perf_counter()
        plans = planner.search(shape, world.Get_size(), args.batch, None, ranks_per_node, net,
                               ex.measured_compute(), top=None, runnable=True,
                               microbatches=args.microbatches)
        took = time.perf_counter() - t0
        if rank0:
            cost = _recompute_cost(ex, shape, args.batch // world.Get_size())
            with open(path, "w") as f:
                json.dump({"shape": shape.__dict__, "cores": cores, "seconds": took,
                           "plans": [q.to_dict() | {"name": q.name(), "args": q.args()}
                                     for q in plans], "recompute": cost}, f)
        return 0
    with open(path) as f:
        plans = json.load(f)["plans"]
    text = ex.corpus(1 << 20)
    for i in (int(x) for x in args.plans.split(",")):
        run_args = ex.parser().parse_args(base + plans[i]["args"])
        ex.warm_up(run_args, world, text)
        s = ex.run(run_args, world, text)
        if rank0:
            with open(path + ".rows", "a") as f:
                f.write(json.dumps({"i": i, "peak_bytes": s["peak_bytes"],
                                    "step_s": s["step_ms"] / 1e3, "loss": s["loss"]}) + "\n")
    return 0


def _launch(args, job: str, plans: str | None = None) -> None:
    from bench.launch import mpiexec
    cmd = [mpiexec(args.mpiexec), "-n", str(args.ranks), sys.executable, "-m", "bench", "plan",
           "--job", job] + _flags(args) + ["--microbatches", str(args.microbatches)]
    if plans:
        cmd += ["--plans", plans]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}")


def _quartiles(xs):
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def main(argv=None) -> int:
    """``python -m bench plan [options]``."""
    args = _parser().parse_args(argv)
    if args.job:
        return _job(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plans.json")
        _launch(args, f"predict:{path}")
        with open(path) as f:
            predicted = json.load(f)
        plans = [q for q in predicted["plans"]
                 if args.only is None or re.search(args.only, q["name"])][:args.limit]
        with open(path, "w") as f:   # the jobs read the plans they run by index
            json.dump(dict(predicted, plans=plans), f)
        shape = predicted["shape"]
        print(f"# bench plan: {len(plans)} plans of a GPT (dim {shape['dim']}, "
              f"{shape['layers']} layers, {shape['heads']} heads, seq {shape['seq']}, "
              f"{shape['attention']} attention, batch {args.batch}) on {args.ranks} ranks "
              f"({predicted['cores']} cores); predicted in {predicted['seconds']:.1f} s; "
              f"{args.rounds} rounds of {args.steps} steps", flush=True)
        k = max(1, args.batch_plans)
        batches = [list(range(i, min(i + k, len(plans)))) for i in range(0, len(plans), k)]
        for r in range(args.rounds):
            shift = (r * len(batches)) // max(args.rounds, 1)
            for batch in batches[shift:] + batches[:shift]:
                _launch(args, f"run:{path}", ",".join(map(str, batch)))
            print(f"# round {r + 1} done", flush=True)
        memory = [[] for _ in plans]
        steps = [[] for _ in plans]
        losses = [None] * len(plans)
        with open(path + ".rows") as f:
            for line in f:
                row = json.loads(line)
                memory[row["i"]].append(row["peak_bytes"])
                steps[row["i"]].append(row["step_s"])
                losses[row["i"]] = row["loss"]
    rows = []
    for q, mem, st, loss in zip(plans, memory, steps, losses):
        m_mem, m_step = statistics.median(mem), statistics.median(st)
        rows.append({"plan": q["name"], "predicted_bytes": q["memory"], "measured_bytes": m_mem,
                     "memory_ratio": q["memory"] / m_mem, "predicted_s": q["step_time"],
                     "measured_s": m_step, "step_ratio": q["step_time"] / m_step,
                     "step_spread": _quartiles(st), "loss": loss, "measured_bytes_rounds": mem,
                     "measured_s_rounds": st})
    print("| plan | predicted MiB | measured MiB | pred/meas | predicted ms | measured ms "
          "| spread | pred/meas |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['plan']} | {row['predicted_bytes'] / 2**20:.1f} | "
              f"{row['measured_bytes'] / 2**20:.1f} | {row['memory_ratio']:.3f} | "
              f"{row['predicted_s'] * 1e3:.1f} | {row['measured_s'] * 1e3:.1f} | "
              f"{row['step_spread']:.0%} | {row['step_ratio']:.2f} |")
    mem_err = [abs(r["memory_ratio"] - 1) for r in rows]
    step_err = [abs(r["step_ratio"] - 1) for r in rows]
    first = rows[0]   # the planner's ranking: plans come fastest predicted first
    fastest = min(rows, key=lambda r: r["measured_s"])
    print(f"\nmemory: predicted / measured {min(r['memory_ratio'] for r in rows):.3f} to "
          f"{max(r['memory_ratio'] for r in rows):.3f}, within 10% for "
          f"{sum(e <= 0.10 for e in mem_err)} of {len(rows)}, below 95% of measured for "
          f"{sum(r['memory_ratio'] < 0.95 for r in rows)}")
    print(f"step time: |error| median {statistics.median(step_err):.0%}, worst "
          f"{max(step_err):.0%}")
    print(f"first choice {first['plan']}: measured {first['measured_s'] * 1e3:.1f} ms; fastest "
          f"measured {fastest['plan']}: {fastest['measured_s'] * 1e3:.1f} ms "
          f"({first['measured_s'] / fastest['measured_s'] - 1:+.0%})")
    cost = predicted["recompute"]
    rows_per = args.batch // args.ranks
    print(f"\nrecompute, one block of {rows_per} sequences (one rank, alone): what autograd "
          f"keeps, forward + backward")
    print("| recompute | saved bytes | of none | forward + backward ms | time vs none |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for pol, (saved, secs) in cost.items():
        print(f"| {pol} | {saved} | {saved / cost['none'][0]:.3f} | {secs * 1e3:.2f} | "
              f"{secs / cost['none'][1] - 1:+.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "ranks": args.ranks, "rows": rows, "recompute": cost},
                      f, indent=1)
    return 0


def _recompute_cost(ex, shape, rows: int, repeats: int = 9) -> dict:
    """Per recompute policy: (bytes autograd keeps for one block on ``rows`` sequences, the
    median forward + backward seconds)."""
    import torch

    from collectives.torch import checkpoint
    out = {}
    for pol in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = ex.GPT(shape.vocab, shape.dim, shape.heads, 1, shape.attention)
        if pol != "none":
            checkpoint.recompute(model, checkpoint.GPT_POLICIES[pol])
        block = model.blocks[0]
        x = torch.randn(rows, shape.seq, shape.dim, requires_grad=True)
        saved, _ = checkpoint.saved_bytes(lambda: block(x))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            block(x).square().mean().backward()
            times.append(time.perf_counter() - t0)
        out[pol] = (saved, statistics.median(times[1:]))
    return out
