"""ZeRO step time and memory: ShardedDataParallel stages 1-3 against our DDP, in one run.

    mpiexec -n 2 python -m bench zero                  # via the bench dispatcher
    mpiexec -n 2 python -m bench.zero --rounds 4 --steps 3

The model is ``bench ddp``'s MLP (about 25M parameters, batch 32 per rank, one torch thread per
rank), trained with fp32 AdamW. Every variant (``ddp``: ``collectives.torch.
DistributedDataParallel``; ``z1``, ``z2``, ``z3``: ``ShardedDataParallel`` at that stage) is
built once and stepped in interleaved rounds, so load from other jobs hits them alike. A step
(``zero_grad``, forward, backward, ``step``) is timed as the slowest rank's; the table shows the
median per variant and its ratio to ``ddp``. The bytes columns are the model state per parameter
on rank 0 after a step (unique storages of parameters, gradients and AdamW's moments, from
``memory_report``; DDP's counted the same way) against ZeRO's formula: 16, 8 + 8/N, 4 + 12/N,
16/N. ``peak RSS`` is the process's high-water mark after all variants ran (all four models live
at once, so it bounds their sum, not one variant).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

__all__ = ["main", "formula", "VARIANTS"]

VARIANTS = ("ddp", "z1", "z2", "z3")


def formula(variant: str, n: int) -> float:
    """ZeRO's model-state bytes per parameter (fp32, Adam) for ``variant`` at ``n`` ranks."""
    return {"ddp": 16.0, "z1": 8 + 8 / n, "z2": 4 + 12 / n, "z3": 16 / n}[variant]


def _state_bytes(model, opt, params) -> int:
    seen, total = set(), 0
    tensors = [p for p in params] + [p.grad for p in params]
    tensors += [v for st in opt.state.values() for v in st.values()]
    for t in tensors:
        if t is None or t.dim() == 0:
            continue
        st = t.untyped_storage()
        if st.nbytes() and (st.data_ptr(), st.nbytes()) not in seen:
            seen.add((st.data_ptr(), st.nbytes()))
            total += st.nbytes()
    return total


def main(argv=None) -> int:
    """Run the comparison and print the table on rank 0."""
    p = argparse.ArgumentParser(prog="python -m bench zero", description=__doc__.split("\n")[0])
    p.add_argument("--params-m", type=float, default=25.0, help="model size, millions (25)")
    p.add_argument("--batch", type=int, default=32, help="batch per rank (32)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (3)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    args = p.parse_args(argv)
    import torch
    from mpi4py import MPI

    from bench.ddp import mlp
    from collectives.torch import DistributedDataParallel, ShardedDataParallel
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    runs = {}
    for v in names:
        torch.manual_seed(0)
        net = mlp(args.params_m)
        model = (DistributedDataParallel(net) if v == "ddp"
                 else ShardedDataParallel(net, stage=int(v[1])))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[v] = (model, opt, list(net.parameters()) if v == "ddp" else None, [])
    x = torch.randn(args.batch, 1024)
    y = torch.randn(args.batch, 1024)

    def step(model, opt):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for v in names:  # warm-up: buckets, optimizer state
        step(*runs[v][:2])
    for _ in range(args.rounds):
        for v in names:
            model, opt, _, times = runs[v]
            for _ in range(args.steps):
                comm.Barrier()
                t0 = time.perf_counter()
                step(model, opt)
                times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    rows = []
    for v in names:
        model, opt, params, times = runs[v]
        if v == "ddp":
            numel = sum(q.numel() for q in params)
            per = _state_bytes(model, opt, params) / numel
        else:
            per = model.memory_report(opt)["bytes_per_parameter"]
        rows.append((v, statistics.median(times), per))
    peak = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX)
    if comm.Get_rank() == 0:
        base = dict((v, t) for v, t, _ in rows).get("ddp")
        print(f"# bench zero: n={n}, {args.params_m:g}M-parameter MLP, batch {args.batch}/rank, "
              f"AdamW fp32, {args.rounds} rounds x {args.steps} steps, medians")
        print(f"{'variant':<8} {'step ms':>9} {'x ddp':>7} {'B/param':>8} {'formula':>8} "
              f"{'off':>7}")
        for v, t, per in rows:
            ratio = f"{t / base:.2f}" if base else "-"
            want = formula(v, n)
            print(f"{v:<8} {t * 1e3:9.1f} {ratio:>7} {per:8.3f} {want:8.3f} "
                  f"{(per - want) / want:+7.1%}")
        print(f"peak RSS (max over ranks, all variants live): {peak / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
