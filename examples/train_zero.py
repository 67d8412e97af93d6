"""Sharded data-parallel training (ZeRO stage 1, 2 or 3) of train_ddp.py's CNN.

    mpiexec -n 3 python examples/train_zero.py --stage 3
    mpiexec -n 3 python examples/train_zero.py --stage 1 --checkpoint /tmp/zero.pt
    mpiexec -n 2 python examples/train_zero.py --stage 2 --resume /tmp/zero.pt

The shapes data set and the CNN are train_ddp.py's. ``ShardedDataParallel`` hands AdamW this
rank's flat shards; rank 0 prints each epoch's loss and test accuracy and, after the first step,
the model state this rank holds (``memory_report``) against ZeRO's formula. ``--checkpoint``
writes the full model and consolidated optimizer state after training (one file, from rank 0);
``--resume`` loads such a file at any number of ranks and any stage before training.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")  # see train_ddp.py

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_ddp import CNN, make_shapes  # noqa: E402

from collectives.torch import ShardedDataParallel, all_reduce  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=3072, help="training images (3072)")
    p.add_argument("--batch", type=int, default=32, help="images per rank and step (32)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--width", type=int, default=32, help="CNN channels (32)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.1)
    p.add_argument("--checkpoint", help="write the full state here after training")
    p.add_argument("--resume", help="load a full state written by --checkpoint")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    images, labels = make_shapes(args.samples, seed=0)
    test_images, test_labels = make_shapes(1024, seed=1)
    torch.manual_seed(0)
    model = ShardedDataParallel(CNN(args.width), stage=args.stage, comm=comm,
                                bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.resume:
        saved = torch.load(args.resume)
        model.load_full_state_dict(saved["model"])
        model.load_full_optim_state_dict(opt, saved["optim"])
    global_batch = args.batch * size
    steps = args.samples // global_batch
    formula = {1: 8 + 8 / size, 2: 4 + 12 / size, 3: 16 / size}[args.stage]
    for epoch in range(args.epochs):
        order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(epoch))
        sums = torch.zeros(2, dtype=torch.float64)
        t0 = time.perf_counter()
        for step in range(steps):
            batch = order[step * global_batch:(step + 1) * global_batch]
            mine = batch[rank * args.batch:(rank + 1) * args.batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(images[mine]), labels[mine])
            loss.backward()
            opt.step()
            sums += torch.tensor([loss.item() * len(mine), len(mine)], dtype=torch.float64)
            if epoch == 0 and step == 0 and rank == 0:
                rep = model.memory_report(opt)
                print(f"train_zero: stage {args.stage}, {size} ranks, {rep['numel']} "
                      f"parameters; model state on rank 0: {rep['bytes_per_parameter']:.2f} "
                      f"bytes/parameter (ZeRO's formula {formula:.2f})", flush=True)
        all_reduce(sums, comm=comm)
        with torch.no_grad():
            shard = slice(rank * len(test_images) // size, (rank + 1) * len(test_images) // size)
            pred = model(test_images[shard]).argmax(1)
            correct = torch.tensor([(pred == test_labels[shard]).sum().item()],
                                   dtype=torch.float64)
        all_reduce(correct, comm=comm)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {sums[0] / sums[1]:.4f}, test accuracy "
                  f"{float(correct[0]) / len(test_images):.3f}, "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    if args.checkpoint:
        state = {"model": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}
        if rank == 0:
            torch.save(state, args.checkpoint)
        comm.Barrier()


if __name__ == "__main__":
    main()
