"""torch's FSDP2 (``fully_shard``) step time on the ``collectives`` backend against gloo.

    python -m bench fsdp                         # 3 pairs of jobs, n = 2 each; prints the table
    python -m bench fsdp --pairs 5 --ranks 3     # more pairs, another rank count

A *job* is one ``mpiexec -n N python -m bench fsdp --backend B`` with one backend for its whole
life, as a training job has: 8 layers ``Linear(1024, 1024)`` + ReLU, each layer and then the
whole model wrapped with ``fully_shard`` on a CPU device mesh, AdamW, batch 16 per rank, one
torch thread per rank. After ``--warmup`` untimed steps it times ``--rounds`` rounds of
``--steps`` steps (a round's time per step is the slowest rank's mean over its steps, each
round starting after a barrier) and writes them, with rank 0's full parameters, to a file.

The parent (``python -m bench fsdp`` without ``--backend``, run outside mpiexec) launches the
jobs one after another as subprocesses, in pairs (gloo then the backend, the order alternating
from pair to pair so that a drift in the machine's load hits both alike), and prints per job
the rounds, their median and slowest/fastest ratio, per pair the ratio of the medians, and
whether the backend's parameters after the run are bitwise gloo's (same seed, same data, same
steps).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.launch import mpiexec

__all__ = ["main", "model", "BACKENDS"]

BACKENDS = ("gloo", "collectives")


def model(layers: int = 8, width: int = 1024):
    """``layers`` x (``Linear(width, width)``, ReLU), seeded."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def _parser():
    p = argparse.ArgumentParser(prog="python -m bench fsdp", description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="pairs of jobs (gloo, ours) (3)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per job (2)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per job (5)")
    p.add_argument("--steps", type=int, default=3, help="steps per round (3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the rounds (3)")
    p.add_argument("--layers", type=int, default=8, help="Linear layers (8)")
    p.add_argument("--width", type=int, default=1024, help="their width (1024)")
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step (16)")
    p.add_argument("--mpiexec", default=None,
                   help="launcher (default: the mpiexec beside this Python, else on PATH)")
    p.add_argument("--json", metavar="PATH", help="also write every job's rounds as JSON")
    p.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)  # a job (under mpiexec)
    p.add_argument("--out", help=argparse.SUPPRESS)                        # the job's result file
    return p


# -- one job -------------------------------------------------------------------------------------
def _job(args) -> int:
    """One job under mpiexec on ``args.backend``: time the rounds, write the result file."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn

    import collectives.torch.backend as cb
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if args.backend == "collectives":
        cb.init_process_group()
    else:  # gloo meets through the same kind of store (rank 0 serves it, port shared by MPI)
        dist.init_process_group("gloo", store=cb.tcp_store(comm), rank=rank,
                                world_size=comm.Get_size())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    net = model(args.layers, args.width)
    mesh = init_device_mesh("cpu", (comm.Get_size(),))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + rank)

    def step():
        x = torch.randn(args.batch, args.width, generator=gen)
        y = torch.randn(args.batch, args.width, generator=gen)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    rounds, cpu = [], []
    for _ in range(args.rounds):
        comm.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        dt = (time.perf_counter() - t0) / args.steps
        rounds.append(comm.allreduce(dt, op=MPI.MAX))
        cpu.append(comm.allreduce((time.process_time() - c0) / args.steps, op=MPI.MAX))
    full = [q.full_tensor().detach().clone() for q in net.parameters()]
    if rank == 0:
        torch.save(full, args.out + ".pt")
        with open(args.out, "w") as f:
            json.dump({"backend": args.backend, "ranks": comm.Get_size(), "rounds_s": rounds,
                       "cpu_s": cpu}, f)
    dist.destroy_process_group()
    comm.Barrier()  # rank 0 serves the store: nobody may still be tearing down when it exits
    return 0


# -- the parent ----------------------------------------------------------------------------------
def _run_job(args, backend: str, out: str) -> dict:
    cmd = [mpiexec(args.mpiexec), "-n", str(args.ranks), sys.executable, "-m", "bench.fsdp",
           "--backend", backend, "--out", out]
    for name in ("rounds", "steps", "warmup", "layers", "width", "batch"):
        cmd += [f"--{name}", str(getattr(args, name))]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"job on {backend} failed (exit {done.returncode}): {' '.join(cmd)}\n"
                         f"{done.stdout[-4000:]}")
    with open(out) as f:
        return json.load(f)


def _same(a: str, b: str) -> str:
    """Whether two jobs' parameters are bitwise equal; else their largest difference."""
    import torch
    x, y = torch.load(a + ".pt"), torch.load(b + ".pt")
    if all(torch.equal(p, q) for p, q in zip(x, y)):
        return "bitwise equal"
    return f"differ by up to {max(float((p - q).abs().max()) for p, q in zip(x, y)):.3g}"


