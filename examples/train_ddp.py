"""Data-parallel training of a small CNN with ``collectives.torch.DistributedDataParallel``.

    mpiexec -n 3 python examples/train_ddp.py                     # about 10 s on 2 cores
    mpiexec -n 3 python examples/train_ddp.py --hook powersgd     # or fp16, bf16
    mpiexec -n 3 python examples/train_ddp.py --hook topk --ratio 0.01 --epochs 12
    mpiexec -n 3 python examples/train_ddp.py --hook sign --no-error-feedback --epochs 12
    mpiexec -n 2 python examples/train_ddp.py --epochs 10 --width 64 --samples 12288

The data set is made here (nothing is downloaded): 16 x 16 grayscale images of six shapes --
horizontal bar, vertical bar, diagonal, anti-diagonal, square outline, cross -- at random
positions with noise, labelled by shape. Every rank builds the same data; each global batch is
split into one shard per rank, and DDP averages the gradients, so N ranks train the same model
as one process on the whole batch. Rank 0 prints the loss of each epoch, test accuracy,
samples/s, the fraction of the gradient communication hidden behind backward, and the bytes
the comm hook put on the wire per step; with a compressing hook (``--hook fp16``, ``bf16`` or
``powersgd``, ``topk``, ``sign``, ``qsgd``: error feedback on unless ``--no-error-feedback``),
also how many times fewer than the float32 gradients. The error-feedback hooks (``topk``, ``sign``,
``qsgd``) apply ``--momentum`` themselves, before compressing, and SGD runs without it
(``--optimizer-momentum`` keeps it in SGD): see docs/torch.md, "Compression with error
feedback".

Where the ranks of a node have no core to spare (ranks x torch threads >= cores), the example
turns the progress thread off (``config.set("COLLECTIVES_PROGRESS_THREAD", "off")``) unless the
environment names a setting: DDP's gradient hooks then advance the bucket allreduces as backward
goes (see docs/torch.md, "Performance").
"""
import argparse
import os
import sys
import time

# MPICH: sleep (usleep(1)) in progress loops that find nothing to do instead of spinning, so
# a rank waiting in MPI leaves the CPU to the ranks still computing (3 ranks oversubscribe a
# 2-core machine). Set before MPI starts; other MPI libraries ignore it.
os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

import collectives as coll  # noqa: E402
from collectives import config  # noqa: E402
from collectives.progress import use_thread  # noqa: E402
from collectives.torch import (  # noqa: E402
    DistributedDataParallel,
    all_reduce,
    compression,
    hooks,
)

COMPRESSING = ("topk", "sign", "qsgd")
SHAPES = ("horizontal", "vertical", "diagonal", "anti-diagonal", "square", "cross")


