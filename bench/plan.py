"""The planner against measurement: every plan of examples/train_gpt.py's GPT on the job's ranks.

    mpiexec -n 4 python -m bench plan                       # every plan, 3 interleaved rounds
    mpiexec -n 4 python -m bench plan --rounds 5 --json plan.json

``collectives.plan.search`` lists every plan the example runs on n ranks (dp x tp x pp,
sequence parallelism, pipeline schedules at ``--microbatches``, ZeRO stage, recompute), each with
its predicted peak memory per rank and step time; the compute is measured once
(``train_gpt.measured_compute``: one block at each micro-batch size and tensor-parallel share)
on every rank at once, so that it runs on the cores as shared as in training. Then
every plan is trained for ``--steps`` steps in the same job, in ``--rounds`` rounds that each
run the plans in a rotated order, so that load from other jobs falls on all of them alike.

Measured, per plan and round, by the processes themselves: the peak memory, the most any rank's
resident set rose (``VmHWM`` after a reset through ``/proc/self/clear_refs``) above what it held
before the plan's mesh and model were built, with glibc's mmap threshold fixed so that freed
tensors leave the resident set (``collectives.plan.measure``); two steps of a tiny model of the
same plan run first (``train_gpt.warm_up``) so that code and first-use allocations are in the
baseline;
the step time, the median over the steps after the first of the slowest rank's step. The table
shows the medians over the rounds, the ratios predicted / measured, and the rounds' spread of
the step (interquartile range over the median); the summary the error statistics and the
planner's first choice against the fastest plan measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

__all__ = ["main"]


def _parser():
    p = argparse.ArgumentParser(prog="python -m bench plan", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per step, global (16)")
    p.add_argument("--vocab", type=int, default=264)
    p.add_argument("--attention", choices=("sdpa", "math"), default="math")
    p.add_argument("--microbatches", type=int, default=4, help="a pipeline's micro-batches (4)")
    p.add_argument("--steps", type=int, default=4, help="steps per plan and round (4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--limit", type=int, default=None, help="the first N plans only")
    p.add_argument("--json", default=None, help="write every row as JSON")
    return p


def _quartiles(xs):
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def main(argv=None) -> int:
    """``mpiexec -n N python -m bench plan [options]``."""
    args = _parser().parse_args(argv)
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
    n, rank0 = world.Get_size(), world.Get_rank() == 0
    base = ["--dim", str(args.dim), "--heads", str(args.heads), "--layers", str(args.layers),
            "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
            "--attention", args.attention, "--steps", str(args.steps)]
    shape = ex.shape(ex.parser().parse_args(base))
    ranks_per_node, cores = ex.node_layout(world)

    # 1. Every plan, predicted; every rank measures the compute at once (the cores shared as
    #    in training), rank 0's predictions are every rank's.
    net = planner.calibrated(ranks_per_node=ranks_per_node)
    t0 = time.perf_counter()
    plans = planner.search(shape, n, args.batch, None, ranks_per_node, net,
                           ex.measured_compute(), top=None, runnable=True,
                           microbatches=args.microbatches)
    took = time.perf_counter() - t0
    plans = world.bcast(plans, root=0)[:args.limit]
    if rank0:
        print(f"# bench plan: {len(plans)} plans of a {shape.params() / 1e6:.2f}M-parameter GPT "
              f"(dim {shape.dim}, {shape.layers} layers, {shape.heads} heads, seq {shape.seq}, "
              f"{shape.attention} attention, batch {args.batch}) on {n} ranks "
              f"({cores} cores); predicted in {took:.1f} s; {args.rounds} rounds of "
              f"{args.steps} steps", flush=True)
    text = ex.corpus(1 << 20)

    # 2. A tiny model of every plan first: code and first-use allocations into the baseline.
    warm = [ex.parser().parse_args(base + q.args()) for q in plans]

    # 3. Interleaved rounds.
    memory = [[] for _ in plans]
    steps = [[] for _ in plans]
    losses = [None] * len(plans)
    for r in range(args.rounds):
        order = list(range(len(plans)))
        shift = (r * len(plans)) // max(args.rounds, 1)
        order = order[shift:] + order[:shift]
        for i in order:
            ex.warm_up(warm[i], world, text)
            s = ex.run(warm[i], world, text)
            memory[i].append(s["peak_bytes"])
            steps[i].append(s["step_ms"] / 1e3)
            losses[i] = s["loss"]
        if rank0:
            print(f"# round {r + 1} done", flush=True)

    if not rank0:
        return 0
    rows = []
    for q, mem, st, loss in zip(plans, memory, steps, losses):
        m_mem, m_step = statistics.median(mem), statistics.median(st)
        rows.append({"plan": q.name(), "predicted_bytes": q.memory, "measured_bytes": m_mem,
                     "memory_ratio": q.memory / m_mem, "predicted_s": q.step_time,
                     "measured_s": m_step, "step_ratio": q.step_time / m_step,
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
    cost = _recompute_cost(ex, shape, args.batch // n)
    print(f"\nrecompute, one block of {args.batch // n} sequences (one rank, alone): what "
          f"autograd keeps, forward + backward")
    print("| recompute | saved bytes | of none | forward + backward ms | time vs none |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for pol, (saved, secs) in cost.items():
        print(f"| {pol} | {saved} | {saved / cost['none'][0]:.3f} | {secs * 1e3:.2f} | "
              f"{secs / cost['none'][1] - 1:+.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape.__dict__, "ranks": n, "cores": cores, "rows": rows,
                       "recompute": cost}, f, indent=1)
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
