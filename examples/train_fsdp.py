"""torch's own FSDP2 (``fully_shard``) over the toolkit's ``torch.distributed`` backend.

    mpiexec -n 3 python examples/train_fsdp.py                   # the "collectives" backend
    mpiexec -n 3 python examples/train_fsdp.py --backend gloo    # the same job on gloo

Every linear layer of an MLP, and then the whole model, is wrapped with
``torch.distributed.fsdp.fully_shard`` on a CPU device mesh: each rank keeps a shard of every
parameter, gradient and optimizer state; FSDP2 all-gathers a layer's parameters before its
forward and backward and reduce-scatters its gradients after, through the process group, here
the toolkit's (``collectives.torch.backend.init_process_group()``). The data (a noisy linear
regression through a tanh) is made here; each step splits a global batch into one shard per
rank, so the losses are those of one process training on the whole batch, and the two backends
print the same numbers. Rank 0 prints the loss of every step and the parameter bytes each rank
holds against the whole model's.
"""
import argparse
import os

os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")  # see train_ddp.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402


def init(backend: str) -> None:
    """The default group on ``backend``, ranks from MPI."""
    import collectives.torch.backend as cb
    if backend == "collectives":
        cb.init_process_group()
    else:  # gloo's ranks meet through the same kind of store (rank 0 serves it)
        comm = MPI.COMM_WORLD
        dist.init_process_group(backend, store=cb.tcp_store(comm), rank=comm.Get_rank(),
                                world_size=comm.Get_size())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="collectives", choices=("collectives", "gloo"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(1)
    init(args.backend)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.width), nn.Tanh(),
                          nn.Linear(args.width, args.width), nn.Tanh(),
                          nn.Linear(args.width, 8))
    full_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    mesh = init_device_mesh("cpu", (ranks,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mine = sum(q.to_local().numel() * q.element_size() for q in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(32, 8, generator=g)
    for step in range(args.steps):
        x = torch.randn(ranks * args.batch, 32, generator=g)
        y = torch.tanh(x @ truth) + 0.05 * torch.randn(ranks * args.batch, 8, generator=g)
        shard = slice(rank * args.batch, (rank + 1) * args.batch)
        loss = nn.functional.mse_loss(model(x[shard]), y[shard])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step}: loss {total.item() / ranks:.6f}", flush=True)
    if rank == 0:
        print(f"{args.backend}: {ranks} ranks, parameters on this rank {mine} of {full_bytes} "
              f"bytes", flush=True)
    dist.destroy_process_group()
    # Rank 0 serves the store: it must not exit while another rank still tears down.
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