def _parent(args) -> int:
    tmp = tempfile.mkdtemp(prefix="bench-fsdp-")
    jobs = []
    print(f"# FSDP2 step: {args.layers} x Linear({args.width}, {args.width}) + ReLU, "
          f"fully_shard per layer and on the model, AdamW, batch {args.batch} per rank, "
          f"{args.ranks} ranks, 1 torch thread per rank; one backend per job, {args.pairs} "
          f"pairs of jobs, the order alternating")
    print(f"# a job: {args.warmup} untimed steps, then {args.rounds} rounds of {args.steps} "
          f"steps; a round's ms per step is the slowest rank's mean; cpu ms: the median "
          f"round's process CPU time per step (all threads), the slowest rank's; cpu max/min: "
          f"the same over the rounds")
    print(f"# {'pair':>4} {'backend':<12} {'median ms':>9} {'max/min':>8} {'vs gloo':>8} "
          f"{'cpu ms':>7} {'cpu max/min':>11}  rounds (ms per step)", flush=True)
    try:
        for pair in range(args.pairs):
            order = BACKENDS if pair % 2 == 0 else BACKENDS[::-1]
            res = {}
            for backend in order:
                out = os.path.join(tmp, f"{pair}-{backend}.json")
                res[backend] = _run_job(args, backend, out)
                res[backend]["file"] = out
            med = {b: statistics.median(r["rounds_s"]) for b, r in res.items()}
            for b in BACKENDS:
                rounds = res[b]["rounds_s"]
                ratio = f"{med[b] / med['gloo']:.2f}x"
                cpus = res[b]["cpu_s"]
                print(f"  {pair:>4} {b:<12} {1e3 * med[b]:>9.1f} "
                      f"{max(rounds) / min(rounds):>7.2f}x {ratio:>8} "
                      f"{1e3 * statistics.median(cpus):>7.1f} {max(cpus) / min(cpus):>10.2f}x  "
                      + " ".join(f"{1e3 * t:.0f}" for t in rounds))
            same = _same(res["collectives"]["file"], res["gloo"]["file"])
            print(f"# pair {pair}: parameters after the run, collectives vs gloo: {same}",
                  flush=True)
            jobs.append({"pair": pair, "order": list(order), "parameters": same,
                         **{b: res[b]["rounds_s"] for b in BACKENDS},
                         **{f"{b}_cpu": res[b]["cpu_s"] for b in BACKENDS}})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meds = {b: [statistics.median(j[b]) for j in jobs] for b in BACKENDS}
    ratios = sorted(c / g for c, g in zip(meds["collectives"], meds["gloo"]))
    spread = {b: max(max(j[b]) / min(j[b]) for j in jobs) for b in BACKENDS}
    print(f"# collectives / gloo, median step: {statistics.median(ratios):.2f} (pairs: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}); slowest/fastest round within a job, "
          f"at most: gloo {spread['gloo']:.2f}x, collectives {spread['collectives']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "layers": args.layers, "width": args.width,
                       "batch": args.batch, "jobs": jobs}, f, indent=1)
    return 0


def main(argv=None) -> int:
    """``python -m bench fsdp``: the parent, or (``--backend``) one job under mpiexec."""
    args = _parser().parse_args(argv)
    return _job(args) if args.backend else _parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
