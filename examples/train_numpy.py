"""Data-parallel logistic regression in numpy, gradients averaged with ``collectives.allreduce``.

    mpiexec -n 3 python examples/train_numpy.py            # each rank trains on its shard
    python examples/train_numpy.py                          # one process, the whole batch

Every rank generates the same synthetic data set (seeded), takes its shard of each batch,
computes the gradient of the mean loss on that shard, and the ranks average the gradients,
weighted by shard size, with one allreduce per step. The loss printed each epoch matches the
single-process run to float64 rounding (the final line prints the difference to a reference
computed on rank 0 alone with the whole batch).
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import collectives as coll


def make_data(n, d, seed=0):
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal(d)
    X = rng.standard_normal((n, d))
    y = (X @ w_true + 0.5 * rng.standard_normal(n) > 0).astype(np.float64)
    return X, y


def loss_and_grad(w, X, y):
    """Sum (not mean) of the logistic loss over the rows, and its gradient."""
    z = X @ w
    p = 1.0 / (1.0 + np.exp(-z))
    eps = 1e-12
    loss = -np.sum(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps))
    return loss, X.T @ (p - y)


def train(X, y, *, epochs, batch, lr, comm=None, algorithm="auto"):
    """SGD on shards of each batch; returns the loss of each epoch (the same on every rank)."""
    rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    w = np.zeros(X.shape[1])
    acc = np.empty(X.shape[1] + 2)  # [grad..., loss, rows]: one allreduce per step
    losses = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, len(X), batch):
            rows = np.array_split(np.arange(start, min(start + batch, len(X))), size)[rank]
            loss, grad = loss_and_grad(w, X[rows], y[rows])
            acc[:-2], acc[-2], acc[-1] = grad, loss, len(rows)
            if comm is not None:
                coll.allreduce(acc, "sum", out=acc, comm=comm, algorithm=algorithm)
            w -= lr * acc[:-2] / acc[-1]
            total += acc[-2]
        losses.append(total / len(X))
    return w, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--algorithm", default="auto", help="allreduce algorithm (default auto)")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    X, y = make_data(args.samples, args.features)
    t0 = time.perf_counter()
    w, losses = train(X, y, epochs=args.epochs, batch=args.batch, lr=args.lr, comm=comm,
                      algorithm=args.algorithm)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        for e, loss in enumerate(losses):
            print(f"epoch {e + 1}: loss {loss:.6f}")
        w1, ref = train(X, y, epochs=args.epochs, batch=args.batch, lr=args.lr)
        diff = max(abs(a - b) for a, b in zip(losses, ref))
        print(f"{size} ranks, {elapsed:.2f} s; single-process reference loss {ref[-1]:.6f}; "
              f"max loss difference {diff:.2e}; max weight difference "
              f"{np.max(np.abs(w - w1)):.2e}")
        if diff > 1e-9:
            raise SystemExit("data-parallel run diverged from the single-process run")


if __name__ == "__main__":
    main()
