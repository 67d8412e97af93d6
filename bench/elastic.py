"""What elastic training costs a step: the in-memory commit and the asynchronous checkpoint,
against the same training without them, in interleaved rounds of one job.

    mpiexec -n 4 python -m bench elastic
    mpiexec -n 4 python -m bench elastic --params-m 5 --every 5,25 --rounds 6

The model is ``bench ddp``'s MLP (``--params-m`` million parameters, batch 32 per rank, one
torch thread per rank) under ``collectives.torch.DistributedDataParallel``, with SGD and
momentum. Variants, each stepped ``--steps`` steps a round, in an order that rotates from round
to round so that load from other jobs hits them alike:

- ``plain``: the training step alone;
- ``commit``: ``state.commit()`` after every step (the ULFM path: a copy of the model's and the
  optimizer's state in memory, what a survivor goes back to);
- ``checkpoint K``: the restart path at interval K (``elastic.checkpoint.Checkpointer(every=K)``,
  a commit every K steps handed to the writer thread, which writes this rank's shard to disk).

A round's time per step is its wall time over its steps, the wait for the checkpoint still
being written at its end included (a median of steps would hide the one step in K that hands a
checkpoint over); a checkpoint round's commits fall half an interval in from its ends, so that
its last write has the steps after it to overlap, as in a run that goes on. The table gives each variant's median over rounds, its ratio to ``plain`` in
the same round (median, and the smallest and largest), and the training loop's own part per
checkpoint (``Checkpointer.mean_seconds``). ``--steps`` is rounded up to a multiple of every K,
so that every round writes as many checkpoints.
"""
from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time

__all__ = ["main"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench elastic",
                                description=__doc__.split("\n")[0])
    p.add_argument("--params-m", type=float, default=5.0, help="model size, millions (5)")
    p.add_argument("--batch", type=int, default=32, help="batch per rank (32)")
    p.add_argument("--every", default="5,25", help="checkpoint intervals K, comma-separated")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (6)")
    p.add_argument("--steps", type=int, default=25,
                   help="steps per variant per round (25; rounded up to a multiple of each K)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary "
                                               "directory, removed at the end)")
    args = p.parse_args(argv)
    every = [int(k) for k in args.every.split(",") if k]
    if not every or min(every) < 1 or args.rounds < 1 or args.steps < 1:
        p.error("--every, --rounds and --steps must be positive")
    steps = math.lcm(*every) * math.ceil(args.steps / math.lcm(*every))

    import torch
    from mpi4py import MPI

    from bench.ddp import mlp
    from collectives import elastic
    from collectives.elastic import checkpoint
    from collectives.torch import DistributedDataParallel

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module, dim = mlp(args.params_m), 1024     # bench ddp's MLP: 1024 in and out
    model = DistributedDataParallel(module, comm=comm)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(args.batch, dim)
    y = torch.randn(args.batch, dim)
    state = elastic.State(model=model, optimizer=opt, step=0)
    root = args.dir or (tempfile.mkdtemp(prefix="bench-elastic-") if rank == 0 else None)
    root = comm.bcast(root, root=0)

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    writers = {}

    def run(variant) -> float:
        """One round of ``variant``: seconds per step (the writer's wait at the end too)."""
        ckpt = writers.get(variant)
        if ckpt is not None:
            state.listeners[:] = [ckpt.on_commit]
            # the round's checkpoints half an interval in from its ends: its last write
            # overlaps the steps after it, as in a run that goes on
            state.step += (-(state.step + ckpt.every // 2)) % ckpt.every
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
            if variant == "commit" or (ckpt is not None and (state.step + 1) % ckpt.every == 0):
                state.commit()       # step state.step is done: the next is state.step + 1
            state.step += 1
        if ckpt is not None:
            ckpt.close()             # the checkpoint in flight is this round's
        seconds = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        state.listeners[:] = []
        return seconds / steps

    variants = ["plain", "commit"] + [f"checkpoint {k}" for k in every]
    for k in every:
        writers[f"checkpoint {k}"] = checkpoint.Checkpointer(f"{root}/every-{k}", every=k,
                                                             comm=comm)
    for _ in range(3):               # warm up: buckets settled, allocator grown
        step()
    times = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            times[v].append(run(v))
    loop_ms = {v: comm.allreduce(w.mean_seconds(), op=MPI.MAX) * 1e3
               for v, w in writers.items()}
    written = {v: w.written for v, w in writers.items()}
    comm.Barrier()
    if rank == 0:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        n_params = sum(t.numel() for t in module.parameters())
        print(f"# elastic training's cost: {n_params / 1e6:.1f}M-parameter MLP, SGD with "
              f"momentum, batch {args.batch} per rank, {size} ranks, {steps} steps a variant "
              f"in each of {args.rounds} interleaved rounds")
        print(f"# {'variant':<16} {'ms/step':>9} {'vs plain':>9} {'min-max':>13} "
              f"{'loop ms/ckpt':>13} {'written':>8}")
        plain = times["plain"]
        for v in variants:
            ratios = [a / b for a, b in zip(times[v], plain)]
            extra = (f"{loop_ms[v]:13.2f} {written[v]:8d}" if v in writers
                     else f"{'-':>13} {'-':>8}")
            print(f"  {v:<16} {statistics.median(times[v]) * 1e3:9.2f} "
                  f"{statistics.median(ratios):9.3f} "
                  f"{min(ratios):6.3f}-{max(ratios):.3f} {extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
