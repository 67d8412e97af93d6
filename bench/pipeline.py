"""``mpiexec -n P python -m bench pipeline``: pipeline schedules measured beside their prediction.

For every schedule and micro-batch count, the toolkit's ``pp.Pipeline`` runs P stages (P = the
job's ranks; ``interleaved`` with v = 2 chunks per rank) and the table shows, per row: the
measured step time (median over ``--steps``), the measured bubble (1 - the time the ranks
spent computing / (P x step)), the peak activations the first rank held (counted on the
runner's graphs), and beside them ``pp.simulate``'s step, bubble and peak for the same stages;
``meas/sim`` is their ratio. Torch's own ``torch.distributed.pipelining`` schedules (GPipe,
1F1B) run the same stages over gloo and over the toolkit's backend (rows ``torch-*``).

``--compute F,B`` fixes each stage's forward at F ms and its backward at B ms with sleeps (half
for the input's gradient, half for the weights'; the batch requires a gradient, so the first
stage does both halves too), so the comparison does not depend on the machine's cores; without
it the stages are MLP blocks of ``--width``. The bubble columns are the busiest rank's idle
share of the step, ``1 - max(busy) / step``, measured and simulated alike.
"""
from __future__ import annotations

import argparse
import statistics
import time

__all__ = ["main"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
TORCH = {"torch-gpipe": "ScheduleGPipe", "torch-1f1b": "Schedule1F1B"}


def _stage_factory(compute, width, busy):
    """A stage module: sleeps (``compute`` = (forward s, backward s)) or an MLP block."""
    import torch
    from torch import nn

    if compute is None:
        def make():
            return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        return make

    fwd, bwd = compute

    def nap(seconds, kind):
        t0 = time.perf_counter()
        time.sleep(seconds)
        took = time.perf_counter() - t0
        busy[0] += took
        busy[1][kind][0] += took
        busy[1][kind][1] += 1

    class _Input(torch.autograd.Function):
        """Identity on the stage's input; its backward is the input-gradient half."""
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            nap(bwd / 2, "input")
            return g

    class _Weight(torch.autograd.Function):
        """Identity on the weight; its backward is the weight-gradient half."""
        @staticmethod
        def forward(ctx, w):
            return w.view_as(w)

        @staticmethod
        def backward(ctx, g):
            nap(bwd / 2, "weight")
            return g

    class Sleeper(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(width))

        def forward(self, x):
            nap(fwd, "forward")
            return _Input.apply(x) * _Weight.apply(self.scale)

    return Sleeper


def _reset(busy):
    busy[0] = 0.0
    busy[1] = {k: [0.0, 0] for k in ("forward", "input", "weight")}


def _measured(comm, busy, v):
    """Per-stage (forward, backward-input, weight) seconds as this run's sleeps took them:
    ``pp.simulate`` fed with measured stage times (a sleep overshoots on a loaded machine)."""
    mine = {k: (t / n if n else 0.0) for k, (t, n) in busy[1].items()}
    every = comm.allgather(mine)
    p = len(every)
    stages = range(p * v)
    return ([every[s % p]["forward"] for s in stages], [every[s % p]["input"] for s in stages],
            [every[s % p]["weight"] for s in stages])


def _ours(comm, name, p, m, v, make, args, busy):
    import torch
    from torch import nn
    from collectives.torch import pipeline as pp
    r = comm.Get_rank()
    sched = pp.schedule(name, p, m, v)
    torch.manual_seed(0)
    stages = [make() for _ in range(p * v)]
    runner = pp.Pipeline([stages[s] for s in sched.local_stages(r)], comm=comm, schedule=sched,
                         loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    x.requires_grad_(args.compute is not None)
    times, busies = [], []
    for k in range(args.warmup + args.steps):
        comm.Barrier()
        _reset(busy)
        t0 = time.perf_counter()
        runner.step(x, y)
        dt = time.perf_counter() - t0
        if k >= args.warmup:
            times.append(dt)
            busies.append(busy[0])
    return sched, times, busies, runner.peak


def _torch(comm, group, cls, p, m, make, args, busy):
    import torch
    from torch import nn
    from torch.distributed import pipelining
    r = comm.Get_rank()
    torch.manual_seed(0)
    stages = [make() for _ in range(p)]
    stage = pipelining.PipelineStage(stages[r], r, p, torch.device("cpu"), group=group)
    sched = getattr(pipelining, cls)(stage, m, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    x.requires_grad_(args.compute is not None)
    times, busies = [], []
    for k in range(args.warmup + args.steps):
        comm.Barrier()
        _reset(busy)
        t0 = time.perf_counter()
        if r == 0:
            sched.step(x)
        elif r == p - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        dt = time.perf_counter() - t0
        if k >= args.warmup:
            times.append(dt)
            busies.append(busy[0])
    return times, busies


def _row(comm, label, m, times, busies, sim, peak):
    """One line of the table on rank 0: the slowest rank's median step."""
    step = comm.allreduce(statistics.median(times), op=_max())
    busy = comm.allreduce(statistics.median(busies), op=_max())
    peak0 = comm.bcast(peak, root=0)
    if comm.Get_rank():
        return None
    bubble = 1 - busy / step if busy else float("nan")
    cols = [f"{label:<16}", f"{m:>3}", f"{step * 1e3:>9.1f}", f"{bubble:>7.3f}",
            f"{peak0 if peak0 is not None else '-':>5}"]
    if sim is not None:
        cols += [f"{sim.step * 1e3:>9.1f}", f"{1 - max(sim.busy) / sim.step:>7.3f}",
                 f"{sim.peak[0]:>5}",
                 f"{step / sim.step:>8.3f}"]
    line = " ".join(cols)
    print(line, flush=True)
    return {"schedule": label, "m": m, "step_ms": step * 1e3, "bubble": bubble, "peak": peak0,
            "sim_step_ms": sim.step * 1e3 if sim else None,
            "sim_bubble": 1 - max(sim.busy) / sim.step if sim else None}


def _max():
    from mpi4py import MPI
    return MPI.MAX


def _draw(args) -> int:
    """The timelines of ``--draw P``: every schedule of ``--schedules`` that is the toolkit's,
    a rank's v chunks taking 1/v of its time each (on rank 0 only under mpiexec)."""
    import os
    from collectives.torch import pipeline as pp
    if os.environ.get("PMI_RANK", "0") != "0":
        return 0
    m = int(args.microbatches.split(",")[0])
    for name in args.schedules.split(","):
        if name not in SCHEDULES:
            continue
        v = args.virtual if name == "interleaved" else 1
        sim = pp.simulate(pp.schedule(name, args.draw, m, v), 1 / v, 1 / v, 1 / v)
        print(f"{name} (p = {args.draw}, m = {m}, v = {v}): step {sim.step:g}, bubble "
              f"{sim.bubble:.3f}, peak {sim.peak}")
        print(sim.draw())
    return 0


def main(argv=None) -> int:
    """Run the sweep and print the table (on rank 0)."""
    p = argparse.ArgumentParser(prog="python -m bench pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--schedules", default=",".join(SCHEDULES + tuple(TORCH)),
                   help="comma-separated: " + ", ".join(SCHEDULES + tuple(TORCH)))
    p.add_argument("--microbatches", default="2,4,8", help="comma-separated m (2,4,8)")
    p.add_argument("--virtual", type=int, default=2, help="chunks per rank for interleaved (2)")
    p.add_argument("--compute", default=None,
                   help="F,B: each stage's forward and backward in ms, as sleeps (e.g. 10,20)")
    p.add_argument("--width", type=int, default=256, help="activation width (256)")
    p.add_argument("--batch", type=int, default=64, help="rows per step (64)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row (5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row (2)")
    p.add_argument("--torch-backends", default="gloo,collectives",
                   help="process groups for the torch-* rows (gloo,collectives)")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.add_argument("--draw", type=int, default=None, metavar="P",
                   help="only print pp.simulate's timeline of each schedule at P stages and "
                        "the first --microbatches (F = B = W = 1 per rank), no measurement")
    args = p.parse_args(argv)
    if args.draw is not None:
        return _draw(args)
    if args.compute is not None:
        f, b = (float(v) / 1e3 for v in args.compute.split(","))
        args.compute = (f, b)
    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCHEDULES and s not in TORCH]
    if unknown:
        raise SystemExit(f"unknown schedule(s) {unknown}; expected some of "
                         f"{', '.join(SCHEDULES + tuple(TORCH))}")
    ms = [int(v) for v in args.microbatches.split(",")]

    import torch
    from mpi4py import MPI
    from collectives.torch import pipeline as pp
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    busy = [0.0, {}]
    _reset(busy)
    groups = {}
    if any(n in TORCH for n in names):
        import torch.distributed as dist
        import collectives.torch.backend as cb
        cb.init_process_group()
        for backend in args.torch_backends.split(","):
            groups[backend] = dist.new_group(backend=backend) if backend == "gloo" \
                else dist.group.WORLD
    if comm.Get_rank() == 0:
        what = (f"--compute {args.compute[0] * 1e3:g},{args.compute[1] * 1e3:g} ms"
                if args.compute else f"MLP blocks of width {args.width}")
        print(f"# pipeline: {P} ranks, batch {args.batch}, {what}; median of {args.steps} steps")
        print(f"# {'schedule':<14} {'m':>3} {'step_ms':>9} {'bubble':>7} {'peak':>5} "
              f"{'sim_ms':>9} {'sim_bub':>7} {'speak':>5} {'meas/sim':>8}")
    rows = []
    for m in ms:
        p2p = pp.p2p_time(4 * args.width * -(-args.batch // m))
        for name in names:
            v = args.virtual if name == "interleaved" else 1
            # each of a rank's v chunks does 1/v of its work
            make = _stage_factory(args.compute and tuple(t / v for t in args.compute),
                                  args.width, busy)
            if name in TORCH:
                if m < P:   # torch's schedules refuse fewer micro-batches than stages
                    continue
                for backend, group in groups.items():
                    times, busies = _torch(comm, group, TORCH[name], P, m, make, args, busy)
                    sim = None
                    if args.compute is not None:
                        sim = pp.simulate(pp.schedule(name[6:], P, m), *_measured(comm, busy, 1),
                                          p2p=p2p)
                    rows.append(_row(comm, f"{name}/{backend}", m, times, busies, sim, None))
                continue
            try:
                pp.schedule(name, P, m, v)
            except ValueError:
                continue
            sched, times, busies, peak = _ours(comm, name, P, m, v, make, args, busy)
            sim = None
            if args.compute is not None:
                sim = pp.simulate(sched, *_measured(comm, busy, v), p2p=p2p)
            rows.append(_row(comm, name if v == 1 else f"{name}(v={v})", m, times, busies,
                             sim, peak))
    if args.json and comm.Get_rank() == 0:
        import json
        with open(args.json, "w") as fh:
            json.dump([r for r in rows if r], fh, indent=1)
    if groups:
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0