def make_shapes(n, size=16, seed=0, noise=0.35):
    """``n`` noisy images of the six shapes, ``(images [n, 1, size, size], labels [n])``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(len(SHAPES), (n,), generator=g)
    images = torch.zeros(n, size, size)
    lo, hi = 3, size - 4
    for i in range(n):
        r, c = torch.randint(lo, hi, (2,), generator=g).tolist()
        half = int(torch.randint(2, 4, (1,), generator=g))
        img = images[i]
        kind = int(labels[i])
        if kind == 0:
            img[r, c - half:c + half + 1] = 1
        elif kind == 1:
            img[r - half:r + half + 1, c] = 1
        elif kind in (2, 3):
            for t in range(-half, half + 1):
                img[r + t, c + (t if kind == 2 else -t)] = 1
        elif kind == 4:
            img[r - half, c - half:c + half + 1] = 1
            img[r + half, c - half:c + half + 1] = 1
            img[r - half:r + half + 1, c - half] = 1
            img[r - half:r + half + 1, c + half] = 1
        else:
            img[r, c - half:c + half + 1] = 1
            img[r - half:r + half + 1, c] = 1
    images += noise * torch.randn(n, size, size, generator=g)
    return images.unsqueeze(1), labels


class CNN(nn.Module):
    """conv-relu-pool twice, then two linear layers."""

    def __init__(self, width=32, classes=len(SHAPES)):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width // 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width // 2, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(width * 16, 4 * width),
                                        nn.ReLU(), nn.Linear(4 * width, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def make_hook(name, comm, args=None):
    """``(state, hook)`` for ``--hook`` (``args``: ``--ratio``, ``--bits``, error feedback)."""
    ef = args is None or not args.no_error_feedback
    mom = hook_momentum(name, args)
    if name == "topk":
        return (compression.TopKState(comm, ratio=args.ratio if args else 0.01,
                                      error_feedback=ef, momentum=mom), compression.topk_hook)
    if name == "sign":
        return (compression.SignState(comm, error_feedback=ef, momentum=mom),
                compression.sign_hook)
    if name == "qsgd":
        return (compression.QSGDState(comm, bits=args.bits if args else 4, error_feedback=ef,
                                      momentum=mom), compression.qsgd_hook)
    algorithm = getattr(args, "algorithm", "auto")  # --algorithm: the hook's allreduce too
    if name == "allreduce":
        return hooks.DefaultState(comm, algorithm), hooks.allreduce_hook
    if name == "fp16":
        return hooks.DefaultState(comm, algorithm), hooks.fp16_compress_hook
    if name == "bf16":
        return hooks.DefaultState(comm, algorithm), hooks.bf16_compress_hook
    state = hooks.PowerSGDState(comm, matrix_approximation_rank=2, start_powerSGD_iter=10)
    return state, hooks.powerSGD_hook


def hook_momentum(name, args) -> float:
    """The momentum a compressing hook applies before compressing (the optimizer then has
    none): ``--momentum`` for topk, sign and qsgd unless ``--optimizer-momentum``."""
    if args is None or name not in COMPRESSING or args.optimizer_momentum:
        return 0.0
    return args.momentum


def progress(iterable, total, enabled, desc):
    """A tqdm bar on rank 0 when stderr is a terminal; the plain iterable otherwise."""
    if enabled and sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            return iterable
        return tqdm(iterable, total=total, desc=desc, leave=False, unit="step")
    return iterable


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=4608, help="training images (4608)")
    p.add_argument("--batch", type=int, default=32, help="images per rank and step (32)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--width", type=int, default=32, help="CNN channels (32)")
    p.add_argument("--hook", choices=("allreduce", "fp16", "bf16", "powersgd", "topk", "sign",
                                      "qsgd"), default="allreduce")
    p.add_argument("--ratio", type=float, default=0.01, help="topk: fraction sent (0.01)")
    p.add_argument("--bits", type=int, default=4, help="qsgd: bits per level (4)")
    p.add_argument("--no-error-feedback", action="store_true",
                   help="topk, sign, qsgd: drop what compression leaves out")
    p.add_argument("--optimizer-momentum", action="store_true",
                   help="topk, sign, qsgd: momentum in the optimizer, on the decompressed "
                        "average, instead of in the hook before compression")
    p.add_argument("--bucket-cap-mb", type=float, default=0.1,
                   help="bucket cap (0.1 MB: this small model still gets two buckets)")
    p.add_argument("--algorithm", default="auto",
                   choices=("auto",) + coll.algorithms("allreduce"),
                   help="the buckets' allreduce algorithm (auto)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # No core to spare for a progress thread per rank: DDP's gradient hooks move the bytes.
    # auto (None) leaves the choice to us; an explicit on/off from the environment stands.
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if config.get("COLLECTIVES_PROGRESS_THREAD") is None and \
            node.Get_size() * args.threads >= len(os.sched_getaffinity(0)):
        config.set("COLLECTIVES_PROGRESS_THREAD", "off")
    node.Free()
    driver = "progress thread" if use_thread() \
        else "gradient hooks (no progress thread)"
    images, labels = make_shapes(args.samples, seed=0)
    test_images, test_labels = make_shapes(1024, seed=1)

    torch.manual_seed(0)
    module = CNN(args.width)
    model = DistributedDataParallel(module, comm=comm, bucket_cap_mb=args.bucket_cap_mb,
                                    algorithm=args.algorithm,
                                    comm_hook=make_hook(args.hook, comm, args))
    # A compressing hook applies the momentum itself, before compressing (hook_momentum).
    opt = torch.optim.SGD(model.parameters(), lr=args.lr,
                          momentum=args.momentum - hook_momentum(args.hook, args))
    n_params = sum(q.numel() for q in module.parameters())
    grad_bytes = sum(q.numel() * q.element_size() for q in module.parameters())
    global_batch = args.batch * size
    steps = args.samples // global_batch
    if rank == 0:
        print(f"train_ddp: {size} ranks, CNN of {n_params / 1e3:.1f}k parameters, "
              f"{args.samples} images, batch {args.batch} per rank ({global_batch} global), "
              f"{steps} steps per epoch, {len(model.bucket_layout())} gradient buckets, "
              f"hook {args.hook}, communication driven by the {driver}", flush=True)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(epoch))
        sums = torch.zeros(2, dtype=torch.float64)  # [loss * samples, samples] of this rank
        t0 = time.perf_counter()
        bar = progress(range(steps), steps, rank == 0 and not args.no_progress,
                       f"epoch {epoch + 1}")
        for step in bar:
            batch = order[step * global_batch:(step + 1) * global_batch]
            mine = batch[rank * args.batch:(rank + 1) * args.batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(images[mine]), labels[mine])
            loss.backward()
            opt.step()
            sums += torch.tensor([loss.item() * len(mine), len(mine)], dtype=torch.float64)
        all_reduce(sums, comm=comm)
        elapsed = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            shard = slice(rank * len(test_images) // size, (rank + 1) * len(test_images) // size)
            pred = model(test_images[shard]).argmax(1)
            correct = torch.tensor([(pred == test_labels[shard]).sum().item(),
                                    pred.numel()], dtype=torch.float64)
        all_reduce(correct, comm=comm)
        stats = model.stats
        if rank == 0:
            print(f"epoch {epoch + 1}  loss {sums[0] / sums[1]:.4f}  "
                  f"test accuracy {100 * correct[0] / correct[1]:.1f}%  "
                  f"{steps * global_batch / elapsed:.0f} samples/s  "
                  f"communication hidden {100 * stats.hidden_fraction():.0f}%", flush=True)
    stats = model.stats
    if rank == 0:
        per_step = stats.wire_bytes / max(stats.steps, 1)
        line = (f"done in {time.perf_counter() - start:.1f} s; the {args.hook} hook put "
                f"{per_step / 1e3:.1f} kB per step on the wire per rank")
        if args.hook != "allreduce" and per_step > 0:
            line += (f" ({grad_bytes / per_step:.1f}x fewer than the {grad_bytes / 1e3:.1f} kB "
                     f"of float32 gradients)")
        print(line, flush=True)


if __name__ == "__main__":
    main()
